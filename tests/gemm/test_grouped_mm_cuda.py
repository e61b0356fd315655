"""grouped_scaled_mm on an sm90 GPU (issue 27): the grouped decode kernel (T <= _grouped_decode_max_rows()) and the
CUTLASS ptr-array grouped GEMM (csrc/gemm/sm90/grouped: its *_Small configs while T <= 16 E, *_Mid while T <= 64 E,
*_Large above) against the float64 product of the dequantized operands, expert by expert.

Tolerances are the dense GEMMs': row-wise int8 / fp8 as tests/gemm/test_scaled_mm_cuda.py (assert_close_to_reference:
one output ulp, float32 epilogue roundoffs, and for fp8 the tensor cores' accumulation, fp8_accum_bound(K)); block
fp8 as tests/gemm/test_scaled_mm_block_cuda.py (its block_reference bound per element and the relative Frobenius error
2.5e-3 for bfloat16, 1e-3 for float16). Outputs are poisoned with NaN first: every routed row must be written and
rows >= offsets[E - 1] must stay untouched. Routings cover empty experts (first, last and inner), all rows on one
expert, T = 1, unrouted tail rows, T on both sides of the decode bound and of the Small / Mid / Large config switches, and
offsets the device must clamp. CUDA graphs: captured once, replayed with other offsets (and activations), equal to
eager bit for bit.
"""

from __future__ import annotations

import pytest
import torch

import cutlass_w8a8 as cw
from cutlass_w8a8.graphs import CapturedGraph
from cutlass_w8a8.testing.references import (assert_close_to_reference, assert_within, fp8_accum_bound, rand_operand,
                                             rand_scale, reference, scale_magnitudes, ulp)
from _opcheck import run_opcheck
from test_scaled_mm_block_cuda import FROBENIUS, block_reference

pytestmark = pytest.mark.sm90

OPS = torch.ops.cutlass_w8a8
FP8 = torch.float8_e4m3fn
DTYPES = [torch.int8, pytest.param(FP8, id="fp8")]


@pytest.fixture(autouse=True)
def _needs_fp8_kernels(request):
    dtype = request.node.callspec.params.get("dtype") if hasattr(request.node, "callspec") else None
    if dtype == FP8 and not cw.supports_fp8():
        pytest.skip("the sm90 fp8 kernels are not available in this build")


def decode_max_rows() -> int:
    return int(OPS._grouped_decode_max_rows())


