"""The sharding math of tensor-parallel linears, without any communication: which rows (column-parallel) or
columns (row-parallel) of a full ``(N, K)`` weight rank ``r`` of ``world`` keeps, the divisibility and kernel
alignment checks, and the shards of a `W8A8Linear`'s operands. Used by the parallel layers and the sharded
checkpoint loader; callable in a single process (no ``torch.distributed``).

Column-parallel (vLLM's ``ColumnParallelLinear``, ``MergedColumnParallelLinear``, ``QKVParallelLinear``): the
output features are split. A layer that stacks several logical matrices along N (``output_sizes``, e.g.
``[q, k, v]`` of a fused ``qkv_proj`` or ``[inter, inter]`` of ``gate_up_proj``) is split per matrix: rank ``r``
keeps rows ``[r * n_j / world, (r + 1) * n_j / world)`` of each matrix ``j`` (offset by the sizes before it), in
matrix order, so its shard is again a stack ``[q_r, k_r, v_r]``. Per-channel weight scales (and a bias) follow
their rows.

Row-parallel (vLLM's ``RowParallelLinear``): the input features are split; rank ``r`` keeps columns
``[r * K / world, (r + 1) * K / world)`` and the full per-channel weight scale (one scale per output row,
common to all of its columns); its output is a partial sum that the layer all-reduces.

Block-scaled fp8 weights (128 x 128 blocks, scale ``[ceil(N / 128), K / 128]``) are split only on block
boundaries: a column shard's rows and a row shard's columns must be whole blocks (``block=True`` in the checks),
and the shard keeps the scale rows (`shard_block_rows`) or columns (`shard_block_cols`) of its blocks.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..ops._limits import BLOCK_SIZE
from ..quantize import shape_supported

__all__ = ["check_column_shardable", "check_row_shardable", "column_rows", "shard_range", "shard_rows",
           "shard_cols", "shard_block_rows", "shard_block_cols"]

STYLES = ("colwise", "rowwise")


def _fail(where: str, what: str, value: int, world: int) -> ValueError:
    return ValueError(f"{where}: `{what}` = {value} is not divisible by the tensor-parallel world size {world}")


def shard_range(size: int, rank: int, world: int, where: str = "shard_range", what: str = "size") -> tuple[int, int]:
    """``(start, stop)`` of rank ``rank``'s equal part of ``size``; ValueError naming ``what`` when ``world``
    does not divide ``size``."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"{where}: rank {rank} is not in [0, world size {world})")
    if size % world:
        raise _fail(where, what, size, world)
    part = size // world
    return rank * part, (rank + 1) * part


