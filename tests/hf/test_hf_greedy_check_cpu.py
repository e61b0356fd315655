"""The MoE routing rule of the greedy comparison with transformers (tests/_hf_tiny.py: `routing_flip`,
`selection_margin`, `check_greedy_against_transformers` with ``routing``), on synthetic routing records, and
`RoutingRecorder` on the tiny MoE models of the GPU greedy test's families (tests/_moe_models.py).

A step whose expert selections differ between the two paths passes only as a near-tie (the reference's margin
between its last selected and first unselected choice value at most twice the paths' largest |choice value
difference|, at router logits within the scheme's ``logits_rel_tol``), and ends the row's comparison; a selection difference
with a larger margin fails naming the block, row, step and position; where the selections are equal the logits
bound applies as for a dense model."""

import types

import pytest
import torch

from _hf_tiny import (LOGITS_REL_TOL, NOISE_K, NOISE_ROWS, NOISE_SEED, QDQ, SCHEMES, LayerRouting, RoutingRecorder,
                      check_greedy_against_transformers, logits_rel_tol, qdq_float, qdq_int, requant_noise,
                      routing_flip, selection_margin)

LENGTH, NEW, VOCAB = 2, 3, 8
SCHEME = "int8"  # the synthetic records' bound: LOGITS_REL_TOL (`logits_rel_tol`)
TOKENS = (3, 5, 1)  # the reference's new tokens
LAYERS = ("model.layers.0.mlp", "model.layers.1.mlp")


def _logits(step, noise=0.0, lead=None):
    """``(1, VOCAB)`` float32 logits of one step: token ``TOKENS[step]`` ahead (at 3.0; ``lead``: that token
    instead), the others in [-1, 1], plus ``noise`` on every entry."""
    g = torch.Generator().manual_seed(step)
    x = torch.rand(VOCAB, generator=g) * 2 - 1
    x[TOKENS[step] if lead is None else lead] = 3.0
    return (x + noise).unsqueeze(0)


def _paths(ours_logits=None):
    """``(ours, ours_logits, ref)`` of one row: equal prompts, our tokens the argmax of our logits (default: the
    reference's logits plus 1e-3, the same tokens)."""
    ref_logits = [_logits(i) for i in range(NEW)]
    ours_logits = ours_logits or [x + 1e-3 for x in ref_logits]
    prompt = torch.tensor([[7, 4]])
    ref_seq = torch.cat([prompt, torch.tensor([TOKENS])], dim=1)
    ours = torch.cat([prompt, torch.stack([x.argmax(-1) for x in ours_logits], dim=1)], dim=1)
    return ours, ours_logits, types.SimpleNamespace(sequences=ref_seq, logits=ref_logits)


def _layer(name, choice, ids, positions=1, logits=None, groups=(1, 1)):
    """A `LayerRouting` of one row and ``positions`` positions, each with ``choice`` (E,) and ``ids`` (k,); the
    router logits ``10 x choice`` unless given; block ``LAYERS[-1]`` in the last decoder layer."""
    c = torch.tensor(choice, dtype=torch.float32).expand(1, positions, -1).clone()
    z = 10 * c if logits is None else torch.tensor(logits, dtype=torch.float32).expand(1, positions, -1).clone()
    i = torch.tensor(ids, dtype=torch.int64).expand(1, positions, -1).clone()
    return LayerRouting(name, z, c, i, *groups, last_layer=name == LAYERS[-1])


CLEAR = ([0.5, 0.3, 0.1, 0.1], [0, 1])  # experts 0 and 1, a margin of 0.2


def _routing(at=None, ours_layer=None, ref_layer=None, layer=1):
    """``(ours, reference)`` routing records: both select CLEAR at every block and step, except at step ``at``,
    block ``layer``, where ours is ``ours_layer`` and the reference's ``ref_layer`` (``(choice, ids)`` or
    ``(choice, ids, logits)``)."""
    def path(special):
        steps = []
        for i in range(NEW):
            s = LENGTH if i == 0 else 1
            blocks = [_layer(n, *CLEAR, positions=s) for n in LAYERS]
            if i == at and special is not None:
                blocks[layer] = _layer(LAYERS[layer], special[0], special[1], positions=s,
                                       logits=special[2] if len(special) > 2 else None)
            steps.append(blocks)
        return steps
    return path(ours_layer), path(ref_layer)


