"""Tensor parallelism of the MoE experts on the CPU: the sharding math of `W8A8MoE`'s buffers in one process, then
`TensorParallelW8A8MoE` in two processes with gloo (`cutlass_w8a8.testing.tp.run_workers`; worker functions in
tests/_tp_moe_scenarios.py).

What is checked, and why these criteria (cutlass_w8a8/distributed/moe.py derives them):

- The shard's buffers are the full layer's slices, bit for bit: w13 rows ``[gate_r; up_r]`` (rank r's I / 2 gate rows
  and the same up rows), their per-channel or block scale rows, w2's I columns, w2's scale whole (per channel) or
  its column blocks, static activation scales replicated.
- The distributed output is the bf16 sum of the two ranks' partial outputs, bit for bit (gloo adds two bf16 values
  and rounds once, as torch does), and equal on both ranks.
- Against the unsharded layer: both approximate the same float model Yf (dequantized weights in float64, exact
  activations). The sharded layer's first GEMM outputs are the full layer's columns exactly; its second GEMM's
  input is quantized per shard (dynamic per-token: scales no larger than the full row's; static or block: exactly
  the full layer's slices) and its partials are rounded to bf16 before the sum, so its error against Yf is no
  larger in expectation. Required, as for the decoder in tests/distributed/test_tp_cpu.py: ||Y2 - Yf|| <= 1.25 ||Y1 - Yf||
  (the 25 % for the sampling variation of the rounding noise over the 32 x H outputs) and hence
  ||Y2 - Y1|| <= 2.25 ||Y1 - Yf||; ||Y1 - Yf|| / ||Yf|| < 0.1 shows the reference is the right one.
- Misuse (block-scaled experts whose I / 2 is not a multiple of 128; ranks with different sizes) raises the same
  ValueError on both ranks, and the group still works afterwards.
"""

import re

import pytest
import torch
import torch.nn.functional as F

from cutlass_w8a8.distributed import sharding as S
from cutlass_w8a8.testing.tp import run_workers

import _tp_moe_scenarios as scen
from _tp_scenarios import TP_VS_TP1_ACCURACY, ok_value

WORLD = 2
TIMEOUT_S = 240


# ---- one process: the sharding math --------------------------------------------------------------------------


