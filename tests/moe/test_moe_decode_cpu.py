"""`moe_decode_experts` on the CPU and on meta tensors: the op equals the unfused chain (`moe_align` ->
`moe_permute_quant` -> `grouped_scaled_mm` -> `silu_mul_quant` -> `grouped_scaled_mm` -> `moe_unpermute`, the
public ops one call each) bit for bit, for int8 and fp8 with per-channel and per-expert weight scales and block fp8,
top-k 1 / 2 / 8, 4 and 64 experts, routings with unrouted (-1) ids, repeated and empty experts and a token with no
routed pair (zeros); every check raises its row of docs/MISUSE.md (exception type and message naming the argument)
from the CPU implementation and from the fake kernel; opcheck; `W8A8MoE`'s rule for taking the decode path.

The CUDA op against the CUDA chain, a float64 reference, CUDA graphs and the profiler is
tests/moe/test_moe_decode_cuda.py.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch

import cutlass_w8a8 as cw
from cutlass_w8a8.ops._limits import MOE_DECODE_MAX_PAIRS

from _misuse_table import assert_row
from _moe_decode import DEVICE_TRIGGERS, META_TRIGGERS, ROUTES, SCHEMES, chain, decode_operands, random_x, routing
from _opcheck import run_opcheck

H, I = 256, 128


def _check_result(out, x, ids, wts, ops, out_dtype=torch.bfloat16):
    """out is (T, H) out_dtype contiguous, equal bit for bit to the chain; tokens with no routed pair are zero,
    the others not all zero (so the equality is not one of two zero tensors)."""
    want = chain(x, ids, wts, out_dtype=out_dtype, **ops)
    t = x.shape[0]
    assert out.shape == (t, x.shape[1]) and out.dtype == out_dtype and out.is_contiguous()
    assert torch.equal(out, want), (out - want).abs().max()
    e = ops["w13"].shape[0]
    routed = ((ids >= 0) & (ids < e)).any(1)
    assert bool((out[~routed] == 0).all())
    assert bool((out[routed] != 0).any(1).all())


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("k", [1, 2, 8])
@pytest.mark.parametrize("e", [4, 64])
@pytest.mark.parametrize("route", ROUTES)
def test_equals_the_chain(scheme, k, e, route):
    t = min(8, MOE_DECODE_MAX_PAIRS // k)
    ops = decode_operands(scheme, e, H, I, seed=k * e)
    ids, wts = routing(t, k, e, route, seed=k + e)
    x = random_x(t, H, seed=k * 7 + e)
    _check_result(cw.moe_decode_experts(x, ids, wts, **ops), x, ids, wts, ops)


@pytest.mark.parametrize("t, k", [(1, 1), (64, 1), (32, 2), (8, 8)])
def test_decode_sizes(t, k):
    """T * top_k up to MOE_DECODE_MAX_PAIRS."""
    ops = decode_operands("fp8", 8, H, I, seed=t)
    ids, wts = routing(t, k, 8, "random", seed=t + k)
    x = random_x(t, H, seed=t)
    _check_result(cw.moe_decode_experts(x, ids, wts, **ops), x, ids, wts, ops)


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scheme", ["int8", "fp8-block"])
def test_dtypes(x_dtype, out_dtype, scheme):
    ops = decode_operands(scheme, 8, H, I, seed=3)
    ids, wts = routing(6, 2, 8, "random", seed=4)
    x = random_x(6, H, x_dtype, seed=5)
    _check_result(cw.moe_decode_experts(x, ids, wts, out_dtype=out_dtype, **ops), x, ids, wts, ops, out_dtype)


def test_strided_operands_and_int64_ids():
    """x with stride(1) != 1, int64 ids and weights as windows of wider buffers, per-expert scales as (E, 1): the
    chain's result on contiguous copies."""
    ops = decode_operands("int8-expert", 8, H, I, seed=6, expert_shape=(-1, 1))
    ids, wts = routing(5, 4, 8, "random", seed=7, ids_dtype=torch.int64)
    x = random_x(5, H, torch.float32, seed=8)
    x_t = x.t().contiguous().t()  # (T, H) with strides (1, T)
    ids_w = torch.full((5, 8), 3, dtype=torch.int64)[:, 2:6]
    wts_w = torch.full((5, 8), 9.0)[:, 1:5]
    ids_w.copy_(ids)
    wts_w.copy_(wts)
    assert x_t.stride(1) != 1 and not ids_w.is_contiguous() and not wts_w.is_contiguous()
    out = cw.moe_decode_experts(x_t, ids_w, wts_w, **ops)
    _check_result(out, x, ids, wts, ops)


def test_token_without_routed_pair_gives_zeros():
    ops = decode_operands("fp8", 4, H, I, seed=9)
    ids = torch.tensor([[-1, -1], [0, 3], [7, -5]], dtype=torch.int32)  # 7, -5: outside [0, 4), not routed
    wts = torch.full((3, 2), 0.5)
    x = random_x(3, H, seed=10)
    out = cw.moe_decode_experts(x, ids, wts, **ops)
    _check_result(out, x, ids, wts, ops)
    assert bool((out[0] == 0).all()) and bool((out[2] == 0).all()) and bool((out[1] != 0).any())


def test_t_zero():
    ops = decode_operands("int8", 4, H, I)
    out = cw.moe_decode_experts(torch.zeros(0, H, dtype=torch.bfloat16), torch.zeros(0, 3, dtype=torch.int32),
                                torch.zeros(0, 3), **ops, out_dtype=torch.float16)
    assert out.shape == (0, H) and out.dtype == torch.float16


