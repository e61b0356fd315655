"""Shared pieces of the MoE routing tests (test_moe_routing_cpu.py, test_moe_routing_cuda.py): naive loop
references written independently of cutlass_w8a8/ops/_reference.py, random routings, and the opcheck cases.
Nothing here touches the GPU at import."""

from __future__ import annotations

import torch
import torch.nn.functional as F

OPS = torch.ops.cutlass_w8a8
FP8 = torch.float8_e4m3fn


def router_math(logits, top_k, renormalize):
    """transformers' Qwen2-MoE / Qwen3-MoE / Mixtral router, written out: softmax in float32, top-k of the
    probabilities, renormalized by their sum (Qwen3 ``norm_topk_prob``; Mixtral always)."""
    probs = F.softmax(logits, dim=-1, dtype=torch.float)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def naive_align(ids, num_experts):
    """(sorted_pairs, dst_pos, offsets) by Python loops: pairs sorted by (bucket, pair index), bucket = id when
    in [0, E), else E (unrouted, last)."""
    flat = [int(v) for v in ids.reshape(-1).tolist()]
    bucket = [v if 0 <= v < num_experts else num_experts for v in flat]
    order = sorted(range(len(flat)), key=lambda p: (bucket[p], p))
    dst = [-1] * len(flat)
    for s, p in enumerate(order):
        if bucket[p] < num_experts:
            dst[p] = s
    offsets, run = [], 0
    for e in range(num_experts):
        run += sum(1 for b in bucket if b == e)
        offsets.append(run)
    i32 = torch.int32
    return torch.tensor(order, dtype=i32), torch.tensor(dst, dtype=i32), torch.tensor(offsets, dtype=i32)


def naive_unpermute(y, dst_pos, weights):
    """out[t] = sum_j (in float32, j ascending, from 0) weights[t, j] * y[dst_pos[t*k+j]], skipping positions
    outside [0, T*k), rounded once to y's dtype: one token at a time."""
    t, k = weights.shape
    n = t * k
    rows = []
    for i in range(t):
        acc = torch.zeros(y.shape[1], dtype=torch.float32)
        for j in range(k):
            d = int(dst_pos[i * k + j])
            if 0 <= d < n:
                acc = acc + weights[i, j] * y[d].to(torch.float32)
        rows.append(acc)
    out = torch.stack(rows) if rows else torch.zeros(0, y.shape[1])
    return out.to(y.dtype)


def random_ids(t, k, e, gen, unrouted=0.0, dtype=torch.int32):
    """(T, k) expert ids: k distinct experts per token when k <= e (as a router gives), a fraction `unrouted`
    of them replaced by -1 (expert parallelism) or out-of-range values."""
    if k <= e:
        ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]) if t else torch.zeros(0, k)
    else:
        ids = torch.randint(0, e, (t, k), generator=gen)
    ids = ids.to(torch.int64)
    if unrouted:
        mask = torch.rand(ids.shape, generator=gen) < unrouted
        bad = torch.tensor([-1, e, e + 3, -5])[torch.randint(0, 4, ids.shape, generator=gen)]
        ids = torch.where(mask, bad, ids)
    return ids.to(dtype)


def opcheck_cases(device):
    """(name, op, args) for torch.library.opcheck on `device`."""
    g = torch.Generator().manual_seed(0)
    out = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        logits = torch.randn(6, 10, generator=g).to(device, dtype)
        out.append((f"moe_topk_softmax {dtype}", OPS.moe_topk_softmax, (logits, 3, True)))
    logits_t = torch.randn(12, 5, generator=g).to(device).t()  # (5, 12), strided
    out.append(("moe_topk_softmax strided no renorm", OPS.moe_topk_softmax, (logits_t, 2, False)))
    out.append(("moe_topk_softmax T=0", OPS.moe_topk_softmax, (torch.zeros(0, 8, device=device), 2, True)))
    for idt in (torch.int32, torch.int64):
        ids = random_ids(7, 2, 6, g, unrouted=0.2, dtype=idt).to(device)
        out.append((f"moe_align {idt}", OPS.moe_align, (ids, 6)))
    out.append(("moe_align T=0", OPS.moe_align, (torch.zeros(0, 2, dtype=torch.int32, device=device), 4)))
    ids = random_ids(5, 2, 4, g).to(device)
    sp = OPS.moe_align(ids, 4)[0]
    x = torch.randn(5, 256, generator=g).to(device, torch.bfloat16)
    for qdtype in (torch.int8, FP8):
        out.append((f"moe_permute_quant {qdtype}", OPS.moe_permute_quant, (x, sp, 2, qdtype, None, 0)))
    scale = torch.tensor([0.02], device=device)
    out.append(("moe_permute_quant static", OPS.moe_permute_quant, (x, sp, 2, torch.int8, scale, 0)))
    out.append(("moe_permute_quant group", OPS.moe_permute_quant, (x, sp, 2, FP8, None, 128)))
    out.append(("moe_permute_quant f16", OPS.moe_permute_quant, (x.half(), sp, 2, FP8, None, 0)))
    out.append(("moe_permute_quant T=0", OPS.moe_permute_quant,
                (x[:0], torch.zeros(0, dtype=torch.int32, device=device), 2, torch.int8, None, 0)))
    w = torch.rand(5, 2, generator=g).to(device)
    dst = OPS.moe_align(ids, 4)[1]
    y = torch.randn(10, 256, generator=g).to(device, torch.bfloat16)
    out.append(("moe_unpermute", OPS.moe_unpermute, (y, dst, w)))
    out.append(("moe_unpermute f32", OPS.moe_unpermute, (y.float(), dst, w)))
    out.append(("moe_unpermute_out", OPS.moe_unpermute_out,
                (torch.empty(5, 256, dtype=torch.bfloat16, device=device), y, dst, w)))
    return out
