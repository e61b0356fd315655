"""Sanitizer cases: decode attention, rope + KV-cache writes, and the fused decode_layer."""

from __future__ import annotations

import math

import torch

from ..attention import assert_close_to_reference as assert_attention_close
from ..attention import reference as attention_reference
from ..references import rand_scale
from .core import BF16, Ctx, F16, F32, FP8, I8, Q, QMAX, _operand, case, check_equal, check_loose, check_ulps
from .quant_norm import _quant_chain


# ----------------------------------------------------------------------------------------------------
# attention


def _attention_inputs(ctx: Ctx, b, h, kvh, d, s, dtype, positions):
    """((q, kv_cache, slots, positions) on the device, the same on the host): q the query heads of a fused qkv
    output (stride(0) = (H + 2 KVH) D), B + 1 cache slots (distinct, shuffled), slots and positions strided columns
    of a (B, 3) int64 tensor, as LlamaAttention and the decode runner pass them."""
    qkv_h = ctx.randn(b, h + 2 * kvh, d, dtype=dtype)
    kv_h = ctx.randn(b + 1, 2, kvh, s, d, dtype=dtype)
    rows_h = torch.zeros(b, 3, dtype=torch.int64)
    rows_h[:, 2] = torch.randperm(b + 1, generator=ctx.g)[:b]
    rows_h[:, 1] = torch.tensor(positions, dtype=torch.int64)
    qkv, kv, rows = ctx.to(qkv_h), ctx.to(kv_h), ctx.to(rows_h)
    return (qkv[:, :h], kv, rows[:, 2], rows[:, 1]), (qkv_h[:, :h], kv_h, rows_h[:, 2], rows_h[:, 1])


def _check_attention(ctx: Ctx, out: torch.Tensor, host, scale: float, dtype, what: str) -> None:
    """The kernel's output within its float64 reference's bound (`cutlass_w8a8.testing.attention`); on the CPU,
    whose implementation is SDPA over the masked cache in q's dtype (not held to the kernel's bound), within
    `LOOSE_REL` of it."""
    ref = attention_reference(*host, scale)
    if ctx.cuda:
        assert_attention_close(out.cpu(), ref, dtype, what)
    else:
        check_loose(out.reshape(ref.out.shape), ref.out, what)


_ATTENTION = [(3, 8, 2, 64, 300, BF16, [0, 299, 150], False),   # G = 4, strided q, many splits
              (2, 4, 4, 128, 40, F16, [39, 7], True),            # multi-head, out=
              (2, 8, 1, 256, 600, BF16, [599, 300], False),      # D = 256 (the largest), G = 8
              (1, 2, 2, 32, 17, F32, [16], True),                # float32
              (1, 32, 4, 128, 512, BF16, [511], False)]          # Qwen3-30B-A3B heads: on sm90 the fused kernel, a
                                                                 # cluster of 16 CTAs (8 splits x 4 head groups)


@case("decode_attention", ["decode_attention", "decode_attention_out"])
def _decode_attention(ctx: Ctx) -> None:
    """decode_attention (split-KV, then combine, or the fused kernel on sm90) against the float64 reference: GQA and MHA, D = 32..256, positions
    0 and S - 1, bf16 / f16 / f32, functional and out=."""
    for b, h, kvh, d, s, dtype, positions, use_out in _ATTENTION:
        what = f"decode_attention B={b} H={h} KVH={kvh} D={d} S={s} {dtype} out={use_out}"
        with ctx.sub(what):
            dev, host = _attention_inputs(ctx, b, h, kvh, d, s, dtype, positions)
            scale = 1.0 / math.sqrt(d)
            if use_out:
                out = ctx.nan((b, h * d), dtype)
                Q.decode_attention_out(out, *dev, scale)
            else:
                out = Q.decode_attention(*dev, scale)
            ctx.sync()
            _check_attention(ctx, out, host, scale, dtype, what)


