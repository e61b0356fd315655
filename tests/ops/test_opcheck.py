"""torch.library.opcheck on every op, for what tests/gemm/test_ops_cpu.py::test_opcheck_cpu and
tests/gemm/test_scaled_mm_cuda.py::test_opcheck_cuda leave out: fp8 operands, the out= schema with fp8, the
tuning op `_scaled_mm_config`, quantize_per_tensor to fp8, float16 / float32 inputs, M = 0, windowed
(non-contiguous) operands, non-contiguous quantization inputs, decode_attention_quant (decode_attention's
own cases are in tests/ops/test_decode_attention_cpu.py / _cuda.py), and block-scaled fp8: scaled_mm(_out) and
scaled_mm_decode with (M, K/128) x (ceil(N/128), K/128) scales, w8a8_linear with block weight scales,
quantize_per_token_group, and rms_norm_quant / silu_mul_quant with group_size=128.

opcheck runs the op against its schema (mutation annotations), its fake kernel (shapes, dtypes and strides
of the outputs), autograd registration, and AOT dispatch; each argument tuple below is run on CPU and, with
the `cuda` marker, on the GPU.
"""

import pytest
import torch

import cutlass_w8a8  # noqa: F401 (defines the ops)

from cutlass_w8a8.testing.references import rand_operand, rand_scale, scale_magnitudes

from _opcheck import run_opcheck

OPS = torch.ops.cutlass_w8a8


