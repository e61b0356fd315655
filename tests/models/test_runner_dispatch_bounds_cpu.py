"""The bucket rule of issue 37 ("the same result at every M"), on the CPU: every bucket set the package builds
(`DecodeGraphRunner`, both modes, and `cutlass_w8a8.hf.GraphGenerator` through `cutlass_w8a8.runner.bucket_sizes`)
holds the dispatch bounds at which a GEMM changes kernel family (the dense decode GEMM's ``decode_gemm_max_m()``,
``64 // top_k`` for each `W8A8MoE`), so that a batch and the bucket it is padded to run the same kernels.

The CPU has no decode GEMM (``_ext.decode_gemm_max_m()`` is 0 without the CUDA ops), so the tests set the bound the
sm90 dispatch has by default (8, csrc/core/launch_policy.hpp) by patching `cutlass_w8a8._ext.decode_gemm_max_m`; the
CUDA side (rows equal within a family, graph == eager at the bounds) is tests/gemm/test_m_invariance_cuda.py.
"""

import pytest
import torch

import cutlass_w8a8 as cw
from cutlass_w8a8.models import LlamaConfig, LlamaDecoder
from cutlass_w8a8.ops._limits import MOE_DECODE_MAX_PAIRS
from cutlass_w8a8.runner import (DecodeGraphRunner, bucket_for, bucket_sizes, cuda_graph_batch_sizes,
                                 dispatch_bounds, with_dispatch_bounds)

DENSE = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4,
                    num_kv_heads=2, max_position=64)
# top-3: a MoE bound (64 // 3 = 21) that is no default bucket
MOE = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=1, num_heads=4, num_kv_heads=2,
                  max_position=64, qk_norm=True, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=128)
SM90_DECODE_MAX_M = 8  # csrc/core/launch_policy.hpp kDecodeGemmMaxM


@pytest.fixture
def sm90_bound(monkeypatch):
    """_ext.decode_gemm_max_m() as on an sm90 build (8); a test may change `bound[0]`."""
    bound = [SM90_DECODE_MAX_M]
    monkeypatch.setattr(cw._ext, "decode_gemm_max_m", lambda: bound[0])
    return bound


def same_family(sizes, bounds, max_batch):
    """Batches 1..max_batch whose bucket lies across a bound from them: [(batch, bucket, bound)]; empty = the rule
    holds. Batches above the largest bucket run eagerly (no padding)."""
    bad = []
    for b in range(1, max_batch + 1):
        w = bucket_for(sizes, b)
        if w is None:
            continue
        bad += [(b, w, t) for t in bounds if b <= t < w]
    return bad


def test_with_dispatch_bounds():
    assert with_dispatch_bounds([1, 2, 4, 16], [8]) == [1, 2, 4, 8, 16]
    assert with_dispatch_bounds([16, 32], [8, 21]) == [8, 16, 21, 32]  # below the smallest bucket too
    assert with_dispatch_bounds([1, 2, 4], [8]) == [1, 2, 4]  # at or above the largest: every bucket below it
    assert with_dispatch_bounds([8, 4, 4], [8]) == [4, 8]
    assert with_dispatch_bounds([4], []) == [4]
    for bad in ([], [0, 4]):
        with pytest.raises(ValueError, match="`sizes` must be positive"):
            with_dispatch_bounds(bad, [8])


