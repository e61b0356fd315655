"""Sanitizer cases: quantization and the fused norm / SiLU (+ quantization) kernels."""

from __future__ import annotations

import torch

from ..references import BLOCK
from .core import BF16, Ctx, F16, F32, FP8, I8, Q, case, check_equal, check_row


# ----------------------------------------------------------------------------------------------------
# quantization


@case("quantize", ["quantize_per_token", "quantize_per_tensor"])
def _quantize(ctx: Ctx) -> None:
    """quantize_per_token and quantize_per_tensor, every kernel variant (csrc/quant/quantize.cu: rows held in
    registers, 1..8 16-byte vectors per thread of 256 or 8 of 512 threads; the loop kernel for long or unaligned
    rows), padded and transposed x, bf16 / f16 / f32 to int8 and fp8; bit for bit against the CPU."""
    ks = (512, 32768, 40000, 100) if ctx.quick else (512, 4096, 8192, 16384, 32768, 40000, 100)
    xdtypes = (BF16, F32) if ctx.quick else (BF16, F16, F32)
    for qdtype in ctx.qdtypes:
        for xdtype in xdtypes:
            for kk in ks:
                xs = [ctx.randn(3, kk, dtype=xdtype, std=3.0)]
                views = [lambda t: t]
                if kk == 512:  # padded rows (a slice of a wider buffer) and a transposed input
                    xs += [ctx.randn(2, 576, dtype=xdtype, std=3.0), ctx.randn(512, 5, dtype=xdtype, std=3.0)]
                    views += [lambda t: t[:, 64:], lambda t: t.t()]
                for x_h, view in zip(xs, views):
                    for static in (False, True):
                        x_h_v = view(x_h)
                        what = f"quantize {xdtype} -> {qdtype} shape={tuple(x_h_v.shape)} static={static}"
                        with ctx.sub(what):
                            x = view(ctx.to(x_h))
                            if static:
                                scale_h = torch.tensor([0.05])
                                q = Q.quantize_per_tensor(x, ctx.to(scale_h), qdtype)
                                check_equal(q, Q.quantize_per_tensor(x_h_v, scale_h, qdtype), f"{what}: q")
                            else:
                                q, s = Q.quantize_per_token(x, qdtype)
                                q_ref, s_ref = Q.quantize_per_token(x_h_v, qdtype)
                                check_equal(q, q_ref, f"{what}: q")
                                check_equal(s, s_ref, f"{what}: scale")


@case("quantize_group", ["quantize_per_token_group"])
def _quantize_group(ctx: Ctx) -> None:
    """quantize_per_token_group (1x128 groups): one group to many per row, a 3-D x, padded rows (vector loads) and
    misaligned rows (element loads), bf16 / f16 / f32 to fp8 and int8; bit for bit against the CPU."""
    shapes = [((3, 128), None), ((2, 4096), None), ((2, 16384), None), ((2, 3, 512), None),
              ((3, 640), lambda t: t[:, 128:]), ((3, 513), lambda t: t[:, 1:])]
    combos = [(x, q) for x in (BF16, F16, F32) for q in ctx.qdtypes]
    for i, (shape, view) in enumerate(shapes):
        for xdtype, qdtype in ([combos[i % len(combos)]] if ctx.quick else combos):
            x_h = ctx.randn(*shape, dtype=xdtype, std=3.0)
            view = view or (lambda t: t)
            what = f"quantize_per_token_group {xdtype} -> {qdtype} shape={tuple(view(x_h).shape)}"
            with ctx.sub(what):
                q, s = Q.quantize_per_token_group(view(ctx.to(x_h)), BLOCK, qdtype)
                q_ref, s_ref = Q.quantize_per_token_group(view(x_h), BLOCK, qdtype)
                check_equal(q, q_ref, f"{what}: q")
                check_equal(s, s_ref, f"{what}: scale")


# ----------------------------------------------------------------------------------------------------
# fused norm / SiLU (+ quantization)

# (mode, quantized dtype): per token, static per tensor, per 1x128 group
_QMODES = [("dynamic", I8), ("static", FP8), ("group", FP8), ("group", I8), ("static", I8), ("dynamic", FP8)]
_STATIC_SCALE = {I8: 0.03, FP8: 0.008}
# row lengths: registers, an 8-block cluster on sm90 (14336), a 3-D x, float32 (no clusters)
_NORM_SHAPES = [((3, 4096), BF16), ((2, 14336), BF16), ((2, 3, 1024), F16), ((4, 384), F32)]


def _quant_chain(y, mode, qdtype, scale):
    """The unfused quantization of y that the fused ops equal bit for bit: (q, scale) with per-row scales in the
    static mode as the fused ops return them."""
    if mode == "group":
        return Q.quantize_per_token_group(y, BLOCK, qdtype)
    if mode == "static":
        return Q.quantize_per_tensor(y, scale, qdtype), scale.reshape(1).expand(*y.shape[:-1], 1).contiguous()
    return Q.quantize_per_token(y, qdtype)


def _modes_for(ctx: Ctx, i: int):
    """Shape i's quantization modes: three of `_QMODES` (one with --quick), rotating so all six are used."""
    picked = [_QMODES[(3 * i + j) % len(_QMODES)] for j in range(1 if ctx.quick else 3)]
    return [(mode, q) for mode, q in picked if q in ctx.qdtypes]


