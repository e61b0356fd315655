"""`cutlass_w8a8.generate` / `GraphGenerator` on a GPU with CUDA graphs, on tiny optimized W8A8 transformers models
(tests/_hf_tiny.py) and tiny quantized MoE models of several families (tests/_moe_models.py: Qwen3-MoE, Mixtral,
DeepSeek-V3, GLM-4.5, OLMoE; the transformers step captured): each decode step's logits replayed from the bucket's graph equal the same steps run eagerly
bit for bit (the capture records the eager kernels), and the greedy tokens agree with ``model.generate``'s with a
``StaticCache`` of the same length (`_hf_tiny.check_greedy_against_transformers`: equal tokens on equal prefixes except where
the reference's logits have a near-tie within the measured logit difference of the two paths, that difference
itself bounded; on the MoE models also equal expert selections, except at a near-tie of a router, which ends the
row's comparison as a token flip does: `_hf_tiny.routing_flip`). Skips without a GPU and the compiled extension
(conftest's ``cuda`` marker)."""

import pytest
import torch

import cutlass_w8a8 as cw

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from _hf_tiny import (MIN_CHECKED, QK_GAIN, RoutingRecorder, check_greedy_against_transformers,  # noqa: E402
                      left_padded_batch, optimized)

from cutlass_w8a8.hf import GraphGenerator  # noqa: E402

pytestmark = pytest.mark.cuda

CACHE = 64
NEW = 12
SCHEMES = ["int8", "fp8", pytest.param("fp8-block", marks=pytest.mark.sm90)]


def _model(kind, scheme, attn="sdpa", qk_gain=1.0, device="cuda"):
    """`_hf_tiny.optimized` (W8A8 ``scheme``, q / k times ``qk_gain``) on ``device``; skips fp8 where the device
    has no fp8 kernels."""
    if device == "cuda" and scheme != "int8" and not cw.supports_fp8():
        pytest.skip("no fp8 kernels on this device")
    return optimized(kind, scheme, qk_gain=qk_gain, device=device, attn=attn)


def _batch(b=3, length=7, seed=0, device="cuda"):
    return left_padded_batch(b, length, seed, device)


@pytest.mark.parametrize("step,attn", [("cw", "sdpa"), ("transformers", "sdpa"), ("transformers", "eager")])
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_graph_replay_equals_eager_steps(kind, scheme, step, attn):
    model = _model(kind, scheme, attn)
    ids, am = _batch()
    graphed = GraphGenerator(model, max_cache_len=CACHE, step=step)
    eager = GraphGenerator(model, max_cache_len=CACHE, use_graphs=False, step=step)
    assert graphed.use_graphs and graphed.step == eager.step == step
    graphed.record_logits = eager.record_logits = True
    out_g = graphed.generate(ids, NEW, attention_mask=am)
    assert graphed._buckets[4].graph is not None and 4 in graphed.warmup_seconds
    out_e = eager.generate(ids, NEW, attention_mask=am)
    assert torch.equal(out_g, out_e)
    assert len(graphed.logits_history) == len(eager.logits_history) == NEW
    for i, (g, e) in enumerate(zip(graphed.logits_history, eager.logits_history)):
        assert torch.equal(g, e), f"step {i}"
    # a second call replays the same graphs on new prompts
    ids2, am2 = _batch(seed=1)
    assert torch.equal(graphed.generate(ids2, NEW, attention_mask=am2), eager.generate(ids2, NEW, attention_mask=am2))


@pytest.mark.parametrize("step", ["cw", "transformers"])
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen2"])
def test_greedy_tokens_equal_transformers(kind, scheme, step):
    _greedy_case(kind, scheme, "cuda", step)


