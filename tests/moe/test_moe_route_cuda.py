"""moe_route's CUDA kernel (csrc/moe/routing.cu, route_kernel):

- bit for bit (ids and weights) against the reference implementation (ops/_reference.py's torch ops) run on the
  same GPU: torch's CUDA softmax (its persistent warp softmax: a lane-strided partial sum then a butterfly, the
  kernel's order) and CUDA sigmoid (1 / (1 + expf(-x))) give the kernel's scores, and the selection and the
  float32 sums are done in the same order; DeepSeek-V3, Kimi-K2, GLM-4.5, OLMoE, Qwen3-MoE dims and the limits
  (E = 1024, 32 groups), float32 / bfloat16 / float16 and strided logits, outputs starting as poisoned memory;
- against transformers' router modules run on the GPU: the same expert set per token and the weights per expert
  bit for bit before renormalization, within the reordered-sum bound after it (tests/_moe_routing.py);
- against the CPU implementation: the ids exactly for softmax without bias (both rank the same float32 logits); with
  sigmoid or a bias the two devices' scores differ by float32 ulps (expf against the CPU's exp), so the sets are
  compared on the tokens without a near-tie (within 2**-18) and the weights within a few ulps;
- captured in a CUDA graph (sync debug mode "error": no host synchronisation) and replayed with new logits and new
  bias values: equal to eager bit for bit;
- NaN rows: ids stay in [0, E), the other rows are unaffected.
"""

from __future__ import annotations

import pytest
import torch

import cutlass_w8a8 as cw
from _fused_quant_cuda import POISON, assert_bits_equal, poison_allocator, replay_and_eager
from _moe_routing import ROUTER_DIMS, compare_with_router, hf_router, selection_ties
from cutlass_w8a8.ops._reference import moe_route_reference

pytestmark = pytest.mark.cuda

DEV = "cuda"

# (name, T, E, top_k, scoring, biased, n_group, topk_group, renormalize, scaling_factor)
KERNEL_CASES = [
    ("deepseek_v3", 64, 256, 8, "sigmoid", True, 8, 4, True, 2.5),
    ("deepseek_v3_raw", 257, 256, 8, "sigmoid", True, 8, 4, False, 2.5),
    ("kimi_k2", 33, 384, 8, "sigmoid", True, 1, 1, True, 2.827),
    ("glm4_5", 64, 160, 8, "sigmoid", True, 1, 1, True, 2.5),
    ("olmoe", 64, 64, 8, "softmax", False, 1, 1, False, 1.0),
    ("qwen3_moe", 5, 128, 8, "softmax", False, 1, 1, True, 1.0),
    ("softmax_bias_groups", 40, 64, 6, "softmax", True, 8, 3, True, 1.0),
    ("softmax_groups", 40, 96, 6, "softmax", False, 8, 3, False, 2.0),
    ("sigmoid_groups", 17, 48, 4, "sigmoid", False, 6, 2, True, 1.0),
    ("limits", 9, 1024, 16, "sigmoid", True, 32, 8, True, 2.5),
    ("kept_groups_whole", 12, 64, 16, "sigmoid", True, 8, 2, True, 1.0),
    ("tiny", 3, 4, 2, "sigmoid", True, 2, 1, True, 1.5),
    ("one_expert", 2, 1, 1, "sigmoid", False, 1, 1, True, 1.0),
    ("many_tokens", 4099, 60, 4, "sigmoid", True, 1, 1, True, 1.0),
]


