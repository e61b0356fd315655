"""Tensor parallelism of mixture-of-experts experts: `TensorParallelW8A8MoE` (a `cutlass_w8a8.moe.W8A8MoE` holding
this rank's slice of every expert's intermediate size I) and `shard_moe`.

Megatron-LM / vLLM layout of an expert's SwiGLU MLP, per expert (the same as the dense MLP of
`cutlass_w8a8.distributed.decoder`): gate and up projections column-parallel over I, down projection row-parallel
over I, one all-reduce of the layer's output. In W8A8MoE's buffers (E experts, hidden H, intermediate I, world w):

- ``w13`` ``[E, 2I, H]`` -> ``[E, 2 I / w, H]``: rank ``r`` keeps the gate rows ``[r I / w, (r + 1) I / w)`` and the
  same up rows (``I + ...``), stacked ``[gate_r; up_r]``, so the shard is again a gate/up stack and the layer's
  ``silu_mul_quant`` pairs the right halves. Its per-channel scale ``[E, 2I]`` follows its rows; a block scale
  ``[E, 2I / 128, H / 128]`` keeps the rows of the shard's row blocks.
- ``w2`` ``[E, H, I]`` -> ``[E, H, I / w]`` (the same I columns); its per-channel scale ``[E, H]`` stays whole (one
  scale per output row, common to all its columns), a block scale ``[E, ceil(H / 128), I / 128]`` keeps the
  shard's column blocks.
- ``a13_scale`` / ``a2_scale`` (static per-tensor activation scales) are replicated.

Routing (top-k, permutation) is computed on every rank from the same inputs, identically; each rank runs the
whole W8A8MoE chain on its slice of I and returns a partial sum of the output, all-reduced (SUM) over the group
with ``torch.distributed.all_reduce`` (NCCL on CUDA: ordered on the current stream and capturable in a CUDA graph;
gloo on the CPU), so every rank returns the full ``[..., H]`` output.

What the result is, against the unsharded layer (the row-parallel linear's argument,
`cutlass_w8a8.distributed.linear`): the first GEMM's outputs are exactly the unsharded layer's gate / up columns
of the shard (same quantized input, same rows and scales). The second GEMM's input, ``silu(gate) * up`` of the
shard, is quantized per shard: with dynamic per-token activations each rank's per-token scale is the absmax of
its own ``I / w`` columns (never larger than the full row's), so the quantized values differ from the unsharded
layer's by rounding; with static ``a2_scale`` or block-scaled fp8 (``I / w`` a multiple of 128, so each rank's
1 x 128 groups are groups of the unsharded layer) they are exactly its slices. Then each rank's partial output is
rounded to the layer's dtype before the reduce. tests/distributed/test_tp_moe_cpu.py states the resulting criteria.

Requirements (ValueError naming the sizes, the same on every rank): I divisible by the world size, ``I / w`` a
multiple of 16, and a multiple of 128 for block-scaled fp8 (`sharding.check_moe_shardable`).
"""

from __future__ import annotations

import struct
from typing import Optional

import torch
from torch import nn

from ..config import W8A8Config
from ..moe.families import SCORINGS, family_of
from ..moe.layer import W8A8MoE
from . import sharding as S
from ._common import TPContext, _all_reduce_, _check_tp_size, _TensorParallel
from ._group import check_same_on_all_ranks, dtype_code, sequence_code

__all__ = ["TensorParallelW8A8MoE", "shard_experts_", "shard_moe", "tp_split"]


def _fields(e, k, h, i, quant_dtype, dtype, block, static, renormalize, tp_size, routing: dict) -> dict:
    bias = routing["correction_bias"]
    return {"num_experts": e, "top_k": k, "hidden_size": h, "intermediate_size": i,
            "quant_dtype": dtype_code(quant_dtype), "dtype": dtype_code(dtype), "block": int(bool(block)),
            "static_input": int(bool(static)), "renormalize": int(bool(renormalize)),
            "tp_size": -1 if tp_size is None else int(tp_size),
            "scoring": SCORINGS.index(routing["scoring"]) if routing["scoring"] in SCORINGS else -1,
            "n_group": routing["n_group"], "topk_group": routing["topk_group"],
            "#scaling_factor": sequence_code(struct.unpack("<2i", struct.pack("<d", float(routing["scaling_factor"])))),
            "correction_bias": int(bias is not None)}


