"""quantize_per_token_group on the GPU (csrc/quant/quantize_group.cu) against the CPU reference: the same float32
arithmetic per 1 x 128 group (absmax / QMAX with IEEE division, q = sat(rne(x / scale))), so bit-exact.

Covers bfloat16 / float16 (a half warp per group) and float32 (a warp per group) inputs, int8 and fp8 outputs,
[..., K] inputs, padded rows (16-byte aligned: vector loads) and misaligned or odd-pitched rows (element loads),
groups of zeros, groups with one large value, K from one group to more groups than one block row of the grid
holds, empty inputs, the current stream, CUDA-graph capture (UpdatableGraph.set_rows on its row-wise node) and
the argument checks (opcheck: tests/ops/test_opcheck.py).
"""

import pytest
import torch

import cutlass_w8a8 as cw

pytestmark = pytest.mark.cuda

OPS = torch.ops.cutlass_w8a8
QDTYPES = [torch.int8, torch.float8_e4m3fn]
XDTYPES = [torch.bfloat16, torch.float16, torch.float32]


def check(x, qdtype):
    """The GPU result equals the CPU reference bit for bit (q as raw bytes, scales as float32 values)."""
    q, s = cw.quantize_per_token_group(x, 128, qdtype)
    q_ref, s_ref = cw.quantize_per_token_group(x.cpu(), 128, qdtype)
    k = x.shape[-1]
    assert q.dtype == qdtype and q.shape == x.shape and q.is_contiguous() and q.device == x.device
    assert s.dtype == torch.float32 and s.shape == (*x.shape[:-1], k // 128) and s.is_contiguous()
    bad = s.cpu().view(torch.int32) != s_ref.view(torch.int32)
    assert not bad.any(), f"{int(bad.sum())} of {s.numel()} scales differ, first at {bad.nonzero()[0].tolist()}"
    mismatch = q.cpu().view(torch.uint8) != q_ref.view(torch.uint8)
    assert not mismatch.any(), (f"{int(mismatch.sum())} of {q.numel()} quantized values differ, first at "
                                f"{mismatch.nonzero()[0].tolist()}")
    return q, s


def rand(shape, xdtype, seed, scale=3.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(shape, device="cuda", generator=g) * scale).to(xdtype)


# K: one group, a few, the DeepSeek-V3 / Llama shapes and 8200 groups (1025 or 2050 blocks along the row); M from 1
# (decode) to a few hundred.
@pytest.mark.parametrize("qdtype", QDTYPES, ids=str)
@pytest.mark.parametrize("xdtype", XDTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 128), (3, 256), (7, 4096), (16, 7168), (33, 14336), (300, 1152), (2, 3, 512),
                                   (4, 8, 1024), (1, 128 * 8200)], ids=str)
