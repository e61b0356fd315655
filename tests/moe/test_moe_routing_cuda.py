"""The MoE routing kernels (csrc/moe/) against their CPU implementations (ops/_reference.py):

- moe_align, moe_permute_quant and moe_unpermute bit for bit: ids, offsets, the sorted order, the quantized bytes
  and the scales, the weighted sums (the kernels do the references' float32 operations in their order);
- moe_topk_softmax: the ids exactly (both rank the same float32 logits), the weights within a few float32 ulps
  (the exp and the order of the softmax sum differ);
- outputs start as poisoned memory, so an element a kernel fails to write shows;
- the whole routing captured into a CUDA graph under sync debug mode "error" replays with new router logits and
  new hidden states copied in, equal to eager bit for bit;
- opcheck on CUDA tensors.
"""

from __future__ import annotations

import pytest
import torch

import cutlass_w8a8 as cw
from _fused_quant_cuda import POISON, assert_bits_equal, poison_allocator, replay_and_eager
from _moe_routing import FP8, OPS, opcheck_cases, random_ids

pytestmark = pytest.mark.cuda

DEV = "cuda"
QUANT = {torch.int8: cw.quantize_int8, FP8: cw.quantize_fp8}


# ---- moe_topk_softmax ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("t,e,k", [(1, 8, 2), (5, 8, 8), (64, 60, 4), (257, 128, 8), (3, 512, 8), (9, 1024, 16),
                                   (4, 1024, 1024), (2, 1, 1), (33, 250, 6)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_topk_softmax_cuda_vs_cpu(dtype, t, e, k, renormalize):
    gen = torch.Generator().manual_seed(t * 1000 + e + k)
    logits = (torch.randn(t, e, generator=gen) * 2).to(dtype)  # bfloat16 / float16: many equal logits
    w_ref, ids_ref = cw.moe_topk_softmax(logits, k, renormalize)
    for byte in POISON:
        poison_allocator(t * k * 4, t * k * 4, byte=byte)
        w, ids = cw.moe_topk_softmax(logits.to(DEV), k, renormalize)
        assert ids.dtype == torch.int32 and w.dtype == torch.float32 and ids.shape == w.shape == (t, k)
        assert_bits_equal(ids, ids_ref, "topk_ids")
        torch.testing.assert_close(w.cpu(), w_ref, rtol=2e-5, atol=1e-7)


def test_topk_softmax_cuda_ties_and_strides():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0], [0.0] * 5], device=DEV)
    _, ids = cw.moe_topk_softmax(logits, 3, True)
    assert ids.tolist() == [[1, 2, 4], [0, 1, 2]]
    base = torch.randn(40, 70, device=DEV)
    strided = base.t().contiguous().t()
    for a, b in zip(cw.moe_topk_softmax(strided, 5, True), cw.moe_topk_softmax(base, 5, True)):
        assert torch.equal(a, b)
    w, ids = cw.moe_topk_softmax(torch.zeros(0, 8, device=DEV), 2, True)
    assert w.shape == ids.shape == (0, 2)


# ---- moe_align ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("idtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("t,k,e,unrouted", [(1, 1, 1, 0.0), (1, 8, 128, 0.0), (5, 2, 3, 0.0), (64, 8, 60, 0.0),
                                            (300, 2, 8, 0.1), (37, 4, 1000, 0.2), (1024, 8, 512, 0.05),
                                            (20, 3, 7, 1.0), (8192, 8, 128, 0.0), (8192, 8, 1024, 0.01),
                                            (16384, 8, 257, 0.0), (100, 1, 1024, 0.0), (0, 8, 16, 0.0)])
def test_align_cuda_vs_cpu(idtype, t, k, e, unrouted):
    """T * k up to 131072 pairs (a segment per warp of several thousand pairs), E up to 1024 (10 segments), E above
    and below the block size, not a power of 2, unrouted and out-of-range ids."""
    gen = torch.Generator().manual_seed(t + k * 13 + e)
    ids = random_ids(t, k, e, gen, unrouted, idtype)
    ref = cw.moe_align(ids, e)
    for byte in POISON:
        poison_allocator(t * k * 4, t * k * 4, e * 4, byte=byte)
        got = cw.moe_align(ids.to(DEV), e)
        for name, a, b in zip(("sorted_pairs", "dst_pos", "offsets"), got, ref):
            assert_bits_equal(a, b, name)


