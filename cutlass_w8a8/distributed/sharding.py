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

Replicated matrices (``replicas``): when a fused layer's key / value heads are fewer than the ranks (``KVH < world``,
``world % KVH == 0``), the key and value matrices are not split ``world`` ways: each is cut into ``KVH`` parts of one
head and each part is kept by ``world / KVH`` consecutive ranks (rank ``r`` keeps head ``r * KVH // world``, as vLLM's
``QKVParallelLinear`` does). ``replicas[j]`` is the number of ranks that share each part of matrix ``j`` (1: plain
split); a rank keeps ``n_j * replicas[j] / world`` rows of it, part ``r // replicas[j]``. `kv_replicas` computes it.

Block-scaled fp8 weights (128 x 128 blocks, scale ``[ceil(N / 128), K / 128]``) are split only on block
boundaries: a column shard's rows and a row shard's columns must be whole blocks (``block=True`` in the checks),
and the shard keeps the scale rows (`shard_block_rows`) or columns (`shard_block_cols`) of its blocks.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..ops._limits import BLOCK_SIZE
from ..linear import shape_supported

__all__ = ["check_column_shardable", "check_row_shardable", "column_rows", "kv_replicas", "shard_range",
           "shard_rows", "shard_cols", "shard_block_rows", "shard_block_cols", "check_moe_shardable", "shard_w13",
           "shard_w13_block_scale", "shard_w2", "shard_w2_block_scale"]

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


def kv_replicas(num_heads: int, num_kv_heads: int, world: int, where: str = "kv_replicas",
                names: tuple = ("num_attention_heads", "num_key_value_heads")) -> int:
    """How many ranks share each key / value head: 1 when ``world`` divides ``num_kv_heads`` (each rank keeps
    ``num_kv_heads / world`` heads), ``world / num_kv_heads`` when ``num_kv_heads < world`` and ``num_kv_heads``
    divides ``world`` (each rank keeps one head, ``r * num_kv_heads // world``: the KV heads are replicated).

    Raises
    ------
    ValueError
        ``num_heads`` is not divisible by ``world``; ``num_kv_heads`` and ``world`` divide neither way. The
        messages name the config fields ``names`` (transformers' by default; the reference decoder's are
        ``num_heads`` / ``num_kv_heads``).
    """
    if num_heads % world:
        raise ValueError(f"{where}: `config.{names[0]}` = {num_heads} is not divisible by the tensor-parallel world "
                         f"size {world}")
    if num_kv_heads % world == 0:
        return 1
    if world % num_kv_heads == 0:
        return world // num_kv_heads
    raise ValueError(f"{where}: `config.{names[1]}` = {num_kv_heads} and the tensor-parallel world size "
                     f"{world} divide neither way: the key/value heads are split over the ranks when the world size "
                     "divides them and replicated when they divide the world size")


def _replicas(sizes: Sequence[int], replicas: Optional[Sequence[int]], where: str) -> list[int]:
    if replicas is None:
        return [1] * len(sizes)
    reps = [int(v) for v in replicas]
    if len(reps) != len(sizes) or any(v < 1 for v in reps):
        raise ValueError(f"{where}: `replicas` = {reps} must hold one positive count per matrix of `output_sizes` "
                         f"= {list(sizes)}")
    return reps