def check_column_shardable(out_features: int, in_features: int, world: int,
                           output_sizes: Optional[Sequence[int]] = None, where: str = "ColumnParallelW8A8Linear",
                           quantized: bool = True, block: bool = False) -> list[int]:
    """Validate a column-parallel split and return ``output_sizes`` as a list (default ``[out_features]``).

    ``block``: the layer has block-scaled fp8 weights (128 x 128 blocks, scale ``[ceil(N / 128), K / 128]``);
    each rank's share of each stacked matrix must then be whole row blocks, a multiple of 128 rows, so that the
    shard keeps rows of the scale (``world == 1`` needs nothing).

    Raises
    ------
    ValueError
        ``output_sizes`` does not sum to ``out_features`` or holds a non-positive size; a size (``out_features``
        or ``output_sizes[j]``) is not divisible by ``world``; for a quantized layer, the shard's
        ``out_features / world`` or ``in_features`` is not a multiple of 16 (the W8A8 GEMM kernels' alignment,
        `cutlass_w8a8.quantize.shape_supported`); for a block layer, a shard would split a weight block (the
        message names ``where``, N and the shard's size).
    """
    sizes = [out_features] if output_sizes is None else [int(s) for s in output_sizes]
    if any(s <= 0 for s in sizes) or sum(sizes) != out_features:
        raise ValueError(f"{where}: `output_sizes` = {list(sizes)} must be positive sizes summing to out_features = "
                         f"{out_features}")
    if output_sizes is None:
        if out_features % world:
            raise _fail(where, "out_features", out_features, world)
    else:
        for j, s in enumerate(sizes):
            if s % world:
                raise _fail(where, f"output_sizes[{j}]", s, world)
    if quantized and not shape_supported(out_features // world, in_features):
        raise ValueError(f"{where}: the shard of each rank would have out_features = {out_features // world} "
                         f"(= {out_features} / {world}) and in_features = {in_features}; the W8A8 GEMM kernels need "
                         "both to be multiples of 16")
    if block and world > 1:
        for j, s in enumerate(sizes):
            if (s // world) % BLOCK_SIZE:
                what = f"N = {out_features}" if len(sizes) == 1 else f"output_sizes[{j}] = {s} (N = {out_features})"
                raise ValueError(f"{where}: block-scaled fp8 weights ({BLOCK_SIZE} x {BLOCK_SIZE} blocks) cannot be "
                                 f"split column-wise over {world} ranks: {what} gives shards of {s // world} rows, "
                                 f"not a multiple of {BLOCK_SIZE}, so a shard would split a weight block")
    return sizes


def check_row_shardable(out_features: int, in_features: int, world: int, where: str = "RowParallelW8A8Linear",
                        quantized: bool = True, block: bool = False) -> None:
    """Validate a row-parallel split (of ``in_features``).

    ``block``: the layer has block-scaled fp8 weights; each rank's ``in_features / world`` columns must then be
    whole column blocks, a multiple of 128 (which the block GEMM needs of its K anyway).

    Raises
    ------
    ValueError
        ``in_features`` is not divisible by ``world``; for a quantized layer, the shard's ``in_features / world``
        or ``out_features`` is not a multiple of 16; for a block layer, a shard would split a weight block (the
        message names ``where``, K and the shard's size).
    """
    if in_features % world:
        raise _fail(where, "in_features", in_features, world)
    if quantized and not shape_supported(out_features, in_features // world):
        raise ValueError(f"{where}: the shard of each rank would have in_features = {in_features // world} "
                         f"(= {in_features} / {world}) and out_features = {out_features}; the W8A8 GEMM kernels "
                         "need both to be multiples of 16")
    if block and (in_features // world) % BLOCK_SIZE:
        raise ValueError(f"{where}: block-scaled fp8 weights ({BLOCK_SIZE} x {BLOCK_SIZE} blocks) cannot be split "
                         f"row-wise over {world} ranks: K = in_features = {in_features} gives shards of "
                         f"{in_features // world} columns, not a multiple of {BLOCK_SIZE}, so a shard would split a "
                         "weight block")


def column_rows(output_sizes: Sequence[int], rank: int, world: int) -> list[tuple[int, int]]:
    """The ``(start, stop)`` row ranges of the full weight that rank ``rank`` keeps, one per logical matrix, in
    order (sizes already validated by `check_column_shardable`)."""
    ranges, offset = [], 0
    for s in output_sizes:
        a, b = shard_range(s, rank, world)
        ranges.append((offset + a, offset + b))
        offset += s
    return ranges


def _take_rows(t: torch.Tensor, ranges: Sequence[tuple[int, int]]) -> torch.Tensor:
    # New, compact storage (never a view that would keep the full tensor alive).
    if len(ranges) == 1:
        a, b = ranges[0]
        return t[a:b].clone(memory_format=torch.contiguous_format)
    return torch.cat([t[a:b] for a, b in ranges], dim=0).contiguous()


def shard_rows(t: torch.Tensor, output_sizes: Sequence[int], rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s rows of ``t`` (``(N, ...)``: a weight, a per-channel scale or a bias) for the
    column-parallel split of `column_rows`, as a new contiguous tensor."""
    return _take_rows(t, column_rows(output_sizes, rank, world))


def shard_cols(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s columns ``[r K / world, (r + 1) K / world)`` of a ``(N, K)`` weight, as a new contiguous
    tensor."""
    a, b = shard_range(t.shape[-1], rank, world)
    return t[..., a:b].clone(memory_format=torch.contiguous_format)


def shard_block_rows(scale: torch.Tensor, output_sizes: Sequence[int], rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s rows of a block scale ``[ceil(N / 128), K / 128]`` for the column-parallel split of
    `column_rows` (whose row ranges start and end on block boundaries: `check_column_shardable` with
    ``block=True``), as a new contiguous tensor."""
    ranges = [(a // BLOCK_SIZE, -(-b // BLOCK_SIZE)) for a, b in column_rows(output_sizes, rank, world)]
    return _take_rows(scale, ranges)


def shard_block_cols(scale: torch.Tensor, in_features: int, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s columns of a block scale ``[ceil(N / 128), K / 128]`` for the row-parallel split of
    ``in_features`` (``K / world`` a multiple of 128: `check_row_shardable` with ``block=True``), as a new
    contiguous tensor."""
    a, b = shard_range(in_features, rank, world)
    return scale[:, a // BLOCK_SIZE:b // BLOCK_SIZE].clone(memory_format=torch.contiguous_format)
