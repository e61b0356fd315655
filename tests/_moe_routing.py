"""Shared pieces of the MoE routing tests (test_moe_routing_cpu.py, test_moe_routing_cuda.py, test_moe_route_cpu.py,
test_moe_route_cuda.py): naive loop references written independently of cutlass_w8a8/ops/_reference.py, random
routings, transformers' router modules built from their config classes, and the opcheck cases. Nothing here touches
the GPU at import."""

from __future__ import annotations

import dataclasses
import math

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


# ---- moe_route: transformers' routers --------------------------------------------------------------------------

# name -> (transformers family, E, top_k, n_group, topk_group, renormalize, routed_scaling_factor): the released
# models' router dims, and tiny ones (group size 2, top_k 1 and 2, E not a power of two)
ROUTER_DIMS = {
    "deepseek_v3": ("deepseek_v3", 256, 8, 8, 4, True, 2.5),
    "kimi_k2": ("deepseek_v3", 384, 8, 1, 1, True, 2.827),
    "glm4_5": ("glm4_moe", 160, 8, 1, 1, True, 2.5),
    "olmoe": ("olmoe", 64, 8, 1, 1, False, 1.0),
    "qwen3_moe": ("qwen3_moe", 128, 8, 1, 1, True, 1.0),
    "minimax_m2": ("minimax_m2", 256, 8, 1, 1, True, 1.0),
    "tiny_deepseek": ("deepseek_v3", 8, 2, 4, 2, True, 1.5),
    "tiny_deepseek_k1": ("deepseek_v3", 12, 1, 6, 1, True, 2.0),
    "tiny_glm_groups": ("glm4_moe", 4, 2, 2, 1, True, 1.0),
    "tiny_olmoe": ("olmoe", 4, 1, 1, 1, False, 1.0),
    "tiny_qwen3": ("qwen3_moe", 6, 2, 1, 1, True, 1.0),
    "tiny_minimax": ("minimax_m2", 5, 2, 1, 1, True, 1.0),
}
SIGMOID_FAMILIES = ("deepseek_v3", "glm4_moe", "minimax_m2")


@dataclasses.dataclass
class HFRouter:
    """A transformers router module with random weights (and bias) and the moe_route arguments that express it."""

    name: str
    family: str
    module: torch.nn.Module
    bias: object  # the module's (or MiniMax-M2 block's) e_score_correction_bias, or None
    top_k: int
    kwargs: dict  # moe_route's keyword arguments

    def __call__(self, hidden_states):
        """(router_logits, topk_weights, topk_ids) of the module's forward."""
        if self.family == "minimax_m2":
            return self.module(hidden_states, self.bias)
        return self.module(hidden_states)


def hf_router(name, seed, hidden=32, renormalize=None, device="cpu") -> HFRouter:
    """`name`'s router (ROUTER_DIMS) built from its transformers config class, float32, its weight drawn N(0, 1.5^2 /
    hidden) (logits of standard deviation about 1.5 on N(0, 1) hidden states) and its correction bias N(0, 0.05^2);
    ``renormalize`` overrides ``norm_topk_prob`` (MiniMax-M2 always renormalizes)."""
    family, e, k, n_group, topk_group, renorm, scale = ROUTER_DIMS[name]
    renorm = renorm if renormalize is None else renormalize
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(e, hidden, generator=gen) * (1.5 / math.sqrt(hidden))
    bias = torch.randn(e, generator=gen) * 0.05
    module_bias = bias if family == "minimax_m2" else None
    if family in ("deepseek_v3", "glm4_moe"):
        if family == "deepseek_v3":
            from transformers import DeepseekV3Config as Config
            from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter as Router
        else:
            from transformers import Glm4MoeConfig as Config
            from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter as Router
        config = Config(hidden_size=hidden, n_routed_experts=e, num_experts_per_tok=k, n_group=n_group,
                        topk_group=topk_group, norm_topk_prob=renorm, routed_scaling_factor=scale)
        module = Router(config)
        with torch.no_grad():
            module.e_score_correction_bias.copy_(bias)
    elif family == "minimax_m2":
        from transformers import MiniMaxM2Config
        from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2TopKRouter

        assert renorm and n_group == 1 and scale == 1.0, "MiniMax-M2's router always renormalizes, has no groups"
        module = MiniMaxM2TopKRouter(MiniMaxM2Config(hidden_size=hidden, num_local_experts=e, num_experts_per_tok=k))
    else:
        if family == "olmoe":
            from transformers import OlmoeConfig as Config
            from transformers.models.olmoe.modeling_olmoe import OlmoeTopKRouter as Router
        else:
            from transformers import Qwen3MoeConfig as Config
            from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter as Router
        module = Router(Config(hidden_size=hidden, num_experts=e, num_experts_per_tok=k, norm_topk_prob=renorm))
    with torch.no_grad():
        module.weight.copy_(weight)
    module = module.float().to(device)
    if family in ("deepseek_v3", "glm4_moe"):
        module_bias = module.e_score_correction_bias  # the module's buffer, moved with it
    elif module_bias is not None:
        module_bias = module_bias.to(device)
    sigmoid = family in SIGMOID_FAMILIES
    kwargs = dict(scoring="sigmoid" if sigmoid else "softmax", correction_bias=module_bias, n_group=n_group,
                  topk_group=topk_group, renormalize=renorm, scaling_factor=scale)
    return HFRouter(name, family, module, module_bias, k, kwargs)


