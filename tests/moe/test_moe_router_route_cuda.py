"""moe_router_route's CUDA kernel (csrc/moe/router_route.cu: the router GEMM and the routing in one cluster launch)
against the two ops it replaces, ``F.linear`` (cuBLAS) in the logits dtype then ``moe_route``:

- every routing family (Qwen3-MoE, Qwen2-MoE's E = 60, Mixtral, OLMoE: logits in the model dtype; DeepSeek-V3 and
  GLM-4.5: sigmoid, correction bias, grouped top-k, float32 logits; the limits E = 1024, T = 16), random x: the
  same set of experts on every token whose unfused top-k boundary is not a near-tie, in the same order unless two of
  the top-k are a near-tie (order inside a tie is the summation order's), the weights by expert within the bound that the
  logits' summation order allows (ops/moe.py moe_router_route: each logit within ``ulp(logit) + (H - 1) * 2**-22 *
  sum_h |x w|`` of cuBLAS's);
- row-invariance: row t of a T = 16 call equals the T = 1 call of that row bit for bit (and of T = 5);
- graph replay (side-stream warm-up, sync debug mode "error") equals eager bit for bit with new x between replays;
- exact sums (small integers): bit for bit against moe_route on the exact logits rounded to each logits dtype, with
  E = 384, H of an odd number of 64-element chunks and a strided x;
- outputs start as poisoned memory (every element is written);
- the decoder's MoE block on CUDA takes it at decode sizes (W8A8MoE.router_route_applies).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import cutlass_w8a8 as cw
from cutlass_w8a8.ops._limits import MOE_ROUTER_ROUTE_MIN_EXPERTS
from _fused_quant_cuda import poison_allocator, replay_and_eager

pytestmark = pytest.mark.cuda

DEV = "cuda"

# (name, E, H, top_k, routing kwargs, logits dtype)
CASES = [
    ("qwen3_moe", 128, 2048, 8, dict(renormalize=True), None),
    ("qwen2_moe", 60, 2048, 4, dict(renormalize=False), None),
    ("mixtral", 8, 4096, 2, dict(renormalize=True), None),
    ("olmoe", 64, 2048, 8, dict(renormalize=False), None),
    ("deepseek_v3", 256, 7168, 8, dict(scoring="sigmoid", n_group=8, topk_group=4, renormalize=True,
                                       scaling_factor=2.5), torch.float32),
    ("glm4_5", 160, 5120, 8, dict(scoring="sigmoid", renormalize=True, scaling_factor=2.5), torch.float32),
    ("softmax_bias_groups", 64, 1024, 6, dict(n_group=8, topk_group=3, renormalize=True), None),
    ("limits", 1024, 256, 16, dict(scoring="sigmoid", n_group=32, topk_group=4, renormalize=True), None),
]


def _inputs(t, e, h, dtype, seed, biased):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(DEV, dtype)
    w = (torch.randn(e, h, generator=g) / math.sqrt(h)).to(DEV, dtype)
    bias = (torch.randn(e, generator=g) * 0.05).to(DEV) if biased else None
    return x, w, bias


def _logit_bound(x, w, logits):
    """Per (t, e): ulp of the logit in its dtype + (H - 1) * 2**-22 * sum_h |x w| (ops/moe.py's bound)."""
    h = x.shape[1]
    s = F.linear(x.double().abs(), w.double().abs())
    mag = logits.double().abs().clamp_min(torch.finfo(logits.dtype).tiny)
    ulp = torch.finfo(logits.dtype).eps * torch.exp2(torch.floor(torch.log2(mag)))
    return ulp + (h - 1) * 2.0**-22 * s


def _keys(logits, kw, bias):
    """The ranking keys moe_route compares (float64), and their Lipschitz constant in the logits."""
    lf = logits.double()
    if kw.get("scoring") == "sigmoid":
        keys, lip = torch.sigmoid(lf), 0.25
    elif bias is None:
        keys, lip = lf, 1.0  # softmax without bias ranks the logits
    else:
        keys, lip = torch.softmax(lf, dim=-1), 0.5  # sum_j |d p_i / d l_j| = 2 p_i (1 - p_i) <= 1/2
    if bias is not None:
        keys = keys + bias.double()
    return keys, lip


def _near_tie(keys, k, n_group, topk_group, tol):
    """Per token: whether the unfused top-k (with its groups) is within ``tol[t]`` of changing."""
    t, e = keys.shape
    out = torch.zeros(t, dtype=torch.bool)
    for i in range(t):
        row = keys[i].cpu()
        eligible = torch.ones(e, dtype=torch.bool)
        if n_group > 1:
            gs = row.view(n_group, -1).topk(2, dim=-1).values.sum(-1)
            srt = gs.sort(descending=True).values
            if srt[topk_group - 1] - srt[topk_group] <= 2 * tol[i]:
                out[i] = True
                continue
            kept = gs.topk(topk_group).indices
            eligible = torch.zeros(n_group, dtype=torch.bool)
            eligible[kept] = True
            eligible = eligible.repeat_interleave(e // n_group)
        vals = row[eligible].sort(descending=True).values
        out[i] = bool(vals.numel() > k and vals[k - 1] - vals[k] <= tol[i])
    return out


def _order_tie(keys, k, ui, tol):
    """Per token: whether two of the unfused top-k's keys are within ``tol[t]`` of each other, so that their order
    inside the top-k (not the set) may differ between the two summation orders."""
    top = keys.gather(1, ui.long()).cpu().sort(dim=1, descending=True).values
    if k == 1:
        return torch.zeros(len(top), dtype=torch.bool)
    return ((top[:, :-1] - top[:, 1:]) <= tol.unsqueeze(1)).any(dim=1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t", [1, 5, 8, 9, 16])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_fused_matches_linear_then_moe_route(case, t, dtype):
    name, e, h, k, kw, ldt = case
    biased = kw.get("scoring") == "sigmoid" or name == "softmax_bias_groups"
    x, w, bias = _inputs(t, e, h, dtype, seed=7 * t + e, biased=biased)
    kw = {**kw, "correction_bias": bias}
    poison_allocator(t * k * 4, t * k * 4)
    fw, fi = cw.moe_router_route(x, w, k, logits_dtype=ldt, **kw)
    logits = F.linear(x, w) if ldt is None else F.linear(x.float(), w.float())
    uw, ui = cw.moe_route(logits, k, **kw)
    assert fw.shape == fi.shape == (t, k) and fw.dtype == torch.float32 and fi.dtype == torch.int32
    assert bool(((fi >= 0) & (fi < e)).all())
    bound = _logit_bound(x, w, logits).amax(dim=1)  # per token
    keys, lip = _keys(logits, kw, bias)
    n_group, topk_group = kw.get("n_group", 1), kw.get("topk_group", 1)
    tie_tol = (2 * lip * bound + 8 * 2.0**-24 * keys.abs().amax(1)).cpu()
    ties = _near_tie(keys, k, n_group, topk_group, tie_tol)
    # the same experts (as a set) on every token whose top-k boundary is not a near-tie, in the same order where no
    # two of the top-k are a near-tie (two logits that round to one bf16 value in one summation order and not in
    # the other swap places; the MoE output sums over the set, so only its order changes)
    fs, forder = fi.sort(dim=1)
    us, uorder = ui.sort(dim=1)
    same_set = (fs == us).all(dim=1).cpu()
    same = (fi == ui).all(dim=1).cpu()
    order_ties = _order_tie(keys, k, ui, tie_tol)
    assert bool((same_set | ties).all()), f"{name}: tokens {(~(same_set | ties)).nonzero().flatten().tolist()} differ"
    assert bool((same | ~same_set | order_ties).all()), \
        f"{name}: tokens {(~(same | ~same_set | order_ties)).nonzero().flatten().tolist()} order the experts differently"
    assert same_set.float().mean() >= 0.5, f"{name}: only {same_set.float().mean():.2f} of the tokens agree"
    # weights of the agreeing tokens, matched by expert: |d ln w| <= 2 * max |d logit| (softmax / sigmoid,
    # renormalized or not), plus float32 roundings of the weight arithmetic
    fw_by_expert, uw_by_expert = fw.gather(1, forder), uw.gather(1, uorder)
    rel = ((fw_by_expert - uw_by_expert).abs() / uw_by_expert.abs().clamp_min(1e-30)).cpu()[same_set]
    tol = (2.2 * bound.cpu()[same_set] + 32 * 2.0**-24).unsqueeze(1)
    assert bool((rel <= tol).all()), f"{name}: weight relative difference {rel.max():.3g} above the bound"


# (E, H, top_k, routing kwargs), with the launch each gets (moe_router_route_plan; on an H100 / H200 the wide ones
# take the cluster of 16):
# - Kimi-K2's E = 384 at H = 576 (9 chunks): 8 CTAs, three 16-expert tiles each, the 8 warps with unequal chunks;
# - Qwen2-MoE's E = 60 and E = 64 at H = 1088 (17 chunks): 8 CTAs, 4 of them without experts;
# - E = 384 at H = 1408 (1.03 MiB of weight): 16 CTAs, 24 tiles (two on 8 of the CTAs), one slice;
# - E = 120 at H = 4416 (1.01 MiB, 69 chunks): 16 CTAs, 8 tiles (the last half empty) in 2 slices of 35 and 34 chunks;
# - E = 8 at H = 2112 (33 chunks): 8 CTAs, one tile in 2 slices of 17 and 16 chunks.
# The 8-CTA one-slice plans run router_route_kernel_one_slice, the others router_route_kernel
# (test_exact_cases_reach_each_kernel).
EXACT_CASES = [
    (384, 576, 8, dict(scoring="sigmoid", renormalize=True, scaling_factor=2.827)),
    (60, 1088, 4, dict(renormalize=False)),
    (64, 1088, 6, dict(n_group=8, topk_group=3, renormalize=True)),
    (384, 1408, 8, dict(scoring="sigmoid", renormalize=True, scaling_factor=2.827)),
    (120, 4416, 8, dict(scoring="sigmoid", renormalize=True, scaling_factor=2.5)),
    (8, 2112, 2, dict(renormalize=True)),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t", [1, 9, 16])
@pytest.mark.parametrize("case", EXACT_CASES,
                         ids=["kimi_k2_e384", "qwen2_e60", "groups", "kimi_k2_wide", "wide_slices", "mixtral_slices"])
def test_exact_sums_bit_for_bit_each_logits_dtype(case, t, dtype):
    """x holds integers in [-64, 64] and the weight integers in [-3, 3] times 2**-10 (both exact in bf16 / f16), so
    every float32 sum of the H products is exact in any order (|sum| <= 192 * H units of 2**-10 < 2**24): the
    kernel's logits are the float64 GEMM's, rounded to logits_dtype, bit for bit. Against moe_route on exactly those
    logits (not on cuBLAS's 16-bit GEMM, which may reduce in reduced precision), for logits_dtype None and float32;
    the two roundings route differently on these inputs, so a kernel that rounds to the wrong dtype fails. x is a
    strided view (row pitch H + 64, offset 64 elements). Where a draw routes the same under both roundings (a
    single token at 8 experts may: its two winners' weights need not move), the next seed is drawn, up to 16."""
    e, h, k, kw = case
    for attempt in range(16):
        g = torch.Generator().manual_seed(1000 * t + e + 100_000 * attempt)
        x = torch.randint(-64, 65, (t, h + 64), generator=g).to(DEV, dtype)[:, 64:]
        w = (torch.randint(-3, 4, (e, h), generator=g) * 2.0**-10).to(DEV, dtype)
        bias = (torch.randn(e, generator=g) * 0.1).to(DEV) if kw.get("scoring") == "sigmoid" else None
        exact = F.linear(x.double(), w.double()).float()
        args = {**kw, "correction_bias": bias}
        wants = [cw.moe_route(exact.to(dtype), k, **args), cw.moe_route(exact, k, **args)]
        if not torch.equal(wants[0][0], wants[1][0]):
            break
    assert not torch.equal(wants[0][0], wants[1][0]), "no draw told the two logits dtypes apart"
    for ldt, want in zip((None, torch.float32), wants):
        poison_allocator(t * k * 4, t * k * 4)
        got = cw.moe_router_route(x, w, k, logits_dtype=ldt, **args)
        for a, b, what in zip(got, want, ("weights", "ids")):
            bad = (a != b).any(dim=1).nonzero().flatten().tolist()
            assert torch.equal(a, b), f"logits_dtype {ldt}: {what} differ in tokens {bad}"


@pytest.mark.parametrize("case", [CASES[0], CASES[4], CASES[2], CASES[5]],
                         ids=["qwen3_moe", "deepseek_v3", "mixtral", "glm4_5"])
def test_row_invariance(case):
    """Row t of T = 16 equals T = 1 of that row (and row t of T = 5) bit for bit: a fixed summation order."""
    name, e, h, k, kw, ldt = case
    x, w, bias = _inputs(16, e, h, torch.bfloat16, seed=3, biased=kw.get("scoring") == "sigmoid")
    kw = {**kw, "correction_bias": bias}
    full = cw.moe_router_route(x, w, k, logits_dtype=ldt, **kw)
    five = cw.moe_router_route(x[:5].clone(), w, k, logits_dtype=ldt, **kw)
    for r in range(16):
        one = cw.moe_router_route(x[r:r + 1].clone(), w, k, logits_dtype=ldt, **kw)
        for a, b in zip(full, one):
            assert torch.equal(a[r:r + 1], b), f"{name}: row {r}"
    for a, b in zip(full, five):
        assert torch.equal(a[:5], b), name


@pytest.mark.parametrize("t", [1, 8, 16])
def test_graph_replay_equals_eager(t):
    e, h, k = 256, 7168, 8
    x = torch.zeros(t, h, dtype=torch.bfloat16, device=DEV)
    g = torch.Generator().manual_seed(11)
    w = (torch.randn(e, h, generator=g) / math.sqrt(h)).to(DEV, torch.bfloat16)
    bias = torch.zeros(e, device=DEV)

    def step(x, bias):
        return (cw.moe_router_route(x, w, k, scoring="sigmoid", correction_bias=bias, n_group=8, topk_group=4,
                                    scaling_factor=2.5, logits_dtype=torch.float32)
                + cw.moe_router_route(x, w[:128], 8))

    inputs = [(torch.randn(t, h, generator=g).to(DEV, torch.bfloat16), (torch.randn(e, generator=g) * 0.05).to(DEV))
              for _ in range(3)]
    results = replay_and_eager(lambda: step(x, bias), (x, bias), inputs)
    for i, (replayed, eager) in enumerate(results):
        for j, (a, b) in enumerate(zip(replayed, eager)):
            assert torch.equal(a, b), f"replay {i}, output {j}"
    assert not torch.equal(results[0][1][1], results[1][1][1])  # the replays saw the new inputs


def _expected_slices(e, h, ctas):
    """csrc/moe/router_route.cu's router_slices re-derived: the s in [1, 8] with the least ceil(tiles * s / C) *
    (ceil(ceil(chunks / s) / 32) + 1), within chunks / s >= 8 and ceil(16 / C) * s * E * 4 <= 32 KiB, ties to fewer."""
    tiles, chunks = -(-e // 16), h // 64

    def cost(s):
        return -(-tiles * s // ctas) * (-(-(-(-chunks // s)) // 32) + 1)

    best = 1
    for s in range(2, 9):
        if chunks // s < 8 or -(-16 // ctas) * s * e * 4 > 32 * 1024:
            break
        if cost(s) < cost(best):
            best = s
    return best


# (E, H) -> the cluster size on an H100 / H200 (132 SMs: clusters of 16 are resident there)
PLAN_CASES = [(128, 2048, 8), (8, 4096, 8), (256, 7168, 16), (384, 7168, 16), (160, 5120, 16), (120, 4416, 16),
              (60, 2048, 8), (1024, 256, 8)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_plan_cluster_and_slices(dtype):
    """moe_router_route_plan: 8 CTAs below 1 MiB of router weight; at or above it 16 where a cluster of 16 is resident
    (asserted on 132-SM sm90 parts, where it is) or 8; the slices follow router_slices' rule for that cluster."""
    dev = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(dev)
    for e, h, want_ctas in PLAN_CASES:
        ctas, slices = cw._ext.moe_router_route_plan(dev, e, h, dtype)
        if props.major < 9:
            assert (ctas, slices) == (0, 0), (e, h)
            continue
        wide = e * h * 2 >= 1 << 20
        assert ctas in ((8, 16) if wide else (8,)), (e, h, ctas)
        if props.major == 9 and props.multi_processor_count >= 132:  # H100 / H200 SXM: the cluster of 16 is resident
            assert ctas == want_ctas, (e, h, ctas)
        assert slices == _expected_slices(e, h, ctas), (e, h, ctas, slices)
    with pytest.raises(ValueError, match="`hidden` must be a positive multiple of 64"):
        cw._ext.moe_router_route_plan(dev, 128, 100, dtype)
    with pytest.raises(ValueError, match="`experts` must be in"):
        cw._ext.moe_router_route_plan(dev, 0, 2048, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_exact_cases_reach_each_kernel(dtype):
    """The exact-sum cases launch every kernel of router_route.cu: router_route_kernel_one_slice (the plan of 8 CTAs x
    1 slice: the logits rounded where their sums are formed, no slice pass) and router_route_kernel with 8 CTAs and
    more than one slice; on 132-SM sm90 parts (clusters of 16 resident) also router_route_kernel with 16 CTAs at one
    slice and at more. A change of the plan rule that left a kernel without an exact case fails here."""
    dev = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(dev)
    if props.major < 9:
        pytest.skip("no clusters before sm90: the two-kernel path")
    reached = set()
    for e, h, _, _ in EXACT_CASES:
        ctas, slices = cw._ext.moe_router_route_plan(dev, e, h, dtype)
        reached.add((ctas, slices > 1))
    assert {(8, False), (8, True)} <= reached, reached
    if props.major == 9 and props.multi_processor_count >= 132:
        assert reached == {(8, False), (8, True), (16, False), (16, True)}, reached


def test_zero_tokens_and_errors():
    w = torch.zeros(8, 64, dtype=torch.bfloat16, device=DEV)
    tw, ids = cw.moe_router_route(torch.zeros(0, 64, dtype=torch.bfloat16, device=DEV), w, 2)
    assert tw.shape == ids.shape == (0, 2) and tw.device.type == "cuda"
    with pytest.raises(ValueError, match=r"moe_router_route: `x` has 17 rows \(tokens\); at most 16"):
        cw.moe_router_route(torch.zeros(17, 64, dtype=torch.bfloat16, device=DEV), w, 2)
    with pytest.raises(ValueError, match=r"moe_router_route: `correction_bias` is on cpu but `x` is on cuda"):
        cw.moe_router_route(torch.zeros(2, 64, dtype=torch.bfloat16, device=DEV), w, 2, scoring="sigmoid",
                            correction_bias=torch.zeros(8))


def test_decoder_block_takes_it_at_decode_sizes():
    """W8A8MoE's rule on CUDA: the fused op at 1 <= T <= 16 with the router's bf16 weight (64 experts), the two ops
    above; below the speed rule's least expert count (MOE_ROUTER_ROUTE_MIN_EXPERTS, Mixtral's 8) the two ops."""
    layer = cw.W8A8MoE(64, 2, 128, 64, device=DEV)
    w = torch.zeros(64, 128, dtype=torch.bfloat16, device=DEV)
    assert layer.router_route_applies(torch.zeros(16, 128, dtype=torch.bfloat16, device=DEV), w)
    assert not layer.router_route_applies(torch.zeros(17, 128, dtype=torch.bfloat16, device=DEV), w)
    layer.fused_router = False  # the A/B switch
    assert not layer.router_route_applies(torch.zeros(16, 128, dtype=torch.bfloat16, device=DEV), w)
    layer.fused_router = True
    least = MOE_ROUTER_ROUTE_MIN_EXPERTS
    assert cw.W8A8MoE(least, 2, 128, 64, device=DEV).router_route_applies(  # Mixtral's 8 experts: the fused op
        torch.zeros(1, 128, dtype=torch.bfloat16, device=DEV), w[:least])
    assert not cw.W8A8MoE(least - 1, 2, 128, 64, device=DEV).router_route_applies(  # fewer: the two ops
        torch.zeros(1, 128, dtype=torch.bfloat16, device=DEV), w[:least - 1])
    x = torch.randn(3, 128, dtype=torch.bfloat16, device=DEV)
    w = torch.randn(64, 128, dtype=torch.bfloat16, device=DEV)
    got = layer.route_from_hidden(x, w)
    want = cw.moe_router_route(x, w, 2)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
