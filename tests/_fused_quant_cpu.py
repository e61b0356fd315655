"""Helpers for the CPU tests of the fused non-GEMM ops (test_fused_quant_cpu.py, test_decoder_fused_path_cpu.py):
the dtypes, bit-exact comparison, seeded inputs and the unfused rms_norm chain.

`inputs(shape, dtype)` gives x and r of `shape` (Gaussian, times `scale`) and w of shape[-1:] in [0.5, 1.5),
all of `dtype`, on the CPU. `assert_bits_equal` compares shape, dtype and raw bits (NaNs and fp8 exactly).
"""

import torch
import torch.nn.functional as F

import cutlass_w8a8 as cw

OPS = torch.ops.cutlass_w8a8
QDTYPES = [torch.int8, torch.float8_e4m3fn]
XDTYPES = [torch.bfloat16, torch.float16, torch.float32]
QUANT = {torch.int8: cw.quantize_int8, torch.float8_e4m3fn: cw.quantize_fp8}
EPS = 1e-5


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of `t` (compares NaNs and fp8 exactly)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_bits_equal(a, b, what=""):
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape} {a.dtype} vs {b.shape} {b.dtype}"
    diff = bits(a) != bits(b)
    assert not diff.any(), f"{what}: {int(diff.sum())} of {diff.numel()} elements differ"


def inputs(shape, dtype, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * scale).to(dtype)
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(dtype)
    r = (torch.randn(shape, generator=g) * scale).to(dtype)
    return x, w, r


def chain_rms_norm(x, w, eps, residual=None):
    """The unfused chain, on copies: (y, residual after)."""
    if residual is not None:
        residual = residual + x
        x = residual
    return F.rms_norm(x, (x.shape[-1],), w, eps), residual

