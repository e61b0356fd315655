"""Eager and graphs across scaled_mm's decode dispatch (issue 26, "fp8 accuracy"): the tolerance documented in
csrc/gemm/EPILOGUES.md ("Eager and graphs across the decode dispatch") and csrc/gemm/decode/README.md.

At M <= decode_gemm_max_m() (8 on sm90) eager scaled_mm runs the decode GEMM, while an UpdatableGraph keeps its
CUTLASS node at every M (update_scaled_mm must be able to rebind it), and so does DecodeGraphRunner(mode="exact").
Here a graph captured at M = 64 and moved to M = 2 (set_rows) is compared with eager scaled_mm at M = 2 on the
same operands, at a DeepSeek-V3 shape (N 2112, K 7168) and the largest K measured (Qwen3-32B down, N 5120,
K 25600). Relative Frobenius errors are against the float64 product of the dequantized operands, bf16 output:

- int8: bit for bit (both families accumulate exactly in int32 and share the epilogue).
- row-wise fp8: the CUTLASS configs accumulate fast (measured up to 4.5e-3, held to 5e-3), the decode GEMM in
  float32 (measured 1.7e-3, the bf16 rounding floor, held to 2.5e-3); graph and eager differ by at most the sum,
  7.5e-3 of the eager output's norm.
- block-scaled fp8: both families promote every 128 products (measured 1.7e-3, held to issue 26's 2.5e-3); graph
  and eager differ by at most 5e-3.

A CapturedGraph at M = 2 replays what eager runs there (the decode GEMM): equal to eager bit for bit.
Inputs are fresh random tensors; outputs are poisoned (NaN) first.
"""

from __future__ import annotations

import pytest
import torch

import cutlass_w8a8 as cw
from cutlass_w8a8.graphs import CapturedGraph, UpdatableGraph
from cutlass_w8a8.testing.references import (Reference, assert_close_to_reference, fp8_accum_bound, rand_operand,
                                             rand_scale, reference, scale_magnitudes)

pytestmark = pytest.mark.sm90

OPS = torch.ops.cutlass_w8a8
FP8 = torch.float8_e4m3fn
OUT = torch.bfloat16
G = 128  # 1 x 128 activation groups, 128 x 128 weight blocks
CAPTURED_M, M = 64, 2
# (N, K): DeepSeek-V3's fused q_a / kv_a projection (N not a multiple of 128) and Qwen3-32B's down projection, the
# largest K of bench_gemm --block's shapes (cutlass_w8a8.testing.shapes.BLOCK_SHAPES), where fast accumulation
# errs most.
SHAPES = [(2112, 7168), (5120, 25600)]
SHAPE_IDS = ["dsv3-n2112-k7168", "q3-32b-down"]

# Relative Frobenius error bounds against float64 (csrc/gemm/EPILOGUES.md; measured on an H100 over the 13
# BLOCK_SHAPES and M 1..8192, bench/results/gemm_block_table1_6025f1a_nvidia-h100-80gb-hbm3.md):
CUTLASS_ROWWISE_REL = 5e-3   # fast accumulation: measured 4.3e-3 to 4.5e-3
DECODE_ROWWISE_REL = 2.5e-3  # float32 accumulation: measured 1.7e-3 (= the bf16 rounding floor)
BLOCK_REL = 2.5e-3           # CUTLASS blockwise and decode block, both promoted: measured 1.7e-3 (issue 26's bound)
# ||graph - eager|| <= ||graph - D|| + ||eager - D||: the bounds of the two families add.
ROWWISE_AGREEMENT = CUTLASS_ROWWISE_REL + DECODE_ROWWISE_REL  # 7.5e-3
BLOCK_AGREEMENT = 2 * BLOCK_REL                                # 5e-3


@pytest.fixture(autouse=True)
def _needs_fp8_kernels():
    if not cw.supports_fp8():
        pytest.skip("the sm90 fp8 kernels are not available in this build")


@pytest.fixture(autouse=True)
def _decode_bound():
    """The default dispatch (decode GEMM at M <= 8), whatever an earlier test left; restored afterwards."""
    previous = cw._ext.set_decode_gemm_max_m(8)
    yield
    cw._ext.set_decode_gemm_max_m(previous)


