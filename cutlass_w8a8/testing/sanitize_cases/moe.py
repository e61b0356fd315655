"""Sanitizer cases: MoE routing (top-k softmax, route, align, permute-quant, unpermute), the grouped GEMM and the fused
decode path (moe_decode_experts)."""

from __future__ import annotations

import itertools

import torch

from ...ops._reference import moe_route_reference
from ..references import BLOCK, rand_scale, scale_magnitudes
from .core import (BF16, Ctx, F16, F32, FP8, I8, Q, _block_scales, _ceil, _operand, case, check_equal, check_gemm,
                   config_count)
from .quant_norm import _STATIC_SCALE


# ----------------------------------------------------------------------------------------------------
# MoE routing and the grouped GEMM


def _random_ids(ctx: Ctx, t, k, e, unrouted=0.0, dtype=torch.int32) -> torch.Tensor:
    """(T, k) expert ids in [0, E); a fraction ``unrouted`` set to -1 (an expert on another rank), one of them to
    E + 3 (out of range: unrouted too)."""
    ids = torch.randint(0, e, (t, k), generator=ctx.g)
    if unrouted:
        mask = torch.rand(t, k, generator=ctx.g) < unrouted
        ids[mask] = -1
        if mask.any():
            ids.view(-1)[int(mask.view(-1).nonzero()[0])] = e + 3
    return ids.to(dtype)


@case("moe_topk_softmax", ["moe_topk_softmax"])
def _moe_topk_softmax(ctx: Ctx) -> None:
    """moe_topk_softmax: E from 8 to 1024, top-k 2..16, renormalized or not, f32 / bf16 / f16 logits, strided logits:
    ids exactly as the CPU, weights within rtol 2e-5 (the exp and the sum order differ)."""
    for t, e, k, renorm, dtype, strided in ((1, 8, 2, True, F32, False), (37, 60, 4, False, BF16, False),
                                            (5, 128, 8, True, F16, True), (9, 1024, 16, True, F32, False)):
        what = f"moe_topk_softmax T={t} E={e} k={k} renormalize={renorm} {dtype} strided={strided}"
        with ctx.sub(what):
            logits_h = ctx.randn(t, e, dtype=dtype, std=2.0)
            logits = ctx.to(logits_h.t().contiguous()).t() if strided else ctx.to(logits_h)
            w, ids = Q.moe_topk_softmax(logits, k, renorm)
            w_ref, ids_ref = Q.moe_topk_softmax(logits_h, k, renorm)
            check_equal(ids, ids_ref, f"{what}: ids")
            torch.testing.assert_close(w.cpu(), w_ref, rtol=2e-5, atol=1e-7, msg=lambda m: f"{what}: weights: {m}")


@case("moe_route", ["moe_route"])
def _moe_route(ctx: Ctx) -> None:
    """moe_route: DeepSeek-V3 (sigmoid, bias, 8 groups keep 4), Kimi-K2 / GLM-4.5 (sigmoid, bias, no groups), OLMoE
    (softmax), E up to 1024 with 32 groups, f32 / bf16 / f16 and strided logits: ids and weights bit for bit against
    the reference's torch ops run on the same device (torch's sigmoid / softmax kernels there)."""
    params = [(7, 256, 8, "sigmoid", True, 8, 4, True, 2.5, F32, False),
              (5, 384, 8, "sigmoid", True, 1, 1, True, 2.827, BF16, True),
              (9, 160, 8, "sigmoid", True, 1, 1, True, 2.5, F16, False),
              (3, 64, 8, "softmax", False, 1, 1, False, 1.0, F32, False),
              (4, 1024, 16, "softmax", True, 32, 8, True, 1.0, BF16, False),
              (6, 512, 6, "sigmoid", False, 16, 3, False, 1.0, F32, True)]
    for t, e, k, scoring, biased, n_group, topk_group, renorm, scale, dtype, strided in (
            params[:3] if ctx.quick else params):
        what = (f"moe_route T={t} E={e} k={k} {scoring} bias={biased} groups={n_group}/{topk_group} "
                f"renormalize={renorm} scale={scale} {dtype} strided={strided}")
        with ctx.sub(what):
            logits_h = ctx.randn(t, e, dtype=dtype, std=2.0)
            logits = ctx.to(logits_h.t().contiguous()).t() if strided else ctx.to(logits_h)
            bias = ctx.to(ctx.randn(e, std=0.1)) if biased else None
            args = (k, scoring, bias, n_group, topk_group, renorm, scale)
            w, ids = Q.moe_route(logits, *args)
            w_ref, ids_ref = moe_route_reference(logits, *args)
            check_equal(ids, ids_ref.cpu(), f"{what}: ids")
            check_equal(w, w_ref.cpu(), f"{what}: weights")


