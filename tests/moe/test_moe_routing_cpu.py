"""The MoE routing ops on the CPU (ops/_reference.py): moe_topk_softmax against transformers' router math written
out, moe_align against a Python-loop counting sort, moe_permute_quant against the public quantizers on the gathered
rows (bit for bit), moe_unpermute against a per-token loop (bit for bit), the four chained against a dense
per-token mixture of experts, their fakes, opcheck, and the errors of their contracts."""

from __future__ import annotations

import pytest
import torch

import cutlass_w8a8 as cw
from _moe_routing import FP8, OPS, naive_align, naive_unpermute, opcheck_cases, random_ids, router_math
from _full import opcheck


def distinct_logits(t, e, dtype, gen):
    """(T, E) logits with no two equal in a row, exact in bfloat16 / float16 (multiples of 1/16 below 16)."""
    rows = [torch.randperm(e, generator=gen).to(torch.float32) / 16 - e / 32 for _ in range(t)]
    return torch.stack(rows).to(dtype)


# ---- moe_topk_softmax ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("t,e,k", [(1, 8, 2), (7, 8, 1), (33, 60, 4), (16, 128, 8), (3, 5, 5), (4, 250, 6)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_topk_softmax_is_the_router_math(dtype, t, e, k, renormalize):
    gen = torch.Generator().manual_seed(t * 1000 + e * 10 + k)
    logits = distinct_logits(t, e, dtype, gen)
    w, ids = cw.moe_topk_softmax(logits, k, renormalize)
    w_ref, ids_ref = router_math(logits, k, renormalize)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32 and w.shape == ids.shape == (t, k)
    assert torch.equal(ids.long(), ids_ref)
    # the softmax is the same torch call; only the float32 sum of the renormalization may be ordered differently
    torch.testing.assert_close(w, w_ref, rtol=3e-7, atol=0)
    if renormalize:
        torch.testing.assert_close(w.sum(-1), torch.ones(t), rtol=1e-6, atol=0)


def test_topk_softmax_ties_take_the_lower_expert_first():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    w, ids = cw.moe_topk_softmax(logits, 3, False)
    assert ids.tolist() == [[1, 2, 4], [0, 1, 2]]
    assert torch.equal(w[1], torch.full((3,), 0.2))
    w, ids = cw.moe_topk_softmax(logits, 3, True)
    assert torch.equal(w[0, 0], w[0, 2]) and torch.equal(w[1], w[1, :1].expand(3))
    torch.testing.assert_close(w[1], torch.full((3,), 1 / 3), rtol=3e-7, atol=0)


def test_topk_softmax_renormalized_is_the_probabilities_over_their_sum():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(9, 16, generator=gen)
    w_raw, ids_raw = cw.moe_topk_softmax(logits, 4, False)
    w, ids = cw.moe_topk_softmax(logits, 4, True)
    assert torch.equal(ids, ids_raw)
    total = ((w_raw[:, 0] + w_raw[:, 1]) + w_raw[:, 2]) + w_raw[:, 3]
    assert torch.equal(w, w_raw / total[:, None])
    assert torch.equal(w_raw, torch.softmax(logits, -1).gather(1, ids.long()))


def test_topk_softmax_strided_logits_and_k_equals_e():
    gen = torch.Generator().manual_seed(4)
    base = torch.randn(12, 7, generator=gen)
    strided = base.t().contiguous().t()  # (12, 7) with strides (1, 12)
    assert not strided.is_contiguous()
    for a, b in zip(cw.moe_topk_softmax(strided, 7, True), cw.moe_topk_softmax(base, 7, True)):
        assert torch.equal(a, b)
    _, ids = cw.moe_topk_softmax(base, 7, True)
    assert torch.equal(ids.sort(-1).values, torch.arange(7, dtype=torch.int32).expand(12, 7))


def test_topk_softmax_t0_and_e1():
    w, ids = cw.moe_topk_softmax(torch.zeros(0, 4), 2, True)
    assert w.shape == ids.shape == (0, 2)
    w, ids = cw.moe_topk_softmax(torch.randn(3, 1), 1, False)
    assert torch.equal(ids, torch.zeros(3, 1, dtype=torch.int32)) and torch.equal(w, torch.ones(3, 1))