def test_selection_margin():  # float32 choice values: margins within 1e-6 of the decimal ones
    assert selection_margin(torch.tensor([0.4, 0.3, 0.299, 0.001]), [0, 1]) == pytest.approx(1e-3, abs=1e-6)
    assert selection_margin(torch.tensor([0.4, 0.3, 0.299, 0.001]), [1, 0]) == pytest.approx(1e-3, abs=1e-6)
    assert selection_margin(torch.tensor([0.4, 0.3, 0.3, 0.001]), [0, 2]) == 0  # an exact tie: either is a top-k
    assert selection_margin(torch.tensor([0.4, 0.3, 0.299, 0.001]), [0, 2]) < 0  # not a top-k
    assert selection_margin(torch.tensor([0.4, 0.3]), [0, 1]) == float("inf")  # nothing left out
    # grouped: groups (0-3) and (4-7), one kept; group sums 0.95 and 0.94: half the group margin, 0.005
    c = torch.tensor([0.5, 0.45, 0.1, 0.1, 0.48, 0.46, 0.1, 0.1])
    assert selection_margin(c, [0, 1], 2, 1) == pytest.approx(0.005, abs=1e-6)
    assert selection_margin(c, [0, 4], 2, 1) == float("-inf")  # expert 4's group is not kept
    assert selection_margin(c, [0, 1, 4, 5], 2, 2) == pytest.approx(0.35, abs=1e-6)  # every group kept


def test_equal_routing_keeps_the_logits_bound():
    ours, ol, ref = _paths()
    assert check_greedy_against_transformers(ours, ol, ref, LENGTH, scheme=SCHEME, routing=_routing()) == NEW
    # the same logits difference as a routing flip below, with equal selections: the dense bound fails it
    bad = [_logits(0) + 1e-3, _logits(1) * 1.5, _logits(2)]
    ours, ol, ref = _paths(bad)
    assert float((bad[1] - ref.logits[1]).norm() / ref.logits[1].norm()) > logits_rel_tol(SCHEME)
    with pytest.raises(AssertionError, match=r"row 0 step 1: logits differ from transformers' by"):
        check_greedy_against_transformers(ours, ol, ref, LENGTH, scheme=SCHEME, routing=_routing())
    with pytest.raises(AssertionError, match=r"row 0 step 1: logits differ from transformers' by"):
        check_greedy_against_transformers(ours, ol, ref, LENGTH, scheme=SCHEME)


def _flip_paths():
    """Our logits far from the reference's from step 1 on (another token at step 2): what a flipped expert
    does."""
    return _paths([_logits(0) + 1e-3, _logits(1) * 1.5, _logits(2, lead=6)])


NEAR_TIE = dict(ours_layer=([0.4, 0.2995, 0.2996, 0.001], [0, 2]), ref_layer=([0.4, 0.3, 0.299, 0.001], [0, 1]))


def test_routing_near_tie_flip_passes_and_ends_the_row():
    # margin 1e-3 <= 2 x max |choice difference| 6e-4; router logits 10 x choice: relative difference ~1e-3
    ours, ol, ref = _flip_paths()
    assert check_greedy_against_transformers(ours, ol, ref, LENGTH, scheme=SCHEME,
                                             routing=_routing(at=1, **NEAR_TIE)) == 1
    # an exact tie (the same values on both paths, another top-k tie-break): margin 0 <= 0
    tie = dict(ours_layer=([0.4, 0.3, 0.3, 0.001], [0, 2]), ref_layer=([0.4, 0.3, 0.3, 0.001], [0, 1]))
    assert check_greedy_against_transformers(ours, ol, ref, LENGTH, scheme=SCHEME, routing=_routing(at=1, **tie)) == 1


def test_routing_flip_with_a_large_margin_fails():
    ours, ol, ref = _flip_paths()
    far = dict(ours_layer=([0.5001, 0.3001, 0.1001, 0.1], [0, 2]), ref_layer=(*CLEAR,))
    with pytest.raises(AssertionError, match=r"layer model.layers.1.mlp, row 0 step 1, position 0: experts \[0, 2\] "
                                             r"instead of transformers' \[0, 1\], whose selection leads by a margin "
                                             r"2.000e-01 > 2 x the paths' max \|choice value difference\| 1.000e-04: "
                                             r"not a routing near-tie"):
        check_greedy_against_transformers(ours, ol, ref, LENGTH, scheme=SCHEME, routing=_routing(at=1, **far))


