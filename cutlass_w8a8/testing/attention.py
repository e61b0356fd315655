"""Shared by the decode_attention tests: random inputs laid out as the decoder's, the float64 reference and
its tolerance."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from .references import EPS32, assert_within, ulp


def make_inputs(b, h, kvh, d, s, dtype, device, seed=0, positions=None, num_slots=None, q_scale=1.0):
    """``(q, kv_cache, slots, positions)`` as LlamaAttention passes them.

    ``q`` is the query part of a fused qkv output, ``qkv.view(B, H + 2 KVH, D)[:, :H]`` (stride(0) =
    (H + 2 KVH) D); ``kv_cache`` is ``(num_slots, 2, KVH, S, D)`` (default ``num_slots = B + 1``) of N(0, 1)
    values; ``slots`` are distinct; ``positions`` (default uniform in [0, S)) and ``slots`` are strided
    columns of a ``(B, 3)`` int64 tensor, as `cutlass_w8a8.runner.DecodeGraphRunner` passes them.
    """
    g = torch.Generator(device=device).manual_seed(seed)
    num_slots = b + 1 if num_slots is None else num_slots
    qkv = (torch.randn(b, h + 2 * kvh, d, generator=g, device=device) * q_scale).to(dtype)
    kv = torch.randn(num_slots, 2, kvh, s, d, generator=g, device=device).to(dtype)
    rows = torch.zeros(b, 3, dtype=torch.int64, device=device)
    rows[:, 2] = torch.randperm(num_slots, generator=g, device=device)[:b]
    if positions is None:
        rows[:, 1] = torch.randint(0, s, (b,), generator=g, device=device)
    else:
        rows[:, 1] = torch.as_tensor(positions, dtype=torch.int64).to(device)
    return qkv[:, :h], kv, rows[:, 2], rows[:, 1]


def sdpa_formulation(q, kv_cache, slots, positions, softmax_scale=None):
    """What LlamaAttention computed before decode_attention: the B whole slots, SDPA over all S positions with
    an additive mask in q's dtype (0 where s <= position, else -inf)."""
    b, h, d = q.shape
    kvh, s = kv_cache.shape[2], kv_cache.shape[3]
    kv = kv_cache.index_select(0, slots)
    zero = torch.zeros((), dtype=q.dtype, device=q.device)
    neg_inf = torch.full((), float("-inf"), dtype=q.dtype, device=q.device)
    mask = torch.where(torch.arange(s, device=q.device) <= positions.unsqueeze(1), zero, neg_inf)
    out = F.scaled_dot_product_attention(q.unflatten(1, (kvh, h // kvh)), kv[:, 0], kv[:, 1],
                                         attn_mask=mask[:, None, None, :], scale=softmax_scale)
    return out.reshape(b, h * d)


class Reference(NamedTuple):
    out: torch.Tensor     # (B, H, D) float64
    abs_v: torch.Tensor   # (B, H, D): sum_s p_s |v_s|, what the rounding of the weighted sum scales with
    s_abs: torch.Tensor   # (B, H): max_s |scale| sum_d |q_d k_sd|, what a score's rounding scales with
    n: torch.Tensor       # (B, 1) float64: positions attended


def reference(q, kv_cache, slots, positions, softmax_scale) -> Reference:
    """float64 attention of each row over positions 0..positions[b] of its slot, written independently of the
    op (per row, the key/value heads repeated for their G query heads)."""
    b, h, d = q.shape
    g = h // kv_cache.shape[2]
    qd = q.double()
    out = torch.zeros(b, h, d, dtype=torch.float64, device=q.device)
    abs_v, s_abs = torch.zeros_like(out), torch.zeros(b, h, dtype=torch.float64, device=q.device)
    n = torch.zeros(b, 1, dtype=torch.float64, device=q.device)
    for i, (slot, pos) in enumerate(zip(slots.tolist(), positions.tolist())):
        k = kv_cache[slot, 0, :, : pos + 1].double().repeat_interleave(g, dim=0)  # (H, L, D)
        v = kv_cache[slot, 1, :, : pos + 1].double().repeat_interleave(g, dim=0)
        p = torch.softmax(torch.einsum("hd,hld->hl", qd[i], k) * softmax_scale, dim=-1)
        out[i] = torch.einsum("hl,hld->hd", p, v)
        abs_v[i] = torch.einsum("hl,hld->hd", p, v.abs())
        s_abs[i] = (torch.einsum("hd,hld->hl", qd[i].abs(), k.abs()) * abs(softmax_scale)).amax(dim=-1)
        n[i] = pos + 1
    return Reference(out, abs_v, s_abs, n)


def assert_close_to_reference(out, ref: Reference, dtype, what=""):
    """|out - ref| <= ulp(dtype) + eps32 (n + 16 (1 + s_abs)) sum_s p_s |v_s|, elementwise; no NaN.

    - ulp: the kernel rounds once to `dtype` (half an ulp; the other half covers ulp(out) vs ulp(ref)).
    - eps32 n sum p|v|: float32 sums of at most n terms (the softmax's denominator and the weighted sum of
      the values, and the rescalings of the online softmax) each err by at most about n eps32 of the sum of
      their terms' magnitudes.
    - 16 eps32 (1 + s_abs) sum p|v|: a score (a float32 dot product of up to 256 terms, summed in a lane,
      then a shuffle tree) errs by about 12 eps32 of sum|q k| (at most 32 per lane plus 5 tree levels), and
      its exponential carries that absolute error as a relative error of the weight; exp2f adds 2 ulp.
    These are worst-case bounds, far below what a wrong position, slot or head costs (O(1) of |v|).
    """
    b, h, d = ref.out.shape
    o = out.reshape(b, h, d).to(torch.float64)
    assert not torch.isnan(o).any(), f"{what}: NaN in output"
    bound = (torch.maximum(ulp(ref.out, dtype), ulp(o, dtype))
             + EPS32 * (ref.n[:, :, None] + 16 * (1 + ref.s_abs[:, :, None])) * ref.abs_v)
    assert_within(o, ref.out, bound, what, index_name="(b, h, d) = ")


def opcheck_cases(device):
    """(id, op, args) for torch.library.opcheck: a strided bf16 q (G = 4), float16 multi-head, the out= op,
    an empty batch."""
    ops = torch.ops.cutlass_w8a8
    q, kv, slots, pos = make_inputs(3, 8, 2, 64, 24, torch.bfloat16, device, seed=5, positions=[0, 23, 9])
    q16, kv16, slots16, pos16 = make_inputs(2, 4, 4, 128, 16, torch.float16, device, seed=6)
    out = torch.empty(3, 8 * 64, dtype=torch.bfloat16, device=device)
    return [
        ("decode_attention bf16 strided", ops.decode_attention, (q, kv, slots, pos, 0.125)),
        ("decode_attention f16 mha", ops.decode_attention, (q16, kv16, slots16, pos16, 0.09)),
        ("decode_attention_out", ops.decode_attention_out, (out, q, kv, slots, pos, 0.125)),
        ("decode_attention B=0", ops.decode_attention,
         (q.new_empty(0, 8, 64), kv, slots.new_empty(0), pos.new_empty(0), 0.125)),
    ]
