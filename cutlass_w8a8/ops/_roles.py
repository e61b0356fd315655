"""Operand roles of the ops' argument contract: the checks that several ops share (an 8-bit GEMM operand, a
float32 scale, a bias, an output matrix, a row-wise input x, a static scale, ...), each with its message.

`_checks.py` composes them per op. Every failure names its op and argument: ``TypeError`` for a wrong type or
dtype, ``ValueError`` for a wrong shape, layout, alignment, device or value.
"""

from __future__ import annotations

from typing import Optional

import torch

from ._limits import (AB_DTYPES, BLOCK_SIZE, DECODE_MAX_M, GEMM_ALIGN, INT8_MAX_K, MAX_ROW_K, MAX_ROWS, OUT_DTYPES,
                      X_DTYPES, blocks)


# ---- failures and small predicates --------------------------------------------------------------------------


def fail_type(op: str, arg: str, msg: str) -> None:
    raise TypeError(f"{op}: `{arg}` {msg}")


def fail_value(op: str, arg: str, msg: str) -> None:
    raise ValueError(f"{op}: `{arg}` {msg}")


def limit_text(v: int) -> str:
    """A limit as the messages write it: 2**31, 2**31 - 1, or the number."""
    if v > 0 and v & (v - 1) == 0:
        return f"2**{v.bit_length() - 1}"
    if (v + 1) & v == 0:
        return f"2**{v.bit_length()} - 1"
    return str(v)


def _misaligned(t: torch.Tensor, nbytes: int) -> bool:
    # The storage itself comes from an allocator that aligns to >= 256 bytes; a view's offset can break it.
    return (t.storage_offset() * t.element_size()) % nbytes != 0


def cxx_dtype(dtype: torch.dtype) -> str:
    """A dtype as c10::toString(ScalarType) prints it ("BFloat16", "Half"): rope_kv_cache_'s messages."""
    names = {torch.bfloat16: "BFloat16", torch.float16: "Half", torch.float32: "Float", torch.float64: "Double",
             torch.int8: "Char", torch.uint8: "Byte", torch.int16: "Short", torch.int32: "Int",
             torch.int64: "Long", torch.bool: "Bool", torch.float8_e4m3fn: "Float8_e4m3fn",
             torch.float8_e5m2: "Float8_e5m2", torch.complex64: "ComplexFloat", torch.complex128: "ComplexDouble"}
    return names.get(dtype, str(dtype).replace("torch.", ""))


def cxx_list(v) -> str:
    """Sizes or strides as c10::IntArrayRef prints them ("[2, 8, 16]"): rope_kv_cache_'s messages."""
    return "[" + ", ".join(str(int(x)) for x in v) + "]"


# ---- roles --------------------------------------------------------------------------------------------------


def tensor_arg(op: str, name: str, t, optional: bool = False) -> None:
    if optional and t is None:
        return
    if not isinstance(t, torch.Tensor):
        _or_none = " or None" if optional else ""
        fail_type(op, name, f"must be a torch.Tensor{_or_none}, got {type(t).__name__}")


def eight_bit(op: str, name: str, t) -> None:
    """An 8-bit GEMM operand's dtype."""
    if t.dtype not in AB_DTYPES:
        fail_type(op, name, f"must be int8 or float8_e4m3fn, got {t.dtype}")


def float32_scale(op: str, name: str, t) -> None:
    """A scale's dtype (weight, activation or static scales are float32 whatever the model dtype)."""
    if t is not None and t.dtype != torch.float32:
        fail_type(op, name, f"must be float32, got {t.dtype}")


def float_input(op: str, name: str, t, dtypes=X_DTYPES) -> None:
    if t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        names = " or ".join(names.rsplit(", ", 1))
        fail_type(op, name, f"must be {names}, got {t.dtype}")


def output_dtype(op: str, out_dtype) -> None:
    if out_dtype not in OUT_DTYPES:
        fail_type(op, "out_dtype", f"must be torch.bfloat16 or torch.float16, got {out_dtype}")


def quant_dtype(op: str, dtype) -> None:
    """The target dtype of a quantization."""
    if dtype not in AB_DTYPES:
        fail_type(op, "dtype", f"must be torch.int8 or torch.float8_e4m3fn, got {dtype}")


def same_device(op: str, ref_name: str, ref, others) -> None:
    for name, t in others:
        if t is not None and t.device != ref.device:
            fail_value(op, name, f"is on {t.device} but `{ref_name}` is on {ref.device}")


