"""The wave mainloop's waves along N (Config's WaveN, csrc/gemm/sm90/wave_mainloop.cuh; issue 37).

A 256-column tile with WaveN 128 runs each warpgroup's 64 x 256 rows as two 64 x 128 waves through one temporary
accumulator. Per element that is the arithmetic of every other promoted fp8 kernel (4 WGMMAs of K 32 into the
temporary, one promotion per 128-deep k tile, the scales combined as CUTLASS's collective combines them), so:

- block fp8: the N-wave entries of the block table (``*_waves_n128``) equal the shipped 128x128 cooperative entry
  (Fp8Block_MLarge, CUTLASS's own blockwise mainloop) bit for bit, at M in and out of their tile (1, 100, 300),
  N a multiple of 256 and two with a partial last 256-tile (N 400: its second wave has 16 of 128 columns in range;
  N 2112: its first wave half, its second none), K one and several k tiles, bias or none, bfloat16 and float16
  out; the 128x128 entry's accuracy against float64 is tests/gemm/test_scaled_mm_block_cuda.py's;
- row-wise fp8 with promotion: the accurate N-wave entry of the fp8 table equals the shipped 128x128 promoted entry
  (Fp8_M1024_Accurate, CUTLASS's promoted mainloop) bit for bit.

Outputs are NaN-poisoned first: an element a wave leaves unwritten fails the equality.
"""

import ctypes

import pytest
import torch

import cutlass_w8a8 as cw
from test_fp8_fast_accum_cuda import rowwise_problem
from test_scaled_mm_block_cuda import block_problem

pytestmark = pytest.mark.sm90

OPS = torch.ops.cutlass_w8a8
TABLE_FP8, TABLE_BLOCK = 1, 2  # kernel_api.h cw8a8_config_table
BLOCK_REFERENCE = "128x128x128_c1x2_cooperative_persistent"  # Fp8Block_MLarge
ROWWISE_REFERENCE = "128x128x128_c1x2_cooperative_persistent"  # Fp8_M1024_Accurate


@pytest.fixture(autouse=True)
def _needs_fp8_kernels():
    if not cw.supports_fp8():
        pytest.skip("the sm90 fp8 kernels are not available in this build")


def table(which: int) -> list:
    """Entry names of one sm90 config table, in index order (the library's own names)."""
    lib = cw._ext.kernel_library("_kernels_sm90")
    if lib is None:
        pytest.skip("the sm90 kernel library is not loaded through ctypes here")
    lib.cw8a8_sm90_config_name.restype = ctypes.c_char_p
    return [lib.cw8a8_sm90_config_name(which, i).decode() for i in range(lib.cw8a8_sm90_num_configs(which))]


def wave_n_entries(names: list) -> list:
    found = [i for i, name in enumerate(names) if "_waves_n" in name]
    assert found, f"no waves-along-N entry in {names}"
    return found


def forced(a, w, sa, sb, bias, config, out_dtype):
    out = torch.full((a.shape[0], w.shape[0]), float("nan"), dtype=out_dtype, device="cuda")
    OPS._scaled_mm_config(out, a, w.t(), sa, sb, bias, config)
    return out


@pytest.mark.parametrize("m", [1, 100, 300])
@pytest.mark.parametrize("nk", [(256, 128), (400, 1024), (2112, 7168)], ids=["N256-K128", "N400-K1024", "N2112-K7168"])
@pytest.mark.parametrize("out_dtype,bias", [(torch.bfloat16, True), (torch.float16, False)], ids=["bf16-bias", "f16"])
@torch.no_grad()
def test_block_wave_n_equals_128x128_bitwise(m, nk, out_dtype, bias):
    names = table(TABLE_BLOCK)
    ref_index = names.index(BLOCK_REFERENCE)
    n, k = nk
    args = block_problem(m, n, k, out_dtype, bias, seed=m * 31 + n + k)  # scales differ group to group
    ref = forced(*args, ref_index, out_dtype)
    assert not torch.isnan(ref).any(), f"{BLOCK_REFERENCE} left elements unwritten"
    for i in wave_n_entries(names):
        out = forced(*args, i, out_dtype)
        assert torch.equal(out, ref), (
            f"{names[i]} differs from {BLOCK_REFERENCE} at M={m} N={n} K={k}: "
            f"{int((out != ref).sum())} of {out.numel()} elements (NaN: {int(torch.isnan(out).sum())})")


@pytest.mark.parametrize("m", [1, 100, 300, 1000])
@pytest.mark.parametrize("nk", [(256, 512), (400, 1024), (4096, 8192)], ids=["N256-K512", "N400-K1024", "N4096-K8192"])
@torch.no_grad()
def test_rowwise_accurate_wave_n_equals_promoted_bitwise(m, nk):
    names = table(TABLE_FP8)
    ref_index = names.index(ROWWISE_REFERENCE)
    n, k = nk
    a, w, sa, sb, bias = rowwise_problem(m, n, k, seed=m * 17 + n + k)
    ref = forced(a, w, sa, sb, bias, ref_index, torch.bfloat16)
    assert not torch.isnan(ref).any(), f"{ROWWISE_REFERENCE} left elements unwritten"
    for i in wave_n_entries(names):
        assert "fastaccum" not in names[i], names[i]
        out = forced(a, w, sa, sb, bias, i, torch.bfloat16)
        assert torch.equal(out, ref), (
            f"{names[i]} differs from {ROWWISE_REFERENCE} at M={m} N={n} K={k}: "
            f"{int((out != ref).sum())} of {out.numel()} elements (NaN: {int(torch.isnan(out).sum())})")
