"""What the parallel layers share: `TPContext` (the group resolved once, kept on a sharded module), their
tensor-parallel attributes, the fields of their cross-rank check, and the all-reduce / all-gather of their
outputs."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ._group import collective_device, group_rank_size


class TPContext:
    """One resolved tensor-parallel group, asked of ``torch.distributed`` once where sharding starts and passed down
    to every layer that shards, instead of each asking again.

    Made by `resolve` at each entry (`cutlass_w8a8.tensor_parallel_`, the sharded checkpoint loader, the decoder's
    sharding, and the public constructors of the parallel layers when given a ``ProcessGroup``); every
    ``from_float`` / ``from_full`` / ``from_shard`` / ``from_linear`` of `cutlass_w8a8.distributed` takes one in
    place of the group and then asks nothing of ``torch.distributed`` but its collectives. A sharded module keeps
    its context in ``_tp`` (``copy.deepcopy`` of the module shares it: a ProcessGroup cannot be copied).

    Attributes
    ----------
    group : torch.distributed.ProcessGroup
    rank : int
        This process's rank in ``group``.
    world : int
        The size of ``group``.
    device : torch.device
        Where the group's collectives take their tensors (`_group.collective_device`: the current CUDA device for
        an NCCL-only group, else the CPU).
    kv_replicas : int
        The replication plan of key/value heads: how many ranks share each one (1: the heads are split over the
        ranks; ``world / KVH`` when there are fewer key/value heads than ranks: `sharding.kv_replicas`). Set by
        the entry that knows the model's heads (`with_kv_replicas`); 1 otherwise.
    """

    __slots__ = ("group", "rank", "world", "device", "kv_replicas")

    def __init__(self, group, rank: int, world: int, device: Optional[torch.device] = None, kv_replicas: int = 1):
        self.group, self.rank, self.world = group, int(rank), int(world)
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self.kv_replicas = int(kv_replicas)

    @classmethod
    def resolve(cls, tp_group, where: str, tp_size: Optional[int] = None) -> "TPContext":
        """``tp_group`` as it is when it is a `TPContext`, else the context of the ``ProcessGroup`` ``tp_group``
        (its rank, size and collective device, asked once).

        Raises
        ------
        RuntimeError
            ``torch.distributed`` is not initialized (the message starts with ``where``).
        TypeError
            ``tp_group`` is neither a `TPContext` nor a ``torch.distributed.ProcessGroup``.
        ValueError
            ``tp_size`` is given and differs from the group's size.
        """
        if isinstance(tp_group, cls):
            ctx = tp_group
        else:
            rank, world = group_rank_size(tp_group, where)
            ctx = cls(tp_group, rank, world, collective_device(tp_group))
        _check_tp_size(where, tp_size, ctx.world)
        return ctx

    def with_kv_replicas(self, kv_replicas: int) -> "TPContext":
        """This context with the key/value replication plan ``kv_replicas`` (a new object; this one unchanged)."""
        return TPContext(self.group, self.rank, self.world, self.device, kv_replicas)

    def __deepcopy__(self, memo):
        return self

    def __repr__(self) -> str:
        return (f"TPContext(rank={self.rank}, world={self.world}, device={self.device}"
                + (f", kv_replicas={self.kv_replicas})" if self.kv_replicas != 1 else ")"))


def _set_tp(mod: nn.Module, ctx: TPContext, full_out: int, full_in: int) -> None:
    mod._tp = ctx
    mod.tp_rank, mod.tp_size = ctx.rank, ctx.world
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