@case("decode_attention_quant", ["decode_attention_quant"])
def _decode_attention_quant(ctx: Ctx) -> None:
    """decode_attention_quant, dynamic per token and static per tensor, int8 and fp8: equal to decode_attention then
    the quantizer bit for bit; that attention within the float64 reference's bound."""
    modes = [(I8, None), (FP8, 0.01), (FP8, None), (I8, 0.02)]
    for qdtype, static in (modes[:2] if ctx.quick else modes):
        if qdtype not in ctx.qdtypes:
            continue
        what = f"decode_attention_quant {qdtype} static={static}"
        with ctx.sub(what):
            dev, host = _attention_inputs(ctx, 3, 8, 2, 64, 300, BF16, [0, 299, 150])
            sm = 1.0 / 8.0
            scale = ctx.to(torch.tensor([static])) if static else None
            q8, s = Q.decode_attention_quant(*dev, sm, qdtype, scale)
            o = Q.decode_attention(*dev, sm)
            qc, sc = _quant_chain(o, "static" if static else "dynamic", qdtype, scale)
            check_equal(q8, qc.cpu(), f"{what}: q vs the chain")
            check_equal(s, sc.cpu(), f"{what}: scale vs the chain")
            _check_attention(ctx, o, host, sm, BF16, f"{what}: attention")


