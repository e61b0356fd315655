"""The attention ops' public wrappers: `decode_attention`, `decode_attention_quant` and `rope_kv_cache_`.

Each wrapper calls its op once and returns; the op checks its arguments (C++ on CUDA, `_checks.py` on the CPU
and in the fake kernels) and raises errors that name the op and the argument (docs/MISUSE.md).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from ._schema import OVERLOADS as _op

__all__ = ["decode_attention", "decode_attention_quant", "rope_kv_cache_"]


def decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    softmax_scale: Optional[float] = None,
    *,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Decode-step attention: one query token per sequence over positions ``0..positions[b]`` of its cache slot.

    For row ``b`` and query head ``h``, with ``G = H / KVH`` and key/value head ``kvh = h // G``::

        K, V = kv_cache[slots[b], 0, kvh], kv_cache[slots[b], 1, kvh]            # (S, D) each
        p = softmax(softmax_scale * K[:positions[b] + 1] @ q[b, h])               # float32, max-subtracted
        out[b, h * D:(h + 1) * D] = round(p @ V[:positions[b] + 1])               # rounded once to q's dtype

    Only those positions of those slots are read, so the cost grows with the real batch and the real sequence
    lengths, not with the cache's size (grouped-query attention without repeating the key/value heads).

    Parameters
    ----------
    q : torch.Tensor
        ``(B, H, D)``, bfloat16, float16 or float32. Any strides with ``stride(2) == 1``: e.g. the query heads
        of a fused qkv projection, ``qkv.view(B, H + 2 * KVH, D)[:, :H]`` (``stride(0) = (H + 2 KVH) D``).
        ``D`` a multiple of 8 in [8, 256].
    kv_cache : torch.Tensor
        ``(num_slots, 2, KVH, S, D)`` in ``q``'s dtype, contiguous, 16-byte aligned: index 0 of dimension 1
        holds the keys, 1 the values. ``KVH`` divides ``H``.
    slots : torch.Tensor
        ``(B,)`` int64 on ``q``'s device (any stride): the cache slot of each row, in ``[0, num_slots)``.
    positions : torch.Tensor
        ``(B,)`` int64 on ``q``'s device (any stride): the position of each row's token, in ``[0, S)``; the row
        attends to positions ``0..positions[b]`` inclusive (its own key and value must already be written).
    softmax_scale : float, optional
        Multiplies the scores before the softmax; default ``1 / sqrt(D)``. Finite.
    out : torch.Tensor, optional
        ``(B, H * D)`` contiguous destination in ``q``'s dtype, written in place and returned (static
        buffers, CUDA graphs).

    Returns
    -------
    torch.Tensor
        ``(B, H * D)``, contiguous, ``q``'s dtype and device: the heads of a row side by side, as
        ``o_proj`` takes them.

    Raises
    ------
    TypeError
        A wrong dtype (``q``, ``kv_cache``, ``slots``, ``positions``, ``out``).
    ValueError
        A wrong shape, stride, alignment, device, head dimension or ``softmax_scale``; the message names the
        argument.
    RuntimeError
        An argument is not of its schema type (a non-tensor, a ``softmax_scale`` that is not a number: torch's
        dispatcher names it); CUDA tensors were given but the CUDA extension is not built.

    Notes
    -----
    The values of ``slots`` and ``positions`` are not checked: that would need a device-to-host
    synchronisation (callers such as `cutlass_w8a8.runner.DecodeGraphRunner` check them on the host). On the
    GPU, out-of-range values are clamped into range (a wrong result, never an out-of-bounds read); on the CPU,
    an out-of-range slot raises from ``index_select`` and an out-of-range position gives an unspecified
    result.

    CUDA kernels (csrc/attention/decode_attention.cu), split-KV ("flash-decoding" [2]_), two launches on the
    current stream (or the one of 3. below), no host synchronisation, all with programmatic dependent launch when
    PDL is on (`cutlass_w8a8.pdl_enabled`):

    1. ``decode_attention_split_kernel``, grid ``(B, H / G', splits)``: a block takes row ``b``, the ``G'``
       query heads that share one key/value head (``G'`` the largest of 8, 4, 2, 1 dividing ``G = H / KVH``
       and at most ``CUTLASS_W8A8_ATTN_HEADS_PER_CTA``, default 4, so each key/value row is read once for those
       heads) and one contiguous chunk of the positions ``0..positions[b]``, and keeps an online softmax over it
       (a running maximum, a running sum and a float32 accumulator, rescaled when the maximum grows: Milakov &
       Gimelshein [1]_). The chunk bounds are computed on the device from ``positions[b]``; the number of splits
       is chosen from ``B``, ``H``, ``KVH``, ``S``, the SM count and the split kernel's occupancy (by default the
       count with the fewest waves of resident blocks times positions per block; ``CUTLASS_W8A8_ATTN_SPLITS=ctas``:
       about ``CUTLASS_W8A8_ATTN_CTAS_PER_SM``, default 2, blocks per SM; ``CUTLASS_W8A8_ATTN_MIN_CHUNK`` and
       ``CUTLASS_W8A8_ATTN_HEADS_PER_CTA``: per-process A/B knobs, csrc/attention/decode_attention.cu), never from
       the positions, so a CUDA graph stays valid when the positions change between replays. It writes float32
       partials (maximum, sum, accumulator) per ``(b, h, split)`` to a workspace from torch's caching allocator.
    2. ``decode_attention_combine_cluster_kernel``, grid ``(B, 8)``: a cluster of 8 blocks per row (sm90,
       ``H * D <= 8192``), each merging the splits of its eighth of the row's ``H * D`` outputs, rescaled to their
       head's common maximum, and rounding them once to ``q``'s dtype. Elsewhere (other archs, longer rows, or
       ``CUTLASS_W8A8_ATTN_COMBINE=row``) ``decode_attention_combine_kernel``, grid ``(B,)``: one block per row
       does the same. Both give the same bits.
    3. ``decode_attention_fused_kernel`` instead of both, where a row's ``H / G' x splits`` (head group, split)
       units fit one thread-block cluster of at most 16 blocks (sm90, 16-bit ``q``, ``32 < D <= 128``; e.g.
       Qwen3-30B-A3B's 32 / 4 heads, 8 groups of 4 at the default cap, at ``S = 128``: at most 4 splits, 8 x 4
       units): the units run the split
       kernel's code into shared memory and the cluster merges them through distributed shared memory with the
       combine kernel's code, in one launch and without the workspace. Same splits, same operations in the same
       order: the same bits as 1. + 2. (``cutlass_w8a8._ext.decode_attention_path`` names the path a shape
       takes). Off by default (``cutlass_w8a8._ext.set_decode_attention_fused(True)`` allows it): on an H200 it
       was 1.05x the two kernels at Qwen3-30B-A3B B = 1, S = 512 and 0.39-0.65x at B >= 8
       (bench/results/decode_attention_nvidia-h200.md).

    All kernels index rows by ``blockIdx.x`` and row ``b`` reads only row ``b``'s inputs and writes only its
    output (row-wise kernels whose CUDA-graph nodes can be shrunk to fewer rows). The CPU implementation is the
    former reference math: ``index_select`` of the B slots, then ``F.scaled_dot_product_attention`` over all S
    positions with an additive ``-inf`` mask. The two agree to rounding (the order of the float32 sums
    differs). :func:`decode_attention_quant` is this op with its output quantized in the combine kernel.

    References
    ----------
    .. [1] M. Milakov and N. Gimelshein, "Online normalizer calculation for softmax", arXiv:1805.02867, 2018.
    .. [2] T. Dao, D. Haziza, F. Massa and G. Sizov, "Flash-Decoding for long-context inference", 2023.

    Examples
    --------
    >>> qkv = qkv_proj(x).view(B, H + 2 * KVH, D)           # rotary already applied, new K/V written
    >>> attn = decode_attention(qkv[:, :H], kv_cache, slots, positions)    # (B, H * D)
    >>> y = o_proj(attn)
    """
    if softmax_scale is None:
        softmax_scale = _default_scale(q)
    if out is None:
        return _op.decode_attention(q, kv_cache, slots, positions, softmax_scale)
    _op.decode_attention_out(out, q, kv_cache, slots, positions, softmax_scale)
    return out


