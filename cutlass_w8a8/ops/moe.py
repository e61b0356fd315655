"""The mixture-of-experts ops' public wrappers: the routing (`moe_topk_softmax` or `moe_route`, `moe_align`,
`moe_permute_quant`, `moe_unpermute`) around the grouped GEMM of the experts.

A W8A8 MoE layer runs, for T tokens routed to top_k of E experts (T * top_k (token, expert) pairs):

    topk_weights, topk_ids = moe_topk_softmax(router_logits, top_k, renormalize)    # [T, top_k] each
    # or moe_route(router_logits, top_k, scoring=..., correction_bias=..., n_group=..., ...)
    # or, at decode sizes (T <= 16), the router GEMM and the routing in one kernel:
    #    topk_weights, topk_ids = moe_router_route(x, router_weight, top_k, scoring=..., ...)
    sorted_pairs, dst_pos, offsets = moe_align(topk_ids, E)                         # pairs grouped by expert
    q, s = moe_permute_quant(x, sorted_pairs, top_k, dtype)                         # [T * top_k, H] 8-bit
    h = grouped_scaled_mm(q, w13, s, w13_scale, offsets, x.dtype)                   # [T * top_k, 2I]
    q2, s2 = silu_mul_quant(h, dtype)                                               # [T * top_k, I]
    y = grouped_scaled_mm(q2, w2, s2, w2_scale, offsets, x.dtype)                   # [T * top_k, H]
    out = moe_unpermute(y, dst_pos, topk_weights)                                   # [T, H]
    # or, at decode sizes (T * top_k <= 64, dynamic activation scales), the same result bit for bit in 2 kernels
    # (top_k >= 4) or 3:
    out = moe_decode_experts(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, group_size, x.dtype)

Every shape depends on T, top_k, E, H and I only, never on the routing, and no op synchronises with the host: the
chain captures into a CUDA graph and replays with new router logits. Each wrapper calls its op once and returns;
the op checks its arguments (C++ on CUDA, `_checks.py` on the CPU and in the fake kernels) and raises errors that
name the op and the argument (docs/MISUSE.md).
"""

from __future__ import annotations

from typing import Optional

import torch

from ._schema import OVERLOADS as _op

__all__ = ["moe_topk_softmax", "moe_route", "moe_router_route", "add_rms_norm_moe_router_route", "moe_align", "moe_permute_quant", "moe_unpermute",
           "grouped_scaled_mm", "moe_decode_experts"]


def moe_topk_softmax(router_logits: torch.Tensor, top_k: int, renormalize: bool = True):
    """The experts of each token: the ``top_k`` largest of the router's softmax, and their weights.

    ``p = softmax(float32(router_logits), dim=-1)`` over the E experts; ``topk_ids[t]`` are the ``top_k`` experts
    of token ``t`` by decreasing logit (so by decreasing probability), the lower expert index first among equal
    logits; ``topk_weights[t, j] = p[t, topk_ids[t, j]]``, divided by their float32 sum (taken in order of
    ``j``) when ``renormalize``. This is the router of transformers' Qwen2-MoE / Qwen3-MoE (``norm_topk_prob``
    selects ``renormalize``) and Mixtral (always renormalized). One kernel launch (a warp per token), no host
    synchronisation.

    Parameters
    ----------
    router_logits : torch.Tensor
        ``(T, E)``, bfloat16, float16 or float32, ``1 <= E <= 1024``, any strides (the router ``gate``'s output).
    top_k : int
        The number of experts per token, ``1 <= top_k <= E``.
    renormalize : bool, default True
        Divide the chosen probabilities by their sum (they then sum to 1 up to rounding).

    Returns
    -------
    (topk_weights, topk_ids) : tuple of torch.Tensor
        ``topk_weights``: float32 ``(T, top_k)``; ``topk_ids``: int32 ``(T, top_k)``, values in ``[0, E)``. Both
        contiguous, on ``router_logits``' device.

    Raises
    ------
    TypeError
        ``router_logits`` is not a tensor of those dtypes.
    ValueError
        ``router_logits`` is not 2-D, E is 0 or above 1024, or ``top_k`` is not in ``[1, E]``.

    Notes
    -----
    The weights are computed in float32 with the device's ``exp``: CUDA and CPU agree to a few float32 ulps,
    the ids exactly (they compare the same float32 logits). A row holding NaN gets unspecified weights and ids
    (ids stay in ``[0, E)``); other rows are unaffected. ``T = 0`` returns empty tensors.

    Examples
    --------
    >>> logits = gate(hidden_states)                               # (T, E)
    >>> topk_weights, topk_ids = moe_topk_softmax(logits, 8, True)  # Qwen3-MoE: top-8, norm_topk_prob
    """
    return _op.moe_topk_softmax(router_logits, top_k, renormalize)