@case("rope_kv_cache", ["rope_kv_cache_"])
def _rope_kv_cache(ctx: Ctx) -> None:
    """rope_kv_cache_: q and k heads rotated in place, k and v written to their (slot, position): within one ulp of
    the CPU, the row padding and every other cache entry untouched. Also partial rotary (rope (B, R / 2, 2) with
    R = D / 2: GLM-4.5's), without head norms (one ulp) and with them (the kernel's own order of the sum of squares:
    checked loosely here, tests/ops/test_rope_kv_cache_partial.py bounds it)."""
    h, kvh, d, s, slots_n = 4, 2, 64, 16, 5
    params = [(3, BF16, d, False), (1, F32, d, False), (3, BF16, d // 2, False), (2, BF16, d // 2, True)]
    if not ctx.quick:
        params += [(5, F16, d, False), (5, F16, d // 4, True)]
    for b, dtype, r, norms in params:
        what = f"rope_kv_cache_ B={b} {dtype}" + (f" R={r}" if r < d else "") + (" norms" if norms else "")
        with ctx.sub(what):
            qkv_h = ctx.randn(b, h + 2 * kvh, d, dtype=dtype)
            angles = torch.rand(b, r // 2, generator=ctx.g) * 6.2831853
            rope_h = torch.stack([angles.cos(), angles.sin()], dim=-1).contiguous()
            cache_h = ctx.randn(slots_n, 2, kvh, s, d, dtype=dtype)
            slots_h = torch.randperm(slots_n, generator=ctx.g)[:b]
            pos_h = torch.randint(0, s, (b,), generator=ctx.g)
            norms_h = (1 + ctx.randn(d, dtype=dtype, std=0.1), 1 + ctx.randn(d, dtype=dtype, std=0.1), 1e-6) \
                if norms else ()
            wide = ctx.to(torch.cat([qkv_h, torch.full((b, 1, d), float("nan"), dtype=dtype)], dim=1))
            qkv, cache = wide[:, :h + 2 * kvh], ctx.to(cache_h)
            Q.rope_kv_cache_(qkv, ctx.to(rope_h), cache, ctx.to(slots_h), ctx.to(pos_h), h, kvh,
                             *[ctx.to(t) if isinstance(t, torch.Tensor) else t for t in norms_h])
            ctx.sync()
            qkv_ref, cache_ref = qkv_h.clone(), cache_h.clone()
            Q.rope_kv_cache_(qkv_ref, rope_h, cache_ref, slots_h, pos_h, h, kvh, *norms_h)
            def check(g, ref, w):
                return check_loose(g, ref, w) if norms else check_ulps(g, ref, 1, w)
            check(qkv, qkv_ref, f"{what}: qkv")
            assert torch.isnan(wide[:, -1].cpu().float()).all(), f"{what}: the row padding was written"
            written = torch.zeros(slots_n, 2, kvh, s, dtype=torch.bool)
            written[slots_h, :, :, pos_h] = True
            got = cache.cpu()
            check_equal(got[~written], cache_h[~written], f"{what}: cache entries outside (slot, position)")
            check(got[written], cache_ref[written], f"{what}: written cache entries")


# ----------------------------------------------------------------------------------------------------
# decode_layer


def _layer_operands(ctx: Ctx, kind: str, hidden=256, heads=4, kv_heads=2, d=64, inter=512):
    """Host operands of decode_layer from input_norm to down_is: 8-bit weights (N, K) with per-channel (N, 1) scales
    sized so each projection's output is O(1), input scales None (dynamic) or static per tensor; or bf16 weights."""
    qkv_n = (heads + 2 * kv_heads) * d
    dims = [(qkv_n, hidden), (hidden, heads * d), (2 * inter, hidden), (hidden, inter)]
    out = [1 + ctx.randn(hidden, dtype=BF16, std=0.1), 1 + ctx.randn(hidden, dtype=BF16, std=0.1), 1e-5]
    for n, k in dims:
        if kind == "bf16":
            out += [ctx.randn(n, k, dtype=BF16, std=k ** -0.5), None, None]
            continue
        dtype = I8 if kind == "int8" else FP8
        typical = 74.0 if dtype == I8 else 1.0  # rms of rand_operand's values
        ws = rand_scale((n, 1), "cpu", 1.0 / (typical * k ** 0.5), ctx.g)
        is_ = torch.tensor([4.0 / QMAX[dtype]]) if kind == "fp8-static" else None
        out += [_operand(ctx, (n, k), dtype), ws, is_]
    return out


@case("decode_layer", ["decode_layer"])
def _decode_layer(ctx: Ctx) -> None:
    """decode_layer (one reference-decoder layer in one op: norms, GEMMs at decode M, rope + cache, attention, SiLU):
    int8 dynamic, fp8 static and bf16 weights, first layer (h None) and later; finite and within LOOSE_REL of the CPU
    chain (output, residual and the cache)."""
    b, hidden, heads, kv_heads, d, s = 3, 256, 4, 2, 64, 32
    kinds = [("int8", True), ("fp8-static", False), ("bf16", False)]
    if ctx.quick:
        kinds = [kinds[0], kinds[2]]
    for kind, first in kinds:
        if kind == "fp8-static" and FP8 not in ctx.qdtypes:
            continue
        if kind == "bf16" and ctx.prefill:
            continue  # initcheck: its projections are cuBLAS GEMMs, whose sm90 epilogues may store by TMA too
        what = f"decode_layer {kind} first={first}"
        with ctx.sub(what):
            ops_h = _layer_operands(ctx, kind, hidden, heads, kv_heads, d)
            h_h = None if first else ctx.randn(b, hidden, dtype=BF16)
            res_h = ctx.randn(b, hidden, dtype=BF16)
            kv_h = ctx.randn(b + 1, 2, kv_heads, s, d, dtype=BF16)
            angles = torch.rand(b, d // 2, generator=ctx.g) * 6.2831853
            rope_h = torch.stack([angles.cos(), angles.sin()], dim=-1).contiguous()
            slots_h = torch.randperm(b + 1, generator=ctx.g)[:b]
            pos_h = torch.tensor([0, s - 1, s // 2])[:b]
            tail = (heads, kv_heads, 1.0 / math.sqrt(d))

            def run(on_dev: bool):
                cv = ctx.to if on_dev else (lambda t: None if t is None else t.clone())
                operands = [cv(t) if isinstance(t, torch.Tensor) else t for t in ops_h]
                res, kv = cv(res_h), cv(kv_h)
                out = Q.decode_layer(cv(h_h), res, *operands, kv, cv(rope_h), cv(slots_h), cv(pos_h), *tail)
                return out, res, kv

            out, res, kv = run(True)
            out_ref, res_ref, kv_ref = run(False)
            check_loose(out, out_ref, f"{what}: output")
            check_loose(res, res_ref, f"{what}: residual")
            check_loose(kv.cpu()[slots_h, :, :, pos_h], kv_ref[slots_h, :, :, pos_h], f"{what}: written cache")