def _greedy_case(kind, scheme, device, step="auto"):
    """The body of `test_greedy_tokens_equal_transformers` (``device`` "cpu": the same steps eagerly; how this
    check was validated without a GPU)."""
    model = _model(kind, scheme, qk_gain=QK_GAIN, device=device)
    ids, am = _batch(device=device)
    ours = cw.generate(model, ids, NEW, attention_mask=am, max_cache_len=CACHE, step=step)
    gen = model.__dict__["_cw_graph_generator"]
    assert gen.use_graphs == (device == "cuda")
    assert gen.step == ("cw" if step == "auto" else step)
    gen.record_logits = True  # the same generator and graphs again, keeping the logits
    assert torch.equal(cw.generate(model, ids, NEW, attention_mask=am, step=step), ours)
    cache = transformers.StaticCache(config=model.config, max_cache_len=CACHE)
    ref = model.generate(ids, attention_mask=am, past_key_values=cache, max_new_tokens=NEW, do_sample=False,
                         output_logits=True, return_dict_in_generate=True)
    checked = check_greedy_against_transformers(ours, gen.logits_history, ref, ids.shape[1], scheme=scheme)
    assert checked >= MIN_CHECKED, f"only {checked} token steps compared on equal prefixes"
    return ours, ref


# The MoE families of cutlass_w8a8.moe.families with a GPU run of their own: the first rows, and the block-fp8 families
# of issue 35 (DeepSeek-V3 with MLA, grouped sigmoid routing, a correction bias and a shared expert; GLM-4.5; OLMoE).
MOE_KINDS = ["qwen3_moe", "mixtral", "deepseek_v3", "glm4_moe", "olmoe"]


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("kind", MOE_KINDS)
def test_moe_families_greedy_tokens_equal_transformers(kind, scheme):
    _moe_greedy_case(kind, scheme, "cuda")