def router_ties(router: HFRouter, logits):
    """(T,) bool: the tokens where transformers' own selection has an exact tie at its boundary (its
    ``torch.topk`` then breaks it in an unspecified way, so the chosen set is not defined by the values)."""
    return selection_ties(logits, router.top_k, router.kwargs)


def selection_ties(logits, top_k, kwargs, rel=0.0):
    """(T,) bool: the tokens whose selection has a tie at its boundary: group scores (the sum of a group's two largest
    choice values) equal across the topk_group boundary, or choice values (probabilities for softmax, sigmoid, plus
    the bias) equal across the top_k boundary among the kept groups' experts. With ``rel > 0`` values within
    ``rel`` of each other (relatively) count as equal: the tokens whose selection another device's scores, a few
    ulps away, may resolve differently."""
    logits = logits.float()
    choice = F.softmax(logits, dim=-1) if kwargs["scoring"] == "softmax" else logits.sigmoid()
    if kwargs.get("correction_bias") is not None:
        choice = choice + kwargs["correction_bias"]
    t, e = choice.shape
    g, kg = kwargs.get("n_group", 1), kwargs.get("topk_group", 1)

    def equal(a, b):
        return (a == b) | ((a - b).abs() <= rel * torch.maximum(a.abs(), b.abs()))

    tie = torch.zeros(t, dtype=torch.bool, device=choice.device)
    if g > 1:
        gs = choice.view(t, g, e // g).topk(2, dim=-1).values.sum(-1)
        ranked = gs.sort(dim=-1, descending=True).values
        if kg < g:
            tie |= equal(ranked[:, kg - 1], ranked[:, kg])
        kept = torch.zeros_like(gs, dtype=torch.bool).scatter_(1, gs.topk(kg, dim=-1).indices, True)
        choice = choice.masked_fill(~kept.repeat_interleave(e // g, dim=1), float("-inf"))
    ranked = choice.sort(dim=-1, descending=True).values
    if top_k < kg * (e // g):
        tie |= equal(ranked[:, top_k - 1], ranked[:, top_k])
    return tie


U32 = 2.0**-24  # the unit roundoff of float32 (eps32 / 2)


def renormalized_rel_bound(top_k: int) -> float:
    """How far apart, relatively, two float32 renormalized weights ``fl(fl(w / S1) * s)`` and ``fl(fl(w / S2) * s)``
    can be when S1 and S2 sum the same top_k positive weights in two orders. Any order of a k-term sum of positive
    terms is within gamma_{k-1} = (k - 1) u / (1 - (k - 1) u) of the exact sum S (u = 2**-24), so
    S2 / S1 is within (1 + gamma) / (1 - gamma); the division and the product by s each round once on either side:
    (1 + u) / (1 - u) each. About (2 (k - 1) + 4) u = (k + 1) * eps32; exact (no reordering) for top_k <= 2. The
    1e-20 DeepSeek-V3 adds to the sum changes nothing for sums above 2**-42 (the tests' sums are above 1e-3)."""
    gamma = (top_k - 1) * U32 / (1 - (top_k - 1) * U32)
    return (1 + gamma) / (1 - gamma) * ((1 + U32) / (1 - U32)) ** 2 - 1


def compare_with_router(router, logits, w_hf, ids_hf, w, ids, renormalized):
    """The tie-free tokens' id sets equal and their weights per id bit for bit (or within the reordered-sum bound
    when renormalized with top_k > 2); returns the number of tokens compared."""
    assert w.dtype == torch.float32 and ids.dtype == torch.int32 and w.shape == ids.shape == ids_hf.shape
    ties = router_ties(router, logits)
    assert int(ties.sum()) <= max(1, ties.numel() // 100), f"{int(ties.sum())} tokens with ties: the draw is degenerate"
    keep = ~ties
    hf_sorted, hf_order = ids_hf[keep].long().sort(-1)
    our_sorted, our_order = ids[keep].long().sort(-1)
    assert torch.equal(our_sorted, hf_sorted), f"{router.name}: the chosen experts differ"
    a = w[keep].gather(1, our_order)
    b = w_hf[keep].float().gather(1, hf_order)
    if not renormalized or router.top_k <= 2:
        assert torch.equal(a, b), f"{router.name}: weights differ: max |diff| {(a - b).abs().max().item()}"
    else:
        bound = renormalized_rel_bound(router.top_k)
        rel = ((a.double() - b.double()).abs() / b.double().abs()).max().item()
        assert rel <= bound, f"{router.name}: relative difference {rel} above the reordered-sum bound {bound}"
    return int(keep.sum())


def naive_route(logits, top_k, scoring, bias, n_group, topk_group, renormalize, scale):
    """moe_route by Python loops over each token's experts (independent of ops/_reference.py's sorts): the scores
    by torch's softmax / sigmoid of the float32 row, the selection as the docstring states it (ties: lower index
    first), the float32 sum in selection order. Returns (weights float32 [T, k], ids int64 [T, k])."""
    logits = logits.float()
    scores = F.softmax(logits, dim=-1) if scoring == "softmax" else logits.sigmoid()
    choice = scores if bias is None else scores + bias
    key = logits if (scoring == "softmax" and bias is None) else choice
    t, e = logits.shape
    size = e // n_group
    out_w, out_ids = [], []
    for r in range(t):
        kr, cr = key[r].tolist(), choice[r]
        kept = list(range(n_group))
        if n_group > 1:
            gscore = []
            for g in range(n_group):
                members = sorted(range(g * size, (g + 1) * size), key=lambda i: (-kr[i], i))
                gscore.append((cr[members[0]] + cr[members[1]]).item())
            kept = sorted(range(n_group), key=lambda g: (-gscore[g], g))[:topk_group]
        eligible = [i for i in range(e) if i // size in kept]
        ids = sorted(eligible, key=lambda i: (-kr[i], i))[:top_k]
        w = scores[r, ids]
        if renormalize:
            total = w[0]
            for j in range(1, top_k):
                total = total + w[j]
            if scoring == "sigmoid":
                total = total + 1e-20
            w = w / total
        out_w.append(w * scale)
        out_ids.append(ids)
    weights = torch.stack(out_w) if t else torch.zeros(0, top_k)
    return weights, torch.tensor(out_ids, dtype=torch.int64).reshape(t, top_k)


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
    bias = (torch.randn(16, generator=g) * 0.1).to(device)
    logits = torch.randn(6, 16, generator=g).to(device)
    out.append(("moe_route sigmoid bias groups", OPS.moe_route, (logits, 3, "sigmoid", bias, 4, 2, True, 2.5)))
    out.append(("moe_route softmax bf16 strided bias", OPS.moe_route,
                (torch.randn(16, 7, generator=g).to(device, torch.bfloat16).t(), 2, "softmax", bias, 1, 1, False,
                 1.0)))
    out.append(("moe_route sigmoid f16 no bias", OPS.moe_route,
                (logits.half(), 4, "sigmoid", None, 2, 1, False, 1.0)))
    out.append(("moe_route T=0", OPS.moe_route, (logits[:0], 2, "sigmoid", bias, 8, 4, True, 2.5)))
    xr = torch.randn(5, 128, generator=g).to(device, torch.bfloat16)
    wr = (torch.randn(16, 128, generator=g) * 0.1).to(device, torch.bfloat16)
    out.append(("moe_router_route softmax", OPS.moe_router_route,
                (xr, wr, 4, "softmax", None, 1, 1, True, 1.0, None)))
    out.append(("moe_router_route sigmoid bias groups float32 logits", OPS.moe_router_route,
                (xr, wr, 3, "sigmoid", bias, 4, 2, True, 2.5, torch.float32)))
    out.append(("moe_router_route f16 T=16", OPS.moe_router_route,
                (torch.randn(16, 64, generator=g).to(device, torch.float16),
                 (torch.randn(8, 64, generator=g) * 0.1).to(device, torch.float16), 2, "softmax", None, 1, 1, False,
                 1.0, None)))
    out.append(("moe_router_route T=0", OPS.moe_router_route, (xr[:0], wr, 2, "sigmoid", bias, 8, 4, True, 2.5, None)))
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