def kernel_inputs(case, dtype, strided, seed=0):
    """(logits, kwargs) on the CPU and (logits, kwargs) on the GPU (strided: a (T, E) view with strides (1, T)),
    and top_k."""
    name, t, e, k, scoring, biased, n_group, topk_group, renorm, scale = case
    gen = torch.Generator().manual_seed(seed * 7919 + t * 31 + e)
    logits = (torch.randn(t, e, generator=gen) * 1.5).to(dtype)
    bias = torch.randn(e, generator=gen) * 0.05 if biased else None
    kwargs = dict(scoring=scoring, correction_bias=bias, n_group=n_group, topk_group=topk_group, renormalize=renorm,
                  scaling_factor=scale)
    logits_d = logits.t().contiguous().to(DEV).t() if strided else logits.to(DEV)
    kwargs_d = {**kwargs, "correction_bias": None if bias is None else bias.to(DEV)}
    return logits, kwargs, logits_d, kwargs_d, k


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", KERNEL_CASES, ids=[c[0] for c in KERNEL_CASES])
def test_route_kernel_is_the_reference_on_the_device(case, dtype, strided):
    _, t, e, k, *_ = case
    logits, kwargs, logits_d, kwargs_d, k = kernel_inputs(case, dtype, strided)
    w_ref, ids_ref = moe_route_reference(logits_d, k, **kwargs_d)
    w_ref, ids_ref = w_ref.cpu(), ids_ref.cpu()
    for byte in POISON:
        poison_allocator(t * k * 4, t * k * 4, byte=byte)
        w, ids = cw.moe_route(logits_d, k, **kwargs_d)
        assert w.dtype == torch.float32 and ids.dtype == torch.int32 and w.shape == ids.shape == (t, k)
        assert w.is_contiguous() and ids.is_contiguous()
        assert_bits_equal(ids, ids_ref, "topk_ids")
        assert_bits_equal(w, w_ref, "topk_weights")
    assert bool(((ids_ref >= 0) & (ids_ref < e)).all())
    assert all(len(set(row)) == k for row in ids_ref.tolist())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", KERNEL_CASES, ids=[c[0] for c in KERNEL_CASES])
