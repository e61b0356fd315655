"""The quantization kernels against the CPU reference: the same float32 arithmetic, so bit-exact."""

import pytest
import torch

import cutlass_w8a8 as cw

pytestmark = pytest.mark.cuda

QUANT = {torch.int8: cw.quantize_int8, torch.float8_e4m3fn: cw.quantize_fp8}


def check_dynamic(x, qdtype):
    q, s = QUANT[qdtype](x)
    q_ref, s_ref = QUANT[qdtype](x.cpu())
    assert q.dtype == qdtype and q.shape == x.shape and q.is_contiguous()
    assert s.shape == (*x.shape[:-1], 1) and s.dtype == torch.float32
    assert torch.equal(s.cpu(), s_ref), "scales differ from the reference"
    mismatch = (q.cpu().view(torch.uint8) != q_ref.view(torch.uint8))
    assert not mismatch.any(), f"{int(mismatch.sum())} of {q.numel()} quantized values differ"


# K values: vectorized (register-resident rows of 1..8 vectors per thread of 256, or 8 of 512 threads for
# 2049..4096 vectors), the looping fallback beyond 4096 vectors per row, and K not a multiple of the 16-byte
# vector (scalar fallback).
@pytest.mark.parametrize("qdtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("xdtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 16), (7, 4096), (33, 14336), (5, 28672), (3, 40000), (2, 3, 100),
                                   (4, 8, 1024), (1, 57344)])
def test_dynamic_per_token_bit_exact(qdtype, xdtype, shape):
    g = torch.Generator(device="cuda").manual_seed(sum(shape))
    x = (torch.randn(shape, device="cuda", generator=g) * 3).to(xdtype)
    x.view(-1, shape[-1])[0] = 0  # a row of zeros: scale 0, q 0
    check_dynamic(x, qdtype)


@pytest.mark.parametrize("qdtype", [torch.int8, torch.float8_e4m3fn])
def test_dynamic_strided_and_sliced_rows(qdtype):
    base = torch.randn(64, 4096 + 64, device="cuda", dtype=torch.bfloat16)
    check_dynamic(base[:, 64:], qdtype)          # padded rows, 16-byte aligned
    check_dynamic(base[:, 3:4099], qdtype)       # misaligned start: scalar path
    check_dynamic(base.t()[:1024], qdtype)       # transposed: copied to rows first


@pytest.mark.parametrize("qdtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("xdtype", [torch.bfloat16, torch.float32])
def test_static_per_tensor_bit_exact(qdtype, xdtype):
    x = (torch.randn(17, 3000, device="cuda") * 50).to(xdtype)
    scale = torch.tensor([0.07], device="cuda")
    q, s = QUANT[qdtype](x, scale)
    assert s is scale
    q_ref, _ = QUANT[qdtype](x.cpu(), scale.cpu())
    assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8))


def test_empty_inputs():
    q, s = cw.quantize_int8(torch.empty(0, 64, device="cuda", dtype=torch.bfloat16))
    assert q.shape == (0, 64) and s.shape == (0, 1)
    q, s = cw.quantize_fp8(torch.empty(0, 64, device="cuda"), torch.ones(1, device="cuda"))
    assert q.shape == (0, 64)


def test_bad_input_cuda():
    x = torch.randn(4, 64, device="cuda")
    with pytest.raises(ValueError, match="quantize_per_tensor: `scale` is on cpu"):
        cw.quantize_int8(x, torch.ones(1))
    with pytest.raises(ValueError, match="quantize_per_tensor: `scale`"):
        torch.ops.cutlass_w8a8.quantize_per_tensor(x, torch.ones(1), torch.int8)
    with pytest.raises(TypeError, match="quantize_per_token: `x`"):
        torch.ops.cutlass_w8a8.quantize_per_token(x.to(torch.int32), torch.int8)