@case("moe_router_route", ["moe_router_route"])
def _moe_router_route(ctx: Ctx) -> None:
    """moe_router_route (the router GEMM and the routing in one cluster kernel): Qwen3-MoE, Mixtral, DeepSeek-V3
    (float32 logits, sigmoid, bias, groups) and E = 1024 dims, T 1 / 9 / 16, bf16 / f16. x and the weight hold small
    integers, so every float32 sum is exact in any order: ids and weights bit for bit against moe_route run on the
    same device on the exact logits (a float64 F.linear) rounded to the logits dtype."""
    params = [(1, 128, 2048, 8, "softmax", False, 1, 1, True, 1.0, BF16, None),
              (9, 8, 4096, 2, "softmax", False, 1, 1, True, 1.0, F16, None),
              (16, 256, 7168, 8, "sigmoid", True, 8, 4, True, 2.5, BF16, F32),
              (5, 1024, 256, 16, "sigmoid", True, 32, 4, False, 1.0, BF16, None)]
    for t, e, h, k, scoring, biased, n_group, topk_group, renorm, scale, dtype, ldt in (
            params[:2] if ctx.quick else params):
        what = (f"moe_router_route T={t} E={e} H={h} k={k} {scoring} bias={biased} groups={n_group}/{topk_group} "
                f"{dtype} logits={ldt}")
        with ctx.sub(what):
            x = ctx.to(torch.randint(-3, 4, (t, h), generator=ctx.g).to(dtype))
            w = ctx.to((torch.randint(-3, 4, (e, h), generator=ctx.g) * 2.0**-6).to(dtype))
            bias = ctx.to(ctx.randn(e, std=0.1)) if biased else None
            args = (k, scoring, bias, n_group, topk_group, renorm, scale)
            tw, ids = Q.moe_router_route(x, w, *args, ldt)
            dt = dtype if ldt is None else ldt
            # the exact sums rounded to dt (a 16-bit cuBLAS GEMM may reduce in reduced precision: torch's
            # allow_bf16 / fp16_reduced_precision_reduction default to True)
            exact = torch.nn.functional.linear(x.double(), w.double()).float()
            w_ref, ids_ref = Q.moe_route(exact.to(dt), *args)
            check_equal(ids, ids_ref.cpu(), f"{what}: ids")
            check_equal(tw, w_ref.cpu(), f"{what}: weights")