def moe_route(router_logits: torch.Tensor, top_k: int, *, scoring: str = "softmax",
              correction_bias: Optional[torch.Tensor] = None, n_group: int = 1, topk_group: int = 1,
              renormalize: bool = True, scaling_factor: float = 1.0):
    """The experts of each token and their weights, as transformers' MoE routers choose them, in one kernel.

    The routers of DeepSeek-V3 / Kimi-K2 (``DeepseekV3TopkRouter``), GLM-4.5 / 4.6 (``Glm4MoeTopkRouter``),
    MiniMax-M2 (sigmoid and bias, no groups), OLMoE and Qwen3-MoE (softmax): for each token ``t`` (all in float32,
    the logits read as float32):

    1. ``score = softmax(router_logits[t])`` over the E experts (``scoring="softmax"``: the same arithmetic as
       :func:`moe_topk_softmax`), or ``score = 1 / (1 + exp(-router_logits[t]))`` (``scoring="sigmoid"``: torch's
       CUDA ``sigmoid`` formula; on the CPU, torch's CPU ``sigmoid``);
    2. ``choice = score + correction_bias`` (``score`` without a bias): the bias moves the selection only;
    3. with ``n_group > 1`` (grouped top-k): the E experts form ``n_group`` groups of ``E / n_group`` consecutive
       experts; a group's score is the sum of its two largest ``choice`` values; the ``topk_group`` best groups are
       kept and the experts of the other groups cannot be chosen;
    4. ``topk_ids[t]``: the ``top_k`` experts of the kept groups (all experts when ``n_group == 1``) by decreasing
       ``choice``, in that order (the selection order);
    5. ``topk_weights[t, j] = score[topk_ids[t, j]]`` (the unbiased score); with ``renormalize`` divided by their
       float32 sum taken in selection order (``j`` ascending), plus ``1e-20`` for sigmoid (DeepSeek-V3's
       denominator; softmax adds nothing, as :func:`moe_topk_softmax`); then multiplied by
       ``float32(scaling_factor)`` (``routed_scaling_factor``).

    **Ties.** Experts with equal ``choice`` values are taken lower expert index first, and groups with equal group
    scores lower group index first; so the result is deterministic and the same on every device. With
    ``scoring="softmax"`` and no ``correction_bias`` the experts are ranked by their logits (softmax is
    increasing, so this is the order of the probabilities; two logits whose probabilities round to the same
    float32 are ordered by logit, then by index), exactly as :func:`moe_topk_softmax`: that case (with
    ``n_group=1`` and ``scaling_factor=1.0``) returns its result bit for bit.

    Against transformers (whose ``torch.topk(..., sorted=False)`` leaves the order of the chosen experts and the
    tie-breaking unspecified): the same set of experts per token and, before renormalization, bit for bit the
    same weights, on the same device; the renormalized weights may differ by the order of the float32 sum of the
    ``top_k`` weights (at most ``top_k`` float32 rounding steps, a relative ``top_k * 2**-24``). MiniMax-M2
    renormalizes without the ``1e-20``, which changes nothing while the sum is at least ``2**-42``.

    One kernel launch (a warp per token), no host synchronisation, the launch fixed by the shapes: it captures
    into a CUDA graph and replays with new logits (and new bias values in the same tensor).

    Parameters
    ----------
    router_logits : torch.Tensor
        ``(T, E)``, bfloat16, float16 or float32, ``1 <= E <= 1024``, any strides (the router ``gate``'s logits).
    top_k : int
        Experts per token: ``1 <= top_k <= E``, and at most ``topk_group * E / n_group`` (the experts of the kept
        groups).
    scoring : str, default "softmax"
        ``"softmax"`` or ``"sigmoid"``.
    correction_bias : torch.Tensor, optional
        float32 ``(E,)`` on ``router_logits``' device, any stride: DeepSeek-V3's ``e_score_correction_bias``,
        added to the scores for the selection only.
    n_group : int, default 1
        Expert groups, ``1 <= n_group <= 32``; above 1 it divides E into groups of at least 2 experts.
    topk_group : int, default 1
        Groups kept per token, ``1 <= topk_group <= n_group`` (ignored, and must be 1, when ``n_group == 1``).
    renormalize : bool, default True
        Divide the chosen weights by their sum (``norm_topk_prob``).
    scaling_factor : float, default 1.0
        Finite; multiplies the weights last (``routed_scaling_factor``).

    Returns
    -------
    (topk_weights, topk_ids) : tuple of torch.Tensor
        ``topk_weights``: float32 ``(T, top_k)``; ``topk_ids``: int32 ``(T, top_k)``, distinct experts of the kept
        groups in selection order, values in ``[0, E)``. Both contiguous, on ``router_logits``' device.

    Raises
    ------
    TypeError
        ``router_logits`` is not a tensor of those dtypes, or ``correction_bias`` is not float32.
    ValueError
        ``router_logits`` is not 2-D or E is 0 or above 1024; ``top_k`` is not in ``[1, E]`` or above
        ``topk_group * E / n_group``; ``scoring`` is not ``"softmax"`` / ``"sigmoid"``; ``correction_bias`` is on
        another device or not ``(E,)``; ``n_group`` is not in ``[1, 32]`` or does not divide E into groups of at
        least 2; ``topk_group`` is not in ``[1, n_group]``; ``scaling_factor`` is not finite. Every message names
        the argument.

    Notes
    -----
    The CUDA kernel and the CPU implementation rank the same float32 values with the same rule, but their
    ``exp`` differ by float32 ulps: with a softmax without bias the ids agree exactly (both rank the logits) and
    the weights to a few ulps; with sigmoid or a bias, the scores themselves differ by ulps between the devices, so
    a near-tie (two choices within a few ulps) may be resolved differently. Each device matches transformers' router
    run on that device. A row holding NaN gets unspecified weights and ids (ids stay in ``[0, E)``); other rows
    are unaffected. ``T = 0`` returns empty tensors.

    Examples
    --------
    >>> gate = model.model.layers[3].mlp.gate                        # DeepseekV3TopkRouter
    >>> logits = F.linear(hidden_states.float(), gate.weight.float())  # (T, 256)
    >>> topk_weights, topk_ids = moe_route(logits, 8, scoring="sigmoid", correction_bias=gate.e_score_correction_bias,
    ...                                    n_group=8, topk_group=4, renormalize=True, scaling_factor=2.5)
    """
    return _op.moe_route(router_logits, top_k, scoring, correction_bias, n_group, topk_group, renormalize,
                         scaling_factor)


