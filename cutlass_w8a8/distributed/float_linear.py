"""`ColumnParallelLinear` and `RowParallelLinear`: float ``nn.Linear`` layers sharded like their W8A8 counterparts
(`cutlass_w8a8.distributed.linear`), for the layers a tensor-parallel plan shards but quantization leaves in
float (and for float reference models)."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from . import sharding as S
from ._common import TPContext, _all_reduce_, _check_tp_size, _fields, _gather_columns, _set_tp, _TensorParallel
from ._group import check_same_on_all_ranks, dtype_code, sequence_code

__all__ = ["ColumnParallelLinear", "RowParallelLinear"]


def _float_layer(cls, weight: torch.Tensor, bias: Optional[torch.Tensor], requires_grad: bool) -> nn.Linear:
    mod = cls(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta", dtype=weight.dtype)
    mod.weight = nn.Parameter(weight, requires_grad=requires_grad)
    if bias is not None:
        mod.bias = nn.Parameter(bias, requires_grad=requires_grad)
    return mod


def _linear_source(cls, linear: nn.Module, tp_group):
    """``(N, K, where, ctx)`` of a full ``linear`` for ``cls``'s builders (float here, W8A8 in `linear`): its
    weight's shape, ``cls``'s name for the messages and the resolved `TPContext`."""
    n, k = linear.weight.shape
    return n, k, cls.__name__, TPContext.resolve(tp_group, cls.__name__)


class ColumnParallelLinear(_TensorParallel, nn.Linear):
    """The float ``nn.Linear`` counterpart of `ColumnParallelW8A8Linear` (for layers a tensor-parallel plan
    shards but quantization leaves in float): ``weight`` ``(N / tp, K)``, ``bias`` ``(N / tp,)``; ``forward`` as
    ``nn.Linear`` on the shard, with the same ``output_sizes`` and ``gather_output`` semantics."""

    @classmethod
    def from_linear(cls, linear: nn.Linear, tp_group, *, output_sizes: Optional[Sequence[int]] = None,
                    gather_output: bool = False, tp_size: Optional[int] = None,
                    check: bool = True, replicas: Optional[Sequence[int]] = None) -> "ColumnParallelLinear":
        """This rank's rows of a full float ``linear``. Arguments (``replicas`` included; ``tp_group`` a
        ``ProcessGroup`` or a `TPContext`) and errors as `ColumnParallelW8A8Linear.from_float` (no alignment
        requirement)."""
        n, k, where, ctx = _linear_source(cls, linear, tp_group)
        rank, world = ctx.rank, ctx.world
        if check:
            check_same_on_all_ranks(ctx, where, _fields(
                "colwise", n, k, tp_size, **{"#output_sizes": sequence_code(output_sizes or []),
                                             "#replicas": sequence_code(replicas or [])},
                dtype=dtype_code(linear.weight.dtype), bias=linear.bias is not None, gather_output=gather_output))
        _check_tp_size(where, tp_size, world)
        sizes = S.check_column_shardable(n, k, world, output_sizes, where, quantized=False, replicas=replicas)
        w = linear.weight.detach()
        mod = _float_layer(cls, S.shard_rows(w, sizes, rank, world, replicas),
                           None if linear.bias is None else S.shard_rows(linear.bias.detach(), sizes, rank, world,
                                                                         replicas),
                           linear.weight.requires_grad)
        _set_tp(mod, ctx, n, k)
        mod.output_sizes, mod.gather_output = sizes, gather_output
        mod.output_replicas = [1] * len(sizes) if replicas is None else [int(r) for r in replicas]
        return mod

    @classmethod
    def from_shard(cls, weight: torch.Tensor, tp_group, *, output_sizes: Sequence[int],
                   bias: Optional[torch.Tensor] = None, gather_output: bool = False,
                   replicas: Optional[Sequence[int]] = None) -> "ColumnParallelLinear":
        """A layer around this rank's rows (``weight`` ``(N / tp, K)``, ``bias`` ``(N / tp,)``, `sharding.column_rows`
        of the full layer's ``output_sizes`` and ``replicas``); no cross-rank check (the caller made one)."""
        sizes = [int(v) for v in output_sizes]
        ctx = TPContext.resolve(tp_group, cls.__name__)
        S.check_column_shardable(sum(sizes), weight.shape[1], ctx.world, sizes, cls.__name__, quantized=False,
                                 replicas=replicas)
        mod = _float_layer(cls, weight, bias, False)
        _set_tp(mod, ctx, sum(sizes), weight.shape[1])
        mod.output_sizes, mod.gather_output = sizes, gather_output
        mod.output_replicas = [1] * len(sizes) if replicas is None else [int(r) for r in replicas]
        return mod

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if self.gather_output and self.tp_size > 1:
            y = _gather_columns(y, self.tp_group, self.tp_size, self.output_sizes, self.output_replicas)
        return y


class RowParallelLinear(_TensorParallel, nn.Linear):
    """The float ``nn.Linear`` counterpart of `RowParallelW8A8Linear`: ``weight`` ``(N, K / tp)``, ``bias`` the
    full ``(N,)``; ``forward`` computes the partial ``x_r @ W_r^T``, all-reduces it (SUM) and adds the bias once.
    ``input_is_parallel`` and ``reduce_results`` as there."""

    @classmethod
    def from_linear(cls, linear: nn.Linear, tp_group, *, input_is_parallel: bool = True,
                    tp_size: Optional[int] = None, check: bool = True) -> "RowParallelLinear":
        """This rank's columns of a full float ``linear``. Errors as `RowParallelW8A8Linear.from_float`."""
        n, k, where, ctx = _linear_source(cls, linear, tp_group)
        rank, world = ctx.rank, ctx.world
        if check:
            check_same_on_all_ranks(ctx, where, _fields(
                "rowwise", n, k, tp_size, dtype=dtype_code(linear.weight.dtype), bias=linear.bias is not None,
                input_is_parallel=input_is_parallel))
        _check_tp_size(where, tp_size, world)
        S.check_row_shardable(n, k, world, where, quantized=False)
        mod = _float_layer(cls, S.shard_cols(linear.weight.detach(), rank, world),
                           None if linear.bias is None else linear.bias.detach().clone(), linear.weight.requires_grad)
        _set_tp(mod, ctx, n, k)
        mod.input_is_parallel, mod.reduce_results = input_is_parallel, True
        return mod

    @classmethod
    def from_shard(cls, weight: torch.Tensor, tp_group, *, bias: Optional[torch.Tensor] = None,
                   input_is_parallel: bool = True) -> "RowParallelLinear":
        """A layer around this rank's columns (``weight`` ``(N, K / tp)``) and the full ``bias`` ``(N,)``; no
        cross-rank check (the caller made one)."""
        ctx = TPContext.resolve(tp_group, cls.__name__)
        mod = _float_layer(cls, weight, bias, False)
        _set_tp(mod, ctx, weight.shape[0], weight.shape[1] * ctx.world)
        mod.input_is_parallel, mod.reduce_results = input_is_parallel, True
        return mod

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            if x.shape[-1] != self.full_in_features:
                raise ValueError(f"RowParallelLinear: input_is_parallel=False needs the full input, last dimension "
                                 f"{self.full_in_features}, got shape {tuple(x.shape)}")
            a, b = S.shard_range(self.full_in_features, self.tp_rank, self.tp_size)
            x = x[..., a:b]
        y = F.linear(x, self.weight)
        if self.reduce_results and self.tp_size > 1:
            _all_reduce_(y, self.tp_group)
        return y if self.bias is None else y + self.bias


