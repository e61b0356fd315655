"""bench/bench_gemm.py's accuracy: the guard and the fp8 error report.

- The guard: before the timings of a point, ours is checked against a bf16 GEMM of the dequantized operands and
  the quantized linears against the bf16 ``nn.Linear`` (relative Frobenius error); a result past its bound
  raises `AccuracyError`, which aborts the run.
- The report (issue 26, "fp8 accuracy"): every fp8 GEMM path (the CUTLASS row-wise kernels, the decode GEMM,
  the block-scaled kernels, torch's row-wise and blockwise ``scaled_mm``) against a float64 GEMM of the very
  dequantized operands it was given (`fp64_reference`), with `error_stats`; `fp8_path_errors` runs them.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import torch

from cutlass_w8a8.testing.report import AccuracyError

from _gemm_methods import OPTIONAL_METHODS, short_error

# Relative Frobenius error bounds. The GEMM against the dequantized operands differs only by bf16
# rounding; the quantized linear also carries int8 quantization error (about 1% on these random inputs).
GEMM_REL_TOL = 2e-2
LINEAR_REL_TOL = 5e-2
# fp8 (e4m3, 3 mantissa bits) linears against bf16: both operands rounded to e4m3, about 2.6% rms each.
FP8_LINEAR_REL_TOL = 1e-1



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



# ---- fp8 error against float64 (reported, not a guard) --------------------------------------------------------

# The error report compares the top-left ACCURACY_ROWS x ACCURACY_COLS corner of each output (every K), which
# keeps the float64 reference cheap at the largest shapes (a 256 x 1024 x 25600 float64 GEMM); the corner covers
# 8 weight blocks of 128 columns, every K block and the first rows of every M bucket's tile.
ACCURACY_ROWS = 256
ACCURACY_COLS = 1024
# Issue 26's bound for the block GEMM with bf16 output against float64: relative Frobenius error <= 2.5e-3
# (rounding the exact result to bf16 alone costs about 1.6e-3 on these random operands: `bf16_floor`).
BLOCK_REL_TARGET = 2.5e-3
_GROUP = 128  # cutlass_w8a8.ops._limits.BLOCK_SIZE: 1 x 128 activation groups, 128 x 128 weight blocks


def fp64_reference(a: torch.Tensor, w: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, *,
                   block: bool, rows: Optional[int] = None, cols: Optional[int] = None) -> torch.Tensor:
    """float64 ``(rows, cols)`` top-left corner of ``(a * scale_a) @ (w * scale_b).T`` (the exact GEMM of the
    dequantized operands, products and sums in float64).

    Parameters
    ----------
    a : torch.Tensor
        ``(M, K)`` int8 or float8_e4m3fn activations.
    w : torch.Tensor
        ``(N, K)`` weight of ``a``'s dtype (row-major, as ``W8A8Linear`` stores it).
    scale_a, scale_b : torch.Tensor
        float32. ``block=False``: ``scale_a`` per tensor ``(1,)`` or per token ``(M, 1)``, ``scale_b`` per tensor
        or per channel (N values). ``block=True``: ``scale_a`` ``(M, K/128)`` (1 x 128 groups), ``scale_b``
        ``(ceil(N/128), K/128)`` (128 x 128 blocks; K a multiple of 128).
    rows, cols : int, optional
        Size of the corner (default: all of M, N).
    """
    m, k = a.shape
    n = w.shape[0]
    rows, cols = min(rows or m, m), min(cols or n, n)
    a64, w64 = a[:rows].double(), w[:cols].double()
    if block:
        a64 = a64 * scale_a[:rows].double().repeat_interleave(_GROUP, dim=1)[:, :k]
        sb = scale_b.double().repeat_interleave(_GROUP, dim=0)[:cols].repeat_interleave(_GROUP, dim=1)[:, :k]
        w64 = w64 * sb
    else:
        sa = scale_a.double().reshape(-1, 1)
        a64 = a64 * (sa if sa.numel() == 1 else sa[:rows])
        sb = scale_b.double().reshape(-1, 1)
        w64 = w64 * (sb if sb.numel() == 1 else sb[:cols])
    return a64 @ w64.t()


def error_stats(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """``rel_fro`` = ||out - ref||_F / ||ref||_F and ``max_over_rms`` = max |out - ref| / rms(ref), in float64;
    ``out`` is cut to ``ref``'s corner first."""
    out = out[: ref.shape[0], : ref.shape[1]].double()
    err = out - ref
    ref_norm = torch.linalg.vector_norm(ref)
    rms = ref_norm / ref.numel() ** 0.5
    return {"rel_fro": float(torch.linalg.vector_norm(err) / ref_norm), "max_over_rms": float(err.abs().max() / rms)}


def bf16_floor(ref: torch.Tensor) -> dict[str, float]:
    """`error_stats` of the float64 reference rounded once to bfloat16: the least error a bf16 output can have."""
    return error_stats(ref.to(torch.bfloat16), ref)


class Operands(NamedTuple):
    """The canonical operands of an fp8 GEMM, for its float64 reference (see `fp64_reference`): ``a`` ``(M, K)``,
    ``w`` ``(N, K)``, float32 scales, ``block`` whether they are 1 x 128 / 128 x 128 block scales."""

    a: torch.Tensor
    w: torch.Tensor
    scale_a: torch.Tensor
    scale_b: torch.Tensor
    block: bool


def fp8_path_errors(paths: dict[str, tuple[Callable, tuple, Operands]], errors: dict[str, str], *,
                    rows: int = ACCURACY_ROWS, cols: int = ACCURACY_COLS) -> dict[str, Any]:
    """Error of each fp8 GEMM path against float64.

    ``paths`` maps a name to ``(fn, args, operands)``: ``fn(*args)`` returns the ``(M, N)`` output of a GEMM of
    ``operands`` (``args`` may hold them in another layout, e.g. torch's column-major scales). A path that
    raises is recorded in ``errors`` (its first line) and left out. Returns ``{name: error_stats}``, plus
    ``"bf16_floor"`` / ``"bf16_floor_block"`` (`bf16_floor` of the row-wise / block reference, where a path of
    that kind ran) and ``"corner": {"rows", "cols"}`` (the part of the outputs compared).
    """
    out: dict[str, Any] = {}
    refs: dict[int, torch.Tensor] = {}
    for name, (fn, args, ops) in paths.items():
        try:
            y = fn(*args)
        except Exception as exc:  # noqa: BLE001 (a path that does not run at this M is a result)
            errors.setdefault(name, short_error(exc))
            continue
        if id(ops) not in refs:
            refs[id(ops)] = fp64_reference(*ops[:4], block=ops.block, rows=rows, cols=cols)
            out.setdefault("bf16_floor_block" if ops.block else "bf16_floor", bf16_floor(refs[id(ops)]))
        out[name] = error_stats(y, refs[id(ops)])
    if refs:
        ref = next(iter(refs.values()))
        out["corner"] = {"rows": ref.shape[0], "cols": ref.shape[1]}
    return out