def moe_router_route(x: torch.Tensor, router_weight: torch.Tensor, top_k: int, *, scoring: str = "softmax",
                     correction_bias: Optional[torch.Tensor] = None, n_group: int = 1, topk_group: int = 1,
                     renormalize: bool = True, scaling_factor: float = 1.0,
                     logits_dtype: Optional[torch.dtype] = None):
    """A MoE layer's router GEMM and its routing in one kernel, at decode sizes: what
    ``moe_route(F.linear(x, router_weight), top_k, ...)`` returns, without the logits round trip.

    ``logits = x @ router_weight.T``, accumulated in float32 and rounded once to ``logits_dtype`` (None: ``x``'s
    dtype, as transformers' Qwen2-MoE / Qwen3-MoE / Mixtral / OLMoE routers' ``F.linear(x, weight)``;
    ``torch.float32`` for DeepSeek-V3 / GLM-4.5's ``F.linear(x.float(), weight.float())``, whose products of 16-bit
    values are the same exact float32 numbers), then :func:`moe_route` on those logits with the same arguments:
    the same device code (csrc/moe/route_row.cuh), so the same float32 operations on the same logit values.

    On sm90 one launch of a thread-block cluster of 8 CTAs, or 16 for a router weight of at least 1 MiB where such a
    cluster is resident (csrc/moe/router_route.cu): the CTAs share (16-expert tile, H slice) units and compute their
    sums for every token with mma.sync, the warps' partial sums added in a fixed order, and send them through
    distributed shared memory to the CTA routing the token, which adds the slices in order; no workspace, no
    counter, no host synchronisation, the launch fixed by the shapes (it captures into a CUDA graph and replays with
    new ``x``). A token's result depends on that token's row alone, bit for bit (not on T, not on scheduling).
    Devices without clusters run ``F.linear`` in ``logits_dtype`` and :func:`moe_route` inside the op (two
    kernels). The CPU runs ``F.linear(x.to(logits_dtype), router_weight.to(logits_dtype))`` and :func:`moe_route`.

    **Against cuBLAS's logits.** Both form the H products ``x[t, h] * w[e, h]`` exactly in float32 and add them in
    float32, in different orders (the tensor cores' adds may truncate: a relative error of at most ``2**-23`` per
    add). Two such sums of H terms differ by at most ``delta = (H - 1) * 2**-22 * sum_h |x[t, h] * w[e, h]|``; the
    rounding to ``logits_dtype`` adds at most one unit in the last place of that dtype at the logit's magnitude.
    So each logit is within ``ulp(logit) + delta`` of cuBLAS's (``delta`` is far below a bfloat16 ulp for
    router-sized H unless the sum cancels: in practice most logits are equal and the others 1 ulp apart). The
    experts chosen are the same except where the top-k is a near-tie: two ranking keys (or group scores) of the
    unfused logits closer than twice that bound (the keys move with the logits at most 1:1; softmax weights are
    ranked by logit, sigmoid scores move by at most a quarter of the logit's change).

    Parameters
    ----------
    x : torch.Tensor
        ``(T, H)`` hidden states, bfloat16 or float16, ``0 <= T <= 16`` (``MOE_ROUTER_ROUTE_MAX_T``), ``H`` a
        positive multiple of 64, rows unit-stride with a pitch that is a multiple of 8 elements, 16-byte aligned.
    router_weight : torch.Tensor
        ``(E, H)`` the router's weight (``nn.Linear(H, E).weight`` layout), ``x``'s dtype and device,
        ``1 <= E <= 1024``, the same row layout as ``x``.
    top_k, scoring, correction_bias, n_group, topk_group, renormalize, scaling_factor
        As :func:`moe_route` (``correction_bias`` on ``x``'s device).
    logits_dtype : torch.dtype, optional
        None (``x``'s dtype), ``x``'s dtype or ``torch.float32``: the dtype the logits are rounded to before routing.

    Returns
    -------
    (topk_weights, topk_ids) : tuple of torch.Tensor
        As :func:`moe_route`: float32 ``(T, top_k)`` and int32 ``(T, top_k)``, contiguous, on ``x``'s device.

    Raises
    ------
    TypeError
        ``x`` is not bfloat16 / float16, ``router_weight`` has another dtype, ``logits_dtype`` is not None, ``x``'s
        dtype or float32, or ``correction_bias`` is not float32.
    ValueError
        ``x`` is not 2-D, has more than 16 rows or an ``H`` that is not a positive multiple of 64;
        ``router_weight`` is on another device or not ``(E, H)`` with ``1 <= E <= 1024``; a row layout or an
        alignment as above is not met; ``top_k`` is not in ``[1, E]``; or a routing argument as :func:`moe_route`
        states. Every message names the argument.

    Examples
    --------
    >>> gate = model.model.layers[0].mlp.gate                     # Qwen3MoeTopKRouter: bf16 logits, softmax, top-8
    >>> topk_weights, topk_ids = moe_router_route(x, gate.weight, 8, renormalize=True)   # x: (T, 2048) bf16, T <= 16
    """
    return _op.moe_router_route(x, router_weight, top_k, scoring, correction_bias, n_group, topk_group, renormalize,
                                scaling_factor, logits_dtype)


