"""moe_route on the CPU (ops/_reference.py) against transformers' router modules themselves (DeepseekV3TopkRouter
for DeepSeek-V3 and Kimi-K2, Glm4MoeTopkRouter, OlmoeTopKRouter, Qwen3MoeTopKRouter, MiniMaxM2TopKRouter), built
from their config classes with random weights and bias, called on random hidden states, at the released models'
router dims and tiny ones:

- the chosen experts: the same set per token (transformers' ``topk(sorted=False)`` leaves the order unspecified,
  so both are compared sorted by expert id), except on the tokens where transformers' own values tie exactly at
  its selection boundary (its tie-breaking is unspecified; `router_ties` finds them; at most 1 % of the tokens);
- the weights per expert bit for bit before renormalization (``norm_topk_prob=False``; DeepSeek-V3's scaling
  factor is one float32 product on both sides), and after it bit for bit for top_k <= 2 (a sum of two is the same
  in any order), otherwise within `renormalized_rel_bound` (the sum's order differs: about (top_k + 1) * eps32);
- moe_route's softmax case is moe_topk_softmax bit for bit; a naive loop implementation of the documented
  selection agrees on softmax + bias and on grouped selections no transformers router has; forced ties follow the
  documented policy (lower expert / group index first; softmax without bias ranks logits); every validation names
  its argument; the fake and torch.compile. (opcheck runs moe_route's cases of tests/_moe_routing.py's
  `opcheck_cases` with the other routing ops: test_moe_routing_cpu.py, test_moe_routing_cuda.py.)
"""

from __future__ import annotations

import pytest
import torch

import cutlass_w8a8 as cw
from _moe_routing import OPS, ROUTER_DIMS, compare_with_router, hf_router, naive_route

