"""What the parallel layers share: the group reference kept on a module, their tensor-parallel attributes, the
fields of their cross-rank check, and the all-reduce / all-gather of their outputs."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn


class _GroupRef:
    """Holds the process group; shared, not copied, by ``copy.deepcopy`` of a module (a ProcessGroup cannot be
    copied)."""

    __slots__ = ("group",)

    def __init__(self, group):
        self.group = group

    def __deepcopy__(self, memo):
        return self


class TPContext:
    """One resolved tensor-parallel group: ``group``, this process's ``rank`` in it and its size ``world``, asked of
    ``torch.distributed`` once where sharding starts (`resolve`) and passed down to the code that shards, instead of
    every layer asking again.

    ``TPContext.resolve(tp_group_or_context, where, tp_size=None)`` returns a given context as it is, or resolves a
    ``ProcessGroup`` (RuntimeError when ``torch.distributed`` is not initialized, TypeError for anything else;
    ValueError when ``tp_size`` is given and differs from the group's size).
    """

    __slots__ = ("group", "rank", "world")

    def __init__(self, group, rank: int, world: int):
        self.group, self.rank, self.world = group, int(rank), int(world)

    @classmethod
    def resolve(cls, tp_group, where: str, tp_size: Optional[int] = None) -> "TPContext":
        if isinstance(tp_group, cls):
            ctx = tp_group
        else:
            from ._group import group_rank_size

            rank, world = group_rank_size(tp_group, where)
            ctx = cls(tp_group, rank, world)
        _check_tp_size(where, tp_size, ctx.world)
        return ctx

    def __repr__(self) -> str:
        return f"TPContext(rank={self.rank}, world={self.world})"


def _set_tp(mod: nn.Module, group, rank: int, world: int, full_out: int, full_in: int) -> None:
    mod._tp = _GroupRef(group)
    mod.tp_rank, mod.tp_size = rank, world
    mod.full_out_features, mod.full_in_features = full_out, full_in


class _TensorParallel:
    """Attributes shared by the parallel layers: ``tp_group``, ``tp_rank``, ``tp_size``, ``full_out_features``
    and ``full_in_features`` (the unsharded N and K)."""

    @property
    def tp_group(self):
        """The ``torch.distributed.ProcessGroup`` the layer reduces / gathers over."""
        return self._tp.group


def _fields(kind: str, n: int, k: int, tp_size: Optional[int], **extra) -> dict:
    out = {"style": 1 if kind == "colwise" else 2, "tp_size": -1 if tp_size is None else int(tp_size),
           "out_features": n, "in_features": k}
    out.update({name: int(v) for name, v in extra.items()})
    return out


def _check_tp_size(where: str, tp_size: Optional[int], world: int) -> None:
    if tp_size is not None and tp_size != world:
        raise ValueError(f"{where}: `tp_size` = {tp_size} but the tensor-parallel group has {world} ranks")


def _gather_columns(y: torch.Tensor, group, world: int, output_sizes: Sequence[int],
                    replicas: Optional[Sequence[int]] = None) -> torch.Tensor:
    """All-gather the column shards ``(..., N / world)`` of every rank into the full ``(..., N)`` output in the
    unsharded layer's order (matrix by matrix, each matrix's rows rank by rank; a matrix whose parts are shared by
    ``replicas[j]`` ranks takes each part once, from the first rank holding it)."""
    reps = [1] * len(output_sizes) if replicas is None else list(replicas)
    y = y.contiguous()
    parts = [torch.empty_like(y) for _ in range(world)]
    dist.all_gather(parts, y, group=group)
    local = [s * r // world for s, r in zip(output_sizes, reps)]
    pieces = [p.split(local, dim=-1) for p in parts]
    return torch.cat([pieces[r][j] for j in range(len(local)) for r in range(0, world, reps[j])], dim=-1)


def _all_reduce_(y: torch.Tensor, group) -> torch.Tensor:
    dist.all_reduce(y, op=dist.ReduceOp.SUM, group=group)
    return y