def add_rms_norm_moe_router_route(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                                  router_weight: torch.Tensor, top_k: int, *, scoring: str = "softmax",
                                  correction_bias: Optional[torch.Tensor] = None, n_group: int = 1,
                                  topk_group: int = 1, renormalize: bool = True, scaling_factor: float = 1.0,
                                  logits_dtype: Optional[torch.dtype] = None):
    """A MoE layer's post-attention norm and its router in one kernel, at decode sizes.

    ``s = residual + x`` (rounded to ``x``'s dtype), ``residual_out = s``, ``y = rms_norm(s) * norm_weight``, then
    :func:`moe_router_route` on ``y``. Bit for bit ``fused_add_rms_norm(x, r, norm_weight, eps)`` on a copy ``r`` of
    ``residual`` (which it turns into ``residual_out``) followed by ``moe_router_route(y, router_weight, top_k,
    ...)``: every CTA of the router's cluster computes every row's sum of squares in fused_add_rms_norm's order
    (``H <= 8192``: its one-block kernel) and y with its float operations, keeps the y rows in shared memory for the
    router GEMM (csrc/moe/router_route.cu, the same plan, summation order and routing as moe_router_route), and the
    CTA that routes a token writes its ``y`` and ``residual_out`` rows. ``residual`` is read, never written. Where
    the y rows do not fit the shared memory, a cluster of 16 CTAs with them is not resident, or the device has no
    clusters, the op runs the two ops itself (the same bits).

    Parameters
    ----------
    x : torch.Tensor
        ``(T, H)`` the attention block's output ``h``, as ``moe_router_route``'s ``x`` (bfloat16 / float16,
        ``T <= 16``, ``H`` a positive multiple of 64), and ``H <= 8192``.
    residual : torch.Tensor
        ``(T, H)`` the residual stream, ``x``'s dtype, device and row layout rules.
    norm_weight : torch.Tensor
        ``(H,)`` the post-attention RMSNorm weight, ``x``'s dtype, contiguous, 16-byte aligned.
    eps : float
        RMSNorm's epsilon, finite and ``>= 0``.
    router_weight, top_k, scoring, correction_bias, n_group, topk_group, renormalize, scaling_factor, logits_dtype
        As :func:`moe_router_route`.

    Returns
    -------
    (y, residual_out, topk_weights, topk_ids) : tuple of torch.Tensor
        ``y`` and ``residual_out`` ``(T, H)`` contiguous in ``x``'s dtype; the routing as :func:`moe_router_route`.

    Raises
    ------
    TypeError, ValueError
        As :func:`moe_router_route`, naming the argument; also ``H`` above 8192, a ``residual`` / ``norm_weight``
        of another dtype, device, shape or layout, and a bad ``eps``.
    """
    return _op.add_rms_norm_moe_router_route(x, residual, norm_weight, eps, router_weight, top_k, scoring,
                                             correction_bias, n_group, topk_group, renormalize, scaling_factor,
                                             logits_dtype)