def _moe_model(kind, scheme, device, qk_gain=1.0, **overrides):
    """tests/_moe_models.py's tiny ``kind`` (bf16, sdpa; ``overrides`` set on its config), its q and k projections'
    weights times ``qk_gain`` (`_hf_tiny.QK_GAIN`: attention that sees positions), ``quantize_``d with ``scheme``
    (``lm_head`` left in bf16: experts W8A8MoE, the router float, attention / MLA / shared experts W8A8Linear), on
    ``device``. With an ``attention_bias`` override, the projection biases, which transformers initialises to 0, are
    drawn as ``0.05 N(0, 1)``."""
    import warnings

    from _hf_tiny import SCHEMES as CONFIGS
    from _moe_models import tiny_moe_model

    if device == "cuda" and scheme != "int8" and not cw.supports_fp8():
        pytest.skip("no fp8 kernels on this device")
    model = tiny_moe_model(kind, **overrides)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if overrides.get("attention_bias") and name.endswith("proj.bias"):
                p.copy_((0.05 * torch.randn(p.shape, generator=gen)).to(p.dtype))
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(qk_gain)
    model = model.to(device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a shared expert's gate (N = 1) stays in float
        cw.quantize_(model, CONFIGS[scheme], filter_fn=lambda m, fqn: fqn != "lm_head")
    assert any(isinstance(m, cw.W8A8MoE) for m in model.modules())
    return model


def _moe_greedy_case(kind, scheme, device):
    """`cw.generate` with the transformers step captured (the MoE blocks run their W8A8MoE inside the graph, routed
    by their own float routers) against ``model.generate`` with a ``StaticCache`` of the same length, as
    `_greedy_case` (``device`` "cpu": the same steps eagerly), with both paths' routing compared
    (`_hf_tiny.routing_flip`: a step whose expert selections differ at some block must be a near-tie of that
    block's router, and ends the row's comparison, as a token flip does).

    The reference runs eagerly (``disable_compile=True``: on CUDA, transformers' ``generate`` would otherwise
    ``torch.compile`` its decode steps for a ``StaticCache``), its routing recorded by forward hooks on the routers
    (`_hf_tiny.RoutingRecorder`); ours by `_our_routing`."""
    model = _moe_model(kind, scheme, device)
    ids, am = _batch(device=device)
    ours = cw.generate(model, ids, NEW, attention_mask=am, max_cache_len=CACHE, step="transformers", pad_token_id=0)
    gen = model.__dict__["_cw_graph_generator"]
    assert gen.use_graphs == (device == "cuda") and gen.step == "transformers"
    gen.record_logits = True  # the same generator and graphs again, keeping the logits
    assert torch.equal(cw.generate(model, ids, NEW, attention_mask=am, step="transformers", pad_token_id=0), ours)
    ours_routing = _our_routing(model, ids, am, ours, gen.logits_history)
    return ours, _check_routed_against_transformers(model, ids, am, ours, gen.logits_history, ours_routing, scheme)


def _check_routed_against_transformers(model, ids, am, ours, logits_history, ours_routing, scheme):
    """``model.generate`` (eager: ``disable_compile=True``) with a ``StaticCache`` of the same length, its routing
    recorded by forward hooks on the routers (`_hf_tiny.RoutingRecorder`), against our tokens ``ours``, their logits
    and routing (`_hf_tiny.check_greedy_against_transformers`, at least ``MIN_CHECKED`` token steps compared on equal
    prefixes). Returns the reference's output."""
    cache = transformers.StaticCache(config=model.config, max_cache_len=CACHE)
    with RoutingRecorder(model, batch=ids.shape[0]) as rec:
        ref = model.generate(ids, attention_mask=am, past_key_values=cache, max_new_tokens=NEW, do_sample=False,
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True, disable_compile=True)
    checked = check_greedy_against_transformers(ours, logits_history, ref, ids.shape[1], scheme=scheme,
                                                routing=(ours_routing, rec.steps()), attention_mask=am)
    assert checked >= MIN_CHECKED, f"only {checked} token steps compared on equal prefixes"
    return ref


def _our_routing(model, ids, am, ours, logits_history):
    """The routing of our path's steps (`_hf_tiny.RoutingRecorder.steps`: per new token, per MoE block), which
    forward hooks cannot record from the graphs (a replay runs the captured kernels, no Python): the same steps run
    again eagerly, with hooks on the routers, by a `GraphGenerator` with ``use_graphs=False`` fed our tokens
    (teacher-forced, `GraphGenerator.prefill` / `GraphGenerator.decode`). It pads the batch to the same bucket and
    builds the same StaticCache and 4-D mask, so each step is the eager step the capture recorded: its logits
    equal the replayed ones (``logits_history``) bit for bit, which this asserts, so the routing it records is the
    graph's. (A teacher-forced forward of the whole prefix would not do: other shapes, B x (L + i) tokens in one
    call, run other GEMM tiles and attention kernels, so other roundings, and a near-tie of the router could fall
    the other way than in our decode step.)"""
    eager = GraphGenerator(model, max_cache_len=CACHE, use_graphs=False, step="transformers")
    length = ids.shape[1]
    with RoutingRecorder(model, batch=eager.bucket_size(ids.shape[0])) as rec:
        logits = [eager.prefill(ids, attention_mask=am, pad_token_id=0).float()]
        for i in range(1, len(logits_history)):
            logits.append(eager.decode(ours[:, length + i - 1]).float())
    for i, (e, g) in enumerate(zip(logits, logits_history)):
        assert torch.equal(e, g), (f"step {i}: the eager re-run of our decode step differs from the graph's logits "
                                   f"by {float((e - g).abs().max()):.3e} (max abs): its routing is not the graph's")
    return rec.steps()


def test_batch_above_the_buckets_gets_its_own_graph():
    model = _model("llama", "int8")
    ids = torch.randint(2, 256, (3, 5), generator=torch.Generator().manual_seed(2)).cuda()
    gen = GraphGenerator(model, max_cache_len=CACHE, max_batch=2)
    assert gen.bucket_size(3) == 3
    eager = GraphGenerator(model, max_cache_len=CACHE, use_graphs=False, max_batch=2)
    assert torch.equal(gen.generate(ids, 6), eager.generate(ids, 6))
    assert gen._buckets[3].graph is not None


# ---- the "cw" step (hf.DecodeStep) on MoE models ------------------------------------------------------------------
# The MoE families whose layers DecodeStep runs (cutlass_w8a8.hf.decode_step.MOE_FAMILIES with an attention optimize_
# fuses): Qwen3-MoE (per-head q / k norms), Mixtral, Qwen2-MoE (q / k / v bias, a shared expert times its sigmoid gate),
# GLM-4.5 (q / k / v bias, partial rotary: R = 32 of head_dim 64, a dense first layer, sigmoid routing with a
# correction bias and routed_scaling_factor from a float32 router, a shared expert without gate).
MOE_CW_KINDS = ["qwen3_moe", "mixtral", "qwen2_moe", "glm4_moe"]
# `_moe_model` arguments of the "cw" cases: GLM-4.5 / 4.6's checkpoints have q / k / v biases (attention_bias True;
# its tiny config's partial_rotary_factor is transformers' default 0.5, the real models'); QK_GAIN makes the tiny
# model's attention see positions (at transformers' init it hardly does: a rotary table pairing the features
# (x[j], x[j + D/2]) instead of GLM's (x[j], x[j + R/2]) passed the teacher-forced bound without it, and fails it
# with it)
MOE_CW_OVERRIDES = {"glm4_moe": dict(attention_bias=True, qk_gain=QK_GAIN)}


def _moe_optimized(kind, scheme, device):
    """`_moe_model` (with `MOE_CW_OVERRIDES`) `optimize_`d: the attention, the dense MLPs and the shared experts
    fused, the MoE blocks' routers and W8A8MoE experts as they were."""
    import warnings

    from cutlass_w8a8.hf import DecodeStep, optimize_

    model = _moe_model(kind, scheme, device, **MOE_CW_OVERRIDES.get(kind, {}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        optimize_(model)
    assert DecodeStep.why_not(model) is None
    return model


def _cw_routers(gen):
    """``{block name: (experts module, adapter)}`` of a "cw" `GraphGenerator`'s decode step (the names
    `RoutingRecorder` uses): each MoeMLP's experts are called ``experts(x, topk_ids, topk_weights)`` with the routing
    whichever op computed it (its `MoeRouter`, or at decode sizes on CUDA moe_router_route, which computes no logits
    tensor); the recorded logits are ``gate.logits(x)``, the router's (the fused op's within its
    summation-order bound, ops/moe.py moe_router_route). The experts module is the transformers block's own, so
    only its calls inside a MoeMLP forward (DecodeStep's, flagged by hooks on the MoeMLP) are recorded."""
    from cutlass_w8a8.hf.decode_step import MoeMLP

    def adapter(mlp):
        inside = [False]
        mlp.register_forward_pre_hook(lambda m, args: inside.__setitem__(0, True))
        mlp.register_forward_hook(lambda m, args, out: inside.__setitem__(0, False))
        gate = mlp.gate
        return lambda args, out: (gate.logits(args[0]), args[2], args[1]) if inside[0] else None

    return {f"model.layers.{i}.mlp": (layer.mlp.experts, adapter(layer.mlp))
            for i, layer in enumerate(gen._cw.layers) if isinstance(layer.mlp, MoeMLP)}


def _teacher_forced(model, ids, am, tokens, step):
    """Logits and routing of ``step``'s path fed ``tokens`` ``(B, n)`` after the prompts, eagerly: ``([(B, V) float32
    logits of the prefill, then of each decode step], [per forward: one LayerRouting per MoE block])``. The prefill is
    transformers' forward on either path (its routers recorded; the "cw" path's prefill fills a DynamicCache, the other
    a StaticCache with its mask: not the same arithmetic bit for bit); the "cw" path's decode steps run DecodeStep (its
    MoeRouters recorded)."""
    import contextlib

    gen = GraphGenerator(model, max_cache_len=CACHE, use_graphs=False, step=step)
    assert gen.step == step
    bucket = gen.bucket_size(ids.shape[0])
    ours = RoutingRecorder(model, bucket, routers=_cw_routers(gen)) if step == "cw" else contextlib.nullcontext()
    with RoutingRecorder(model, bucket) as rec, ours as rec_cw:
        logits = [gen.prefill(ids, attention_mask=am, pad_token_id=0).float()]
        for i in range(tokens.shape[1]):
            logits.append(gen.decode(tokens[:, i]).float())
    routing = rec.steps() + (rec_cw.steps() if step == "cw" else [])
    assert len(routing) == len(logits)
    return logits, routing


def _moe_cw_teacher_forced_case(kind, scheme, device, steps=NEW):
    """DecodeStep's eager steps against the model's own (transformers) steps on the same prefixes: both fed the
    same tokens (random, teacher-forced), each step's logits rows within ``_hf_tiny.logits_rel_tol(scheme)``
    (relative), as the greedy check bounds them, except that a row whose expert selections differ at some block (a
    router near-tie, checked by `_hf_tiny.routing_flip`) is not compared from that step on. Returns the (row, step)
    pairs compared."""
    from _hf_tiny import logits_rel_tol, rel_err, routing_flip

    model = _moe_optimized(kind, scheme, device)
    ids, am = _batch(device=device)
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(2, 512, (ids.shape[0], steps - 1), generator=g).to(device)
    ours, ours_routing = _teacher_forced(model, ids, am, tokens, "cw")
    ref, ref_routing = _teacher_forced(model, ids, am, tokens, "transformers")
    tol = logits_rel_tol(scheme)
    compared = 0
    for r in range(ids.shape[0]):
        for i in range(steps):
            where = f"row {r} step {i}"
            positions = ([int(p) for p in torch.nonzero(am[r]).flatten()] if i == 0
                         else list(range(ref_routing[i][0].ids.shape[1])))
            if routing_flip(ours_routing[i], ref_routing[i], r, positions, where, scheme=scheme):
                break
            err = rel_err(ours[i][r], ref[i][r])
            assert err <= tol, f"{where}: logits differ from transformers' by {err:.3e} (relative) > {tol:.3g}"
            compared += i > 0
    assert compared >= MIN_CHECKED, f"only {compared} decode steps compared on equal routings"
    return compared


def _moe_cw_greedy_case(kind, scheme, device):
    """`cw.generate` with ``step="auto"`` (which picks DecodeStep) against ``model.generate`` with a ``StaticCache``,
    as `_moe_greedy_case`, both paths' routing compared (ours from an eager re-run of our steps, whose logits equal
    the generator's bit for bit)."""
    model = _moe_optimized(kind, scheme, device)
    ids, am = _batch(device=device)
    ours = cw.generate(model, ids, NEW, attention_mask=am, max_cache_len=CACHE, pad_token_id=0)
    gen = model.__dict__["_cw_graph_generator"]
    assert gen.use_graphs == (device == "cuda") and gen.step == "cw" and gen.step_reason is None
    gen.record_logits = True
    assert torch.equal(cw.generate(model, ids, NEW, attention_mask=am, pad_token_id=0), ours)
    eager_logits, ours_routing = _teacher_forced(model, ids, am, ours[:, ids.shape[1]:-1], "cw")
    for i, (e, g) in enumerate(zip(eager_logits, gen.logits_history)):
        assert torch.equal(e[:ids.shape[0]], g.float()), f"step {i}: the eager re-run differs from the generator's"
    return ours, _check_routed_against_transformers(model, ids, am, ours, gen.logits_history, ours_routing, scheme)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("kind", MOE_CW_KINDS)
def test_moe_cw_step_graph_replay_equals_eager(kind, scheme):
    model = _moe_optimized(kind, scheme, "cuda")
    ids, am = _batch()
    graphed = GraphGenerator(model, max_cache_len=CACHE)
    eager = GraphGenerator(model, max_cache_len=CACHE, use_graphs=False)
    assert graphed.use_graphs and graphed.step == eager.step == "cw"
    graphed.record_logits = eager.record_logits = True
    out_g = graphed.generate(ids, NEW, attention_mask=am, pad_token_id=0)
    assert graphed._buckets[4].graph is not None
    out_e = eager.generate(ids, NEW, attention_mask=am, pad_token_id=0)
    assert torch.equal(out_g, out_e)
    for i, (g, e) in enumerate(zip(graphed.logits_history, eager.logits_history)):
        assert torch.equal(g, e), f"step {i}"
    ids2, am2 = _batch(seed=1)
    assert torch.equal(graphed.generate(ids2, NEW, attention_mask=am2, pad_token_id=0),
                       eager.generate(ids2, NEW, attention_mask=am2, pad_token_id=0))


# The GLM-4.5 fp8 case failed once on an H200 (2026-11-30) at the router near-tie bound when it was 0.1 for every
# scheme (router logits 1.016e-01 relative; int8 and fp8-block passed): the e4m3 schemes' bound is now derived,
# 0.1 x their noise ratio to int8 (`_hf_tiny.logits_rel_tol`, about 0.23); awaiting its GPU run (docs/LIMITS.md).
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("kind", MOE_CW_KINDS)
def test_moe_cw_step_teacher_forced_logits(kind, scheme):
    _moe_cw_teacher_forced_case(kind, scheme, "cuda")


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("kind", MOE_CW_KINDS)
def test_moe_cw_step_greedy_tokens_equal_transformers(kind, scheme):
    _moe_cw_greedy_case(kind, scheme, "cuda")
