"""The decode GEMM with block scales (csrc/gemm/decode, kBlockScaled) and w8a8_linear's block path on the GPU.

Block-scaled fp8: a (M, K) e4m3 with scale_a (M, K/128) (1x128 groups), the (N, K) e4m3 weight with scale_b
(ceil(N/128), K/128) (128x128 blocks), D = sum_kb scale_a[m, kb] * scale_b[n // 128, kb] * (a . w over group kb)
+ bias. The kernel scales each group's float32 partial dot products into the accumulator, so the error against
the float64 reference of the dequantized operands is the float32 accumulation's (bounded as the row-wise fp8
tests bound it, fp8_accum_bound(K)) plus the final rounding; a wrong scale index is an error of order one.

- every M in 1..16 (one and two token tiles) against float64: N multiples of 16 that are and are not multiples
  of 128 (a partial last weight block), K multiples of 128 with an odd number of groups (a 256-byte K block
  half past K), shapes that split K (small N: partials pre-scaled, the reduce kernel adds only the bias), bias or
  not, both output dtypes; outputs poisoned (NaN) first;
- padded a rows, a K window of a wider weight, a row block of a bigger weight with its scale_b rows, a padded
  out window;
- capture and replay equal eager bitwise; UpdatableGraph.set_rows on the decode nodes;
- on sm90: scaled_mm at M <= decode_gemm_max_m() runs this kernel (bitwise equal), and w8a8_linear with block
  weight scales equals quantize_per_token_group followed by scaled_mm bitwise;
- linear_decode refuses block scales naming `scale_b`.
"""

import pytest
import torch

import cutlass_w8a8 as cw
from cutlass_w8a8.testing.references import (Reference, assert_close_to_reference, fp8_accum_bound, rand_operand,
                                             rand_scale, scale_magnitudes)

pytestmark = pytest.mark.cuda