def test_align_cuda_one_expert_strided_and_deterministic():
    ids = torch.full((4096, 8), 77, dtype=torch.int64, device=DEV)
    sp, dst, off = cw.moe_align(ids, 100)
    assert torch.equal(sp.cpu(), torch.arange(4096 * 8, dtype=torch.int32))
    assert torch.equal(dst.cpu(), torch.arange(4096 * 8, dtype=torch.int32))
    assert off.cpu().tolist() == [0] * 77 + [4096 * 8] * 23
    gen = torch.Generator().manual_seed(1)
    ids = random_ids(3000, 6, 40, gen, 0.05).to(DEV)
    strided = ids.t().contiguous().t()
    first = cw.moe_align(strided, 40)
    for _ in range(3):
        for a, b in zip(cw.moe_align(ids, 40), first):
            assert torch.equal(a, b)


# ---- moe_permute_quant --------------------------------------------------------------------------------------


@pytest.mark.parametrize("xdtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("qdtype", [torch.int8, FP8])
@pytest.mark.parametrize("mode", ["dynamic", "static", "group"])
@pytest.mark.parametrize("t,k,e,h", [(1, 1, 4, 256), (1, 8, 128, 2048), (7, 2, 5, 384), (33, 4, 16, 128),
                                     (4, 3, 3, 1024), (5, 2, 8, 14336), (3, 2, 4, 16384), (16, 8, 64, 4096)])
def test_permute_quant_cuda_vs_cpu(xdtype, qdtype, mode, t, k, e, h):
    """Every launch shape of the row-wise kernels: registers, 512-thread rows, clusters of 8 (sm90, 14336 and
    16384-wide bf16 / f16 rows), float32 (no clusters); per token, per tensor, per 1x128 group."""
    gen = torch.Generator().manual_seed(t * 31 + h + k)
    ids = random_ids(t, k, e, gen, 0.1)
    sp = cw.moe_align(ids, e)[0]
    x = (torch.randn(t, h, generator=gen) * 3).to(xdtype)
    scale = torch.tensor([0.03]) if mode == "static" else None
    group = 128 if mode == "group" else 0
    q_ref, s_ref = OPS.moe_permute_quant(x, sp, k, qdtype, scale, group)
    xd, spd, scd = x.to(DEV), sp.to(DEV), scale.to(DEV) if scale is not None else None
    for byte in POISON:
        poison_allocator(t * k * h, s_ref.numel() * 4, byte=byte)
        q, s = OPS.moe_permute_quant(xd, spd, k, qdtype, scd, group)
        assert_bits_equal(q.view(torch.int8), q_ref.view(torch.int8), "q")
        assert_bits_equal(s, s_ref, "scale")
    # and the unfused chain on the GPU: gather, then the quantizer
    rows = xd[spd.long() // k]
    q2, s2 = cw.quantize_per_token_group(rows, 128, qdtype) if group else QUANT[qdtype](rows, scd)
    assert torch.equal(q.view(torch.int8), q2.view(torch.int8))
    assert torch.equal(s, s2) if scale is None else torch.equal(s, scd.expand(t * k, 1))


@pytest.mark.parametrize("xdtype", [torch.bfloat16, torch.float32])
def test_permute_quant_cuda_unaligned_and_padded_rows(xdtype):
    """x as a window of a wider buffer (padded rows) and at an odd offset (element-wise loop kernel)."""
    gen = torch.Generator().manual_seed(2)
    buf = torch.randn(9, 1100, generator=gen).to(xdtype)
    ids = random_ids(9, 2, 6, gen)
    sp = cw.moe_align(ids, 6)[0]
    for x in (buf[:, :1024], buf[:, 1:1025], buf[:, 3:1000]):
        for qdtype in (torch.int8, FP8):
            ref = OPS.moe_permute_quant(x, sp, 2, qdtype, None, 0)
            got = OPS.moe_permute_quant(x.to(DEV), sp.to(DEV), 2, qdtype, None, 0)
            assert_bits_equal(got[0].view(torch.int8), ref[0].view(torch.int8), "q")
            assert_bits_equal(got[1], ref[1], "scale")


# ---- moe_unpermute ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("t,k,e,h,unrouted", [(1, 1, 2, 64, 0.0), (1, 8, 128, 2048, 0.0), (9, 2, 8, 200, 0.2),
                                              (16, 8, 60, 4096, 0.0), (5, 3, 3, 7, 0.5), (300, 2, 8, 1024, 0.1)])