def test_routing_flip_at_router_logits_far_apart_fails():
    ours, ol, ref = _flip_paths()
    ours_layer = (*NEAR_TIE["ours_layer"], [5.2, 3.9, 3.9, 0.0])  # router logits 30 % off the reference's
    for scheme in SCHEMES:  # over every scheme's bound (e4m3's: ~0.23)
        tol = f"{logits_rel_tol(scheme):.3g}"
        with pytest.raises(AssertionError, match=(r"layer model.layers.1.mlp, row 0 step 1, position 0: experts "
                                                  r"\[0, 2\] instead of transformers' \[0, 1\] at router logits that "
                                                  r"differ from transformers' by 3.0\d+e-01 \(relative\) > "
                                                  rf"{tol} \({scheme}\): not rounding noise")):
            check_greedy_against_transformers(ours, ol, ref, LENGTH, scheme=scheme,
                                              routing=_routing(at=1, ours_layer=ours_layer,
                                                               ref_layer=NEAR_TIE["ref_layer"]))


def test_selection_not_a_top_k_of_its_choice_values_fails():
    ours, ol, ref = _flip_paths()
    misread = dict(ours_layer=NEAR_TIE["ref_layer"], ref_layer=([0.4, 0.3, 0.299, 0.001], [0, 3]))
    with pytest.raises(AssertionError, match=r"row 0 step 1, position 0: transformers' experts \[0, 3\] are not a "
                                             r"top-k of its router's choice values"):
        check_greedy_against_transformers(ours, ol, ref, LENGTH, scheme=SCHEME, routing=_routing(at=1, **misread))


def test_only_the_first_flipped_block_is_checked():
    # a near-tie at block 0; block 1 then selects other experts by far (it saw the flip's hidden state)
    ours, ol, ref = _flip_paths()
    rec_o, rec_w = _routing(at=1, layer=0, **NEAR_TIE)
    rec_o[1][1] = _layer(LAYERS[1], [0.1, 0.1, 0.3, 0.5], [2, 3])
    assert check_greedy_against_transformers(ours, ol, ref, LENGTH, scheme=SCHEME, routing=(rec_o, rec_w)) == 1
    # the same selections the other way round: block 0 a far flip fails, named
    rec_o, rec_w = _routing(at=1, layer=0, ours_layer=([0.5001, 0.3001, 0.1001, 0.1], [0, 2]), ref_layer=CLEAR)
    with pytest.raises(AssertionError, match=r"layer model.layers.0.mlp, row 0 step 1, position 0: .* not a routing "
                                             r"near-tie"):
        check_greedy_against_transformers(ours, ol, ref, LENGTH, scheme=SCHEME, routing=(rec_o, rec_w))


def test_grouped_routing_near_tie_of_the_groups():
    # two groups of 4, one kept, top-2: the reference keeps group 0 (sums 0.95 vs 0.94), ours group 1
    ref_c = [0.5, 0.45, 0.1, 0.1, 0.48, 0.46, 0.1, 0.1]
    ours_c = [0.495, 0.449, 0.1, 0.1, 0.485, 0.462, 0.1, 0.1]  # max |difference| 5e-3: margin 0.01 / 2 <= 1e-2
    ours, ol, ref = _flip_paths()
    rec_o, rec_w = _routing()
    rec_o[1][1] = _layer(LAYERS[1], ours_c, [4, 5], groups=(2, 1))
    rec_w[1][1] = _layer(LAYERS[1], ref_c, [0, 1], groups=(2, 1))
    assert check_greedy_against_transformers(ours, ol, ref, LENGTH, scheme=SCHEME, routing=(rec_o, rec_w)) == 1
    # the reference's group 1 far behind (sum 0.5): a group margin of 0.45
    ref_far = [0.5, 0.45, 0.1, 0.1, 0.25, 0.25, 0.1, 0.1]
    ours_far = [0.5, 0.45, 0.1, 0.1, 0.2501, 0.2501, 0.1, 0.1]
    rec_o[1][1] = _layer(LAYERS[1], ours_far, [4, 5], groups=(2, 1))
    rec_w[1][1] = _layer(LAYERS[1], ref_far, [0, 1], groups=(2, 1))
    with pytest.raises(AssertionError, match=r"margin 2.250e-01 > 2 x .* not a routing near-tie"):
        check_greedy_against_transformers(ours, ol, ref, LENGTH, scheme=SCHEME, routing=(rec_o, rec_w))