@case("rms_norm", ["rms_norm", "fused_add_rms_norm"])
def _rms_norm(ctx: Ctx) -> None:
    """rms_norm and fused_add_rms_norm (residual += x in place): y within `check_row`'s bound of the CPU, the residual
    bit for bit; row lengths that take the register, cluster and float32 kernels, a 3-D x."""
    eps = 1e-5
    for shape, dtype in _NORM_SHAPES:
        x_h = ctx.randn(*shape, dtype=dtype, std=2.0)
        w_h = 1 + ctx.randn(shape[-1], dtype=dtype, std=0.1)
        r_h = ctx.randn(*shape, dtype=dtype)
        what = f"rms_norm {shape} {dtype}"
        with ctx.sub(what):
            y = Q.rms_norm(ctx.to(x_h), ctx.to(w_h), eps)
            check_row(y, Q.rms_norm(x_h, w_h, eps), "rms_norm", what)
        with ctx.sub(f"fused_add_{what}"):
            r = ctx.to(r_h)
            y = Q.fused_add_rms_norm(ctx.to(x_h), r, ctx.to(w_h), eps)
            r_ref = r_h.clone()
            y_ref = Q.fused_add_rms_norm(x_h, r_ref, w_h, eps)
            check_equal(r, r_ref, f"fused_add_{what}: residual")
            check_row(y, y_ref, "rms_norm", f"fused_add_{what}")


@case("rms_norm_quant", ["rms_norm_quant"])
def _rms_norm_quant(ctx: Ctx) -> None:
    """rms_norm_quant per token, per tensor and per 1x128 group, with and without the residual, int8 and fp8: equal
    to rms_norm then the quantizer on the same device bit for bit; that y within `check_row`'s bound of the CPU, its
    quantization equal to the CPU's."""
    eps = 1e-5
    for i, (shape, dtype) in enumerate(_NORM_SHAPES):
        for j, (mode, qdtype) in enumerate(_modes_for(ctx, i)):
            residual = (i + j) % 2 == 0
            what = f"rms_norm_quant {shape} {dtype} -> {qdtype} {mode} residual={residual}"
            with ctx.sub(what):
                x_h, w_h = ctx.randn(*shape, dtype=dtype, std=2.0), 1 + ctx.randn(shape[-1], dtype=dtype, std=0.1)
                r_h = ctx.randn(*shape, dtype=dtype) if residual else None
                scale_h = torch.tensor([_STATIC_SCALE[qdtype]]) if mode == "static" else None
                group = BLOCK if mode == "group" else 0
                x, w, scale, r1, r2 = ctx.to(x_h), ctx.to(w_h), ctx.to(scale_h), ctx.to(r_h), ctx.to(r_h)
                q, s = Q.rms_norm_quant(x, w, eps, qdtype, scale, r1, group)
                y = Q.fused_add_rms_norm(x, r2, w, eps) if residual else Q.rms_norm(x, w, eps)
                qc, sc = _quant_chain(y, mode, qdtype, scale)
                check_equal(q, qc.cpu(), f"{what}: q vs the chain")
                check_equal(s, sc.cpu(), f"{what}: scale vs the chain")
                if residual:
                    check_equal(r1, r2.cpu(), f"{what}: residual vs the chain")
                r_ref = None if r_h is None else r_h.clone()
                y_ref = Q.fused_add_rms_norm(x_h, r_ref, w_h, eps) if residual else Q.rms_norm(x_h, w_h, eps)
                check_row(y, y_ref, "rms_norm", f"{what}: y vs the CPU")
                qh, sh = _quant_chain(y.cpu(), mode, qdtype, scale_h)
                check_equal(q, qh, f"{what}: q vs the CPU quantization of y")
                check_equal(s, sh, f"{what}: scale vs the CPU quantization of y")


# [gate | up] rows: registers, an 8-block cluster on sm90 (I = 14336), a 3-D x, float32
_SILU_SHAPES = [((3, 8192), BF16), ((2, 28672), BF16), ((2, 3, 2048), F16), ((4, 768), F32)]


@case("silu_mul", ["silu_mul", "silu_mul_quant"])
def _silu_mul(ctx: Ctx) -> None:
    """silu_mul within `check_row`'s bound of the CPU; silu_mul_quant per token, per tensor and per 1x128 group, int8 and fp8,
    equal to silu_mul then the quantizer on the same device bit for bit, and to the CPU quantization of that y."""
    for i, (shape, dtype) in enumerate(_SILU_SHAPES):
        x_h = ctx.randn(*shape, dtype=dtype, std=2.0)
        what = f"silu_mul {shape} {dtype}"
        with ctx.sub(what):
            y = Q.silu_mul(ctx.to(x_h))
            check_row(y, Q.silu_mul(x_h), "silu_mul", what)
        for mode, qdtype in _modes_for(ctx, i):
            what = f"silu_mul_quant {shape} {dtype} -> {qdtype} {mode}"
            with ctx.sub(what):
                scale_h = torch.tensor([_STATIC_SCALE[qdtype]]) if mode == "static" else None
                x, scale = ctx.to(x_h), ctx.to(scale_h)
                q, s = Q.silu_mul_quant(x, qdtype, scale, BLOCK if mode == "group" else 0)
                qc, sc = _quant_chain(Q.silu_mul(x), mode, qdtype, scale)
                check_equal(q, qc.cpu(), f"{what}: q vs the chain")
                check_equal(s, sc.cpu(), f"{what}: scale vs the chain")
                qh, sh = _quant_chain(Q.silu_mul(x).cpu(), mode, qdtype, scale_h)
                check_equal(q, qh, f"{what}: q vs the CPU quantization of y")
                check_equal(s, sh, f"{what}: scale vs the CPU quantization of y")


