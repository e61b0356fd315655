"""Issue 37, "the same result at every M", on an sm90 GPU: a GEMM row's bits do not depend on M within a kernel
family, and every graph bucket equals the eager step of any batch it holds.

The dispatch (csrc/core/launch_policy.hpp, scaled_mm_uses_decode) sends M <= decode_gemm_max_m() (8) to the decode
GEMM and larger M to CUTLASS (no split-K or stream-K in the default configs, one K order in every config). So:

- int8: every M gives the rows of M = 256 (exact int32 accumulation in both families, one epilogue);
- row-wise fp8 (fast and accurate accumulation) and block fp8: every M of a family gives the rows of that family's
  largest M (decode: M = decode_gemm_max_m(); CUTLASS: M = 256), bit for bit. Across the bound they differ (measured
  on an H200: scripts/m_invariance.py), which is why the runners' bucket sets hold the bound
  (`cutlass_w8a8.runner.dispatch_bounds`, tests/models/test_runner_dispatch_bounds_cpu.py);
- a CapturedGraph of scaled_mm at each bucket W of `bucket_sizes(None, 64)` and 256, replayed on n <= W real rows
  (n = W, W - 1, and the previous bucket + 1), equals eager scaled_mm on the n rows alone;
- a decoder (every GEMM ours: quant_lm_head=True) through DecodeGraphRunner, both modes, at every batch 1..32 equals
  the eager unpadded step, for int8, fp8 and fp8-block.

Operands are fresh random tensors; outputs are poisoned (NaN) first.
"""

from __future__ import annotations

import functools

import pytest
import torch

import cutlass_w8a8 as cw
from cutlass_w8a8.graphs import CapturedGraph
from cutlass_w8a8.linear import quantize_weight_blocks
from cutlass_w8a8.models import LlamaConfig, LlamaDecoder
from cutlass_w8a8.runner import DecodeGraphRunner, bucket_sizes

pytestmark = [pytest.mark.cuda, pytest.mark.sm90]

FP8 = torch.float8_e4m3fn
OUT = torch.bfloat16
M_MAX = 256
SHAPES = [(2112, 7168), (4096, 4096)]  # (N, K): DeepSeek-V3 q_a (N not a multiple of 128), Llama-3-8B o
SCHEMES = ["int8", "fp8-fast", "fp8-accurate", "block"]


@pytest.fixture(autouse=True)
def _default_dispatch():
    """The default decode bound (8), whatever an earlier test left; restored afterwards."""
    previous = cw._ext.set_decode_gemm_max_m(8)
    yield
    cw._ext.set_decode_gemm_max_m(previous)


def _needs(scheme):
    if scheme != "int8" and not cw.supports_fp8():
        pytest.skip("the sm90 fp8 kernels are not available in this build")