def moe_align(topk_ids: torch.Tensor, num_experts: int):
    """Group the (token, expert) pairs by expert: a stable counting sort, on the device.

    Pair ``p = t * top_k + j`` is token ``t``'s ``j``-th expert ``topk_ids[t, j]``. The pairs are sorted by expert,
    and within one expert by increasing ``p`` (stable, deterministic: the same ids give the same output on every
    run and device). Ids outside ``[0, num_experts)`` (expert parallelism's -1 for an expert on another rank) are
    not routed: they are placed after every expert's group and get ``dst_pos`` -1. One kernel launch (one thread
    block), no host synchronisation, output shapes fixed by ``T * top_k`` and ``num_experts``.

    Parameters
    ----------
    topk_ids : torch.Tensor
        ``(T, top_k)`` int32 or int64 (``moe_topk_softmax``'s ids, or transformers' ``top_k_index``), any
        strides.
    num_experts : int
        E, ``1 <= E <= 1024``.

    Returns
    -------
    (sorted_pairs, dst_pos, offsets) : tuple of torch.Tensor
        All int32, contiguous, on ``topk_ids``' device.

        - ``sorted_pairs`` ``(T * top_k,)``: row ``s`` of the permuted buffer holds pair ``sorted_pairs[s]``
          (token ``sorted_pairs[s] // top_k``); rows ``>= offsets[E - 1]`` hold the unrouted pairs, by increasing
          pair index.
        - ``dst_pos`` ``(T * top_k,)``: the inverse, ``dst_pos[p] = s``, or -1 for an unrouted pair.
        - ``offsets`` ``(E,)``: the end row of each expert's group (cumulative counts, torch's ``offs``
          convention of ``grouped_scaled_mm``); ``offsets[E - 1]`` is the number of routed pairs. Expert ``e``'s
          rows are ``[offsets[e - 1], offsets[e])`` (``offsets[-1]`` read as 0); empty experts are fine.

    Raises
    ------
    TypeError
        ``topk_ids`` is not int32 / int64.
    ValueError
        ``topk_ids`` is not 2-D or has more than 2**31 - 1 pairs, or ``num_experts`` is not in ``[1, 1024]``.
    """
    return _op.moe_align(topk_ids, num_experts)


def moe_permute_quant(x: torch.Tensor, sorted_pairs: torch.Tensor, top_k: int, dtype: torch.dtype,
                      scale: Optional[torch.Tensor] = None, group_size: Optional[int] = None):
    """Gather the tokens into the experts' order and quantize them, in one kernel: the first grouped GEMM's ``a``.

    Row ``s`` of the output is ``x[sorted_pairs[s] // top_k]`` quantized to ``dtype`` exactly as
    :func:`quantize_int8` / :func:`quantize_fp8` quantize it per token (``scale`` and ``group_size`` None), per
    tensor (``scale`` given), or as :func:`quantize_per_token_group` per 1 x 128 group (``group_size=128``):
    bit for bit the same bytes and scales as gathering the rows, then quantizing them. One launch, one block (or
    on sm90 a cluster of up to 8 for long rows) per output row, no host synchronisation.

    Parameters
    ----------
    x : torch.Tensor
        ``(T, H)`` hidden states, bfloat16, float16 or float32, ``H > 0``, unit column stride (other layouts are
        copied).
    sorted_pairs : torch.Tensor
        int32 ``(T * top_k,)`` on ``x``'s device: :func:`moe_align`'s first output. Values are not checked (that
        would need a host synchronisation): a value outside ``[0, T * top_k)`` is clamped into it.
    top_k : int
        Experts per token, ``>= 1``.
    dtype : torch.dtype
        ``torch.int8`` or ``torch.float8_e4m3fn``.
    scale : torch.Tensor, optional
        Static per-tensor activation scale: float32, one element, on ``x``'s device. None: dynamic.
    group_size : int, optional
        None or 0: per token (or per tensor with ``scale``); 128: dynamic per 1 x 128 group (block fp8's
        activations; ``H`` a multiple of 128, ``scale`` None).

    Returns
    -------
    (q, q_scale) : tuple of torch.Tensor
        ``q``: ``dtype``, ``(T * top_k, H)``, contiguous. ``q_scale``: float32 ``(T * top_k, 1)`` (per token),
        ``(T * top_k, H / 128)`` (``group_size=128``), or the given ``scale`` object (static).

    Raises
    ------
    TypeError
        ``x``, ``sorted_pairs``, ``dtype`` or ``scale`` has the wrong dtype.
    ValueError
        ``x`` is not 2-D or has ``H = 0``; ``sorted_pairs`` is not ``(T * top_k,)`` or is on another device;
        ``top_k < 1``; ``scale`` is not one element or is on another device; ``group_size`` is not 0 / None or
        128; with ``group_size=128``, ``scale`` is given or ``H`` is not a multiple of 128.

    Notes
    -----
    A row with a non-finite value gets an unspecified ``q`` and scale; other rows are unaffected. The op itself
    (``torch.ops.cutlass_w8a8.moe_permute_quant``, ``group_size`` an int) returns per-row scales in the static
    mode too (the given value repeated, ``(T * top_k, 1)``).
    """
    q, s = _op.moe_permute_quant(x, sorted_pairs, top_k, dtype, scale, group_size or 0)
    return q, (s if scale is None else scale)


