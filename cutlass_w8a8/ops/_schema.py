"""The schemas of every tensor op in the ``torch.ops.cutlass_w8a8`` namespace: the one definition block.

The schemas live in Python (not in C++) so that a CPU-only install, which compiles nothing, still has every op
with its CPU reference implementation (`_reference.py`) and fake kernel (`_fake.py`); `_C.so` adds the CUDA
kernels when it is built (csrc/torch_bindings.cpp, ``TORCH_LIBRARY_IMPL(cutlass_w8a8, CUDA)``). The non-tensor
ops (PDL, fp8 support, CUDA-graph records) are defined by `_C.so` itself and exist only when it is loaded.

Ops:

- ``scaled_mm(a, b, scale_a, scale_b, out_dtype, bias=None, fp8_fast_accum=FP8_FAST_ACCUM) -> Tensor``: row-wise
  scales (per-tensor, per-token
  ``scale_a``, per-channel ``scale_b``) or block-scaled fp8 (``scale_a`` (M, K/128) 1x128 groups, ``scale_b``
  (ceil(N/128), K/128) 128x128 blocks), told apart by the scales' shapes (`_roles.block_scaled`)
- ``scaled_mm_out(out, a, b, scale_a, scale_b, bias=None, fp8_fast_accum=FP8_FAST_ACCUM) -> ()``; ``fp8_fast_accum``
  picks row-wise fp8's sm90 kernels: fast accumulation (True) or promoted every 128 of K (False); the default is
  `_limits.FP8_FAST_ACCUM`
- ``w8a8_linear(x, weight, weight_scale, input_scale=None, bias=None, out_dtype, fp8_fast_accum=FP8_FAST_ACCUM)
  -> Tensor``: a `W8A8Linear`
  forward in one call: quantize ``x (..., K)`` (per token, or per tensor with ``input_scale``; per 1x128 group with
  block weight scales (ceil(N/128), K/128)), then the GEMM with the ``(N, K)`` weight
- ``decode_layer(h, residual, input_norm, post_norm, eps, qkv_w, qkv_ws, qkv_is, o_w, ..., down_is, kv_cache, rope,
  slots, positions, num_heads, num_kv_heads, softmax_scale) -> Tensor``: one layer of the reference decoder
  (`cutlass_w8a8.models.LlamaDecoderLayer`) in one call, for eager decoding; ``residual`` and ``kv_cache`` are
  updated in place
- ``quantize_per_token(x, dtype) -> (q, scale)``
- ``quantize_per_tensor(x, scale, dtype) -> q``
- ``quantize_per_token_group(x, group_size, dtype) -> (q, scale)``: dynamic per 1 x group_size group along K
  (group_size 128), ``scale`` (..., K / group_size)
- ``rms_norm(x, weight, eps) -> y``: RMSNorm
- ``fused_add_rms_norm(x, residual, weight, eps) -> y``: ``residual += x`` in place, then RMSNorm of it (vLLM's)
- ``rms_norm_quant(x, weight, eps, dtype, scale=None, residual=None, group_size=0) -> (q, scale)``: either, then
  quantized (per token, per tensor with ``scale``, or per 1x128 group with ``group_size=128``)
- ``silu_mul(x) -> y``: ``silu(gate) * up`` of ``x = [gate | up]``
- ``silu_mul_quant(x, dtype, scale=None, group_size=0) -> (q, scale)``: the same, then quantized (as
  ``rms_norm_quant``)
- ``decode_attention(q, kv_cache, slots, positions, softmax_scale) -> Tensor``
- ``decode_attention_out(out, q, kv_cache, slots, positions, softmax_scale) -> ()``
- ``decode_attention_quant(q, kv_cache, slots, positions, softmax_scale, dtype, scale=None) -> (q_out, scale)``:
  ``decode_attention`` then quantized for a W8A8 ``o_proj`` (per token, or per tensor with ``scale``), in
  the attention's last kernel
- ``rope_kv_cache_(qkv, rope, kv_cache, slots, positions, num_heads, num_kv_heads, q_norm=None, k_norm=None,
  eps=-1.0) -> ()``: rotary embedding of the q and k heads in place (RMS-normalized first with Qwen3's
  ``q_norm`` / ``k_norm``; over their first R = 2 rope.shape[1] elements, partial rotary when R < D), then the k
  and v heads into the slot cache (the decoder's glue before attention)
- ``_scaled_mm_config(out, a, b, scale_a, scale_b, bias, config) -> ()``: force a kernel config (tuning only)
- ``scaled_mm_decode(a, b, scale_a, scale_b, out_dtype, bias=None) -> Tensor``: ``scaled_mm`` for M <= 16
- ``scaled_mm_decode_out(out, a, b, scale_a, scale_b, bias=None) -> ()``
- ``linear_decode(x, b, scale_b, bias, dtype) -> Tensor``: per-token quantization of x and the GEMM, one kernel
- ``linear_decode_out(out, x, b, scale_b, bias, dtype) -> ()``
- ``add_rms_norm_linear_decode(x, residual, norm_weight, eps, b, scale_b, bias, dtype) -> (out, residual_out)``:
  a decoder layer's input norm and its qkv GEMM at M <= 16, K <= 8192, one kernel: ``s = residual + x`` (``x``
  without a residual), ``residual_out = s`` (a new tensor: ``residual`` is not written), then ``rms_norm_quant(s)``
  per token and ``linear_decode``'s GEMM (no out= variant: the decoder uses the functional form)
- ``moe_topk_softmax(router_logits, top_k, renormalize) -> (topk_weights, topk_ids)``: the router's softmax over
  the E experts in float32 and its top_k largest (ties: lower expert first), optionally renormalized
- ``moe_route(router_logits, top_k, scoring="softmax", correction_bias=None, n_group=1, topk_group=1,
  renormalize=True, scaling_factor=1.0) -> (topk_weights, topk_ids)``: the transformers routers' top-k in one op:
  softmax or sigmoid scores, a per-expert correction bias for the selection only, grouped top-k (DeepSeek-V3's
  ``n_group`` / ``topk_group``), optional renormalization, then ``routed_scaling_factor``; ``moe_topk_softmax``
  is its softmax case without bias, groups or scaling
- ``moe_router_route(x, router_weight, top_k, scoring="softmax", correction_bias=None, n_group=1, topk_group=1,
  renormalize=True, scaling_factor=1.0, logits_dtype=None) -> (topk_weights, topk_ids)``: the router GEMM
  (``x @ router_weight.T`` in float32, rounded to ``logits_dtype``) and ``moe_route`` on those logits in one kernel,
  at decode sizes (T <= 16)
- ``add_rms_norm_moe_router_route(x, residual, norm_weight, eps, router_weight, top_k, <moe_router_route's routing
  arguments>) -> (y, residual_out, topk_weights, topk_ids)``: a MoE layer's post-attention norm and its router in one
  kernel at T <= 16, H <= 8192: ``s = residual + x``, ``residual_out = s`` (a new tensor: ``residual`` is not
  written), ``y = rms_norm(s) * norm_weight``, then ``moe_router_route(y, ...)``; bit for bit ``fused_add_rms_norm``
  on a copy of ``residual`` followed by ``moe_router_route``
- ``moe_align(topk_ids, num_experts) -> (sorted_pairs, dst_pos, offsets)``: the (token, expert) pairs sorted by
  expert (stable), the inverse permutation and the end row of each expert's group
- ``moe_permute_quant(x, sorted_pairs, top_k, dtype, scale=None, group_size=0) -> (q, scale)``: the tokens
  gathered into that order and quantized (per token, per tensor, or per 1x128 group)
- ``moe_unpermute(y, dst_pos, topk_weights) -> Tensor``: out[t] = sum_j topk_weights[t, j] * y[dst_pos[t*k+j]]
- ``moe_unpermute_out(out, y, dst_pos, topk_weights) -> ()``
- ``moe_decode_experts(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, group_size, out_dtype) -> Tensor``:
  a SwiGLU MoE layer's routed experts at decode sizes (T * top_k <= 64) in two kernels (top_k >= 4 within the
  speed rule of ops/moe.py's docstring) or three, bit for bit the chain
  moe_align -> moe_permute_quant -> grouped_scaled_mm -> silu_mul_quant -> grouped_scaled_mm -> moe_unpermute
- ``grouped_scaled_mm(a, b, scale_a, scale_b, offsets, out_dtype, bias=None) -> Tensor``: the mixture-of-experts
  grouped GEMM: ``a`` (T, K) rows grouped by expert, ``b`` (E, K, N), ``offsets`` int32 (E,) the end row of each
  expert's group (torch's ``offs``); per-token / per-tensor ``scale_a``, per-channel / per-expert ``scale_b``, or
  block fp8 (``scale_a`` (T, K/128), ``scale_b`` (E, ceil(N/128), K/128))
- ``grouped_scaled_mm_out(out, a, b, scale_a, scale_b, offsets, bias=None) -> ()``
- ``_grouped_scaled_mm_config(out, a, b, scale_a, scale_b, offsets, bias, config) -> ()``: force an entry of the sm90
  library's grouped table, whatever T (tuning only: bench/bench_moe.py --grouped-configs)
- ``_graph_update_scaled_mm(graph_exec, record, out, a, b, scale_a, scale_b, bias) -> ()``: a CUDA-graph node
  update (`cutlass_w8a8.graphs.UpdatableGraph.update_scaled_mm`); no CPU or fake kernel, it changes an
  instantiated graph, not tensors

Every op checks its arguments and raises ``TypeError`` (wrong dtype) or ``ValueError`` (wrong shape, layout,
device or value) naming the argument: on CUDA in C++, on the CPU and in the fake kernels with `_checks.py`,
with the same messages (docs/MISUSE.md). Without `_C.so`, CUDA tensors get the ``RuntimeError`` of
`register_cuda_fallback`.
"""

