"""Sanitizer cases: CUDA graphs, capture + replay with new inputs (torch's caching allocator on)."""

from __future__ import annotations

import math
from typing import Callable

import torch

from ...graphs import UpdatableGraph, capture
from ..references import BLOCK, rand_scale, scale_magnitudes
from .core import (BF16, Ctx, FP8, I8, Q, _block_scales, _ceil, _operand, _rowwise_scales, case, check_equal, check_gemm,
                   check_loose)


# ----------------------------------------------------------------------------------------------------
# CUDA graphs: capture + replay with new inputs (torch's caching allocator on)


def _replay_and_compare(ctx: Ctx, what: str, fn: Callable, inputs_h: list, steps: list, cpu_fn: Callable) -> None:
    """On CUDA: capture ``fn(*static)`` (`cutlass_w8a8.graphs.capture`), then per step copy the step's host inputs
    in, replay, and compare with the eager ``fn`` on the same inputs (bit for bit) and with ``cpu_fn`` (the chain on
    the CPU, `check_loose`). On the CPU: ``fn`` eagerly per step against ``cpu_fn``."""
    if ctx.cuda:
        static = [ctx.to(x) for x in inputs_h]
        graph, out = capture(fn, static)  # warm-up and capture run fn on inputs_h (state, e.g. a cache, changes)
    else:
        fn(*[ctx.to(x) for x in inputs_h])
    cpu_fn(*inputs_h)  # the same history on the CPU
    for i, step_h in enumerate(steps):
        with ctx.sub(f"{what} step {i}"):
            if ctx.cuda:
                for dst, src in zip(static, step_h):
                    dst.copy_(ctx.to(src))
                graph.replay()
                ctx.sync()
                replayed = out.cpu().clone()
                eager = fn(*[ctx.to(x) for x in step_h]).cpu()
                check_equal(replayed, eager, f"{what} step {i}: replay vs eager")
            else:
                replayed = fn(*[ctx.to(x) for x in step_h]).clone()
            check_loose(replayed, cpu_fn(*step_h), f"{what} step {i}")


