"""Element-wise bounds between a quantized MoE checkpoint's layers (`W8A8MoE`, `W8A8Linear`) and their float64
reference (tests/_moe_models.py's `FakeQuantExperts` / `FakeQuantLinear` over the weights the tests dequantize from
the files), derived from the roundings (float32 accumulation, bf16 outputs, the 8-bit quantization of the down
GEMM's input), and the teacher-forced check that uses them: shared by tests/checkpoints/test_checkpoints_moe.py and
tests/checkpoints/test_checkpoints_deepseek.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import cutlass_w8a8 as cw
from cutlass_w8a8.testing.references import assert_within, ulp

from _checkpoints import sqnr_db
from _moe_models import fake_quant_act


def float32_rounding_bound(ref, x):
    """Element-wise bound on how far ours's float32 result of the linear ``ref`` (a float64 `FakeQuantLinear`) can
    be from the exact one before the bf16 rounding (see `sum_error`)."""
    xq = fake_quant_act(x, ref.quant_dtype, ref.input_scale, ref.group_size, torch.float64)
    return sum_error(xq.abs() @ ref.weight.double().abs().T, xq.shape[-1], ref.group_size)


def sum_error(abs_terms, k, group_size):
    """Ours's float32 error on an exact sum of 8-bit products, given sum_k |a_k w_k| (dequantized): the ops round
    the exact sum of each K block (K / 128 blocks with 1 x 128 activation groups, else one) to float32, multiply by
    the scales and add the blocks in float32: at most K / 128 + 2 roundings of 2**-24 of sum_k |a_k w_k|, one
    more for the second-order terms; the float64 reference adds K 2**-53 of it."""
    blocks = k // group_size if group_size else 1
    return ((blocks + 3) * 2.0 ** -24 + k * 2.0 ** -53) * abs_terms


def _to_bf16(x):
    return x.to(torch.bfloat16).double()


def _silu_mul_interval(g_lo, g_hi, u_lo, u_hi):
    """[lo, hi] of bf16 ``silu(gate) * up`` (silu rounded, then the product, as the layer and the reference compute
    it) over bf16 gate in [g_lo, g_hi] and up in [u_lo, u_hi]: silu falls to its minimum at -1.2785 and rises after
    (its rounding is monotone), so its range is at the ends and, when inside, at the bf16 values around the
    minimum; the rounded product is monotone in each factor, so its range is at the corners."""
    silu = lambda g: F.silu(g.to(torch.bfloat16)).double()  # noqa: E731
    cands = [silu(g_lo), silu(g_hi)]
    for m in (-1.28125, -1.2734375):  # the bf16 neighbours of silu's minimum
        cands.append(silu(torch.full_like(g_lo, m).clamp(g_lo, g_hi)))
    s_lo, s_hi = torch.stack(cands).amin(0), torch.stack(cands).amax(0)
    prods = torch.stack([(a.to(torch.bfloat16) * b.to(torch.bfloat16)).double()
                         for a in (s_lo, s_hi) for b in (u_lo, u_hi)])
    return prods.amin(0), prods.amax(0)


def _quant_interval(a_lo, a_hi, quant_dtype, scale, group_size):
    """[lo, hi] of the dequantized 8-bit value ``q * s`` of an activation anywhere in [a_lo, a_hi], quantized as
    `fake_quant_act` does (dynamic scale absmax / qmax per row or 1 x 128 group, or the static ``scale``): the
    scale ranges over the group's possible absmax values, and ``a / s`` and its rounding are monotone."""
    qmax = 127.0 if quant_dtype == torch.int8 else 448.0
    if group_size:
        a_lo, a_hi = a_lo.unflatten(-1, (-1, group_size)), a_hi.unflatten(-1, (-1, group_size))
    if scale is None:
        mag_lo = torch.where((a_lo <= 0) & (a_hi >= 0), torch.zeros_like(a_lo), torch.minimum(a_lo.abs(), a_hi.abs()))
        mag_hi = torch.maximum(a_lo.abs(), a_hi.abs())
        s = [(m.amax(-1, keepdim=True).float() / torch.tensor(qmax)).double() for m in (mag_lo, mag_hi)]
    else:
        s = [scale.double().reshape(())] * 2
    corners = []
    for sc in s:
        safe = torch.where(sc == 0, torch.ones_like(sc), sc).float()
        for a in (a_lo, a_hi):
            y = torch.where(sc == 0, torch.zeros_like(a), (a.float() / safe).double())
            q = torch.round(y).clamp(-128, 127) if quant_dtype == torch.int8 else \
                y.clamp(-448, 448).to(quant_dtype).double()
            corners.append(q * sc)
    lo, hi = torch.stack(corners).amin(0), torch.stack(corners).amax(0)
    return (lo.flatten(-2), hi.flatten(-2)) if group_size else (lo, hi)