def contiguous(op: str, name: str, t) -> None:
    if not t.is_contiguous():
        fail_value(op, name, "must be contiguous")


def exact_shape(op: str, name: str, t, dims: str, shape: tuple, note: str = "") -> None:
    """``t.shape`` must be ``shape``; the message writes it as ``[dims] = [values]``, then ``note`` if any
    (e.g. ``"[E, N] = [8, 4096]"``, ``"[T * top_k] = [12] (the end row ...)"``)."""
    if tuple(t.shape) != tuple(shape):
        fail_value(op, name, f"must be [{dims}] = [{', '.join(map(str, shape))}]{' ' + note if note else ''}, "
                   f"got shape {tuple(t.shape)}")


def gemm_shapes(op: str, a_name: str, a, b) -> tuple[int, int, int]:
    """``(M, K, N)`` of a 2-D ``[M, K]`` activation operand (``a`` or ``x``) and a 2-D ``[K, N]`` ``b``."""
    if a.dim() != 2:
        fail_value(op, a_name, f"must be 2-D [M, K], got shape {tuple(a.shape)}")
    if b.dim() != 2:
        fail_value(op, "b", f"must be 2-D [K, N], got shape {tuple(b.shape)}")
    m, k = a.shape
    if b.shape[0] != k:
        fail_value(op, "b", f"must be [K, N] with K = {a_name}.shape[1] = {k}, got shape {tuple(b.shape)}")
    return m, k, b.shape[1]


def gemm_size(op: str, name: str, what: str, v: int) -> None:
    """K or N of a GEMM: a positive multiple of GEMM_ALIGN."""
    if v <= 0 or v % GEMM_ALIGN != 0:
        fail_value(op, name, f"{what} must be a positive multiple of {GEMM_ALIGN}, got {v}")


def int8_k_bound(op: str, name: str, dtype, k: int) -> None:
    if dtype == torch.int8 and k > INT8_MAX_K:
        fail_value(op, name, f"K = {k} can overflow the int32 accumulator; int8 needs K <= {INT8_MAX_K}")


def per_channel_scale(op: str, name: str, scale, n: int) -> None:
    """A weight scale of scaled_mm / linear_decode: [1], [N], [1, N] or [N, 1], contiguous."""
    if not (scale.numel() == 1 or tuple(scale.shape) in ((n,), (1, n), (n, 1))):
        fail_value(op, name, f"must be [1] (per-tensor), [N], [1, N] or [N, 1] (per-channel) with N = {n}, "
                   f"got shape {tuple(scale.shape)}")
    contiguous(op, name, scale)


def block_scale_shaped(n: int, k: int, scale) -> bool:
    """Whether the weight scale ``scale`` of an (N, K) weight has the block shape: 2-D (ceil(N / 128), ceil(K / 128)),
    more than one element, and not a per-channel (N, 1) / (1, N). The shape half of `block_scaled` and
    `block_weight_scaled`; `cutlass_w8a8.W8A8Linear.from_quantized` tells block scales from it."""
    sb = tuple(scale.shape)
    return scale.dim() == 2 and sb == (blocks(n), blocks(k)) and scale.numel() > 1 and sb not in ((n, 1), (1, n))


def block_scaled(a, b, scale_a, scale_b) -> bool:
    """Whether a scaled_mm call is block-scaled fp8 (1 x 128 activation groups, 128 x 128 weight blocks): the one
    detection rule, mirrored by csrc/core/checks.hpp ``is_block_scaled``. With M, K = a.shape, N = b.shape[1],
    KB = ceil(K / 128), NB = ceil(N / 128): ``scale_a`` 2-D with more than one column, or ``scale_b`` of shape
    (NB, KB) with more than one element and not a per-channel (N, 1) / (1, N) (`block_scale_shaped`). False unless
    ``a`` and ``b`` are 2-D. (With K = 128 and N <= 128 the block scales (M, 1) x (1, 1) are per-token x
    per-tensor: the same product, so the rule may call them row-wise.)"""
    if a.dim() != 2 or b.dim() != 2:
        return False
    if scale_a.dim() == 2 and scale_a.shape[1] > 1:
        return True
    return block_scale_shaped(b.shape[1], a.shape[1], scale_b)


