"""The GEMM ops' public wrappers: `scaled_mm`, `scaled_mm_decode`, `linear_decode`, `add_rms_norm_linear_decode`,
and `supports_fp8`.

Each wrapper calls its op once and returns; the op checks its arguments (C++ on CUDA, `_checks.py` on the CPU
and in the fake kernels) and raises errors that name the argument (docs/MISUSE.md). The one check a wrapper makes
itself is `scaled_mm`'s ``fp8_fast_accum`` type, which torch's dispatcher coerces to bool before C++ sees it.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import _ext
from ._checks import check_fp8_fast_accum
from ._limits import FP8_FAST_ACCUM
from ._schema import OVERLOADS as _op

__all__ = ["scaled_mm", "scaled_mm_decode", "linear_decode", "add_rms_norm_linear_decode", "supports_fp8"]


def scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    bias: Optional[torch.Tensor] = None,
    *,
    out: Optional[torch.Tensor] = None,
    fp8_fast_accum: bool = FP8_FAST_ACCUM,
) -> torch.Tensor:
    """W8A8 GEMM with fused dequantization: ``D = scale_a * scale_b * (A @ B) + bias``.

    The products accumulate exactly in int32 (int8) or in float32 (float8_e4m3fn); the epilogue multiplies
    by ``scale_b`` then ``scale_a`` in float32, adds ``bias`` and rounds once to ``out_dtype``
    (csrc/gemm/EPILOGUES.md).

    **Block-scaled fp8** (DeepSeek-V3's format, also Qwen3-FP8's, transformers' ``finegrained_fp8`` and
    compressed-tensors' ``FP8_BLOCK``): when ``scale_a`` is ``(M, K/128)`` (one scale per 1x128 group of a row
    of ``a``, from :func:`quantize_per_token_group`) and ``scale_b`` is ``(ceil(N/128), K/128)`` (one scale per
    128x128 block of the ``(N, K)`` weight, N-major: the checkpoint's ``weight_scale_inv`` / ``weight_scale``
    as stored), both float32, row-major, contiguous, ``a`` and ``b`` float8_e4m3fn and K a multiple of 128::

        D[m, n] = round( sum_kb scale_a[m, kb] * scale_b[n // 128, kb] * (a[m, kb*128:(kb+1)*128] .
                         b[kb*128:(kb+1)*128, n]) + bias[n] )

    accumulated in float32 (each 128-long partial dot product scaled and added), one rounding to ``out_dtype``.
    N only needs to be a multiple of 16 (its last block may be partial). The mode is told from the scales'
    shapes (`cutlass_w8a8.ops._roles.block_scaled`: ``scale_a`` 2-D with more than one column, or ``scale_b``
    ``(ceil(N/128), ceil(K/128))`` with more than one element and not ``(N, 1)`` / ``(1, N)``); with K = 128
    and N <= 128 the block scales ``(M, 1)`` x ``(1, 1)`` are the same product as per-token x per-tensor. On
    the GPU block mode needs sm90 (the CUTLASS blockwise FP8 kernels, or the decode GEMM at decode M).

    Parameters
    ----------
    a : torch.Tensor
        ``(M, K)``, int8 or float8_e4m3fn, row-major (``stride(1) == 1``). Rows may be padded
        (``stride(0) >= K``, a multiple of 16) as in a slice of a wider buffer. Any ``M >= 0``.
    b : torch.Tensor
        ``(K, N)``, the dtype of ``a``, column-major: pass the ``(N, K)`` row-major weight as ``weight.t()``.
        K and N must be positive multiples of 16; for int8, ``K <= INT8_MAX_K`` (131056) so the int32
        accumulator cannot overflow.
    scale_a : torch.Tensor
        float32, ``(1,)`` per-tensor or ``(M, 1)`` per-token, contiguous, on ``a``'s device; block-scaled:
        ``(M, K/128)``, row-major contiguous.
    scale_b : torch.Tensor
        float32, ``(1,)`` per-tensor or ``(N,)`` / ``(1, N)`` / ``(N, 1)`` per-channel (the last is what
        compressed-tensors checkpoints store and ``quantize_int8(weight)`` returns), contiguous; block-scaled:
        ``(ceil(N/128), K/128)``, row-major contiguous.
    out_dtype : torch.dtype
        ``torch.bfloat16`` (default) or ``torch.float16``. Ignored when ``out`` is given.
    bias : torch.Tensor, optional
        ``(N,)`` in ``out_dtype``.
    out : torch.Tensor, optional
        ``(M, N)`` row-major destination (its dtype is the output dtype); written in place and returned.
        For static buffers, e.g. inside CUDA graphs.
    fp8_fast_accum : bool
        Row-wise fp8 on sm90 only: True runs the fast-accumulation kernels (the tensor cores' partial sums kept
        over the whole K loop), False the accurate ones (partial sums promoted into float32 every 128 of K, the
        same result at every M that the CUTLASS kernels serve). Measured, bf16 output, relative Frobenius error
        against float64: fast accumulation 4.3-4.5e-3 (H100, 13 DeepSeek-V3 / Qwen3 shapes) and 3.5e-3 (H200,
        issue 37), growing with K; accurate, like block fp8 and the decode GEMM, within the output rounding
        (1.7e-3). Accurate costs 1.09x (M = 1024) / 1.05x (M = 4096) the fast kernels' time on an H200 (Llama-3-70B
        shapes, bench/results/tune_nvidia-h200_fp8_waves.md). int8 (exact), block-scaled fp8 (always promoted) and
        the decode GEMM at M <= 8 ignore it. Default: ``cutlass_w8a8.ops._limits.FP8_FAST_ACCUM`` (True).

    Returns
    -------
    torch.Tensor
        ``(M, N)`` in ``out_dtype``, on ``a``'s device.

    Raises
    ------
    TypeError
        A dtype is wrong (``a``, ``b``, scales, ``bias``, ``out_dtype``, ``out``); block scales with int8
        operands (``a`` must be float8_e4m3fn with block scales); ``fp8_fast_accum`` is not a bool.
    ValueError
        A shape, layout, alignment or device is wrong; the message names the argument. Block-scaled: K not a
        multiple of 128, ``scale_a`` not ``(M, K/128)``, ``scale_b`` not ``(ceil(N/128), K/128)``.
    RuntimeError
        An argument is not of its schema type, e.g. a list for a tensor (torch's dispatcher names it); CUDA
        tensors were given but the CUDA extension is not built, or the device has no kernels.
    NotImplementedError
        Block scales on a GPU whose kernels are not sm90's (sm80 / sm89, or ``CUTLASS_W8A8_FORCE_ARCH=sm80``).

    Examples
    --------
    >>> x_q, x_s = quantize_int8(x)                  # x: (M, K) bf16 -> per-token int8
    >>> y = scaled_mm(x_q, w_q.t(), x_s, w_s, torch.bfloat16, bias)
    >>> x_q, x_s = quantize_per_token_group(x)       # block-scaled fp8: x_s (M, K / 128)
    >>> y = scaled_mm(x_q, w_q.t(), x_s, w_s, torch.bfloat16)   # w_q e4m3 (N, K), w_s (ceil(N / 128), K / 128)
    """
    # torch's dispatcher would turn None or a number into a bool before the C++ op sees it: checked here
    check_fp8_fast_accum("scaled_mm", fp8_fast_accum)
    if out is None:
        return _op.scaled_mm(a, b, scale_a, scale_b, out_dtype, bias, fp8_fast_accum)
    _op.scaled_mm_out(out, a, b, scale_a, scale_b, bias, fp8_fast_accum)
    return out


def scaled_mm_decode(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    bias: Optional[torch.Tensor] = None,
    *,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """:func:`scaled_mm` for decode batches (M <= 16), written to stream the weights at the memory limit.

    Computes ``D = scale_a * scale_b * (A @ B) + bias`` exactly as :func:`scaled_mm` does: the products
    accumulate exactly in int32 (int8) or in float32 (float8_e4m3fn), then
    ``D = round(scale_a[m] * (scale_b[n] * float(acc)) + bias[n])`` in float32 with one rounding to
    ``out_dtype`` (csrc/gemm/EPILOGUES.md). For int8 the result therefore equals :func:`scaled_mm`'s bit for bit.
    At M <= 16 a GEMM is a stream of the ``N x K`` weight bytes; this kernel keeps every SM streaming (N / 16
    thread blocks of 8 warps, split along K when that is fewer than the SMs) where the CUTLASS kernels behind
    :func:`scaled_mm` run 64 to 96 tiles. Which one a model should call at which shape is for the caller to
    decide from ``bench/bench_decode_gemm.py``.

    Parameters
    ----------
    a : torch.Tensor
        ``(M, K)`` with ``1 <= M <= 16``, int8 or float8_e4m3fn, row-major (``stride(1) == 1``); rows may be
        padded (``stride(0) >= K``, a multiple of 16 elements, e.g. a slice of a wider buffer).
    b : torch.Tensor
        ``(K, N)``, ``a``'s dtype, column-major: the ``(N, K)`` row-major weight passed as ``weight.t()``
        (``stride(1)``, the weight's row pitch, a multiple of 16 and at least K; a column slice of a wider
        weight is fine). K and N positive multiples of 16 (K need not be a multiple of 64); int8 needs
        ``K <= INT8_MAX_K`` (131056), any dtype ``K <= 2**30``.
    scale_a : torch.Tensor
        float32, ``(1,)`` per-tensor or ``(M, 1)`` / ``(M,)`` per-token, contiguous; or block-scaled fp8
        ``(M, K/128)`` as in :func:`scaled_mm`.
    scale_b : torch.Tensor
        float32, ``(1,)`` per-tensor or ``(N,)`` / ``(1, N)`` / ``(N, 1)`` per-channel (the last is what
        compressed-tensors checkpoints store and ``quantize_int8(weight)`` returns), contiguous; or
        block-scaled ``(ceil(N/128), K/128)`` (then K a multiple of 128, e4m3 operands; sm90 only).
    out_dtype : torch.dtype
        ``torch.bfloat16`` (default) or ``torch.float16``; ignored when ``out`` is given.
    bias : torch.Tensor, optional
        ``(N,)`` in the output dtype, contiguous.
    out : torch.Tensor, optional
        ``(M, N)`` row-major destination (``stride(0)`` a multiple of 8 when M > 1, 16-byte aligned), written
        in place and returned.

    Returns
    -------
    torch.Tensor
        ``(M, N)`` in the output dtype, on ``a``'s device.

    Raises
    ------
    TypeError
        A dtype is wrong (``a``, ``b``, scales, ``bias``, ``out_dtype``, ``out``).
    ValueError
        M outside [1, 16], or a shape, layout, alignment or device :func:`scaled_mm` rejects; the message names
        the argument.
    RuntimeError
        An argument is not a tensor (torch's dispatcher names it); CUDA tensors were given but the CUDA
        extension is not built.
    NotImplementedError
        int8 on a GPU below compute capability 8.0, float8_e4m3fn below 8.9.

    Notes
    -----
    Kernel (csrc/gemm/decode/scaled_mm_decode.cu, csrc/gemm/decode/README.md): tensor-core ``mma.sync`` with 16 weight rows
    on the MMA's M and up to 8 tokens on its N (two token tiles for M > 8). The fragment layouts are those of the
    PTX ISA, "Matrix Fragments for mma.m16n8k32" (int8, and e4m3 on sm89) and "mma.m16n8k16" (f16, on sm90,
    where e4m3 pairs are converted to f16 exactly first): thread ``(g, t) = (lane / 4, lane % 4)`` holds 16
    contiguous K bytes of weight rows ``g`` and ``g + 8`` and of token ``g``; one 128-bit load each, since a dot
    product is unchanged when the same permutation of K is applied to both operands. The grid depends on N, K
    and the SM count only, and M is the kernel's first parameter, so the node of a captured CUDA graph follows
    ``UpdatableGraph.set_rows``. One launch (two when K is split), on the current stream, no host
    synchronization; a split-K workspace comes from the torch caching allocator. On sm90 with PDL on
    (:func:`cutlass_w8a8.set_pdl`) the kernel is launched with programmatic dependent launch and waits on
    ``griddepcontrol.wait`` before reading its inputs.

    fp8 accumulates in float32 tensor-core accumulators in another order than :func:`scaled_mm`'s kernels, so
    fp8 results agree with it to the accumulation bound of csrc/gemm/EPILOGUES.md, not bit for bit.

    Examples
    --------
    >>> x_q, x_s = quantize_int8(x)                  # x: (4, K) bf16 -> per-token int8
    >>> y = scaled_mm_decode(x_q, w_q.t(), x_s, w_s, torch.bfloat16, bias)
    """
    if out is None:
        return _op.scaled_mm_decode(a, b, scale_a, scale_b, out_dtype, bias)
    _op.scaled_mm_decode_out(out, a, b, scale_a, scale_b, bias)
    return out


def linear_decode(
    x: torch.Tensor,
    b: torch.Tensor,
    scale_b: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    dtype: Optional[torch.dtype] = None,
    *,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """A W8A8 linear for M <= 16 in one kernel: dynamic per-token quantization of ``x`` and the GEMM.

    Equal bit for bit to ``scaled_mm_decode(*quantize_per_token(x, dtype), b, scale_b, x.dtype, bias)``:
    every thread block computes each row's scale ``max_k |x[m, k]| / QMAX`` (QMAX 127 for int8, 448 for e4m3;
    float32, IEEE division, 0 for a row of zeros) and quantizes ``q = sat(round_half_even(x / scale))``
    exactly as :func:`quantize_int8` / :func:`quantize_fp8` do, then runs :func:`scaled_mm_decode`'s main loop
    and epilogue with ``scale_a = scale``. It saves the quantization kernel's launch and its round trip through
    memory, at the price of every thread block reading the ``M x K`` activations from L2 and repeating the
    ``M x K`` divisions: it wins at small M and loses at larger M (csrc/gemm/decode/README.md, "Crossover";
    ``bench/bench_decode_gemm.py`` measures it). The caller chooses.

    Parameters
    ----------
    x : torch.Tensor
        ``(M, K)`` with ``1 <= M <= 16``, bfloat16 or float16, row-major (``stride(1) == 1``), ``stride(0)`` a
        multiple of 8 elements when M > 1, 16-byte aligned. The output has ``x``'s dtype.
    b : torch.Tensor
        ``(K, N)`` weight in ``dtype``, column-major (``weight.t()`` of the ``(N, K)`` row-major weight); as in
        :func:`scaled_mm_decode`.
    scale_b : torch.Tensor
        float32, ``(1,)`` per-tensor or ``(N,)`` / ``(1, N)`` / ``(N, 1)`` per-channel (the last is what
        compressed-tensors checkpoints store and ``quantize_int8(weight)`` returns), contiguous.
    bias : torch.Tensor, optional
        ``(N,)`` in ``x``'s dtype, contiguous.
    dtype : torch.dtype, optional
        The quantized type, ``torch.int8`` or ``torch.float8_e4m3fn``; must be ``b``'s dtype. Default:
        ``b.dtype``.
    out : torch.Tensor, optional
        ``(M, N)`` row-major destination in ``x``'s dtype, written in place and returned.

    Returns
    -------
    torch.Tensor
        ``(M, N)`` in ``x``'s dtype.

    Raises
    ------
    TypeError
        ``x`` not bfloat16 / float16, ``dtype`` not int8 / float8_e4m3fn or not ``b``'s dtype, ``scale_b`` not
        float32, ``bias`` / ``out`` not in ``x``'s dtype.
    ValueError
        M outside [1, 16], or a wrong shape, layout, alignment or device; the message names the argument.
    RuntimeError
        An argument is not a tensor (torch's dispatcher names it); CUDA tensors were given but the CUDA
        extension is not built.
    NotImplementedError
        int8 below compute capability 8.0, float8_e4m3fn below 8.9.

    Notes
    -----
    Non-finite values in ``x`` give unspecified results for their row, as in the quantization ops. The CPU
    implementation is the CPU chain ``quantize_per_token`` -> ``scaled_mm`` reference.
    """
    if dtype is None:
        dtype = getattr(b, "dtype", None)  # a non-tensor `b` gets the op's own error
    if out is None:
        return _op.linear_decode(x, b, scale_b, bias, dtype)
    _op.linear_decode_out(out, x, b, scale_b, bias, dtype)
    return out


def add_rms_norm_linear_decode(
    x: torch.Tensor,
    residual: Optional[torch.Tensor],
    norm_weight: torch.Tensor,
    eps: float,
    b: torch.Tensor,
    scale_b: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    dtype: Optional[torch.dtype] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoder layer's residual add, input RMSNorm and W8A8 projection for M <= 16 in one kernel.

    ``s = residual + x`` (rounded to x's dtype; ``s = x`` without a residual), ``residual_out = s``, and
    ``out = linear_decode(rms_norm(s) * norm_weight)`` with the per-token quantization of the normalized rows.
    Equal bit for bit to ``q, scale = rms_norm_quant(x, norm_weight, eps, dtype, None, r)`` on a copy ``r`` of
    ``residual`` (which it turns into ``residual_out``), then ``scaled_mm_decode(q, b, scale, scale_b, x.dtype,
    bias)``: every thread block computes each row's sum of squares in rms_norm_quant's order (K <= 8192: its
    one-block kernel), y, the scale and the quantized values as that op does, then runs :func:`linear_decode`'s
    main loop and epilogue. ``residual`` is read, never written: the thread block that owns a row writes ``s`` to
    the new ``residual_out`` (the other blocks still read ``residual``).

    Parameters
    ----------
    x : torch.Tensor
        ``(M, K)`` with ``1 <= M <= 16`` and ``K <= 8192``, bfloat16 or float16, row-major, ``stride(0)`` a
        multiple of 8 elements when M > 1, 16-byte aligned. The outputs have ``x``'s dtype.
    residual : torch.Tensor or None
        ``(M, K)`` in ``x``'s dtype with ``x``'s layout rules, or None (the first layer: the stream is ``x``, and
        ``residual_out`` is a copy of it).
    norm_weight : torch.Tensor
        ``(K,)`` in ``x``'s dtype, contiguous, 16-byte aligned.
    eps : float
        RMSNorm's epsilon, finite and ``>= 0``.
    b, scale_b, bias, dtype
        As :func:`linear_decode` (per-tensor or per-channel ``scale_b``; block scales are refused).

    Returns
    -------
    (torch.Tensor, torch.Tensor)
        ``out`` ``(M, N)`` and ``residual_out`` ``(M, K)`` (contiguous), both in ``x``'s dtype.

    Raises
    ------
    TypeError, ValueError, NotImplementedError
        As :func:`linear_decode`, naming the argument; also K above 8192, a ``residual`` / ``norm_weight`` of
        another dtype, shape or layout, a bad ``eps``, and block-scaled ``scale_b``.
    """
    if dtype is None:
        dtype = getattr(b, "dtype", None)  # a non-tensor `b` gets the op's own error
    return _op.add_rms_norm_linear_decode(x, residual, norm_weight, eps, b, scale_b, bias, dtype)


def supports_fp8(device=None) -> bool:
    """Whether float8_e4m3fn ``scaled_mm`` can run on ``device`` (default: the current CUDA device).

    True on compute capability 9.0 with the sm90 kernels built (TORCH_CUDA_ARCH_LIST with 9.0a) and on 8.9
    with the sm89 kernels built (8.9 in the list); False otherwise, also without CUDA. Queries the device.
    """
    if not torch.cuda.is_available():
        return False
    return _ext.supports_fp8(torch.cuda._get_device_index(device, optional=True))