def test_unpermute_cuda_vs_cpu(dtype, t, k, e, h, unrouted):
    gen = torch.Generator().manual_seed(t * k + h)
    ids = random_ids(t, k, e, gen, unrouted)
    dst = cw.moe_align(ids, e)[1]
    y = torch.randn(t * k, h, generator=gen).to(dtype)
    w = torch.rand(t, k, generator=gen)
    ref = cw.moe_unpermute(y, dst, w)
    yd, dd, wd = y.to(DEV), dst.to(DEV), w.to(DEV)
    for byte in POISON:
        poison_allocator(t * h * y.element_size(), byte=byte)
        assert_bits_equal(cw.moe_unpermute(yd, dd, wd), ref, "out")
    out = torch.full((t, h), float("nan"), dtype=dtype, device=DEV)
    assert cw.moe_unpermute(yd, dd, wd, out=out) is out
    assert_bits_equal(out, ref, "out=")
    wide = torch.randn(t * k, h + 8, generator=gen).to(dtype).to(DEV)
    wide[:, :h] = yd
    assert_bits_equal(cw.moe_unpermute(wide[:, :h], dd, wd), ref, "padded y")


# ---- the routing in a CUDA graph ----------------------------------------------------------------------------


def route(logits, x, e, k, qdtype, group):
    """topk -> align -> permute_quant -> (dequantize: a stand-in for the experts) -> unpermute."""
    w, ids = cw.moe_topk_softmax(logits, k, True)
    sp, dst, off = cw.moe_align(ids, e)
    q, s = cw.moe_permute_quant(x, sp, k, qdtype, None, group)
    deq = q.float().reshape(q.shape[0], -1, 128) * s.reshape(q.shape[0], -1, 1) if group else q.float() * s
    y = deq.reshape(q.shape).to(x.dtype)
    return w, ids, sp, dst, off, q.view(torch.int8), s, cw.moe_unpermute(y, dst, w)


@pytest.mark.parametrize("t,e,k,qdtype,group", [(1, 128, 8, torch.int8, 0), (16, 128, 8, FP8, 128),
                                                (512, 60, 4, FP8, 0), (8, 8, 2, torch.int8, 0)])
def test_routing_graph_replay_equals_eager(t, e, k, qdtype, group):
    h = 2048
    logits = torch.zeros(t, e, device=DEV)
    x = torch.zeros(t, h, dtype=torch.bfloat16, device=DEV)
    steps = []
    for i in range(4):
        gen = torch.Generator().manual_seed(100 + i)
        lg = torch.randn(t, e, generator=gen)
        if i == 1:
            lg[:, :k] += 50.0  # every token on the same k experts: the other groups are empty
        steps.append((lg.to(DEV), torch.randn(t, h, generator=gen).to(DEV, torch.bfloat16)))
    results = replay_and_eager(lambda: route(logits, x, e, k, qdtype, group), (logits, x), steps)
    names = ("topk_weights", "topk_ids", "sorted_pairs", "dst_pos", "offsets", "q", "scale", "out")
    for i, (replayed, eager) in enumerate(results):
        for name, a, b in zip(names, replayed, eager):
            assert torch.equal(a, b), f"replay {i}: {name}"
    _, ids, *_ = results[1][1]
    assert torch.equal(ids.sort(-1).values.cpu(), torch.arange(k, dtype=torch.int32).expand(t, k))


# The cases are built on the GPU inside the test (nothing touches the GPU at collection); named by their CPU twins.
CASE_NAMES = [name for name, _, _ in opcheck_cases("cpu")]


@pytest.mark.parametrize("index", range(len(CASE_NAMES)), ids=CASE_NAMES)
def test_opcheck_cuda(index):
    name, op, args = opcheck_cases(DEV)[index]
    assert name == CASE_NAMES[index]
    torch.library.opcheck(op, args)