def moe_unpermute(y: torch.Tensor, dst_pos: torch.Tensor, topk_weights: torch.Tensor,
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Weight and sum each token's expert outputs back into token order.

    ``out[t] = sum_{j = 0 .. top_k - 1} topk_weights[t, j] * y[dst_pos[t * top_k + j]]`` in float32: each product
    rounded to float32, added one ``j`` at a time in increasing ``j`` starting from 0, pairs with ``dst_pos`` -1
    (unrouted) skipped, then rounded once to ``y``'s dtype. The CUDA kernel and the CPU implementation do the
    same float32 operations in the same order, so they agree bit for bit. One launch (a block per token), no
    host synchronisation.

    Parameters
    ----------
    y : torch.Tensor
        ``(T * top_k, H)`` bfloat16, float16 or float32: the experts' outputs in :func:`moe_align`'s order (the
        second grouped GEMM's output). Rows past ``offsets[E - 1]`` are never read (only unrouted pairs point
        there, and they are skipped). Unit column stride (other layouts are copied).
    dst_pos : torch.Tensor
        int32 ``(T * top_k,)``: :func:`moe_align`'s second output. Values are not checked (no host
        synchronisation): a value outside ``[0, T * top_k)`` is skipped like -1.
    topk_weights : torch.Tensor
        float32 ``(T, top_k)``: :func:`moe_topk_softmax`'s weights (or transformers' ``top_k_weights`` cast to
        float32).
    out : torch.Tensor, optional
        ``(T, H)`` contiguous, ``y``'s dtype and device: written and returned (a static buffer for CUDA graphs).

    Returns
    -------
    torch.Tensor
        ``(T, H)`` in ``y``'s dtype, contiguous (``out`` when given). A token with no routed pair gets zeros.

    Raises
    ------
    TypeError
        ``y``, ``dst_pos``, ``topk_weights`` or ``out`` has the wrong dtype.
    ValueError
        A shape or device is wrong (the message names the argument), or ``out`` is not contiguous.
    """
    if out is None:
        return _op.moe_unpermute(y, dst_pos, topk_weights)
    _op.moe_unpermute_out(out, y, dst_pos, topk_weights)
    return out


def grouped_scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                      offsets: torch.Tensor, out_dtype: torch.dtype, bias: Optional[torch.Tensor] = None,
                      out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The experts' GEMMs of a mixture-of-experts layer in one call: ``a``'s rows are grouped by expert.

    Expert ``e`` owns the rows ``[offsets[e - 1], offsets[e])`` of ``a`` (``offsets[-1]`` read as 0: torch's
    ``offs`` convention of ``torch._grouped_mm`` / ``F.scaled_grouped_mm``, and :func:`moe_align`'s third output),
    and for each of its rows ``t``::

        out[t, n] = scale_a(t) * scale_b(e, n) * sum_k a[t, k] * b[e, k, n]  (+ bias[e, n])

    with the products exact (int8: int32 accumulation; e4m3: float32 accumulation, the row-wise kernels with fast
    accumulation as :func:`scaled_mm`), the scaling in float32 and one rounding to ``out_dtype``. With block
    scales (``scale_b`` 3-D, e4m3 only) each 128-deep K block's float32 partial sum is multiplied by
    ``scale_a[t, kb] * scale_b[e, n // 128, kb]`` before it is added, as :func:`scaled_mm`'s block mode
    (CUTLASS example 68's grouped blockwise-scaled GEMM).

    On CUDA (sm90 only) T up to the grouped decode kernel's bound runs that kernel (it streams only the weights of
    the experts that have rows); larger T runs a CUTLASS ptr-array grouped GEMM whose per-expert problem sizes
    and pointers are built on the device. Neither reads ``offsets`` on the host: the call never synchronises and
    captures into a CUDA graph whatever the routing (a replay with new ``offsets`` computes the new routing).
    Experts with no rows are skipped.

    Parameters
    ----------
    a : torch.Tensor
        ``(T, K)`` int8 or float8_e4m3fn, row-major (``stride(1) == 1``, ``stride(0)`` a multiple of 16 and at
        least K), 16-byte aligned; K a positive multiple of 16 (of 128 with block scales), at most 131056 for int8.
    b : torch.Tensor
        ``(E, K, N)``, ``a``'s dtype: the experts' row-major ``(E, N, K)`` weights as ``w.transpose(1, 2)``
        (``stride(1) == 1``; ``stride(2)`` >= K and ``stride(0)`` >= N * ``stride(2)``, multiples of 16);
        ``1 <= E <= 1024``, N a positive multiple of 16.
    scale_a : torch.Tensor
        float32, contiguous: per-token ``(T,)`` or ``(T, 1)``, per-tensor (one value), or with block scales
        ``(T, K/128)`` (one scale per 1x128 group, :func:`quantize_per_token_group`'s).
    scale_b : torch.Tensor
        float32, contiguous: per-channel ``(E, N)``, per-expert ``(E,)`` or ``(E, 1)``, or block fp8
        ``(E, ceil(N/128), K/128)`` (one scale per 128x128 block of each expert's (N, K) weight).
    offsets : torch.Tensor
        int32 ``(E,)``, contiguous, on ``a``'s device: the end row of each expert's group, non-decreasing within
        ``[0, T]``. The CPU implementation raises ``ValueError`` naming ``offsets`` otherwise; the CUDA kernels
        cannot check device data without a host synchronisation, so they clamp instead: ``c[e] = min(T,
        max(c[e - 1], offsets[e]))`` with ``c[-1] = 0``, and expert e owns rows ``[c[e - 1], c[e])``.
    out_dtype : torch.dtype
        torch.bfloat16 or torch.float16.
    bias : torch.Tensor, optional
        ``(E, N)`` contiguous, ``out_dtype``: expert e's bias is added to its rows.
    out : torch.Tensor, optional
        ``(T, N)`` contiguous, ``out_dtype``, 16-byte aligned: written and returned (a static buffer for CUDA
        graphs).

    Returns
    -------
    torch.Tensor
        ``(T, N)`` ``out_dtype``, contiguous (``out`` when given). Rows ``t >= offsets[E - 1]`` (pairs routed to no
        expert) are not written: unspecified in a fresh CUDA result (zero in a fresh CPU one), unchanged in
        ``out``.

    Raises
    ------
    TypeError
        A dtype is wrong (``a`` not 8-bit, ``b`` of another dtype, a scale not float32, ``offsets`` not int32,
        ``out_dtype`` / ``bias`` / ``out`` not bfloat16 / float16 or not matching), or block scales with int8.
    ValueError
        A shape, layout, alignment or device is wrong (the message names the argument), or, on the CPU, the
        values of ``offsets`` are not non-decreasing within ``[0, T]``.
    NotImplementedError
        On a CUDA device other than sm90 (the message names the device).
    RuntimeError
        The CUDA extension or the sm90 kernel library is not built or not loaded.
    """
    if out is None:
        return _op.grouped_scaled_mm(a, b, scale_a, scale_b, offsets, out_dtype, bias)
    _op.grouped_scaled_mm_out(out, a, b, scale_a, scale_b, offsets, bias)
    return out