from __future__ import annotations

import types

import torch

from .. import _ext
from ._limits import FP8_FAST_ACCUM

lib = torch.library.Library("cutlass_w8a8", "DEF")  # noqa: TOR901 (the one definition block of the namespace)

OPS: list = []  # the names of the ops defined here, in order


def _define(schema: str) -> None:
    lib.define(schema)
    name = schema.split("(", 1)[0]
    OPS.append(name)
    lib.impl(name, _no_kernel(name, schema), "CompositeExplicitAutograd")


def _no_kernel(op: str, schema: str):
    """The kernel the dispatcher falls back to where the op has none of its own: a call with no tensor at all
    (every tensor given as None, e.g. ``quantize_int8(None)``) gets the TypeError the checks raise for a None
    tensor (`_roles.tensor_arg`), naming the first required tensor argument, instead of the dispatcher's
    NotImplementedError ("There were no tensor arguments to this function ..."); tensors of a backend without
    kernels (MPS, XPU) get a NotImplementedError naming their device. CPU, CUDA and Meta calls never reach it:
    their kernels are registered for those keys."""
    args = torch._C.parse_schema(f"cutlass_w8a8::{schema}").arguments

    def kernel(*given, **by_name):
        values = [given[i] if i < len(given) else by_name.get(arg.name) for i, arg in enumerate(args)]
        tensors = [v for v in values if isinstance(v, torch.Tensor)]
        if tensors:
            raise NotImplementedError(f"cutlass_w8a8.{op}: no kernel for {tensors[0].device.type} tensors "
                                      "(the ops run on CPU and CUDA tensors)")
        for arg, v in zip(args, values):
            if str(arg.type) == "Tensor":
                raise TypeError(f"{op}: `{arg.name}` must be a torch.Tensor, got {type(v).__name__}")
        raise TypeError(f"{op}: no tensor argument was given")

    kernel.__name__ = f"{op}_no_kernel"
    return kernel