SEEDS = (0, 1, 2)
TOKENS = 96


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", list(ROUTER_DIMS))
@pytest.mark.parametrize("renormalize", [False, True], ids=["raw", "renormalized"])
def test_route_is_the_transformers_router(name, renormalize, seed):
    family = ROUTER_DIMS[name][0]
    if family == "minimax_m2" and not renormalize:
        pytest.skip("MiniMax-M2's router always renormalizes (its raw weights are checked in the renormalized case)")
    router = hf_router(name, seed, renormalize=renormalize)
    gen = torch.Generator().manual_seed(1000 + seed)
    hidden = torch.randn(TOKENS, 32, generator=gen)
    with torch.no_grad():
        logits, w_hf, ids_hf = router(hidden)
    w, ids = cw.moe_route(logits, router.top_k, **router.kwargs)
    assert compare_with_router(router, logits, w_hf, ids_hf, w, ids, renormalize) >= TOKENS - TOKENS // 100
    if family == "minimax_m2":  # its raw weights: the module's own sigmoid of the logits at the chosen ids
        raw, raw_ids = cw.moe_route(logits, router.top_k, **{**router.kwargs, "renormalize": False})
        assert torch.equal(raw_ids, ids)
        assert torch.equal(raw, torch.sigmoid(logits.float()).gather(1, ids.long()))
    if renormalize:  # the sums are far above 2**-42, where DeepSeek-V3's + 1e-20 would matter
        raw, _ = cw.moe_route(logits, router.top_k, **{**router.kwargs, "renormalize": False})
        assert raw.sum(-1).min().item() > 1e-3 * router.kwargs["scaling_factor"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("t,e,k", [(1, 8, 2), (33, 60, 4), (16, 128, 8), (3, 5, 5), (4, 1024, 16)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_softmax_case_is_moe_topk_softmax(dtype, t, e, k, renormalize):
    gen = torch.Generator().manual_seed(t * 100 + e + k)
    logits = (torch.randn(t, e, generator=gen) * 2).to(dtype)
    ref = cw.moe_topk_softmax(logits, k, renormalize)
    for args in [dict(renormalize=renormalize), dict(scoring="softmax", correction_bias=None, n_group=1,
                                                     topk_group=1, renormalize=renormalize, scaling_factor=1.0)]:
        for a, b in zip(cw.moe_route(logits, k, **args), ref):
            assert torch.equal(a, b)
    strided = logits.t().contiguous().t()
    for a, b in zip(cw.moe_route(strided, k, renormalize=renormalize), ref):
        assert torch.equal(a, b)


ROUTE_CASES = [  # (T, E, top_k, scoring, bias, n_group, topk_group, renormalize, scale)
    (40, 64, 6, "softmax", True, 8, 3, True, 1.0),    # softmax + bias + groups (no transformers router)
    (40, 64, 6, "softmax", False, 8, 3, False, 2.0),  # softmax groups, ranked by logits
    (40, 48, 4, "sigmoid", False, 6, 2, True, 1.0),   # sigmoid groups without bias
    (40, 20, 3, "softmax", True, 1, 1, True, 1.0),    # softmax + bias (Ernie-4.5-MoE's selection)
    (9, 1024, 16, "sigmoid", True, 32, 8, True, 2.5),  # the limits: 1024 experts, 32 groups
    (5, 512, 8, "sigmoid", True, 16, 16, True, 1.0),   # every group kept: the plain top-k of the choice
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ROUTE_CASES, ids=[f"E{c[1]}-{c[3]}-bias{c[4]}-g{c[5]}/{c[6]}" for c in ROUTE_CASES])
def test_route_is_the_naive_loop(case, dtype):
    t, e, k, scoring, biased, n_group, topk_group, renorm, scale = case
    gen = torch.Generator().manual_seed(e * 7 + k)
    logits = (torch.randn(t, e, generator=gen) * 1.5).to(dtype)
    bias = torch.randn(e, generator=gen) * 0.05 if biased else None
    w, ids = cw.moe_route(logits, k, scoring=scoring, correction_bias=bias, n_group=n_group, topk_group=topk_group,
                          renormalize=renorm, scaling_factor=scale)
    w_ref, ids_ref = naive_route(logits, k, scoring, bias, n_group, topk_group, renorm, scale)
    assert torch.equal(ids.long(), ids_ref)
    assert torch.equal(w, w_ref)
    size = e // n_group
    kept_groups = (ids.long() // size)
    assert all(len(set(row.tolist())) <= topk_group for row in kept_groups)
    assert all(len(set(row.tolist())) == k for row in ids)


def test_every_group_kept_is_the_plain_top_k():
    gen = torch.Generator().manual_seed(11)
    logits, bias = torch.randn(30, 64, generator=gen), torch.randn(64, generator=gen) * 0.1
    grouped = cw.moe_route(logits, 6, scoring="sigmoid", correction_bias=bias, n_group=8, topk_group=8)
    plain = cw.moe_route(logits, 6, scoring="sigmoid", correction_bias=bias)
    for a, b in zip(grouped, plain):
        assert torch.equal(a, b)


# ---- ties ---------------------------------------------------------------------------------------------------


def test_ties_take_the_lower_expert_first():
    # sigmoid(0) = 0.5 exactly; the bias makes exact ties of the choice values: 0.75 at experts 1, 3, 4
    logits = torch.zeros(2, 6)
    bias = torch.tensor([0.0, 0.25, -0.25, 0.25, 0.25, 0.0])
    w, ids = cw.moe_route(logits, 3, scoring="sigmoid", correction_bias=bias, renormalize=False)
    assert ids.tolist() == [[1, 3, 4]] * 2
    assert torch.equal(w, torch.full((2, 3), 0.5))  # the unbiased scores
    _, ids = cw.moe_route(logits, 4, scoring="sigmoid", correction_bias=bias)
    assert ids.tolist() == [[1, 3, 4, 0]] * 2  # then 0.5 at experts 0 and 5: the lower first
    # sigmoid saturates: 20 and 30 both give 1.0 in float32, tied whatever their logits
    _, ids = cw.moe_route(torch.tensor([[20.0, 0.0, 30.0, 25.0]]), 2, scoring="sigmoid")
    assert ids.tolist() == [[0, 2]]
    # all equal: the first top_k experts
    _, ids = cw.moe_route(torch.full((1, 16), 0.3), 5, scoring="sigmoid", correction_bias=torch.zeros(16))
    assert ids.tolist() == [[0, 1, 2, 3, 4]]


def test_softmax_without_bias_ranks_the_logits():
    """1e-8 and 0 are different float32 logits whose probabilities round to the same float32: without a bias the
    larger logit comes first (moe_topk_softmax's order); with a (zero) bias the ranking is by probability + bias, a
    tie, so the lower expert comes first."""
    logits = torch.tensor([[0.0, 1e-8, -5.0]])
    p = torch.softmax(logits, -1)
    assert p[0, 0] == p[0, 1] and logits[0, 0] != logits[0, 1]
    w, ids = cw.moe_route(logits, 2, renormalize=False)
    assert ids.tolist() == [[1, 0]] and torch.equal(w, p[:, [1, 0]])
    _, ids = cw.moe_route(logits, 2, correction_bias=torch.zeros(3), renormalize=False)
    assert ids.tolist() == [[0, 1]]


def test_group_ties_take_the_lower_group_first():
    # groups of 2 (E = 8, n_group = 4): group scores, sigmoid(0) = 0.5 plus bias:
    #   group 0: 0.5 + 0.5 = 1.0; group 1: 0.75 + 0.25 = 1.0 (its best expert 3 beats all of group 0);
    #   group 2: 0.5 + 0.5 = 1.0; group 3: 0.25 + 0.25 = 0.5
    bias = torch.tensor([0.0, 0.0, -0.25, 0.25, 0.0, 0.0, -0.25, -0.25])
    logits = torch.zeros(1, 8)
    _, ids = cw.moe_route(logits, 2, scoring="sigmoid", correction_bias=bias, n_group=4, topk_group=1)
    assert ids.tolist() == [[0, 1]]  # groups 0, 1, 2 tie at 1.0: group 0 is kept
    _, ids = cw.moe_route(logits, 4, scoring="sigmoid", correction_bias=bias, n_group=4, topk_group=2)
    assert ids.tolist() == [[3, 0, 1, 2]]  # groups 0 and 1 kept; expert 3 (0.75) first, then 0.5, 0.5, 0.25
    _, ids = cw.moe_route(logits, 6, scoring="sigmoid", correction_bias=bias, n_group=4, topk_group=3)
    assert ids.tolist() == [[3, 0, 1, 4, 5, 2]]
    # a group's score is its two best choices: one strong expert does not beat two good ones
    bias = torch.tensor([0.4, -0.45, 0.2, 0.2])  # group 0: 0.9 + 0.05 = 0.95; group 1: 0.7 + 0.7 = 1.4
    _, ids = cw.moe_route(torch.zeros(1, 4), 1, scoring="sigmoid", correction_bias=bias, n_group=2, topk_group=1)
    assert ids.tolist() == [[2]]


# ---- shapes, errors, opcheck, fakes -------------------------------------------------------------------------


def test_t0_e1_and_k_equals_e():
    w, ids = cw.moe_route(torch.zeros(0, 256), 8, scoring="sigmoid", correction_bias=torch.zeros(256), n_group=8,
                          topk_group=4)
    assert w.shape == ids.shape == (0, 8)
    w, ids = cw.moe_route(torch.randn(3, 1), 1, scoring="sigmoid", renormalize=True, scaling_factor=3.0)
    assert torch.equal(ids, torch.zeros(3, 1, dtype=torch.int32)) and torch.equal(w, torch.full((3, 1), 3.0))
    gen = torch.Generator().manual_seed(12)
    _, ids = cw.moe_route(torch.randn(4, 12, generator=gen), 12, scoring="sigmoid", n_group=3, topk_group=3)
    assert torch.equal(ids.sort(-1).values, torch.arange(12, dtype=torch.int32).expand(4, 12))


def _route(e=8, k=2, **kw):
    return lambda: cw.moe_route(torch.zeros(2, e), k, **kw)


ERRORS = [
    (lambda: cw.moe_route(torch.zeros(2, 4, dtype=torch.float64), 1), TypeError,
     "moe_route: `router_logits` must be bfloat16, float16 or float32, got torch.float64"),
    (lambda: cw.moe_route(torch.zeros(2, 3, 4), 1), ValueError,
     "moe_route: `router_logits` must be 2-D [T, E], got shape (2, 3, 4)"),
    (lambda: cw.moe_route(torch.zeros(2, 1025), 1), ValueError,
     "moe_route: `router_logits` E = router_logits.shape[1] must be in [1, 1024], got 1025"),
    (_route(k=9), ValueError, "moe_route: `top_k` must be in [1, E] with E = 8, got 9"),
    (_route(k=0), ValueError, "moe_route: `top_k` must be in [1, E] with E = 8, got 0"),
    (_route(scoring="tanh"), ValueError, "moe_route: `scoring` must be 'softmax' or 'sigmoid', got 'tanh'"),
    (_route(correction_bias=torch.zeros(8, dtype=torch.bfloat16)), TypeError,
     "moe_route: `correction_bias` must be float32, got torch.bfloat16"),
    (_route(correction_bias=torch.zeros(8, device="meta")), ValueError,
     "moe_route: `correction_bias` is on meta but `router_logits` is on cpu"),
    (_route(correction_bias=torch.zeros(7)), ValueError,
     "moe_route: `correction_bias` must be [E] = [8], got shape (7,)"),
    (_route(correction_bias=torch.zeros(1, 8)), ValueError,
     "moe_route: `correction_bias` must be [E] = [8], got shape (1, 8)"),
    (_route(n_group=0), ValueError, "moe_route: `n_group` must be in [1, 32], got 0"),
    (_route(e=66, n_group=33), ValueError, "moe_route: `n_group` must be in [1, 32], got 33"),
    (_route(n_group=3), ValueError, "moe_route: `n_group` must divide E = 8 into groups of at least 2 experts, got 3"),
    (_route(n_group=8), ValueError, "moe_route: `n_group` must divide E = 8 into groups of at least 2 experts, got 8"),
    (_route(topk_group=2), ValueError, "moe_route: `topk_group` must be in [1, n_group] with n_group = 1, got 2"),
    (_route(n_group=4, topk_group=0), ValueError,
     "moe_route: `topk_group` must be in [1, n_group] with n_group = 4, got 0"),
    (_route(k=3, n_group=4, topk_group=1), ValueError,
     "moe_route: `top_k` must be at most topk_group * E / n_group = 2 (the experts of the kept groups), got 3"),
    (_route(scaling_factor=float("inf")), ValueError, "moe_route: `scaling_factor` must be a finite number"),
    (_route(scaling_factor=float("nan")), ValueError, "moe_route: `scaling_factor` must be a finite number"),
]


@pytest.mark.parametrize("trigger,exc,message", ERRORS, ids=[m[2].split("`")[1] + str(i) for i, m in enumerate(ERRORS)])
def test_errors_name_the_argument(trigger, exc, message):
    with pytest.raises(exc) as info:
        trigger()
    assert str(info.value).splitlines()[0] == message


def test_errors_on_meta_sizes():
    with pytest.raises(ValueError, match=r"moe_route: `router_logits` has 2147483648 rows"):
        cw.moe_route(torch.empty(2**31, 8, device="meta"), 2)


def test_fake_shapes_and_compile():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        w, ids = OPS.moe_route(torch.empty(5, 256), 8, "sigmoid", torch.empty(256), 8, 4, True, 2.5)
        assert w.shape == ids.shape == (5, 8) and w.dtype == torch.float32 and ids.dtype == torch.int32
        with pytest.raises(ValueError, match="`n_group` must divide E = 256"):
            OPS.moe_route(torch.empty(5, 256), 8, "sigmoid", None, 3, 1, True, 1.0)

    def route(logits, bias):
        return cw.moe_route(logits, 4, scoring="sigmoid", correction_bias=bias, n_group=4, topk_group=2,
                            scaling_factor=2.5)

    gen = torch.Generator().manual_seed(13)
    logits, bias = torch.randn(6, 32, generator=gen), torch.randn(32, generator=gen)
    compiled = torch.compile(route, fullgraph=True, backend="eager")
    for a, b in zip(compiled(logits, bias), route(logits, bias)):
        assert torch.equal(a, b)