def block_weight_scaled(weight, weight_scale) -> bool:
    """Whether w8a8_linear's (N, K) ``weight`` has block scales: e4m3 with a ``weight_scale`` of the block shape
    (`block_scale_shaped`). False unless ``weight`` is 2-D."""
    if weight.dim() != 2 or weight.dtype != torch.float8_e4m3fn:
        return False
    return block_scale_shaped(weight.shape[0], weight.shape[1], weight_scale)


def grouped_block_scaled(scale_b) -> bool:
    """Whether a grouped_scaled_mm call is block-scaled fp8: a 3-D ``scale_b`` [E, ceil(N / 128), K / 128] (row-wise
    ones are [E] or [E, N])."""
    return scale_b.dim() == 3


def block_scales(op: str, a, scale_a, scale_b, m: int, k: int, n: int, experts: Optional[int] = None) -> None:
    """The shape checks of block-scaled scaled_mm (in place of the row-wise scale shapes), in the contract's
    order: e4m3 `a`, K a multiple of 128, scale_a [M, K/128], scale_b [ceil(N/128), K/128]. With ``experts``
    (grouped_scaled_mm) the rows are T and scale_b is [E, ceil(N/128), K/128] with E = ``experts``."""
    rows, lead, lead_shape = ("M", "", ()) if experts is None else ("T", "E, ", (experts,))
    if a.dtype != torch.float8_e4m3fn:
        fail_type(op, "a", f"must be float8_e4m3fn with block scales (scale_a [{rows}, K/128], scale_b "
                  f"[{lead}ceil(N/128), K/128]), got {a.dtype}")
    if k % BLOCK_SIZE != 0:
        fail_value(op, "a", f"K = a.shape[1] must be a multiple of {BLOCK_SIZE} with block scales, got {k}")
    kb, nb = k // BLOCK_SIZE, blocks(n)
    exact_shape(op, "scale_a", scale_a, f"{rows}, K/128", (m, kb), "(1x128 groups) with block scales")
    exact_shape(op, "scale_b", scale_b, f"{lead}ceil(N/128), K/128", (*lead_shape, nb, kb),
                "(128x128 blocks) with block scales")


def static_scale(op: str, x, scale, *, ref_name: str = "x") -> None:
    """A static per-tensor activation scale: a float32 tensor of one value on the device of `x`, the op's
    input named `ref_name` in the device message (``"q"`` for decode_attention_quant)."""
    tensor_arg(op, "scale", scale, optional=True)
    float32_scale(op, "scale", scale)
    same_device(op, ref_name, x, [("scale", scale)])
    if scale.numel() != 1:
        fail_value(op, "scale", f"must hold one value (static per-tensor), got shape {tuple(scale.shape)}")


def bias_vector(op: str, bias, n: int) -> None:
    """A bias operand: None, or a contiguous (N,) vector (its dtype is checked with the output's)."""
    if bias is not None:
        if tuple(bias.shape) != (n,):
            fail_value(op, "bias", f"must be [N] with N = {n}, got shape {tuple(bias.shape)}")
        contiguous(op, "bias", bias)


def row_major(op: str, name: str, t, rows: int, cols: int, cols_name: str, pitch: int,
          form: str = "row-major", always: bool = False) -> None:
    """A row-major matrix [rows, cols] with unit-stride rows, padded rows allowed (a pitch multiple of `pitch`
    elements); the stride(0) checks apply to one row only when `always`."""
    if t.stride(1) != 1:
        fail_value(op, name, f"must be {form} (stride(1) == 1), got strides {t.stride()}")
    if (always or rows > 1) and t.stride(0) < cols:
        fail_value(op, name, f"rows overlap: stride(0) = {t.stride(0)} < {cols_name} = {cols}")
    if (always or rows > 1) and t.stride(0) % pitch != 0:
        fail_value(op, name, f"stride(0) must be a multiple of {pitch} elements, got {t.stride(0)}")


def x_dtype(op: str, name: str, t, x) -> None:
    """`t` (None: nothing to check) has x's dtype; else TypeError "`name` must have x's dtype ..."."""
    if t is not None and t.dtype != x.dtype:
        fail_type(op, name, f"must have x's dtype {x.dtype}, got {t.dtype}")


