"""Tensor parallelism over ``torch.distributed`` (NCCL on GPUs, gloo on the CPU): vLLM's column- and
row-parallel linears on `W8A8Linear` (`ColumnParallelW8A8Linear`, `RowParallelW8A8Linear`) and on float
``nn.Linear`` (`ColumnParallelLinear`, `RowParallelLinear`), `shard_linear`, `fuse_w8a8` (re-exported from
`cutlass_w8a8.fuse`: q / k / v layers into one column-parallel-ready layer), plans by module name
(`LLAMA_TP_PLAN`, `tensor_parallel_`, used by ``quantize_(..., tp_group=...)``), the reference decoder's
sharding (`shard_decoder_`, `TensorParallelLlamaDecoder`), and the sharded loading of compressed-tensors
checkpoints (``from_pretrained(..., tp_group=...)``: `cutlass_w8a8.distributed.checkpoint`), the experts of
mixture-of-experts blocks split over their intermediate size (`TensorParallelW8A8MoE`, `shard_moe`), and
`TPContext`, a process group resolved once (group, rank, world, collective device, key/value replication
plan) at each entry and passed down to every layer.

Key/value heads fewer than the ranks are replicated (``world % num_key_value_heads == 0``: rank ``r`` keeps head
``r * KVH // world``), in `tensor_parallel_`, ``from_pretrained(tp_group=...)`` and `shard_decoder_`; the reference
decoder's ``lm_head`` is sharded over the vocabulary by default at TP > 1 (``tp_lm_head=False`` replicates it).

Modules: `sharding` (which rows / columns each rank keeps; no communication), `linear`, `float_linear`, `plan`,
`decoder`, `checkpoint`, `moe`. Importing this package touches no GPU and needs no initialized process group.
"""

from . import sharding
from .decoder import TensorParallelLlamaDecoder, shard_decoder_
from ._common import TPContext
from .float_linear import ColumnParallelLinear, RowParallelLinear
from ..fuse import fuse_w8a8
from .linear import ColumnParallelW8A8Linear, RowParallelW8A8Linear, shard_linear
from .moe import TensorParallelW8A8MoE, shard_moe
from .plan import LLAMA_TP_PLAN, tensor_parallel_

__all__ = [
    "ColumnParallelLinear",
    "ColumnParallelW8A8Linear",
    "LLAMA_TP_PLAN",
    "RowParallelLinear",
    "RowParallelW8A8Linear",
    "TPContext",
    "TensorParallelLlamaDecoder",
    "TensorParallelW8A8MoE",
    "fuse_w8a8",
    "shard_decoder_",
    "shard_linear",
    "shard_moe",
    "sharding",
    "tensor_parallel_",
]