def operands(scheme, n, k, seed):
    """(a, scale_a) of M_MAX rows quantized row by row (so a[:m] is the m-row problem), b (K, N) column-major,
    scale_b, and scaled_mm's extra keywords."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M_MAX, k, generator=g, device="cuda").to(OUT)
    w = (torch.randn(n, k, generator=g, device="cuda") / k ** 0.5).to(OUT)
    kw = {}
    if scheme == "int8":
        (a, sa), (q, sb) = cw.quantize_int8(x), cw.quantize_int8(w)
    elif scheme == "block":
        a, sa = cw.quantize_per_token_group(x, 128, FP8)
        q, sb = quantize_weight_blocks(w, FP8)
    else:
        (a, sa), (q, sb) = cw.quantize_fp8(x), cw.quantize_fp8(w)
        kw["fp8_fast_accum"] = scheme == "fp8-fast"
    return a, sa, q.t(), sb, kw


def run(a, sa, b, sb, kw, m):
    out = torch.full((m, b.shape[1]), float("nan"), device="cuda", dtype=OUT)
    cw.scaled_mm(a[:m], b, sa[:m], sb, out=out, **kw)
    return out


@pytest.mark.parametrize("nk", SHAPES, ids=lambda nk: f"n{nk[0]}-k{nk[1]}")
@pytest.mark.parametrize("scheme", SCHEMES)
@torch.no_grad()
def test_rows_equal_within_family(scheme, nk):
    _needs(scheme)
    bound = cw._ext.decode_gemm_max_m()
    assert bound == 8
    a, sa, b, sb, kw = operands(scheme, *nk, seed=1)
    ref = {"decode": run(a, sa, b, sb, kw, bound), "cutlass": run(a, sa, b, sb, kw, M_MAX)}
    bad = []
    for m in range(1, M_MAX + 1):
        out = run(a, sa, b, sb, kw, m)
        family = "decode" if m <= bound else "cutlass"
        expect = ref["cutlass" if scheme == "int8" else family][:m]  # int8: one result across the families
        if not torch.equal(out.view(torch.int16), expect.view(torch.int16)):
            bad.append(m)
    assert bad == [], f"{scheme}: rows at M = {bad} differ from their family's reference"


@pytest.mark.parametrize("scheme", SCHEMES)
@torch.no_grad()
def test_bucket_graph_equals_eager_at_the_bounds(scheme):
    _needs(scheme)
    n_, k_ = SHAPES[0]
    a, sa, b, sb, kw = operands(scheme, n_, k_, seed=2)
    fresh_a, fresh_sa, _, _, _ = operands(scheme, n_, k_, seed=3)
    sizes = bucket_sizes(None, 64) + [M_MAX]
    assert 8 in sizes
    prev = 0
    for w in sizes:
        graph = CapturedGraph(lambda a_, sa_: cw.scaled_mm(a_, b, sa_, sb, OUT, **kw), [a[:w], sa[:w]])
        for n in sorted({w, w - 1, prev + 1} - {0}):
            static_a, static_sa = fresh_a[:w].clone(), fresh_sa[:w].clone()
            static_a[n:], static_sa[n:] = a[n:w], sa[n:w]  # padding rows: other data
            graph.static_outputs.fill_(float("nan"))
            replayed = graph(static_a, static_sa)[:n]
            eager = run(fresh_a, fresh_sa, b, sb, kw, n)
            assert torch.equal(replayed.view(torch.int16), eager.view(torch.int16)), f"{scheme}: bucket {w}, {n} rows"
        prev = w


CFG = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
                  num_kv_heads=2, max_position=256)
MAX_BATCH, MAX_SEQ = 32, 64


@functools.lru_cache(maxsize=None)
def _decoder_unavailable(quant):
    if quant != "int8" and not cw.supports_fp8():
        return "the sm90 fp8 kernels are not available in this build"
    return None


@pytest.mark.parametrize("mode", ["buckets", "exact"])
@pytest.mark.parametrize("quant", ["int8", "fp8", "fp8-block"])
@torch.no_grad()
def test_decoder_graph_equals_unpadded_eager_step(quant, mode):
    """Every batch 1..MAX_BATCH: the runner's graph (padded to its bucket, or the exact-M UpdatableGraph above its
    floor) gives the logits of the model's eager step on the batch alone, bit for bit. Every row at position 7 of its
    own slot, positions 0..6 zero: the eager step rewrites the cache entries the graph step wrote with the same
    values."""
    why = _decoder_unavailable(quant)
    if why:
        pytest.skip(why)
    model = LlamaDecoder(CFG, quant, max_batch=MAX_BATCH, max_seq_len=MAX_SEQ, device="cuda", quant_lm_head=True)
    runner = DecodeGraphRunner(model, mode=mode)
    assert 8 in runner.sizes
    gen = torch.Generator().manual_seed(7)
    for n in range(1, MAX_BATCH + 1):
        tok = torch.randint(0, CFG.vocab_size, (n,), generator=gen)
        pos, slots = torch.full((n,), 7), torch.randperm(MAX_BATCH, generator=gen)[:n]
        graph = runner.step(tok, pos, slots).clone()
        eager = model(tok.cuda(), pos.cuda(), slots.cuda())
        assert torch.equal(graph.view(torch.int16), eager.view(torch.int16)), (
            f"{quant} {mode}: {n} rows (bucket {runner.bucket(n)})")
