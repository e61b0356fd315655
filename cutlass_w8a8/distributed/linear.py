"""Tensor-parallel linears: `ColumnParallelW8A8Linear` and `RowParallelW8A8Linear` (subclasses of `W8A8Linear`,
whose GEMM they run unchanged on their shard), their float counterparts `ColumnParallelLinear` and
`RowParallelLinear` (for layers left unquantized), and `shard_linear`, which builds the right one. (`fuse_w8a8`,
re-exported here, lives in `cutlass_w8a8.fuse`: stacking layers is not a tensor-parallel concern.)

Semantics are vLLM's (vllm/model_executor/layers/linear.py): a column-parallel layer keeps a slice of the
output features and returns its slice of the output (``gather_output=False``, the default; the next layer is
row-parallel and takes that slice as its input); a row-parallel layer keeps a slice of the input features,
takes the matching slice of the input (``input_is_parallel=True``), and all-reduces (SUM) its partial output
over the group, then adds its bias once, after the reduce. Which rows and columns each rank keeps:
`cutlass_w8a8.distributed.sharding`.

Every constructor takes the group as a ``ProcessGroup`` (resolved there, once) or as the `TPContext` an entry resolved
(`cutlass_w8a8.tensor_parallel_`, the sharded loader, the decoder's sharding: passed down as it is, nothing asked of
``torch.distributed`` again). With ``check=True`` (the default for a direct call; an entry that checked the whole
model once passes False) it first checks, with one all_gather over the group (`check_same_on_all_ranks`), that every
rank is building the same layer (full shapes, dtypes, ``output_sizes``, expected tensor-parallel size), then
checks divisibility and kernel alignment; both raise the same ValueError on every rank.

Activation quantization of a row-parallel W8A8 layer is per shard: with dynamic per-token quantization each
rank quantizes its ``K / world`` input columns with their own per-token scale ``amax(x_r) / 127`` (as vLLM
does), which is never larger than the full row's ``amax(x) / 127``. The result therefore differs from the
unsharded layer's by the two activation quantizations (and the rounding of the partial outputs to the layer
dtype before the reduce), not by more: `cutlass_w8a8.testing.tp.row_parallel_bound` writes the element-wise
bound out; tests/distributed/test_tp_cpu.py checks it. A static ``input_scale`` is shared by all shards, so the shards'
quantized inputs are exactly the slices of the unsharded layer's.

Block-scaled fp8 layers (128 x 128 weight blocks, activations per 1 x 128 group) are split on block boundaries
only (`cutlass_w8a8.distributed.sharding`): a shard keeps the scale rows (column-parallel) or columns
(row-parallel) of its own blocks. A row-parallel shard's ``K / tp`` columns are whole activation groups, so its
quantized input is exactly the slice of the unsharded layer's: only the rounding of the partial outputs to the
layer dtype before the reduce separates it from the unsharded layer.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
from torch import nn

from ..config import W8A8Config
from ..fuse import fuse_w8a8  # noqa: F401 (re-exported: cutlass_w8a8.distributed.fuse_w8a8)
from ..linear import QuantizedActivation, W8A8Linear
from ..ops._limits import BLOCK_SIZE
from ..ops._roles import block_weight_scaled
from ..ops._schema import OVERLOADS as _op
from . import sharding as S
from ._common import TPContext, _all_reduce_, _check_tp_size, _fields, _gather_columns, _set_tp, _TensorParallel
from ._group import check_same_on_all_ranks, dtype_code, sequence_code
from .float_linear import ColumnParallelLinear, RowParallelLinear, _linear_source

__all__ = ["ColumnParallelW8A8Linear", "RowParallelW8A8Linear", "fuse_w8a8", "shard_linear"]


def _is_block(layer) -> bool:
    """Whether a `W8A8Linear` has block-scaled fp8 weights (128 x 128 blocks)."""
    return getattr(layer, "weight_block_size", None) is not None


def _shard_block(weight, weight_scale, weight_block_size) -> bool:
    """Whether `from_shard`'s operands are block-scaled: ``weight_block_size`` given, or the scale's shape says
    so (`ops._roles.block_weight_scaled`, the op's rule)."""
    return weight_block_size is not None or block_weight_scaled(weight, weight_scale)


def _float_source(cls, linear, tp_group, config):
    """``(N, K, where, ctx, config, block)`` for ``cls.from_float(linear, tp_group, config=config)``: ``config``
    defaults to int8 `W8A8Config`, ``block`` says whether it asks for block-scaled weights."""
    config = config or W8A8Config()
    return (*_linear_source(cls, linear, tp_group), config, getattr(config, "weight_block_size", None) is not None)


def _unsharded(cls, layer, tp_group):
    """``(N, K, where, ctx)`` for ``cls.from_full(layer, tp_group)``; TypeError unless ``layer`` is an unsharded
    `W8A8Linear`."""
    if not isinstance(layer, W8A8Linear) or isinstance(layer, _TensorParallel):
        raise TypeError(f"{cls.__name__}.from_full: `layer` must be an unsharded W8A8Linear, got "
                        f"{type(layer).__name__}")
    return layer.out_features, layer.in_features, cls.__name__, TPContext.resolve(tp_group, cls.__name__)


# ----------------------------------------------------------------------------------------------------
# W8A8


class ColumnParallelW8A8Linear(_TensorParallel, W8A8Linear):
    """A `W8A8Linear` holding rank ``tp_rank``'s rows of the output features: ``(N / tp_size, K)``.

    Build it with `from_float` (a full float ``nn.Linear``, quantized per channel, then sharded), `from_full` (a
    full `W8A8Linear`) or `from_shard` (weights already sharded, e.g. read from a checkpoint). The buffers are
    `W8A8Linear`'s, holding the shard: ``weight`` ``(N / tp, K)``, ``weight_scale`` ``(N / tp,)`` per channel (the
    shard's own channels' scales) or ``(1,)`` per tensor, ``bias`` ``(N / tp,)``, ``input_scale`` ``(1,)``.

    ``forward(x)``: ``x`` ``(..., K)``, the full input, replicated on every rank (float or a
    `QuantizedActivation`); returns ``(..., N / tp)``, this rank's output columns (in the shard's order: the
    rank's rows of each matrix of ``output_sizes``), or with ``gather_output=True`` the full ``(..., N)`` in the
    unsharded layer's order (one all_gather). Each output element equals the unsharded layer's exactly (same
    quantized input, same weight row, same scales). A block-scaled fp8 layer keeps whole row blocks: its
    ``weight_scale`` is the shard's ``[N / tp / 128, K / 128]`` rows of the block scale, and each matrix of
    ``output_sizes`` must split into multiples of 128 rows.

    Attributes
    ----------
    output_sizes : list of int
        The logical matrices stacked along the full N (``[N]`` for a plain layer).
    output_replicas : list of int
        Per matrix, how many ranks share each of its parts (`cutlass_w8a8.distributed.sharding`: the key / value
        matrices of a fused ``qkv_proj`` when there are fewer key/value heads than ranks); all 1 for a plain split.
    gather_output : bool
    tp_group, tp_rank, tp_size, full_out_features, full_in_features
    """

    @classmethod
    def from_float(cls, linear: nn.Linear, tp_group, *, output_sizes: Optional[Sequence[int]] = None,
                   config: Optional[W8A8Config] = None, input_scale: Optional[torch.Tensor] = None,
                   gather_output: bool = False, tp_size: Optional[int] = None,
                   check: bool = True, replicas: Optional[Sequence[int]] = None) -> "ColumnParallelW8A8Linear":
        """Quantize a full float ``linear`` (``(N, K)`` weight, per-channel; `W8A8Linear.from_float` with
        ``config`` and ``input_scale``) and keep this rank's shard.

        Parameters
        ----------
        linear : nn.Linear
            The full layer, identical on every rank.
        tp_group : torch.distributed.ProcessGroup or TPContext
            The group, or the context an entry resolved once (`cutlass_w8a8.distributed.TPContext`).
        output_sizes : sequence of int, optional
            Logical matrices stacked along N (``[q, k, v]``, ``[inter, inter]``); default one matrix.
        gather_output : bool
            All-gather the full output in ``forward`` (default False).
        tp_size : int, optional
            The tensor-parallel size this rank was configured for; checked against the group on every rank.
        check : bool
            Run the cross-rank agreement check (default True; a caller that checked a whole model once passes
            False).
        replicas : sequence of int, optional
            Per matrix of ``output_sizes``, how many ranks share each of its parts (default all 1: each matrix
            split ``tp_size`` ways; `sharding.kv_replicas` for key/value heads fewer than the ranks).

        Raises
        ------
        ValueError
            The ranks disagree (shapes, dtypes, ``output_sizes``, ``tp_size``); N or a matrix size is not
            divisible by the world size; the shard breaks the kernels' multiple-of-16 alignment.
        """
        n, k, where, ctx, config, block = _float_source(cls, linear, tp_group, config)
        if check:
            check_same_on_all_ranks(ctx, where, _fields(
                "colwise", n, k, tp_size, **{"#output_sizes": sequence_code(output_sizes or []),
                                             "#replicas": sequence_code(replicas or [])},
                quant_dtype=dtype_code(config.dtype), bias=linear.bias is not None,
                static_input=input_scale is not None, gather_output=gather_output, block=block))
        _check_tp_size(where, tp_size, ctx.world)
        S.check_column_shardable(n, k, ctx.world, output_sizes, where, block=block, replicas=replicas)
        full = W8A8Linear.from_float(linear, config, input_scale)
        return cls._build(full, ctx, output_sizes, gather_output, replicas)

    @classmethod
    def from_full(cls, layer: W8A8Linear, tp_group, *, output_sizes: Optional[Sequence[int]] = None,
                  gather_output: bool = False, tp_size: Optional[int] = None,
                  check: bool = True, replicas: Optional[Sequence[int]] = None) -> "ColumnParallelW8A8Linear":
        """This rank's shard of a full `W8A8Linear` (weights and scales as they are: no re-quantization).
        Arguments and errors as `from_float`."""
        n, k, where, ctx = _unsharded(cls, layer, tp_group)
        if check:
            check_same_on_all_ranks(ctx, where, _fields(
                "colwise", n, k, tp_size, **{"#output_sizes": sequence_code(output_sizes or []),
                                             "#replicas": sequence_code(replicas or [])},
                quant_dtype=dtype_code(layer.quant_dtype), dtype=dtype_code(layer.dtype),
                bias=layer.bias is not None, per_channel=layer.per_channel,
                static_input=layer.input_scale is not None, gather_output=gather_output, block=_is_block(layer)))
        _check_tp_size(where, tp_size, ctx.world)
        S.check_column_shardable(n, k, ctx.world, output_sizes, where, block=_is_block(layer), replicas=replicas)
        return cls._build(layer, ctx, output_sizes, gather_output, replicas)

    @classmethod
    def _build(cls, full: W8A8Linear, ctx: TPContext, output_sizes, gather_output, replicas=None):
        rank, world = ctx.rank, ctx.world
        sizes = list(output_sizes) if output_sizes is not None else [full.out_features]
        b = full._buffers
        scale = b["weight_scale"]
        if _is_block(full):  # [ceil(N / 128), K / 128]: the rows of the shard's row blocks
            scale = S.shard_block_rows(scale, sizes, rank, world, replicas)
        elif scale.numel() > 1:
            scale = S.shard_rows(scale, sizes, rank, world, replicas)
        mod = cls.from_quantized(
            S.shard_rows(b["weight"], sizes, rank, world, replicas), scale,
            bias=None if b["bias"] is None else S.shard_rows(b["bias"], sizes, rank, world, replicas),
            input_scale=b["input_scale"], dtype=full.dtype, weight_block_size=full.weight_block_size)
        mod.fp8_fast_accum = full.fp8_fast_accum
        mod._init_column(ctx, full.out_features, full.in_features, sizes, gather_output, replicas)
        return mod

    @classmethod
    def from_shard(cls, weight: torch.Tensor, weight_scale: torch.Tensor, tp_group, *, output_sizes: Sequence[int],
                   bias: Optional[torch.Tensor] = None, input_scale: Optional[torch.Tensor] = None,
                   dtype: torch.dtype = torch.bfloat16, gather_output: bool = False, tp_size: Optional[int] = None,
                   check: bool = True, weight_block_size: Optional[tuple] = None,
                   replicas: Optional[Sequence[int]] = None) -> "ColumnParallelW8A8Linear":
        """A layer around this rank's already-sharded operands (`from_quantized` semantics, no copy).

        ``weight``: ``(N / tp, K)`` int8 / e4m3, the rank's rows (`sharding.column_rows`); ``weight_scale``:
        ``N / tp`` values (the same rows) or one, or for block-scaled e4m3 weights the float32 block scale of the
        shard, ``[N / tp / 128, K / 128]`` (`sharding.shard_block_rows`); ``bias``: ``N / tp`` values;
        ``output_sizes``: the full layer's logical matrices (they give the full N); ``weight_block_size``:
        ``(128, 128)`` for block scales (None: told from the scale's shape, as `W8A8Linear.from_quantized` does);
        ``replicas``: as in `from_float` (the shard then has ``sum(n_j * replicas[j] / tp)`` rows). Errors as
        `from_float`.
        """
        sizes = [int(s) for s in output_sizes]
        n, k, where = sum(sizes), weight.shape[1], cls.__name__
        ctx = TPContext.resolve(tp_group, where)
        block = _shard_block(weight, weight_scale, weight_block_size)
        if check:
            check_same_on_all_ranks(ctx, where, _fields(
                "colwise", n, k, tp_size, **{"#output_sizes": sequence_code(sizes),
                                             "#replicas": sequence_code(replicas or [])},
                quant_dtype=dtype_code(weight.dtype),
                dtype=dtype_code(dtype), bias=bias is not None, per_channel=weight_scale.numel() > 1,
                static_input=input_scale is not None, gather_output=gather_output, block=block))
        _check_tp_size(where, tp_size, ctx.world)
        S.check_column_shardable(n, k, ctx.world, sizes, where, block=block, replicas=replicas)
        local = sum(z - a for a, z in S.column_rows(sizes, ctx.rank, ctx.world, replicas))
        if weight.shape[0] != local:
            raise ValueError(f"{where}.from_shard: `weight` must have N / tp_size = {local} rows (with `replicas`: "
                             f"the rows of this rank's parts), got {weight.shape[0]}")
        mod = cls.from_quantized(weight, weight_scale, bias=bias, input_scale=input_scale, dtype=dtype,
                                 weight_block_size=weight_block_size)
        mod._init_column(ctx, n, k, sizes, gather_output, replicas)
        return mod

    def _init_column(self, ctx: TPContext, full_n, full_k, sizes, gather_output, replicas=None):
        _set_tp(self, ctx, full_n, full_k)
        self.output_sizes, self.gather_output = list(sizes), gather_output
        self.output_replicas = [1] * len(sizes) if replicas is None else [int(r) for r in replicas]

    def forward(self, x: Union[torch.Tensor, QuantizedActivation]) -> torch.Tensor:
        y = super().forward(x)
        if self.gather_output and self.tp_size > 1:
            y = _gather_columns(y, self.tp_group, self.tp_size, self.output_sizes, self.output_replicas)
        return y

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, tp_rank={self.tp_rank}, tp_size={self.tp_size}, "
                f"full_out_features={self.full_out_features}, output_sizes={self.output_sizes}, "
                + (f"output_replicas={self.output_replicas}, " if any(r > 1 for r in self.output_replicas) else "")
                + f"gather_output={self.gather_output}")