def offsets_for(t, e, kind, seed):
    """int32 offsets [E] on the GPU: "random" (uniform experts, experts 0, 1 and E - 1 empty), "one" (every row on
    expert E // 2), "tail" (3 rows routed to no expert), "uniform" (every expert, round robin)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "one":
        counts = torch.zeros(e, dtype=torch.int64)
        counts[e // 2] = t
    elif kind == "uniform":
        counts = torch.bincount(torch.arange(t) % e, minlength=e)
    else:
        routed = max(t - 3, 0) if kind == "tail" else t
        ids = torch.randint(2, max(e - 1, 3), (routed,), generator=g) % e
        counts = torch.bincount(ids, minlength=e)
    return counts.cumsum(0).to(torch.int32).cuda()


def problem(t, n, k, e, dtype, *, sa_kind="token", sb_kind="channel", bias=True, out_dtype=torch.bfloat16,
            block=False, seed=0):
    """(a, w, sa, sb, bias): a (T, K), w (E, N, K) (the op gets w.transpose(1, 2)), float32 scales, bias (E, N)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = rand_operand((t, k), dtype, "cuda", g)
    w = rand_operand((e, n, k), dtype, "cuda", g)
    if block:
        def scales(shape):
            mag = 2.0 ** torch.randint(-3, 3, shape, device="cuda", generator=g).float()
            return (torch.rand(shape, device="cuda", generator=g) + 0.5) * mag / (k ** 0.5)
        sa, sb = scales((t, k // 128)), scales((e, -(-n // 128), k // 128))
    else:
        ma, mb = scale_magnitudes(dtype, k)
        sa = rand_scale({"token": (t, 1), "token1d": (t,), "tensor": (1,)}[sa_kind], "cuda", ma, g)
        sb = rand_scale({"channel": (e, n), "expert": (e,), "expert2d": (e, 1)}[sb_kind], "cuda", mb, g)
    b = (torch.randn(e, n, device="cuda", generator=g) * 2).to(out_dtype) if bias else None
    return a, w, sa, sb, b


def run(a, w, sa, sb, offsets, b, out_dtype):
    out = torch.empty(a.shape[0], w.shape[1], dtype=out_dtype, device="cuda")
    out.fill_(float("nan"))
    ret = cw.grouped_scaled_mm(a, w.transpose(1, 2), sa, sb, offsets, out_dtype, b, out=out)
    assert ret is out
    return out


def check(out, a, w, sa, sb, offsets, b, what):
    """Each expert's rows against the float64 reference of the dense GEMM of those rows; rows past the last end NaN."""
    n = w.shape[1]
    ends = [int(v) for v in offsets.tolist()]
    start = 0
    for e, end in enumerate(ends):
        if end > start:
            rows = slice(start, end)
            be = b[e] if b is not None else None
            name = f"{what}, expert {e} rows [{start}, {end})"
            if sb.dim() == 3:
                d, bound = block_reference(a[rows], w[e], sa[rows], sb[e], be)
                o = out[rows].double()
                assert not torch.isnan(o).any(), f"{name}: rows left unwritten (NaN)"
                rel = float((d - o).norm() / d.norm())
                assert rel <= FROBENIUS[out.dtype], f"{name}: relative Frobenius error {rel:.3g}"
                assert_within(o, d, bound + torch.maximum(ulp(d, out.dtype), ulp(o, out.dtype)), name, "(t, n) = ")
            else:
                sa_e = sa.reshape(-1)[rows] if sa.numel() != 1 else sa.reshape(1)
                sb_e = sb[e] if sb.dim() == 2 and sb.shape[1] == n else sb.reshape(-1)[e:e + 1]
                ref = reference(a[rows], w[e].t(), sa_e, sb_e, be)
                rel = fp8_accum_bound(a.shape[1]) if a.dtype == FP8 else 0.0
                assert_close_to_reference(out[rows], ref, out.dtype, accum_rel=rel, what=name)
        start = max(start, end)
    assert torch.isnan(out[ends[-1]:].float()).all(), f"{what}: rows >= offsets[-1] = {ends[-1]} were written"


def t_values():
    dmax = decode_max_rows()
    return sorted({1, 2, dmax, dmax + 1, 200, 512, 513, 1000})  # at E = 8: Small <= 128, Mid <= 512, Large above


# ---- the kernels against the float64 reference ------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["random", "one", "tail", "uniform"])
@torch.no_grad()
def test_routings_and_sizes(dtype, kind):
    """E = 8, N = 272 (partial tiles), K = 512: every T of t_values() (decode kernel, CUTLASS Small, Mid and Large)."""
    e, n, k = 8, 272, 512
    for t in t_values():
        a, w, sa, sb, b = problem(t, n, k, e, dtype, seed=t)
        offsets = offsets_for(t, e, kind, seed=t)
        out = run(a, w, sa, sb, offsets, b, torch.bfloat16)
        check(out, a, w, sa, sb, offsets, b, f"{dtype} {kind} T={t}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scales", [("tensor", "expert"), ("token1d", "expert2d"), ("tensor", "channel"),
                                    ("token", "expert")])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
@torch.no_grad()
def test_scale_kinds_bias_and_out_dtypes(dtype, scales, out_dtype):
    e, n, k = 6, 256, 256
    for t, bias in ((5, True), (300, False), (800, True)):
        a, w, sa, sb, b = problem(t, n, k, e, dtype, sa_kind=scales[0], sb_kind=scales[1], bias=bias,
                                  out_dtype=out_dtype, seed=t + 7)
        offsets = offsets_for(t, e, "random", seed=t)
        out = run(a, w, sa, sb, offsets, b, out_dtype)
        check(out, a, w, sa, sb, offsets, b, f"{dtype} {scales} {out_dtype} T={t} bias={bias}")


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["random", "one", "tail"])
@torch.no_grad()
def test_block_fp8(out_dtype, kind):
    if not cw.supports_fp8():
        pytest.skip("the sm90 fp8 kernels are not available in this build")
    e, n, k = 8, 208, 384  # N = 208: a partial last weight block
    for t in t_values():
        a, w, sa, sb, b = problem(t, n, k, e, FP8, block=True, out_dtype=out_dtype, seed=t + 3)
        offsets = offsets_for(t, e, kind, seed=t + 1)
        out = run(a, w, sa, sb, offsets, b, out_dtype)
        check(out, a, w, sa, sb, offsets, b, f"block {kind} {out_dtype} T={t}")


@pytest.mark.parametrize("dtype", DTYPES + [pytest.param("block", id="block")])
@torch.no_grad()
def test_moe_shapes(dtype):
    """Qwen3-30B-A3B's w13 (E 128, N 2I = 1536, K 2048) and w2 (N 2048, K 768) at 512 tokens x top-8 rows."""
    if dtype != torch.int8 and not cw.supports_fp8():
        pytest.skip("the sm90 fp8 kernels are not available in this build")
    block = dtype == "block"
    ab = FP8 if block else dtype
    for n, k in ((1536, 2048), (2048, 768)):
        t, e = 4096, 128
        a, w, sa, sb, b = problem(t, n, k, e, ab, block=block, bias=False, seed=n)
        offsets = offsets_for(t, e, "random", seed=n)
        out = run(a, w, sa, sb, offsets, b, torch.bfloat16)
        check(out, a, w, sa, sb, offsets, b, f"{dtype} N={n} K={k}")


@torch.no_grad()
def test_device_clamps_bad_offsets():
    """Offsets the CPU refuses: the device clamps them (c[e] = min(T, max(c[e-1], offsets[e]))), no error."""
    e, n, k = 4, 128, 256
    for t in (3, 600):
        a, w, sa, sb, b = problem(t, n, k, e, torch.int8, seed=t)
        bad = torch.tensor([t // 2, -5, t + 100, t // 3], dtype=torch.int32, device="cuda")
        clamped = torch.tensor([t // 2, t // 2, t, t], dtype=torch.int32, device="cuda")
        out = run(a, w, sa, sb, bad, b, torch.bfloat16)
        check(out, a, w, sa, sb, clamped, b, f"clamped offsets T={t}")


@torch.no_grad()
def test_zero_rows_and_all_empty():
    e, n, k = 4, 128, 256
    a, w, sa, sb, b = problem(0, n, k, e, torch.int8)
    assert cw.grouped_scaled_mm(a, w.transpose(1, 2), sa, sb, torch.zeros(e, dtype=torch.int32, device="cuda"),
                                torch.bfloat16, b).shape == (0, n)
    for t in (2, 700):  # every expert empty: nothing written
        a, w, sa, sb, b = problem(t, n, k, e, torch.int8, seed=t)
        out = run(a, w, sa, sb, torch.zeros(e, dtype=torch.int32, device="cuda"), b, torch.bfloat16)
        assert torch.isnan(out.float()).all()


@torch.no_grad()
def test_padded_views():
    """a as a window of a wider buffer, padded experts in the weight buffer."""
    e, n, k = 4, 256, 512
    g = torch.Generator(device="cuda").manual_seed(11)
    for t in (5, 900):
        a = rand_operand((t, k + 64), torch.int8, "cuda", g)[:, 16:16 + k]
        w = rand_operand((e, n + 16, k + 32), torch.int8, "cuda", g)[:, :n, :k]
        ma, mb = scale_magnitudes(torch.int8, k)
        sa, sb = rand_scale((t, 1), "cuda", ma, g), rand_scale((e, n), "cuda", mb, g)
        offsets = offsets_for(t, e, "random", seed=t)
        out = run(a, w, sa, sb, offsets, None, torch.bfloat16)
        check(out, a, w, sa, sb, offsets, None, f"padded T={t}")


@torch.no_grad()
def test_runs_on_current_stream():
    e, n, k, t = 8, 256, 512, 700
    a, w, sa, sb, b = problem(t, n, k, e, torch.int8, seed=5)
    offsets = offsets_for(t, e, "random", seed=5)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out = run(a, w, sa, sb, offsets, b, torch.bfloat16)
    torch.cuda.current_stream().wait_stream(s)
    check(out, a, w, sa, sb, offsets, b, "side stream")


# ---- CUDA graphs -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES + [pytest.param("block", id="block")])
@torch.no_grad()
def test_graph_replay_equals_eager_bitwise(dtype):
    """Captured once per T (decode kernel at 1 and 64; at E = 8 CUTLASS Small at 65, Mid at 300, Large at 1000),
    replayed with new offsets and activations: the replay equals eager on the same inputs bit for bit, and the float64
    reference."""
    if dtype != torch.int8 and not cw.supports_fp8():
        pytest.skip("the sm90 fp8 kernels are not available in this build")
    block = dtype == "block"
    ab = FP8 if block else dtype
    e, n, k = 8, 256, 512
    for t in sorted({1, decode_max_rows(), decode_max_rows() + 1, 300, 1000}):
        a, w, sa, sb, b = problem(t, n, k, e, ab, block=block, seed=t)
        bt = w.transpose(1, 2)
        offsets = offsets_for(t, e, "uniform", seed=0)
        g = CapturedGraph(lambda a_, sa_, o_: cw.grouped_scaled_mm(a_, bt, sa_, sb, o_, torch.bfloat16, b),
                          [a, sa, offsets])
        for i, kind in enumerate(("random", "one", "tail", "random")):
            a2, _, sa2, _, _ = problem(t, n, k, e, ab, block=block, seed=1000 * i + t)
            o2 = offsets_for(t, e, kind, seed=i)
            g.static_outputs.fill_(float("nan"))
            y = g(a2, sa2, o2)
            eager = torch.full_like(y, float("nan"))
            cw.grouped_scaled_mm(a2, bt, sa2, sb, o2, torch.bfloat16, b, out=eager)
            torch.cuda.synchronize()
            end = int(o2[-1])
            assert torch.equal(y[:end], eager[:end]), f"{dtype} T={t} replay {i} ({kind}): graph and eager differ"
            check(y, a2, w, sa2, sb, o2, b, f"{dtype} graph T={t} replay {i} ({kind})")


# ---- forced configs (_grouped_scaled_mm_config: the tuning op) ----------------------------------------------


def grouped_tables():
    """{table id: [entry names]} of the sm90 library's grouped tables (kernel_api.h cw8a8_config_table: 0 int8, 1 fp8,
    2 block fp8): the shipped Small, Mid and Large entries, then the tuning candidates of a CUTLASS_W8A8_TUNE=grouped
    build."""
    import ctypes

    lib = cw._ext.kernel_library("_kernels_sm90")
    if lib is None:
        pytest.skip("the sm90 kernel library is not loaded through ctypes here")
    lib.cw8a8_sm90_grouped_config_name.restype = ctypes.c_char_p
    return {t: [lib.cw8a8_sm90_grouped_config_name(t, i).decode() for i in range(lib.cw8a8_sm90_grouped_num_configs(t))]
            for t in (0, 1, 2)}


def forced(a, w, sa, sb, offsets, b, config):
    out = torch.full((a.shape[0], w.shape[1]), float("nan"), dtype=torch.bfloat16, device="cuda")
    OPS._grouped_scaled_mm_config(out, a, w.transpose(1, 2), sa, sb, offsets, b, config)
    return out


@pytest.mark.parametrize("dtype", DTYPES + [pytest.param("block", id="block")])
@torch.no_grad()
def test_every_grouped_config_forced(dtype):
    """Every entry of the grouped table (tuning candidates included when built) forced at T 40 and 600 (E = 8: a
    decode-size T and one in *_Large's range; a forced entry runs whatever T): right at any T, rows past the last
    expert untouched."""
    if dtype != torch.int8 and not cw.supports_fp8():
        pytest.skip("the sm90 fp8 kernels are not available in this build")
    block = dtype == "block"
    table = 2 if block else (0 if dtype == torch.int8 else 1)
    names = grouped_tables()[table]
    assert len(names) >= 3 and all(names), names
    e, n, k = 8, 208 if block else 272, 512
    for config, name in enumerate(names):
        for t in (40, 600):
            a, w, sa, sb, b = problem(t, n, k, e, FP8 if block else dtype, block=block, seed=config * 10 + t)
            offsets = offsets_for(t, e, "tail", seed=t)
            out = forced(a, w, sa, sb, offsets, b, config)
            check(out, a, w, sa, sb, offsets, b, f"{dtype} config {config} ({name}) T={t}")


def test_grouped_config_table_size_and_names():
    """The op's range is the library's table size (3 shipped entries, more only in a tuning build), named as the dense
    tables' entries are (grouped_sm90_config.cuh: every family's Mid is a 64x128 pingpong tile, its Large a 128x256
    cooperative one, block fp8's on the wave mainloop with waves 128 wide along N)."""
    a, w, sa, sb, b = problem(8, 128, 256, 4, torch.int8)
    o = torch.tensor([2, 4, 6, 8], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match=r"^_grouped_scaled_mm_config: `config` must be in \[0, (\d+)\), got 99999"):
        forced(a, w, sa, sb, o, b, 99_999)
    tables = grouped_tables()
    assert tables[0][:3] == ["swap_64x32x256_c1x1_pingpong_persistent", "64x128x128_c1x1_pingpong_persistent",
                             "128x256x128_c1x1_cooperative_persistent"]
    assert tables[1][:3] == ["swap_64x32x256_c1x1_pingpong_persistent_fastaccum",
                             "64x128x128_c1x1_pingpong_persistent_fastaccum",
                             "128x256x128_c1x1_cooperative_persistent_fastaccum"]
    assert tables[2][:3] == ["swap_128x32x128_c1x1_pingpong_persistent", "64x128x128_c1x1_pingpong_persistent",
                             "128x256x128_c1x1_cooperative_persistent_waves_n128"]


@pytest.mark.parametrize("dtype", [pytest.param(FP8, id="fp8"), pytest.param("block", id="block")])
@torch.no_grad()
def test_wave_candidates_bit_identical(dtype):
    """The wave mainloop on the ptr-array collectives (wave_mainloop.cuh) computes CUTLASS's products in CUTLASS's K
    order with one promotion per 128 of K, so its output equals, bit for bit, CUTLASS's 128x128 cooperative kernel:
    block fp8's blockwise mainloop (its *_Large until 2026-11-30, now a candidate) and, row-wise, the promoted
    candidate; so do its 128x256 tiles with waves along N (Config's WaveN; block fp8's shipped *_Large). Needs a
    CUTLASS_W8A8_TUNE=grouped build (the references are candidates)."""
    if not cw.supports_fp8():
        pytest.skip("the sm90 fp8 kernels are not available in this build")
    block = dtype == "block"
    names = grouped_tables()[2 if block else 1]
    waves = [i for i, name in enumerate(names) if "_waves" in name]  # also _waves_n128: waves along N
    reference_name = "128x128x128_c1x1_cooperative_persistent"
    if not waves or reference_name not in names:
        pytest.skip("built without the grouped tuning candidates (CUTLASS_W8A8_TUNE=grouped)")
    reference_index = names.index(reference_name)
    e = 8
    for t, n, k in ((600, 208 if block else 272, 512), (4096, 1536, 2048)):
        a, w, sa, sb, b = problem(t, n, k, e, FP8, block=block, seed=t)
        offsets = offsets_for(t, e, "random", seed=t)
        want = forced(a, w, sa, sb, offsets, b, reference_index)
        end = int(offsets[-1])
        for i in waves:
            got = forced(a, w, sa, sb, offsets, b, i)
            assert torch.equal(got[:end], want[:end]), f"{names[i]} differs from {reference_name} at T={t} N={n} K={k}"


@torch.no_grad()
def test_int8_entries_bit_identical():
    """int8 accumulates exactly in int32 and every int8 entry (swapped or not, any tile or schedule) applies the same
    float32 epilogue per element (scale_tok * (scale_ch * float(acc)) + bias, rounded once: scaled_mm_sm90_epilogue.cuh
    RowwiseEVT), so every entry of the int8 grouped table (shipped Small / Mid / Large and, in a CUTLASS_W8A8_TUNE=grouped
    build, the candidates) equals the shipped Large entry bit for bit (the bench's bit reference for int8,
    bench/_moe_configs.py), itself checked against float64. N 272 leaves partial tiles of every tile width; random
    routing leaves experts empty and rows unrouted."""
    names = grouped_tables()[0]
    reference_index = 2  # *_Large (kNumGroupedConfigs' order: Small, Mid, Large)
    assert names[reference_index] == "128x256x128_c1x1_cooperative_persistent", names
    e = 8
    for t, n, k in ((600, 272, 512), (4096, 1536, 2048)):
        a, w, sa, sb, b = problem(t, n, k, e, torch.int8, seed=t + 1)
        offsets = offsets_for(t, e, "random", seed=t)
        want = forced(a, w, sa, sb, offsets, b, reference_index)
        check(want, a, w, sa, sb, offsets, b, f"int8 reference {names[reference_index]} T={t} N={n} K={k}")
        end = int(offsets[-1])
        for i, name in enumerate(names):
            if i == reference_index:
                continue
            got = forced(a, w, sa, sb, offsets, b, i)
            assert torch.equal(got[:end], want[:end]), \
                f"int8 entry {i} ({name}) differs from {names[reference_index]} at T={t} N={n} K={k}"


# ---- opcheck and the checks ---------------------------------------------------------------------------------


def test_opcheck_cuda():
    cases = []
    for t in (3, 600):
        a, w, sa, sb, b = problem(t, 128, 256, 4, torch.int8, seed=t)
        o = offsets_for(t, 4, "random", seed=t)
        cases.append((OPS.grouped_scaled_mm, (a, w.transpose(1, 2), sa, sb, o, torch.bfloat16, b)))
        out = torch.empty(t, 128, dtype=torch.float16, device="cuda")
        cases.append((OPS.grouped_scaled_mm_out, (out, a, w.transpose(1, 2), sa, sb, o, None)))
        if cw.supports_fp8():
            a, w, sa, sb, b = problem(t, 208, 256, 4, FP8, block=True, seed=t)
            cases.append((OPS.grouped_scaled_mm, (a, w.transpose(1, 2), sa, sb, o, torch.bfloat16, b)))
            out = torch.empty(t, 208, dtype=torch.bfloat16, device="cuda")
            cases.append((OPS._grouped_scaled_mm_config, (out, a, w.transpose(1, 2), sa, sb, o, b, 1)))
    for op, args in cases:
        run_opcheck(op, args)


def test_errors_match_cpu():
    """The C++ checks raise the CPU contract's first line (a few rows; docs/MISUSE.md holds the rest)."""
    a, w, sa, sb, b = problem(8, 128, 256, 4, torch.int8)
    o = torch.tensor([2, 4, 6, 8], dtype=torch.int32, device="cuda")
    for args in ((a, w.transpose(1, 2), sa, sb, o.long(), torch.bfloat16, b),
                 (a, w, sa, sb, o, torch.bfloat16, b),
                 (a, w.transpose(1, 2), sa, sb[:, :64], o, torch.bfloat16, b)):
        with pytest.raises((TypeError, ValueError)) as cuda_err:
            OPS.grouped_scaled_mm(*args)
        cpu_args = [x.cpu() if isinstance(x, torch.Tensor) else x for x in args]
        with pytest.raises(type(cuda_err.value)) as cpu_err:
            OPS.grouped_scaled_mm(*cpu_args)
        assert str(cuda_err.value).split("\n")[0] == str(cpu_err.value).split("\n")[0]