def test_prefill_compares_the_prompt_positions_only():
    # step 0 (the prefill, 2 positions): a far flip at position 0, which the prompt mask marks as padding (in the
    # last layer: checked where it is a prompt position, though it would not end the row)
    ours, ol, ref = _paths()
    rec_o, rec_w = _routing()
    rec_o[0][1].ids[0, 0] = torch.tensor([2, 3])
    assert check_greedy_against_transformers(ours, ol, ref, LENGTH, scheme=SCHEME, routing=(rec_o, rec_w),
                                             attention_mask=torch.tensor([[0, 1]])) == NEW
    with pytest.raises(AssertionError, match=r"layer model.layers.1.mlp, row 0 step 0, position 0: experts \[2, 3\]"):
        check_greedy_against_transformers(ours, ol, ref, LENGTH, scheme=SCHEME, routing=(rec_o, rec_w),
                                          attention_mask=torch.tensor([[1, 1]]))


def test_last_layer_flip_at_a_prompt_position_does_not_end_the_row():
    # the prefill (2 positions): a near-tie flip at position 0 of the last decoder layer's block reaches no logits
    # compared and no later step; at position 1 (the logits' row) or in block 0, it ends the row
    ours, ol, ref = _paths()
    for layer, position, expected in ((1, 0, NEW), (1, 1, 0), (0, 0, 0)):
        rec_o, rec_w = _routing()
        for rec, (choice, ids) in ((rec_o, NEAR_TIE["ours_layer"]), (rec_w, NEAR_TIE["ref_layer"])):
            rec[0][layer].choice[0, position] = torch.tensor(choice)
            rec[0][layer].logits[0, position] = 10 * torch.tensor(choice)
            rec[0][layer].ids[0, position] = torch.tensor(ids)
        assert check_greedy_against_transformers(ours, ol, ref, LENGTH, scheme=SCHEME,
                                                 routing=(rec_o, rec_w)) == expected
    # checked all the same: a far flip there fails
    rec_o, rec_w = _routing()
    rec_o[0][1].ids[0, 0] = torch.tensor([2, 3])
    with pytest.raises(AssertionError, match=r"layer model.layers.1.mlp, row 0 step 0, position 0: .* not a routing "
                                             r"near-tie"):
        check_greedy_against_transformers(ours, ol, ref, LENGTH, scheme=SCHEME, routing=(rec_o, rec_w))


def test_routing_flip_returns_false_on_equal_selections():
    rec_o, rec_w = _routing()
    assert routing_flip(rec_o[1], rec_w[1], 0, [0], scheme=SCHEME) is False
    rec_o[1][0].ids[0, 0] = torch.tensor([1, 0])  # the same experts in another order
    assert routing_flip(rec_o[1], rec_w[1], 0, [0], scheme=SCHEME) is False


pytest.importorskip("transformers")
import test_hf_generate_graph_cuda as gpu_cases  # noqa: E402  (MOE_KINDS; its tests are collected from its own file)


@pytest.mark.parametrize("kind", gpu_cases.MOE_KINDS)
def test_recorder_reads_the_routers(kind):
    """Each forward's record holds one `LayerRouting` per MoE block of the row's shape; the ids are those the
    block gave its experts, and a top-k of the recorded choice values (grouped top-k included)."""
    from _moe_models import moe_blocks, tiny_moe_model

    model = tiny_moe_model(kind)
    given = []  # top_k_index as each block passed it to its experts

    def pre_hook(module, args, kwargs):
        given.append((args[1] if len(args) > 1 else kwargs["top_k_index"]).clone())

    hooks = [block.experts.register_forward_pre_hook(pre_hook, with_kwargs=True) for _, block in moe_blocks(model)]
    ids = torch.randint(0, 512, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), RoutingRecorder(model, batch=2) as rec:
        model(ids)
        model(ids[:, :1])
    for h in hooks:
        h.remove()
    steps = rec.steps()
    n = len(moe_blocks(model))
    assert len(steps) == 2 and all(len(s) == n for s in steps) and len(given) == 2 * n
    for s, layers in enumerate(steps):
        for j, lr in enumerate(layers):
            e = lr.choice.shape[-1]
            assert lr.ids.shape[:2] == lr.choice.shape[:2] == lr.logits.shape[:2] == (2, 5 if s == 0 else 1)
            assert torch.equal(lr.ids.reshape(-1, lr.ids.shape[-1]), given[s * n + j].to(torch.int64))
            for r in range(2):
                for p in range(lr.ids.shape[1]):
                    assert selection_margin(lr.choice[r, p], lr.ids[r, p], lr.n_group, lr.topk_group) >= 0, \
                        (lr.layer, s, r, p)
            assert e == (16 if kind == "deepseek_v3" else 8)
            assert (lr.n_group, lr.topk_group) == ((4, 2) if kind == "deepseek_v3" else (1, 1))
            assert lr.last_layer == (lr.layer == f"model.layers.{model.config.num_hidden_layers - 1}.mlp")
    assert steps[0][-1].last_layer and steps[0][-1].layer == "model.layers.1.mlp"