def eps_type(op: str, eps) -> None:
    """A norm's eps is a Python int or float (not a bool); else TypeError naming `eps`."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        fail_type(op, "eps", f"must be a float, got {type(eps).__name__}")


def aligned16(op: str, name: str, t) -> None:
    if _misaligned(t, 16):
        fail_value(op, name, f"data must be 16-byte aligned (storage offset {t.storage_offset()})")


def _k_major(op: str, b, k: int, k_dim: int, n_dim: int, layout: str) -> None:
    """`b` with unit stride along its K dimension `k_dim` and, along its N dimension `n_dim`, a column pitch of at
    least K elements that is a multiple of GEMM_ALIGN. Raises ValueError on "b": ``layout`` (what b must be) with
    the strides when K is not unit-stride, else the overlap or the pitch alignment."""
    if b.stride(k_dim) != 1:
        fail_value(op, "b", f"{layout}, got strides {b.stride()}")
    if b.stride(n_dim) < k:
        fail_value(op, "b", f"columns overlap: stride({n_dim}) = {b.stride(n_dim)} < K = {k}")
    if b.stride(n_dim) % GEMM_ALIGN != 0:
        fail_value(op, "b", f"stride({n_dim}) must be a multiple of {GEMM_ALIGN} elements, got {b.stride(n_dim)}")


def weight_columns(op: str, b, k: int) -> None:
    """`b` of the GEMMs: (K, N) column-major, i.e. the row-major (N, K) weight as weight.t()."""
    _k_major(op, b, k, 0, 1, "must be column-major [K, N] (the transpose of a row-major [N, K] weight, "
             "stride(0) == 1)")


def expert_weights(op: str, b, k: int, n: int) -> None:
    """`b` of grouped_scaled_mm: (E, K, N) with unit-stride K, i.e. the row-major (E, N, K) expert weights as
    ``w.transpose(1, 2)``; rows of K padded to a multiple of 16 elements and padded experts are fine."""
    _k_major(op, b, k, 1, 2, "must be [E, K, N] with stride(1) == 1 (w.transpose(1, 2) of a row-major [E, N, K] "
             "weight)")
    if b.shape[0] > 1:
        if b.stride(0) < n * b.stride(2):
            fail_value(op, "b", f"experts overlap: stride(0) = {b.stride(0)} < N * stride(2) = {n * b.stride(2)}")
        if b.stride(0) % GEMM_ALIGN != 0:
            fail_value(op, "b", f"stride(0) must be a multiple of {GEMM_ALIGN} elements, got {b.stride(0)}")


def out_matrix(op: str, out, m: int, n: int) -> None:
    """A GEMM destination: (M, N), row-major, rows padded to a multiple of 8 elements, 16-byte aligned."""
    exact_shape(op, "out", out, "M, N", (m, n))
    row_major(op, "out", out, m, n, "N", 8)
    aligned16(op, "out", out)


def decode_m(op: str, name: str, m: int) -> None:
    if not 1 <= m <= DECODE_MAX_M:
        fail_value(op, name, f"M = {name}.shape[0] must be in [1, {DECODE_MAX_M}] (decode sizes; scaled_mm "
                   f"serves any M), got {m}")


def row_input(op: str, x) -> None:
    """`x` of the row-wise ops: a float tensor [..., K] with 0 < K < MAX_ROW_K and at most MAX_ROWS rows."""
    tensor_arg(op, "x", x)
    float_input(op, "x", x)
    if x.dim() < 1:
        fail_value(op, "x", "must have at least one dimension [..., K]")
    k = x.shape[-1]
    if k == 0:
        fail_value(op, "x", f"must have a non-empty last dimension [..., K], got shape {tuple(x.shape)}")
    if k >= MAX_ROW_K:
        fail_value(op, "x", f"K = {k} must be below {limit_text(MAX_ROW_K)}")
    rows = x.numel() // k
    if rows > MAX_ROWS:
        fail_value(op, "x", f"has {rows} rows; at most {limit_text(MAX_ROWS)} are supported")


def flat_row_stride(t: torch.Tensor) -> Optional[int]:
    """Stride between the rows of ``t`` seen as ``[M, K]`` without a copy (unit-stride rows whose leading
    dimensions merge), or None when that view does not exist. A ``[K]`` tensor is one row."""
    k = t.shape[-1]
    if k > 1 and t.stride(-1) != 1:
        return None
    stride = nxt = None
    for d in range(t.dim() - 2, -1, -1):
        if t.shape[d] == 1:
            continue
        if stride is not None and t.stride(d) != nxt:
            return None
        if stride is None:
            stride = t.stride(d)
        nxt = t.stride(d) * t.shape[d]
    return k if stride is None else stride