@case("add_rms_norm_moe_router_route", ["add_rms_norm_moe_router_route"])
def _add_rms_norm_moe_router_route(ctx: Ctx) -> None:
    """add_rms_norm_moe_router_route (the post-attention norm folded into moe_router_route's cluster kernel):
    Qwen3-MoE dims at T 1 / 16 (the one-slice kernel), Mixtral's two H slices, a 1 MiB router (the 16-CTA kernel
    where resident), DeepSeek-V3 dims; bit for bit against fused_add_rms_norm on a copy of the residual then
    moe_router_route, on the same device; the residual is not written."""
    params = [(1, 128, 2048, 8, "softmax", False, 1, 1, BF16, None), (16, 128, 2048, 8, "softmax", False, 1, 1, F16,
                                                                        None),
              (9, 8, 4096, 2, "softmax", False, 1, 1, BF16, None), (5, 128, 4096, 8, "sigmoid", True, 1, 1, BF16, None),
              (3, 256, 7168, 8, "sigmoid", True, 8, 4, BF16, F32)]
    for t, e, h, k, scoring, biased, n_group, topk_group, dtype, ldt in (params[:2] if ctx.quick else params):
        what = f"add_rms_norm_moe_router_route T={t} E={e} H={h} k={k} {scoring} {dtype} logits={ldt}"
        with ctx.sub(what):
            x = ctx.to(ctx.randn(t, h, std=2.0).to(dtype))
            r = ctx.to(ctx.randn(t, h, std=4.0).to(dtype))
            nw = ctx.to((1 + 0.2 * ctx.randn(h, std=1.0)).to(dtype))
            w = ctx.to((ctx.randn(e, h, std=1.0) / h**0.5).to(dtype))
            bias = ctx.to(ctx.randn(e, std=0.1)) if biased else None
            args = (k, scoring, bias, n_group, topk_group, True, 2.5 if biased else 1.0, ldt)
            r_before = r.clone()
            got = Q.add_rms_norm_moe_router_route(x, r, nw, 1e-6, w, *args)
            stream = r.clone()
            y = Q.fused_add_rms_norm(x, stream, nw, 1e-6)
            want = (y, stream) + tuple(Q.moe_router_route(y, w, *args))
            check_equal(r, r_before.cpu(), f"{what}: residual written")
            for a, b, name in zip(got, want, ("y", "residual_out", "weights", "ids")):
                check_equal(a, b.cpu(), f"{what}: {name}")


@case("moe_align", ["moe_align"])
def _moe_align(ctx: Ctx) -> None:
    """moe_align (the stable counting sort of the (token, expert) pairs): unrouted and out-of-range ids, many empty
    experts (E = 128 > pairs), int32 and int64 ids; bit for bit against the CPU."""
    for t, k, e, unrouted, dtype in ((5, 2, 8, 0.2, torch.int32), (300, 8, 64, 0.05, torch.int64),
                                     (1, 1, 1, 0.0, torch.int32), (64, 4, 128, 0.0, torch.int32)):
        what = f"moe_align T={t} k={k} E={e} unrouted={unrouted} {dtype}"
        with ctx.sub(what):
            ids_h = _random_ids(ctx, t, k, e, unrouted, dtype)
            got, ref = Q.moe_align(ctx.to(ids_h), e), Q.moe_align(ids_h, e)
            for name, a, r in zip(("sorted_pairs", "dst_pos", "offsets"), got, ref):
                check_equal(a, r, f"{what}: {name}")


@case("moe_permute_quant", ["moe_permute_quant"])
def _moe_permute_quant(ctx: Ctx) -> None:
    """moe_permute_quant (gather into the experts' order + quantize) per token, per tensor and per 1x128 group, int8
    and fp8, rows in registers and in an 8-block cluster (H = 14336); bit for bit against the CPU."""
    params = [(7, 2, 5, 384, BF16, "dynamic", I8), (4, 3, 3, 1024, F32, "static", FP8),
              (5, 2, 8, 14336, BF16, "group", FP8), (33, 4, 16, 128, F16, "group", I8),
              (3, 2, 4, 16384, BF16, "dynamic", FP8)]
    for t, k, e, h, xdtype, mode, qdtype in (params[:3] if ctx.quick else params):
        if qdtype not in ctx.qdtypes:
            continue
        what = f"moe_permute_quant T={t} k={k} H={h} {xdtype} -> {qdtype} {mode}"
        with ctx.sub(what):
            sp_h = Q.moe_align(_random_ids(ctx, t, k, e, 0.1), e)[0]
            x_h = ctx.randn(t, h, dtype=xdtype, std=3.0)
            scale_h = torch.tensor([_STATIC_SCALE[qdtype]]) if mode == "static" else None
            group = BLOCK if mode == "group" else 0
            q, s = Q.moe_permute_quant(ctx.to(x_h), ctx.to(sp_h), k, qdtype, ctx.to(scale_h), group)
            q_ref, s_ref = Q.moe_permute_quant(x_h, sp_h, k, qdtype, scale_h, group)
            check_equal(q, q_ref, f"{what}: q")
            check_equal(s, s_ref, f"{what}: scale")