def test_bit_exact_vs_cpu(shape, xdtype, qdtype):
    x = rand(shape, xdtype, seed=sum(shape))
    rows = x.view(-1, shape[-1])
    rows[0, :128] = 0                               # a group of zeros: scale 0, q 0
    if shape[-1] >= 256:
        rows[-1, 128:256] = 0
        rows[-1, 130] = 1000.0                      # one large value in a group: everything else small
    _, s = check(x, qdtype)
    assert (s.view(-1, shape[-1] // 128)[0, 0] == 0).item()


@pytest.mark.parametrize("qdtype", QDTYPES, ids=str)
@pytest.mark.parametrize("xdtype", [torch.bfloat16, torch.float32], ids=str)
def test_padded_misaligned_and_transposed_rows(xdtype, qdtype):
    base = rand((64, 4096 + 64), xdtype, seed=5)
    check(base[:, 64:], qdtype)          # padded rows, 16-byte aligned: vector loads
    check(base[:, 3:3 + 4096], qdtype)   # misaligned start: element loads
    check(base[:1, 5:5 + 1024], qdtype)  # one misaligned row
    odd = rand((9, 1024 + 3), xdtype, seed=6)[:, :1024]  # pitch 1027: rows misaligned from the second on
    check(odd, qdtype)
    check(rand((256, 1024), xdtype, seed=7).t(), qdtype)  # (1024, 256), column stride 1024: copied to rows first


def test_saturation_and_extremes():
    """Large and tiny magnitudes: q saturates to +-QMAX at the group's absmax, subnormal-range scales stay exact."""
    x = torch.zeros(4, 512, device="cuda")
    x[0, :128] = torch.linspace(-3e38, 3e38, 128, dtype=torch.float64).float()  # finite (float32 steps overflow)
    x[1, 128:256] = torch.linspace(-1e-40, 1e-40, 128)
    x[2, 256:384] = 7.0
    x[3] = rand((512,), torch.float32, seed=7)
    for qdtype in QDTYPES:
        check(x, qdtype)
        check(x.to(torch.bfloat16), qdtype)


def test_empty_inputs():
    q, s = cw.quantize_per_token_group(torch.empty(0, 256, device="cuda", dtype=torch.bfloat16))
    assert q.shape == (0, 256) and s.shape == (0, 2) and q.dtype == torch.float8_e4m3fn
    q, s = cw.quantize_per_token_group(torch.empty(3, 0, device="cuda"), 128, torch.int8)
    assert q.shape == (3, 0) and s.shape == (3, 0)


def test_runs_on_current_stream():
    x = rand((512, 7168), torch.bfloat16, seed=8)
    expect = cw.quantize_per_token_group(x)
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        for _ in range(3):
            got = cw.quantize_per_token_group(x)
    side.synchronize()
    assert torch.equal(got[0].view(torch.uint8), expect[0].view(torch.uint8)) and torch.equal(got[1], expect[1])


@torch.no_grad()
def test_graph_capture_replay_and_set_rows():
    """Captured as a row-wise node: replays with new inputs equal eager calls without host synchronization, and
    UpdatableGraph.set_rows shrinks it to the first M rows."""
    m, k = 16, 4096
    x0 = rand((m, k), torch.bfloat16, seed=9)

    def fn(x):
        return cw.quantize_per_token_group(x)

    graph = cw.graphs.CapturedGraph(fn, [x0])
    for i in range(1, 3):
        x = rand((m, k), torch.bfloat16, seed=10 + i)
        torch.cuda.set_sync_debug_mode("error")
        try:
            q, s = graph(x)
            q_e, s_e = fn(x)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(q.view(torch.uint8), q_e.view(torch.uint8)) and torch.equal(s, s_e), f"replay {i}"
    upd = cw.graphs.UpdatableGraph(fn, [x0])
    assert {node.op for node in upd.nodes} == {"quantize_per_token_group"}, upd.nodes
    for rows in (1, 5, 16):
        upd.set_rows(rows)
        x = rand((m, k), torch.bfloat16, seed=20 + rows)
        q, s = upd(x)
        q_e, s_e = fn(x[:rows])
        assert torch.equal(q[:rows].view(torch.uint8), q_e.view(torch.uint8)), f"rows={rows}"
        assert torch.equal(s[:rows], s_e), f"rows={rows}"


def test_cpp_checks_name_the_argument():
    """Direct op calls are checked by the C++ op with the CPU implementation's messages."""
    x = rand((4, 256), torch.bfloat16, seed=11)
    with pytest.raises(TypeError, match="^quantize_per_token_group: `x` must be bfloat16, float16 or float32"):
        OPS.quantize_per_token_group(x.to(torch.int32), 128, torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="^quantize_per_token_group: `dtype` must be torch.int8 or "
                                        "torch.float8_e4m3fn, got torch.bfloat16"):
        OPS.quantize_per_token_group(x, 128, torch.bfloat16)
    with pytest.raises(ValueError, match="^quantize_per_token_group: `group_size` must be 128, got 64$"):
        OPS.quantize_per_token_group(x, 64, torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"^quantize_per_token_group: `x` K = x.shape\[1\] must be a multiple of "
                                         r"group_size = 128, got 200$"):
        OPS.quantize_per_token_group(x[:, :200], 128, torch.float8_e4m3fn)


def test_rows_longer_than_the_grid():
    """A row of 270000 float32 groups needs 67500 blocks of 4 groups, more than gridDim.y's 65535: each block
    then loops over groups y * 4 + 65535 * 4 * i."""
    x = rand((1, 128 * 270000), torch.float32, seed=12)
    check(x, torch.float8_e4m3fn)