# fp8_fast_accum: row-wise fp8 on sm90 runs the fast-accumulation (True) or the accurate (False) configs; its default
# is _limits.FP8_FAST_ACCUM, the one place it is decided (the C++ ops receive it filled in).
_define("scaled_mm(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, ScalarType out_dtype, "
        f"Tensor? bias=None, bool fp8_fast_accum={FP8_FAST_ACCUM}) -> Tensor")
_define("scaled_mm_out(Tensor(a!) out, Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, "
        f"Tensor? bias=None, bool fp8_fast_accum={FP8_FAST_ACCUM}) -> ()")
_define("w8a8_linear(Tensor x, Tensor weight, Tensor weight_scale, Tensor? input_scale, Tensor? bias, "
        f"ScalarType out_dtype, bool fp8_fast_accum={FP8_FAST_ACCUM}) -> Tensor")
_define("decode_layer(Tensor? h, Tensor(a!) residual, Tensor input_norm, Tensor post_norm, float eps, "
        "Tensor qkv_w, Tensor? qkv_ws, Tensor? qkv_is, Tensor o_w, Tensor? o_ws, Tensor? o_is, "
        "Tensor gate_up_w, Tensor? gate_up_ws, Tensor? gate_up_is, Tensor down_w, Tensor? down_ws, "
        "Tensor? down_is, Tensor(b!) kv_cache, Tensor rope, Tensor slots, Tensor positions, int num_heads, "
        "int num_kv_heads, float softmax_scale) -> Tensor")
