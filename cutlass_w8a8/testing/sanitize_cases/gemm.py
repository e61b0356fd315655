"""Sanitizer cases: the dense GEMMs (row-wise, K tails, forced configs, block fp8, decode, w8a8_linear)."""

from __future__ import annotations

import math

import torch

from ..references import BLOCK, rand_scale, scale_magnitudes
from .core import (BF16, Ctx, F16, FP8, I8, Q, QMAX, _block_scales, _ceil, _operand, _rowwise_scales, case, check_gemm,
                   config_count)


# ----------------------------------------------------------------------------------------------------
# dense GEMMs


def _gemm(ctx: Ctx, m, n, k, dtype, out_dtype, bias_on, per_token, use_out, *, op="scaled_mm", config=None,
          windowed=False, block=False) -> None:
    """One call of ``op`` (scaled_mm, scaled_mm_decode; _scaled_mm_config with ``config``) checked against the
    float64 reference. ``windowed``: a, the weight and out are windows of wider buffers (16-byte aligned)."""
    what = (f"{op} M={m} N={n} K={k} {dtype} -> {out_dtype} bias={bias_on} "
            f"{'block' if block else ('per-token' if per_token else 'per-tensor')} out={use_out} config={config} "
            f"windowed={windowed}")
    with ctx.sub(what):
        if windowed:
            a_buf, w_buf = _operand(ctx, (m, k + 48), dtype), _operand(ctx, (n, k + 32), dtype)
            a_h, w_h = a_buf[:, 16:16 + k], w_buf[:, 32:]
            a, w = ctx.to(a_buf)[:, 16:16 + k], ctx.to(w_buf)[:, 32:]
        else:
            a_h, w_h = _operand(ctx, (m, k), dtype), _operand(ctx, (n, k), dtype)
            a, w = ctx.to(a_h), ctx.to(w_h)
        if block:
            sa_h, sb_h = _block_scales(ctx, (m, k // BLOCK), k), _block_scales(ctx, (_ceil(n, BLOCK), k // BLOCK), k)
        else:
            sa_h, sb_h = _rowwise_scales(ctx, m, n, k, dtype, per_token)
        bias_h = ctx.randn(n, dtype=out_dtype, std=4.0) if bias_on else None
        sa, sb, bias = ctx.to(sa_h), ctx.to(sb_h), ctx.to(bias_h)
        out_buf = None
        if windowed:
            out_buf = ctx.to(torch.full((m, n + 24), 7.0, dtype=out_dtype))
            out = out_buf[:, 8:8 + n]
        elif use_out or config is not None or (op == "scaled_mm" and ctx.tma_out(m)):
            out = ctx.nan((m, n), out_dtype)
        else:
            out = None
        if config is not None:
            Q._scaled_mm_config(out, a, w.t(), sa, sb, bias, config)
        elif out is None:
            out = getattr(Q, op)(a, w.t(), sa, sb, out_dtype, bias)
        else:
            getattr(Q, f"{op}_out")(out, a, w.t(), sa, sb, bias)
        ctx.sync()
        if m:
            check_gemm(out, a_h, w_h.t(), sa_h, sb_h, bias_h, what, block)
        if out_buf is not None:
            o = out_buf.cpu()
            assert (o[:, :8] == 7).all() and (o[:, 8 + n:] == 7).all(), f"{what}: wrote outside out"


def _combos(ctx: Ctx):
    """(out dtype, bias, per-token scales): all four pairings of each two-valued choice with the others' values
    (an orthogonal array of the 8 combinations); --quick: two that flip all three."""
    if ctx.quick:
        return [(BF16, False, False), (F16, True, True)]
    return [(BF16, False, False), (BF16, True, True), (F16, False, True), (F16, True, False)]


@case("scaled_mm_rowwise", ["scaled_mm", "scaled_mm_out"])
def _scaled_mm_rowwise(ctx: Ctx) -> None:
    """Row-wise scaled_mm at one M per dispatch bucket (M <= 8 the decode GEMM), int8 and fp8, both output dtypes,
    bias or not, per-tensor and per-token/per-channel scales, functional and out=; M = 0; windowed operands."""
    for m in ctx.ms:
        for dtype in ctx.qdtypes:
            for i, (out_dtype, bias_on, per_token) in enumerate(_combos(ctx)):
                _gemm(ctx, m, ctx.n, ctx.k, dtype, out_dtype, bias_on, per_token, use_out=i % 2 == 1)
    for dtype in ctx.qdtypes:
        _gemm(ctx, 0, ctx.n, ctx.k, dtype, BF16, True, True, use_out=False)
        _gemm(ctx, 0, ctx.n, ctx.k, dtype, BF16, True, True, use_out=True)
        _gemm(ctx, 100, ctx.n, ctx.k, dtype, BF16, True, True, use_out=True, windowed=True)


@case("scaled_mm_k_tail", ["scaled_mm"])
def _scaled_mm_k_tail(ctx: Ctx) -> None:
    """K = 400 (a multiple of 16, not of 64 or 128: the K tails), N = 272 (a partial N tile), decode and CUTLASS M."""
    for dtype in ctx.qdtypes:
        for m in (1, 100):
            _gemm(ctx, m, 272, 400, dtype, BF16, True, True, use_out=False)


def _num_configs(ctx: Ctx, dtype, block: bool = False) -> int:
    """Entries of the config table serving these operands, read from the error of a config index far past it
    ("`config` must be in [0, N)"). The CPU implementation ignores the config: one call drives it there."""
    if not ctx.cuda:
        return 1
    k = 256
    a = ctx.to(torch.zeros(1, k).to(dtype))
    b = ctx.to(torch.zeros(16, k).to(dtype)).t()
    sa = ctx.to(torch.ones(1, k // BLOCK) if block else torch.ones(1))
    sb = ctx.to(torch.ones(1, k // BLOCK) if block else torch.ones(1))
    out = ctx.to(torch.zeros(1, 16, dtype=BF16))
    return config_count(lambda config: Q._scaled_mm_config(out, a, b, sa, sb, None, config), "_scaled_mm_config",
                        f"{dtype} (block={block})")


@case("scaled_mm_configs", ["_scaled_mm_config"])
def _scaled_mm_configs(ctx: Ctx) -> None:
    """Every entry of the int8, fp8 and block-fp8 config tables forced with _scaled_mm_config (the tuning candidates
    too when built with CUTLASS_W8A8_TUNE=1); --no-configs: the first of each."""
    tables = [(dtype, False) for dtype in ctx.qdtypes] + ([(FP8, True)] if ctx.sm90 and ctx.fp8 else [])
    for dtype, block in tables:
        count = _num_configs(ctx, dtype, block)
        if count < 1:
            ctx.failures.append(f"the {'block' if block else dtype} config table is empty")
        for config in range(count if ctx.configs else min(count, 1)):
            _gemm(ctx, 100, ctx.n, ctx.k, dtype, BF16, True, True, use_out=True, config=config, block=block)


@case("scaled_mm_block", ["scaled_mm", "scaled_mm_out"], needs_sm90=True)
def _scaled_mm_block(ctx: Ctx) -> None:
    """Block-scaled fp8 (1x128 activation groups x 128x128 weight blocks) through scaled_mm: decode M (the decode
    GEMM's block steps) and every CUTLASS block bucket; N = 208 (a partial last weight block), K = 384 (3 blocks)."""
    ms = (1, 16, 300) if ctx.quick else (1, 7, 16, 100, 300)
    for i, m in enumerate(ms):
        _gemm(ctx, m, 208, 384, FP8, (BF16, F16)[i % 2], i % 2 == 0, True, use_out=i % 2 == 1, block=True)


@case("scaled_mm_decode", ["scaled_mm_decode", "scaled_mm_decode_out"])
def _scaled_mm_decode(ctx: Ctx) -> None:
    """The decode GEMM called directly, M = 1..16 (one and two token tiles), split-K (N = 256: 16 blocks) and not
    (N = 2304: 144 blocks), padded rows of a, and block fp8 at decode M."""
    ms = (1, 9, 16) if ctx.quick else (1, 8, 9, 16)
    for i, m in enumerate(ms):
        for dtype in ctx.qdtypes:
            _gemm(ctx, m, 256, 512, dtype, (BF16, F16)[i % 2], i % 2 == 0, i % 3 != 2, use_out=i % 2 == 1,
                  op="scaled_mm_decode")
    _gemm(ctx, 4, 2304, 256, I8, BF16, True, True, use_out=False, op="scaled_mm_decode")
    _gemm(ctx, 3, 256, 512, ctx.qdtypes[-1], BF16, False, True, use_out=True, op="scaled_mm_decode", windowed=True)
    if ctx.sm90 and ctx.fp8:
        for m in ((16,) if ctx.quick else (5, 16)):
            _gemm(ctx, m, 208, 384, FP8, BF16, True, True, use_out=m == 16, op="scaled_mm_decode", block=True)


@case("linear_decode", ["linear_decode", "linear_decode_out"])
def _linear_decode(ctx: Ctx) -> None:
    """linear_decode (per-token quantization of x fused into the decode GEMM), M = 1, 5, 16, int8 and fp8, bf16 and
    fp16 x, per-channel scales as (N,) and (N, 1), bias or not, functional and out=."""
    n, k = 256, 512
    for m, dtype, xdtype, bias_on, use_out in ((1, I8, BF16, True, False), (16, I8, F16, False, True),
                                               (5, FP8, BF16, False, True), (16, FP8, F16, True, False)):
        if dtype not in ctx.qdtypes:
            continue
        what = f"linear_decode M={m} {xdtype} -> {dtype} bias={bias_on} out={use_out}"
        with ctx.sub(what):
            x_h = ctx.randn(m, k, dtype=xdtype, std=3.0)
            w_h = _operand(ctx, (n, k), dtype)
            sb_h = rand_scale((n, 1) if use_out else (n,), "cpu", scale_magnitudes(dtype, k)[1], ctx.g)
            bias_h = ctx.randn(n, dtype=xdtype, std=2.0) if bias_on else None
            x, w, sb, bias = ctx.to(x_h), ctx.to(w_h), ctx.to(sb_h), ctx.to(bias_h)
            if use_out:
                out = ctx.nan((m, n), xdtype)
                Q.linear_decode_out(out, x, w.t(), sb, bias, dtype)
            else:
                out = Q.linear_decode(x, w.t(), sb, bias, dtype)
            ctx.sync()
            q, s = Q.quantize_per_token(x_h, dtype)  # the CPU quantization equals the kernel's bit for bit
            check_gemm(out, q, w_h.t(), s, sb_h.reshape(-1), bias_h, what)


@case("add_rms_norm_linear_decode", ["add_rms_norm_linear_decode"])
def _add_rms_norm_linear_decode(ctx: Ctx) -> None:
    """add_rms_norm_linear_decode (residual add, RMSNorm and per-token quantization fused into the decode GEMM),
    M = 1, 5, 16, int8 and fp8, bf16 and fp16, residual or None, bias or not; checked against the device's
    rms_norm_quant chain (q and its scales) and the residual add."""
    n, k, eps = 256, 512, 1e-6
    for m, dtype, xdtype, res_on, bias_on in ((1, I8, BF16, False, True), (16, I8, F16, True, False),
                                              (5, FP8, BF16, True, True), (16, FP8, F16, False, False)):
        if dtype not in ctx.qdtypes:
            continue
        what = f"add_rms_norm_linear_decode M={m} {xdtype} -> {dtype} residual={res_on} bias={bias_on}"
        with ctx.sub(what):
            x_h = ctx.randn(m, k, dtype=xdtype, std=3.0)
            r_h = ctx.randn(m, k, dtype=xdtype, std=3.0) if res_on else None
            nw_h = ctx.randn(k, dtype=xdtype, std=1.0)
            w_h = _operand(ctx, (n, k), dtype)
            sb_h = rand_scale((n,), "cpu", scale_magnitudes(dtype, k)[1], ctx.g)
            bias_h = ctx.randn(n, dtype=xdtype, std=2.0) if bias_on else None
            x, r, nw, w, sb, bias = (ctx.to(t) for t in (x_h, r_h, nw_h, w_h, sb_h, bias_h))
            out, r_out = Q.add_rms_norm_linear_decode(x, r, nw, eps, w.t(), sb, bias, dtype)
            stream = r.clone() if r is not None else None
            q, s = Q.rms_norm_quant(x, nw, eps, dtype, None, stream)
            ctx.sync()
            expect_r = (x_h if r_h is None else (r_h.float() + x_h.float()).to(xdtype))
            if not torch.equal(r_out.cpu(), expect_r):
                raise AssertionError(f"{what}: residual_out differs from residual + x")
            check_gemm(out, q.cpu(), w_h.t(), s.cpu(), sb_h, bias_h, what)


@case("w8a8_linear", ["w8a8_linear"])
def _w8a8_linear(ctx: Ctx) -> None:
    """w8a8_linear (quantize x, then the GEMM, one op): per-token and static per-tensor int8 / fp8, block fp8 weights
    (x quantized per 1x128 group), decode M and CUTLASS M, a 3-D x."""
    params = [((2, 3, 512), I8, False, False, BF16, True),   # M = 6: the decode GEMM
              ((100, 512), I8, True, False, F16, False),     # static per-tensor, CUTLASS
              ((5, 512), FP8, False, False, BF16, False),
              ((40, 512), FP8, True, False, BF16, True),
              ((1, 384), FP8, False, True, BF16, True),      # block weights, decode
              ((100, 384), FP8, False, True, F16, False)]    # block weights, CUTLASS
    if ctx.quick:
        params = [params[i] for i in (0, 1, 4, 5)]
    n_row, n_block = 256, 208
    for shape, dtype, static, block, out_dtype, bias_on in params:
        if dtype not in ctx.qdtypes or (block and not ctx.sm90):
            continue
        k = shape[-1]
        n = n_block if block else n_row
        m = math.prod(shape[:-1])
        what = f"w8a8_linear x={shape} {dtype} static={static} block={block} -> {out_dtype} bias={bias_on}"
        with ctx.sub(what):
            x_h = ctx.randn(*shape, dtype=BF16, std=2.0)
            w_h = _operand(ctx, (n, k), dtype)
            ws_h = (_block_scales(ctx, (_ceil(n, BLOCK), k // BLOCK), k) if block else
                    rand_scale((n, 1), "cpu", scale_magnitudes(dtype, k)[1], ctx.g))
            is_h = (x_h.float().abs().amax() / QMAX[dtype]).reshape(1) if static else None
            bias_h = ctx.randn(n, dtype=out_dtype, std=2.0) if bias_on else None
            out = Q.w8a8_linear(ctx.to(x_h), ctx.to(w_h), ctx.to(ws_h), ctx.to(is_h), ctx.to(bias_h), out_dtype)
            ctx.sync()
            if ctx.tma_out(m):
                continue  # initcheck: no out= form, and the CUTLASS epilogue's TMA stores are invisible to it
            x2 = x_h.reshape(-1, k)
            if block:
                q, s = Q.quantize_per_token_group(x2, BLOCK, FP8)
            elif static:
                q, s = Q.quantize_per_tensor(x2, is_h, dtype), is_h
            else:
                q, s = Q.quantize_per_token(x2, dtype)
            check_gemm(out.reshape(m, n), q, w_h.t(), s, ws_h if block else ws_h.reshape(-1), bias_h, what, block)