# ---- moe_align ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("idtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("t,k,e,unrouted", [(1, 1, 1, 0.0), (1, 2, 8, 0.0), (5, 2, 3, 0.0), (64, 8, 60, 0.0),
                                            (300, 2, 8, 0.1), (37, 4, 1000, 0.2), (100, 8, 512, 0.0),
                                            (20, 3, 7, 1.0), (9, 10, 6, 0.0)])
def test_align_is_the_stable_counting_sort(idtype, t, k, e, unrouted):
    gen = torch.Generator().manual_seed(t * 7 + k * 3 + e)
    ids = random_ids(t, k, e, gen, unrouted, idtype)
    got = cw.moe_align(ids, e)
    ref = naive_align(ids, e)
    for name, a, b in zip(("sorted_pairs", "dst_pos", "offsets"), got, ref):
        assert a.dtype == torch.int32 and torch.equal(a, b), name
    sorted_pairs, dst_pos, offsets = got
    routed = int(offsets[-1])
    # the inverse permutation, and each group holds its expert's pairs in increasing pair order
    assert torch.equal(dst_pos[sorted_pairs[:routed].long()], torch.arange(routed, dtype=torch.int32))
    flat = ids.reshape(-1).long()
    start = 0
    for x in range(e):
        group = sorted_pairs[start:int(offsets[x])].long()
        assert torch.all(flat[group] == x) and torch.all(group[1:] > group[:-1])
        start = int(offsets[x])
    assert torch.all(dst_pos[sorted_pairs[routed:].long()] == -1)


def test_align_all_pairs_on_one_expert_and_edges():
    ids = torch.full((6, 2), 3, dtype=torch.int32)
    sp, dst, off = cw.moe_align(ids, 5)
    assert sp.tolist() == list(range(12)) and dst.tolist() == list(range(12))
    assert off.tolist() == [0, 0, 0, 12, 12]
    sp, dst, off = cw.moe_align(torch.tensor([[2]]), 3)  # T = 1, k = 1
    assert sp.tolist() == [0] and dst.tolist() == [0] and off.tolist() == [0, 0, 1]
    sp, dst, off = cw.moe_align(torch.full((4, 2), -1), 4)  # nothing routed
    assert sp.tolist() == list(range(8)) and dst.tolist() == [-1] * 8 and off.tolist() == [0] * 4
    sp, dst, off = cw.moe_align(torch.zeros(0, 8, dtype=torch.int32), 7)  # T = 0
    assert sp.shape == dst.shape == (0,) and off.tolist() == [0] * 7


def test_align_strided_ids():
    gen = torch.Generator().manual_seed(5)
    ids = random_ids(40, 4, 9, gen, 0.1)
    strided = ids.t().contiguous().t()
    for a, b in zip(cw.moe_align(strided, 9), cw.moe_align(ids, 9)):
        assert torch.equal(a, b)


def test_align_65536_pairs():
    gen = torch.Generator().manual_seed(6)
    ids = torch.randint(-1, 128, (8192, 8), generator=gen, dtype=torch.int32)
    for a, b in zip(cw.moe_align(ids, 128), naive_align(ids, 128)):
        assert torch.equal(a, b)


# ---- moe_permute_quant --------------------------------------------------------------------------------------

QUANT = {torch.int8: cw.quantize_int8, FP8: cw.quantize_fp8}


def routed(t, k, e, seed, unrouted=0.0):
    gen = torch.Generator().manual_seed(seed)
    ids = random_ids(t, k, e, gen, unrouted)
    return ids, cw.moe_align(ids, e)


