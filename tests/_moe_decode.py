"""Shared by the tests of `moe_decode_experts` (tests/moe/test_moe_decode_cpu.py, _cuda.py) and its docs/MISUSE.md
rows (tests/_misuse_triggers_api.py): random expert operands per scheme, routings (empty experts, all pairs on one
expert, unrouted -1 ids, a token with no routed pair), the unfused chain the op must equal bit for bit, and the
misuse triggers.
"""

from __future__ import annotations

import torch

import cutlass_w8a8 as cw
from cutlass_w8a8.testing.references import rand_operand, rand_scale

FP8 = torch.float8_e4m3fn
# scheme: (weight dtype, weight-scale kind, group_size). "channel": (E, N) scales, "expert": one scale per expert,
# "block": 128 x 128 blocks with 1 x 128 activation groups.
SCHEMES = {
    "int8": (torch.int8, "channel", 0),
    "int8-expert": (torch.int8, "expert", 0),
    "fp8": (FP8, "channel", 0),
    "fp8-expert": (FP8, "expert", 0),
    "fp8-block": (FP8, "block", 128),
}
ROUTES = ("random", "one-expert", "unrouted")


def _weight_scale(kind, e, n, k, dtype, device, g, expert_shape=(-1,)):
    """float32 scales of an (E, N, K) weight that keep each GEMM's output around 1..4 for x ~ N(0, 1): the 8-bit
    weights' rms is about 74 (int8 uniform) or 1 (e4m3 of N(0, 1)), the dynamic activation scales undo x's."""
    rms = 74.0 if dtype == torch.int8 else 1.0
    mag = 2.0 / (rms * k ** 0.5)
    if kind == "block":
        return rand_scale((e, -(-n // 128), k // 128), device, mag, g)
    if kind == "expert":
        return rand_scale((e,), device, mag, g).reshape(e, *expert_shape[1:])
    return rand_scale((e, n), device, mag, g)


def decode_operands(scheme, e, h, i, device="cpu", seed=0, expert_shape=(-1,)):
    """``dict(w13, w13_scale, w2, w2_scale, group_size)``: random contiguous expert weights of ``scheme`` (a key of
    SCHEMES), w13 (E, 2I, H) and w2 (E, H, I), with their float32 scales; ``expert_shape=(-1, 1)`` gives per-expert
    scales as (E, 1) instead of (E,)."""
    dtype, kind, group = SCHEMES[scheme]
    g = torch.Generator(device=device).manual_seed(seed)
    w13 = rand_operand((e, 2 * i, h), dtype, device, g)
    w2 = rand_operand((e, h, i), dtype, device, g)
    return dict(w13=w13, w13_scale=_weight_scale(kind, e, 2 * i, h, dtype, device, g, expert_shape),
                w2=w2, w2_scale=_weight_scale(kind, e, h, i, dtype, device, g, expert_shape), group_size=group)


def routing(t, k, e, route="random", device="cpu", seed=0, ids_dtype=torch.int32):
    """``(topk_ids (T, k), topk_weights float32 (T, k))`` on ``device``.

    - "random": each token's k experts drawn at random (distinct within a token when k <= E, so experts repeat
      across tokens), about one pair in five set to -1 (unrouted), the last token's ids all -1 when T > 1;
    - "one-expert": every pair on expert E - 1 (every other expert empty);
    - "unrouted": as "random", but only experts 0 and 1 (and -1) are used: E - 2 experts empty.
    Weights are positive, normalized per token."""
    g = torch.Generator().manual_seed(seed)
    if route == "one-expert":
        ids = torch.full((t, k), e - 1, dtype=torch.int64)
    else:
        span = e if route == "random" else min(e, 2)
        ids = torch.stack([torch.randperm(max(span, k), generator=g)[:k] % span for _ in range(t)]) if t else \
            torch.zeros(0, k, dtype=torch.int64)
        drop = torch.rand(t, k, generator=g) < 0.2
        ids = torch.where(drop, torch.full_like(ids, -1), ids)
        if t > 1:
            ids[-1] = -1
    w = torch.rand(t, k, generator=g) + 0.1
    w = w / w.sum(-1, keepdim=True)
    return ids.to(ids_dtype).to(device), w.to(device)


def random_x(t, h, dtype=torch.bfloat16, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, h, generator=g).to(dtype).to(device)


def chain(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, group_size=0, out_dtype=torch.bfloat16):
    """The unfused chain `W8A8MoE.forward` runs (the public ops, one call each): moe_align, moe_permute_quant,
    grouped_scaled_mm (w13), silu_mul_quant, grouped_scaled_mm (w2), moe_unpermute. (T, H) out_dtype."""
    k = topk_ids.shape[1]
    sorted_pairs, dst_pos, offsets = cw.moe_align(topk_ids, w13.shape[0])
    q, s = cw.moe_permute_quant(x, sorted_pairs, k, w13.dtype, group_size=group_size or None)
    y13 = cw.grouped_scaled_mm(q, w13.transpose(1, 2), s, w13_scale, offsets, out_dtype)
    q2, s2 = cw.silu_mul_quant(y13, w13.dtype, None, group_size)
    y2 = cw.grouped_scaled_mm(q2, w2.transpose(1, 2), s2, w2_scale, offsets, out_dtype)
    return cw.moe_unpermute(y2, dst_pos, topk_weights)


# ---- docs/MISUSE.md triggers ------------------------------------------------------------------------------------
# Legal operands: x (2, 128) bfloat16, topk_ids / topk_weights (2, 2), int8 w13 (4, 256, 128) and w2 (4, 128, 128)
# with per-channel scales (block: e4m3 with (4, 2, 1) / (4, 1, 1) scales and group_size 128); one thing changed.


def decode_call(d, dtype=torch.int8, group_size=0, e=4, h=128, i=128, t=2, k=2, out_dtype=torch.bfloat16, **given):
    """moe_decode_experts on device ``d`` with legal operands of those sizes, the tensors in ``given`` replacing
    theirs."""
    block = group_size == 128
    z = lambda *s, dt=torch.float32: torch.zeros(*s, dtype=dt, device=d)  # noqa: E731
    args = dict(x=z(t, h, dt=torch.bfloat16), topk_ids=z(t, k, dt=torch.int32), topk_weights=z(t, k),
                w13=z(e, 2 * i, h, dt=dtype), w2=z(e, h, i, dt=dtype),
                w13_scale=z(e, -(-2 * i // 128), h // 128) if block else z(e, 2 * i),
                w2_scale=z(e, -(-h // 128), i // 128) if block else z(e, h))
    args.update(given)
    return cw.moe_decode_experts(args["x"], args["topk_ids"], args["topk_weights"], args["w13"], args["w13_scale"],
                                 args["w2"], args["w2_scale"], group_size, out_dtype)


def _other(d):
    return "meta" if d == "cpu" else "cpu"


def _z(d, *shape, dt=torch.float32):
    return torch.zeros(*shape, dtype=dt, device=d)


# Rows triggered on "cpu" (the CPU implementation), "meta" (the fake kernel) and "cuda" (the C++ checks).
DEVICE_TRIGGERS = {
    "moe-decode-x-dtype": lambda d: decode_call(d, x=_z(d, 2, 128, dt=torch.float64)),
    "moe-decode-ids-dtype": lambda d: decode_call(d, topk_ids=_z(d, 2, 2)),
    "moe-decode-weights-dtype": lambda d: decode_call(d, topk_weights=_z(d, 2, 2, dt=torch.bfloat16)),
    "moe-decode-w13-dtype": lambda d: decode_call(d, w13=_z(d, 4, 256, 128, dt=torch.bfloat16)),
    "moe-decode-w2-dtype": lambda d: decode_call(d, w2=_z(d, 4, 128, 128, dt=FP8)),
    "moe-decode-scale-dtype": lambda d: decode_call(d, w13_scale=_z(d, 4, 256, dt=torch.float16)),
    "moe-decode-out-dtype": lambda d: decode_call(d, out_dtype=torch.float32),
    "moe-decode-group-size": lambda d: decode_call(d, group_size=64),
    "moe-decode-group-int8": lambda d: decode_call(d, group_size=128),
    "moe-decode-device": lambda d: decode_call(d, w2=_z(_other(d), 4, 128, 128, dt=torch.int8)),
    "moe-decode-x-shape": lambda d: decode_call(d, x=_z(d, 1, 2, 128, dt=torch.bfloat16)),
    "moe-decode-ids-shape": lambda d: decode_call(d, topk_ids=_z(d, 3, 2, dt=torch.int32)),
    "moe-decode-top-k": lambda d: decode_call(d, k=0),
    "moe-decode-weights-shape": lambda d: decode_call(d, topk_weights=_z(d, 2, 3)),
    "moe-decode-pairs": lambda d: decode_call(d, t=33),
    "moe-decode-w13-shape": lambda d: decode_call(d, w13=_z(d, 256, 128, dt=torch.int8)),
    "moe-decode-experts": lambda d: decode_call(d, e=1025, h=16, i=16),
    "moe-decode-h-mismatch": lambda d: decode_call(d, w13=_z(d, 4, 256, 256, dt=torch.int8)),
    "moe-decode-h-align": lambda d: decode_call(d, h=40),
    "moe-decode-i-align": lambda d: decode_call(d, i=24),
    "moe-decode-w2-shape": lambda d: decode_call(d, w2=_z(d, 4, 128, 256, dt=torch.int8)),
    "moe-decode-block-h": lambda d: decode_call(d, dtype=FP8, group_size=128, h=144),
    "moe-decode-block-i": lambda d: decode_call(d, dtype=FP8, group_size=128, i=64),
    "moe-decode-block-scale": lambda d: decode_call(d, dtype=FP8, group_size=128, w13_scale=_z(d, 4, 256)),
    "moe-decode-scale-shape": lambda d: decode_call(d, w13_scale=_z(d, 4, 2, 1)),
    "moe-decode-w2-scale-shape": lambda d: decode_call(d, w2_scale=_z(d, 1, 128)),
    "moe-decode-contiguous": lambda d: decode_call(d, w13=_z(d, 4, 128, 256, dt=torch.int8).transpose(1, 2)),
    "moe-decode-misaligned": lambda d: decode_call(
        d, w13=_z(d, 4 * 256 * 128 + 8, dt=torch.int8)[8:].view(4, 256, 128)),
}

# Rows on meta tensors only (sizes too large to allocate).
META_TRIGGERS = {
    "moe-decode-int8-k": lambda: decode_call("meta", h=131072),
}