def check_column_shardable(out_features: int, in_features: int, world: int,
                           output_sizes: Optional[Sequence[int]] = None, where: str = "ColumnParallelW8A8Linear",
                           quantized: bool = True, block: bool = False,
                           replicas: Optional[Sequence[int]] = None) -> list[int]:
    """Validate a column-parallel split and return ``output_sizes`` as a list (default ``[out_features]``).

    ``replicas``: per matrix, how many ranks share each of its parts (module docstring; default all 1). Matrix
    ``j`` is then split into ``world / replicas[j]`` parts (``replicas[j]`` must divide ``world``), and the shard
    has ``sum(n_j * replicas[j] / world)`` rows.

    ``block``: the layer has block-scaled fp8 weights (128 x 128 blocks, scale ``[ceil(N / 128), K / 128]``);
    each rank's share of each stacked matrix must then be whole row blocks, a multiple of 128 rows, so that the
    shard keeps rows of the scale (``world == 1`` needs nothing).

    Raises
    ------
    ValueError
        ``output_sizes`` does not sum to ``out_features`` or holds a non-positive size; a size (``out_features``
        or ``output_sizes[j]``) is not divisible by ``world``; for a quantized layer, the shard's
        ``out_features / world`` or ``in_features`` is not a multiple of 16 (the W8A8 GEMM kernels' alignment,
        `cutlass_w8a8.linear.shape_supported`); for a block layer, a shard would split a weight block (the
        message names ``where``, N and the shard's size).
    """
    sizes = [out_features] if output_sizes is None else [int(s) for s in output_sizes]
    if any(s <= 0 for s in sizes) or sum(sizes) != out_features:
        raise ValueError(f"{where}: `output_sizes` = {list(sizes)} must be positive sizes summing to out_features = "
                         f"{out_features}")
    reps = _replicas(sizes, replicas, where)
    for j, r in enumerate(reps):
        if world % r:
            raise ValueError(f"{where}: `replicas[{j}]` = {r} does not divide the tensor-parallel world size {world}")
    parts = [world // r for r in reps]
    if output_sizes is None and reps == [1]:
        if out_features % world:
            raise _fail(where, "out_features", out_features, world)
    else:
        for j, (s, p) in enumerate(zip(sizes, parts)):
            if s % p:
                if p == world:
                    raise _fail(where, f"output_sizes[{j}]", s, world)
                raise ValueError(f"{where}: `output_sizes[{j}]` = {s} is not divisible by its {p} parts ({world} "
                                 f"ranks, each part shared by {reps[j]})")
    local = sum(s // p for s, p in zip(sizes, parts))
    if quantized and not shape_supported(local, in_features):
        what = f"(= {out_features} / {world})" if reps == [1] * len(reps) else f"(of {out_features}, replicas {reps})"
        raise ValueError(f"{where}: the shard of each rank would have out_features = {local} "
                         f"{what} and in_features = {in_features}; the W8A8 GEMM kernels need "
                         "both to be multiples of 16")
    if block and world > 1:
        for j, (s, p) in enumerate(zip(sizes, parts)):
            if p > 1 and (s // p) % BLOCK_SIZE:
                what = f"N = {out_features}" if len(sizes) == 1 else f"output_sizes[{j}] = {s} (N = {out_features})"
                raise ValueError(f"{where}: block-scaled fp8 weights ({BLOCK_SIZE} x {BLOCK_SIZE} blocks) cannot be "
                                 f"split column-wise over {world} ranks: {what} gives shards of {s // p} rows, "
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


def column_rows(output_sizes: Sequence[int], rank: int, world: int,
                replicas: Optional[Sequence[int]] = None) -> list[tuple[int, int]]:
    """The ``(start, stop)`` row ranges of the full weight that rank ``rank`` keeps, one per logical matrix, in
    order (sizes already validated by `check_column_shardable`). With ``replicas``, matrix ``j`` is cut into
    ``world / replicas[j]`` parts and the rank keeps part ``rank // replicas[j]``."""
    reps = _replicas(output_sizes, replicas, "column_rows")
    ranges, offset = [], 0
    for s, r in zip(output_sizes, reps):
        a, b = shard_range(s, rank // r, world // r)
        ranges.append((offset + a, offset + b))
        offset += s
    return ranges


def _take_rows(t: torch.Tensor, ranges: Sequence[tuple[int, int]]) -> torch.Tensor:
    # New, compact storage (never a view that would keep the full tensor alive).
    if len(ranges) == 1:
        a, b = ranges[0]
        return t[a:b].clone(memory_format=torch.contiguous_format)
    return torch.cat([t[a:b] for a, b in ranges], dim=0).contiguous()


def shard_rows(t: torch.Tensor, output_sizes: Sequence[int], rank: int, world: int,
               replicas: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Rank ``rank``'s rows of ``t`` (``(N, ...)``: a weight, a per-channel scale or a bias) for the
    column-parallel split of `column_rows`, as a new contiguous tensor."""
    return _take_rows(t, column_rows(output_sizes, rank, world, replicas))


def shard_cols(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s columns ``[r K / world, (r + 1) K / world)`` of a ``(N, K)`` weight, as a new contiguous
    tensor."""
    a, b = shard_range(t.shape[-1], rank, world)
    return t[..., a:b].clone(memory_format=torch.contiguous_format)


def shard_block_rows(scale: torch.Tensor, output_sizes: Sequence[int], rank: int, world: int,
                     replicas: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Rank ``rank``'s rows of a block scale ``[ceil(N / 128), K / 128]`` for the column-parallel split of
    `column_rows` (whose row ranges start and end on block boundaries: `check_column_shardable` with
    ``block=True``), as a new contiguous tensor."""
    ranges = [(a // BLOCK_SIZE, -(-b // BLOCK_SIZE)) for a, b in column_rows(output_sizes, rank, world, replicas)]
    return _take_rows(scale, ranges)


def shard_block_cols(scale: torch.Tensor, in_features: int, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s columns of a block scale ``[ceil(N / 128), K / 128]`` for the row-parallel split of
    ``in_features`` (``K / world`` a multiple of 128: `check_row_shardable` with ``block=True``), as a new
    contiguous tensor."""
    a, b = shard_range(in_features, rank, world)
    return scale[:, a // BLOCK_SIZE:b // BLOCK_SIZE].clone(memory_format=torch.contiguous_format)


# ---- mixture-of-experts experts (W8A8MoE): split over the intermediate size I ----------------------------------
#
# ``w13`` ``[E, 2I, H]`` stacks each expert's gate rows ``[0, I)`` and up rows ``[I, 2I)``: rank ``r`` keeps the
# gate rows ``[r I / w, (r + 1) I / w)`` and the same up rows, stacked ``[gate_r; up_r]`` (a column-parallel
# split of ``output_sizes = [I, I]`` per expert), so its shard is again a ``[E, 2 I / w, H]`` gate/up stack.
# ``w2`` ``[E, H, I]`` is split on its I columns (row-parallel); the layer all-reduces its output.


def check_moe_shardable(intermediate_size: int, world: int, block: bool = False,
                        where: str = "TensorParallelW8A8MoE") -> int:
    """Validate the expert-parallel split of the intermediate size I over ``world`` ranks; return ``I / world``.

    Raises
    ------
    ValueError
        I is not divisible by ``world``; ``I / world`` is not a multiple of 16 (the grouped GEMM's alignment); with
        block-scaled fp8 (``block``) ``I / world`` is not a multiple of 128, so a shard would split a 128 x 128
        weight block of w13's rows or w2's columns (the message names I, the world size and the shard's size).
    """
    if intermediate_size % world:
        raise _fail(where, "intermediate_size", intermediate_size, world)
    local = intermediate_size // world
    if block and local % BLOCK_SIZE:
        raise ValueError(f"{where}: block-scaled fp8 experts ({BLOCK_SIZE} x {BLOCK_SIZE} blocks) cannot be split "
                         f"over {world} ranks: intermediate_size I = {intermediate_size} gives shards of I / {world} = "
                         f"{local}, not a multiple of {BLOCK_SIZE}, so a shard would split a weight block")
    if local % 16:
        raise ValueError(f"{where}: intermediate_size I = {intermediate_size} gives shards of I / {world} = {local}; "
                         "the grouped GEMM kernels need a multiple of 16")
    return local


def _cat_dim1(t: torch.Tensor, ranges) -> torch.Tensor:
    return torch.cat([t[:, a:b] for a, b in ranges], dim=1).contiguous()


def shard_w13(t: torch.Tensor, intermediate_size: int, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s ``[gate_r; up_r]`` rows of a ``[E, 2I, ...]`` tensor (``w13`` ``[E, 2I, H]`` or its
    per-channel scale ``[E, 2I]``): ``[E, 2 I / world, ...]``, a new contiguous tensor."""
    return _cat_dim1(t, column_rows([intermediate_size, intermediate_size], rank, world))


def shard_w13_block_scale(scale: torch.Tensor, intermediate_size: int, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s rows of w13's block scale ``[E, 2I / 128, H / 128]`` (I and ``I / world`` multiples of 128:
    `check_moe_shardable` with ``block=True``): ``[E, 2 I / world / 128, H / 128]``."""
    ranges = column_rows([intermediate_size, intermediate_size], rank, world)
    return _cat_dim1(scale, [(a // BLOCK_SIZE, b // BLOCK_SIZE) for a, b in ranges])


def shard_w2(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s I columns ``[r I / world, (r + 1) I / world)`` of ``w2`` ``[E, H, I]``, a new contiguous
    tensor (its per-channel scale ``[E, H]`` is kept whole)."""
    return shard_cols(t, rank, world)


def shard_w2_block_scale(scale: torch.Tensor, intermediate_size: int, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s columns of w2's block scale ``[E, ceil(H / 128), I / 128]``: ``[E, ceil(H / 128),
    I / world / 128]``."""
    a, b = shard_range(intermediate_size, rank, world)
    return scale[..., a // BLOCK_SIZE:b // BLOCK_SIZE].clone(memory_format=torch.contiguous_format)