def test_shard_w13_keeps_gate_and_up_rows_of_the_rank():
    e, i, h, world = 3, 8, 4, 2
    w = torch.arange(e * 2 * i * h, dtype=torch.float32).reshape(e, 2 * i, h)
    for r in range(world):
        got = S.shard_w13(w, i, r, world)
        assert got.shape == (e, i, h) and got.is_contiguous()
        assert torch.equal(got[:, :i // 2], w[:, r * 4:(r + 1) * 4])          # gate_r
        assert torch.equal(got[:, i // 2:], w[:, i + r * 4:i + (r + 1) * 4])  # up_r
    s = torch.arange(e * 2 * i, dtype=torch.float32).reshape(e, 2 * i)
    assert torch.equal(S.shard_w13(s, i, 1, 2), torch.cat([s[:, 4:8], s[:, 12:16]], 1))
    w2 = torch.arange(e * h * i, dtype=torch.float32).reshape(e, h, i)
    assert torch.equal(S.shard_w2(w2, 1, 2), w2[..., 4:8])


def test_shard_block_scales_keep_whole_blocks():
    e, i, h = 2, 512, 256  # w13 scale [E, 2I/128 = 8, H/128 = 2], w2 scale [E, H/128 = 2, I/128 = 4]
    s13 = torch.arange(e * 8 * 2, dtype=torch.float32).reshape(e, 8, 2)
    s2 = torch.arange(e * 2 * 4, dtype=torch.float32).reshape(e, 2, 4)
    assert torch.equal(S.shard_w13_block_scale(s13, i, 1, 2), torch.cat([s13[:, 2:4], s13[:, 6:8]], 1))
    assert torch.equal(S.shard_w2_block_scale(s2, i, 1, 2), s2[..., 2:4])
    assert torch.equal(S.shard_w13_block_scale(s13, i, 3, 4), torch.cat([s13[:, 3:4], s13[:, 7:8]], 1))


@pytest.mark.parametrize("i, world, block, match", [
    (256, 3, False, r"`intermediate_size` = 256 is not divisible by the tensor-parallel world size 3"),
    (96, 4, False, r"intermediate_size I = 96 gives shards of I / 4 = 24; the grouped GEMM kernels need a multiple "
                   r"of 16"),
    (384, 2, True, r"block-scaled fp8 experts \(128 x 128 blocks\) cannot be split over 2 ranks: intermediate_size "
                   r"I = 384 gives shards of I / 2 = 192, not a multiple of 128"),
])
def test_check_moe_shardable_errors(i, world, block, match):
    with pytest.raises(ValueError, match=match):
        S.check_moe_shardable(i, world, block)


def test_check_moe_shardable_ok():
    assert S.check_moe_shardable(768, 2) == 384 and S.check_moe_shardable(768, 2, block=True) == 384
    assert S.check_moe_shardable(768, 4) == 192


# ---- two processes, gloo ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def moe():
    pytest.importorskip("cutlass_w8a8.distributed.moe")
    res = run_workers(scen.moe_cases, WORLD, timeout_s=TIMEOUT_S, group_timeout_s=60)
    return [r.value for r in res]


@pytest.mark.parametrize("name", sorted(scen.CASES))
def test_shard_buffers_are_the_full_layers_slices(moe, name):
    _, block, static, h, i = scen.CASES[name]
    for rank in range(WORLD):
        d = ok_value(moe[rank][name])
        f, s = d["full"], d["shard"]
        assert d["types"] == ["TensorParallelW8A8MoE"] * 2
        assert d["sizes"] == (i // 2, i, rank, 2)
        rows = scen.w13_rows(i, rank, WORLD)
        cols = torch.arange(rank * i // 2, (rank + 1) * i // 2)
        assert torch.equal(s["w13"], f["w13"][:, rows]) and torch.equal(s["w2"], f["w2"][..., cols])  # fp8 as uint8
        if block:
            brows = torch.cat([torch.arange(rank * i // 256, (rank + 1) * i // 256),
                               torch.arange(i // 128 + rank * i // 256, i // 128 + (rank + 1) * i // 256)])
            assert torch.equal(s["w13_scale"], f["w13_scale"][:, brows])
            assert torch.equal(s["w2_scale"], f["w2_scale"][..., rank * i // 256:(rank + 1) * i // 256])
        else:
            assert torch.equal(s["w13_scale"], f["w13_scale"][:, rows])
            assert torch.equal(s["w2_scale"], f["w2_scale"])
        assert ("a13_scale" in s) == static and all(torch.equal(s[k], f[k]) for k in ("a13_scale", "a2_scale")
                                                    if k in s)


@pytest.mark.parametrize("name", sorted(scen.CASES))
def test_output_is_the_bf16_sum_of_the_partials(moe, name):
    d0, d1 = (ok_value(moe[r][name]) for r in range(WORLD))
    expected = d0["partial"] + d1["partial"]
    for d in (d0, d1):
        assert torch.equal(d["tp_y"], expected)
        assert torch.equal(d["tp2_y"], d["tp_y"])  # shard_moe == from_full
    assert torch.equal(d0["tp_yl"], d1["tp_yl"])  # router-logits mode: the same routing on both ranks
    assert not torch.equal(d0["partial"], expected)  # a partial alone is not the output


@pytest.mark.parametrize("name", sorted(scen.CASES))
def test_sharded_vs_unsharded_against_the_float_model(moe, name):
    d = ok_value(moe[0][name])
    scen.assert_sharded_vs_unsharded(d, scen.float_reference(d))
    # router-logits mode: the routing (softmax, top-2, renormalized) computed here, then the same criterion
    p = torch.softmax(d["logits"].double(), -1)
    w, ids = torch.topk(p, 2, -1)
    yf = scen.float_reference(d, ids, w / w.sum(-1, keepdim=True))
    scen.assert_sharded_vs_unsharded(d, yf, "full_yl", "tp_yl", check_tp_vs_tp1=False)


def test_repr_names_the_shard(moe):
    d = ok_value(moe[1]["int8"])
    assert "intermediate_size=128" in d["repr"] and "tp_rank=1, tp_size=2, full_intermediate_size=256" in d["repr"]


@pytest.mark.parametrize("name", sorted(scen.MOE_ERRORS))
def test_misuse_raises_the_same_error_on_every_rank(moe, name):
    got = [moe[r]["errors"][name] for r in range(WORLD)]
    assert got[0][0] == "error" and got[0][1] == "ValueError" and re.search(scen.MOE_ERRORS[name], got[0][2]), got[0]
    assert got[1] == got[0]
    assert [ok_value(moe[r]["group_still_works"]) for r in range(WORLD)] == [3.0, 3.0]


# ---- two processes, gloo: a transformers Qwen3-MoE model, quantize_(tp_group=...) ------------------------------


@pytest.fixture(scope="module")
def hf_moe():
    pytest.importorskip("transformers")
    ids = torch.randint(0, 512, (2, 10), generator=torch.Generator().manual_seed(0))
    res = run_workers(scen.hf_moe_cases, WORLD, args=(ids,), timeout_s=TIMEOUT_S, group_timeout_s=60)
    return ids, [r.value for r in res]


def test_quantize_tp_qwen3_moe_logits_vs_tp1(hf_moe):
    """Qwen3-MoE (8 experts, top-2, 2 layers) quantized with tp_group: attention and experts sharded; the logits
    meet the TP criterion against TP=1 (the dequantized float model as reference, as in tests/distributed/test_tp_cpu.py)."""
    import cutlass_w8a8 as cw
    from _moe_models import tiny_moe_model

    ids, res = hf_moe
    d = [ok_value(res[r]["qwen3_moe"]) for r in range(WORLD)]
    assert d[0]["experts"] == ["TensorParallelW8A8MoE"] * 2
    assert torch.equal(d[0]["logits"], d[1]["logits"])
    full = cw.quantize_(tiny_moe_model("qwen3_moe", seed=0))
    with torch.no_grad():
        l1 = full(ids).logits.double()
        lf = _exact_float_model(full)(ids).logits.double()
    l2 = d[0]["logits"].double()
    e1, e2 = float((l1 - lf).norm()), float((l2 - lf).norm())
    assert e1 / float(lf.norm()) < 0.1
    assert e2 <= TP_VS_TP1_ACCURACY * e1, (e1, e2)
    assert float((l2 - l1).norm()) <= (1 + TP_VS_TP1_ACCURACY) * e1


class _ExactExperts(torch.nn.Module):
    """A W8A8MoE's dequantized weights in float32 with exact activations (transformers' experts call)."""

    def __init__(self, layer):
        super().__init__()
        from _moe_models import dequantize_experts

        self.register_buffer("w13", dequantize_experts(layer.w13, layer.w13_scale, torch.float32))
        self.register_buffer("w2", dequantize_experts(layer.w2, layer.w2_scale, torch.float32))

    def forward(self, x, ids, w):
        out = torch.zeros(x.shape[0], self.w2.shape[1], dtype=torch.float32)
        for t in range(x.shape[0]):
            for j in range(ids.shape[1]):
                e = int(ids[t, j])
                gate, up = (self.w13[e] @ x[t].float()).chunk(2)
                out[t] += w[t, j].float() * (self.w2[e] @ (F.silu(gate) * up))
        return out.to(x.dtype)


def _exact_float_model(model):
    """A float32 copy of a quantized transformers model: W8A8Linear -> nn.Linear of the dequantized weight, W8A8MoE
    -> `_ExactExperts`; exact activations (what both the TP=1 and the TP=2 model approximate)."""
    import copy

    import cutlass_w8a8 as cw

    ref = copy.deepcopy(model)
    for name, m in list(ref.named_modules()):
        if isinstance(m, cw.W8A8MoE):
            new = _ExactExperts(m)
        elif isinstance(m, cw.W8A8Linear):
            new = torch.nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, dtype=torch.float32)
            with torch.no_grad():
                new.weight.copy_(m.weight.float() * m.weight_scale.reshape(-1, 1))
                if m.bias is not None:
                    new.bias.copy_(m.bias.float())
        else:
            continue
        parent, _, child = name.rpartition(".")
        setattr(ref.get_submodule(parent), child, new)
    return ref.to(torch.float32).eval()


# ---- two processes, gloo: one cross-rank check per entry -------------------------------------------------------


def _count_all_gathers(rank, world, path, input_ids):
    """A gloo rank: the number of ``torch.distributed.all_gather`` calls (the cross-rank agreement check is one)
    made by ``quantize_(tp_group=...)`` of a 2-layer Qwen3-MoE model, and by ``from_pretrained(path, tp_group=...)``
    of its checkpoint; and their logits (the lm_head gathers its vocabulary shards: counted apart)."""
    import warnings

    import torch.distributed as dist

    import cutlass_w8a8 as cw
    from _moe_models import tiny_moe_model

    calls = []
    real = dist.all_gather

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    dist.all_gather = counting
    try:
        out = {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = cw.quantize_(tiny_moe_model("qwen3_moe", seed=0), filter_fn=lambda m, fqn: fqn != "lm_head",
                                 tp_group=dist.group.WORLD)
            out["quantize_"] = len(calls)
            calls.clear()
            loaded = cw.from_pretrained(path, tp_group=dist.group.WORLD)
            out["from_pretrained"] = len(calls)
        out["experts"] = [type(m).__name__ for m in loaded.modules() if isinstance(m, cw.W8A8MoE)]
        with torch.no_grad():
            out["logits_equal"] = torch.equal(model(input_ids).logits, loaded(input_ids).logits)
        return out
    finally:
        dist.all_gather = real


def test_one_cross_rank_check_per_entry(tmp_path):
    """quantize_(tp_group=...) and from_pretrained(tp_group=...) of a model with two MoE layers run the cross-rank
    agreement check once each (one all_gather): the experts' fields are part of the entry's one check, and neither
    shard_experts_ nor TensorParallelW8A8MoE.from_shard runs its own again (issue 34: the MoE check ran twice in
    one path, once more per MoE layer when loading). The loaded model's logits are the quantized model's."""
    pytest.importorskip("transformers")
    import warnings

    import cutlass_w8a8 as cw
    from _moe_models import tiny_moe_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = cw.quantize_(tiny_moe_model("qwen3_moe", seed=0), filter_fn=lambda m, fqn: fqn != "lm_head")
    cw.save_pretrained(model, tmp_path / "ckpt")
    ids = torch.randint(0, 512, (2, 6), generator=torch.Generator().manual_seed(0))
    res = run_workers(_count_all_gathers, WORLD, args=(str(tmp_path / "ckpt"), ids), timeout_s=TIMEOUT_S,
                      group_timeout_s=60)
    for r in res:
        d = r.value
        assert d["experts"] == ["TensorParallelW8A8MoE"] * 2
        assert (d["quantize_"], d["from_pretrained"]) == (1, 1), d
        assert d["logits_equal"]