# ---- the per-scheme bound (`logits_rel_tol`) ------------------------------------------------------------------------


def _step_ratio():
    """RMS level step of per-token e4m3 over int8 per-token's, on `requant_noise`'s rows (dequantized units): e4m3's
    ``scale 2^(floor(log2 |x / scale|) - 3)`` per element, int8's ``absmax / 127`` per row."""
    x = torch.randn(NOISE_ROWS, NOISE_K, generator=torch.Generator().manual_seed(NOISE_SEED)).bfloat16().float()
    amax = x.abs().amax(-1, keepdim=True)
    scale = amax / torch.finfo(torch.float8_e4m3fn).max
    e4m3 = scale * torch.exp2(torch.floor(torch.log2((x / scale).abs())) - 3)
    return float(e4m3.square().mean().sqrt() / (amax / 127).square().mean().sqrt())


def test_logits_rel_tol_is_the_int8_bound_scaled_by_the_derived_noise_ratio():
    assert set(QDQ) == set(SCHEMES)
    assert logits_rel_tol("int8") == LOGITS_REL_TOL == 0.1
    for scheme in ("fp8", "fp8-block"):
        tol = logits_rel_tol(scheme)
        ratio = requant_noise(QDQ[scheme]) / requant_noise(QDQ["int8"])
        assert tol == pytest.approx(LOGITS_REL_TOL * ratio, rel=1e-12)
        # e4m3's relative level step turns a bf16 ulp into more noise than int8's absolute one: more than 1.5x,
        # less than the ratio of the steps themselves (the noise compounded over many layers, a step's size)
        assert 1.5 * LOGITS_REL_TOL < tol < _step_ratio() * LOGITS_REL_TOL, (scheme, tol, _step_ratio())
    # 1 x 128 groups of a Gaussian row: the same relative steps, nearly the same noise as per-token e4m3
    assert logits_rel_tol("fp8-block") == pytest.approx(logits_rel_tol("fp8"), rel=0.05)


def test_requant_noise_grows_with_the_level_step():
    ints = [requant_noise(lambda x, q=q: qdq_int(x, q)) for q in (127, 63, 31, 15)]
    assert all(a < b for a, b in zip(ints, ints[1:])), ints
    # e5m2's relative step (2^-2) against e4m3's (2^-3)
    assert requant_noise(qdq_float) < requant_noise(lambda x: qdq_float(x, torch.float8_e5m2))
    # no quantization: the ulp itself, 2^-8 to 2^-7 of each value
    assert 2 ** -8 < requant_noise(lambda x: x) < 2 ** -7
    # another seed's rows: the same ratio within 2% (the sampling error of NOISE_ROWS rows)
    r0 = requant_noise(QDQ["fp8"]) / requant_noise(QDQ["int8"])
    r1 = requant_noise(QDQ["fp8"], seed=1) / requant_noise(QDQ["int8"], seed=1)
    assert r1 == pytest.approx(r0, rel=0.02)


def test_logits_rel_tol_refuses_an_unknown_scheme():
    with pytest.raises(ValueError, match=r"logits_rel_tol: scheme 'fp4' is not one of"):
        logits_rel_tol("fp4")
    ours, ol, ref = _paths()
    with pytest.raises(ValueError, match=r"scheme 'w8a8'"):
        check_greedy_against_transformers(ours, ol, ref, LENGTH, scheme="w8a8")
