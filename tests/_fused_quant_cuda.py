"""Inputs and comparisons for the CUDA tests of the fused non-GEMM kernels (test_fused_quant_cuda.py,
test_fused_quant_cuda_edges.py) and of the MoE routing kernels (tests/moe/test_moe_route_cuda.py, ...).

- `exact_norm_rows(shape, gen, eps)` -> (x, w) float64 on the CPU and `exact_silu_input(shape, dtype, gen)`:
  inputs on which no step depends on the order of a float32 sum or on the last bit of an exp or rsqrt, so the
  GPU can be compared with the CPU bit for bit; `exact_y` is the RMSNorm output they give.
- `poison_allocator(*nbytes)` fills the caching allocator's blocks of those sizes (`out_bytes` gives an op's),
  so an element a kernel fails to write shows.
- `gaussian(shape, dtype, seed)` -> (x, w, r) on the GPU; `assert_bits_equal(got, expect)` compares shape,
  dtype and raw bits, naming the first element that differs.
- `capture(step)`: a step captured in a CUDA graph after a warm-up on a side stream; `replay_and_eager(step, statics,
  inputs)`: that under sync debug mode "error", replayed on new inputs copied into the step's static tensors, each
  replay beside the eager step.

Nothing here touches the GPU at import.
"""

import math
import zlib

import torch

import cutlass_w8a8 as cw

DEV = "cuda"
OPS = torch.ops.cutlass_w8a8
QDTYPES = [torch.int8, torch.float8_e4m3fn]
XDTYPES = [torch.bfloat16, torch.float16, torch.float32]
QUANT = {torch.int8: cw.quantize_int8, torch.float8_e4m3fn: cw.quantize_fp8}
EPS = 1e-5
# (quantized dtype or None, static scale or None): the unquantized op, dynamic and static, int8 and fp8
MODES = [(None, None), (torch.int8, None), (torch.int8, 0.05), (torch.float8_e4m3fn, None),
         (torch.float8_e4m3fn, 0.05)]
MODE_IDS = ["float", "int8-dynamic", "int8-static", "fp8-dynamic", "fp8-static"]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_bits_equal(got, expect, what=""):
    got = got.cpu()
    assert got.shape == expect.shape and got.dtype == expect.dtype, (
        f"{what}: {tuple(got.shape)} {got.dtype} vs {tuple(expect.shape)} {expect.dtype}")
    diff = bits(got) != bits(expect)
    if diff.any():
        idx = tuple(diff.nonzero()[0].tolist())
        raise AssertionError(f"{what}: {int(diff.sum())} of {diff.numel()} elements differ; first at {list(idx)}: "
                             f"{got[idx].item()!r} vs {expect[idx].item()!r}")


def seed_of(*parts) -> int:
    """A seed fixed by `parts` in every process (crc32, not hash(): str hashes change with PYTHONHASHSEED, which
    gave each pytest run different inputs and made failures look like run-to-run nondeterminism)."""
    return sum((i + 1) * zlib.crc32(str(p).encode()) % 1000003 for i, p in enumerate(parts)) % (2**31)


def poison_allocator(*nbytes, byte=0xFF):
    """Leave blocks of these sizes in the caching allocator filled with `byte`: the op's next allocations of
    those sizes reuse them, so outputs start as garbage instead of (often) zeros. Best effort; with two
    different bytes, an element the kernel does not write differs from the expected value in one of them."""
    torch.cuda.empty_cache()
    blocks = [torch.full((max(int(n), 1),), byte, dtype=torch.uint8, device=DEV) for n in nbytes]
    del blocks


POISON = (0xFF, 0x7E)


def out_bytes(shape, dtype, qdtype):
    """Bytes of the outputs of an op on x of `shape`: y or q, and the scales."""
    n = math.prod(shape)
    rows = n // shape[-1] if shape[-1] else 0
    return [n * (torch.empty(0, dtype=qdtype or dtype).element_size()), rows * 4]


# ----------------------------------------------------------------------------------------------------
# exact inputs


def _four_squares(n: int, cap: int):
    """(a, b, c, d), a >= b >= c >= d >= 0, a <= cap, with a^2 + b^2 + c^2 + d^2 = n; None if there is none."""
    a = min(math.isqrt(n), cap)
    while a >= 0 and n - a * a <= 3 * a * a:
        r1 = n - a * a
        b = min(math.isqrt(r1), a)
        while b >= 0 and r1 - b * b <= 2 * b * b:
            r2 = r1 - b * b
            c = min(math.isqrt(r2), b)
            while c >= 0 and r2 - c * c <= c * c:
                d = math.isqrt(r2 - c * c)
                if d * d == r2 - c * c:
                    return a, b, c, d
                c -= 1
            b -= 1
        a -= 1
    return None