@pytest.mark.parametrize("xdtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("qdtype", [torch.int8, FP8])
@pytest.mark.parametrize("mode", ["dynamic", "static", "group"])
@pytest.mark.parametrize("t,k,e,h", [(1, 1, 4, 256), (7, 2, 5, 384), (33, 4, 16, 128), (4, 3, 3, 1024)])
def test_permute_quant_is_quantize_of_the_gathered_rows(xdtype, qdtype, mode, t, k, e, h):
    _, (sp, _, _) = routed(t, k, e, seed=t + k + h, unrouted=0.1)
    gen = torch.Generator().manual_seed(h)
    x = (torch.randn(t, h, generator=gen) * 3).to(xdtype)
    rows = x[sp.long() // k]
    scale = torch.tensor([0.03]) if mode == "static" else None
    group = 128 if mode == "group" else None
    q, s = cw.moe_permute_quant(x, sp, k, qdtype, scale, group)
    if mode == "group":
        q_ref, s_ref = cw.quantize_per_token_group(rows, 128, qdtype)
    else:
        q_ref, s_ref = QUANT[qdtype](rows, scale)
    assert q.shape == (t * k, h) and q.dtype == qdtype
    assert torch.equal(q.view(torch.int8), q_ref.view(torch.int8))
    assert torch.equal(s, s_ref)
    if mode == "static":
        assert s is scale
        q2, s2 = OPS.moe_permute_quant(x, sp, k, qdtype, scale, 0)
        assert torch.equal(s2, scale.expand(t * k, 1))


def test_permute_quant_clamps_pair_indices():
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    sp = torch.tensor([5, -4, 2, 100, 0, 1], dtype=torch.int32)  # T * k = 6: 100 -> 5, -4 -> 0
    q, s = cw.moe_permute_quant(x, sp, 2, torch.int8)
    q_ref, s_ref = cw.quantize_int8(x[torch.tensor([2, 0, 1, 2, 0, 0])])
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)


# ---- moe_unpermute ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("t,k,e,h,unrouted", [(1, 1, 2, 64, 0.0), (9, 2, 8, 200, 0.2), (16, 8, 60, 128, 0.0),
                                              (5, 3, 3, 7, 0.5)])
def test_unpermute_is_the_weighted_sum(dtype, t, k, e, h, unrouted):
    _, (_, dst, _) = routed(t, k, e, seed=t * k + h, unrouted=unrouted)
    gen = torch.Generator().manual_seed(h + 1)
    y = torch.randn(t * k, h, generator=gen).to(dtype)
    w = torch.rand(t, k, generator=gen)
    out = cw.moe_unpermute(y, dst, w)
    assert out.dtype == dtype and out.shape == (t, h)
    assert torch.equal(out, naive_unpermute(y, dst, w))
    buf = torch.full((t, h), float("nan"), dtype=dtype)
    assert cw.moe_unpermute(y, dst, w, out=buf) is buf and torch.equal(buf, out)


