"""The decode-size grouped GEMM behind grouped_scaled_mm at T <= grouped_decode_max_rows() (issue 27;
csrc/gemm/decode/grouped_decode.cu, README.md "Grouped decode GEMM").

grouped_scaled_mm(a [T, K], b [E, K, N], scale_a, scale_b, offsets [E], out_dtype, bias [E, N]): expert e owns rows
[offsets[e - 1], offsets[e]) of a, and D[t] = epilogue(a[t] @ b[e]) with scaled_mm's epilogue (csrc/gemm/EPILOGUES.md).

- Against the float64 reference from the dequantized operands, one expert at a time (assert_close_to_reference:
  int8 accumulates exactly, fp8 adds fp8_accum_bound(K)): int8 / e4m3, per-token / per-tensor scale_a, per-channel
  [E, N] / per-expert [E] and [E, 1] scale_b, bias [E, N] or none, bf16 / fp16 out, T from 1 to the largest served
  (64), routings with empty experts, all rows on one expert (several 16-row chunks), the first / last expert only,
  fewer routed rows than T, K with a tail (K % 64 != 0) and E = 128 (the Qwen3-30B-A3B expert count).
- Block-scaled fp8 (scale_a [T, K/128], scale_b [E, ceil(N/128), K/128]): N not a multiple of 128, K / 128 odd.
- Bit for bit: int8 (exact sums, same epilogue) and fp8 where the dense decode GEMM does not split K equal
  scaled_mm_decode run expert by expert on the expert's rows (the kernel reuses its steps, order and epilogue).
- Outputs poisoned (NaN) first: every routed row is written; rows >= offsets[-1] are left as they were.
- An expert with no rows is never read: its weight filled with e4m3 NaN bytes, its scales and bias NaN, changes
  nothing, bit for bit.
- Bad offsets (decreasing, negative, past T) are clamped on the device, c[e] = min(T, max(c[e - 1], offsets[e])),
  without a fault; CUDA-graph replay across changing routings equals eager bitwise (no host sync); the profiler
  sees the decode kernel at T <= 64 and not above.
"""

import re
from pathlib import Path

import pytest
import torch

import cutlass_w8a8 as cw
from cutlass_w8a8.testing.references import (Reference, assert_close_to_reference, fp8_accum_bound, rand_operand,
                                             rand_scale, reference, scale_magnitudes)

OPS = torch.ops.cutlass_w8a8
FP8 = torch.float8_e4m3fn
G = 128
DTYPES = [torch.int8, pytest.param(FP8, id="fp8")]
OUT_DTYPES = [torch.bfloat16, torch.float16]
# grouped_decode.cu's kGroupedDecodeMaxRows (test_max_rows_matches_source pins it).
MAX_ROWS = 64


def gpu(test):
    """The markers of every GPU test here (conftest.py skips them without CUDA or off sm90: grouped_scaled_mm runs
    on sm90 only)."""
    return pytest.mark.cuda(pytest.mark.sm90(test))


SOURCE = Path(__file__).resolve().parents[2] / "csrc" / "gemm" / "decode" / "grouped_decode.cu"


def test_max_rows_matches_source():
    text = SOURCE.read_text()
    found = re.search(r"constexpr int64_t kGroupedDecodeMaxRows = (\d+);", text)
    assert found is not None, "kGroupedDecodeMaxRows not found in grouped_decode.cu"
    assert int(found.group(1)) == MAX_ROWS


def grouped(a, b, scale_a, scale_b, offsets, out_dtype, bias=None, out=None):
    """grouped_scaled_mm through its public wrapper (the spec's signature) when it exists, else the registered op."""
    fn = getattr(cw, "grouped_scaled_mm", None)
    if fn is not None:
        return fn(a, b, scale_a, scale_b, offsets, out_dtype, bias=bias, out=out)
    if out is not None and hasattr(OPS, "grouped_scaled_mm_out"):
        OPS.grouped_scaled_mm_out(out, a, b, scale_a, scale_b, offsets, bias)
        return out
    if out is not None:
        return OPS.grouped_scaled_mm(a, b, scale_a, scale_b, offsets, out_dtype, bias=bias, out=out)
    return OPS.grouped_scaled_mm(a, b, scale_a, scale_b, offsets, out_dtype, bias=bias)