@pytest.mark.parametrize("bounds", [[8], [8, 21], [8, 32], [8, 9, 10, 12, 16, 21, 32, 64], [3], [16]])
def test_every_batch_runs_in_its_own_family(bounds):
    """For default and custom bucket sets, no batch is padded across a bound; and without the rule some are (so
    the check can fail)."""
    for max_batch in (1, 3, 8, 9, 12, 20, 33, 64, 100, 256):
        for base in (cuda_graph_batch_sizes(max_batch), sorted({max_batch, max(1, max_batch // 2)}), [max_batch]):
            sizes = with_dispatch_bounds(base, bounds)
            assert sizes[-1] == base[-1] and set(base) <= set(sizes)
            assert same_family(sizes, bounds, max_batch) == [], (max_batch, base, sizes)
    assert same_family([4, 16], [8], 16) == [(b, 16, 8) for b in range(5, 9)]


def test_dispatch_bounds(sm90_bound):
    dense = LlamaDecoder(DENSE, "fp8", max_batch=32, max_seq_len=16)
    assert dispatch_bounds() == dispatch_bounds(dense) == [8]
    moe = LlamaDecoder(MOE, "fp8-block", max_batch=32, max_seq_len=16)
    assert any(isinstance(m, cw.W8A8MoE) and m.top_k == 3 for m in moe.modules())
    assert dispatch_bounds(moe) == [8, MOE_DECODE_MAX_PAIRS // 3] == [8, 21]
    sm90_bound[0] = 0  # decode path off (or a CPU-only install): no dense bound
    assert dispatch_bounds(dense) == [] and dispatch_bounds(moe) == [21]


def test_runner_buckets_hold_the_bounds(sm90_bound):
    dense = LlamaDecoder(DENSE, "int8", max_batch=32, max_seq_len=16)
    assert DecodeGraphRunner(dense).sizes == cuda_graph_batch_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert DecodeGraphRunner(dense, sizes=[4, 16]).sizes == [4, 8, 16]
    assert DecodeGraphRunner(dense, sizes=[16, 32]).sizes == [8, 16, 32]
    assert DecodeGraphRunner(dense, max_batch=6).sizes == [1, 2, 4, 6]
    moe = LlamaDecoder(MOE, "int8", max_batch=32, max_seq_len=16)
    runner = DecodeGraphRunner(moe)
    assert runner.sizes == [1, 2, 4, 8, 16, 21, 24, 32] == bucket_sizes(moe, 32)
    assert [runner.bucket(b) for b in (7, 8, 9, 20, 21, 22)] == [8, 8, 16, 21, 21, 24]
    sm90_bound[0] = 0
    assert DecodeGraphRunner(dense, sizes=[4, 16]).sizes == [4, 16]


def test_exact_runner_serves_one_family_per_graph(sm90_bound):
    """mode="exact": the UpdatableGraph (CUTLASS GEMM nodes at every M) takes only batches above the largest bound
    below max_batch, buckets the rest; with the decode bound at or above max_batch there is no UpdatableGraph."""
    dense = LlamaDecoder(DENSE, "fp8", max_batch=32, max_seq_len=16)
    runner = DecodeGraphRunner(dense, mode="exact")
    assert (runner.exact_floor, runner.sizes) == (8, [1, 2, 4, 8, 32])
    assert [runner.bucket(b) for b in (3, 8, 9, 32)] == [4, 8, 32, 32]
    small = DecodeGraphRunner(LlamaDecoder(DENSE, "fp8", max_batch=8, max_seq_len=16), mode="exact")
    assert (small.exact_floor, small.sizes) == (8, [1, 2, 4, 8])
    moe = DecodeGraphRunner(LlamaDecoder(MOE, "int8", max_batch=32, max_seq_len=16), mode="exact")
    assert (moe.exact_floor, moe.sizes) == (21, [1, 2, 4, 8, 16, 21, 32])
    sm90_bound[0] = 0
    assert (DecodeGraphRunner(dense, mode="exact").exact_floor, DecodeGraphRunner(dense, mode="exact").sizes) == (
        0, [32])


@torch.no_grad()
def test_exact_runner_steps_on_cpu(sm90_bound):
    """Without graphs the exact-mode runner steps through its buckets and the full width alike (shapes only: the
    CPU references are one family)."""
    model = LlamaDecoder(DENSE, "int8", max_batch=16, max_seq_len=16)
    runner = DecodeGraphRunner(model, mode="exact")
    assert runner.sizes == [1, 2, 4, 8, 16] and runner.exact_graph is None
    for n in (3, 8, 9, 16):
        out = runner.step(list(range(n)), [0] * n)
        assert out.shape == (n, DENSE.vocab_size) and torch.isfinite(out).all()
