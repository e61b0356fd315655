"""`cutlass_w8a8.generate` / `GraphGenerator` on a GPU with CUDA graphs, on tiny optimized W8A8 transformers models
(tests/_hf_tiny.py): each decode step's logits replayed from the bucket's graph equal the same steps run eagerly
bit for bit (the capture records the eager kernels), and the greedy tokens agree with ``model.generate``'s with a
``StaticCache`` of the same length (`_check_greedy_against_transformers`: equal tokens on equal prefixes except where
the reference's logits have a near-tie within the measured logit difference of the two paths, that difference
itself bounded). Skips without a GPU and the compiled extension (conftest's ``cuda`` marker)."""

import pytest
import torch

import cutlass_w8a8 as cw

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from _hf_tiny import quantized, rel_err, tiny_model  # noqa: E402

from cutlass_w8a8.hf import GraphGenerator, optimize_  # noqa: E402

pytestmark = pytest.mark.cuda

CACHE = 64
NEW = 12
SCHEMES = ["int8", "fp8", pytest.param("fp8-block", marks=pytest.mark.sm90)]
# Our decode step and transformers' compute the same function with other roundings on the GPU (the batch padded
# to its bucket, 4 rows instead of 3, can pick other GEMM / lm_head kernels; another 4-D mask construction; an
# 8-bit activation level flipped by a bf16 rounding), so their logits on the same prefix differ by bf16 noise and
# the tiny random models' frequent near-ties (logits ~0.7, bf16 ulp 2^-8, many exact ties) flip greedy tokens.
# Bound on ||ours - reference|| / ||reference|| of one row's logits on the same prefix: measured on the CPU up to
# 4.9e-2 between the `sdpa` and `eager` attention paths of these models (expected larger than the GPU's
# roundings; not measured on a GPU), while a decode step with the padding keys visible, its own key masked or its
# positions not advanced measured 0.15 and more there (with QK_GAIN).
LOGITS_REL_TOL = 0.1
# The greedy test's q / k projections are scaled by this: transformers' init (std 0.02) gives Llama near-uniform
# attention that hardly sees positions (a decode step that does not advance the positions moved its logits by
# <= 3e-2 relative, under LOGITS_REL_TOL); x4 makes that bug move them by 0.15 - 0.43. (Qwen3's q / k norms undo
# the gain: it sees positions already.)
QK_GAIN = 4.0
# Fewest (row, step) token comparisons on equal prefixes the greedy test must make over its 3 rows.
MIN_CHECKED = NEW // 2


def _model(kind, scheme, attn="sdpa", qk_gain=1.0, device="cuda"):
    """The tiny model ``kind``, its q and k projections' weights times ``qk_gain`` (before quantization), W8A8
    ``scheme``, optimized, on ``device``."""
    if device == "cuda" and scheme != "int8" and not cw.supports_fp8():
        pytest.skip("no fp8 kernels on this device")
    base = tiny_model(kind, attn=attn)
    if qk_gain != 1.0:
        with torch.no_grad():
            for name, p in base.named_parameters():
                if name.endswith(("q_proj.weight", "k_proj.weight")):
                    p.mul_(qk_gain)
    return optimize_(quantized(base, scheme).to(device))


def _batch(b=3, length=7, seed=0, device="cuda"):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 256, (b, length), generator=g)
    am = torch.ones_like(ids)
    am[1, :3] = 0
    am[2, :1] = 0
    return ids.masked_fill(am == 0, 0).to(device), am.to(device)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_graph_replay_equals_eager_steps(kind, scheme, attn):
    model = _model(kind, scheme, attn)
    ids, am = _batch()
    graphed = GraphGenerator(model, max_cache_len=CACHE)
    eager = GraphGenerator(model, max_cache_len=CACHE, use_graphs=False)
    assert graphed.use_graphs
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