@case("moe_unpermute", ["moe_unpermute", "moe_unpermute_out"])
def _moe_unpermute(ctx: Ctx) -> None:
    """moe_unpermute (weighted sum back into token order, unrouted pairs skipped), functional and out=; bit for bit
    against the CPU (the same float32 operations in the same order)."""
    for t, k, e, h, dtype, use_out in ((7, 2, 8, 384, BF16, False), (33, 8, 64, 128, F32, True),
                                       (4, 3, 3, 1024, F16, True)):
        what = f"moe_unpermute T={t} k={k} H={h} {dtype} out={use_out}"
        with ctx.sub(what):
            dst_h = Q.moe_align(_random_ids(ctx, t, k, e, 0.1), e)[1]
            y_h = ctx.randn(t * k, h, dtype=dtype)
            w_h = torch.rand(t, k, generator=ctx.g)
            y, dst, w = ctx.to(y_h), ctx.to(dst_h), ctx.to(w_h)
            if use_out:
                out = ctx.nan((t, h), dtype)
                Q.moe_unpermute_out(out, y, dst, w)
            else:
                out = Q.moe_unpermute(y, dst, w)
            check_equal(out, Q.moe_unpermute(y_h, dst_h, w_h), what)


def _group_ends(ctx: Ctx, t: int, e: int, kind: str) -> list[int]:
    """The end row of each expert's group: "empty" (experts 0, 1, E // 2 and E - 1 get no rows), "tail" (the same,
    with 3 rows routed to no expert), "one" (every row on expert E // 2)."""
    counts = [0] * e
    if kind == "one":
        counts[e // 2] = t
    else:
        allowed = [x for x in range(e) if x not in (0, 1, e // 2, e - 1)] or [e // 2]
        routed = max(t - 3, 0) if kind == "tail" else t
        for i in torch.randint(0, len(allowed), (routed,), generator=ctx.g).tolist():
            counts[allowed[i]] += 1
    return list(itertools.accumulate(counts))


def _grouped(ctx: Ctx, t, n, k, e, dtype, kind, *, sa_kind="token", sb_kind="channel", bias=True, out_dtype=BF16,
             functional=False, block=False, bad_offsets=False, config=None) -> None:
    """One grouped_scaled_mm call checked expert by expert against the dense float64 reference; with out= (NaN
    first) the rows past the last expert's end must stay untouched. ``config``: _grouped_scaled_mm_config with that
    entry of the grouped table (out= only)."""
    what = (f"grouped_scaled_mm T={t} E={e} N={n} K={k} {'block' if block else dtype} {kind} sa={sa_kind} "
            f"sb={sb_kind} bias={bias} -> {out_dtype} functional={functional} bad_offsets={bad_offsets}"
            + ("" if config is None else f" config={config}"))
    with ctx.sub(what):
        a_h, w_h = _operand(ctx, (t, k), dtype), _operand(ctx, (e, n, k), dtype)
        if block:
            sa_h = _block_scales(ctx, (t, k // BLOCK), k)
            sb_h = _block_scales(ctx, (e, _ceil(n, BLOCK), k // BLOCK), k)
        else:
            ma, mb = scale_magnitudes(dtype, k)
            sa_h = rand_scale({"token": (t, 1), "token1d": (t,), "tensor": (1,)}[sa_kind], "cpu", ma, ctx.g)
            sb_h = rand_scale({"channel": (e, n), "expert": (e,), "expert2d": (e, 1)}[sb_kind], "cpu", mb, ctx.g)
        b_h = ctx.randn(e, n, dtype=out_dtype, std=2.0) if bias else None
        if bad_offsets:  # the device clamps: c[e] = min(T, max(c[e - 1], offsets[e])); the CPU refuses them
            assert e == 4
            ends = [t // 2, t // 2, t, t]
            given = torch.tensor([t // 2, -5, t + 100, t // 3] if ctx.cuda else ends, dtype=torch.int32)
        else:
            ends = _group_ends(ctx, t, e, kind)
            given = torch.tensor(ends, dtype=torch.int32)
        a, w, sa, sb, offs, b = (ctx.to(x) for x in (a_h, w_h, sa_h, sb_h, given, b_h))
        routed = ends[-1]
        if config is not None:
            out = ctx.nan((t, n), out_dtype)
            Q._grouped_scaled_mm_config(out, a, w.transpose(1, 2), sa, sb, offs, b, config)
            got = out.cpu()
            assert torch.isnan(got[routed:].float()).all(), f"{what}: rows >= offsets[-1] = {routed} were written"
        elif functional and not ctx.tma_out(t, ctx.grouped_decode_rows):
            out = Q.grouped_scaled_mm(a, w.transpose(1, 2), sa, sb, offs, out_dtype, b)
            got = out[:routed].cpu()  # rows past the last end are unspecified in a fresh result
        else:
            out = ctx.nan((t, n), out_dtype)
            Q.grouped_scaled_mm_out(out, a, w.transpose(1, 2), sa, sb, offs, b)
            got = out.cpu()
            assert torch.isnan(got[routed:].float()).all(), f"{what}: rows >= offsets[-1] = {routed} were written"
        start = 0
        for x, end in enumerate(ends):
            if end > start:
                rows = slice(start, end)
                be = None if b_h is None else b_h[x]
                name = f"{what}: expert {x} rows [{start}, {end})"
                if block:
                    check_gemm(got[rows], a_h[rows], w_h[x].t(), sa_h[rows], sb_h[x], be, name, block=True)
                else:
                    sa_e = sa_h.reshape(-1)[rows] if sa_h.numel() != 1 else sa_h.reshape(1)
                    sb_e = sb_h[x] if sb_h.dim() == 2 and sb_h.shape[1] == n else sb_h.reshape(-1)[x:x + 1]
                    check_gemm(got[rows], a_h[rows], w_h[x].t(), sa_e, sb_e, be, name)
            start = max(start, end)


@case("grouped_scaled_mm", ["grouped_scaled_mm", "grouped_scaled_mm_out"], needs_sm90=True)
def _grouped_scaled_mm(ctx: Ctx) -> None:
    """grouped_scaled_mm int8, fp8 and block fp8 with empty experts (first, last, inner), unrouted tail rows and all
    rows on one expert; T on both sides of the grouped decode bound (64 rows) and of the CUTLASS Small / Mid / Large
    switches (16 E, 64 E; at E = 8: Small up to T 128, Mid up to 512, int8's Mid being its Large): fp8 65 / 512 / 600,
    block 128 / 129 / 513; per-token / per-tensor x per-channel / per-expert scales; a K tail (K = 400) in the decode
    kernel; offsets the device must clamp."""
    e, n, k = 8, 272, 512
    rows = [(I8, 5, "empty", dict(functional=True)),
            (I8, 64, "tail", dict(sa_kind="tensor", sb_kind="expert", bias=False, out_dtype=F16)),
            (I8, 100, "empty", dict(sb_kind="expert2d")),
            (I8, 300, "tail", {}),
            (FP8, 1, "one", dict(sa_kind="token1d", sb_kind="expert")),
            (FP8, 33, "empty", dict(bias=False, out_dtype=F16, functional=True)),
            (FP8, 65, "tail", dict(sa_kind="tensor")),
            (FP8, 600, "empty", dict(bias=False)),
            (FP8, 512, "tail", dict(sb_kind="expert2d"))]
    blocks = [(7, "empty", dict(functional=True)), (64, "tail", dict(out_dtype=F16)), (128, "tail", {}),
              (129, "empty", {}), (513, "one", dict(bias=False))]
    if ctx.quick:
        rows, blocks = [rows[i] for i in (0, 3, 5, 7)], [blocks[0], blocks[4]]
    for dtype, t, kind, kw in rows:
        if dtype in ctx.qdtypes:
            _grouped(ctx, t, n, k, e, dtype, kind, **kw)
    if FP8 in ctx.qdtypes:
        for t, kind, kw in blocks:
            _grouped(ctx, t, 208, 384, e, FP8, kind, block=True, **kw)
    _grouped(ctx, 9, n, 400, e, I8, "empty")  # K % 64 != 0 in the grouped decode kernel
    for t in ((3,) if ctx.quick else (3, 600)):
        _grouped(ctx, t, 128, 256, 4, I8, "clamped", bad_offsets=True)




def _grouped_num_configs(ctx: Ctx, dtype, block: bool) -> int:
    """Entries of the grouped table serving these operands, read from the error of a config index far past it
    ("`config` must be in [0, N)"). The CPU implementation ignores the config: one call drives it there."""
    if not ctx.cuda:
        return 1
    k, n, e = 256, 128, 2
    a = ctx.to(torch.zeros(4, k).to(dtype))
    w = ctx.to(torch.zeros(e, n, k).to(dtype))
    sa = ctx.to(torch.ones(4, k // BLOCK) if block else torch.ones(4, 1))
    sb = ctx.to(torch.ones(e, n // BLOCK, k // BLOCK) if block else torch.ones(e, n))
    offs = ctx.to(torch.tensor([2, 4], dtype=torch.int32))
    out = ctx.to(torch.zeros(4, n, dtype=BF16))
    wt = w.transpose(1, 2)
    return config_count(lambda config: Q._grouped_scaled_mm_config(out, a, wt, sa, sb, offs, None, config),
                        "_grouped_scaled_mm_config", f"{dtype} (block={block})")


@case("grouped_scaled_mm_configs", ["_grouped_scaled_mm_config"], needs_sm90=True)
def _grouped_scaled_mm_configs(ctx: Ctx) -> None:
    """Every entry of the int8, fp8 and block-fp8 grouped tables forced with _grouped_scaled_mm_config (the tuning
    candidates too when built with CUTLASS_W8A8_TUNE naming grouped) at T = 300 with empty experts and unrouted tail
    rows (N = 272: a partial N tile; block: N = 208, a partial weight block); --no-configs: the first of each."""
    tables = [(dtype, False) for dtype in ctx.qdtypes] + ([(FP8, True)] if FP8 in ctx.qdtypes else [])
    for dtype, block in tables:
        count = _grouped_num_configs(ctx, dtype, block)
        if count < 1:
            ctx.failures.append(f"the grouped {'block' if block else dtype} table is empty")
        for config in range(count if ctx.configs else min(count, 1)):
            if block:
                _grouped(ctx, 300, 208, 384, 8, FP8, "tail", block=True, config=config)
            else:
                _grouped(ctx, 300, 272, 512, 8, dtype, "tail", config=config)


def _decode_chain(ctx: Ctx, x, ids, wts, w13, s13, w2, s2, group, out_dtype):
    """The unfused chain moe_decode_experts equals bit for bit, on ctx's device: moe_align, moe_permute_quant,
    grouped_scaled_mm_out (w13), silu_mul_quant, grouped_scaled_mm_out (w2), moe_unpermute. The GEMM outputs are
    host-written NaN buffers, so the rows of unrouted pairs (never written by the GEMMs, never read back by
    moe_unpermute) are initialised memory for initcheck."""
    t, k = ids.shape
    e, i2, h = w13.shape
    sorted_pairs, dst_pos, offsets = Q.moe_align(ids, e)
    q, s = Q.moe_permute_quant(x, sorted_pairs, k, w13.dtype, None, group)
    y13 = ctx.nan((t * k, i2), out_dtype)
    Q.grouped_scaled_mm_out(y13, q, w13.transpose(1, 2), s, s13, offsets, None)
    q2, sq2 = Q.silu_mul_quant(y13, w13.dtype, None, group)
    y2 = ctx.nan((t * k, h), out_dtype)
    Q.grouped_scaled_mm_out(y2, q2, w2.transpose(1, 2), sq2, s2, offsets, None)
    return Q.moe_unpermute(y2, dst_pos, wts)


@case("moe_decode_experts", ["moe_decode_experts"], needs_sm90=True)
def _moe_decode_experts(ctx: Ctx) -> None:
    """moe_decode_experts (the fused MoE decode path, 2 or 3 kernels) int8, fp8 and block fp8, per-channel and
    per-expert weight scales, T * top_k from 1 to 64, 8 and 128 experts (most of them empty), unrouted and
    out-of-range ids and a token with none routed, int32 / int64 ids, f32 / bf16 / f16 x, bf16 / f16 out: bit for
    bit against the unfused chain on the same device, no NaN in the fresh output."""
    params = [(1, 1, 8, 256, 128, I8, "channel", BF16, BF16, torch.int32),
              (8, 8, 128, 256, 128, FP8, "expert", F32, BF16, torch.int64),
              (16, 4, 8, 256, 256, FP8, "block", BF16, F16, torch.int32),
              (32, 2, 128, 512, 128, I8, "expert2d", F16, F16, torch.int64),
              (64, 1, 8, 384, 256, FP8, "channel", BF16, BF16, torch.int32)]
    for t, k, e, h, i, dtype, sb_kind, xdtype, out_dtype, id_dtype in (
            [params[i] for i in (0, 1, 2)] if ctx.quick else params):
        if dtype not in ctx.qdtypes:
            continue
        block = sb_kind == "block"
        what = (f"moe_decode_experts T={t} k={k} E={e} H={h} I={i} {dtype} {sb_kind} x {xdtype} -> {out_dtype} "
                f"ids {id_dtype}")
        with ctx.sub(what):
            ids_h = _random_ids(ctx, t, k, e, 0.15, id_dtype)
            if t > 1:
                ids_h[-1] = -1  # a token with no routed pair: zeros
            w_h = torch.rand(t, k, generator=ctx.g) + 0.1
            x_h = ctx.randn(t, h, dtype=xdtype, std=2.0)
            w13_h, w2_h = _operand(ctx, (e, 2 * i, h), dtype), _operand(ctx, (e, h, i), dtype)
            if block:
                s13_h = _block_scales(ctx, (e, _ceil(2 * i, BLOCK), h // BLOCK), h)
                s2_h = _block_scales(ctx, (e, _ceil(h, BLOCK), i // BLOCK), i)
            else:
                shapes = {"channel": ((e, 2 * i), (e, h)), "expert": ((e,), (e,)), "expert2d": ((e, 1), (e, 1))}
                (sh13, sh2), rms = shapes[sb_kind], (74.0 if dtype == I8 else 1.0)
                s13_h = rand_scale(sh13, "cpu", 2.0 / (rms * h ** 0.5), ctx.g)
                s2_h = rand_scale(sh2, "cpu", 2.0 / (rms * i ** 0.5), ctx.g)
            args = [ctx.to(v) for v in (x_h, ids_h, w_h, w13_h, s13_h, w2_h, s2_h)]
            group = BLOCK if block else 0
            out = Q.moe_decode_experts(*args, group, out_dtype)
            ref = _decode_chain(ctx, *args, group, out_dtype)
            got = out.cpu()
            assert not torch.isnan(got.float()).any(), f"{what}: NaN in the output"
            check_equal(got, ref.cpu(), what)
            if t > 1:
                assert bool((got[-1] == 0).all()), f"{what}: the token with no routed pair is not zero"
