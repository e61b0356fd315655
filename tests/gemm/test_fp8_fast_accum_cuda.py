"""Row-wise fp8 with fp8_fast_accum=False (issue 37): the sm90 accurate configs (Fp8_*_Accurate, promoted every 128 of
K) at every M bucket of select_fp8, against the float64 reference of the dequantized operands.

Bound: the tensor cores' error now covers one 128-deep K block at a time (fp8_accum_bound(128) of sum|terms|, the
per-product 14-bit figure derived in cutlass_w8a8/testing/references.py), plus the float32 sum of the K / 128 promoted
partials and the epilogue ((K / 128 + 4) float32 roundoffs of sum|terms|); assert_close_to_reference adds the output
ulp. With fast accumulation the allowance is fp8_accum_bound(K), K / 128 times larger.

Which kernel the flag runs (a bound cannot tell a lost flag): scaled_mm (functional, out=) and w8a8_linear equal bit
for bit the fp8 table's entry that select_fp8 picks among the fast or the accurate rows (forced with
_scaled_mm_config); an UpdatableGraph captured accurate stays on the accurate rows through set_rows and
update_scaled_mm.
"""

import pytest
import torch

import cutlass_w8a8 as cw
from cutlass_w8a8.testing.references import (EPS32, assert_close_to_reference, fp8_accum_bound, rand_operand,
                                             rand_scale, reference, scale_magnitudes)

pytestmark = pytest.mark.sm90

OPS = torch.ops.cutlass_w8a8
FP8 = torch.float8_e4m3fn
# Crosses every bucket of select_fp8's accurate rows: [1, 16], (16, 64], (64, 128], (128, 256], (256, 1024), >= 1024.
M_BUCKETS = [9, 16, 17, 64, 65, 128, 129, 256, 257, 1023, 1024, 2048]


@pytest.fixture(autouse=True)
def _needs_fp8_kernels():
    if not cw.supports_fp8():
        pytest.skip("the sm90 fp8 kernels are not available in this build")