def _routing(moe: W8A8MoE) -> dict:
    """The router-logits-mode routing of ``moe`` as `TensorParallelW8A8MoE.from_shard`'s keyword arguments (the
    correction bias replicated: every rank routes the same tokens)."""
    return {"scoring": moe.scoring, "n_group": moe.n_group, "topk_group": moe.topk_group,
            "scaling_factor": moe.scaling_factor, "correction_bias": moe.correction_bias}


class TensorParallelW8A8MoE(_TensorParallel, W8A8MoE):
    """A `W8A8MoE` holding rank ``tp_rank``'s slice of every expert's intermediate size (module docstring):
    ``intermediate_size`` is the shard's ``I / tp_size``; ``full_intermediate_size`` the unsharded I.

    Build it with `from_full` (a full W8A8MoE: its quantized weights and scales, sliced, no re-quantization) or
    `from_shard` (buffers already sliced, e.g. read from a checkpoint); `shard_moe` is `from_full`.

    Buffers: W8A8MoE's, holding the shard: ``w13`` ``[E, 2 I / tp, H]`` (``[gate_r; up_r]`` per expert),
    ``w13_scale`` ``[E, 2 I / tp]`` or ``[E, 2 I / tp / 128, H / 128]``, ``w2`` ``[E, H, I / tp]``, ``w2_scale``
    ``[E, H]`` (whole) or ``[E, ceil(H / 128), I / tp / 128]``, ``a13_scale`` / ``a2_scale`` ``[1]`` or None.

    ``forward(hidden_states, router_logits_or_topk_ids, topk_weights=None)``: W8A8MoE's arguments, the same full
    tensors on every rank; returns the full output (``hidden_states``' shape and dtype), equal on every rank: the
    sum over ranks of each rank's partial output, all-reduced in ``hidden_states``' dtype.

    Attributes
    ----------
    full_intermediate_size : int
    reduce_results : bool
        All-reduce the partial outputs (default True). False returns this rank's partial output: only for
        measuring the reduce's share, or for tests.
    tp_group, tp_rank, tp_size
    """

    @classmethod
    def from_full(cls, moe: W8A8MoE, tp_group, *, tp_size: Optional[int] = None,
                  check: bool = True) -> "TensorParallelW8A8MoE":
        """This rank's shard of a full (unsharded) `W8A8MoE`, identical on every rank.

        Parameters
        ----------
        moe : W8A8MoE
        tp_group : torch.distributed.ProcessGroup or TPContext
        tp_size : int, optional
            The tensor-parallel size this rank was configured for; checked against the group on every rank.
        check : bool
            Run the cross-rank agreement check (one all_gather; default True; a caller that checked a whole model
            once passes False).

        Raises
        ------
        TypeError
            ``moe`` is not an unsharded W8A8MoE.
        ValueError
            (the same on every rank) the ranks disagree on the layer's sizes, dtypes, scales or ``tp_size``; I is
            not divisible by the world size, or ``I / world`` is not a multiple of 16 (128 for block-scaled fp8).
        """
        where = cls.__name__
        if not isinstance(moe, W8A8MoE) or isinstance(moe, _TensorParallel):
            raise TypeError(f"{where}.from_full: `moe` must be an unsharded W8A8MoE, got {type(moe).__name__}")
        ctx = TPContext.resolve(tp_group, where)
        block = moe.weight_block_size is not None
        i = moe.intermediate_size
        if check:
            check_same_on_all_ranks(ctx, where, _fields(
                moe.num_experts, moe.top_k, moe.hidden_size, i, moe.quant_dtype, moe.dtype, block,
                moe.a13_scale is not None, moe.renormalize, tp_size, _routing(moe)))
        _check_tp_size(where, tp_size, ctx.world)
        S.check_moe_shardable(i, ctx.world, block, where)
        r, w = ctx.rank, ctx.world
        b = moe._buffers
        if block:
            s13 = S.shard_w13_block_scale(b["w13_scale"], i, r, w)
            s2 = S.shard_w2_block_scale(b["w2_scale"], i, r, w)
        else:
            s13, s2 = S.shard_w13(b["w13_scale"], i, r, w), b["w2_scale"].clone()
        return cls._build(ctx, S.shard_w13(b["w13"], i, r, w), s13, S.shard_w2(b["w2"], r, w), s2,
                          top_k=moe.top_k, intermediate_size=i, dtype=moe.dtype, renormalize=moe.renormalize,
                          activation=moe.activation, weight_block_size=moe.weight_block_size,
                          a13_scale=None if b["a13_scale"] is None else b["a13_scale"].clone(),
                          a2_scale=None if b["a2_scale"] is None else b["a2_scale"].clone(), **_routing(moe))

    @classmethod
    def from_shard(cls, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
                   tp_group, *, top_k: int, intermediate_size: int, dtype: torch.dtype = torch.bfloat16,
                   renormalize: bool = True, weight_block_size: Optional[tuple] = None,
                   a13_scale: Optional[torch.Tensor] = None, a2_scale: Optional[torch.Tensor] = None,
                   tp_size: Optional[int] = None, check: bool = True, scoring: str = "softmax", n_group: int = 1,
                   topk_group: int = 1, scaling_factor: float = 1.0,
                   correction_bias: Optional[torch.Tensor] = None) -> "TensorParallelW8A8MoE":
        """A layer around this rank's already-sliced buffers (no copy): ``w13`` ``[E, 2 I / tp, H]`` int8 / e4m3
        (``[gate_r; up_r]``: `sharding.shard_w13`), ``w13_scale`` ``[E, 2 I / tp]`` or with ``weight_block_size =
        (128, 128)`` ``[E, 2 I / tp / 128, H / 128]``, ``w2`` ``[E, H, I / tp]`` (`sharding.shard_w2`), ``w2_scale``
        ``[E, H]`` or ``[E, ceil(H / 128), I / tp / 128]``, ``a13_scale`` / ``a2_scale`` float32 ``[1]`` (both or
        neither); ``intermediate_size`` is the full I, ``dtype`` the output dtype. The routing of router-logits
        mode (``top_k``, ``renormalize``, ``scoring``, ``n_group``, ``topk_group``, ``scaling_factor``,
        ``correction_bias`` ``[E]``: `W8A8MoE`'s, whole on every rank). ``check``: as `from_full` (a loader that
        checked every layer once passes False). Errors as `from_full`, and ValueError when a buffer's shape is not
        the shard's."""
        where = cls.__name__
        ctx = TPContext.resolve(tp_group, where)
        routing = {"scoring": scoring, "n_group": n_group, "topk_group": topk_group,
                   "scaling_factor": scaling_factor, "correction_bias": correction_bias}
        e, i2_local, h = w13.shape
        block = weight_block_size is not None
        if check:
            check_same_on_all_ranks(ctx, where, _fields(
                e, top_k, h, intermediate_size, w13.dtype, dtype, block, a13_scale is not None, renormalize,
                tp_size, routing))
        _check_tp_size(where, tp_size, ctx.world)
        local = S.check_moe_shardable(intermediate_size, ctx.world, block, where)
        if tuple(w13.shape) != (e, 2 * local, h) or tuple(w2.shape) != (e, h, local):
            raise ValueError(f"{where}.from_shard: `w13` must be [E, 2 I / tp, H] = [{e}, {2 * local}, {h}] and `w2` "
                             f"[E, H, I / tp] = [{e}, {h}, {local}], got {tuple(w13.shape)} and {tuple(w2.shape)}")
        return cls._build(ctx, w13, w13_scale, w2, w2_scale, top_k=top_k, intermediate_size=intermediate_size,
                          dtype=dtype, renormalize=renormalize, activation="silu",
                          weight_block_size=weight_block_size, a13_scale=a13_scale, a2_scale=a2_scale, **routing)

    @classmethod
    def _build(cls, ctx: TPContext, w13, w13_scale, w2, w2_scale, *, top_k, intermediate_size, dtype, renormalize,
               activation, weight_block_size, a13_scale, a2_scale, scoring, n_group, topk_group, scaling_factor,
               correction_bias):
        e, _, h = w13.shape
        local = intermediate_size // ctx.world
        config = W8A8Config(dtype=w13.dtype, out_dtype=dtype, weight_block_size=weight_block_size)
        # built on the meta device (the constructor checks the shard's sizes and the routing), then given the real
        # buffers; the correction bias as W8A8MoE holds it (the same float32 tensor, else a float32 copy)
        mod = cls(e, top_k, h, local, config, renormalize, activation, device="meta",
                  static_input_scale=a13_scale is not None, scoring=scoring, n_group=n_group,
                  topk_group=topk_group, scaling_factor=scaling_factor, correction_bias=correction_bias)
        if correction_bias is not None:
            mod._buffers["correction_bias"] = correction_bias.detach().reshape(e).to(device=w13.device,
                                                                                      dtype=torch.float32)
        for name, t in (("w13", w13), ("w13_scale", w13_scale), ("w2", w2), ("w2_scale", w2_scale),
                        ("a13_scale", a13_scale), ("a2_scale", a2_scale)):
            want = mod._buffers[name]
            if (t is None) != (want is None):
                raise ValueError(f"{cls.__name__}: give both `a13_scale` and `a2_scale` (static per-tensor) or "
                                 "neither")
            if t is None:
                continue
            if name in ("w13_scale", "w2_scale", "a13_scale", "a2_scale"):
                t = t.to(torch.float32)
                if t.numel() == want.numel():
                    t = t.reshape(want.shape)
            if tuple(t.shape) != tuple(want.shape) or t.dtype != want.dtype:
                raise ValueError(f"{cls.__name__}: `{name}` of the shard must be {want.dtype} {tuple(want.shape)}, "
                                 f"got {t.dtype} {tuple(t.shape)}")
            mod._buffers[name] = t
        mod._tp = ctx
        mod.tp_rank, mod.tp_size = ctx.rank, ctx.world
        mod.full_intermediate_size = intermediate_size
        mod.reduce_results = True
        return mod

    def forward(self, hidden_states: torch.Tensor, router_logits_or_topk_ids: torch.Tensor,
                topk_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        y = super().forward(hidden_states, router_logits_or_topk_ids, topk_weights)
        if self.reduce_results and self.tp_size > 1:
            y = y.contiguous()
            _all_reduce_(y, self.tp_group)
        return y

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, tp_rank={self.tp_rank}, tp_size={self.tp_size}, "
                f"full_intermediate_size={self.full_intermediate_size}")