def _default_scale(q) -> float:
    """SDPA's default softmax scale, 1 / sqrt(D); 1.0 for a `q` the op will reject anyway (it names the error)."""
    valid = isinstance(q, torch.Tensor) and q.dim() == 3 and q.shape[2] > 0
    return 1.0 / math.sqrt(q.shape[2]) if valid else 1.0


def decode_attention_quant(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    softmax_scale: Optional[float] = None,
    dtype: torch.dtype = torch.int8,
    scale: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`decode_attention` fused with the quantization of its output: the activation of a W8A8 ``o_proj``.

    Exactly the composition::

        y = decode_attention(q, kv_cache, slots, positions, softmax_scale)    # (B, H * D), rounded to q's dtype
        q_out, s = quantize_per_token(y, dtype)              # scale None: s = max|y_b| / QMAX per row
        q_out = quantize_per_tensor(y, scale, dtype)         # a static scale

    with QMAX 127 (int8) or 448 (float8_e4m3fn). The attention output is rounded to ``q``'s dtype before it is
    quantized, as the unfused chain stores it, so on one device the fused op equals the chain bit for bit
    (on the CPU by construction; on the GPU the combine kernel rounds the row, then quantizes it as the
    quantization kernels do). One op call and one kernel fewer per decoder layer than the chain, and the
    rounded float row never goes to memory. `cutlass_w8a8.models.LlamaAttention` calls it when its ``o_proj`` is a `W8A8Linear`.

    Parameters
    ----------
    q, kv_cache, slots, positions, softmax_scale
        As :func:`decode_attention`: ``q`` ``(B, H, D)`` bfloat16, float16 or float32 (``stride(2) == 1``,
        e.g. a strided view of a fused qkv output), ``kv_cache`` ``(num_slots, 2, KVH, S, D)`` in ``q``'s
        dtype, contiguous; ``slots`` and ``positions`` ``(B,)`` int64; ``softmax_scale`` default
        ``1 / sqrt(D)``.
    dtype : torch.dtype
        ``torch.int8`` (default) or ``torch.float8_e4m3fn``: the ``quant_dtype`` of the consuming layer.
    scale : torch.Tensor, optional
        float32 with one element (static per-tensor, e.g. ``o_proj.input_scale``), on ``q``'s device.
        None: dynamic per-token.

    Returns
    -------
    (q_out, scale) : tuple of torch.Tensor
        ``q_out``: ``(B, H * D)`` in ``dtype``, contiguous, ``q``'s device: the heads of a row side by side,
        as ``o_proj`` takes them. ``scale``: float32 ``(B, 1)`` per-token scales (dynamic), or the given
        ``scale`` object (static), as :func:`rms_norm_quant` returns them; either way what `W8A8Linear`
        takes as a `QuantizedActivation` with ``q_out``.

    Raises
    ------
    TypeError
        As :func:`decode_attention` (with the op name ``decode_attention_quant``); ``dtype`` not int8 /
        float8_e4m3fn; ``scale`` not float32.
    ValueError
        As :func:`decode_attention`; ``scale`` not one element or on another device than ``q``.
    RuntimeError
        An argument is not of its schema type (torch's dispatcher names it); CUDA tensors were given but the
        CUDA extension is not built.

    Notes
    -----
    The checks run in this order, with these messages on every device (docs/MISUSE.md): decode_attention's
    (without ``out``), then ``dtype``, then ``scale``. The values of ``slots`` and ``positions`` are not
    checked (see :func:`decode_attention`). A row whose attention output is not finite gets an unspecified
    ``q_out`` and scale, as the quantization ops document; other rows are unaffected. The op itself
    (``torch.ops.cutlass_w8a8.decode_attention_quant``) returns per-row scales in both modes: in the static
    one the given value repeated, ``(B, 1)``.

    CUDA: :func:`decode_attention`'s two split-KV kernels; the combine kernel (a cluster of 8 blocks per row on
    sm90, else one block) rounds the merged row to ``q``'s dtype, then quantizes it (the row's absolute maximum,
    a max over the cluster's blocks, then each element divided by the scale, rounded half to even and saturated)
    and writes ``q_out`` and the row's scale. Row-wise, no host
    synchronisation, CUDA-graph safe with positions that change between replays.

    Examples
    --------
    >>> qkv = qkv_proj(x).view(B, H + 2 * KVH, D)           # rotary already applied, new K/V written
    >>> q8, s = decode_attention_quant(qkv[:, :H], kv_cache, slots, positions, dtype=o_proj.quant_dtype,
    ...                                scale=o_proj.input_scale)
    >>> y = o_proj(QuantizedActivation(q8, s))             # the GEMM only: no second quantization
    """
    if softmax_scale is None:
        softmax_scale = _default_scale(q)
    q_out, s = _op.decode_attention_quant(q, kv_cache, slots, positions, softmax_scale, dtype, scale)
    return q_out, (s if scale is None else scale)


def rope_kv_cache_(
    qkv: torch.Tensor,
    rope: torch.Tensor,
    kv_cache: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    q_norm: Optional[torch.Tensor] = None,
    k_norm: Optional[torch.Tensor] = None,
    eps: float = -1.0,
) -> None:
    """Rotary embedding of a decode step's query and key heads, in place, and the write of its key and value
    heads into the slot cache: the glue between the qkv projection and :func:`decode_attention`.

    For row ``b``, with ``H = num_heads``, ``KVH = num_kv_heads``, ``(cos_j, sin_j) = rope[b, j]``, the rotary
    width ``R = 2 * rope.shape[1]`` (``R == D``, or ``R < D`` for partial rotary: GLM-4.5's
    ``partial_rotary_factor``) and heads ordered q, k, v (vLLM's ``QKVParallelLinear``)::

        if q_norm is not None:                                    # Qwen3's head norms, first
            qkv[b, n] = rms_norm(qkv[b, n], q_norm, eps)  for n < H           # rounded to qkv's dtype
            qkv[b, n] = rms_norm(qkv[b, n], k_norm, eps)  for H <= n < H + KVH
        for each head x = qkv[b, n], n < H + KVH, j < R/2:        # the "neox" rotation of (x[j], x[j + R/2])
            x[j], x[j + R/2] = x[j] cos_j - x[j + R/2] sin_j, x[j + R/2] cos_j + x[j] sin_j    # float32
            # x[R:] is left as it is (normalized, with the norms): transformers' q_pass / k_pass
        kv_cache[slots[b], 0, g, positions[b]] = qkv[b, H + g]         # the rotated key heads, g < KVH
        kv_cache[slots[b], 1, g, positions[b]] = qkv[b, H + KVH + g]   # the value heads

    Each rotated element is computed in float32 and rounded once to ``qkv``'s dtype; only the written cache
    entries change (all ``D`` elements of each k and v head). `cutlass_w8a8.models.LlamaAttention` calls it on its qkv projection's output before
    :func:`decode_attention`.

    Parameters
    ----------
    qkv : torch.Tensor
        ``(B, num_heads + 2 * num_kv_heads, D)``, bfloat16, float16 or float32, with contiguous heads of even
        ``D`` (strides ``(*, D, 1)``: rows may be padded, e.g. the output of a wider projection). Updated in
        place: its q and k heads are rotated.
    rope : torch.Tensor
        ``(B, R / 2, 2)`` float32, contiguous, ``1 <= R / 2 <= D / 2``: ``(cos, sin)`` of each row's position for
        frequency ``j``; its second dimension sets the rotary width ``R`` (as vLLM's ``rot_dim``).
    kv_cache : torch.Tensor
        ``(num_slots, 2, num_kv_heads, S, D)`` in ``qkv``'s dtype, contiguous, ``num_slots, S >= 1``: index 0
        of dimension 1 holds the keys, 1 the values (the layout :func:`decode_attention` reads). Written in
        place at ``(slots[b], :, :, positions[b])``.
    slots : torch.Tensor
        ``(B,)`` int64 (any stride): the cache slot of each row, in ``[0, num_slots)``.
    positions : torch.Tensor
        ``(B,)`` int64 (any stride): the position of each row's token, in ``[0, S)``.
    num_heads, num_kv_heads : int
        Query heads ``H`` and key/value heads ``KVH``, both positive.
    q_norm, k_norm : torch.Tensor, optional
        Both or neither: ``(D,)`` contiguous weights in ``qkv``'s dtype (Qwen3's ``q_norm`` / ``k_norm``). Each q
        head (k head) is first replaced by `cutlass_w8a8.rms_norm` of it with ``q_norm`` (``k_norm``) and ``eps``, float32
        inside and rounded once to ``qkv``'s dtype, and the rotation reads those values: the chain ``rms_norm``,
        copy back, ``rope_kv_cache_`` in one kernel. On the CUDA device the sum of squares runs in the kernel's
        own order, so a normalized element can differ from ``rms_norm``'s in the last bit where its float32
        value lies within a few roundings of a tie; on the CPU it is that chain.
    eps : float
        The norms' epsilon, a finite number >= 0; required with ``q_norm`` (the default -1.0 means "not given").

    Returns
    -------
    None
        ``qkv`` and ``kv_cache`` are modified in place.

    Raises
    ------
    TypeError
        ``qkv`` not bfloat16 / float16 / float32, ``kv_cache``, ``q_norm`` or ``k_norm`` not in ``qkv``'s dtype,
        ``rope`` not float32, ``slots`` or ``positions`` not int64.
    ValueError
        The tensors on different devices, a non-positive head count, a wrong shape or layout, only one of
        ``q_norm`` / ``k_norm``, or norms without a valid ``eps``; the message names the argument
        (csrc/attention/rope_kv_cache.cu's wording: C++ dtype names, sizes in brackets).
    RuntimeError
        An argument that is not a tensor (torch's dispatcher), or CUDA tensors when the CUDA extension is not
        built.

    Notes
    -----
    The values of ``slots`` and ``positions`` are not checked (a device-to-host synchronisation): the CUDA
    kernel clamps them into range (a wrong entry, never a write outside the cache); on the CPU an
    out-of-range value raises from ``index_put_`` or writes another entry. CUDA kernel: one block per
    (row, head), one launch on the current stream, no host synchronisation; its CUDA-graph node is row-wise.
    The CPU implementation is the torch code it replaced (a float32 complex multiply, then ``index_put_``).

    Examples
    --------
    >>> qkv = qkv_proj(x).view(B, H + 2 * KVH, D)
    >>> rope_kv_cache_(qkv, rope_table.index_select(0, positions), kv_cache, slots, positions, H, KVH)
    >>> attn = decode_attention(qkv[:, :H], kv_cache, slots, positions)
    """
    _op.rope_kv_cache_(qkv, rope, kv_cache, slots, positions, num_heads, num_kv_heads, q_norm, k_norm, eps)