@pytest.mark.parametrize("m", M_BUCKETS)
@pytest.mark.parametrize("nk", [(768, 1024), (1024, 7168)], ids=["N768-K1024", "N1024-K7168"])
@torch.no_grad()
def test_accurate_buckets_match_fp64_reference(cutlass_only, m, nk):
    n, k = nk
    g = torch.Generator(device="cuda").manual_seed(m * 7 + n + k)
    a, w = rand_operand((m, k), FP8, "cuda", g), rand_operand((n, k), FP8, "cuda", g)
    ma, mb = scale_magnitudes(FP8, k)
    sa, sb = rand_scale((m, 1), "cuda", ma, g), rand_scale((n,), "cuda", mb, g)
    bias = (torch.randn(n, device="cuda", generator=g) * 4).to(torch.bfloat16)
    ref = reference(a, w.t(), sa, sb, bias)
    rel = fp8_accum_bound(128) + (k // 128 + 4) * EPS32
    for out in (None, torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")):
        y = cw.scaled_mm(a, w.t(), sa, sb, torch.bfloat16, bias, out=out, fp8_fast_accum=False)
        assert_close_to_reference(y, ref, torch.bfloat16, accum_rel=rel, what=f"accurate M={m} N={n} K={k}")


# ---- the flag's plumbing: which row of the fp8 table runs --------------------------------------------------------
# select_fp8 (csrc/gemm/sm90/scaled_mm_sm90_dispatch.cuh), mirrored by name: (largest M of the bucket, config name).
FAST_ROWS = [(16, "swap_64x16x256_c1x1_pingpong_persistent_fastaccum"),
             (64, "swap_64x32x256_c1x1_pingpong_persistent_fastaccum"),
             (128, "swap_64x64x256_c1x1_pingpong_persistent_fastaccum")]
FAST_LARGE = "128x128x128_c2x1_pingpong_persistent_fastaccum"
FAST_KBIG = "128x256x128_c2x1_cooperative_persistent_fastaccum"  # M >= 2048 and K >= 8192
ACCURATE_ROWS = [(16, "swap_128x16x128_c1x1_cooperative_persistent"),
                 (64, "swap_128x32x128_c1x1_cooperative_persistent"),
                 (128, "swap_128x64x128_c1x1_cooperative_persistent"),
                 (256, "swap_128x128x128_c1x1_cooperative_persistent"),
                 (1023, "128x128x128_c1x2_cooperative_persistent")]
ACCURATE_LARGE = "256x128x128_c2x1_cooperative_persistent_waves"


def fp8_table():
    """Entry names of the sm90 library's row-wise fp8 table (kernel_api.h CW8A8_TABLE_FP8 = 1), in index order."""
    import ctypes

    lib = cw._ext.kernel_library("_kernels_sm90")
    if lib is None:
        pytest.skip("the sm90 kernel library is not loaded through ctypes here")
    lib.cw8a8_sm90_config_name.restype = ctypes.c_char_p
    return [lib.cw8a8_sm90_config_name(1, i).decode() for i in range(lib.cw8a8_sm90_num_configs(1))]


def selected(m: int, k: int, fast: bool) -> str:
    """The name select_fp8 picks for M (and K) among the fast or the accurate rows, at the N = 384 these tests use:
    select_fp8's 128x256 accurate wave row (waves_n_fill_ok, M in (128, 1024)) never applies at so few columns."""
    for top, name in FAST_ROWS if fast else ACCURATE_ROWS:
        if m <= top:
            return name
    if fast:
        return FAST_KBIG if m >= 2048 and k >= 8192 else FAST_LARGE
    return ACCURATE_LARGE


def forced(a, w, sa, sb, bias, config):
    out = torch.full((a.shape[0], w.shape[0]), float("nan"), dtype=torch.bfloat16, device="cuda")
    OPS._scaled_mm_config(out, a, w.t(), sa, sb, bias, config)
    return out


def rowwise_problem(m, n, k, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    a, w = rand_operand((m, k), FP8, "cuda", g), rand_operand((n, k), FP8, "cuda", g)
    ma, mb = scale_magnitudes(FP8, k)
    bias = (torch.randn(n, device="cuda", generator=g) * 4).to(torch.bfloat16)
    return a, w, rand_scale((m, 1), "cuda", ma, g), rand_scale((n,), "cuda", mb, g), bias


@pytest.mark.parametrize("m", [16, 17, 65, 129, 257, 1024, 2048])
@torch.no_grad()
def test_flag_runs_its_table_row(cutlass_only, m):
    """scaled_mm(fp8_fast_accum=...) (functional and out=) and w8a8_linear equal, bit for bit, the fp8 table entry
    select_fp8 picks among the accurate or the fast rows, forced with _scaled_mm_config; so a flag lost on its way to
    cw8a8_scaled_mm_args (or read the wrong way round) fails here, which the error bound above cannot promise (fast
    accumulation on random operands often stays inside the accurate bound). At K = 8192 the two rows' outputs
    differ, so each comparison can fail."""
    names = fp8_table()
    assert all(names.index(name) < 12 for _, name in FAST_ROWS + ACCURATE_ROWS), names  # shipped rows, not candidates
    n, k = 384, 8192
    a, w, sa, sb, bias = rowwise_problem(m, n, k, seed=m)
    results = {}
    for fast in (True, False):
        want = forced(a, w, sa, sb, bias, names.index(selected(m, k, fast)))
        got = cw.scaled_mm(a, w.t(), sa, sb, torch.bfloat16, bias, fp8_fast_accum=fast)
        assert torch.equal(got, want), f"M={m} fp8_fast_accum={fast}: not {selected(m, k, fast)}'s bits"
        out = torch.full_like(want, float("nan"))
        cw.scaled_mm(a, w.t(), sa, sb, torch.bfloat16, bias, out=out, fp8_fast_accum=fast)
        assert torch.equal(out, want), f"M={m} out= fp8_fast_accum={fast}"
        results[fast] = want
    assert not torch.equal(results[True], results[False]), "fast and accurate rows gave the same bits: no power"
    # w8a8_linear: its own quantization of x, then the GEMM with the flag
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=torch.Generator(device="cuda").manual_seed(1))
    q, s = OPS.quantize_per_token(x, FP8)
    for fast in (True, False):
        y = OPS.w8a8_linear(x, w, sb, None, bias, torch.bfloat16, fast)
        assert torch.equal(y, forced(q, w, s, sb, bias, names.index(selected(m, k, fast)))), (
            f"w8a8_linear M={m} fp8_fast_accum={fast}")


@torch.no_grad()
def test_updatable_graph_keeps_the_accurate_rows(cutlass_only):
    """A GEMM captured with fp8_fast_accum=False at M = 200 (the swapped 128x128 accurate tile, cluster 1x1) and moved
    by set_rows to M = 16 and 100 switches to the accurate row of that M (same cluster shape), not the fast one: the
    replay equals the forced accurate entry bit for bit. update_scaled_mm to new operands keeps it too."""
    from cutlass_w8a8.graphs import UpdatableGraph

    names = fp8_table()
    n, k = 384, 8192
    a, w, sa, sb, bias = rowwise_problem(200, n, k, seed=5)
    g = UpdatableGraph(lambda a_, sa_: cw.scaled_mm(a_, w.t(), sa_, sb, torch.bfloat16, bias, fp8_fast_accum=False),
                       [a, sa])
    (node,) = [node for node in g.nodes if node.op == "scaled_mm"]
    assert names[node.config] == selected(200, k, fast=False), names[node.config]
    for i, m in enumerate([16, 100, 200]):
        g.set_rows(m)
        a2, _, sa2, _, _ = rowwise_problem(200, n, k, seed=50 + i)
        g.static_inputs[0].copy_(a2)
        g.static_inputs[1].copy_(sa2)
        g.static_outputs.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        want = forced(a2[:m], w, sa2[:m], sb, bias, names.index(selected(m, k, fast=False)))
        assert torch.equal(g.static_outputs[:m], want), f"set_rows({m}): not the accurate row's bits"
    a3, _, sa3, _, _ = rowwise_problem(16, n, k, seed=60)
    out = torch.full((16, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    g.update_scaled_mm(node, out, a3, w.t(), sa3, sb, bias)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, forced(a3, w, sa3, sb, bias, names.index(selected(16, k, fast=False)))), (
        "update_scaled_mm: not the accurate row's bits")
