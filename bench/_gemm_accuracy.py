"""bench/bench_gemm.py's accuracy guard: before the timings of a point, ours is checked against a bf16 GEMM of
the dequantized operands and the quantized linears against the bf16 ``nn.Linear`` (relative Frobenius error);
a result past its bound raises `AccuracyError`, which aborts the run.
"""

from __future__ import annotations

import torch

from _gemm_methods import OPTIONAL_METHODS, short_error

# Relative Frobenius error bounds. The GEMM against the dequantized operands differs only by bf16
# rounding; the quantized linear also carries int8 quantization error (about 1% on these random inputs).
GEMM_REL_TOL = 2e-2
LINEAR_REL_TOL = 5e-2
# fp8 (e4m3, 3 mantissa bits) linears against bf16: both operands rounded to e4m3, about 2.6% rms each.
FP8_LINEAR_REL_TOL = 1e-1


class AccuracyError(RuntimeError):
    """A cutlass_w8a8 result is too far from its reference: the timings would be meaningless."""


def rel_fro_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref||_F / ||ref||_F`` in float32."""
    ref = ref.float()
    return (torch.linalg.vector_norm(out.float() - ref) / torch.linalg.vector_norm(ref)).item()


def dequantized_reference(a: torch.Tensor, w: torch.Tensor, scale_a: torch.Tensor,
                          scale_b: torch.Tensor) -> torch.Tensor:
    """bf16 GEMM of the dequantized operands: ``(a * scale_a) @ (w * scale_b[:, None]).t()``, ``(M, N)``."""
    a_deq = (a.float() * scale_a).to(torch.bfloat16)
    w_deq = (w.float() * scale_b.reshape(-1, 1)).to(torch.bfloat16)
    return a_deq @ w_deq.t()


def check_accuracy(methods: dict, errors: dict[str, str], where: str) -> dict[str, float]:
    """Check ours (and the quantized linears) before timing; returns relative errors by method.

    Raises AccuracyError above `GEMM_REL_TOL` (`LINEAR_REL_TOL` for ``linear_w8a8``, `FP8_LINEAR_REL_TOL` for
    ``linear_w8a8_fp8``, against ``linear_bf16``). A failing first call of an optional method is recorded in
    ``errors`` and the method is dropped from ``methods``. The torchao peers are checked by `check_torchao`.
    """
    rel = {}
    for name in ("ours_int8", "ours_fp8"):
        if name not in methods:
            continue
        fn, args = methods[name]
        try:
            out = fn(*args)
        except Exception as exc:  # noqa: BLE001 (any failure of an optional method is a result)
            if name not in OPTIONAL_METHODS:
                raise
            errors[name] = short_error(exc)
            del methods[name]
            continue
        rel[name] = rel_fro_error(out, dequantized_reference(*args))
    ref_fn, ref_args = methods["linear_bf16"]
    ref = ref_fn(*ref_args)
    for name in ("linear_w8a8", "linear_w8a8_fp8"):
        if name not in methods:
            continue
        fn, args = methods[name]
        try:
            out = fn(*args)
        except Exception as exc:  # noqa: BLE001
            if name not in OPTIONAL_METHODS:
                raise
            errors[name] = short_error(exc)
            del methods[name]
            continue
        rel[name] = rel_fro_error(out, ref)
    tols = {"linear_w8a8": LINEAR_REL_TOL, "linear_w8a8_fp8": FP8_LINEAR_REL_TOL}
    for name, err in rel.items():
        tol = tols.get(name, GEMM_REL_TOL)
        if not err < tol:  # also catches NaN
            raise AccuracyError(f"{where}: {name} relative Frobenius error {err:.3g} is not below {tol:g}")
    return rel

