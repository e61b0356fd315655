"""Block-scaled fp8 scaled_mm on an sm90 GPU (issue 26): the CUTLASS blockwise kernels of
csrc/gemm/sm90/scaled_mm_sm90_blockwise.cuh (the Fp8Block_* table of scaled_mm_sm90_dispatch.cuh).

a e4m3 [M, K] with scale_a float32 [M, K/128] (1x128 groups), the weight e4m3 [N, K] with scale_b float32
[ceil(N/128), K/128] (128x128 blocks). Every result is compared with the float64 product of the dequantized
operands: the relative Frobenius error ||ref - out|| / ||ref|| at most 2.5e-3 with bfloat16 output (the issue's
bound; rounding alone gives ~1.7e-3) and 1e-3 with float16 (rounding: ~2e-4), and every element within its own
bound: one output ulp, float32 scaling and summing of the K/128 block partials, and Hopper's fp8 accumulation
within a 128-long block (fp8_accum_bound(128)). Outputs are poisoned (NaN) first: every element must be written.

The CUTLASS kernels are tested with the decode GEMM turned off (set_decode_gemm_max_m(0)), so M = 1 and 7 run
them too; test_decode_sizes_dispatch runs the default dispatch (M <= 8: the decode GEMM of csrc/gemm/decode).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

import cutlass_w8a8 as cw
from cutlass_w8a8.graphs import CapturedGraph, UpdatableGraph
from cutlass_w8a8.testing.references import EPS32, assert_within, fp8_accum_bound, rand_operand, ulp

pytestmark = pytest.mark.sm90

OPS = torch.ops.cutlass_w8a8
FP8 = torch.float8_e4m3fn
BLOCK = 128
FROBENIUS = {torch.bfloat16: 2.5e-3, torch.float16: 1e-3}
# Fp8BlockConfigs (csrc/gemm/sm90/scaled_mm_sm90_dispatch.cuh), in table order: (name, select_fp8_block's M range)
BLOCK_CONFIGS = ["swap_128x16x128_c1x1_pingpong_persistent", "swap_128x32x128_c1x1_pingpong_persistent",
                 "64x128x128_c1x1_pingpong_persistent", "128x128x128_c1x2_cooperative_persistent",
                 "256x128x128_c1x2_cooperative_persistent_waves",
                 # waves along N (test_wave_n_cuda.py): M > 128 where waves_n_fill_ok (5% slack); the second never
                 "128x256x128_c1x2_cooperative_persistent_waves_n128", "64x256x128_c1x1_pingpong_persistent_waves_n128"]
# Crosses every bucket of select_fp8_block: [1, 32], (32, 64], (64, 128], > 128 (on 132 SMs: the 64x128 tile at
# M = 129, the 128x128 tile at M = 1024 with N = 1280, the 128x256 tile with waves along N at M = 1024 with N = 4096
# (waves_n_fill_ok), and the 256x128 wave tile at M = 3072 with N = 1280, where its rows per SM stay within 1.05x and
# the 128x256 tile would leave the busiest SM 2x the output).
M_BUCKETS = [1, 7, 16, 17, 32, 33, 64, 100, 128, 129, 1024, 2048, 3072, 4096]


@pytest.fixture(autouse=True)
def _needs_fp8_kernels():
    if not cw.supports_fp8():
        pytest.skip("the sm90 fp8 kernels are not available in this build")


def blocks(v: int) -> int:
    return -(-v // BLOCK)


def block_problem(m, n, k, out_dtype=torch.bfloat16, bias=True, seed=0):
    """(a, w, sa, sb, bias): e4m3 a (M, K) and w (N, K) from N(0, 1); scales of magnitudes 2^-3 .. 2^2 that
    differ from group to group and block to block (a scale read for the wrong group shows); bias ~ |D|."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = rand_operand((m, k), FP8, "cuda", g)
    w = rand_operand((n, k), FP8, "cuda", g)

    def scales(shape):
        mag = 2.0 ** torch.randint(-3, 3, shape, device="cuda", generator=g).float()
        return (torch.rand(shape, device="cuda", generator=g) + 0.5) * mag / (k ** 0.5)

    sa, sb = scales((m, k // BLOCK)), scales((blocks(n), k // BLOCK))
    b = (torch.randn(n, device="cuda", generator=g) * 2).to(out_dtype) if bias else None
    return a, w, sa, sb, b


def block_reference(a, w, sa, sb, bias):
    """(D, bound): D = (a * sa) @ (w * sb)^T + bias in float64 from the dequantized operands, and the
    elementwise allowance besides the output rounding (see the module docstring)."""
    n, k = w.shape
    a_deq = a.double() * sa.double().repeat_interleave(BLOCK, dim=1)
    w_deq = w.double() * sb.double().repeat_interleave(BLOCK, dim=0)[:n].repeat_interleave(BLOCK, dim=1)
    d = a_deq @ w_deq.t()
    mag = d.abs()
    if bias is not None:
        d = d + bias.double()
        mag = mag + bias.double().abs()
    terms = a_deq.abs() @ w_deq.abs().t()
    return d, ((k // BLOCK + 4) * EPS32 + fp8_accum_bound(BLOCK)) * terms + 2 * EPS32 * mag


def check(out, a, w, sa, sb, bias, what):
    """out (M, N) against the float64 reference: no NaN left, the relative Frobenius error, each element."""
    d, bound = block_reference(a, w, sa, sb, bias)
    o = out.double()
    assert not torch.isnan(o).any(), f"{what}: elements left unwritten (NaN)"
    if d.numel() == 0:
        return
    rel = float((d - o).norm() / d.norm())
    assert rel <= FROBENIUS[out.dtype], f"{what}: relative Frobenius error {rel:.3g} > {FROBENIUS[out.dtype]}"
    assert_within(o, d, bound + torch.maximum(ulp(d, out.dtype), ulp(o, out.dtype)), what, "(m, n) = ")


def large_m_config(m: int, n: int, sms: int = 0) -> str:
    """The name of the config select_fp8_block picks for M > 128 on `sms` SMs (default: this GPU's; its rules,
    mirrored): the 128x256 wave tile where waves_n_fill_ok with 5% slack; else at M >= 1024 the 256x128 wave tile
    unless its busiest SM has more than 1.05x the rows of the 128x128 tile's; else the 64x128 tile where its busiest SM
    has at most 1/1.4 of the 128x128 tile's rows (block_few_tiles_pay), the 128x128 tile otherwise."""
    sms = sms or torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    pairs = (blocks(n) + 1) // 2 * 2  # a 1x2 cluster pads the N tiles to pairs

    def busiest_sm_rows(tile_m, tiles_n=pairs):
        return -(-(-(-m // tile_m) * tiles_n) // sms) * tile_m

    if waves_n_fill_ok(m, n, sms, pairs_along_n=True, slack_pct=5):
        return BLOCK_CONFIGS[5]
    if m >= 1024 and busiest_sm_rows(256) * 100 <= busiest_sm_rows(128) * 105:
        return BLOCK_CONFIGS[4]
    few_tiles_pay = busiest_sm_rows(64, blocks(n)) * 14 <= busiest_sm_rows(128) * 10
    return BLOCK_CONFIGS[2] if few_tiles_pay else BLOCK_CONFIGS[3]


def waves_n_fill_ok(m, n, sms, pairs_along_n, slack_pct=0):
    """The dispatch's waves_n_fill_ok (csrc/gemm/sm90/scaled_mm_sm90_dispatch.cuh): the 128x256 wave tile's busiest SM
    computes no more of the output than the 128x128 1x2 tile's (rounds of tiles times tile area), give or take
    `slack_pct` percent."""
    tiles_m = -(-m // 128)

    def rounds(tiles_n, pairs):
        tiles_n = (tiles_n + 1) // 2 * 2 if pairs else tiles_n
        return -(-(tiles_m * tiles_n) // sms)

    return rounds(-(-n // 256), pairs_along_n) * 256 * 100 <= rounds(blocks(n), True) * 128 * (100 + slack_pct)


def run(a, w, sa, sb, bias, out_dtype, out=None):
    """scaled_mm(out=) into a NaN-poisoned output (a fresh one unless given)."""
    if out is None:
        out = torch.empty(a.shape[0], w.shape[0], dtype=out_dtype, device="cuda")
    out.fill_(float("nan"))
    cw.scaled_mm(a, w.t(), sa, sb, out_dtype, bias, out=out)
    return out


# ---- the kernels against the float64 reference ------------------------------------------------------------

@pytest.mark.parametrize("m", M_BUCKETS)
@pytest.mark.parametrize("nk", [(272, 512), (768, 128), (1024, 7168), (4096, 512), (1280, 512)],
                         ids=["N272-K512", "N768-K128", "N1024-K7168", "N4096-K512", "N1280-K512"])
@torch.no_grad()
def test_buckets_match_fp64_reference(cutlass_only, m, nk):
    """Every M bucket; N with a partial last block (272 = 2 * 128 + 16) and multiples of 128; K = 128 (one
    block), 512 and 7168 (DeepSeek-V3's hidden size); bias or not; both output dtypes."""
    n, k = nk
    for i, (out_dtype, bias) in enumerate([(torch.bfloat16, True), (torch.float16, False),
                                           (torch.bfloat16, False), (torch.float16, True)]):
        args = block_problem(m, n, k, out_dtype, bias, seed=m * 1000 + n + k + i)
        out = run(*args, out_dtype)
        check(out, *args, f"M={m} N={n} K={k} {out_dtype} bias={bias}")
        # the functional form allocates the same result
        assert torch.equal(cw.scaled_mm(args[0], args[1].t(), args[2], args[3], out_dtype, args[4]), out)


@pytest.mark.parametrize("config", range(len(BLOCK_CONFIGS)))
@pytest.mark.parametrize("m", [1, 33, 300])
@torch.no_grad()
def test_every_config_forced(m, config):
    """Each entry of the block table, forced with _scaled_mm_config at M far from its bucket (the swapped
    16-column tile at M = 300, the cooperative 128x128 tile at M = 1): right at any M."""
    n, k = 400, 1024
    a, w, sa, sb, b = block_problem(m, n, k, seed=config * 10 + m)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    OPS._scaled_mm_config(out, a, w.t(), sa, sb, b, config)
    check(out, a, w, sa, sb, b, f"config {config} ({BLOCK_CONFIGS[config]}) M={m}")


def test_config_table_size_and_names():
    """_scaled_mm_config indexes the block table for block arguments (kernel_api.h CW8A8_TABLE_FP8_BLOCK = 2):
    7 shipped entries (more only in a CUTLASS_W8A8_TUNE build), named by their shapes."""
    a, w, sa, sb, _ = block_problem(4, 256, 256)
    out = torch.empty(4, 256, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match=r"_scaled_mm_config: `config` must be in \[0, (\d+)\)") as info:
        OPS._scaled_mm_config(out, a, w.t(), sa, sb, None, 1 << 20)
    count = int(re.search(r"must be in \[0, (\d+)\)", str(info.value)).group(1))
    lib = cw._ext.kernel_library("_kernels_sm90")
    if lib is None:
        pytest.skip("the sm90 kernel library is not loaded through ctypes here")
    import ctypes

    lib.cw8a8_sm90_config_name.restype = ctypes.c_char_p
    assert lib.cw8a8_sm90_num_configs(2) == count >= len(BLOCK_CONFIGS)
    names = [lib.cw8a8_sm90_config_name(2, i).decode() for i in range(len(BLOCK_CONFIGS))]
    assert names == BLOCK_CONFIGS
    assert lib.cw8a8_sm90_config_name(2, count) is None and lib.cw8a8_sm90_num_configs(3) == 0


@torch.no_grad()
def test_decode_sizes_dispatch():
    """The default dispatch: M <= decode_gemm_max_m() runs the decode GEMM with block scales (csrc/gemm/decode),
    above it the CUTLASS kernels; both against the same reference."""
    assert cw._ext.decode_gemm_max_m() >= 1
    for m in (1, 7, 8, 9, 16):
        args = block_problem(m, 720, 1024, seed=50 + m)
        check(run(*args, torch.bfloat16), *args, f"dispatched M={m}")


@torch.no_grad()
def test_zero_rows():
    a, w, sa, sb, b = block_problem(0, 256, 512)
    assert cw.scaled_mm(a, w.t(), sa, sb, torch.bfloat16, b).shape == (0, 256)


def test_dispatch_follows_the_mirrored_rules():
    """The library's own choice (cw8a8_sm90_select_config, what scaled_mm runs) against the rules mirrored here, over
    SM counts and shapes where they differ: the block table at M > 128 (large_m_config), and the fp8 table's accurate
    rows at M in (128, 1024), where the 128x256 wave row runs exactly where waves_n_fill_ok holds (no pairing: cluster
    1x1). A rule changed in one place only fails here."""
    import ctypes

    lib = cw._ext.kernel_library("_kernels_sm90")
    if lib is None:
        pytest.skip("the sm90 kernel library is not loaded through ctypes here")
    lib.cw8a8_sm90_config_name.restype = ctypes.c_char_p
    select = lib.cw8a8_sm90_select_config
    select.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int]
    fp8_names = [lib.cw8a8_sm90_config_name(1, i).decode() for i in range(lib.cw8a8_sm90_num_configs(1))]
    accurate_wide = "128x256x128_c1x1_cooperative_persistent_waves_n128"
    seen = set()
    for sms in (132, 114, 78):
        for m in (129, 256, 300, 512, 1000, 1024, 1025, 2048, 4096):
            for n in (768, 2112, 4096, 7168, 24576, 51200):
                got = BLOCK_CONFIGS[select(2, m, n, 7168, sms, 0)]
                assert got == large_m_config(m, n, sms), f"block M={m} N={n} on {sms} SMs: {got}"
                seen.add(got)
                if m < 1024:
                    wide = waves_n_fill_ok(m, n, sms, pairs_along_n=False)
                    name = fp8_names[select(1, m, n, 8192, sms, 0)]
                    assert (name == accurate_wide) == wide, f"accurate fp8 M={m} N={n} on {sms} SMs: {name}"
    assert {BLOCK_CONFIGS[3], BLOCK_CONFIGS[4], BLOCK_CONFIGS[5]} <= seen, seen


# ---- layouts, streams ----------------------------------------------------------------------------------

@pytest.mark.parametrize("m", [3, 100, 1000])
@torch.no_grad()
def test_padded_views(cutlass_only, m):
    """a and the weight sliced from wider buffers (pitches K + 64 and K + 32, a at a 16-byte offset), out a
    window of a wider buffer: the leading strides are passed through, the padding stays untouched."""
    n, k = 272, 512
    g = torch.Generator(device="cuda").manual_seed(m)
    a_buf = rand_operand((m, k + 64), FP8, "cuda", g)
    w_buf = rand_operand((n, k + 32), FP8, "cuda", g)
    a, w = a_buf[:, 16:16 + k], w_buf[:, :k]
    _, _, sa, sb, b = block_problem(m, n, k, seed=m + 1)
    out_buf = torch.full((m, n + 24), 7.0, dtype=torch.bfloat16, device="cuda")
    out = out_buf[:, 8:8 + n]
    run(a, w, sa, sb, b, torch.bfloat16, out=out)
    check(out, a, w, sa, sb, b, f"padded views M={m}")
    assert (out_buf[:, :8] == 7).all() and (out_buf[:, 8 + n:] == 7).all(), "the padding was written"
    # the same product from packed copies, bit for bit
    packed = cw.scaled_mm(a.contiguous(), w.contiguous().t(), sa, sb, torch.bfloat16, b)
    assert torch.equal(out, packed)


@torch.no_grad()
def test_single_row_any_stride(cutlass_only):
    """One row sliced out of a taller buffer keeps the parent's stride(0)."""
    k = 1024
    g = torch.Generator(device="cuda").manual_seed(9)
    a = rand_operand((8, k + 16), FP8, "cuda", g)[5:6, :k]
    _, w, sa, sb, b = block_problem(1, 512, k, seed=9)
    check(run(a, w, sa, sb, b, torch.bfloat16), a, w, sa, sb, b, "one-row slice")


@torch.no_grad()
def test_results_follow_the_scales(cutlass_only):
    """Doubling one group's scale of one row changes exactly that row; doubling one weight block's scale
    changes exactly that block's 128 columns (a kernel reading the wrong scale element fails here)."""
    m, n, k = 200, 384, 512
    a, w, sa, sb, _ = block_problem(m, n, k, bias=False, seed=11)
    y0 = cw.scaled_mm(a, w.t(), sa, sb, torch.bfloat16)
    sa2 = sa.clone()
    sa2[37, 2] *= 2
    y1 = cw.scaled_mm(a, w.t(), sa2, sb, torch.bfloat16)
    changed = (y1 != y0).any(dim=1)
    assert changed[37] and changed.sum() == 1, "only row 37 depends on scale_a[37, 2]"
    sb2 = sb.clone()
    sb2[1, 3] *= 2
    y2 = cw.scaled_mm(a, w.t(), sa, sb2, torch.bfloat16)
    cols = (y2 != y0).any(dim=0)
    assert cols[128:256].any() and not cols[:128].any() and not cols[256:].any(), \
        "only columns 128..255 depend on scale_b[1, 3]"


@torch.no_grad()
def test_runs_on_current_stream(cutlass_only):
    """Work goes to the current stream: the results are ready once that (side) stream is synchronised."""
    a, w, sa, sb, b = block_problem(256, 1024, 2048, seed=12)
    s = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(s):
        out = torch.full((256, 1024), float("nan"), dtype=torch.bfloat16, device="cuda")
        for _ in range(3):
            cw.scaled_mm(a, w.t(), sa, sb, torch.bfloat16, b, out=out)
        y = cw.scaled_mm(a, w.t(), sa, sb, torch.bfloat16, b)
    s.synchronize()
    check(out, a, w, sa, sb, b, "side stream, out=")
    check(y, a, w, sa, sb, b, "side stream, functional")


# ---- CUDA graphs -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("m", [3, 17, 200, 1024])
@torch.no_grad()
def test_captured_graph_equals_eager_bitwise(m):
    """A CapturedGraph of the block GEMM, replayed on new activations and scales copied into its inputs,
    equals eager scaled_mm on the same tensors bit for bit (one config per shape, no split-K; M = 3 takes the
    decode GEMM on both sides)."""
    n, k = 768, 1024
    a, w, sa, sb, b = block_problem(m, n, k, seed=20 + m)
    g = CapturedGraph(lambda a_, sa_: cw.scaled_mm(a_, w.t(), sa_, sb, torch.bfloat16, b), [a, sa])
    for i in range(3):
        a2, _, sa2, _, _ = block_problem(m, n, k, seed=100 * i + m)
        g.static_outputs.fill_(float("nan"))
        y = g(a2, sa2)
        eager = cw.scaled_mm(a2, w.t(), sa2, sb, torch.bfloat16, b)
        torch.cuda.synchronize()
        assert torch.equal(y, eager), f"replay {i}, M={m}: graph and eager differ"
        check(y, a2, w, sa2, sb, b, f"graph replay {i}, M={m}")


def _updatable_gemm(m, n, k, seed):
    """An UpdatableGraph of one block scaled_mm captured at M = m, with a and scale_a as its static inputs."""
    a, w, sa, sb, b = block_problem(m, n, k, seed=seed)
    g = UpdatableGraph(lambda a_, sa_: cw.scaled_mm(a_, w.t(), sa_, sb, torch.bfloat16, b), [a, sa])
    nodes = [node for node in g.nodes if node.op == "scaled_mm"]
    assert len(g.nodes) == 1 and len(nodes) == 1, g.nodes  # recording keeps the CUTLASS node, even at M <= 8
    return g, nodes[0], w, sb, b


def _replay_rows(g, w, sb, b, m, seed, what):
    """Fresh activations and scales in all captured rows, NaN in the output, replay: rows < m right, the
    others untouched."""
    rows, k = g.static_inputs[0].shape
    a2, _, sa2, _, _ = block_problem(rows, w.shape[0], k, seed=seed)
    g.static_inputs[0].copy_(a2)
    g.static_inputs[1].copy_(sa2)
    g.static_outputs.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    out = g.static_outputs
    check(out[:m], a2[:m], w, sa2[:m], sb, b, what)
    assert torch.isnan(out[m:].float()).all(), f"{what}: rows >= {m} were written"


@torch.no_grad()
def test_updatable_graph_set_rows():
    """Captured at M = 256 (N = 768: the 64x128 pingpong tile, cluster 1x1); M walks across the buckets, the
    node switching configs with it (the scale_a pointer stays: the first M rows of [M, K/128])."""
    g, node, w, sb, b = _updatable_gemm(256, 768, 1024, seed=30)
    assert BLOCK_CONFIGS[node.config] == large_m_config(256, 768) == BLOCK_CONFIGS[2], node
    for i, m in enumerate([256, 129, 128, 100, 64, 17, 16, 7, 1, 200]):
        g.set_rows(m)
        assert g.nodes[0].rows == m
        _replay_rows(g, w, sb, b, m, seed=i, what=f"set_rows({m})")


@torch.no_grad()
@pytest.mark.parametrize("captured_m,n,config", [(512, 4096, 3), (3072, 1280, 4), (1024, 4096, 5)],
                         ids=["128x128", "256x128_waves", "128x256_waves_n"])
def test_updatable_graph_keeps_cluster_config(captured_m, n, config):
    """Captured at (M, N) = (512, 4096), (3072, 1280) or (1024, 4096) (on 132 SMs the 128x128 cooperative tile, the
    256x128 wave tile, or the 128x256 tile with waves along N, all cluster 1x2 and launched without PDL); smaller M keep
    that config (a node's cluster shape cannot change) and stay right."""
    if large_m_config(captured_m, n) != BLOCK_CONFIGS[config]:
        pytest.skip(f"on this GPU's SM count dispatch picks another tile at M = {captured_m}, N = {n}")
    g, node, w, sb, b = _updatable_gemm(captured_m, n, 512, seed=31)
    assert BLOCK_CONFIGS[node.config] == BLOCK_CONFIGS[config], node
    for i, m in enumerate([100, 1, captured_m // 2 + 1, captured_m]):
        g.set_rows(m)
        _replay_rows(g, w, sb, b, m, seed=40 + i, what=f"{BLOCK_CONFIGS[config]}, set_rows({m})")


@pytest.mark.parametrize("captured_m,n", [(16, 2048), (1024, 4096)])
@torch.no_grad()
def test_updatable_graph_quantizer_then_gemm_with_pdl(captured_m, n):
    """The block layer's two kernels, quantize_per_token_group then the GEMM, captured with PDL on (the GEMM's
    node gets a programmatic edge from the quantizer, which lets its dependents start early): at M = 16 the
    pingpong kernel, whose producer warps wait on griddepcontrol before loading A, B and the scales; at M = 1024
    (on 132 SMs) the cooperative 128x256 wave kernel (Fp8Block_MMid_WavesN), which the library launches without PDL
    (its scale-loading warp does not wait). Replays with new inputs at several M must read the scales the quantizer
    wrote in that replay."""
    k = 2048
    _, w, _, sb, b = block_problem(1, n, k, seed=32)

    def layer(x):
        q, s = cw.quantize_per_token_group(x)
        return cw.scaled_mm(q, w.t(), s, sb, torch.bfloat16, b)

    prev = cw.set_pdl(True)
    try:
        g = UpdatableGraph(layer, [torch.randn(captured_m, k, device="cuda", dtype=torch.bfloat16)])
    finally:
        cw.set_pdl(prev)
    assert [node.op for node in g.nodes][-1] == "scaled_mm" and len(g.nodes) == 2, g.nodes
    for i in range(12):
        m = [captured_m, 3, 1, 9][i % 4]
        g.set_rows(m)
        x = torch.randn(captured_m, k, device="cuda", dtype=torch.bfloat16,
                        generator=torch.Generator("cuda").manual_seed(60 + i))
        g.static_inputs[0].copy_(x)
        g.static_outputs.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        q, s = cw.quantize_per_token_group(x[:m])
        out = g.static_outputs
        check(out[:m], q, w, s, sb, b, f"PDL replay {i}, captured M={captured_m}, M={m}")
        assert torch.isnan(out[m:].float()).all(), f"replay {i}: rows >= {m} were written"


@torch.no_grad()
def test_update_scaled_mm_block_operands():
    """update_scaled_mm re-points the block node to new tensors of another M (new a, scales, weight, bias,
    out): the new output holds the new product, the captured one is left alone."""
    n, k = 512, 1024
    a, w, sa, sb, b = block_problem(48, n, k, seed=33)
    out = torch.empty(48, n, dtype=torch.bfloat16, device="cuda")
    g = UpdatableGraph(lambda a_: cw.scaled_mm(a_, w.t(), sa, sb, torch.bfloat16, b, out=out), [a])
    node = [n_ for n_ in g.nodes if n_.op == "scaled_mm"][0]
    for i, m in enumerate([7, 48, 1, 30]):
        a2, w2, sa2, sb2, b2 = block_problem(m, n, k, bias=i % 2 == 0, seed=70 + i)
        out2 = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        out.fill_(float("nan"))
        g.update_scaled_mm(node, out2, a2, w2.t(), sa2, sb2, b2)
        g.replay()
        torch.cuda.synchronize()
        check(out2, a2, w2, sa2, sb2, b2, f"update {i}, M={m}")
        assert torch.isnan(out.float()).all(), f"update {i}: the captured output was written"
    # a block node keeps block scales: row-wise scales are refused, the node unchanged
    a2, w2, _, _, _ = block_problem(8, n, k, seed=80)
    out2 = torch.empty(8, n, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="must be block scales .* as captured"):
        g.update_scaled_mm(node, out2, a2, w2.t(), torch.ones(8, 1, device="cuda"), torch.ones(n, device="cuda"))


@torch.no_grad()
def test_rowwise_node_refuses_block_scales():
    """The converse: a row-wise fp8 node cannot be re-pointed to block scales (another kernel family)."""
    n, k = 256, 512
    a, w, sa, sb, _ = block_problem(32, n, k, seed=34)
    ones_a, ones_b = torch.ones(32, 1, device="cuda"), torch.ones(n, device="cuda")
    out = torch.empty(32, n, dtype=torch.bfloat16, device="cuda")
    g = UpdatableGraph(lambda a_: cw.scaled_mm(a_, w.t(), ones_a, ones_b, torch.bfloat16, out=out), [a])
    node = [n_ for n_ in g.nodes if n_.op == "scaled_mm"][0]
    with pytest.raises(ValueError, match="must be row-wise scales .* as captured"):
        g.update_scaled_mm(node, out, a, w.t(), sa, sb)


# ---- the contract on CUDA -----------------------------------------------------------------------------------

def _bad_cases():
    """(name, exception, exact message, (a, b, scale_a, scale_b)) of the block checks, in the spec's order."""
    m, n, k = 4, 272, 512
    a, w, sa, sb, _ = block_problem(m, n, k, seed=90)
    a8 = torch.randint(-128, 128, (m, k), dtype=torch.int8, device="cuda")
    w8 = torch.randint(-128, 128, (n, k), dtype=torch.int8, device="cuda")
    k2 = 400  # a multiple of 16, not of 128
    a_k2, w_k2 = rand_operand((m, k2), FP8, "cuda"), rand_operand((n, k2), FP8, "cuda")
    sa_k2 = torch.ones(m, blocks(k2), device="cuda")
    sb_k2 = torch.ones(blocks(n), blocks(k2), device="cuda")
    return [
        ("int8 operands", TypeError,
         "scaled_mm: `a` must be float8_e4m3fn with block scales (scale_a [M, K/128], scale_b [ceil(N/128), K/128]), "
         "got torch.int8", (a8, w8.t(), sa, sb)),
        ("K not a multiple of 128", ValueError,
         "scaled_mm: `a` K = a.shape[1] must be a multiple of 128 with block scales, got 400",
         (a_k2, w_k2.t(), sa_k2, sb_k2)),
        ("scale_a rows", ValueError,
         "scaled_mm: `scale_a` must be [M, K/128] = [4, 4] (1x128 groups) with block scales, got shape (5, 4)",
         (a, w.t(), torch.ones(5, 4, device="cuda"), sb)),
        ("scale_b shape", ValueError,
         "scaled_mm: `scale_b` must be [ceil(N/128), K/128] = [3, 4] (128x128 blocks) with block scales, "
         "got shape (2, 4)", (a, w.t(), sa, torch.ones(2, 4, device="cuda"))),
        ("scale_a not contiguous", ValueError, "scaled_mm: `scale_a` must be contiguous",
         (a, w.t(), torch.ones(4, 4, device="cuda").t(), sb)),
        ("scale_b not contiguous", ValueError, "scaled_mm: `scale_b` must be contiguous",
         (a, w.t(), sa, torch.ones(4, 3, device="cuda").t())),
    ]


@pytest.mark.parametrize("case", range(6))
def test_block_checks_match_cpu(case):
    """The C++ checks raise the contract's exception and message, the same as the CPU implementation."""
    name, exc, message, (a, b, sa, sb) = _bad_cases()[case]
    with pytest.raises(exc) as on_cuda:
        OPS.scaled_mm(a, b, sa, sb, torch.bfloat16, None)
    assert str(on_cuda.value).splitlines()[0] == message, name
    with pytest.raises(exc) as on_cpu:
        OPS.scaled_mm(a.cpu(), b.cpu(), sa.cpu(), sb.cpu(), torch.bfloat16, None)
    assert str(on_cpu.value).splitlines()[0] == message, f"{name} (CPU)"


FORCED_SM80_CHILD = textwrap.dedent("""
    import torch
    import cutlass_w8a8 as cw
    from cutlass_w8a8.testing.references import rand_operand

    prefix = ("scaled_mm: block-scaled fp8 (scale_a [M, K/128], scale_b [ceil(N/128), K/128]) needs an sm90 GPU; "
              "this device is sm_")
    refused = 0
    for m in (1, 8, 64, 300):  # the decode range too: the refusal comes before the decode dispatch
        a = rand_operand((m, 512), torch.float8_e4m3fn, "cuda")
        w = rand_operand((272, 512), torch.float8_e4m3fn, "cuda")
        sa, sb = torch.ones(m, 4, device="cuda"), torch.ones(3, 4, device="cuda")
        try:
            cw.scaled_mm(a, w.t(), sa, sb, torch.bfloat16)
        except NotImplementedError as e:
            assert str(e).startswith(prefix), e
            refused += 1
    # row-wise fp8 still runs (on the sm90 kernels: there is no Ampere fp8)
    y = cw.scaled_mm(a, w.t(), torch.ones(300, 1, device="cuda"), torch.ones(272, device="cuda"), torch.bfloat16)
    torch.cuda.synchronize()
    assert not torch.isnan(y.float()).any()
    print("refused:", refused)
""")


def test_forced_sm80_refuses_block_scales():
    """CUTLASS_W8A8_FORCE_ARCH=sm80 (read once per process: a child process) serves the GPU as a non-sm90 one
    for block scales: NotImplementedError naming the device, at every M."""
    env = dict(os.environ, CUTLASS_W8A8_FORCE_ARCH="sm80")
    res = subprocess.run([sys.executable, "-c", FORCED_SM80_CHILD], env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, f"child failed:\n{res.stdout[-3000:]}\n{res.stderr[-5000:]}"
    assert "refused: 4" in res.stdout, res.stdout