_define("_scaled_mm_config(Tensor(a!) out, Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, "
        "Tensor? bias, int config) -> ()")
# Decode GEMMs, M <= 16 (csrc/gemm/decode/scaled_mm_decode.cu)
_define("scaled_mm_decode(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, ScalarType out_dtype, "
        "Tensor? bias=None) -> Tensor")
_define("scaled_mm_decode_out(Tensor(a!) out, Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, "
        "Tensor? bias=None) -> ()")
_define("linear_decode(Tensor x, Tensor b, Tensor scale_b, Tensor? bias, ScalarType dtype) -> Tensor")
_define("linear_decode_out(Tensor(a!) out, Tensor x, Tensor b, Tensor scale_b, Tensor? bias, "
        "ScalarType dtype) -> ()")
_define("add_rms_norm_linear_decode(Tensor x, Tensor? residual, Tensor norm_weight, float eps, Tensor b, "
        "Tensor scale_b, Tensor? bias, ScalarType dtype) -> (Tensor, Tensor)")
_define("quantize_per_token(Tensor x, ScalarType dtype) -> (Tensor, Tensor)")
_define("quantize_per_tensor(Tensor x, Tensor scale, ScalarType dtype) -> Tensor")
# Block-scaled fp8 activations: one scale per 1 x group_size group along K (csrc/quant/)
_define("quantize_per_token_group(Tensor x, int group_size, ScalarType dtype) -> (Tensor, Tensor)")
# Fused non-GEMM steps of a decoder layer (csrc/quant/); `residual` is updated in place.
# rms_norm without and with the residual are two ops: torch 2.13's inductor fails to lower an op that returns a
# single Tensor when its `Tensor(a!)?` argument is None (rms_norm_quant, returning two, is not affected).
_define("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor")
_define("fused_add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor")
# group_size: 0 quantizes per token (or per tensor with `scale`), 128 per 1x128 group of the output row.
_define("rms_norm_quant(Tensor x, Tensor weight, float eps, ScalarType dtype, Tensor? scale=None, "
        "Tensor(a!)? residual=None, int group_size=0) -> (Tensor, Tensor)")
_define("silu_mul(Tensor x) -> Tensor")
_define("silu_mul_quant(Tensor x, ScalarType dtype, Tensor? scale=None, int group_size=0) -> (Tensor, Tensor)")
_define("decode_attention(Tensor q, Tensor kv_cache, Tensor slots, Tensor positions, float softmax_scale) "
        "-> Tensor")
_define("decode_attention_out(Tensor(a!) out, Tensor q, Tensor kv_cache, Tensor slots, Tensor positions, "
        "float softmax_scale) -> ()")
# decode_attention fused with the quantization of its output (o_proj's activation): the same attention, rounded to
# q's dtype, then quantize_per_token (scale None) or quantize_per_tensor; the scales come back (B, 1) either way.
_define("decode_attention_quant(Tensor q, Tensor kv_cache, Tensor slots, Tensor positions, float softmax_scale, "
        "ScalarType dtype, Tensor? scale=None) -> (Tensor, Tensor)")
# The glue between the qkv projection and decode_attention (csrc/attention/rope_kv_cache.cu): rotary embedding
# of the q and k heads in place, then the k and v heads written into the slot cache.
# With q_norm and k_norm (Qwen3's head norms; eps then required: the default -1 is "not given"), every q and k head
# is RMS-normalized first, in the same kernel.
# rope (B, R / 2, 2) float32 sets the rotary width R (2 <= R <= D, even): the pairs (x[j], x[j + R/2]) of each q and k
# head are rotated and x[R:] passes through (partial rotary, GLM-4.5's partial_rotary_factor); R == D is full rotary.
_define("rope_kv_cache_(Tensor(a!) qkv, Tensor rope, Tensor(b!) kv_cache, Tensor slots, Tensor positions, "
        "int num_heads, int num_kv_heads, Tensor? q_norm=None, Tensor? k_norm=None, float eps=-1.0) -> ()")
# CUDA-graph node update (cutlass_w8a8/graphs, UpdatableGraph.update_scaled_mm): CUDA only
_define("_graph_update_scaled_mm(int graph_exec, int record, Tensor out, Tensor a, Tensor b, Tensor scale_a, "
        "Tensor scale_b, Tensor? bias) -> ()")


