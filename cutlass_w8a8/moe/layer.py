"""`W8A8MoE`: the experts of one mixture-of-experts block with 8-bit weights and activations.

One forward is a fixed chain of device ops with shapes static in ``T x top_k`` (no host sync, capturable into a
CUDA graph whatever the routing), all from `cutlass_w8a8.ops.moe` and `cutlass_w8a8.ops`:

``moe_route`` (router-logits mode only) -> ``moe_align`` -> ``moe_permute_quant`` ->
``grouped_scaled_mm`` (w13) -> ``silu_mul_quant`` -> ``grouped_scaled_mm`` (w2) -> ``moe_unpermute``.

At decode sizes on CUDA (``T * top_k <= MOE_DECODE_MAX_PAIRS`` = 64, dynamic activation scales) the six ops after
the routing are one ``moe_decode_experts`` call (two kernels at top_k >= 4 where its speed rule allows, else three),
equal to them bit for bit (`W8A8MoE.fused_decode`).
On the CPU the chain's ops run their references.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..config import W8A8Config
from ..linear import quantization_repr, quantize_weight_blocks
from ..ops import moe as _moe
from ..ops import silu_mul_quant
from ..ops._limits import (BLOCK_SIZE, GEMM_ALIGN, MOE_DECODE_MAX_PAIRS, MOE_ROUTER_H_MULTIPLE, MOE_ROUTER_ROUTE_MAX_T,
                           MOE_ROUTER_ROUTE_MAX_WEIGHT_BYTES, MOE_ROUTER_ROUTE_MIN_EXPERTS, OUT_DTYPES, blocks)
from ..ops._schema import OVERLOADS as _op
from .families import routing_problem

__all__ = ["W8A8MoE", "quantize_expert_weights"]

# hidden-state dtypes the first quantization (moe_permute_quant) takes as they are
_ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# Where `W8A8MoE` (fused_decode None) takes the decode path: top_k >= FUSED_DECODE_MIN_TOP_K (the down GEMM is then
# token-major, csrc/moe/moe_decode.cu) and I <= FUSED_DECODE_AUTO_MAX_I, the measured range (uses_decode_path).
FUSED_DECODE_MIN_TOP_K = 4
FUSED_DECODE_AUTO_MAX_I = 2048


def quantize_expert_weights(weight: torch.Tensor, dtype: torch.dtype, weight_block_size: Optional[tuple] = None):
    """``(q, scale)`` of stacked float expert weights ``[E, N, K]`` (each expert an ``[N, K]`` Linear weight), as
    `W8A8Linear.from_float` quantizes one weight: per output channel (``scale[e, n] = max_k |w[e, n, k]| / QMAX``,
    QMAX 127 for int8, 448 for float8_e4m3fn; the per-token quantization op on the ``[E * N, K]`` rows), or with
    ``weight_block_size=(128, 128)`` per 128 x 128 block of each expert (`cutlass_w8a8.linear.quantize_weight_blocks`).

    Returns ``q``: ``dtype`` ``[E, N, K]`` contiguous, on ``weight``'s device, and ``scale``: float32 ``[E, N]``
    (per-channel) or ``[E, ceil(N / 128), ceil(K / 128)]`` (block)."""
    e, n, k = weight.shape
    w = weight.detach()
    if weight_block_size is not None:
        qs, ss = zip(*(quantize_weight_blocks(w[i], dtype) for i in range(e)))
        return torch.stack(qs), torch.stack(ss)
    q, s = _op.quantize_per_token(w.reshape(e * n, k).to(torch.float32), dtype)
    return q.reshape(e, n, k), s.reshape(e, n)


def _check_routing(where: str, num_experts: int, top_k: int, scoring: str, n_group: int, topk_group: int,
                   scaling_factor: float, correction_bias: Optional[torch.Tensor]) -> None:
    """The routing arguments of `W8A8MoE` (router-logits mode, ``moe_route``'s), as
    `cutlass_w8a8.moe.families.routing_problem` states them: ValueError / TypeError naming the argument."""
    bad = routing_problem(num_experts, top_k, scoring, n_group, topk_group, scaling_factor, correction_bias)
    if bad is not None:
        raise bad[0](f"{where}: {bad[1]}")


class W8A8MoE(nn.Module):
    """The experts of one MoE block (SwiGLU experts, top-k routing) with 8-bit weights and activations.

    For each token ``t`` routed to experts ``e_j`` with weights ``w_j`` (j < top_k):
    ``out[t] = sum_j w_j * down_e(silu(gate_e(x_t)) * up_e(x_t))``, each projection a W8A8 GEMM: weights quantized
    once per output channel (or per 128 x 128 block), activations quantized on every call per token (or per
    1 x 128 group for block-scaled fp8, or static per tensor with ``a13_scale`` / ``a2_scale``).

    Buffers (names fixed: checkpoints and tensor parallelism rely on them; E experts, hidden H, intermediate I):

    - ``w13``: ``[E, 2I, H]`` int8 / float8_e4m3fn, each expert's ``[gate_proj; up_proj]`` weight (rows ``[0, I)``
      gate, ``[I, 2I)`` up: transformers' ``gate_up_proj`` layout), row-major; passed to the GEMM as
      ``w13.transpose(1, 2)``.
    - ``w13_scale``: float32 ``[E, 2I]`` per output channel, or ``[E, ceil(2I / 128), H / 128]`` per 128 x 128
      block (``weight_block_size``).
    - ``w2``: ``[E, H, I]``, each expert's ``down_proj`` weight; ``w2_scale``: ``[E, H]`` or
      ``[E, ceil(H / 128), I / 128]``.
    - ``a13_scale``, ``a2_scale``: float32 ``[1]`` static per-tensor activation scales of the first (gate/up) and
      second (down) GEMM's input, present only with ``static_input_scale=True`` (None: dynamic).
    - ``correction_bias``: float32 ``[E]``, the router's per-expert selection bias (``correction_bias``), or None;
      non-persistent (never in the state dict).

    Parameters
    ----------
    num_experts : int
        E >= 1.
    top_k : int
        Experts per token, 1 <= top_k <= E (used in router-logits mode; a given ``topk_ids`` sets its own k).
    hidden_size, intermediate_size : int
        H and I (one expert's), positive multiples of 16; multiples of 128 with block scales.
    config : W8A8Config, optional
        ``dtype`` (int8 default, or float8_e4m3fn), ``out_dtype`` (the GEMMs' output dtype, bfloat16 default, or
        float16) and ``weight_block_size`` (``(128, 128)``: block-scaled fp8).
    renormalize : bool
        Router-logits mode: divide the top-k weights by their sum (Mixtral; Qwen's ``norm_topk_prob``; with
        sigmoid scoring by the sum plus 1e-20, DeepSeek-V3's ``norm_topk_prob``).
    activation : str
        ``"silu"`` (SwiGLU), the only one supported.
    device : torch.device, optional
    static_input_scale : bool, keyword-only
        Hold ``a13_scale`` / ``a2_scale`` buffers (static per-tensor activation quantization). Not with block
        scales.
    scoring : str, keyword-only
        Router-logits mode: how the logits score the experts, ``"softmax"`` (default) or ``"sigmoid"``
        (DeepSeek-V3, GLM-4.5, MiniMax-M2).
    n_group, topk_group : int, keyword-only
        Router-logits mode, grouped top-k: the E experts form ``n_group`` groups of ``E / n_group``, and only the
        ``topk_group`` groups with the largest sum of their two best scores (correction bias included) are
        candidates. Default 1 and 1: no grouping. ``1 <= n_group <= 32``, above 1 dividing E into groups of at
        least 2; ``1 <= topk_group <= n_group``; ``top_k <= topk_group * E / n_group``.
    scaling_factor : float, keyword-only
        Router-logits mode: the final weights are multiplied by it (DeepSeek-V3's ``routed_scaling_factor``);
        finite, default 1.0.
    correction_bias : torch.Tensor, optional, keyword-only
        Router-logits mode: a per-expert bias ``[E]`` added to the scores for the selection only (DeepSeek-V3's
        ``e_score_correction_bias``), the weights being the unbiased scores. Held as the non-persistent float32
        buffer ``correction_bias`` (not in the state dict: the router module holds the checkpoint's tensor):
        the tensor itself when it is a float32 ``[E]`` tensor on the layer's device (a view of its storage when it
        is a parameter or another shape of E elements, e.g. ``[1, E]``), else a float32 copy there.

    The routing of router-logits mode is ``cutlass_w8a8.ops.moe.moe_route(logits, top_k, scoring=...,
    correction_bias=..., n_group=..., topk_group=..., renormalize=..., scaling_factor=...)`` (`route`); a call given
    ``topk_ids`` / ``topk_weights`` (transformers' blocks: their router computes them) does not use these.

    **Decode path.** On CUDA, when the call has ``1 <= T * k <= 64`` (``MOE_DECODE_MAX_PAIRS``) (token, expert)
    pairs and dynamic activation scales (no ``a13_scale``), the experts run as one
    `cutlass_w8a8.ops.moe.moe_decode_experts` call (at top_k >= 4 with ``T x H <= 2048`` and ``top_k x I <= 6144``,
    its measured speed rule, two kernels: the gate/up GEMM quantizing x itself with SiLU * up in its epilogue, the
    token-major down GEMM quantizing the intermediate itself with the weighted top-k sum in its epilogue;
    elsewhere three: the quantization of x, the gate/up GEMM with the intermediate's quantization in its epilogue,
    the down GEMM) instead of the six ops of the chain; the result is the chain's bit for bit, so the choice never
    changes an output. Larger calls, static activation scales and CPU tensors run the chain.

    **Router and routing in one kernel.** `route_from_hidden` (``x`` and the router's weight, as the decoders and
    `cutlass_w8a8.hf.DecodeStep` call it) runs `cutlass_w8a8.ops.moe.moe_router_route` at decode sizes on CUDA
    (``T <= MOE_ROUTER_ROUTE_MAX_T``: `router_route_applies`), else the router GEMM and `route`.

    Attributes
    ----------
    fused_decode : bool or None
        None (default): the decode path where it applies and was measured faster than the chain, i.e. at
        ``top_k >= FUSED_DECODE_MIN_TOP_K`` (4) and ``intermediate_size <= FUSED_DECODE_AUTO_MAX_I`` (2048; see
        `uses_decode_path`). True: wherever it applies;
        False: the unfused chain at every size (A/B benchmarks: ``bench/bench_moe.py --parts decode``). A plain
        attribute, not in the state dict, read on every forward, so a captured CUDA graph keeps the path it was
        captured with.
    fused_router : bool
        True (default): `route_from_hidden` takes ``moe_router_route`` where `router_route_fits` on CUDA; False: the
        router GEMM and `route` at every size (an A/B switch, e.g. for ``bench/bench_decoder.py``; the experts
        chosen may differ at near-ties only). A plain attribute, as ``fused_decode``.

    Raises
    ------
    TypeError
        ``config`` is not a `W8A8Config`; ``correction_bias`` is not a floating-point tensor.
    ValueError
        A size is out of range (the message names it), ``activation`` is not ``"silu"``, ``static_input_scale``
        is given with block scales, or a routing argument is out of range (the message names it).
    """

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 config: Optional[W8A8Config] = None, renormalize: bool = True, activation: str = "silu",
                 device=None, *, static_input_scale: bool = False, scoring: str = "softmax", n_group: int = 1,
                 topk_group: int = 1, scaling_factor: float = 1.0,
                 correction_bias: Optional[torch.Tensor] = None):
        super().__init__()
        if config is None:
            config = W8A8Config()
        elif not isinstance(config, W8A8Config):
            raise TypeError(f"W8A8MoE: `config` must be a cutlass_w8a8.W8A8Config, got {type(config).__name__}")
        block = config.weight_block_size
        for name, v in (("num_experts", num_experts), ("top_k", top_k), ("hidden_size", hidden_size),
                        ("intermediate_size", intermediate_size)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"W8A8MoE: `{name}` must be a positive int, got {v!r}")
        if top_k > num_experts:
            raise ValueError(f"W8A8MoE: `top_k` = {top_k} must be <= num_experts = {num_experts}")
        align = BLOCK_SIZE if block is not None else GEMM_ALIGN
        for name, v in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
            if v % align != 0:
                why = (f" with weight_block_size={block} (the GEMMs' K: 1x{BLOCK_SIZE} activation groups)"
                       if block is not None else " (the GEMM kernels' alignment)")
                raise ValueError(f"W8A8MoE: `{name}` = {v} must be a multiple of {align}{why}")
        if activation != "silu":
            raise ValueError(f"W8A8MoE: `activation` must be 'silu' (SwiGLU experts), got {activation!r}")
        if static_input_scale and block is not None:
            raise ValueError("W8A8MoE: `static_input_scale` must be False with weight_block_size (activations are "
                             f"quantized per 1x{BLOCK_SIZE} group at run time)")
        _check_routing("W8A8MoE", num_experts, top_k, scoring, n_group, topk_group, scaling_factor,
                       correction_bias)
        e, h, i = num_experts, hidden_size, intermediate_size
        self.num_experts, self.top_k, self.hidden_size, self.intermediate_size = e, top_k, h, i
        self.renormalize, self.activation = bool(renormalize), activation
        self.scoring, self.n_group, self.topk_group = scoring, n_group, topk_group
        self.scaling_factor = float(scaling_factor)
        self.quant_dtype = config.dtype
        self.dtype = config.out_dtype or torch.bfloat16
        self.weight_block_size = block
        self.register_buffer("w13", torch.zeros(e, 2 * i, h, dtype=config.dtype, device=device))
        self.register_buffer("w2", torch.zeros(e, h, i, dtype=config.dtype, device=device))
        if block is not None:
            s13, s2 = (e, blocks(2 * i), h // BLOCK_SIZE), (e, blocks(h), i // BLOCK_SIZE)
        else:
            s13, s2 = (e, 2 * i), (e, h)
        self.register_buffer("w13_scale", torch.ones(s13, dtype=torch.float32, device=device))
        self.register_buffer("w2_scale", torch.ones(s2, dtype=torch.float32, device=device))
        self.register_buffer("a13_scale", torch.ones(1, dtype=torch.float32, device=device)
                             if static_input_scale else None)
        self.register_buffer("a2_scale", torch.ones(1, dtype=torch.float32, device=device)
                             if static_input_scale else None)
        if correction_bias is not None:
            if isinstance(correction_bias, nn.Parameter) or tuple(correction_bias.shape) != (e,):
                correction_bias = correction_bias.detach().reshape(e)  # a view where it can be: the same storage
            if device is not None:
                correction_bias = correction_bias.to(device=device)
            correction_bias = correction_bias.to(torch.float32)
        # non-persistent: the router holds the checkpoint's tensor (transformers' state dict has no other)
        self.register_buffer("correction_bias", correction_bias, persistent=False)
        self.fused_decode = None  # None: the decode path where it is measured faster (uses_decode_path); True / False
        self.fused_router = True  # route_from_hidden: moe_router_route where router_route_applies; False: two ops

    def tie_correction_bias(self, bias: torch.Tensor) -> None:
        """Point the layer's ``correction_bias`` at the router's ``bias`` again.

        The constructor shares the router's tensor where it can (a float32 view of it), so that a state dict
        loaded into the router later is seen by the layer; a device move (``model.to(device)``) moves the two
        modules' tensors separately and ends the sharing, and a later load into the router would leave the
        layer routing with the old values. The decode step (`cutlass_w8a8.hf.DecodeStep`) calls this when it is
        built.

        Parameters
        ----------
        bias : torch.Tensor
            The router's correction bias: E floating-point elements (``[E]`` or ``[1, E]``, any float dtype).
            Shared (a view) when it is float32 on the layer's device, else copied to float32 there.

        Raises
        ------
        ValueError
            The layer routes without a correction bias, or ``bias`` does not have E elements.
        TypeError
            ``bias`` is not a floating-point tensor.
        """
        if self.correction_bias is None:
            raise ValueError("W8A8MoE.tie_correction_bias: this layer routes without a correction bias")
        if not isinstance(bias, torch.Tensor) or not bias.is_floating_point():
            raise TypeError(f"W8A8MoE.tie_correction_bias: `bias` must be a floating-point tensor, got "
                            f"{getattr(bias, 'dtype', type(bias).__name__)}")
        e = self.num_experts
        if bias.numel() != e:
            raise ValueError(f"W8A8MoE.tie_correction_bias: `bias` must have E = {e} elements, got shape "
                             f"{tuple(bias.shape)}")
        device = self.w13.device
        bias = bias.detach().reshape(e)  # a view where it can be: the same storage
        self._buffers["correction_bias"] = bias.to(device=device, dtype=torch.float32)

    @property
    def group_size(self) -> int:
        """128 when activations are quantized per 1 x 128 group (block-scaled fp8), else 0."""
        return BLOCK_SIZE if self.weight_block_size is not None else 0

    @classmethod
    def from_float(cls, experts: nn.Module, config: Optional[W8A8Config] = None, top_k: Optional[int] = None,
                   renormalize: bool = True, *, a13_scale: Optional[torch.Tensor] = None,
                   a2_scale: Optional[torch.Tensor] = None, gate_up: str = "gate_up_proj",
                   down: str = "down_proj", scoring: str = "softmax", n_group: int = 1, topk_group: int = 1,
                   scaling_factor: float = 1.0, correction_bias: Optional[torch.Tensor] = None) -> "W8A8MoE":
        """Quantize a transformers experts module (Qwen2-MoE / Qwen3-MoE / Mixtral ``experts``, transformers 5's
        fused 3-D parameters) or any module with the same two parameters.

        Parameters
        ----------
        experts : nn.Module
            Holds ``gate_up_proj`` ``[E, 2I, H]`` (rows ``[0, I)`` gate, ``[I, 2I)`` up) and ``down_proj``
            ``[E, H, I]`` float tensors. When it carries transformers' ``use_experts_implementation`` flags they
            must describe that layout (``is_transposed`` False, ``is_concatenated`` True, ``has_gate`` True,
            ``has_bias`` False), and an ``act_fn`` must be SiLU.
        config : W8A8Config, optional
            As the constructor; the output dtype defaults to the experts' dtype when bfloat16 / float16.
        top_k, renormalize
            The router's, for router-logits mode (see the constructor). ``top_k`` None: the ``top_k`` attribute of
            ``experts`` (ValueError when it has none; transformers' experts do not, their router ``gate`` has it).
        a13_scale, a2_scale : torch.Tensor, optional, keyword-only
            One-element static per-tensor activation scales (both or neither); None: dynamic.
        gate_up, down : str, keyword-only
            The names of the two parameters in ``experts`` (a `cutlass_w8a8.moe.families` row's `ExpertLayout`;
            default transformers 5's ``gate_up_proj`` / ``down_proj``).
        scoring, n_group, topk_group, scaling_factor, correction_bias : keyword-only
            The router's, for router-logits mode (see the constructor). A float32 ``correction_bias`` on the
            experts' device is held as it is, the same tensor (`cutlass_w8a8.moe.hf`'s swap passes the router's
            ``e_score_correction_bias``, so that a state dict loaded into the router later is seen by the layer);
            another dtype or device is copied to float32 there.

        Weights are quantized per output channel (absmax / 127 for int8, / 448 for e4m3), or per 128 x 128
        block with ``config.weight_block_size``, exactly as `W8A8Linear.from_float` quantizes each expert's
        ``[N, K]`` weight. The layer lives on the experts' device.

        Raises
        ------
        TypeError
            ``experts`` lacks the parameters, or they are not floating point (already quantized), or ``config``
            is not a `W8A8Config`.
        ValueError
            The parameters' shapes disagree, the layout flags or activation are not the supported ones, only one
            of ``a13_scale`` / ``a2_scale`` is given, or as the constructor.
        """
        where = "W8A8MoE.from_float"
        if config is None:
            config = W8A8Config()
        elif not isinstance(config, W8A8Config):
            raise TypeError(f"{where}: `config` must be a cutlass_w8a8.W8A8Config, got {type(config).__name__}")
        if isinstance(experts, W8A8MoE):
            raise TypeError(f"{where}: `experts` is already a W8A8MoE (quant_dtype {experts.quant_dtype}); its "
                            "float weights are gone, so it cannot be quantized again")
        gu, dn = getattr(experts, gate_up, None), getattr(experts, down, None)
        if not isinstance(gu, torch.Tensor) or not isinstance(dn, torch.Tensor):
            raise TypeError(f"{where}: `experts` ({type(experts).__name__}) must hold 3-D `{gate_up}` [E, 2I, H] "
                            f"and `{down}` [E, H, I] tensors (transformers 5's fused experts)")
        for name, t in ((gate_up, gu), (down, dn)):
            if not t.is_floating_point():
                raise TypeError(f"{where}: `experts.{name}` holds {t.dtype} values (a quantized checkpoint loaded "
                                "into float experts?); quantizing them again would ignore their scales. Load the "
                                "checkpoint with cutlass_w8a8.from_pretrained(path) instead")
        for flag, want in (("is_transposed", False), ("is_concatenated", True), ("has_gate", True),
                           ("has_bias", False)):
            got = getattr(experts, flag, want)
            if got != want:
                raise ValueError(f"{where}: `experts.{flag}` must be {want} ({gate_up} [E, 2I, H] = [gate; up], "
                                 f"no bias), got {got}")
        act = getattr(experts, "act_fn", None)
        if act is not None and not isinstance(act, nn.SiLU) and type(act).__name__ not in ("SiLUActivation",):
            raise ValueError(f"{where}: `experts.act_fn` must be SiLU (SwiGLU experts), got {type(act).__name__}")
        if gu.dim() != 3 or dn.dim() != 3 or gu.shape[1] % 2 != 0:
            raise ValueError(f"{where}: `experts.{gate_up}` must be [E, 2I, H] and `experts.{down}` [E, H, I], "
                             f"got shapes {tuple(gu.shape)} and {tuple(dn.shape)}")
        e, i2, h = gu.shape
        i = i2 // 2
        if tuple(dn.shape) != (e, h, i):
            raise ValueError(f"{where}: `experts.{down}` must be [E, H, I] = [{e}, {h}, {i}] for {gate_up} "
                             f"{tuple(gu.shape)}, got {tuple(dn.shape)}")
        if top_k is None:
            top_k = getattr(experts, "top_k", None)
            if not isinstance(top_k, int):
                raise ValueError(f"{where}: `top_k` must be given ({type(experts).__name__} has no int `top_k`; "
                                 "transformers' blocks hold it in their router, `block.gate.top_k`)")
        if (a13_scale is None) != (a2_scale is None):
            raise ValueError(f"{where}: give both `a13_scale` and `a2_scale` (static per-tensor) or neither")
        out_dtype = config.out_dtype or (gu.dtype if gu.dtype in OUT_DTYPES else torch.bfloat16)
        cfg = W8A8Config(dtype=config.dtype, out_dtype=out_dtype, weight_block_size=config.weight_block_size)
        mod = cls(e, top_k, h, i, cfg, renormalize, "silu", device=gu.device,
                  static_input_scale=a13_scale is not None, scoring=scoring, n_group=n_group,
                  topk_group=topk_group, scaling_factor=scaling_factor, correction_bias=correction_bias)
        with torch.no_grad():
            for wname, sname, w in (("w13", "w13_scale", gu), ("w2", "w2_scale", dn)):
                q, s = quantize_expert_weights(w, config.dtype, config.weight_block_size)
                getattr(mod, wname).copy_(q)
                getattr(mod, sname).copy_(s)
            if a13_scale is not None:
                mod.a13_scale.copy_(a13_scale.detach().reshape(1).float())
                mod.a2_scale.copy_(a2_scale.detach().reshape(1).float())
        return mod

    def _apply(self, fn, recurse=True):
        # As W8A8Linear: dtype casts (.half(), .to(torch.bfloat16), a model's .to(dtype)) must not touch the 8-bit
        # weights or the float32 scales; a cast to bf16 / fp16 becomes the layer's output dtype, device moves
        # apply to every buffer.
        probe = fn(torch.empty(0, dtype=self.dtype, device=self.w13.device))
        probe32 = fn(torch.empty(0, dtype=torch.float32, device=self.w13.device))
        if not isinstance(probe, torch.Tensor) or (probe.dtype == self.dtype and probe32.dtype == torch.float32):
            return super()._apply(fn, recurse)
        self.dtype = probe.dtype if probe.dtype in OUT_DTYPES else self.dtype
        for name, buf in self._buffers.items():
            if buf is not None:
                self._buffers[name] = buf.to(device=probe.device)
        return self

    def _check_inputs(self, x: torch.Tensor, second: torch.Tensor, topk_weights: Optional[torch.Tensor]) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"W8A8MoE: `hidden_states` must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() < 1 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"W8A8MoE: `hidden_states` must be [..., hidden_size = {self.hidden_size}], got shape "
                             f"{tuple(x.shape)}")
        if not x.is_floating_point():
            raise TypeError(f"W8A8MoE: `hidden_states` must be floating point, got {x.dtype}")
        if x.device != self.w13.device:
            raise ValueError(f"W8A8MoE: `hidden_states` is on {x.device} but the layer is on {self.w13.device}")
        t = x.numel() // self.hidden_size
        if not isinstance(second, torch.Tensor):
            raise TypeError("W8A8MoE: `router_logits_or_topk_ids` must be a torch.Tensor, got "
                            f"{type(second).__name__}")
        if topk_weights is None:
            if not second.is_floating_point():
                raise TypeError("W8A8MoE: `router_logits_or_topk_ids` must be floating-point router logits [T, E = "
                                f"{self.num_experts}] when topk_weights is None, got {second.dtype} (pass "
                                "topk_weights with topk ids)")
            if second.numel() != t * self.num_experts or second.shape[-1] != self.num_experts:
                raise ValueError(f"W8A8MoE: `router_logits_or_topk_ids` (router logits) must be [T = {t}, E = "
                                 f"{self.num_experts}], got shape {tuple(second.shape)}")
        else:
            if not isinstance(topk_weights, torch.Tensor):
                raise TypeError(f"W8A8MoE: `topk_weights` must be a torch.Tensor, got {type(topk_weights).__name__}")
            if second.dtype not in (torch.int32, torch.int64):
                raise TypeError(f"W8A8MoE: `topk_ids` (the second argument with topk_weights) must be int32 or int64, "
                                f"got {second.dtype}")
            if second.dim() < 1 or second.shape[-1] < 1 or second.numel() != t * second.shape[-1]:
                raise ValueError(f"W8A8MoE: `topk_ids` must be [T = {t}, k], got shape {tuple(second.shape)}")
            if tuple(topk_weights.shape) != tuple(second.shape):
                raise ValueError(f"W8A8MoE: `topk_weights` must have topk_ids' shape {tuple(second.shape)}, got "
                                 f"{tuple(topk_weights.shape)}")
            if not topk_weights.is_floating_point():
                raise TypeError(f"W8A8MoE: `topk_weights` must be floating point, got {topk_weights.dtype}")
        for name, v in (("router_logits_or_topk_ids", second), ("topk_weights", topk_weights)):
            if v is not None and v.device != x.device:
                raise ValueError(f"W8A8MoE: `{name}` is on {v.device} but `hidden_states` is on {x.device}")

    def uses_decode_path(self, x: torch.Tensor, top_k: int) -> bool:
        """Whether a forward on ``x`` ``[T, H]`` with ``top_k`` experts per token runs `moe_decode_experts` (the
        decode path, class docstring) rather than the chain: a CUDA ``x``, no static activation scale,
        ``1 <= T * top_k <= MOE_DECODE_MAX_PAIRS``, and ``fused_decode`` True, or None with ``top_k >=
        FUSED_DECODE_MIN_TOP_K`` and ``intermediate_size <= FUSED_DECODE_AUTO_MAX_I``.

        The automatic rule is measured (one H200, CUDA graphs, routing included, T = 1 and 8; issue 36's closing
        note). With the token-major down GEMM (top_k >= 4) the decode path was 1.20-1.52x faster than the chain at
        Qwen3-30B-A3B dims (I = 768, top-8, int8 / fp8 / block), 1.07-1.23x at DeepSeek-V3's (I = 2048, top-8),
        1.17x at OLMoE's (I = 1024, top-8) and 1.12x at Qwen2-MoE's (I = 1408, top-4). At top-2 (Mixtral, I =
        14336) it was 0.84x: the down GEMM is then expert-major, and each CTA's cross-CTA top-k reduction (fence,
        counter, re-read) costs more than the three kernels it saves. Larger I is not measured."""
        pairs = x.shape[0] * top_k
        fused = self.fused_decode
        if fused is None:
            fused = top_k >= FUSED_DECODE_MIN_TOP_K and self.intermediate_size <= FUSED_DECODE_AUTO_MAX_I
        return bool(x.is_cuda and fused and self.a13_scale is None and 1 <= pairs <= MOE_DECODE_MAX_PAIRS)

    def route(self, router_logits: torch.Tensor):
        """The routing of router-logits mode: ``(topk_weights float32 [T, top_k], topk_ids int32 [T, top_k])`` of
        ``router_logits`` ``[T, E]`` (float32 / bfloat16 / float16), `cutlass_w8a8.ops.moe.moe_route` with the
        layer's ``top_k``, ``scoring``, ``correction_bias``, ``n_group``, ``topk_group``, ``renormalize`` and
        ``scaling_factor``. One kernel, no host synchronisation. Errors are the op's."""
        return _moe.moe_route(router_logits, self.top_k, scoring=self.scoring, correction_bias=self.correction_bias,
                              n_group=self.n_group, topk_group=self.topk_group, renormalize=self.renormalize,
                              scaling_factor=self.scaling_factor)

    def router_route_applies(self, x: torch.Tensor, router_weight: torch.Tensor,
                             logits_dtype: Optional[torch.dtype] = None) -> bool:
        """Whether `route_from_hidden` runs `cutlass_w8a8.ops.moe.moe_router_route` (the router GEMM and the routing
        in one kernel) rather than ``F.linear`` and `route`: ``fused_router`` (default True), a CUDA ``x``,
        `router_route_pays` and `router_route_fits`. Any other call takes the two ops, whose result is the same up
        to the logits' summation order (`moe_router_route`'s docstring)."""
        return bool(getattr(self, "fused_router", True) and x.is_cuda and self.router_route_pays(router_weight)
                    and self.router_route_fits(x, router_weight, logits_dtype))

    @staticmethod
    def router_route_pays(router_weight: torch.Tensor) -> bool:
        """The speed rule of `router_route_applies`: a router weight ``[E, H]`` of at least
        ``MOE_ROUTER_ROUTE_MIN_EXPERTS`` experts and at most ``MOE_ROUTER_ROUTE_MAX_WEIGHT_BYTES`` bytes (ops/_limits.py
        owns both and cites the H200 measurement: 1.35-2.99x the two ops at T = 1 / 8 / 16 over the routers of
        Mixtral-8x7B, OLMoE, Qwen3-30B-A3B, GLM-4.5, DeepSeek-V3 and Kimi-K2; a router outside that range keeps the
        two ops, unmeasured)."""
        return (router_weight.dim() == 2 and router_weight.shape[0] >= MOE_ROUTER_ROUTE_MIN_EXPERTS
                and router_weight.numel() * router_weight.element_size() <= MOE_ROUTER_ROUTE_MAX_WEIGHT_BYTES)

    def router_route_fits(self, x: torch.Tensor, router_weight: torch.Tensor,
                          logits_dtype: Optional[torch.dtype] = None) -> bool:
        """The decode-size rule of `router_route_applies`, the device aside: ``x`` ``[T, H]`` with
        ``1 <= T <= MOE_ROUTER_ROUTE_MAX_T`` (ops/_limits.py, the one owner of the limit), bfloat16 / float16; a
        ``router_weight`` ``[E, H]`` of its dtype and device; ``H`` a multiple of ``MOE_ROUTER_H_MULTIPLE``; both
        with unit-stride rows whose pitch is a multiple of 8 elements at 16-byte aligned offsets; ``logits_dtype``
        None, ``x``'s dtype or float32 (`moe_router_route`'s contract, so the op never raises on a call it takes)."""
        if x.dim() != 2 or not 1 <= x.shape[0] <= MOE_ROUTER_ROUTE_MAX_T or x.dtype not in (torch.bfloat16,
                                                                                             torch.float16):
            return False
        if router_weight.dtype != x.dtype or router_weight.device != x.device or router_weight.dim() != 2:
            return False
        h = x.shape[1]
        if tuple(router_weight.shape) != (self.num_experts, h) or h % MOE_ROUTER_H_MULTIPLE != 0:
            return False
        if logits_dtype not in (None, x.dtype, torch.float32):
            return False
        for m in (x, router_weight):
            # the storage comes from an allocator aligning to >= 256 bytes: the view's offset decides
            if (m.stride(1) != 1 or (m.shape[0] > 1 and m.stride(0) % 8 != 0)
                    or m.storage_offset() * m.element_size() % 16 != 0):
                return False
        return True

    def route_from_hidden(self, x: torch.Tensor, router_weight: torch.Tensor,
                          logits_dtype: Optional[torch.dtype] = None):
        """The routing of the hidden states ``x`` ``[T, H]`` by the router weight ``router_weight`` ``[E, H]``:
        ``(topk_weights float32 [T, top_k], topk_ids int32 [T, top_k])`` = `route` of
        ``F.linear(x.to(logits_dtype), router_weight.to(logits_dtype))`` (``logits_dtype`` None: ``x``'s dtype,
        transformers' Qwen / Mixtral / OLMoE routers; float32: DeepSeek-V3 / GLM-4.5's).

        At decode sizes (`router_route_applies`) one kernel, `cutlass_w8a8.ops.moe.moe_router_route` with the
        layer's routing; else two ops (the router GEMM, then `route`). The two agree up to the summation order of
        the logits (each within one unit in the last place of ``logits_dtype`` plus a float32 sum's error bound:
        `moe_router_route`'s Notes), so experts at a near-tie may be chosen differently. Errors are the ops'."""
        if self.router_route_applies(x, router_weight, logits_dtype):
            return _moe.moe_router_route(x, router_weight, self.top_k, scoring=self.scoring,
                                         correction_bias=self.correction_bias, n_group=self.n_group,
                                         topk_group=self.topk_group, renormalize=self.renormalize,
                                         scaling_factor=self.scaling_factor, logits_dtype=logits_dtype)
        dt = x.dtype if logits_dtype is None else logits_dtype
        return self.route(torch.nn.functional.linear(x.to(dt), router_weight.to(dt)))

    def forward(self, hidden_states: torch.Tensor, router_logits_or_topk_ids: torch.Tensor,
                topk_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Run the experts.

        Parameters
        ----------
        hidden_states : torch.Tensor
            ``[T, H]`` or ``[..., H]`` (T = the product of the leading dimensions), any float dtype, on the
            layer's device. bfloat16 / float16 / float32 are quantized as they are (as `W8A8Linear` does),
            float64 after a cast to float32. The GEMMs output the layer's ``dtype``.
        router_logits_or_topk_ids : torch.Tensor
            Without ``topk_weights``: router logits ``[T, E]`` (``[..., E]``), float32 / bfloat16 / float16; the
            routing is `route` (``moe_route`` with the layer's routing). With ``topk_weights``: the chosen experts
            ``[T, k]`` int32 / int64 (transformers' ``top_k_index``; ids outside ``[0, E)`` are not routed).
        topk_weights : torch.Tensor, optional
            ``[T, k]`` float, the routing weights (transformers' ``top_k_weights``), applied in float32.

        Returns
        -------
        torch.Tensor
            ``hidden_states``' shape and dtype.

        Raises TypeError / ValueError naming the argument for a wrong dtype, shape or device. Only static shapes
        and device ops: capturable into a CUDA graph, routings changing between replays. On CUDA at
        ``T * k <= 64`` the experts are one `moe_decode_experts` call (`uses_decode_path`; the class docstring's
        "Decode path"), bit for bit the chain's result.
        """
        self._check_inputs(hidden_states, router_logits_or_topk_ids, topk_weights)
        h = self.hidden_size
        x = hidden_states.reshape(-1, h)
        if x.dtype not in _ACT_DTYPES:  # quantized as given, as W8A8Linear does (float64 through float32)
            x = x.to(torch.float32)
        if topk_weights is None:
            logits = router_logits_or_topk_ids.reshape(-1, self.num_experts)
            topk_weights, topk_ids = self.route(logits)
        else:
            k = router_logits_or_topk_ids.shape[-1]
            topk_ids = router_logits_or_topk_ids.reshape(x.shape[0], k)
            topk_weights = topk_weights.reshape(x.shape[0], k).to(torch.float32)
        k = topk_ids.shape[1]
        group = self.group_size
        if self.uses_decode_path(x, k):
            out = _moe.moe_decode_experts(x, topk_ids, topk_weights, self.w13, self.w13_scale, self.w2,
                                          self.w2_scale, group, self.dtype)
            if out.dtype != hidden_states.dtype:
                out = out.to(hidden_states.dtype)
            return out.reshape(hidden_states.shape)
        sorted_pairs, dst_pos, offsets = _moe.moe_align(topk_ids, self.num_experts)
        q, q_scale = _moe.moe_permute_quant(x, sorted_pairs, k, self.quant_dtype, scale=self.a13_scale,
                                            group_size=group or None)
        y13 = _moe.grouped_scaled_mm(q, self.w13.transpose(1, 2), q_scale, self.w13_scale, offsets, self.dtype)
        q2, q2_scale = silu_mul_quant(y13, self.quant_dtype, self.a2_scale, group)
        y2 = _moe.grouped_scaled_mm(q2, self.w2.transpose(1, 2), q2_scale, self.w2_scale, offsets, self.dtype)
        out = _moe.moe_unpermute(y2, dst_pos, topk_weights)
        if out.dtype != hidden_states.dtype:
            out = out.to(hidden_states.dtype)
        return out.reshape(hidden_states.shape)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, top_k={self.top_k}, hidden_size={self.hidden_size}, "
                f"intermediate_size={self.intermediate_size}, renormalize={self.renormalize}, "
                f"scoring={self.scoring}, n_group={self.n_group}, topk_group={self.topk_group}, "
                f"scaling_factor={self.scaling_factor}, correction_bias={self.correction_bias is not None}, "
                f"activation={self.activation}, dtype={self.dtype}, quant_dtype={self.quant_dtype}"
                f"{quantization_repr(self.weight_block_size, self.a13_scale is not None)}")