def moe_output_interval(ref, x, ids, wts):
    """[lo, hi] (bf16 values) that ours's W8A8MoE output must lie in, element-wise, given the float64 reference
    experts ``ref`` (a `FakeQuantExperts`) on ``(x, ids, wts)``. Ours quantizes ``x`` as the reference does; its
    gate / up GEMM is within `sum_error` of the exact sum, so each rounds to a bf16 value between those of the
    interval's ends; `_silu_mul_interval` and `_quant_interval` carry that to the down GEMM's 8-bit input (where an
    output one ulp apart can move it one quantization step, or move its group's scale); the down GEMM adds its
    input's spread times |w2| and its own `sum_error`, then the bf16 rounding; the top-k sum in float32 (one
    product and one addition per expert, 2k roundings of 2**-24 of sum_j w_j |z_j|) and the bf16 rounding."""
    cd = torch.float64
    t, h = x.shape
    k = ids.shape[1]
    xq = fake_quant_act(x, ref.quant_dtype, ref.a13_scale, ref.group_size, cd)
    z_lo = torch.zeros(t, k, h, dtype=cd)
    z_hi = torch.zeros(t, k, h, dtype=cd)
    for e in range(ref.num_experts):
        tok, j = torch.nonzero(ids == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        w13, w2 = ref.w13[e].to(cd), ref.w2[e].to(cd)
        y13 = xq[tok] @ w13.T
        err = sum_error(xq[tok].abs() @ w13.abs().T, h, ref.group_size)
        (g_lo, u_lo), (g_hi, u_hi) = _to_bf16(y13 - err).chunk(2, -1), _to_bf16(y13 + err).chunk(2, -1)
        a_lo, a_hi = _silu_mul_interval(g_lo, g_hi, u_lo, u_hi)
        q_lo, q_hi = _quant_interval(a_lo, a_hi, ref.quant_dtype, ref.a2_scale, ref.group_size)
        mid, spread = (q_lo + q_hi) / 2, (q_hi - q_lo) / 2
        mag = torch.maximum(q_lo.abs(), q_hi.abs())
        err2 = spread @ w2.abs().T + sum_error(mag @ w2.abs().T, w2.shape[1], ref.group_size)
        y2 = mid @ w2.T
        z_lo[tok, j], z_hi[tok, j] = _to_bf16(y2 - err2), _to_bf16(y2 + err2)
    w = wts.double().reshape(t, k, 1)  # routing weights >= 0
    lo, hi = (w * z_lo).sum(1), (w * z_hi).sum(1)
    err = 2 * k * 2.0 ** -24 * (w * torch.maximum(z_lo.abs(), z_hi.abs())).sum(1)
    return _to_bf16(lo - err), _to_bf16(hi + err)


def assert_each_layer_within_bounds(ours, ref, source, input_ids):
    """Teacher-forced: every `W8A8MoE` and `W8A8Linear` of ``ours`` against its counterpart in ``ref`` (the float64
    reference of the same checkpoint: `FakeQuantExperts` / `FakeQuantLinear` in float64), both run on the inputs
    that counterpart saw in ``source``'s forward on ``input_ids`` (the checkpoint's model in float64, routings
    included), rounded to bf16 (the layers' input dtype). A W8A8Linear within one bf16 ulp plus
    `float32_rounding_bound` of the reference, a W8A8MoE within `moe_output_interval` (the reference inside its own
    interval too). Returns ``(worst SQNR in dB over the layers, number of layers)``; AssertionError naming the
    layer otherwise (tests/checkpoints/test_checkpoints_moe.py's test_each_layer_matches_its_reference says why
    these bounds do not depend on the CPU)."""
    seen = {}

    def keep(n):
        def hook(mod, args, out):
            seen[n] = tuple(a.to(torch.bfloat16) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                            for a in args)
        return hook

    mods = {n for n, m in ours.named_modules() if isinstance(m, (cw.W8A8MoE, cw.W8A8Linear))}
    hooks = [source.get_submodule(n).register_forward_hook(keep(n)) for n in mods]
    with torch.no_grad():
        source(input_ids)
    for h in hooks:
        h.remove()
    assert set(seen) == mods, sorted(set(seen) ^ mods)[:4]
    worst = float("inf")
    with torch.no_grad():
        for n in sorted(mods):
            args = seen[n]
            got, want = ours.get_submodule(n)(*args), ref.get_submodule(n)(*args)
            assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape, n
            got, want = got.double(), want.double()
            if isinstance(ours.get_submodule(n), cw.W8A8Linear):
                one_ulp = torch.maximum(ulp(got, torch.bfloat16), ulp(want, torch.bfloat16))
                assert_within(got, want, one_ulp + float32_rounding_bound(ref.get_submodule(n), *args), n)
            else:
                lo, hi = moe_output_interval(ref.get_submodule(n), *args)
                assert bool(((lo <= want) & (want <= hi)).all()), f"{n}: the reference outside its own interval"
                mid, half = (lo + hi) / 2, (hi - lo) / 2
                assert_within(got, mid, half, n)
            worst = min(worst, sqnr_db(got, want))
    return worst, len(mods)