def exact_norm_rows(shape, gen, eps):
    """Random integer rows ``s`` (float64, shape `shape`) with ``sum(s^2) = K * (4**j - eps)`` exactly, j in
    {1, 2, 3} per row (where eight entries of at most 192 can make up the remainder), |s| <= 192. Then in
    float32 the sum of squares is exact in any order (< 2**24), the mean plus eps is 4**j, its rsqrt is 2**-j
    on the CPU and the GPU alike, and ``y = (s * 2**-j) * w`` is one rounding of an exact product: every
    implementation of the chain gives the same bits.
    ``eps * K`` must be an integer (eps = 1/16 with K a multiple of 16, or eps = 0)."""
    k = shape[-1]
    m = math.prod(shape[:-1])
    assert k >= 9 and float(eps * k).is_integer()
    rows = []
    while len(rows) < m:
        j = int(torch.randint(1, 4, (1,), generator=gen))
        target = int(k * (4**j - eps))
        # uniform integers in [-a, a] have E[n^2] = a (a + 1) / 3: the largest a with that <= 0.95 of the mean
        # square leaves a remainder that eight entries of at most 192 can carry (two sums of four squares)
        a = max(1, int((math.sqrt(1 + 12 * 0.95 * (4**j - eps)) - 1) / 2))
        body = torch.randint(-a, a + 1, (k - 8,), generator=gen, dtype=torch.int64)
        rest = target - int((body * body).sum())
        if rest < 0:
            continue
        halves = (_four_squares(rest // 2, 192), _four_squares(rest - rest // 2, 192))
        if None in halves:
            continue
        tail = halves[0] + halves[1]
        signs = torch.randint(0, 2, (8,), generator=gen) * 2 - 1
        row = torch.cat([body, torch.tensor(tail) * signs])
        rows.append(row[torch.randperm(k, generator=gen)])
    return torch.stack(rows).to(torch.float64).reshape(shape)


def exact_y(s, w, eps):
    """The exact y of `exact_norm_rows` rows in w's dtype: (s * 2**-j) * w, one rounding."""
    inv = 1.0 / torch.sqrt((s * s).mean(-1, keepdim=True) + eps)  # exactly 2**-j in float64
    return ((s * inv) * w.double()).to(w.dtype)


def _silu_ambiguous(gate, rel=2.0**-18):
    """Where silu(gate), exactly (float64), is within `rel` of a rounding tie of gate's dtype: there a float32
    silu a few ulps off (CPU vectorized exp vs CUDA expf) may round either way."""
    g = gate.double()
    v = g / (1 + torch.exp(-g))
    return bits((v * (1 - rel)).to(gate.dtype)) != bits((v * (1 + rel)).to(gate.dtype))


def exact_silu_input(shape, dtype, gen):
    """x = [gate | up] in bfloat16 / float16 with no silu(gate) near a rounding tie (resampled until so). The
    product of two such values is exact in float32, so the chain's bits do not depend on the exp used."""
    half = shape[-1] // 2
    gate = (torch.randn(*shape[:-1], half, generator=gen) * 3).to(dtype)
    for _ in range(50):
        amb = _silu_ambiguous(gate)
        if not amb.any():
            break
        gate[amb] = (torch.randn(int(amb.sum()), generator=gen) * 3).to(dtype)
    assert not _silu_ambiguous(gate).any()
    up = (torch.randn(*shape[:-1], half, generator=gen) * 2).to(dtype)
    return torch.cat([gate, up], dim=-1)



# ----------------------------------------------------------------------------------------------------
# any input


def gaussian(shape, dtype, seed, scale=3.0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = (torch.randn(shape, device=DEV, generator=g) * scale).to(dtype)
    w = (torch.rand(shape[-1], device=DEV, generator=g) + 0.5).to(dtype)
    r = (torch.randn(shape, device=DEV, generator=g) * scale).to(dtype)
    return x, w, r


# ----------------------------------------------------------------------------------------------------
# CUDA graphs


def capture(step, warm_up=None):
    """``warm_up()`` (default ``step``) run on a side stream (lazy loading and first allocations outside the capture),
    then ``step()`` captured in a CUDA graph on the current stream. Returns ``(graph, what step returned)``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        (warm_up or step)()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    return graph, captured


def replay_and_eager(step, statics, inputs, eager=None):
    """``step()`` (a function of the tensors in ``statics``, returning a sequence of tensors) captured in a CUDA graph
    after a warm-up call on a side stream, all under torch's sync debug mode "error" (a host synchronisation raises);
    then for each entry of ``inputs`` (one tensor per static): copied into ``statics``, the graph replayed, and
    ``eager()`` (default ``step``) run on the same statics. Returns ``[(replayed, eager)]``, one per entry: clones of
    the captured outputs after the replay, and what the eager call returned."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        graph, captured = capture(step)
        results = []
        for new in inputs:
            for dst, src in zip(statics, new, strict=True):
                dst.copy_(src)
            graph.replay()
            results.append(([c.clone() for c in captured], (eager or step)()))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return results