def test_route_kernel_vs_cpu(case, dtype):
    _, t, e, k, scoring, biased, *_ = case
    logits, kwargs, logits_d, kwargs_d, k = kernel_inputs(case, dtype, False, seed=1)
    w_cpu, ids_cpu = cw.moe_route(logits, k, **kwargs)
    w, ids = cw.moe_route(logits_d, k, **kwargs_d)
    w, ids = w.cpu(), ids.cpu()
    if scoring == "softmax" and not biased and kwargs["n_group"] == 1:
        assert_bits_equal(ids, ids_cpu, "topk_ids")  # both rank the same float32 logits
    else:
        # a choice within 2**-16 of the boundary may fall on either side with the other device's exp (a few ulps
        # apart: CUDA's expf is within 2 ulps, the CPU's within 1)
        keep = ~selection_ties(logits, k, kwargs, rel=2.0**-16)
        assert int(keep.sum()) >= t - max(1, t // 50)
        cpu_sorted, cpu_order = ids_cpu[keep].long().sort(-1)
        our_sorted, our_order = ids[keep].long().sort(-1)
        assert torch.equal(our_sorted, cpu_sorted)
        w, w_cpu = w[keep].gather(1, our_order), w_cpu[keep].gather(1, cpu_order)
    # each score within a few ulps, the sum and the division a few more
    torch.testing.assert_close(w, w_cpu, rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", [n for n in ROUTER_DIMS])
@pytest.mark.parametrize("renormalize", [False, True], ids=["raw", "renormalized"])
def test_route_kernel_is_the_transformers_router_on_the_gpu(name, renormalize, seed):
    if ROUTER_DIMS[name][0] == "minimax_m2" and not renormalize:
        pytest.skip("MiniMax-M2's router always renormalizes (its raw weights are checked in the renormalized case)")
    router = hf_router(name, seed, renormalize=renormalize, device=DEV)
    gen = torch.Generator().manual_seed(2000 + seed)
    hidden = torch.randn(200, 32, generator=gen).to(DEV)
    with torch.no_grad():
        logits, w_hf, ids_hf = router(hidden)
    w, ids = cw.moe_route(logits, router.top_k, **router.kwargs)
    assert w.device == logits.device
    compared = compare_with_router(router, logits, w_hf, ids_hf, w, ids, renormalize)
    assert compared >= 200 - 2
    if router.family == "minimax_m2":
        raw, raw_ids = cw.moe_route(logits, router.top_k, **{**router.kwargs, "renormalize": False})
        assert torch.equal(raw_ids, ids)
        assert torch.equal(raw, torch.sigmoid(logits.float()).gather(1, ids.long()))


def test_route_kernel_softmax_case_is_moe_topk_softmax():
    gen = torch.Generator().manual_seed(5)
    for t, e, k in ((1, 8, 2), (64, 60, 4), (9, 1024, 16), (4, 128, 128)):
        logits = (torch.randn(t, e, generator=gen) * 2).to(DEV)
        for renorm in (True, False):
            ref = cw.moe_topk_softmax(logits, k, renorm)
            for a, b in zip(cw.moe_route(logits, k, renormalize=renorm), ref):
                assert torch.equal(a, b)


def test_route_kernel_ties():
    bias = torch.tensor([0.0, 0.25, -0.25, 0.25, 0.25, 0.0], device=DEV)
    _, ids = cw.moe_route(torch.zeros(3, 6, device=DEV), 4, scoring="sigmoid", correction_bias=bias)
    assert ids.tolist() == [[1, 3, 4, 0]] * 3
    bias = torch.tensor([0.0, 0.0, -0.25, 0.25, 0.0, 0.0, -0.25, -0.25], device=DEV)
    _, ids = cw.moe_route(torch.zeros(1, 8, device=DEV), 4, scoring="sigmoid", correction_bias=bias, n_group=4,
                          topk_group=2)
    assert ids.tolist() == [[3, 0, 1, 2]]
    # softmax without bias ranks the logits (1e-8 > 0) whatever the probabilities; with a (zero) bias it ranks the
    # probabilities, which this device's exp may or may not round to a tie: then the lower index first
    logits = torch.tensor([[0.0, 1e-8, -5.0]], device=DEV)
    _, ids = cw.moe_route(logits, 2)
    assert ids.tolist() == [[1, 0]]
    _, ids = cw.moe_route(logits, 2, correction_bias=torch.zeros(3, device=DEV))
    p = torch.softmax(logits, -1)[0].tolist()
    assert ids.tolist() == [sorted(range(3), key=lambda i: (-p[i], i))[:2]]
    w, ids = cw.moe_route(torch.zeros(0, 256, device=DEV), 8, scoring="sigmoid", n_group=8, topk_group=4)
    assert w.shape == ids.shape == (0, 8)


def test_route_kernel_nan_rows():
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(6, 64, generator=gen)
    logits[1, 5] = float("nan")
    logits[3] = float("nan")
    bias = torch.randn(64, generator=gen) * 0.05
    for kwargs in (dict(scoring="sigmoid", correction_bias=bias, n_group=8, topk_group=2),
                   dict(scoring="softmax"), dict(scoring="softmax", correction_bias=bias, n_group=4, topk_group=4)):
        if kwargs.get("correction_bias") is not None:
            kwargs["correction_bias"] = kwargs["correction_bias"].to(DEV)
        w, ids = cw.moe_route(logits.to(DEV), 8, **kwargs)
        ids = ids.cpu()
        assert bool(((ids >= 0) & (ids < 64)).all())
        clean = [0, 2, 4, 5]
        w_ref, ids_ref = cw.moe_route(logits[clean].to(DEV), 8, **kwargs)
        assert torch.equal(ids[clean], ids_ref.cpu()) and torch.equal(w.cpu()[clean], w_ref.cpu())


def route_step(logits, bias):
    return (cw.moe_route(logits, 8, scoring="sigmoid", correction_bias=bias, n_group=8, topk_group=4,
                         scaling_factor=2.5)
            + cw.moe_route(logits, 6, renormalize=False))


@pytest.mark.parametrize("t", [1, 16, 300])
def test_route_graph_replay_equals_eager(t):
    e = 256
    logits = torch.zeros(t, e, device=DEV)
    bias = torch.zeros(e, device=DEV)
    steps = []
    for i in range(4):
        gen = torch.Generator().manual_seed(300 + i)
        lg = torch.randn(t, e, generator=gen)
        if i == 2:
            lg[:, 200:] += 20.0  # every token's scores saturate in the last groups
        steps.append((lg.to(DEV), (torch.randn(e, generator=gen) * 0.1 * i).to(DEV)))
    results = replay_and_eager(lambda: route_step(logits, bias), (logits, bias), steps)
    for i, (replayed, eager) in enumerate(results):
        for name, a, b in zip(("weights", "ids", "softmax weights", "softmax ids"), replayed, eager):
            assert torch.equal(a, b), f"replay {i}: {name}"
    assert not torch.equal(results[0][1][1], results[1][1][1])  # the replays saw the new logits


def test_route_errors_on_cuda():
    logits = torch.zeros(2, 8, device=DEV)
    with pytest.raises(ValueError, match=r"moe_route: `correction_bias` is on cpu but `router_logits` is on cuda"):
        cw.moe_route(logits, 2, correction_bias=torch.zeros(8))
    with pytest.raises(ValueError, match=r"moe_route: `n_group` must divide E = 8 into groups of at least 2"):
        cw.moe_route(logits, 2, n_group=3)
    with pytest.raises(ValueError, match=r"moe_route: `scoring` must be 'softmax' or 'sigmoid', got 'tanh'"):
        cw.moe_route(logits, 2, scoring="tanh")