def moe_decode_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                       w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor, group_size: int = 0,
                       out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The routed experts of a SwiGLU MoE layer at decode sizes (``T * top_k <= 64``), fused into two or three kernels.

    For each token ``t`` and its experts ``e_j = topk_ids[t, j]`` (``j < top_k``) with weights
    ``w_j = topk_weights[t, j]``::

        out[t] = sum_j w_j * down_e(silu(gate_e(x[t])) * up_e(x[t]))

    every projection a W8A8 GEMM. The result equals, **bit for bit**, the unfused chain that
    `cutlass_w8a8.W8A8MoE` runs above 64 pairs (and with ``fused_decode = False``), on the same device::

        sorted_pairs, dst_pos, offsets = moe_align(topk_ids, E)
        q, s = moe_permute_quant(x, sorted_pairs, top_k, w13.dtype, group_size=group_size or None)
        y13 = grouped_scaled_mm(q, w13.transpose(1, 2), s, w13_scale, offsets, out_dtype)
        q2, s2 = silu_mul_quant(y13, w13.dtype, None, group_size)
        y2 = grouped_scaled_mm(q2, w2.transpose(1, 2), s2, w2_scale, offsets, out_dtype)
        out = moe_unpermute(y2, dst_pos, topk_weights)

    so the activations are quantized dynamically per token (``group_size`` 0) or per 1 x 128 group
    (``group_size`` 128), the intermediate ``silu(gate) * up`` is rounded to ``out_dtype`` before its quantization,
    and the top-k outputs are weighted and summed in float32 in increasing ``j``, then rounded once.

    On CUDA (sm90) the op runs two kernels at ``top_k >= 4`` within the speed rule below and three otherwise, with
    no host synchronisation, its launches fixed by the shapes (it captures into a CUDA graph and replays with new
    routings). The two kernels:

    1. **gate/up**: a grouped decode GEMM whose CTAs find their expert from ``topk_ids`` (no sort), quantize the
       ``x`` rows of their tokens themselves (per token or per group, into shared memory) and apply
       ``silu(gate) * up`` in the epilogue, storing the intermediate row in ``out_dtype``;
    2. **down** (token-major): each CTA owns one token's 16 output columns; it quantizes the token's ``top_k``
       intermediate rows itself, weights each row's result by ``topk_weights`` and sums them in increasing ``j``
       (deterministic: a fixed order, no float atomics), writing ``out`` (zeros for a token with no routed pair).

    Below ``top_k`` 4, or where the redundant quantization of the two kernels above outweighs the launch they save
    (``T x H > 2048`` or ``top_k x I > 6144``: on an H200 the two-kernel path won at Qwen3-30B-A3B dims at ``T = 1``
    and lost at ``T = 8`` and at DeepSeek-V3 dims, csrc/moe/moe_decode.cu ``own_quant``), or with the environment
    variable ``CUTLASS_W8A8_MOE_DECODE_PREP=1`` (read once per process: an A/B switch giving the same bits; ``0``
    forces the two kernels wherever ``top_k >= 4`` and their shared memory fits; another value than unset, empty,
    0 or 1 raises ``ValueError``):

    1. **prep**: the per-token (or per-group) quantization of ``x`` and the zeroing of the workspace counters;
    2. **gate/up**: as above on prep's quantized rows; the last CTA of each (token, expert) pair to finish
       quantizes that pair's intermediate row;
    3. **down**: the token-major kernel above on the quantized rows (``top_k >= 4``), or a grouped decode GEMM whose
       epilogue weights each row by ``topk_weights``, the last CTA per (token, 16-column tile) summing the token's
       ``top_k`` rows in increasing ``j`` and writing ``out``.

    The two-kernel path is also left for the three-kernel one where its shared memory would exceed 64 KiB per CTA
    (``T`` quantized ``x`` rows of about ``H`` bytes in gate/up, 8 intermediate rows of ``I`` bytes in down).
    ``cutlass_w8a8._ext.moe_decode_path(T, top_k, H, I, group_size)`` names the path these sizes take in this
    process.

    Only the weights of the experts that some pair routes to are read, each once per CTA tile. On the CPU the op
    runs the chain's CPU references (`cutlass_w8a8.ops._reference`), so it equals the chain there by construction.

    Parameters
    ----------
    x : torch.Tensor
        ``(T, H)`` hidden states, bfloat16, float16 or float32, any strides (copied when ``stride(1) != 1``).
        ``T`` may be 0.
    topk_ids : torch.Tensor
        ``(T, top_k)`` int32 or int64, any strides, ``top_k >= 1`` and ``T * top_k <= 64``
        (``MOE_DECODE_MAX_PAIRS``). Ids outside ``[0, E)`` (expert parallelism's -1) are not routed: a token's output
        sums its routed pairs only, and a token with none gets zeros (as :func:`moe_align` / :func:`moe_unpermute`).
        Values are not checked (no host synchronisation).
    topk_weights : torch.Tensor
        ``(T, top_k)`` float32 (``topk_ids``' shape), any strides.
    w13 : torch.Tensor
        ``(E, 2I, H)`` int8 or float8_e4m3fn, contiguous: each expert's gate rows ``[0, I)`` and up rows
        ``[I, 2I)`` (`W8A8MoE.w13`). ``1 <= E <= 1024``; ``H`` and ``I`` positive multiples of 16, at most 131056
        for int8 (``INT8_MAX_K``).
    w13_scale : torch.Tensor
        float32, contiguous. ``group_size`` 0: per channel ``(E, 2I)``, or per expert ``(E,)`` / ``(E, 1)``.
        ``group_size`` 128: one scale per 128 x 128 block of each expert's weight, ``(E, ceil(2I/128), H/128)``.
    w2 : torch.Tensor
        ``(E, H, I)``, ``w13``'s dtype, contiguous: each expert's down projection (`W8A8MoE.w2`).
    w2_scale : torch.Tensor
        float32, contiguous: ``(E, H)``, ``(E,)`` or ``(E, 1)``; with ``group_size`` 128 ``(E, ceil(H/128), I/128)``.
    group_size : int, default 0
        0: per-token activation scales (row-wise weight scales). 128: per 1 x 128 group activation scales and block
        weight scales (block fp8: float8_e4m3fn only, ``H`` and ``I`` multiples of 128).
    out_dtype : torch.dtype, default torch.bfloat16
        torch.bfloat16 or torch.float16: the dtype of the GEMMs' outputs, the intermediate and the result.

    Returns
    -------
    torch.Tensor
        ``(T, H)`` ``out_dtype``, contiguous, a new tensor on ``x``'s device.

    Raises
    ------
    TypeError
        ``x`` is not bfloat16 / float16 / float32, ``topk_ids`` not int32 / int64, ``topk_weights`` or a scale not
        float32, ``w13`` not int8 / float8_e4m3fn (or not float8_e4m3fn with ``group_size`` 128), ``w2`` not of
        ``w13``'s dtype, ``out_dtype`` not bfloat16 / float16.
    ValueError
        ``group_size`` not 0 / 128; a tensor on another device than ``x``; a shape that disagrees with the ones above
        (the message names the argument), ``T * top_k`` above 64, ``E``, ``H`` or ``I`` out of range, a weight or
        scale not contiguous; on CUDA, ``CUTLASS_W8A8_MOE_DECODE_PREP`` (or another of the decode path's A/B
        switches, docs/MOE.md) set to a value it does not accept.
    NotImplementedError
        On a CUDA device other than sm90 (the message names the device).
    RuntimeError
        The CUDA extension is not built or not loaded.

    Examples
    --------
    >>> moe = cw.W8A8MoE.from_float(block.experts, cw.W8A8Config(dtype=torch.float8_e4m3fn), top_k=8)
    >>> topk_weights, topk_ids = moe.route(router_logits)                  # (T, 8) each, T <= 8
    >>> out = moe_decode_experts(x, topk_ids, topk_weights, moe.w13, moe.w13_scale, moe.w2, moe.w2_scale,
    ...                          moe.group_size, moe.dtype)                 # (T, H) bfloat16
    """
    return _op.moe_decode_experts(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, group_size, out_dtype)