def test_meta_shapes():
    ops = {k: (v.to("meta") if isinstance(v, torch.Tensor) else v) for k, v in decode_operands("fp8-block", 4, H, I).items()}
    ids, wts = routing(3, 2, 4)
    out = cw.moe_decode_experts(torch.empty(3, H, device="meta"), ids.to("meta"), wts.to("meta"), **ops,
                                out_dtype=torch.float16)
    assert out.device.type == "meta" and out.shape == (3, H) and out.dtype == torch.float16


@pytest.mark.parametrize("scheme", ["int8", "fp8-expert", "fp8-block"])
def test_opcheck(scheme):
    ops = decode_operands(scheme, 4, H, I, seed=11)
    ids, wts = routing(3, 2, 4, seed=12)
    x = random_x(3, H, seed=13)
    run_opcheck(torch.ops.cutlass_w8a8.moe_decode_experts,
                (x, ids, wts, ops["w13"], ops["w13_scale"], ops["w2"], ops["w2_scale"], ops["group_size"],
                 torch.bfloat16))


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("row_id", sorted(DEVICE_TRIGGERS))
def test_misuse_rows(row_id, device):
    """Each check raises its docs/MISUSE.md row (type and full first line, naming the argument) from the CPU
    implementation and the fake kernel (tests/test_misuse_table.py runs the CPU ones and, on a GPU, the C++ ones)."""
    assert_row(row_id, lambda: DEVICE_TRIGGERS[row_id](device))


@pytest.mark.parametrize("row_id", sorted(META_TRIGGERS))
def test_misuse_rows_meta_only(row_id):
    assert_row(row_id, META_TRIGGERS[row_id])


# ---- W8A8MoE's choice of path ------------------------------------------------------------------------------------


def _layer(scheme="fp8", static=False):
    mod = cw.W8A8MoE(8, 2, H, I, cw.W8A8Config(dtype=SCHEMES[scheme][0],
                                               weight_block_size=(128, 128) if scheme == "fp8-block" else None),
                     static_input_scale=static)
    ops = decode_operands(scheme, 8, H, I, seed=14)
    with torch.no_grad():
        for name in ("w13", "w13_scale", "w2", "w2_scale"):
            getattr(mod, name).copy_(ops[name])
    return mod


def _cuda_like(t):
    """Stands for a CUDA (T, H) hidden state in `uses_decode_path` (only is_cuda and shape are read)."""
    return types.SimpleNamespace(is_cuda=True, shape=(t, H))


def test_decode_path_rule():
    from cutlass_w8a8.moe.layer import FUSED_DECODE_AUTO_MAX_I, FUSED_DECODE_MIN_TOP_K
    mod = _layer()
    assert mod.fused_decode is None and copy.deepcopy(mod).fused_decode is None
    # automatic rule: top_k >= FUSED_DECODE_MIN_TOP_K and I <= FUSED_DECODE_AUTO_MAX_I, within the pair limit
    assert mod.intermediate_size <= FUSED_DECODE_AUTO_MAX_I
    for t, k, want in ((1, 4, True), (8, 8, True), (16, 4, True), (1, FUSED_DECODE_MIN_TOP_K - 1, False),
                       (32, 2, False), (9, 8, False), (0, 8, False)):
        assert mod.uses_decode_path(_cuda_like(t), k) is want, (t, k)
    # forced: every call within 1 <= T * top_k <= MOE_DECODE_MAX_PAIRS, whatever top_k
    mod.fused_decode = True
    for t, k, want in ((1, 1, True), (8, 8, True), (64, 1, True), (32, 2, True), (33, 2, False), (9, 8, False),
                       (0, 2, False)):
        assert mod.uses_decode_path(_cuda_like(t), k) is want, (t, k)
    assert not mod.uses_decode_path(torch.zeros(1, H), 2)  # CPU: the chain
    mod.fused_decode = False
    assert not mod.uses_decode_path(_cuda_like(1), 8)
    assert not _layer(static=True).uses_decode_path(_cuda_like(1), 8)  # static activation scales: the chain
    assert _layer("fp8-block").uses_decode_path(_cuda_like(4), 8)
    # above FUSED_DECODE_AUTO_MAX_I only when forced
    wide = _layer()
    wide.intermediate_size = FUSED_DECODE_AUTO_MAX_I + 128
    assert not wide.uses_decode_path(_cuda_like(1), 8)
    wide.fused_decode = True
    assert wide.uses_decode_path(_cuda_like(1), 8)


def test_decode_path_query_needs_the_extension():
    """cutlass_w8a8._ext.moe_decode_path (the CUDA op's two- or three-kernel rule, csrc/moe/moe_decode.cu own_quant)
    names itself when the CUDA extension is not loaded."""
    if cw.cuda_ops_available():
        pytest.skip("the CUDA extension is loaded here (tests/moe/test_moe_decode_cuda.py tests the query)")
    with pytest.raises(RuntimeError, match="moe_decode_path: the CUDA extension is not loaded"):
        cw._ext.moe_decode_path(1, 8, 2048, 768, 0)


@pytest.mark.parametrize("scheme", ["int8", "fp8-block"])
def test_layer_on_cpu_equals_the_op(scheme):
    """On the CPU the layer runs the chain; the op gives the same bits (what the CUDA path relies on)."""
    mod = _layer(scheme)
    ids, wts = routing(4, 2, 8, seed=15)
    x = random_x(4, H, seed=16)
    want = cw.moe_decode_experts(x, ids, wts, mod.w13, mod.w13_scale, mod.w2, mod.w2_scale, mod.group_size,
                                 mod.dtype)
    for fused in (True, False):
        mod.fused_decode = fused
        assert torch.equal(mod(x, ids, wts), want)