def poisoned_run(a, w, sa, sb, offsets, out_dtype, bias=None):
    """grouped_scaled_mm into a NaN-filled [T, N] output, with b = w.transpose(1, 2) ([E, K, N] view of [E, N, K])."""
    out = torch.full((a.shape[0], w.shape[1]), float("nan"), dtype=out_dtype, device="cuda")
    res = grouped(a, w.transpose(1, 2), sa, sb, offsets, out_dtype, bias=bias, out=out)
    assert res.data_ptr() == out.data_ptr()
    return out


# ---- routings ---------------------------------------------------------------------------------------------------


def routing_counts(t, e, kind, g):
    """Rows per expert (a CPU int64 [E] summing to at most t) for a routing `kind`."""
    counts = torch.zeros(e, dtype=torch.int64)
    if kind == "random":  # a random subset of experts active, the others empty
        active = torch.randperm(e, generator=g)[: int(torch.randint(1, min(e, t) + 1, (1,), generator=g))]
        rows = active[torch.randint(0, len(active), (t,), generator=g)]
        counts += torch.bincount(rows, minlength=e)
    elif kind == "spread":  # one row per expert where possible (decode at many experts)
        for i in range(t):
            counts[(i * 7) % e] += 1
    elif kind == "one":  # every row on one middle expert
        counts[e // 2] = t
    elif kind == "first":
        counts[0] = t
    elif kind == "last":
        counts[e - 1] = t
    elif kind == "partial":  # fewer routed rows than T: rows >= offsets[-1] belong to nobody
        routed = max(t - 3, 0)
        if routed:
            rows = torch.randint(0, e, (routed,), generator=g)
            counts += torch.bincount(rows, minlength=e)
    else:
        raise AssertionError(kind)
    return counts


def offsets_of(counts):
    return torch.cumsum(counts, 0).to(torch.int32).cuda()


def expert_rows(offsets):
    """[(e, start, end)] for the valid offsets (a CPU list)."""
    ends = offsets.cpu().tolist()
    out, start = [], 0
    for e, end in enumerate(ends):
        out.append((e, start, end))
        start = end
    return out


# ---- problems and references ------------------------------------------------------------------------------------


def stitched(ds, mags, terms, n, k):
    """The experts' references stacked in row order ([0, N] when no row is routed)."""
    if not ds:
        empty = torch.zeros(0, n, dtype=torch.float64, device="cuda")
        return Reference(empty, empty, empty, k)
    return Reference(torch.cat(ds), torch.cat(mags), torch.cat(terms), k)


def rowwise_problem(t, e, n, k, dtype, per_token, scale_b_kind, bias, out_dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = rand_operand((t, k), dtype, "cuda", g)
    w = rand_operand((e, n, k), dtype, "cuda", g)  # contiguous [E, N, K]: b = w.transpose(1, 2)
    ma, mb = scale_magnitudes(dtype, k)
    sa = rand_scale((t, 1) if per_token else (1,), "cuda", ma, g)
    sb_shape = {"channel": (e, n), "expert": (e,), "expert2d": (e, 1)}[scale_b_kind]
    sb = rand_scale(sb_shape, "cuda", mb, g)
    b = (torch.randn(e, n, device="cuda", generator=g) * 4).to(out_dtype) if bias else None
    return a, w, sa, sb, b


def rowwise_reference(a, w, sa, sb, offsets, bias):
    """The float64 reference of the routed rows [0, offsets[-1]), one expert at a time."""
    per_token = sa.numel() > 1
    ds, mags, terms = [], [], []
    for e, s, t_end in expert_rows(offsets):
        if t_end == s:
            continue
        sa_e = sa[s:t_end] if per_token else sa
        sb_e = sb[e].reshape(-1)
        ref = reference(a[s:t_end], w[e].t(), sa_e, sb_e, None if bias is None else bias[e])
        ds.append(ref.d), mags.append(ref.mag), terms.append(ref.abs_terms)
    return stitched(ds, mags, terms, w.shape[1], a.shape[1])


def block_problem(t, e, n, k, bias, out_dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = rand_operand((t, k), FP8, "cuda", g)
    w = rand_operand((e, n, k), FP8, "cuda", g)
    ma, mb = scale_magnitudes(FP8, k)
    sa = rand_scale((t, k // G), "cuda", ma, g)
    sb = rand_scale((e, (n + G - 1) // G, k // G), "cuda", mb, g)
    b = (torch.randn(e, n, device="cuda", generator=g) * 4).to(out_dtype) if bias else None
    return a, w, sa, sb, b


def block_reference(a, w, sa, sb, offsets, bias):
    """sum_kb sa[t, kb] * sb[e, n // 128, kb] * (a . w over group kb) + bias[e] in float64, expert by expert."""
    n, k = w.shape[1], w.shape[2]
    ds, mags, terms = [], [], []
    for e, s, t_end in expert_rows(offsets):
        if t_end == s:
            continue
        a_deq = a[s:t_end].double() * sa[s:t_end].double().repeat_interleave(G, 1)
        w_deq = w[e].double() * sb[e].double().repeat_interleave(G, 0)[:n].repeat_interleave(G, 1)
        d = a_deq @ w_deq.t()
        mag = d.abs()
        if bias is not None:
            d = d + bias[e].double()
            mag = mag + bias[e].double().abs()
        ds.append(d), mags.append(mag), terms.append(a_deq.abs() @ w_deq.abs().t())
    return stitched(ds, mags, terms, n, k)


def check_routed(out, ref, offsets, out_dtype, fp8, what):
    """Routed rows against the reference; unrouted rows still NaN (not written)."""
    routed = int(offsets[-1])
    if routed:
        rel = fp8_accum_bound(ref.k) if fp8 else 0.0
        assert_close_to_reference(out[:routed], ref, out_dtype, accum_rel=rel, what=what)
    assert torch.isnan(out[routed:].float()).all(), f"{what}: rows >= offsets[-1] were written"


# ---- against the float64 reference --------------------------------------------------------------------------


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1, 2, 5, 8, 9, 16, 17, 40, 64])
@pytest.mark.parametrize("kind", ["random", "spread", "one", "first", "last", "partial"])
@pytest.mark.parametrize("case", range(3))
def test_rowwise(dtype, t, kind, case):
    """Routings x T x (per-token / per-tensor scale_a, [E, N] / [E] / [E, 1] scale_b, bias, out dtype), rotated by
    `case`; E = 8 with N = 48, K = 272 (K % 64 = 16: the tail) and E = 128 with N = 64, K = 512."""
    e, n, k = [(8, 48, 272), (128, 64, 512), (8, 1040, 4112)][case]
    per_token = (t + case) % 2 == 0
    scale_b_kind = ["channel", "expert", "expert2d"][(t + case) % 3]
    bias = (t + case) % 4 < 2
    out_dtype = OUT_DTYPES[case % 2]
    seed = 1000 * t + 10 * case + ["random", "spread", "one", "first", "last", "partial"].index(kind)
    g = torch.Generator().manual_seed(seed)
    offsets = offsets_of(routing_counts(t, e, kind, g))
    a, w, sa, sb, b = rowwise_problem(t, e, n, k, dtype, per_token, scale_b_kind, bias, out_dtype, seed)
    out = poisoned_run(a, w, sa, sb, offsets, out_dtype, b)
    what = (f"T={t} E={e} N={n} K={k} {dtype} {kind} per_token={per_token} scale_b={scale_b_kind} bias={bias} "
            f"{out_dtype}")
    check_routed(out, rowwise_reference(a, w, sa, sb, offsets, b), offsets, out_dtype, dtype == FP8, what)



@gpu
@pytest.mark.parametrize("t", [1, 3, 8, 12, 16, 33, 64])
@pytest.mark.parametrize("kind", ["random", "one", "partial"])
@pytest.mark.parametrize("nk", [(208, 384), (256, 1024)], ids=["N%128!=0,K/128 odd", "N=256,K=1024"])
@pytest.mark.parametrize("bias", [False, True])
def test_block(t, kind, nk, bias):
    """Block-scaled fp8: scale_a [T, K/128], scale_b [E, ceil(N/128), K/128]; a partial last weight block of N and
    an odd number of K groups (a 256-byte K block half past K)."""
    n, k = nk
    e = 16
    out_dtype = OUT_DTYPES[t % 2]
    seed = 7 * t + n + k + bias
    g = torch.Generator().manual_seed(seed)
    offsets = offsets_of(routing_counts(t, e, kind, g))
    a, w, sa, sb, b = block_problem(t, e, n, k, bias, out_dtype, seed)
    out = poisoned_run(a, w, sa, sb, offsets, out_dtype, b)
    check_routed(out, block_reference(a, w, sa, sb, offsets, b), offsets, out_dtype, True,
                 f"block T={t} E={e} N={n} K={k} {kind} bias={bias} {out_dtype}")



# ---- bit for bit with the dense decode GEMM -----------------------------------------------------------------


def dense_splits_k(n, k):
    """Whether scaled_mm_decode.cu's choose_splits splits K for this shape on this device."""
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return n // 16 < sms and (k + 255) // 256 // 8 >= 2


def dense_per_expert(a, w, sa, sb, offsets, out_dtype, bias, block):
    """scaled_mm_decode on each expert's rows (in chunks of at most 16 rows), into a NaN-filled [T, N]."""
    out = torch.full((a.shape[0], w.shape[1]), float("nan"), dtype=out_dtype, device="cuda")
    for e, s, t_end in expert_rows(offsets):
        for r in range(s, t_end, 16):
            r1 = min(r + 16, t_end)
            if block:
                sa_c, sb_e = sa[r:r1], sb[e]
            else:
                sa_c = sa[r:r1] if sa.numel() > 1 else sa
                sb_e = sb[e].reshape(-1)
            out[r:r1] = cw.scaled_mm_decode(a[r:r1].contiguous(), w[e].t(), sa_c, sb_e, out_dtype,
                                            None if bias is None else bias[e])
    return out


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1, 7, 16, 30, 64])
@pytest.mark.parametrize("kind", ["random", "one"])
def test_equals_dense_decode(dtype, t, kind):
    """int8 (exact sums) always, fp8 with N = 2304 (144 row tiles: the dense kernel does not split K): the grouped
    kernel runs the dense decode kernel's steps, order and epilogue, so expert by expert the results are equal."""
    e, n, k = 8, 2304, 1040
    if dtype == FP8 and dense_splits_k(n, k):
        pytest.skip("the dense decode GEMM splits K on this device (fp8 partials summed in another order)")
    seed = 31 * t + (kind == "one")
    g = torch.Generator().manual_seed(seed)
    offsets = offsets_of(routing_counts(t, e, kind, g))
    a, w, sa, sb, b = rowwise_problem(t, e, n, k, dtype, True, "channel", True, torch.bfloat16, seed)
    out = poisoned_run(a, w, sa, sb, offsets, torch.bfloat16, b)
    dense = dense_per_expert(a, w, sa, sb, offsets, torch.bfloat16, b, block=False)
    routed = int(offsets[-1])
    assert torch.equal(out[:routed], dense[:routed])



@gpu
@pytest.mark.parametrize("t", [4, 16, 48])
def test_block_equals_dense_decode(t):
    e, n, k = 4, 2304, 1152
    if dense_splits_k(n, k):
        pytest.skip("the dense decode GEMM splits K on this device (partials summed in another order)")
    g = torch.Generator().manual_seed(t)
    offsets = offsets_of(routing_counts(t, e, "random", g))
    a, w, sa, sb, b = block_problem(t, e, n, k, True, torch.float16, t)
    out = poisoned_run(a, w, sa, sb, offsets, torch.float16, b)
    dense = dense_per_expert(a, w, sa, sb, offsets, torch.float16, b, block=True)
    routed = int(offsets[-1])
    assert torch.equal(out[:routed], dense[:routed])



# ---- inactive experts are not read ----------------------------------------------------------------------------


@gpu
@pytest.mark.parametrize("mode", ["int8", "fp8", "block"])
@pytest.mark.parametrize("t", [1, 6, 16, 64])
def test_inactive_experts_not_read(mode, t):
    """Poison everything of the experts without rows (e4m3 weights: the NaN byte 0x7f; int8: extreme bytes; their
    scale_b and bias: NaN): the result is bit for bit the unpoisoned one, so those weights are never used."""
    e, n, k = 32, 96, 512
    g = torch.Generator().manual_seed(100 + t)
    active = torch.randperm(e, generator=g)[: min(t, e // 2)]  # at most half the experts have rows
    counts = torch.bincount(active[torch.randint(0, len(active), (t,), generator=g)], minlength=e)
    offsets = offsets_of(counts)
    if mode == "block":
        a, w, sa, sb, b = block_problem(t, e, n, k, True, torch.bfloat16, 100 + t)
    else:
        dtype = torch.int8 if mode == "int8" else FP8
        a, w, sa, sb, b = rowwise_problem(t, e, n, k, dtype, True, "channel", True, torch.bfloat16, 100 + t)
    clean = poisoned_run(a, w, sa, sb, offsets, torch.bfloat16, b)
    idle = (counts == 0).nonzero().flatten().cuda()
    assert idle.numel() > 0
    w2, sb2, b2 = w.clone(), sb.clone(), b.clone()
    poison = 0x7F if mode != "int8" else 0x80  # e4m3fn NaN / int8 -128
    w2.view(torch.uint8)[idle] = poison
    sb2[idle] = float("nan")
    b2[idle] = float("nan")
    dirty = poisoned_run(a, w2, sa, sb2, offsets, torch.bfloat16, b2)
    routed = int(offsets[-1])
    assert not torch.isnan(clean[:routed].float()).any()
    assert torch.equal(clean[:routed], dirty[:routed])



# ---- layouts, bad offsets, graphs, dispatch ---------------------------------------------------------------------


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_padded_activation_rows(dtype):
    """a as the K window of a wider buffer (stride(0) = K + 64 > K): rows read through lda."""
    t, e, n, k = 13, 8, 80, 784
    seed = 5
    g = torch.Generator().manual_seed(seed)
    offsets = offsets_of(routing_counts(t, e, "random", g))
    a, w, sa, sb, b = rowwise_problem(t, e, n, k, dtype, True, "expert", False, torch.float16, seed)
    wide = torch.zeros(t, k + 64, dtype=torch.int8, device="cuda").view(dtype)
    wide[:, :k] = a
    wide.view(torch.uint8)[:, k:] = 0x7F  # NaN bytes for e4m3 past K: must not be read
    a_view = wide[:, :k]
    assert a_view.stride(0) == k + 64
    out = poisoned_run(a_view, w, sa, sb, offsets, torch.float16, b)
    ref = poisoned_run(a, w, sa, sb, offsets, torch.float16, b)
    routed = int(offsets[-1])
    assert torch.equal(out[:routed], ref[:routed])
    check_routed(out, rowwise_reference(a, w, sa, sb, offsets, b), offsets, torch.float16, dtype == FP8,
                 f"padded a {dtype}")



def clamped(offsets_list, t):
    """kernel_api.h's device clamp: c[-1] = 0, c[e] = min(T, max(c[e - 1], offsets[e]))."""
    c, prev = [], 0
    for o in offsets_list:
        prev = min(t, max(prev, o))
        c.append(prev)
    return c


@gpu
@pytest.mark.parametrize("bad", [[3, 1, 5, 9], [-4, 2, 2, 100], [7, 7, 7, 7], [0, -1, 12, 3], [20, 30, 40, 50]])
def test_bad_offsets_clamped(bad):
    """Offsets the CPU reference refuses: on CUDA no fault, and each expert gets the rows of the clamped sequence."""
    t, e, n, k = 12, 4, 32, 256
    a, w, sa, sb, b = rowwise_problem(t, e, n, k, torch.int8, True, "channel", True, torch.bfloat16, 9)
    offsets = torch.tensor(bad, dtype=torch.int32, device="cuda")
    out = poisoned_run(a, w, sa, sb, offsets, torch.bfloat16, b)
    torch.cuda.synchronize()
    good = torch.tensor(clamped(bad, t), dtype=torch.int32, device="cuda")
    check_routed(out, rowwise_reference(a, w, sa, sb, good, b), good, torch.bfloat16, False, f"offsets {bad}")



@gpu
@pytest.mark.parametrize("mode", ["int8", "fp8", "block"])
def test_graph_replay_across_routings(mode):
    """One capture, replayed with new routings and activations written into its input buffers: bitwise equal to
    eager each time (the kernel reads the offsets on the device; nothing depends on them on the host)."""
    t, e, n, k = 16, 16, 64, 512
    if mode == "block":
        a, w, sa, sb, b = block_problem(t, e, n, k, True, torch.bfloat16, 3)
    else:
        a, w, sa, sb, b = rowwise_problem(t, e, n, k, torch.int8 if mode == "int8" else FP8, True, "channel", True,
                                          torch.bfloat16, 3)
    g = torch.Generator().manual_seed(3)
    routings = [routing_counts(t, e, kind, g) for kind in ("random", "one", "partial", "spread", "last", "random")]
    offsets = offsets_of(routings[0])
    out = torch.full((t, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    bt = w.transpose(1, 2)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream
        grouped(a, bt, sa, sb, offsets, torch.bfloat16, bias=b, out=out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grouped(a, bt, sa, sb, offsets, torch.bfloat16, bias=b, out=out)
    gen = torch.Generator(device="cuda").manual_seed(4)
    for i, counts in enumerate(routings):
        offsets.copy_(offsets_of(counts))
        a.copy_(rand_operand(a.shape, a.dtype, "cuda", gen))
        out.fill_(float("nan"))
        graph.replay()
        eager = poisoned_run(a, w, sa, sb, offsets, torch.bfloat16, b)
        torch.cuda.synchronize()
        routed = int(offsets[-1])
        assert torch.equal(out[:routed], eager[:routed]), f"routing {i}"
        assert torch.isnan(out[routed:].float()).all(), f"routing {i}: unrouted rows written"



def kernel_names(fn):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [evt.name for evt in prof.events() if evt.device_type == torch.autograd.DeviceType.CUDA]


@gpu
@pytest.mark.parametrize("t", [1, 16, MAX_ROWS, MAX_ROWS + 1])
def test_dispatch_uses_decode_kernel(t):
    """grouped_scaled_mm sends T <= grouped_decode_max_rows() (64) to this kernel and larger T elsewhere."""
    if hasattr(OPS, "_grouped_decode_max_rows"):
        assert OPS._grouped_decode_max_rows() == MAX_ROWS
    e, n, k = 8, 64, 256
    a, w, sa, sb, b = rowwise_problem(t, e, n, k, FP8, True, "channel", False, torch.bfloat16, 11)
    offsets = offsets_of(routing_counts(t, e, "random", torch.Generator().manual_seed(11)))
    poisoned_run(a, w, sa, sb, offsets, torch.bfloat16)  # warm-up (lazy library loading)
    names = kernel_names(lambda: poisoned_run(a, w, sa, sb, offsets, torch.bfloat16))
    if not names:
        pytest.skip("the profiler recorded no CUDA kernels here (no CUPTI)")
    used = any("grouped_decode_kernel" in name for name in names)
    assert used == (t <= MAX_ROWS), names