class RowParallelW8A8Linear(_TensorParallel, W8A8Linear):
    """A `W8A8Linear` holding rank ``tp_rank``'s columns of the input features: ``(N, K / tp_size)``.

    Build it with `from_float`, `from_full` or `from_shard` (as `ColumnParallelW8A8Linear`). Buffers hold the
    shard: ``weight`` ``(N, K / tp)``; ``weight_scale`` the full ``(N,)`` per-channel scale (or ``(1,)``), or
    for block-scaled fp8 weights the shard's columns ``[ceil(N / 128), K / tp / 128]`` of the block scale
    (``K / tp`` a multiple of 128);
    ``bias`` the full ``(N,)``, replicated, added once after the reduce; ``input_scale`` ``(1,)``.

    ``forward(x)``: ``x`` ``(..., K / tp)``, this rank's slice of the input (``input_is_parallel=True``, the
    output of a column-parallel layer or of attention over this rank's heads; float or a
    `QuantizedActivation`), or the full ``(..., K)`` with ``input_is_parallel=False`` (sliced here). The GEMM
    gives the partial output ``(..., N)`` in ``dtype``; it is all-reduced (SUM) over ``tp_group`` with
    ``torch.distributed.all_reduce`` (NCCL on CUDA, ordered after the GEMM on the current stream and capturable
    in a CUDA graph; gloo on the CPU), then ``bias`` is added. Returns ``(..., N)``, equal on every rank.

    Activation quantization is per shard (dynamic per-token: each rank's own per-token scales): see the
    module docstring for what that means for agreement with the unsharded layer.

    Attributes
    ----------
    input_is_parallel : bool
    reduce_results : bool
        All-reduce the partial outputs (default True). False returns this rank's partial sum (plus the bias):
        only for measuring the reduce's share of a step (bench/bench_tp.py); the result is then not the
        layer's output.
    tp_group, tp_rank, tp_size, full_out_features, full_in_features
    """

    @classmethod
    def from_float(cls, linear: nn.Linear, tp_group, *, config: Optional[W8A8Config] = None,
                   input_scale: Optional[torch.Tensor] = None, input_is_parallel: bool = True,
                   tp_size: Optional[int] = None, check: bool = True) -> "RowParallelW8A8Linear":
        """Quantize a full float ``linear`` (per-channel scales over its full K), then keep this rank's columns.

        Raises
        ------
        ValueError
            The ranks disagree; K is not divisible by the world size; the shard breaks the kernels'
            multiple-of-16 alignment.
        """
        n, k, where, ctx, config, block = _float_source(cls, linear, tp_group, config)
        if check:
            check_same_on_all_ranks(ctx, where, _fields(
                "rowwise", n, k, tp_size, quant_dtype=dtype_code(config.dtype), bias=linear.bias is not None,
                static_input=input_scale is not None, input_is_parallel=input_is_parallel, block=block))
        _check_tp_size(where, tp_size, ctx.world)
        S.check_row_shardable(n, k, ctx.world, where, block=block)
        full = W8A8Linear.from_float(linear, config, input_scale)
        return cls._build(full, ctx, input_is_parallel)

    @classmethod
    def from_full(cls, layer: W8A8Linear, tp_group, *, input_is_parallel: bool = True,
                  tp_size: Optional[int] = None, check: bool = True) -> "RowParallelW8A8Linear":
        """This rank's columns of a full `W8A8Linear` (no re-quantization). Errors as `from_float`."""
        n, k, where, ctx = _unsharded(cls, layer, tp_group)
        if check:
            check_same_on_all_ranks(ctx, where, _fields(
                "rowwise", n, k, tp_size, quant_dtype=dtype_code(layer.quant_dtype), dtype=dtype_code(layer.dtype),
                bias=layer.bias is not None, per_channel=layer.per_channel,
                static_input=layer.input_scale is not None, input_is_parallel=input_is_parallel,
                block=_is_block(layer)))
        _check_tp_size(where, tp_size, ctx.world)
        S.check_row_shardable(n, k, ctx.world, where, block=_is_block(layer))
        return cls._build(layer, ctx, input_is_parallel)

    @classmethod
    def _build(cls, full: W8A8Linear, ctx: TPContext, input_is_parallel):
        rank, world = ctx.rank, ctx.world
        b = full._buffers
        if _is_block(full):  # [ceil(N / 128), K / 128]: the columns of the shard's column blocks
            scale = S.shard_block_cols(b["weight_scale"], full.in_features, rank, world)
        else:  # one scale per output row (or one), common to all of its columns
            scale = b["weight_scale"].clone()
        mod = cls.from_quantized(S.shard_cols(b["weight"], rank, world), scale,
                                 bias=None if b["bias"] is None else b["bias"].clone(),
                                 input_scale=b["input_scale"], dtype=full.dtype,
                                 weight_block_size=full.weight_block_size)
        mod.fp8_fast_accum = full.fp8_fast_accum
        mod._init_row(ctx, full.out_features, full.in_features, input_is_parallel)
        return mod

    @classmethod
    def from_shard(cls, weight: torch.Tensor, weight_scale: torch.Tensor, tp_group, *,
                   bias: Optional[torch.Tensor] = None, input_scale: Optional[torch.Tensor] = None,
                   dtype: torch.dtype = torch.bfloat16, input_is_parallel: bool = True, tp_size: Optional[int] = None,
                   check: bool = True, weight_block_size: Optional[tuple] = None) -> "RowParallelW8A8Linear":
        """A layer around this rank's already-sharded operands: ``weight`` ``(N, K / tp)`` (the rank's columns,
        `sharding.shard_range` of K), ``weight_scale`` the full N values or one, or for block-scaled e4m3 weights
        the float32 block scale's columns of the shard, ``[ceil(N / 128), K / tp / 128]``
        (`sharding.shard_block_cols`); ``bias`` the full N values; ``weight_block_size`` as in
        `ColumnParallelW8A8Linear.from_shard`. Errors as `from_float`."""
        n, k_local, where = weight.shape[0], weight.shape[1], cls.__name__
        ctx = TPContext.resolve(tp_group, where)
        k = k_local * ctx.world
        block = _shard_block(weight, weight_scale, weight_block_size)
        if check:
            check_same_on_all_ranks(ctx, where, _fields(
                "rowwise", n, k, tp_size, quant_dtype=dtype_code(weight.dtype), dtype=dtype_code(dtype),
                bias=bias is not None, per_channel=weight_scale.numel() > 1, static_input=input_scale is not None,
                input_is_parallel=input_is_parallel, block=block))
        _check_tp_size(where, tp_size, ctx.world)
        S.check_row_shardable(n, k, ctx.world, where, block=block)
        mod = cls.from_quantized(weight, weight_scale, bias=bias, input_scale=input_scale, dtype=dtype,
                                 weight_block_size=weight_block_size)
        mod._init_row(ctx, n, k, input_is_parallel)
        return mod

    def _init_row(self, ctx: TPContext, full_n, full_k, input_is_parallel):
        _set_tp(self, ctx, full_n, full_k)
        self.input_is_parallel = input_is_parallel
        self.reduce_results = True

    def _split_input(self, x):
        a, b = S.shard_range(self.full_in_features, self.tp_rank, self.tp_size, type(self).__name__, "in_features")
        if isinstance(x, QuantizedActivation):
            if x.q.shape[-1] != self.full_in_features:
                raise ValueError(f"{type(self).__name__}: input_is_parallel=False needs the full input, last "
                                 f"dimension {self.full_in_features}, got shape {tuple(x.q.shape)}")
            if _is_block(self):  # 1 x 128 group scales: the shard's groups (K / tp is a multiple of 128)
                return QuantizedActivation(x.q[..., a:b].contiguous(),
                                           x.scale[..., a // BLOCK_SIZE:b // BLOCK_SIZE].contiguous())
            # per-token scales stay valid for any slice of their row
            return QuantizedActivation(x.q[..., a:b].contiguous(), x.scale)
        if x.shape[-1] != self.full_in_features:
            raise ValueError(f"{type(self).__name__}: input_is_parallel=False needs the full input, last dimension "
                             f"{self.full_in_features}, got shape {tuple(x.shape)}")
        return x[..., a:b].contiguous()

    def forward(self, x: Union[torch.Tensor, QuantizedActivation]) -> torch.Tensor:
        if not self.input_is_parallel:
            x = self._split_input(x)
        b = self._buffers
        if isinstance(x, QuantizedActivation):
            self._check_quantized(x)
            lead = x.q.shape[:-1]
            if _is_block(self):  # (..., K / 128) group scales -> (M, K / 128)
                s = x.scale.reshape(-1, self.in_features // BLOCK_SIZE).contiguous()
            else:
                s = x.scale if x.scale.numel() == 1 else x.scale.reshape(-1, 1).contiguous()
            y = _op.scaled_mm(x.q.reshape(-1, self.in_features), b["weight"].t(), s, b["weight_scale"], self.dtype,
                              None, self.fp8_fast_accum).reshape(*lead, self.out_features)
            in_dtype = self.dtype
        else:
            if x.shape[-1] != self.in_features:
                raise ValueError(f"{type(self).__name__}: input's last dimension must be in_features (this rank's "
                                 f"K / tp_size) = {self.in_features}, got shape {tuple(x.shape)}")
            y = _op.w8a8_linear(x, b["weight"], b["weight_scale"], b["input_scale"], None, self.dtype,
                                self.fp8_fast_accum)
            in_dtype = x.dtype
        if self.reduce_results and self.tp_size > 1:
            _all_reduce_(y, self.tp_group)
        if b["bias"] is not None:
            y = y + b["bias"]
        return y if y.dtype == in_dtype else y.to(in_dtype)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, tp_rank={self.tp_rank}, tp_size={self.tp_size}, "
                f"full_in_features={self.full_in_features}, input_is_parallel={self.input_is_parallel}")


def shard_linear(linear: nn.Module, style: str, tp_group, *, output_sizes: Optional[Sequence[int]] = None,
                 tp_size: Optional[int] = None, check: bool = True,
                 replicas: Optional[Sequence[int]] = None) -> nn.Module:
    """This rank's shard of a full layer, by ``style`` (``"colwise"`` or ``"rowwise"``): a `W8A8Linear` becomes a
    `ColumnParallelW8A8Linear` / `RowParallelW8A8Linear` (its quantized weights as they are), a float
    ``nn.Linear`` a `ColumnParallelLinear` / `RowParallelLinear`. To quantize and shard a float layer in one step
    use ``ColumnParallelW8A8Linear.from_float``.

    ``tp_group``: a ``ProcessGroup`` or the `TPContext` of the caller's entry (passed down as it is).
    ``output_sizes`` (colwise only): the logical matrices stacked along N; ``replicas`` (colwise only): per matrix,
    how many ranks share each of its parts (replicated key/value heads, `sharding.kv_replicas`). Raises TypeError
    for another module type or an already-sharded layer, ValueError for an unknown style and as the constructors.
    """
    if style not in S.STYLES:
        raise ValueError(f"shard_linear: `style` must be 'colwise' or 'rowwise', got {style!r}")
    if isinstance(linear, _TensorParallel):
        raise TypeError(f"shard_linear: `linear` is already sharded ({type(linear).__name__})")
    if style == "rowwise" and (output_sizes is not None or replicas is not None):
        raise ValueError("shard_linear: `output_sizes` and `replicas` are for style='colwise'")
    kw = dict(tp_size=tp_size, check=check)
    if isinstance(linear, W8A8Linear):
        if style == "colwise":
            return ColumnParallelW8A8Linear.from_full(linear, tp_group, output_sizes=output_sizes, replicas=replicas,
                                                      **kw)
        return RowParallelW8A8Linear.from_full(linear, tp_group, **kw)
    if type(linear) is nn.Linear:
        if style == "colwise":
            return ColumnParallelLinear.from_linear(linear, tp_group, output_sizes=output_sizes, replicas=replicas,
                                                    **kw)
        return RowParallelLinear.from_linear(linear, tp_group, **kw)
    raise TypeError(f"shard_linear: `linear` must be an nn.Linear or a W8A8Linear, got {type(linear).__name__}")
