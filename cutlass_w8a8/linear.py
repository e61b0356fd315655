"""`W8A8Linear`, a drop-in replacement for `nn.Linear`; `quantize_` (cutlass_w8a8/quantize.py) swaps it in. Also the
one rule of which Linears can be quantized (`shape_supported`, `refuse_quantized_weight`).

Weights are quantized once, symmetric per output channel; activations are quantized on every call, dynamic
per-token (or static per-tensor with a calibrated `input_scale`). Block-scaled fp8 layers
(``weight_block_size=(128, 128)``, DeepSeek-V3's format) hold one weight scale per 128 x 128 block and quantize
activations per 1 x 128 group. The GEMM dequantizes in its epilogue (`cutlass_w8a8.scaled_mm`). Activations
already quantized by a fused op (`cutlass_w8a8.rms_norm_quant`, `cutlass_w8a8.silu_mul_quant`) are passed as a
`QuantizedActivation` instead of a float tensor.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch
from torch import nn

from .config import W8A8Config
from .ops._limits import AB_DTYPES as _QUANT_DTYPES
from .ops._checks import check_fp8_fast_accum
from .ops._limits import BLOCK_SIZE, FP8_FAST_ACCUM, GEMM_ALIGN, QMAX, blocks
from .ops._limits import OUT_DTYPES as _OUT_DTYPES
from .ops._reference import quantize_rows
from .ops._roles import block_scale_shaped
from .ops._schema import OVERLOADS as _op

__all__ = ["QuantizedActivation", "W8A8Linear", "quantize_activations", "quantize_weight_blocks", "shape_supported",
           "refuse_quantized_weight"]

# The ops' overloads, looked up once (ops/_schema.OVERLOADS): W8A8Linear.forward is on the host-bound path of
# small batches.
_w8a8_linear = _op.w8a8_linear


def shape_supported(out_features: int, in_features: int, weight_block_size: Optional[tuple] = None) -> bool:
    """Whether a Linear of these sizes can be a `W8A8Linear` (the one "can this Linear be quantized" rule, shared
    by `W8A8Linear`, `quantize_`, the tensor-parallel shard checks and the checkpoint loader): N and K positive
    multiples of 16 (``ops._limits.GEMM_ALIGN``, the GEMM kernels' alignment); with ``weight_block_size``
    (block-scaled fp8) also K a multiple of 128 (``ops._limits.BLOCK_SIZE``: 1 x 128 activation groups; N's last
    block may be partial)."""
    if weight_block_size is not None and (in_features <= 0 or in_features % BLOCK_SIZE != 0):
        return False
    return all(v > 0 and v % GEMM_ALIGN == 0 for v in (out_features, in_features))


_8BIT_DTYPES = tuple(getattr(torch, n) for n in ("int8", "uint8", "float8_e4m3fn", "float8_e5m2",
                                                 "float8_e4m3fnuz", "float8_e5m2fnuz") if hasattr(torch, n))


def refuse_quantized_weight(where: str, linear: nn.Module, fqn: Optional[str] = None) -> None:
    """Raise when a Linear already holds quantized weights: quantizing its integers again as if they were
    floats gives a silently wrong model (int8 values loaded into nn.Linear by a loader that ignored the
    checkpoint's scales, or a compressed-tensors layer that transformers has not decompressed yet)."""
    w = getattr(linear, "weight", None)
    if isinstance(w, torch.Tensor) and (w.dtype in _8BIT_DTYPES or not w.is_floating_point()):
        raise TypeError(
            f"{where}: `linear`{f' {fqn}' if fqn else ''} already holds {w.dtype} weights (a quantized checkpoint loaded into "
            "nn.Linear?); quantizing them again would treat the integers as float weights and ignore their "
            "scales. Load the checkpoint with cutlass_w8a8.from_pretrained(path) instead.")


def quantize_activations(x2: torch.Tensor, input_scale: Optional[torch.Tensor], quant_dtype: torch.dtype,
                         group_size: int = 0):
    """``(q, scale)`` of ``(M, K)`` activations as `W8A8Linear` quantizes them: dynamic per-token (``scale``
    ``(M, 1)``) when ``input_scale`` is None, else static per-tensor with it (``scale`` is ``input_scale``);
    with ``group_size`` 128 (a block-scaled layer's ``group_size``) dynamic per 1 x 128 group (``scale``
    ``(M, K / 128)``)."""
    if group_size:
        return _op.quantize_per_token_group(x2, group_size, quant_dtype)
    if input_scale is None:
        return _op.quantize_per_token(x2, quant_dtype)
    return _op.quantize_per_tensor(x2, input_scale, quant_dtype), input_scale


def _check_block_operands(weight, weight_scale, input_scale, block) -> tuple:
    """from_quantized with block scales: ``block`` validated by `W8A8Config.check_weight_block_size` (returned as a
    tuple), then the weight's dtype, the scales' shape, K and the absent input_scale."""
    where = "W8A8Linear.from_quantized"
    n, k = weight.shape
    block = W8A8Config.check_weight_block_size(where, block, None)
    if weight.dtype != torch.float8_e4m3fn:
        raise TypeError(f"{where}: `weight` must be float8_e4m3fn with 128x128 block scales, got {weight.dtype}")
    if isinstance(weight_scale, torch.Tensor) and tuple(weight_scale.shape) != (blocks(n), blocks(k)):
        raise ValueError(f"{where}: `weight_scale` must be [ceil(N/128), ceil(K/128)] = [{blocks(n)}, {blocks(k)}] "
                         f"(128x128 blocks) for N = {n}, K = {k}, got shape {tuple(weight_scale.shape)}")
    if k % BLOCK_SIZE != 0:
        raise ValueError(f"{where}: `weight` K = {k} must be a multiple of {BLOCK_SIZE} with block scales (the "
                         f"activations' 1x{BLOCK_SIZE} groups); such a layer stays in float")
    if input_scale is not None:
        raise ValueError(f"{where}: `input_scale` must be None with block weight scales (activations are quantized "
                         f"per 1x{BLOCK_SIZE} group at run time), got a tensor")
    return block


def _check_block(where: str, weight_block_size, quant_dtype, in_features: int, static_input_scale: bool) -> tuple:
    """``weight_block_size`` as a tuple, validated by `W8A8Config.check_weight_block_size`, after the checks of a
    block-scaled layer (each names its argument)."""
    block = W8A8Config.check_weight_block_size(where, weight_block_size, quant_dtype, "quant_dtype")
    if in_features % BLOCK_SIZE != 0:
        raise ValueError(f"{where}: `in_features` must be a multiple of {BLOCK_SIZE} with weight_block_size "
                         f"(1x{BLOCK_SIZE} activation groups), got {in_features}")
    if static_input_scale:
        raise ValueError(f"{where}: `static_input_scale` must be False with weight_block_size (activations are "
                         f"quantized per 1x{BLOCK_SIZE} group at run time)")
    return block


def quantize_weight_blocks(weight: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn):
    """``(q, scale)`` of a float ``(N, K)`` weight quantized per 128 x 128 block (block-scaled fp8, DeepSeek-V3's
    format): ``scale[i, j] = max |weight[128 i : 128 (i + 1), 128 j : 128 (j + 1)]| / QMAX`` (float32, IEEE
    division; QMAX 448 for float8_e4m3fn, 127 for int8) and ``q = sat(round_half_even(weight / scale))`` in
    float32, the per-token rules applied per block; a block of zeros gets scale 0 and q = 0. The last row / column
    blocks may be partial. ``q``: ``dtype`` ``(N, K)`` contiguous; ``scale``: float32 ``(ceil(N / 128),
    ceil(K / 128))``, N-major (the checkpoints' ``weight_scale_inv`` layout). Plain torch on ``weight``'s device,
    the same bits on the CPU and on CUDA."""
    n, k = weight.shape
    nb, kb = blocks(n), blocks(k)
    padded = weight.new_zeros((nb * BLOCK_SIZE, kb * BLOCK_SIZE), dtype=torch.float32)
    padded[:n, :k] = weight.to(torch.float32)
    tiles = padded.view(nb, BLOCK_SIZE, kb, BLOCK_SIZE)
    scale = tiles.abs().amax(dim=(1, 3)) / torch.tensor(QMAX[dtype], dtype=torch.float32, device=weight.device)
    q = quantize_rows(tiles, scale.view(nb, 1, kb, 1), dtype).view(nb * BLOCK_SIZE, kb * BLOCK_SIZE)
    return q[:n, :k].contiguous(), scale


def quantization_repr(weight_block_size, static_input_scale: bool) -> str:
    """The tail of W8A8Linear's and W8A8MoE's ``extra_repr``: ``", weight_block_size=[bn, bk]"`` when the weights
    are block-scaled (else nothing), then ``", activations=..."``: dynamic per-group (1x128) with block weights,
    else static per-tensor when the layer holds an input scale, else dynamic per-token."""
    if weight_block_size is not None:
        act = f"dynamic per-group (1x{BLOCK_SIZE})"
    else:
        act = "static per-tensor" if static_input_scale else "dynamic per-token"
    block = "" if weight_block_size is None else f", weight_block_size={weight_block_size}"
    return f"{block}, activations={act}"


class QuantizedActivation(NamedTuple):
    """Activations already quantized for a `W8A8Linear`, accepted by its ``forward`` in place of ``x``.

    Produce them the way the layer would (`W8A8Linear.quantize_input`), or with a fused op given the layer's
    ``quant_dtype`` and ``input_scale``, e.g. ``QuantizedActivation(*rms_norm_quant(h, w, eps,
    layer.quant_dtype, layer.input_scale))``: then the layer's output equals its output on the float input
    that the fused op quantized.

    Attributes
    ----------
    q : torch.Tensor
        ``(..., K)``, int8 or float8_e4m3fn (the layer's ``quant_dtype``), on the layer's device.
    scale : torch.Tensor
        float32: ``(..., 1)`` per-token scales (one per row of ``q``), or one element (per-tensor, e.g. the
        layer's static ``input_scale``). ``x ~= q * scale``. For a block-scaled layer: ``(..., K / 128)``, one
        per 1 x 128 group of each row (``quantize_per_token_group``, or a fused op with ``group_size=128``),
        ``x[..., k] ~= q[..., k] * scale[..., k // 128]``.
    """

    q: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        """``q.shape``: the shape of the float activations this stands for (so code that reads ``x.shape``
        before calling the layer keeps working)."""
        return self.q.shape

    @property
    def device(self) -> torch.device:
        """``q.device``."""
        return self.q.device


class W8A8Linear(nn.Module):
    """``y = x @ W^T + b`` with 8-bit weights and activations.

    Buffers (all saved in ``state_dict``):

    - ``weight``: ``(out_features, in_features)`` = ``(N, K)``, int8 or float8_e4m3fn, row-major; passed to
      the GEMM as ``weight.t()`` without a copy.
    - ``weight_scale``: float32, ``(N,)`` per-channel symmetric (``W[n, :] ~= weight[n, :] * weight_scale[n]``,
      the default) or ``(1,)`` per-tensor (``per_channel=False``); with ``weight_block_size=(128, 128)``
      ``(ceil(N / 128), K / 128)``, one per 128 x 128 block (``W[n, k] ~= weight[n, k] *
      weight_scale[n // 128, k // 128]``), saved as is (compressed-tensors' FP8_BLOCK ``weight_scale``).
    - ``bias``: ``(N,)`` in ``dtype``, or None.
    - ``input_scale``: ``(1,)`` float32 static per-tensor activation scale, present only when
      ``static_input_scale=True``; otherwise activations are quantized dynamically per token.

    ``state_dict`` uses compressed-tensors' layout (what llm-compressor writes and vLLM reads): a per-channel
    ``weight_scale`` is saved as ``(N, 1)``. Loading accepts ``(N,)``, ``(N, 1)``, ``(1, N)`` or one value, in
    any float dtype (cast to float32, exact for bf16 / fp16), and may switch the layer between per-channel and
    per-tensor weight scales; a ``weight`` of another dtype than the layer's is an error, not a cast. A
    block-scaled layer saves and loads its ``(ceil(N / 128), K / 128)`` ``weight_scale`` as is (any float dtype
    loaded, cast to float32), with no ``input_scale`` key.

    Dtype casts (``.to(dtype)``, ``.half()``, ``.bfloat16()``, ``.float()``, a model's ``.to(torch.float16)``)
    never touch the 8-bit ``weight`` or the float32 scales, as torchao's quantized tensors behave: a cast to
    bfloat16 or float16 changes the layer's ``dtype`` (its GEMM output and ``bias``); a cast to float32 or
    float64 leaves the layer as it is (its output still follows the input's dtype). Device moves apply to
    every buffer.

    Parameters
    ----------
    in_features, out_features : int
        K and N; both must be positive multiples of 16.
    bias : bool
        Whether the layer has a bias.
    device : torch.device, optional
    dtype : torch.dtype
        Output and bias dtype, ``torch.bfloat16`` (default) or ``torch.float16``. Inputs of another
        floating dtype are accepted and the output is cast back to it.
    quant_dtype : torch.dtype
        ``torch.int8`` (default) or ``torch.float8_e4m3fn``.
    static_input_scale : bool
        Quantize activations with the fixed ``input_scale`` buffer instead of per token.
    per_channel : bool
        ``weight_scale`` holds one scale per output channel ``(N,)`` (default) or one for the tensor ``(1,)``.
        Ignored with ``weight_block_size``.
    weight_block_size : tuple of int, optional
        ``(128, 128)``: block-scaled fp8 (DeepSeek-V3 / Qwen3-FP8 / compressed-tensors ``FP8_BLOCK``): one weight
        scale per 128 x 128 block, activations quantized dynamically per 1 x 128 group. Needs
        ``quant_dtype=torch.float8_e4m3fn``, K a multiple of 128 (N any multiple of 16: the last row block may
        be partial) and no static input scale; the GEMM needs an sm90 GPU. None (default): row-wise scales.
    fp8_fast_accum : bool
        Row-wise fp8 layers on sm90: True runs the fast-accumulation GEMMs, False the accurate ones (promoted every
        128 of K; `cutlass_w8a8.scaled_mm` gives the measured error and cost). Ignored by int8 and block-scaled
        layers. Default ``cutlass_w8a8.ops._limits.FP8_FAST_ACCUM``; also an attribute that may be set later.

    Shapes: input ``(..., K)``, output ``(..., N)``. The input is a float tensor (quantized here, then cast
    back: the output has the input's dtype) or a `QuantizedActivation` (output in ``dtype``).

    Attributes
    ----------
    quant_dtype : torch.dtype
        The activation (and weight) dtype: what a `QuantizedActivation` given to ``forward`` must hold, and
        the ``dtype`` to give a fused quantizing op (`cutlass_w8a8.rms_norm_quant`, ...).
    input_scale : torch.Tensor or None
        The static per-tensor activation scale (``(1,)`` float32 buffer), or None for dynamic per-token
        quantization: the ``scale`` to give a fused quantizing op.
    weight_block_size : tuple of int or None
        ``(128, 128)`` for a block-scaled layer, else None.
    fp8_fast_accum : bool
        What the layer's GEMMs pass as ``scaled_mm``'s / ``w8a8_linear``'s ``fp8_fast_accum``.
    group_size : int
        The ``group_size`` to give a fused quantizing op (`cutlass_w8a8.rms_norm_quant`, ...): 128 for a
        block-scaled layer (its activations are 1 x 128 groups), else 0.

    Raises
    ------
    ValueError
        K or N is not a positive multiple of 16; at call time, the input has no dimension (0-d) or its last
        dimension is not K. With ``weight_block_size``: it is not (128, 128), ``quant_dtype`` is not
        float8_e4m3fn, K is not a multiple of 128, or ``static_input_scale`` is set.
    TypeError
        ``dtype`` or ``quant_dtype`` is not supported, or ``fp8_fast_accum`` is not a bool; at call time, the input is
        neither a tensor nor a `QuantizedActivation` (a list).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None,
                 dtype: torch.dtype = torch.bfloat16, quant_dtype: torch.dtype = torch.int8,
                 static_input_scale: bool = False, per_channel: bool = True,
                 weight_block_size: Optional[tuple] = None, fp8_fast_accum: bool = FP8_FAST_ACCUM):
        super().__init__()
        check_fp8_fast_accum("W8A8Linear", fp8_fast_accum)
        for name, v in (("in_features", in_features), ("out_features", out_features)):
            if not shape_supported(v, v):
                raise ValueError(f"W8A8Linear: `{name}` must be a positive multiple of 16, got {v}")
        if dtype not in _OUT_DTYPES:
            raise TypeError(f"W8A8Linear: `dtype` must be torch.bfloat16 or torch.float16, got {dtype}")
        if quant_dtype not in _QUANT_DTYPES:
            raise TypeError(f"W8A8Linear: `quant_dtype` must be torch.int8 or torch.float8_e4m3fn, got {quant_dtype}")
        if weight_block_size is not None:
            weight_block_size = _check_block("W8A8Linear", weight_block_size, quant_dtype, in_features,
                                             static_input_scale)
        self.in_features = in_features
        self.out_features = out_features
        self.dtype = dtype
        self.quant_dtype = quant_dtype
        self.weight_block_size = weight_block_size
        self.fp8_fast_accum = fp8_fast_accum
        if weight_block_size is not None:
            scale_shape = (blocks(out_features), in_features // BLOCK_SIZE)
        else:
            scale_shape = (out_features if per_channel else 1,)
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=quant_dtype, device=device))
        self.register_buffer("weight_scale", torch.ones(scale_shape, dtype=torch.float32, device=device))
        # bias and input_scale are buffers even when absent (None): forward reads all operands from _buffers
        self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=device) if bias else None)
        self.register_buffer("input_scale",
                             torch.ones(1, dtype=torch.float32, device=device) if static_input_scale else None)

    @classmethod
    def from_float(cls, linear: nn.Linear, config: Optional[W8A8Config] = None,
                   input_scale: Optional[torch.Tensor] = None) -> "W8A8Linear":
        """Quantize a float ``nn.Linear``: weights per-channel symmetric (absmax / 127, or / 448 for fp8), or
        per 128 x 128 block with ``config.weight_block_size`` (`quantize_weight_blocks`).

        ``input_scale`` (float32, one element) switches activations to static per-tensor quantization (not with
        block scales). The new module lives on the linear's device.

        Raises TypeError when ``linear`` is not an ``nn.Linear`` (a ``Conv1d``, or a `W8A8Linear`, whose float
        weights are gone) or holds 8-bit weights, or ``config`` is not a `W8A8Config`; ValueError when K or N is
        not a multiple of 16.
        """
        where = "W8A8Linear.from_float"
        if config is None:
            config = W8A8Config()
        elif not isinstance(config, W8A8Config):
            raise TypeError(f"{where}: `config` must be a cutlass_w8a8.W8A8Config, got {type(config).__name__} "
                            f"({config!r}); e.g. W8A8Config(dtype=torch.int8)")
        if isinstance(linear, W8A8Linear):
            raise TypeError(f"{where}: `linear` is already a W8A8Linear (quant_dtype {linear.quant_dtype}); its "
                            "float weights are gone, so it cannot be quantized again: use it as is, or call "
                            "from_float on the float nn.Linear")
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"{where}: `linear` must be a torch.nn.Linear (weight (out_features, in_features)), got "
                            f"{type(linear).__name__}; other layers (Conv1d, transformers' Conv1D) are not "
                            "supported")
        refuse_quantized_weight(where, linear)
        n, k = linear.weight.shape
        out_dtype = config.out_dtype or (linear.weight.dtype if linear.weight.dtype in _OUT_DTYPES else torch.bfloat16)
        block = config.weight_block_size
        mod = cls(k, n, bias=linear.bias is not None, device=linear.weight.device, dtype=out_dtype,
                  quant_dtype=config.dtype, static_input_scale=input_scale is not None, weight_block_size=block,
                  fp8_fast_accum=config.fp8_fast_accum)
        with torch.no_grad():
            if block is not None:
                w_q, w_s = quantize_weight_blocks(linear.weight.detach(), config.dtype)
            else:
                # Per-channel absmax quantization of the [N, K] weight is per-row, i.e. the per-token kernel.
                w_q, w_s = torch.ops.cutlass_w8a8.quantize_per_token(linear.weight.detach().float(), config.dtype)
            mod.weight.copy_(w_q)
            mod.weight_scale.copy_(w_s.reshape(mod.weight_scale.shape))
            if linear.bias is not None:
                mod.bias.copy_(linear.bias.detach().to(out_dtype))
            if input_scale is not None:
                mod.input_scale.copy_(input_scale.detach().reshape(1).float())
        return mod

    @classmethod
    def from_quantized(cls, weight: torch.Tensor, weight_scale: torch.Tensor, bias: Optional[torch.Tensor] = None,
                       input_scale: Optional[torch.Tensor] = None, dtype: torch.dtype = torch.bfloat16,
                       weight_block_size: Optional[tuple] = None) -> "W8A8Linear":
        """A layer around weights that are already quantized (a checkpoint's), without re-quantizing them.

        Parameters
        ----------
        weight : torch.Tensor
            ``(N, K)`` int8 or float8_e4m3fn, the layer's ``weight`` as is (no copy when its rows are
            contiguous); its dtype becomes the layer's ``quant_dtype``. K and N positive multiples of 16.
        weight_scale : torch.Tensor
            Symmetric weight scales, any float dtype: N values (per-channel: ``(N,)``, ``(N, 1)`` or
            ``(1, N)``) or one (per-tensor). Stored as float32 (exact from bf16 / fp16). Block-scaled fp8:
            ``(ceil(N / 128), ceil(K / 128))``, one per 128 x 128 block (a DeepSeek-V3 / Qwen3-FP8
            ``weight_scale_inv``, a compressed-tensors FP8_BLOCK ``weight_scale``), kept 2-D.
        bias : torch.Tensor, optional
            N values, cast to ``dtype``.
        input_scale : torch.Tensor, optional
            One value: static per-tensor activation scale (float32 after the cast); None: dynamic per-token
            (per 1 x 128 group with block scales, which take no ``input_scale``).
        dtype : torch.dtype
            The layer's output and bias dtype, ``torch.bfloat16`` (default) or ``torch.float16``.
        weight_block_size : tuple of int, optional
            ``(128, 128)``: ``weight_scale`` holds block scales. None (default): told from the shape, by the rule
            of the ``w8a8_linear`` op (2-D ``(ceil(N / 128), ceil(K / 128))`` with more than one element, not
            ``(N, 1)`` / ``(1, N)``); pass it to keep a layer with one block (N <= 128, K = 128) block-scaled.

        The layer lives on ``weight``'s device. Raises TypeError for a weight that is not int8 / e4m3 (e4m3 with
        block scales) or scales that are not floating point, ValueError for shapes that do not match, block
        scales with K not a multiple of 128 or with an ``input_scale`` (the message names the argument).
        """
        if not isinstance(weight, torch.Tensor) or weight.dtype not in _QUANT_DTYPES:
            raise TypeError("W8A8Linear.from_quantized: `weight` must be an int8 or float8_e4m3fn tensor, got "
                            f"{weight.dtype if isinstance(weight, torch.Tensor) else type(weight).__name__}")
        if weight.dim() != 2:
            raise ValueError(f"W8A8Linear.from_quantized: `weight` must be 2-D (N, K), got shape {tuple(weight.shape)}")
        n, k = weight.shape
        block = weight_block_size
        if block is None and isinstance(weight_scale, torch.Tensor) and block_scale_shaped(n, k, weight_scale):
            block = (BLOCK_SIZE, BLOCK_SIZE)
        if block is not None:
            block = _check_block_operands(weight, weight_scale, input_scale, block)
        for name, t, allowed in (("weight_scale", weight_scale, (1, n)), ("input_scale", input_scale, (1,)),
                                 ("bias", bias, (n,))):
            if t is None:
                continue
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                raise TypeError(f"W8A8Linear.from_quantized: `{name}` must be a floating-point tensor, got "
                                f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
            if name == "weight_scale" and block is not None:
                pass  # its block shape is checked above
            elif t.numel() not in allowed or (t.numel() > 1 and max(t.shape) != t.numel()):
                raise ValueError(f"W8A8Linear.from_quantized: `{name}` must hold "
                                 f"{' or '.join(map(str, allowed))} values for N = {n}, got shape {tuple(t.shape)}")
            if t.device != weight.device:
                raise ValueError(f"W8A8Linear.from_quantized: `{name}` is on {t.device} but `weight` is on "
                                 f"{weight.device}")
        mod = cls(k, n, bias=bias is not None, device="meta", dtype=dtype, quant_dtype=weight.dtype,
                  static_input_scale=input_scale is not None, per_channel=weight_scale.numel() > 1,
                  weight_block_size=block)
        mod._buffers["weight"] = weight if weight.stride(1) == 1 and weight.stride(0) % 16 == 0 else weight.contiguous()
        scale_shape = mod.weight_scale.shape if block is not None else (-1,)
        mod._buffers["weight_scale"] = weight_scale.detach().reshape(scale_shape).to(torch.float32).contiguous()
        if bias is not None:
            mod._buffers["bias"] = bias.detach().reshape(n).to(dtype).contiguous()
        if input_scale is not None:
            mod._buffers["input_scale"] = input_scale.detach().reshape(1).to(torch.float32).contiguous()
        return mod

    @property
    def per_channel(self) -> bool:
        """Whether ``weight_scale`` has one scale per output channel (else one for the whole weight, or one per
        128 x 128 block: see ``weight_block_size``)."""
        return self.weight_block_size is None and self.weight_scale.numel() > 1

    @property
    def group_size(self) -> int:
        """128 when activations are quantized per 1 x 128 group (a block-scaled layer), else 0: the
        ``group_size`` argument of the fused quantizing ops that feed this layer a `QuantizedActivation`."""
        return BLOCK_SIZE if self.weight_block_size is not None else 0

    def _apply(self, fn, recurse=True):
        # nn.Module.half() / .float() / .to(dtype) cast every floating buffer, which would turn the fp8 weight
        # and the float32 scales into something the kernels reject (and lose the scales' precision). Probe what
        # fn does to a tensor of the layer's dtype and to a float32 one (the scales'): without a dtype change of
        # either (device moves, to_empty, ...) fn applies as usual; with one, the 8-bit weight and the scales only
        # follow the device, and a cast to bf16 / fp16 becomes the layer's new output dtype (bias included). The
        # float32 probe catches a cast to the layer's own dtype (``.to(torch.bfloat16)`` on a bf16 layer), which
        # the first probe cannot see.
        probe = fn(torch.empty(0, dtype=self.dtype, device=self.weight.device))
        probe32 = fn(torch.empty(0, dtype=torch.float32, device=self.weight.device))
        if not isinstance(probe, torch.Tensor) or (probe.dtype == self.dtype and probe32.dtype == torch.float32):
            return super()._apply(fn, recurse)
        new_dtype = probe.dtype if probe.dtype in _OUT_DTYPES else self.dtype
        for name, buf in self._buffers.items():
            if buf is None:
                continue
            if name == "bias":
                self._buffers[name] = buf.to(device=probe.device, dtype=new_dtype)
            else:
                self._buffers[name] = buf.to(device=probe.device)
        self.dtype = new_dtype
        return self

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        key = prefix + "weight_scale"
        if key in destination and self.weight_block_size is None and self.weight_scale.numel() == self.out_features:
            # compressed-tensors' channel layout, (N, 1): what transformers' and vLLM's loaders expect
            destination[key] = destination[key].reshape(-1, 1)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        w_key, s_key, i_key = prefix + "weight", prefix + "weight_scale", prefix + "input_scale"
        w = state_dict.get(w_key)
        if isinstance(w, torch.Tensor) and w.dtype != self.weight.dtype:
            error_msgs.append(f"W8A8Linear {prefix[:-1] or '(root)'}: `weight` in the state dict is {w.dtype} "
                              f"but the layer's quant_dtype is {self.weight.dtype} (a cast would corrupt it)")
            return
        s = state_dict.get(s_key)
        if isinstance(s, torch.Tensor) and self.weight_block_size is not None:
            if tuple(s.shape) != tuple(self.weight_scale.shape):
                error_msgs.append(f"W8A8Linear {prefix[:-1] or '(root)'}: `weight_scale` must be [ceil(N/128), "
                                  f"K/128] = {list(self.weight_scale.shape)} (128x128 blocks), got shape "
                                  f"{tuple(s.shape)}")
                return
            state_dict = dict(state_dict)
            state_dict[s_key] = s.to(torch.float32)
        elif isinstance(s, torch.Tensor):
            n = self.out_features
            if s.numel() not in (1, n) or (s.numel() > 1 and max(s.shape) != s.numel()):
                error_msgs.append(f"W8A8Linear {prefix[:-1] or '(root)'}: `weight_scale` must hold 1 or N = {n} "
                                  f"values, got shape {tuple(s.shape)}")
                return
            state_dict = dict(state_dict)
            state_dict[s_key] = s.reshape(-1).to(torch.float32)
            if state_dict[s_key].numel() != self.weight_scale.numel():  # per-tensor <-> per-channel
                self._buffers["weight_scale"] = torch.empty_like(state_dict[s_key], device=self.weight_scale.device)
        si = state_dict.get(i_key)
        if isinstance(si, torch.Tensor) and self.input_scale is not None:
            state_dict = dict(state_dict)
            state_dict[i_key] = si.reshape(-1).to(torch.float32)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def quantize_input(self, x: torch.Tensor) -> QuantizedActivation:
        """Quantize float activations ``x`` ``(..., K)`` exactly as ``forward`` does: dynamic per-token
        (``scale`` ``(..., 1)``), static per-tensor with ``input_scale`` (``scale`` is that buffer), or, for a
        block-scaled layer, dynamic per 1 x 128 group (``scale`` ``(..., K / 128)``).
        ``self(self.quantize_input(x))`` equals ``self(x)`` when ``x`` has the layer's ``dtype``.

        Raises TypeError when ``x`` is not a tensor, ValueError when it has no dimension or its last dimension
        is not ``in_features``.
        """
        self._check_input(x)
        lead = x.shape[:-1]
        g = self.group_size
        q, s = quantize_activations(x.reshape(-1, self.in_features), self.input_scale, self.quant_dtype, g)
        if self.input_scale is None:
            s = s.reshape(*lead, self.in_features // g if g else 1)
        return QuantizedActivation(q.reshape(*lead, self.in_features), s)

    def _check_quantized(self, x: QuantizedActivation) -> None:
        q, scale = x.q, x.scale
        if not isinstance(q, torch.Tensor):
            raise TypeError(f"W8A8Linear: `q` must be a torch.Tensor, got {type(q).__name__}")
        if not isinstance(scale, torch.Tensor):
            raise TypeError(f"W8A8Linear: `scale` must be a torch.Tensor, got {type(scale).__name__}")
        if q.dtype != self.quant_dtype:
            raise TypeError(f"W8A8Linear: `q` must have the layer's quant_dtype {self.quant_dtype}, got {q.dtype}")
        if scale.dtype != torch.float32:
            raise TypeError(f"W8A8Linear: `scale` must be float32, got {scale.dtype}")
        if q.dim() < 1 or q.shape[-1] != self.in_features:
            raise ValueError(f"W8A8Linear: `q` must have the last dimension in_features = {self.in_features}, "
                             f"got shape {tuple(q.shape)}")
        if self.weight_block_size is not None:
            groups = (*q.shape[:-1], self.in_features // BLOCK_SIZE)
            if tuple(scale.shape) != groups:
                raise ValueError(f"W8A8Linear: `scale` must have shape {groups} (one per 1x{BLOCK_SIZE} group of q's "
                                 f"rows) for a block-scaled layer, got shape {tuple(scale.shape)}")
        else:
            per_token = (*q.shape[:-1], 1)
            if scale.numel() != 1 and tuple(scale.shape) != per_token:
                raise ValueError(f"W8A8Linear: `scale` must have one element (per-tensor) or shape {per_token} "
                                 f"(per-token), got shape {tuple(scale.shape)}")
        if q.device != self.weight.device:
            raise ValueError(f"W8A8Linear: `q` is on {q.device} but the layer is on {self.weight.device}")
        if scale.device != q.device:
            raise ValueError(f"W8A8Linear: `scale` is on {scale.device} but `q` is on {q.device}")

    def _check_input(self, x) -> None:
        """A float input ``x`` must be a tensor whose last dimension is ``in_features`` (TypeError / ValueError)."""
        try:  # free unless it raises: a list has no .shape, a 0-d tensor no last dimension
            k = x.shape[-1]
        except (AttributeError, IndexError, TypeError):
            self._refuse_input(x)
        if k != self.in_features:
            raise ValueError(f"W8A8Linear: input's last dimension must be in_features = {self.in_features}, "
                             f"got shape {tuple(x.shape)}")

    def _refuse_input(self, x) -> None:
        """The error for an ``x`` without a last dimension: not a tensor (a list), or a 0-d tensor."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"W8A8Linear: `x` must be a torch.Tensor (..., in_features = {self.in_features}) or a "
                            f"QuantizedActivation, got {type(x).__name__}; convert it with torch.tensor(x, "
                            "dtype=layer.dtype, device=layer.weight.device)")
        raise ValueError(f"W8A8Linear: `x` must have at least one dimension (..., in_features = "
                         f"{self.in_features}), got shape {tuple(x.shape)}")

    def forward(self, x: Union[torch.Tensor, QuantizedActivation]) -> torch.Tensor:
        if isinstance(x, QuantizedActivation):
            self._check_quantized(x)
            lead = x.q.shape[:-1]
            if self.weight_block_size is not None:  # (M, K / 128) group scales: block-scaled scaled_mm
                s = x.scale.reshape(-1, self.in_features // BLOCK_SIZE).contiguous()
            else:
                s = x.scale if x.scale.numel() == 1 else x.scale.reshape(-1, 1).contiguous()
            y = _op.scaled_mm(x.q.reshape(-1, self.in_features), self.weight.t(), s,
                              self.weight_scale, self.dtype, self.bias, self.fp8_fast_accum)
            return y.reshape(*lead, self.out_features)
        self._check_input(x)
        # One op call: the activation quantization and the GEMM, checked once (in C++ on CUDA). The operands come
        # straight from _buffers (a dict lookup each, instead of nn.Module.__getattr__): this is the host-bound
        # path of small batches.
        b = self._buffers
        y = _w8a8_linear(x, b["weight"], b["weight_scale"], b["input_scale"], b["bias"], self.dtype,
                         self.fp8_fast_accum)
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"dtype={self.dtype}, quant_dtype={self.quant_dtype}"
                f"{quantization_repr(self.weight_block_size, self.input_scale is not None)}"
                # shown where it differs from the package default (and matters: row-wise fp8)
                f"{', fp8_fast_accum=' + str(self.fp8_fast_accum) if self._fp8_accum_differs() else ''}")

    def _fp8_accum_differs(self) -> bool:
        return (self.quant_dtype == torch.float8_e4m3fn and self.weight_block_size is None
                and self.fp8_fast_accum != FP8_FAST_ACCUM)