def test_unpermute_skips_unrouted_and_inverts_the_gather():
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(6, 32, generator=gen, dtype=torch.bfloat16)
    ids = torch.tensor([[0, 1], [1, -1], [-1, -1], [2, 0], [1, 2], [2, 1]])
    sp, dst, _ = cw.moe_align(ids, 3)
    y = x[sp.long() // 2]  # the permuted rows, unquantized
    one_hot = torch.zeros(6, 2)
    one_hot[:, 0] = 1.0
    out = cw.moe_unpermute(y, dst, one_hot)
    assert torch.equal(out[2], torch.zeros(32, dtype=torch.bfloat16))  # token 2: nothing routed
    assert torch.equal(out[[0, 1, 3, 4, 5]], x[[0, 1, 3, 4, 5]])
    y_poison = y.clone()
    y_poison[int(cw.moe_align(ids, 3)[2][-1]):] = float("nan")  # rows of unrouted pairs are never read
    w = torch.rand(6, 2, generator=gen)
    assert torch.equal(cw.moe_unpermute(y_poison, dst, w), cw.moe_unpermute(y, dst, w))
    assert not torch.isnan(cw.moe_unpermute(y_poison, dst, w)).any()


def test_routing_chain_is_a_dense_mixture_of_experts():
    """topk_softmax -> align -> gather -> each expert's rows [offsets[e-1], offsets[e]) -> unpermute equals, for
    each token, sum_j w_j * W_{e_j} x_t computed densely (float64)."""
    gen = torch.Generator().manual_seed(9)
    t, e, k, h, n = 11, 6, 2, 32, 16
    x = torch.randn(t, h, generator=gen, dtype=torch.float64)
    experts = torch.randn(e, n, h, generator=gen, dtype=torch.float64)
    w, ids = cw.moe_topk_softmax(torch.randn(t, e, generator=gen), k, True)
    sp, dst, off = cw.moe_align(ids, e)
    a = x[sp.long() // k].float()
    y = torch.empty(t * k, n)
    start = 0
    for i in range(e):
        end = int(off[i])
        y[start:end] = a[start:end] @ experts[i].float().t()
        start = end
    out = cw.moe_unpermute(y, dst, w).double()
    dense = torch.stack([sum(w[i, j].double() * (experts[ids[i, j]] @ x[i]) for j in range(k)) for i in range(t)])
    torch.testing.assert_close(out, dense, rtol=1e-5, atol=1e-5)


# ---- fakes, opcheck, errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize("case", opcheck_cases("cpu"), ids=lambda c: c[0] if isinstance(c, tuple) else None)
def test_opcheck_cpu(case):
    _, op, args = case
    opcheck(op, args)


def test_fakes_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        w, ids = OPS.moe_topk_softmax(torch.empty(5, 12, dtype=torch.bfloat16), 3, True)
        assert w.shape == ids.shape == (5, 3) and w.dtype == torch.float32 and ids.dtype == torch.int32
        sp, dst, off = OPS.moe_align(torch.empty(5, 3, dtype=torch.int64), 12)
        assert sp.shape == dst.shape == (15,) and off.shape == (12,) and off.dtype == torch.int32
        x = torch.empty(5, 256, dtype=torch.bfloat16)
        q, s = OPS.moe_permute_quant(x, sp, 3, FP8, None, 128)
        assert q.shape == (15, 256) and q.dtype == FP8 and s.shape == (15, 2)
        q, s = OPS.moe_permute_quant(x, sp, 3, torch.int8, None, 0)
        assert s.shape == (15, 1)
        out = OPS.moe_unpermute(torch.empty(15, 256, dtype=torch.float16), dst, torch.empty(5, 3))
        assert out.shape == (5, 256) and out.dtype == torch.float16


def test_compiled_routing_matches_eager():
    def route(logits, x):
        w, ids = cw.moe_topk_softmax(logits, 2, True)
        sp, dst, off = cw.moe_align(ids, 8)
        q, s = cw.moe_permute_quant(x, sp, 2, torch.int8)
        y = (q.float() * s).to(x.dtype)
        return cw.moe_unpermute(y, dst, w), off

    gen = torch.Generator().manual_seed(10)
    logits, x = torch.randn(6, 8, generator=gen), torch.randn(6, 128, generator=gen, dtype=torch.bfloat16)
    compiled = torch.compile(route, fullgraph=True, backend="eager")
    for a, b in zip(compiled(logits, x), route(logits, x)):
        assert torch.equal(a, b)


ERRORS = [
    (lambda: cw.moe_topk_softmax(torch.zeros(2, 4, dtype=torch.float64), 1), TypeError,
     "moe_topk_softmax: `router_logits` must be bfloat16, float16 or float32, got torch.float64"),
    (lambda: cw.moe_topk_softmax(torch.zeros(2, 3, 4), 1), ValueError,
     "moe_topk_softmax: `router_logits` must be 2-D [T, E], got shape (2, 3, 4)"),
    (lambda: cw.moe_topk_softmax(torch.zeros(2, 1025), 1), ValueError,
     "moe_topk_softmax: `router_logits` E = router_logits.shape[1] must be in [1, 1024], got 1025"),
    (lambda: cw.moe_topk_softmax(torch.zeros(2, 4), 5), ValueError,
     "moe_topk_softmax: `top_k` must be in [1, E] with E = 4, got 5"),
    (lambda: cw.moe_align(torch.zeros(2, 2), 4), TypeError,
     "moe_align: `topk_ids` must be int32 or int64, got torch.float32"),
    (lambda: cw.moe_align(torch.zeros(4, dtype=torch.int32), 4), ValueError,
     "moe_align: `topk_ids` must be 2-D [T, top_k], got shape (4,)"),
    (lambda: cw.moe_align(torch.zeros(2, 2, dtype=torch.int32), 0), ValueError,
     "moe_align: `num_experts` must be in [1, 1024], got 0"),
    (lambda: cw.moe_permute_quant(torch.zeros(2, 2, 128), torch.zeros(4, dtype=torch.int32), 2, torch.int8),
     ValueError, "moe_permute_quant: `x` must be 2-D [T, H], got shape (2, 2, 128)"),
    (lambda: cw.moe_permute_quant(torch.zeros(2, 128), torch.zeros(4), 2, torch.int8), TypeError,
     "moe_permute_quant: `sorted_pairs` must be int32, got torch.float32"),
    (lambda: cw.moe_permute_quant(torch.zeros(2, 128), torch.zeros(4, dtype=torch.int32), 0, torch.int8),
     ValueError, "moe_permute_quant: `top_k` must be at least 1, got 0"),
    (lambda: cw.moe_permute_quant(torch.zeros(2, 128), torch.zeros(3, dtype=torch.int32), 2, torch.int8),
     ValueError, "moe_permute_quant: `sorted_pairs` must be [T * top_k] = [4] with T = x.shape[0] = 2, got shape (3,)"),
    (lambda: cw.moe_permute_quant(torch.zeros(2, 128), torch.zeros(4, dtype=torch.int32), 2, torch.float16),
     TypeError, "moe_permute_quant: `dtype` must be torch.int8 or torch.float8_e4m3fn, got torch.float16"),
    (lambda: cw.moe_permute_quant(torch.zeros(2, 64), torch.zeros(4, dtype=torch.int32), 2, FP8, None, 128),
     ValueError, "moe_permute_quant: `x` the output row length 64 must be a multiple of group_size = 128"),
    (lambda: cw.moe_unpermute(torch.zeros(4, 8, dtype=torch.int32), torch.zeros(4, dtype=torch.int32),
                              torch.zeros(2, 2)), TypeError,
     "moe_unpermute: `y` must be bfloat16, float16 or float32, got torch.int32"),
    (lambda: cw.moe_unpermute(torch.zeros(4, 8), torch.zeros(4), torch.zeros(2, 2)), TypeError,
     "moe_unpermute: `dst_pos` must be int32, got torch.float32"),
    (lambda: cw.moe_unpermute(torch.zeros(4, 8), torch.zeros(4, dtype=torch.int32), torch.zeros(2, 2,
                                                                                                 dtype=torch.float16)),
     TypeError, "moe_unpermute: `topk_weights` must be float32, got torch.float16"),
    (lambda: cw.moe_unpermute(torch.zeros(4, 8), torch.zeros(4, dtype=torch.int32), torch.zeros(2, 2),
                              out=torch.zeros(2, 8, dtype=torch.bfloat16)), TypeError,
     "moe_unpermute: `out` must have y's dtype torch.float32, got torch.bfloat16"),
    (lambda: cw.moe_unpermute(torch.zeros(4, 8), torch.zeros(4, dtype=torch.int32), torch.zeros(4)), ValueError,
     "moe_unpermute: `topk_weights` must be 2-D [T, top_k], got shape (4,)"),
    (lambda: cw.moe_unpermute(torch.zeros(5, 8), torch.zeros(4, dtype=torch.int32), torch.zeros(2, 2)), ValueError,
     "moe_unpermute: `y` must be 2-D [T * top_k, H] with T * top_k = 4 (T, top_k = topk_weights.shape), got shape "
     "(5, 8)"),
    (lambda: cw.moe_unpermute(torch.zeros(4, 8), torch.zeros(5, dtype=torch.int32), torch.zeros(2, 2)), ValueError,
     "moe_unpermute: `dst_pos` must be [T * top_k] = [4], got shape (5,)"),
    (lambda: cw.moe_unpermute(torch.zeros(4, 8), torch.zeros(4, dtype=torch.int32), torch.zeros(2, 2),
                              out=torch.zeros(2, 9)), ValueError,
     "moe_unpermute: `out` must be [T, H] = [2, 8], got shape (2, 9)"),
    (lambda: cw.moe_unpermute(torch.zeros(4, 8), torch.zeros(4, dtype=torch.int32), torch.zeros(2, 2),
                              out=torch.zeros(8, 2).t()), ValueError, "moe_unpermute: `out` must be contiguous"),
]


@pytest.mark.parametrize("trigger,exc,message", ERRORS, ids=[m[2].split(":")[0] + str(i) for i, m in enumerate(ERRORS)])
def test_errors(trigger, exc, message):
    with pytest.raises(exc) as info:
        trigger()
    assert str(info.value).splitlines()[0] == message


def test_errors_on_meta_sizes():
    """Limits shown on meta tensors (no memory)."""
    with pytest.raises(ValueError, match=r"moe_align: `topk_ids` has 2147483648 \(token, expert\) pairs"):
        cw.moe_align(torch.empty(2**28, 8, dtype=torch.int32, device="meta"), 8)
    with pytest.raises(ValueError, match=r"moe_permute_quant: `top_k` T \* top_k = 4294967296 rows"):
        cw.moe_permute_quant(torch.empty(2**30, 128, dtype=torch.bfloat16, device="meta"),
                             torch.empty(0, dtype=torch.int32, device="meta"), 4, torch.int8)