def _moe_weights(ctx: Ctx, e, hidden, inter, block):
    """Host (w13 (E, 2I, H), s13, w2 (E, H, I), s2): int8 with per-channel scales, or e4m3 with 128x128 block
    scales."""
    out = []
    for n, k in ((2 * inter, hidden), (hidden, inter)):
        dtype = FP8 if block else I8
        w = _operand(ctx, (e, n, k), dtype)
        s = (_block_scales(ctx, (e, _ceil(n, BLOCK), k // BLOCK), k) if block
             else rand_scale((e, n), "cpu", 1.0 / (74.0 * k ** 0.5), ctx.g))
        out += [w, s]
    return out


@case("graph_moe", ["moe_topk_softmax", "moe_align", "moe_permute_quant", "grouped_scaled_mm_out", "silu_mul_quant",
                    "moe_unpermute_out"], graphs=True, needs_sm90=True)
def _graph_moe(ctx: Ctx) -> None:
    """The MoE layer's op chain (router top-k, align, permute-quant, grouped GEMM, SiLU-quant, grouped GEMM, unpermute)
    captured into a CUDA graph and replayed with new router logits and hidden states: int8 at 48 routed rows (grouped
    decode kernel), block fp8 at 160 (CUTLASS grouped); experts 0 and 5 never chosen (empty)."""
    e, hidden, inter, top_k = 8, 256, 256, 2
    for block, t in ((False, 24), (True, 80)):
        if block and FP8 not in ctx.qdtypes:
            continue
        qd, group = (FP8, BLOCK) if block else (I8, 0)
        w_h = _moe_weights(ctx, e, hidden, inter, block)

        def make(on_dev: bool):
            cv = ctx.to if on_dev else (lambda x: x.clone())
            w13, s13, w2, s2 = (cv(x) for x in w_h)
            nan = ctx.nan if on_dev else (lambda shape, dtype: torch.full(shape, float("nan"), dtype=dtype))
            h_buf, y_buf = nan((t * top_k, 2 * inter), BF16), nan((t * top_k, hidden), BF16)
            out_buf = nan((t, hidden), BF16)

            def chain(logits, x):
                tw, ids = Q.moe_topk_softmax(logits, top_k, True)
                sp, dst, offs = Q.moe_align(ids, e)
                q, s = Q.moe_permute_quant(x, sp, top_k, qd, None, group)
                Q.grouped_scaled_mm_out(h_buf, q, w13.transpose(1, 2), s, s13, offs, None)
                q2, sq2 = Q.silu_mul_quant(h_buf, qd, None, group)
                Q.grouped_scaled_mm_out(y_buf, q2, w2.transpose(1, 2), sq2, s2, offs, None)
                Q.moe_unpermute_out(out_buf, y_buf, dst, tw)
                return out_buf

            return chain

        def inputs():
            logits = ctx.randn(t, e, std=2.0)
            logits[:, 0] = logits[:, 5] = -30.0  # never chosen: empty experts
            return [logits, ctx.randn(t, hidden, dtype=BF16)]

        _replay_and_compare(ctx, f"graph_moe {'block fp8' if block else 'int8'} T={t}", make(True), inputs(),
                            [inputs(), inputs()], make(False))


@case("graph_decode", ["rms_norm_quant", "scaled_mm_out", "rope_kv_cache_", "decode_attention_quant",
                       "scaled_mm_decode_out", "linear_decode_out"], graphs=True)
def _graph_decode(ctx: Ctx) -> None:
    """A decode step's op chain (norm-quant, qkv GEMM at M = 4 (the decode GEMM), rope + cache, attention-quant,
    o_proj, a fused linear_decode) captured and replayed with new hidden states, positions and rotary tables."""
    b, hidden, heads, kv_heads, d, s, inter = 4, 256, 4, 2, 64, 32, 256
    qkv_n = (heads + 2 * kv_heads) * d
    norm_h = 1 + ctx.randn(hidden, dtype=BF16, std=0.1)
    weights_h = [(_operand(ctx, (n, k), I8), rand_scale((n, 1), "cpu", 1.0 / (74.0 * k ** 0.5), ctx.g))
                 for n, k in ((qkv_n, hidden), (hidden, heads * d), (2 * inter, hidden))]
    kv_h = ctx.randn(b + 1, 2, kv_heads, s, d, dtype=BF16)
    slots_h = torch.randperm(b + 1, generator=ctx.g)[:b]

    def make(on_dev: bool):
        cv = ctx.to if on_dev else (lambda x: x.clone())
        nw, kv, slots = cv(norm_h), cv(kv_h), cv(slots_h)
        (wqkv, sqkv), (wo, so), (wgu, sgu) = ((cv(w), cv(sc)) for w, sc in weights_h)
        nan = ctx.nan if on_dev else (lambda shape, dtype: torch.full(shape, float("nan"), dtype=dtype))
        qkv_buf, o_buf, gu_buf = nan((b, qkv_n), BF16), nan((b, hidden), BF16), nan((b, 2 * inter), BF16)

        def step(x, positions, rope):
            q, sq = Q.rms_norm_quant(x, nw, 1e-5, I8, None, None, 0)
            Q.scaled_mm_out(qkv_buf, q, wqkv.t(), sq, sqkv, None)
            qkv = qkv_buf.view(b, heads + 2 * kv_heads, d)
            Q.rope_kv_cache_(qkv, rope, kv, slots, positions, heads, kv_heads)
            qa, sa = Q.decode_attention_quant(qkv[:, :heads], kv, slots, positions, 1.0 / math.sqrt(d), I8, None)
            Q.scaled_mm_decode_out(o_buf, qa, wo.t(), sa, so, None)
            Q.linear_decode_out(gu_buf, o_buf, wgu.t(), sgu, None, I8)
            return gu_buf

        return step

    def inputs():
        positions = torch.randint(0, s, (b,), generator=ctx.g)
        angles = torch.rand(b, d // 2, generator=ctx.g) * 6.2831853
        return [ctx.randn(b, hidden, dtype=BF16), positions, torch.stack([angles.cos(), angles.sin()], -1).contiguous()]

    _replay_and_compare(ctx, "graph_decode", make(True), inputs(), [inputs(), inputs()], make(False))


@case("graph_update", ["_graph_update_scaled_mm", "quantize_per_token", "quantize_per_token_group", "scaled_mm_out"],
      graphs=True, cuda_only_ops=["_graph_update_scaled_mm"])
def _graph_update(ctx: Ctx) -> None:
    """UpdatableGraph: quantize + scaled_mm(out=) captured at M = 64 (int8) and 32 (block fp8), resized with set_rows
    (rows past the new M untouched), then the GEMM node re-pointed to new operands of another M
    (_graph_update_scaled_mm) and replayed. On the CPU: the same GEMMs through scaled_mm_out."""
    variants = [(False, I8, 64, 256, 512, 5, 7)]
    if ctx.sm90 and ctx.fp8:
        variants.append((True, FP8, 32, 256, 256, 3, 9))
    for block, dtype, m, n, k, rows, m2 in variants:
        what = f"graph_update {'block fp8' if block else dtype} M={m} set_rows({rows}) update M={m2}"
        with ctx.sub(what):
            w_h = _operand(ctx, (n, k), dtype)
            ws_h = (_block_scales(ctx, (_ceil(n, BLOCK), k // BLOCK), k) if block else
                    rand_scale((n, 1), "cpu", scale_magnitudes(dtype, k)[1], ctx.g))
            bias_h = ctx.randn(n, dtype=BF16, std=2.0)  # captured with a bias, updated to another
            w, ws, bias = ctx.to(w_h), ctx.to(ws_h), ctx.to(bias_h)
            out = ctx.nan((m, n), BF16)

            def quant(x):
                return Q.quantize_per_token_group(x, BLOCK, FP8) if block else Q.quantize_per_token(x, dtype)

            def fn(x):
                q, s = quant(x)
                Q.scaled_mm_out(out, q, w.t(), s, ws, bias)
                return out

            x_h = ctx.randn(m, k, dtype=BF16, std=2.0)
            if ctx.cuda:
                g = UpdatableGraph(fn, [ctx.to(x_h)])
                node = next(nd for nd in g.nodes if nd.op == "scaled_mm")
                g.set_rows(rows)
                g.static_inputs[0].copy_(ctx.to(x_h))
                out.copy_(ctx.nan(out.shape, out.dtype))
                g.replay()
                ctx.sync()
                got = out.cpu()
                assert torch.isnan(got[rows:].float()).all(), f"{what}: rows >= {rows} were written"
            else:
                q, s = quant(ctx.to(x_h[:rows]))
                Q.scaled_mm_out(out[:rows], q, w.t(), s, ws, bias)
                got = out
            q_h, s_h = quant(x_h[:rows])
            check_gemm(got[:rows], q_h, w_h.t(), s_h, ws_h if block else ws_h.reshape(-1), bias_h,
                       f"{what}: set_rows", block)
            # new operands of another M for the GEMM node
            a2_h, w2_h = _operand(ctx, (m2, k), dtype), _operand(ctx, (n, k), dtype)
            if block:
                sa2_h = _block_scales(ctx, (m2, k // BLOCK), k)
                sb2_h = _block_scales(ctx, (_ceil(n, BLOCK), k // BLOCK), k)
            else:
                sa2_h, sb2_h = _rowwise_scales(ctx, m2, n, k, dtype, True)
            bias2_h = ctx.randn(n, dtype=BF16, std=2.0)
            out2 = ctx.nan((m2, n), BF16)
            a2, w2 = ctx.to(a2_h), ctx.to(w2_h)
            if ctx.cuda:
                g.update_scaled_mm(node, out2, a2, w2.t(), ctx.to(sa2_h), ctx.to(sb2_h), ctx.to(bias2_h))
                out.copy_(ctx.nan(out.shape, out.dtype))
                g.replay()
                ctx.sync()
                assert torch.isnan(out.cpu().float()).all(), f"{what}: the captured output was written after the update"
            else:
                Q.scaled_mm_out(out2, a2, w2.t(), ctx.to(sa2_h), ctx.to(sb2_h), ctx.to(bias2_h))
            check_gemm(out2, a2_h, w2_h.t(), sa2_h, sb2_h, bias2_h, f"{what}: updated node", block)
