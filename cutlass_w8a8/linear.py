"""`W8A8Linear`, a drop-in replacement for `nn.Linear`, and `quantize_`, the in-place module swap.

Weights are quantized once, symmetric per output channel; activations are quantized on every call, dynamic
per-token (or static per-tensor with a calibrated `input_scale`). The GEMM dequantizes in its epilogue
(`cutlass_w8a8.scaled_mm`). Activations already quantized by a fused op (`cutlass_w8a8.rms_norm_quant`,
`cutlass_w8a8.silu_mul_quant`) are passed as a `QuantizedActivation` instead of a float tensor.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Callable, NamedTuple, Optional, Union

import torch
from torch import nn

__all__ = ["QuantizedActivation", "W8A8Config", "W8A8Linear", "quantize_", "quantize_activations"]

_QUANT_DTYPES = (torch.int8, torch.float8_e4m3fn)
_OUT_DTYPES = (torch.bfloat16, torch.float16)


@dataclasses.dataclass(frozen=True)
class W8A8Config:
    """How `quantize_` quantizes each `nn.Linear`.

    Attributes
    ----------
    dtype : torch.dtype
        ``torch.int8`` (default) or ``torch.float8_e4m3fn``, for both weights and activations.
    out_dtype : torch.dtype, optional
        Output (and bias) dtype of the quantized layers, bfloat16 or float16. Default: the layer's weight
        dtype when it is one of those, else bfloat16; outputs are cast back to the input's dtype.
    """

    dtype: torch.dtype = torch.int8
    out_dtype: Optional[torch.dtype] = None

    def __post_init__(self):
        if self.dtype not in _QUANT_DTYPES:
            raise TypeError(f"W8A8Config: `dtype` must be torch.int8 or torch.float8_e4m3fn, got {self.dtype}")
        if self.out_dtype is not None and self.out_dtype not in _OUT_DTYPES:
            raise TypeError(f"W8A8Config: `out_dtype` must be torch.bfloat16 or torch.float16, got {self.out_dtype}")


def quantize_activations(x2: torch.Tensor, input_scale: Optional[torch.Tensor], quant_dtype: torch.dtype):
    """``(q, scale)`` of ``(M, K)`` activations as `W8A8Linear` quantizes them: dynamic per-token (``scale``
    ``(M, 1)``) when ``input_scale`` is None, else static per-tensor with it (``scale`` is ``input_scale``)."""
    if input_scale is None:
        return torch.ops.cutlass_w8a8.quantize_per_token(x2, quant_dtype)
    return torch.ops.cutlass_w8a8.quantize_per_tensor(x2, input_scale, quant_dtype), input_scale


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
        layer's static ``input_scale``). ``x ~= q * scale``.
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
    - ``weight_scale``: ``(N,)`` float32, per-channel symmetric: ``W[n, :] ~= weight[n, :] * weight_scale[n]``.
    - ``bias``: ``(N,)`` in ``dtype``, or None.
    - ``input_scale``: ``(1,)`` float32 static per-tensor activation scale, present only when
      ``static_input_scale=True``; otherwise activations are quantized dynamically per token.

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

    Raises
    ------
    ValueError
        K or N is not a positive multiple of 16; at call time, the input's last dimension is not K.
    TypeError
        ``dtype`` or ``quant_dtype`` is not supported.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None,
                 dtype: torch.dtype = torch.bfloat16, quant_dtype: torch.dtype = torch.int8,
                 static_input_scale: bool = False):
        super().__init__()
        for name, v in (("in_features", in_features), ("out_features", out_features)):
            if v <= 0 or v % 16 != 0:
                raise ValueError(f"W8A8Linear: `{name}` must be a positive multiple of 16, got {v}")
        if dtype not in _OUT_DTYPES:
            raise TypeError(f"W8A8Linear: `dtype` must be torch.bfloat16 or torch.float16, got {dtype}")
        if quant_dtype not in _QUANT_DTYPES:
            raise TypeError(f"W8A8Linear: `quant_dtype` must be torch.int8 or torch.float8_e4m3fn, got {quant_dtype}")
        self.in_features = in_features
        self.out_features = out_features
        self.dtype = dtype
        self.quant_dtype = quant_dtype
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=quant_dtype, device=device))
        self.register_buffer("weight_scale", torch.ones(out_features, dtype=torch.float32, device=device))
        if bias:
            self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=device))
        else:
            self.bias = None
        if static_input_scale:
            self.register_buffer("input_scale", torch.ones(1, dtype=torch.float32, device=device))
        else:
            self.input_scale = None

    @classmethod
    def from_float(cls, linear: nn.Linear, config: Optional[W8A8Config] = None,
                   input_scale: Optional[torch.Tensor] = None) -> "W8A8Linear":
        """Quantize a float ``nn.Linear``: weights per-channel symmetric (absmax / 127, or / 448 for fp8).

        ``input_scale`` (float32, one element) switches activations to static per-tensor quantization.
        The new module lives on the linear's device. Raises ValueError when K or N is not a multiple of 16.
        """
        config = config or W8A8Config()
        n, k = linear.weight.shape
        out_dtype = config.out_dtype or (linear.weight.dtype if linear.weight.dtype in _OUT_DTYPES else torch.bfloat16)
        mod = cls(k, n, bias=linear.bias is not None, device=linear.weight.device, dtype=out_dtype,
                  quant_dtype=config.dtype, static_input_scale=input_scale is not None)
        with torch.no_grad():
            # Per-channel absmax quantization of the [N, K] weight is per-row, i.e. the per-token kernel.
            w_q, w_s = torch.ops.cutlass_w8a8.quantize_per_token(linear.weight.detach().float(), config.dtype)
            mod.weight.copy_(w_q)
            mod.weight_scale.copy_(w_s.reshape(n))
            if linear.bias is not None:
                mod.bias.copy_(linear.bias.detach().to(out_dtype))
            if input_scale is not None:
                mod.input_scale.copy_(input_scale.detach().reshape(1).float())
        return mod

    def quantize_input(self, x: torch.Tensor) -> QuantizedActivation:
        """Quantize float activations ``x`` ``(..., K)`` exactly as ``forward`` does: dynamic per-token
        (``scale`` ``(..., 1)``) or static per-tensor with ``input_scale`` (``scale`` is that buffer).
        ``self(self.quantize_input(x))`` equals ``self(x)`` when ``x`` has the layer's ``dtype``.

        Raises ValueError when the last dimension of ``x`` is not ``in_features``.
        """
        if x.shape[-1] != self.in_features:
            raise ValueError(f"W8A8Linear: input's last dimension must be in_features = {self.in_features}, "
                             f"got shape {tuple(x.shape)}")
        lead = x.shape[:-1]
        q, s = quantize_activations(x.reshape(-1, self.in_features), self.input_scale, self.quant_dtype)
        if self.input_scale is None:
            s = s.reshape(*lead, 1)
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
        per_token = (*q.shape[:-1], 1)
        if scale.numel() != 1 and tuple(scale.shape) != per_token:
            raise ValueError(f"W8A8Linear: `scale` must have one element (per-tensor) or shape {per_token} "
                             f"(per-token), got shape {tuple(scale.shape)}")
        if q.device != self.weight.device:
            raise ValueError(f"W8A8Linear: `q` is on {q.device} but the layer is on {self.weight.device}")
        if scale.device != q.device:
            raise ValueError(f"W8A8Linear: `scale` is on {scale.device} but `q` is on {q.device}")

    def forward(self, x: Union[torch.Tensor, QuantizedActivation]) -> torch.Tensor:
        if isinstance(x, QuantizedActivation):
            self._check_quantized(x)
            lead = x.q.shape[:-1]
            s = x.scale if x.scale.numel() == 1 else x.scale.reshape(-1, 1).contiguous()
            y = torch.ops.cutlass_w8a8.scaled_mm(x.q.reshape(-1, self.in_features), self.weight.t(), s,
                                                 self.weight_scale, self.dtype, self.bias)
            return y.reshape(*lead, self.out_features)
        if x.shape[-1] != self.in_features:
            raise ValueError(f"W8A8Linear: input's last dimension must be in_features = {self.in_features}, "
                             f"got shape {tuple(x.shape)}")
        lead = x.shape[:-1]
        q, s = quantize_activations(x.reshape(-1, self.in_features), self.input_scale, self.quant_dtype)
        y = torch.ops.cutlass_w8a8.scaled_mm(q, self.weight.t(), s, self.weight_scale, self.dtype, self.bias)
        if x.dtype != self.dtype:
            y = y.to(x.dtype)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        act = "static per-tensor" if self.input_scale is not None else "dynamic per-token"
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"dtype={self.dtype}, quant_dtype={self.quant_dtype}, activations={act}")


def quantize_(model: nn.Module, config: Optional[W8A8Config] = None,
              filter_fn: Optional[Callable[[nn.Module, str], bool]] = None) -> nn.Module:
    """Replace every ``nn.Linear`` in ``model`` by a `W8A8Linear`, in place (torchao's ``quantize_`` shape).

    Parameters
    ----------
    model : nn.Module
        Modified in place; a bare ``nn.Linear`` cannot be swapped in place, so its replacement is returned.
    config : W8A8Config, optional
        Quantized dtype and output dtype; default int8.
    filter_fn : callable, optional
        ``filter_fn(module, fqn) -> bool``; only linears for which it returns True are swapped.

    Returns
    -------
    nn.Module
        ``model`` (or the replacement of a bare linear).

    Linears whose K or N is not a multiple of 16 are left as they are, with a warning.
    """
    config = config or W8A8Config()

    def eligible(linear: nn.Linear, fqn: str) -> bool:
        if filter_fn is not None and not filter_fn(linear, fqn):
            return False
        n, k = linear.weight.shape
        if k % 16 or n % 16:
            warnings.warn(f"quantize_: leaving {fqn or 'the model'} in float: in_features={k} and "
                          f"out_features={n} must be multiples of 16", stacklevel=3)
            return False
        return True

    if isinstance(model, nn.Linear):
        return W8A8Linear.from_float(model, config) if eligible(model, "") else model

    def swap(module: nn.Module, prefix: str) -> None:
        for name, child in list(module.named_children()):
            fqn = f"{prefix}.{name}" if prefix else name
            if isinstance(child, nn.Linear):
                if eligible(child, fqn):
                    setattr(module, name, W8A8Linear.from_float(child, config))
            else:
                swap(child, fqn)

    swap(model, "")
    return model