def rel_fro(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref||_F / ||ref||_F in float64."""
    ref = ref.double()
    return float(torch.linalg.vector_norm(out.double() - ref) / torch.linalg.vector_norm(ref))


def rowwise_operands(rows, n, k, dtype, seed):
    """a (rows, K), w (N, K) of `dtype`, per-token scale_a (rows, 1), per-channel scale_b (N,)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    ma, mb = scale_magnitudes(dtype, k)
    a = rand_operand((rows, k), dtype, "cuda", g)
    w = rand_operand((n, k), dtype, "cuda", g)
    return a, w, rand_scale((rows, 1), "cuda", ma, g), rand_scale((n,), "cuda", mb, g)


def block_operands(rows, n, k, seed):
    """e4m3 a (rows, K), w (N, K); scale_a (rows, K/128) per group, scale_b (ceil(N/128), K/128) per block."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    ma, mb = scale_magnitudes(FP8, k)
    a = rand_operand((rows, k), FP8, "cuda", g)
    w = rand_operand((n, k), FP8, "cuda", g)
    return a, w, rand_scale((rows, k // G), "cuda", ma, g), rand_scale((-(-n // G), k // G), "cuda", mb, g)


def block_reference(a, w, sa, sb) -> Reference:
    """(a * scale_a per group) @ (w * scale_b per block)^T in float64, from the dequantized operands."""
    n, k = w.shape
    a_deq = a.double() * sa.double().repeat_interleave(G, 1)
    w_deq = w.double() * sb.double().repeat_interleave(G, 0)[:n].repeat_interleave(G, 1)
    d = a_deq @ w_deq.t()
    return Reference(d, d.abs(), a_deq.abs() @ w_deq.abs().t(), k)


def graph_and_eager(w, sb, captured, fresh):
    """An UpdatableGraph of scaled_mm(a, w.t(), scale_a, sb) with (a, scale_a) as static inputs, captured on
    `captured` (CAPTURED_M rows), moved to M rows and replayed on `fresh`; eager scaled_mm on fresh's first M rows,
    which must be the decode GEMM's result. Returns (graph rows, eager, the M-row a, the M-row scale_a)."""
    graph = UpdatableGraph(lambda a_, sa_: cw.scaled_mm(a_, w.t(), sa_, sb, OUT), list(captured))
    nodes = [(node.op, node.config >= 0) for node in graph.nodes]
    assert nodes == [("scaled_mm", True)], f"expected one CUTLASS scaled_mm node, got {nodes}"
    graph.set_rows(M)
    assert graph.nodes[0].rows == M
    for dst, src in zip(graph.static_inputs, fresh):
        dst.copy_(src)
    graph.static_outputs.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.isnan(graph.static_outputs[M:].float()).all(), f"rows >= {M} were written"
    replayed = graph.static_outputs[:M].clone()

    a, sa = fresh[0][:M], fresh[1][:M]
    eager = torch.full((M, w.shape[0]), float("nan"), device="cuda", dtype=OUT)
    cw.scaled_mm(a, w.t(), sa, sb, OUT, out=eager)
    assert torch.equal(eager, OPS.scaled_mm_decode(a, w.t(), sa, sb, OUT)), "eager M = 2 did not run the decode GEMM"
    return replayed, eager, a, sa


@pytest.mark.parametrize("nk", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("dtype", [torch.int8, pytest.param(FP8, id="fp8")])
@torch.no_grad()
def test_rowwise_updatable_graph_vs_eager(dtype, nk):
    n, k = nk
    captured_a, w, captured_sa, sb = rowwise_operands(CAPTURED_M, n, k, dtype, seed=1)
    fresh_a, _, fresh_sa, _ = rowwise_operands(CAPTURED_M, n, k, dtype, seed=2)
    replayed, eager, a, sa = graph_and_eager(w, sb, (captured_a, captured_sa), (fresh_a, fresh_sa))
    ref = reference(a, w.t(), sa, sb)
    if dtype == torch.int8:
        assert torch.equal(replayed, eager), "int8: the UpdatableGraph's CUTLASS node and the decode GEMM differ"
        assert_close_to_reference(eager, ref, OUT, what="int8 eager")
    else:
        accum = fp8_accum_bound(k)
        assert_close_to_reference(replayed, ref, OUT, accum, what="fp8 graph (CUTLASS)")
        assert_close_to_reference(eager, ref, OUT, accum, what="fp8 eager (decode GEMM)")
        err_graph, err_eager, diff = rel_fro(replayed, ref.d), rel_fro(eager, ref.d), rel_fro(replayed, eager)
        assert err_graph <= CUTLASS_ROWWISE_REL, f"CUTLASS row-wise fp8 error {err_graph:.3g} > {CUTLASS_ROWWISE_REL}"
        assert err_eager <= DECODE_ROWWISE_REL, f"decode row-wise fp8 error {err_eager:.3g} > {DECODE_ROWWISE_REL}"
        assert diff <= ROWWISE_AGREEMENT, (f"graph and eager differ by {diff:.3g} of the eager norm > "
                                           f"{ROWWISE_AGREEMENT} (errors: graph {err_graph:.3g}, "
                                           f"eager {err_eager:.3g})")

    # a CapturedGraph at M = 2 replays the kernel eager runs there
    static = CapturedGraph(lambda a_, sa_: cw.scaled_mm(a_, w.t(), sa_, sb, OUT), [captured_a[:M], captured_sa[:M]])
    static.static_outputs.fill_(float("nan"))
    assert torch.equal(static(a, sa), eager), "CapturedGraph at M = 2 differs from eager"


@pytest.mark.parametrize("nk", SHAPES, ids=SHAPE_IDS)
@torch.no_grad()
def test_block_updatable_graph_vs_eager(nk):
    n, k = nk
    captured_a, w, captured_sa, sb = block_operands(CAPTURED_M, n, k, seed=3)
    fresh_a, _, fresh_sa, _ = block_operands(CAPTURED_M, n, k, seed=4)
    replayed, eager, a, sa = graph_and_eager(w, sb, (captured_a, captured_sa), (fresh_a, fresh_sa))
    ref = block_reference(a, w, sa, sb)
    assert_close_to_reference(replayed, ref, OUT, fp8_accum_bound(k), what="block graph (CUTLASS blockwise)")
    assert_close_to_reference(eager, ref, OUT, fp8_accum_bound(k), what="block eager (decode GEMM)")
    err_graph, err_eager, diff = rel_fro(replayed, ref.d), rel_fro(eager, ref.d), rel_fro(replayed, eager)
    assert err_graph <= BLOCK_REL, f"CUTLASS block error {err_graph:.3g} > {BLOCK_REL}"
    assert err_eager <= BLOCK_REL, f"decode block error {err_eager:.3g} > {BLOCK_REL}"
    assert diff <= BLOCK_AGREEMENT, (f"graph and eager differ by {diff:.3g} of the eager norm > {BLOCK_AGREEMENT} "
                                     f"(errors: graph {err_graph:.3g}, eager {err_eager:.3g})")
