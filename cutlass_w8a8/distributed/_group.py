"""The tensor-parallel group: rank and size, the cross-rank agreement check made at construction, and the
all-reduce / all-gather of layer outputs. Everything goes through ``torch.distributed`` (gloo on the CPU,
NCCL on CUDA devices); nothing here opens a transport of its own."""

from __future__ import annotations

import zlib
from typing import Optional, Sequence

import torch
import torch.distributed as dist

__all__ = ["group_rank_size", "check_same_on_all_ranks", "dtype_code", "collective_device"]

# Length of the int64 vector every rank contributes to the agreement check: a fixed length, so the all_gather
# itself always matches across ranks whatever each rank was asked to build.
_CHECK_LEN = 24
_HEADER = 3  # (site code, number of fields, world size seen by the rank)

_DTYPE_CODES = {torch.int8: 1, torch.float8_e4m3fn: 2, torch.bfloat16: 3, torch.float16: 4, torch.float32: 5,
                torch.float64: 6}


def dtype_code(dtype: Optional[torch.dtype]) -> int:
    """A small int for a dtype (0 for None or one not listed), for `check_same_on_all_ranks`."""
    return _DTYPE_CODES.get(dtype, 0) if dtype is not None else 0


def group_rank_size(tp_group, where: str) -> tuple[int, int]:
    """``(rank in tp_group, size of tp_group)``. Called by `TPContext.resolve` alone: everything else takes the
    resolved context.

    Raises
    ------
    RuntimeError
        ``torch.distributed`` is not initialized.
    TypeError
        ``tp_group`` is None or not a ``torch.distributed.ProcessGroup``.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{where}: torch.distributed is not initialized (call torch.distributed."
                           "init_process_group first, e.g. under torchrun)")
    if tp_group is None or not isinstance(tp_group, dist.ProcessGroup):
        raise TypeError(f"{where}: `tp_group` must be a torch.distributed.ProcessGroup (e.g. "
                        f"torch.distributed.group.WORLD), got {type(tp_group).__name__}")
    return dist.get_rank(tp_group), dist.get_world_size(tp_group)


def collective_device(tp_group) -> torch.device:
    """Where the group's collectives take their tensors: the current CUDA device for an NCCL-only group, else
    the CPU (gloo, or a group with a CPU backend)."""
    backend = str(dist.get_backend(tp_group)).lower()
    if "nccl" in backend and "gloo" not in backend and "cpu" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _site_code(where: str) -> int:
    return zlib.crc32(where.encode()) & 0x7FFFFFFF


def sequence_code(values: Sequence[int]) -> int:
    """A 31-bit fingerprint of a sequence of ints (e.g. ``output_sizes``), for `check_same_on_all_ranks`."""
    return zlib.crc32(",".join(str(int(v)) for v in values).encode()) & 0x7FFFFFFF


def check_same_on_all_ranks(ctx, where: str, fields: dict) -> None:
    """Raise the same ValueError on every rank of ``ctx.group`` unless all ranks pass equal ``fields``.

    One ``all_gather`` of a fixed-length int64 vector per call (on ``ctx.device``): the call-site code
    (from ``where``), the number of fields, the world size as each rank sees it, then the fields. Every rank
    compares the gathered rows and, on any difference, raises ``ValueError`` with a message built from the
    gathered rows alone, so the message is identical on every rank. It cannot hang as long as every rank calls
    it (a rank that raised earlier, or never calls, leaves the others in the all_gather until the group's
    timeout, ``init_process_group(timeout=...)``).

    Parameters
    ----------
    ctx : TPContext
        The group resolved once by the caller's entry (`cutlass_w8a8.distributed.TPContext`): its ``group``,
        ``world`` and collective ``device``; nothing is asked of ``torch.distributed`` again.
    where : str
        The constructing call, e.g. ``"ColumnParallelW8A8Linear"``; ranks at different call sites are reported
        as such.
    fields : dict of str to int
        At most 21 named integers (shapes, dtype codes from `dtype_code`). A name starting with ``#`` marks a
        fingerprint (`sequence_code` of a list): reported as differing, without its meaningless value. A value
        of -1 is printed as "unset".
    """
    names = list(fields)
    if len(names) > _CHECK_LEN - _HEADER:
        raise ValueError(f"check_same_on_all_ranks: at most {_CHECK_LEN - _HEADER} fields, got {len(names)}")
    world = ctx.world
    row = [_site_code(where), len(names), world] + [int(fields[n]) for n in names]
    row += [0] * (_CHECK_LEN - len(row))
    mine = torch.tensor(row, dtype=torch.int64, device=ctx.device)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=ctx.group)
    rows = [g.cpu().tolist() for g in gathered]
    if all(r == rows[0] for r in rows):
        return
    if any(r[:2] != rows[0][:2] for r in rows):
        ranks = [i for i, r in enumerate(rows) if r[:2] != rows[0][:2]]
        raise ValueError(f"{where}: the ranks of the tensor-parallel group are not at the same construction step "
                         f"(ranks {ranks} differ from rank 0): every rank must build the same layers in the same "
                         "order")
    labels = ["world size"] + names

    def show(v: int) -> str:
        return "unset" if v == -1 else str(v)

    diffs = []
    for j, label in enumerate(labels):
        vals = [r[_HEADER - 1 + j] for r in rows]
        if any(v != vals[0] for v in vals):
            if label.startswith("#"):
                groups = sorted({v: [i for i, w in enumerate(vals) if w == v] for v in vals}.values())
                diffs.append(f"`{label[1:]}` (" + " vs ".join("ranks " + ",".join(map(str, g)) for g in groups) + ")")
            else:
                diffs.append(f"`{label}` (" + ", ".join(f"rank {i}: {show(v)}" for i, v in enumerate(vals)) + ")")
    raise ValueError(f"{where}: the ranks of the tensor-parallel group disagree on " + "; ".join(diffs) +
                     ". Every rank must be given the same full (unsharded) shapes, dtypes and tensor-parallel size.")
