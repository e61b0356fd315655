"""Worker functions of the block-scaled fp8 tensor-parallel tests (tests/checkpoints/test_checkpoints_block_tp.py, gloo on
the CPU), run by `cutlass_w8a8.testing.tp.run_workers` in spawned processes, one per rank. As in
tests/_tp_scenarios.py: every rank builds the same full layer from one seed, shards it, runs both, and returns
plain data (CPU tensors, e4m3 viewed as uint8; exceptions as ``("error", type, message)``); the tests assert in
the parent.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import cutlass_w8a8 as cw
from cutlass_w8a8.distributed import ColumnParallelW8A8Linear, RowParallelW8A8Linear, fuse_w8a8, shard_linear

from _tp_scenarios import _ReadLog, _catch, _cpu, _float_linear

BLOCK_CONFIG = cw.W8A8Config(dtype=torch.float8_e4m3fn, weight_block_size=(128, 128))


def block_layer(k: int, n: int, seed: int) -> cw.W8A8Linear:
    """A full block-scaled fp8 layer (bf16, bias) from `_float_linear`'s weights."""
    return cw.W8A8Linear.from_float(_float_linear(k, n, "cpu", seed), BLOCK_CONFIG)


def block_input(m: int, k: int, seed: int = 7) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g).to(torch.bfloat16)


def _layers(rank, world):
    col_full, row_full = block_layer(256, 512, 0), block_layer(512, 256, 1)
    x_col, x_row = block_input(5, 256), block_input(5, 512)
    col = shard_linear(col_full, "colwise", dist.group.WORLD)
    row = shard_linear(row_full, "rowwise", dist.group.WORLD)
    a, b = rank * 256, (rank + 1) * 256
    with torch.no_grad():
        out = dict(col_y=col(x_col), col_full_y=col_full(x_col), col_w=col.weight, col_s=col.weight_scale,
                   row_y=row(x_row[:, a:b]), row_w=row.weight, row_s=row.weight_scale,
                   col_type=type(col).__name__, row_type=type(row).__name__,
                   col_block=col.weight_block_size, row_block=row.weight_block_size)
        # a QuantizedActivation of the full input, split here (input_is_parallel=False): its group scales too
        row_full_in = RowParallelW8A8Linear.from_full(row_full, dist.group.WORLD, input_is_parallel=False)
        out["row_qa_y"] = row_full_in(row_full.quantize_input(x_row))
        out["row_float_y"] = row_full_in(x_row)
        # quantized and sharded in one step
        col_ff = ColumnParallelW8A8Linear.from_float(_float_linear(256, 512, "cpu", 0), dist.group.WORLD,
                                                     config=BLOCK_CONFIG)
        out["from_float_same"] = bool(torch.equal(col_ff.weight.view(torch.uint8), col.weight.view(torch.uint8))
                                      and torch.equal(col_ff.weight_scale, col.weight_scale))
        # q / k / v fused, then split per matrix
        q, k, v = block_layer(256, 512, 2), block_layer(256, 256, 3), block_layer(256, 256, 4)
        fused, sizes = fuse_w8a8([q, k, v])
        qkv = ColumnParallelW8A8Linear.from_full(fused, dist.group.WORLD, output_sizes=sizes)
        out["qkv_y"] = qkv(x_col)
        out["qkv_parts_y"] = [layer(x_col) for layer in (q, k, v)]
    return _cpu(out)


def _misaligned_column(rank, world):
    return shard_linear(block_layer(256, 384, 5), "colwise", dist.group.WORLD)


def _misaligned_row(rank, world):
    return shard_linear(block_layer(384, 256, 6), "rowwise", dist.group.WORLD)


def layer_cases(rank: int, world: int) -> dict:
    """Block layers sharded column- and row-wise (outputs, shards), and the two shards that would split a block."""
    return {"layers": _catch(_layers, rank, world), "misaligned_column": _catch(_misaligned_column, rank, world),
            "misaligned_row": _catch(_misaligned_row, rank, world)}


def _from_pretrained(path, input_ids, tp_plan=None):
    log = _ReadLog()
    try:
        model = cw.from_pretrained(path, tp_group=dist.group.WORLD, tp_plan=tp_plan)
    finally:
        log.close()
    with torch.no_grad():
        out = model(input_ids).logits
    kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    tokens = model.generate(input_ids[:1, :8], **kw)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    return _cpu(dict(logits=out, tokens=tokens, reads=log.reads,
                     q_w=attn.q_proj.weight, q_s=attn.q_proj.weight_scale, o_w=attn.o_proj.weight,
                     o_s=attn.o_proj.weight_scale, down_w=mlp.down_proj.weight, down_s=mlp.down_proj.weight_scale,
                     types={n: type(m).__name__ for n, m in model.named_modules()
                            if isinstance(m, (torch.nn.Linear, cw.W8A8Linear))}))


def hf_cases(rank: int, world: int, paths: dict, input_ids: torch.Tensor) -> dict:
    """``from_pretrained(tp_group=...)`` of each block checkpoint in ``paths`` (``{name: path}``; a name ending in
    ``_mlp384`` is one whose MLP splits into 192-row / -column shards: loaded with the default plan and with only
    ``down_proj`` planned, both refused)."""
    out = {}
    for name, path in paths.items():
        if name.endswith("_mlp384"):
            out[name] = _catch(_from_pretrained, path, input_ids)
            out[name + "_down_only"] = _catch(_from_pretrained, path, input_ids, {"down_proj": "rowwise"})
        else:
            out[name] = _catch(_from_pretrained, path, input_ids)
    return out