# MoE routing (csrc/moe/): top-k of the router's softmax, the stable counting sort of the (token, expert) pairs by
# expert, the gather of the tokens into that order fused with their quantization, and the weighted sum back.
# MoE grouped GEMM (csrc/gemm/grouped_mm_entry.cu): the grouped decode kernel at small T, the sm90 CUTLASS ptr-array
# grouped GEMM above it.
_define("grouped_scaled_mm(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, Tensor offsets, ScalarType out_dtype, "
        "Tensor? bias=None) -> Tensor")
_define("grouped_scaled_mm_out(Tensor(a!) out, Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, Tensor offsets, "
        "Tensor? bias=None) -> ()")
_define("_grouped_scaled_mm_config(Tensor(a!) out, Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, "
        "Tensor offsets, Tensor? bias, int config) -> ()")
_define("moe_topk_softmax(Tensor router_logits, int top_k, bool renormalize) -> (Tensor, Tensor)")
_define("moe_route(Tensor router_logits, int top_k, str scoring=\"softmax\", Tensor? correction_bias=None, "
        "int n_group=1, int topk_group=1, bool renormalize=True, float scaling_factor=1.0) -> (Tensor, Tensor)")
_define("moe_router_route(Tensor x, Tensor router_weight, int top_k, str scoring=\"softmax\", "
        "Tensor? correction_bias=None, int n_group=1, int topk_group=1, bool renormalize=True, "
        "float scaling_factor=1.0, ScalarType? logits_dtype=None) -> (Tensor, Tensor)")
_define("add_rms_norm_moe_router_route(Tensor x, Tensor residual, Tensor norm_weight, float eps, Tensor router_weight, "
        "int top_k, str scoring=\"softmax\", Tensor? correction_bias=None, int n_group=1, int topk_group=1, "
        "bool renormalize=True, float scaling_factor=1.0, ScalarType? logits_dtype=None) "
        "-> (Tensor, Tensor, Tensor, Tensor)")
_define("moe_align(Tensor topk_ids, int num_experts) -> (Tensor, Tensor, Tensor)")
_define("moe_permute_quant(Tensor x, Tensor sorted_pairs, int top_k, ScalarType dtype, Tensor? scale=None, "
        "int group_size=0) -> (Tensor, Tensor)")
_define("moe_unpermute(Tensor y, Tensor dst_pos, Tensor topk_weights) -> Tensor")
_define("moe_unpermute_out(Tensor(a!) out, Tensor y, Tensor dst_pos, Tensor topk_weights) -> ()")
# The fused MoE decode path (csrc/moe/moe_decode.cu): the chain above, from x and the routing to the weighted sum,
# in two kernels (top_k >= 4 within its speed rule) or three at T * top_k <= MOE_DECODE_MAX_PAIRS (group_size 0:
# per-token activations, 128: 1x128 groups).
_define("moe_decode_experts(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w13, Tensor w13_scale, "
        "Tensor w2, Tensor w2_scale, int group_size, ScalarType out_dtype) -> Tensor")


def extension_missing(op: str):
    """The CUDA kernel of `op` when `_C.so` is not loaded: raises `_ext.require_cuda_ops`'s RuntimeError
    ("cutlass_w8a8.<op>: the CUDA extension is not built or not loaded (...)") whatever the arguments."""

    def kernel(*args, **kwargs):
        _ext.require_cuda_ops(op)
        raise RuntimeError(f"cutlass_w8a8.{op}: no CUDA kernel registered ({_ext.extension_status()})")

    kernel.__name__ = f"{op}_cuda_extension_missing"
    return kernel


_fallback_registered = False


# Every op's default overload, looked up once: the public wrappers call these (``OVERLOADS.scaled_mm(...)``),
# because resolving the overload from the packet on every call costs host time that eager decoding pays per
# layer (bench/bench_host.py compares the wrapper with the bare op).
OVERLOADS = types.SimpleNamespace(**{name: getattr(torch.ops.cutlass_w8a8, name).default for name in OPS})


def register_cuda_fallback() -> bool:
    """Register `extension_missing` as the CUDA kernel of every op above, if `_C.so` did not load.

    Called by ``cutlass_w8a8/__init__.py`` after ``_ext._load()`` (the schemas must exist before `_C.so`
    registers its CUDA kernels, and the fallback must not shadow them). Returns whether it registered (once).
    """
    global _fallback_registered
    if _fallback_registered or _ext.cuda_ops_available():
        return False
    for op in OPS:
        lib.impl(op, extension_missing(op), "CUDA")
    _fallback_registered = True
    return True