def shard_moe(moe: W8A8MoE, tp_group, *, tp_size: Optional[int] = None, check: bool = True) -> TensorParallelW8A8MoE:
    """This rank's `TensorParallelW8A8MoE` shard of a full `W8A8MoE` (`TensorParallelW8A8MoE.from_full`; arguments
    and errors as there)."""
    return TensorParallelW8A8MoE.from_full(moe, tp_group, tp_size=tp_size, check=check)


def tp_split(model: nn.Module, name: str) -> str:
    """How the `W8A8MoE` at ``name`` in ``model`` splits over the ranks: the ``tp`` of its block's row of
    `cutlass_w8a8.moe.families` (``"intermediate"``: every expert over I, what `TensorParallelW8A8MoE` does), the same
    for a layer outside any family's block. NotImplementedError for a split this module does not implement."""
    parent = name.rpartition(".")[0]
    fam = family_of(model.get_submodule(parent)) if parent else None
    split = "intermediate" if fam is None else fam.tp
    if split != "intermediate":
        raise NotImplementedError(f"{TensorParallelW8A8MoE.__name__} {name!r}: the {fam.name} family splits its "
                                  f"experts by {split!r}; only 'intermediate' is implemented")
    return split


def shard_experts_(model: nn.Module, tp_group, *, check: bool = True) -> list:
    """Replace every unsharded `W8A8MoE` in ``model`` by its shard (`shard_moe`), in place; return their names.
    ``tp_group``: a ``ProcessGroup`` or the caller's `TPContext` (passed down to every shard).

    With ``check``, one cross-rank check of all of them (their count and sizes) first; every layer's split
    (`tp_split`, the family table's) is checked before any is replaced. Raises as `shard_moe` (a split error names
    the layer).
    """
    ctx = TPContext.resolve(tp_group, "shard_experts_")
    found = [(n, m) for n, m in model.named_modules()
             if n and isinstance(m, W8A8MoE) and not isinstance(m, _TensorParallel)]
    if check:
        check_same_on_all_ranks(ctx, "shard_experts_", {
            "experts layers": len(found),
            "#experts sizes": sequence_code([v for _, m in found for v in (m.num_experts, m.hidden_size,
                                                                           m.intermediate_size)])})
    for name, m in found:
        tp_split(model, name)
        S.check_moe_shardable(m.intermediate_size, ctx.world, m.weight_block_size is not None,
                              f"{TensorParallelW8A8MoE.__name__} {name!r}")
    for name, m in found:
        new = shard_moe(m, ctx, check=False)
        new.train(m.training)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
    return [n for n, _ in found]