FP8 = torch.float8_e4m3fn
G = 128
OUT_DTYPES = [torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def _needs_fp8():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 mma needs compute capability 8.9 or newer")


def block_problem(m, n, k, seed, bias=False, out_dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = rand_operand((m, k), FP8, "cuda", g)
    w = rand_operand((n, k), FP8, "cuda", g)
    ma, mb = scale_magnitudes(FP8, k)
    sa = rand_scale((m, k // G), "cuda", ma, g)
    sb = rand_scale(((n + G - 1) // G, k // G), "cuda", mb, g)
    b = (torch.randn(n, device="cuda", generator=g) * 4).to(out_dtype) if bias else None
    return a, w, sa, sb, b


def block_reference(a, w, sa, sb, bias=None) -> Reference:
    """D = (a * scale_a per group) @ (w * scale_b per block)^T + bias in float64, from the dequantized operands."""
    n, k = w.shape
    a_deq = a.double() * sa.double().repeat_interleave(G, 1)
    w_deq = w.double() * sb.double().repeat_interleave(G, 0)[:n].repeat_interleave(G, 1)
    d = a_deq @ w_deq.t()
    mag = d.abs()
    if bias is not None:
        d = d + bias.double()
        mag = mag + bias.double().abs()
    return Reference(d, mag, a_deq.abs() @ w_deq.abs().t(), k)


def decode(a, w, sa, sb, b, out_dtype, out=None):
    if out is None:
        out = torch.empty(a.shape[0], w.shape[0], dtype=out_dtype, device="cuda")
    out.fill_(float("nan"))
    return cw.scaled_mm_decode(a, w.t(), sa, sb, out_dtype, b, out=out)


def check(out, a, w, sa, sb, b, out_dtype, what):
    ref = block_reference(a, w, sa, sb, b)
    assert_close_to_reference(out, ref, out_dtype, accum_rel=fp8_accum_bound(a.shape[1]), what=what)


def splits_k(n, k):
    """Whether csrc/gemm/decode/scaled_mm_decode.cu's choose_splits splits K for this shape on this device."""
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return n // 16 < sms and (k + 255) // 256 // 8 >= 2


# ---- against the float64 reference --------------------------------------------------------------------------


@pytest.mark.parametrize("nk", [(2176, 4224), (144, 4224), (272, 1152), (48, 128)],
                         ids=["tiles>=SMs", "split-K", "few-tiles", "one-group"])
@pytest.mark.parametrize("m", range(1, 17))
def test_every_m(m, nk):
    """K / 128 = 33 (odd: the last 256-byte block is half past K) and 9, 1; N = 2176 (17 blocks of 128), 144 and
    48 (a partial last block), 272; the split along K at N = 144 (9 row tiles)."""
    n, k = nk
    if nk == (144, 4224):
        assert splits_k(n, k), "the split-K case must split"
    for bias in (False, True):
        for out_dtype in OUT_DTYPES:
            args = block_problem(m, n, k, seed=1000 * m + 10 * n + bias + (out_dtype == torch.float16), bias=bias,
                                 out_dtype=out_dtype)
            out = decode(*args, out_dtype)
            check(out, *args, out_dtype, f"M={m} N={n} K={k} bias={bias} {out_dtype}")


@pytest.mark.parametrize("nk", [(7168, 2048), (2112, 7168), (24576, 1536), (4096, 14336), (16, 8192)],
                         ids=lambda nk: f"{nk[0]}x{nk[1]}")
@pytest.mark.parametrize("m", [1, 4, 8, 9, 16])
def test_model_shapes(m, nk):
    """DeepSeek-V3-like and Qwen3 / Llama shapes, and one 16-row weight split over many CTAs along K."""
    n, k = nk
    args = block_problem(m, n, k, seed=n + k + m, bias=True)
    out = decode(*args, torch.bfloat16)
    check(out, *args, torch.bfloat16, f"M={m} N={n} K={k}")


def test_scales_matter():
    """Doubling one group's activation scale or one weight block's scale changes exactly the outputs it should."""
    m, n, k = 5, 384, 512
    a, w, sa, sb, _ = block_problem(m, n, k, seed=3)
    base = decode(a, w, sa, sb, None, torch.bfloat16).float()
    sa2 = sa.clone()
    sa2[2, 1] *= 2
    out = decode(a, w, sa2, sb, None, torch.bfloat16).float()
    changed = (out != base).any(dim=1)
    assert changed[2] and not changed[[0, 1, 3, 4]].any(), changed
    sb2 = sb.clone()
    sb2[1, 3] *= 2
    out = decode(a, w, sa, sb2, None, torch.bfloat16).float()
    changed = (out != base).any(dim=0)
    assert changed[128:256].all() and not changed[:128].any() and not changed[256:].any()


# ---- layouts ------------------------------------------------------------------------------------------------


def test_padded_rows_weight_windows_and_padded_out():
    m, n, k = 11, 1040, 4224
    g = torch.Generator(device="cuda").manual_seed(7)
    a = rand_operand((m, k + 48), FP8, "cuda", g)[:, 16:16 + k]
    w_window = rand_operand((n, k + 64), FP8, "cuda", g)[:, 32:32 + k]
    ma, mb = scale_magnitudes(FP8, k)
    sa = rand_scale((m, k // G), "cuda", ma, g)
    sb = rand_scale(((n + G - 1) // G, k // G), "cuda", mb, g)
    # rows [256, 256 + n) of a bigger weight: its scale_b rows [2, 2 + ceil(n / 128)) of the bigger scale_b
    w_big = rand_operand((3 * 512, k), FP8, "cuda", g)
    sb_big = rand_scale((3 * 512 // G, k // G), "cuda", mb, g)
    w_rows, sb_rows = w_big[256:256 + n], sb_big[2:2 + (n + G - 1) // G]
    bias = torch.randn(n, device="cuda", generator=g).to(torch.bfloat16)
    for w, s, what in ((w_window, sb, "K window"), (w_rows, sb_rows, "row block")):
        assert s.is_contiguous()
        out_buf = torch.full((m, n + 24), 7.0, dtype=torch.bfloat16, device="cuda")
        out = out_buf[:, 8:8 + n]
        decode(a, w, sa, s, bias, torch.bfloat16, out=out)
        check(out, a, w, sa, s, bias, torch.bfloat16, what)
        assert (out_buf[:, :8] == 7).all() and (out_buf[:, 8 + n:] == 7).all()


def test_single_row_any_stride():
    k, n = 4096, 512
    g = torch.Generator(device="cuda").manual_seed(8)
    a = rand_operand((6, k + 16), FP8, "cuda", g)[2:3, :k]
    w = rand_operand((n, k), FP8, "cuda", g)
    ma, mb = scale_magnitudes(FP8, k)
    sa, sb = rand_scale((1, k // G), "cuda", ma, g), rand_scale((n // G, k // G), "cuda", mb, g)
    out = decode(a, w, sa, sb, None, torch.bfloat16)
    check(out, a, w, sa, sb, None, torch.bfloat16, "one-row slice")


# ---- graphs -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("nk", [(4096, 4096), (272, 4224)], ids=["4096x4096", "split-K"])
@torch.no_grad()
def test_graph_capture_and_replay_equal_eager(nk):
    n, k, m = nk[0], nk[1], 12
    g = torch.Generator(device="cuda").manual_seed(11)
    w = rand_operand((n, k), FP8, "cuda", g)
    _, mb = scale_magnitudes(FP8, k)
    sb = rand_scale(((n + G - 1) // G, k // G), "cuda", mb, g)
    bias = torch.randn(n, device="cuda", generator=g).to(torch.bfloat16)

    def fn(a, sa):
        return cw.scaled_mm_decode(a, w.t(), sa, sb, torch.bfloat16, bias)

    def inputs(seed):
        a, _, sa, _, _ = block_problem(m, 16, k, seed=seed)
        return a, sa

    graph = cw.graphs.CapturedGraph(fn, list(inputs(0)))
    for i in range(1, 4):
        a, sa = inputs(i)
        torch.cuda.set_sync_debug_mode("error")
        try:
            y = graph(a, sa)
            e = fn(a, sa)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(y, e), f"replay {i}"


@pytest.mark.parametrize("nk", [(4096, 4096), (272, 4224)], ids=["4096x4096", "split-K"])
@torch.no_grad()
def test_updatable_graph_set_rows(nk):
    n, k = nk
    g = torch.Generator(device="cuda").manual_seed(12)
    w = rand_operand((n, k), FP8, "cuda", g)
    _, mb = scale_magnitudes(FP8, k)
    sb = rand_scale(((n + G - 1) // G, k // G), "cuda", mb, g)

    def fn(a, sa):
        return cw.scaled_mm_decode(a, w.t(), sa, sb)

    a16, _, sa16, _, _ = block_problem(16, 16, k, seed=0)
    graph = cw.graphs.UpdatableGraph(fn, [a16, sa16])
    assert {node.op for node in graph.nodes} == {"scaled_mm_decode"}, graph.nodes
    assert len(graph.nodes) == (2 if splits_k(n, k) else 1), graph.nodes
    for i, m in enumerate([16, 1, 5, 8, 9, 3, 16]):
        graph.set_rows(m)
        a, _, sa, _, _ = block_problem(16, 16, k, seed=100 + i)
        y = graph(a, sa)
        assert torch.equal(y[:m], fn(a[:m], sa[:m])), f"M={m}"


# ---- through scaled_mm and w8a8_linear (sm90: the block GEMMs and the decode dispatch) --------------------------


@pytest.mark.sm90
@pytest.mark.parametrize("nk", [(2112, 7168), (272, 4224), (384, 1024)], ids=lambda nk: f"{nk[0]}x{nk[1]}")
def test_scaled_mm_dispatches_decode_sizes_here(nk):
    """At M <= decode_gemm_max_m() scaled_mm with block scales runs this kernel: bitwise the same output."""
    n, k = nk
    for m in range(1, cw._ext.decode_gemm_max_m() + 1):
        a, w, sa, sb, b = block_problem(m, n, k, seed=m + n, bias=m % 2 == 0)
        assert torch.equal(cw.scaled_mm(a, w.t(), sa, sb, torch.bfloat16, b), decode(a, w, sa, sb, b, torch.bfloat16)), m


@pytest.mark.sm90
@pytest.mark.parametrize("xdtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("nk", [(2112, 7168), (208, 256), (4096, 4096)], ids=lambda nk: f"{nk[0]}x{nk[1]}")
def test_w8a8_linear_block_equals_group_quantize_then_scaled_mm(nk, xdtype):
    """The op's two kernels (quantize_per_token_group into its temporary, the block GEMM) against the same chain
    of public ops, bit for bit, at decode sizes (the decode GEMM) and above (the CUTLASS blockwise kernels)."""
    n, k = nk
    g = torch.Generator(device="cuda").manual_seed(n + k)
    w = rand_operand((n, k), FP8, "cuda", g)
    ws = rand_scale(((n + G - 1) // G, k // G), "cuda", 1e-2, g)
    out_dtype = torch.float16 if xdtype == torch.float16 else torch.bfloat16
    for m in (1, 3, 8, 9, 64, 300):
        x = (torch.randn(m, k, device="cuda", generator=g) * 2).to(xdtype)
        x[m // 2, :G] = 0  # a group of zeros
        bias = torch.randn(n, device="cuda", generator=g).to(out_dtype) if m % 2 else None
        y = torch.ops.cutlass_w8a8.w8a8_linear(x, w, ws, None, bias, out_dtype)
        q, s = cw.quantize_per_token_group(x, G, FP8)
        chain = cw.scaled_mm(q, w.t(), s, ws, out_dtype, bias)
        assert torch.equal(y, chain), f"M={m} N={n} K={k} {xdtype}"
        x3 = x.reshape(1, m, k)  # [..., K] input
        assert torch.equal(torch.ops.cutlass_w8a8.w8a8_linear(x3, w, ws, None, bias, out_dtype), y.reshape(1, m, n))


# ---- refusals ------------------------------------------------------------------------------------------------


def test_linear_decode_refuses_block_scales():
    """linear_decode quantizes per token inside its kernel: a (ceil(N/128), K/128) scale_b is refused by its
    scale_b check (w8a8_linear with block scales quantizes per group and runs scaled_mm instead)."""
    n, k = 256, 512
    x = torch.randn(4, k, device="cuda").to(torch.bfloat16)
    w = rand_operand((n, k), FP8, "cuda")
    sb = torch.ones(n // G, k // G, device="cuda")
    with pytest.raises(ValueError, match=r"^linear_decode: `scale_b` must be \[1\] \(per-tensor\)"):
        torch.ops.cutlass_w8a8.linear_decode(x, w.t(), sb, None, FP8)