def gemm_args(m, n, k, dtype, device, per_token=True, out_dtype=torch.bfloat16, windowed=False, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    a = rand_operand((m, k), dtype, device, g)
    w = rand_operand((n, k), dtype, device, g)
    if windowed:  # a and the weight as 16-byte aligned windows of wider buffers
        a = torch.cat([a, rand_operand((m, 32), dtype, device, g)], dim=1)[:, :k]
        w = torch.cat([rand_operand((n, 16), dtype, device, g), w], dim=1)[:, 16:]
    ma, mb = scale_magnitudes(dtype, k)
    sa = rand_scale((m, 1) if per_token else (1,), device, ma, g)
    sb = rand_scale((n,) if per_token else (1,), device, mb, g)
    bias = torch.randn(n, device=device, generator=g).to(out_dtype)
    return a, w.t(), sa, sb, bias


def block_args(m, n, k, device, seed=0):
    """Block-scaled fp8 operands: a (M, K), b = w.t() (K, N), scale_a (M, K/128), scale_b (ceil(N/128), K/128),
    a bf16 bias."""
    g = torch.Generator(device=device).manual_seed(seed)
    fp8 = torch.float8_e4m3fn
    a, w = rand_operand((m, k), fp8, device, g), rand_operand((n, k), fp8, device, g)
    ma, mb = scale_magnitudes(fp8, k)
    sa = rand_scale((m, k // 128), device, ma, g)
    sb = rand_scale(((n + 127) // 128, k // 128), device, mb, g)
    bias = torch.randn(n, device=device, generator=g).to(torch.bfloat16)
    return a, w.t(), sa, sb, bias


def block_cases(device):
    """Block-scaled fp8 GEMMs (N = 208: a partial last row block), the group quantization and the fused ops with
    group_size=128."""
    fp8 = torch.float8_e4m3fn
    out = []
    a, b, sa, sb, bias = block_args(24, 208, 384, device)
    out.append(("scaled_mm block bias", OPS.scaled_mm, (a, b, sa, sb, torch.bfloat16, bias)))
    out.append(("scaled_mm block f16", OPS.scaled_mm, (a, b, sa, sb, torch.float16, None)))
    d = torch.empty(24, 208, dtype=torch.bfloat16, device=device)
    out.append(("scaled_mm_out block", OPS.scaled_mm_out, (d, a, b, sa, sb, bias)))
    a0, b0, sa0, sb0, _ = block_args(0, 208, 384, device)
    out.append(("scaled_mm block M=0", OPS.scaled_mm, (a0, b0, sa0, sb0, torch.bfloat16, None)))
    a, b, sa, sb, bias = block_args(4, 256, 256, device, seed=1)
    out.append(("scaled_mm_decode block", OPS.scaled_mm_decode, (a, b, sa, sb, torch.bfloat16, bias)))
    a, b, sa, sb, bias = block_args(4, 208, 384, device, seed=2)
    x = torch.randn(2, 3, 384, device=device).to(torch.bfloat16)
    out.append(("w8a8_linear block", OPS.w8a8_linear, (x, b.t(), sb, None, bias, torch.bfloat16)))
    g = torch.Generator(device=device).manual_seed(3)
    for xdtype, qdtype in ((torch.bfloat16, fp8), (torch.float16, torch.int8), (torch.float32, fp8)):
        x = torch.randn(5, 256, device=device, generator=g).to(xdtype)
        out.append((f"quantize_per_token_group {xdtype} {qdtype}", OPS.quantize_per_token_group, (x, 128, qdtype)))
    x = torch.randn(6, 512, device=device, generator=g).to(torch.bfloat16)[:, 128:384]  # padded rows
    out.append(("quantize_per_token_group padded rows", OPS.quantize_per_token_group, (x, 128, fp8)))
    out.append(("quantize_per_token_group 3-D", OPS.quantize_per_token_group,
                (torch.randn(2, 3, 128, device=device, generator=g), 128, fp8)))
    out.append(("quantize_per_token_group M=0", OPS.quantize_per_token_group,
                (torch.empty(0, 256, device=device, dtype=torch.bfloat16), 128, fp8)))
    x = torch.randn(3, 256, device=device, generator=g).to(torch.bfloat16)
    w = torch.randn(256, device=device, generator=g).to(torch.bfloat16)
    r = torch.randn(3, 256, device=device, generator=g).to(torch.bfloat16)
    out.append(("rms_norm_quant group", OPS.rms_norm_quant, (x, w, 1e-5, fp8, None, None, 128)))
    out.append(("rms_norm_quant group residual", OPS.rms_norm_quant, (x, w, 1e-5, fp8, None, r, 128)))
    out.append(("silu_mul_quant group", OPS.silu_mul_quant,
                (torch.randn(3, 512, device=device, generator=g).to(torch.bfloat16), fp8, None, 128)))
    return out


def cases(device):
    """(id, op, args) for opcheck on `device`."""
    fp8, i8 = torch.float8_e4m3fn, torch.int8
    out = []
    a, b, sa, sb, bias = gemm_args(24, 64, 128, fp8, device)
    out.append(("scaled_mm fp8 per-token bias", OPS.scaled_mm, (a, b, sa, sb, torch.bfloat16, bias)))
    a, b, sa, sb, bias = gemm_args(24, 64, 128, fp8, device, per_token=False, out_dtype=torch.float16)
    out.append(("scaled_mm fp8 per-tensor f16", OPS.scaled_mm, (a, b, sa, sb, torch.float16, None)))
    a, b, sa, sb, bias = gemm_args(24, 64, 128, fp8, device)
    d = torch.empty(24, 64, dtype=torch.bfloat16, device=device)
    out.append(("scaled_mm_out fp8", OPS.scaled_mm_out, (d, a, b, sa, sb, bias)))
    # fp8_fast_accum=False: the accurate row-wise configs on sm90 (M = 300: a CUTLASS bucket, not the decode GEMM)
    a, b, sa, sb, bias = gemm_args(300, 256, 256, fp8, device)
    out.append(("scaled_mm fp8 accurate", OPS.scaled_mm, (a, b, sa, sb, torch.bfloat16, bias, False)))
    d = torch.empty(300, 256, dtype=torch.bfloat16, device=device)
    out.append(("scaled_mm_out fp8 accurate", OPS.scaled_mm_out, (d, a, b, sa, sb, bias, False)))
    x = torch.randn(300, 256, device=device, generator=torch.Generator(device=device).manual_seed(2))
    out.append(("w8a8_linear fp8 accurate", OPS.w8a8_linear,
                (x.to(torch.bfloat16), b.t(), sb, None, bias, torch.bfloat16, False)))
    a, b, sa, sb, bias = gemm_args(24, 64, 128, i8, device, windowed=True)
    d_buf = torch.empty(24, 80, dtype=torch.bfloat16, device=device)
    out.append(("scaled_mm int8 windowed", OPS.scaled_mm, (a, b, sa, sb, torch.bfloat16, bias)))
    out.append(("scaled_mm_out int8 windowed out", OPS.scaled_mm_out, (d_buf[:, 8:72], a, b, sa, sb, bias)))
    a, b, sa, sb, bias = gemm_args(0, 64, 128, i8, device)
    out.append(("scaled_mm M=0", OPS.scaled_mm, (a, b, sa, sb, torch.bfloat16, bias)))
    for dtype, name in ((i8, "int8"), (fp8, "fp8")):
        a, b, sa, sb, bias = gemm_args(100, 64, 128, dtype, device)
        d = torch.empty(100, 64, dtype=torch.bfloat16, device=device)
        out.append((f"_scaled_mm_config {name}", OPS._scaled_mm_config, (d, a, b, sa, sb, bias, 0)))
    g = torch.Generator(device=device).manual_seed(1)
    for xdtype in (torch.float16, torch.float32):
        x = torch.randn(3, 5, 64, device=device, generator=g).to(xdtype)
        out.append((f"quantize_per_token {xdtype} fp8", OPS.quantize_per_token, (x, fp8)))
        out.append((f"quantize_per_tensor {xdtype} fp8", OPS.quantize_per_tensor,
                    (x, torch.tensor([0.02], device=device), fp8)))
    x = torch.randn(8, 96, device=device, generator=g).to(torch.bfloat16)[:, 16:80]  # padded rows
    out.append(("quantize_per_token padded rows", OPS.quantize_per_token, (x, torch.int8)))
    out.append(("quantize_per_token M=0", OPS.quantize_per_token,
                (torch.empty(0, 64, device=device, dtype=torch.bfloat16), torch.int8)))
    out += attention_quant_cases(device)
    out += block_cases(device)
    return out


def attention_quant_cases(device):
    """decode_attention_quant: int8 and fp8, dynamic and static, bf16 / f16 / f32 q (a strided view of qkv,
    as the decoder passes it), and an empty batch."""
    from cutlass_w8a8.testing.attention import make_inputs

    out = []
    for i, (dtype, qdtype, static) in enumerate([(torch.bfloat16, torch.int8, False),
                                                 (torch.float16, torch.float8_e4m3fn, True),
                                                 (torch.float32, torch.int8, True),
                                                 (torch.bfloat16, torch.float8_e4m3fn, False)]):
        q, kv, slots, pos = make_inputs(3, 8, 2, 64, 24, dtype, device, seed=30 + i, positions=[0, 23, 9])
        scale = torch.tensor([0.01], device=device) if static else None
        name = f"decode_attention_quant {dtype} {qdtype} {'static' if static else 'dynamic'}"
        out.append((name, OPS.decode_attention_quant, (q, kv, slots, pos, 0.125, qdtype, scale)))
    out.append(("decode_attention_quant B=0", OPS.decode_attention_quant,
                (q.new_empty(0, 8, 64), kv, slots.new_empty(0), pos.new_empty(0), 0.125, torch.int8, None)))
    return out


def transposed_cases(device):
    """Non-contiguous inputs whose row order differs from memory order (the outputs are documented as
    contiguous)."""
    x = torch.randn(64, 6, device=device).to(torch.bfloat16).t()
    return [("quantize_per_token transposed", OPS.quantize_per_token, (x, torch.int8)),
            ("quantize_per_tensor transposed", OPS.quantize_per_tensor,
             (x, torch.tensor([0.02], device=device), torch.float8_e4m3fn))]


CPU_CASES = cases("cpu")


@pytest.mark.parametrize("case", [c[0] for c in CPU_CASES])
def test_opcheck_more_cpu(case):
    _, op, args = next(c for c in CPU_CASES if c[0] == case)
    run_opcheck(op, args)


@pytest.mark.parametrize("which", [0, 1])
def test_opcheck_transposed_input_cpu(which):
    _, op, args = transposed_cases("cpu")[which]
    run_opcheck(op, args)


@pytest.mark.cuda
def test_opcheck_more_cuda():
    for name, op, args in cases("cuda") + transposed_cases("cuda"):
        try:
            run_opcheck(op, args)
        except Exception as exc:
            raise AssertionError(f"opcheck failed for {name}: {exc}") from exc