def _check_greedy_against_transformers(ours, ours_logits, ref, length):
    """Our greedy tokens against transformers', row by row, while the prefixes are equal.

    ``ours``: ``(B, L + NEW)`` tokens with ``ours_logits`` (``NEW`` ``(B, V)`` float32 logits that picked them,
    `GraphGenerator.logits_history`); ``ref``: ``model.generate(..., output_logits=True,
    return_dict_in_generate=True)`` (``ref.logits``: the raw, unprocessed logits of each step). At each step of a
    row whose tokens so far are equal (so both paths saw the same prefix):

    - each path's token is the argmax of its own logits (greedy picks what its logits say);
    - the two logit rows differ by at most ``LOGITS_REL_TOL`` (relative, Frobenius): a wrong mask / position /
      cache column / logits row fails here;
    - the tokens are equal, or, where they differ, the reference prefers its token over ours by at most
      ``2 * d``, ``d`` the largest |logit difference| of the two paths at this step: a near-tie that bf16 noise of
      that size can flip. Any larger gap is a wrong token. The row is then not compared further (the prefixes
      differ).

    Returns the number of (row, step) pairs whose tokens were compared equal on equal prefixes."""
    assert ref.sequences.shape == ours.shape
    assert len(ours_logits) == len(ref.logits) == ours.shape[1] - length
    checked = 0
    for r in range(ours.shape[0]):
        assert torch.equal(ours[r, :length], ref.sequences[r, :length])
        for i in range(ours.shape[1] - length):
            o, w = ours_logits[i][r].double(), ref.logits[i][r].double()
            t_o, t_w = int(ours[r, length + i]), int(ref.sequences[r, length + i])
            where = f"row {r} step {i}"
            assert o[t_o] == o.max(), f"{where}: our token {t_o} is not the argmax of our logits"
            assert w[t_w] == w.max(), f"{where}: transformers' token {t_w} is not the argmax of its logits"
            err = rel_err(o, w)
            assert err <= LOGITS_REL_TOL, f"{where}: logits differ from transformers' by {err:.3e} (relative)"
            if t_o == t_w:
                checked += 1
                continue
            d, gap = float((o - w).abs().max()), float(w[t_w] - w[t_o])
            assert gap <= 2 * d, (f"{where}: token {t_o} instead of transformers' {t_w}, whose logit is ahead by "
                                  f"{gap:.3e} > 2 x the paths' max |logit difference| {d:.3e}")
            break
    return checked


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_greedy_tokens_equal_transformers(kind, scheme):
    _greedy_case(kind, scheme, "cuda")


def _greedy_case(kind, scheme, device):
    """The body of `test_greedy_tokens_equal_transformers` (``device`` "cpu": the same steps eagerly, where the
    tokens also equal exactly; how this check was validated without a GPU)."""
    model = _model(kind, scheme, qk_gain=QK_GAIN, device=device)
    ids, am = _batch(device=device)
    ours = cw.generate(model, ids, NEW, attention_mask=am, max_cache_len=CACHE)
    gen = model.__dict__["_cw_graph_generator"]
    assert gen.use_graphs == (device == "cuda")
    gen.record_logits = True  # the same generator and graphs again, keeping the logits
    assert torch.equal(cw.generate(model, ids, NEW, attention_mask=am), ours)
    cache = transformers.StaticCache(config=model.config, max_cache_len=CACHE)
    ref = model.generate(ids, attention_mask=am, past_key_values=cache, max_new_tokens=NEW, do_sample=False,
                         output_logits=True, return_dict_in_generate=True)
    checked = _check_greedy_against_transformers(ours, gen.logits_history, ref, ids.shape[1])
    assert checked >= MIN_CHECKED, f"only {checked} token steps compared on equal prefixes"
    return ours, ref


def test_batch_above_the_buckets_gets_its_own_graph():
    model = _model("llama", "int8")
    ids = torch.randint(2, 256, (3, 5), generator=torch.Generator().manual_seed(2)).cuda()
    gen = GraphGenerator(model, max_cache_len=CACHE, max_batch=2)
    assert gen.bucket_size(3) == 3
    eager = GraphGenerator(model, max_cache_len=CACHE, use_graphs=False, max_batch=2)
    assert torch.equal(gen.generate(ids, 6), eager.generate(ids, 6))
    assert gen._buckets[3].graph is not None
