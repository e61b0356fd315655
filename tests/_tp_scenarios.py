"""Worker functions of the tensor-parallel tests (tests/distributed/test_tp_cpu.py with gloo, tests/distributed/test_tp_cuda.py with NCCL),
run by `cutlass_w8a8.testing.tp.run_workers` in spawned processes, one per rank. Each builds the full (unsharded)
layer or model and its shard from the same seed on every rank, runs both, and returns plain data (CPU tensors,
exception names and messages); the tests assert in the parent. Every scenario records its own exception instead of
raising, so one failure does not hide the others (and the ranks stay in step: every rank runs every collective).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

import cutlass_w8a8 as cw
from cutlass_w8a8.distributed import (ColumnParallelLinear, ColumnParallelW8A8Linear, RowParallelLinear,
                                      RowParallelW8A8Linear, TensorParallelLlamaDecoder, shard_decoder_)
from cutlass_w8a8.distributed.sharding import column_rows, shard_range
from cutlass_w8a8.models import LlamaConfig, LlamaDecoder
from cutlass_w8a8.runner import DecodeGraphRunner

#: A tiny Llama whose shards over 2 ranks keep every W8A8 N and K a multiple of 16: 4 query heads and 2 key/value
#: heads of 32 (qkv 256 -> 128 per rank: q 64, k 32, v 32), MLP 256 (gate_up 512 -> 256, down K 256 -> 128).
TINY = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=32, max_position=64)
#: TINY with one key/value head: at TP=2 it is replicated (each rank keeps head 0 and 2 of the 4 query heads).
TINY_KV1 = TINY.replace(num_kv_heads=1)
QUANT = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
COL_SIZES = [64, 16, 16]  # a fused layer of three matrices (q, k, v), N = 96


def _device(rank: int) -> torch.device:
    return torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")


def _catch(fn, *args):
    """``("ok", fn(*args))`` or ``("error", exception type name, message)``."""
    try:
        return ("ok", fn(*args))
    except Exception as exc:  # noqa: BLE001 (reported to the parent)
        return ("error", type(exc).__name__, str(exc))


def _cpu(obj):
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu()
        return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t  # pickles on every torch
    if isinstance(obj, dict):
        return {k: _cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu(v) for v in obj)
    return obj


def _float_linear(k: int, n: int, device, seed: int) -> nn.Linear:
    """bf16 Linear with N(0, 0.05) weights and a large N(0, 1) bias (so that a bias added twice is caught)."""
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(k, n, bias=True, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) * 0.05)
        lin.bias.copy_(torch.randn(n, generator=g))
    return lin.to(device)


# ----------------------------------------------------------------------------------------------------
# layers


def _layers_one(rank: int, world: int, qname: str) -> dict:
    if qname == "fp8" and dist.get_backend() == "nccl" and not cw.supports_fp8():
        return "skip: no fp8 kernels on this device"
    group, dev = dist.group.WORLD, _device(rank)
    config = cw.W8A8Config(dtype=QUANT[qname])
    lin = _float_linear(128, 96, dev, seed=1)
    x = (torch.randn(5, 128, generator=torch.Generator().manual_seed(2)) * 2).to(torch.bfloat16).to(dev)
    full = cw.W8A8Linear.from_float(lin, config)
    col = ColumnParallelW8A8Linear.from_float(lin, group, output_sizes=COL_SIZES, config=config)
    colg = ColumnParallelW8A8Linear.from_full(full, group, output_sizes=COL_SIZES, gather_output=True)
    row = RowParallelW8A8Linear.from_full(full, group)
    row_full_input = RowParallelW8A8Linear.from_full(full, group, input_is_parallel=False)
    a, b = shard_range(128, rank, world)
    xs = x[:, a:b].contiguous()
    partial = cw.W8A8Linear.from_quantized(row.weight, row.weight_scale, dtype=torch.bfloat16)(xs)
    q, s = torch.ops.cutlass_w8a8.quantize_per_token(xs, QUANT[qname])
    static = cw.W8A8Linear.from_float(lin, config, input_scale=torch.tensor([0.05], device=dev))
    row_static = RowParallelW8A8Linear.from_full(static, group)
    return _cpu(dict(
        x=x, full_w=full.weight, full_s=full.weight_scale, full_b=full.bias, full_y=full(x),
        col_y=col(x), col_w=col.weight, col_s=col.weight_scale, col_b=col.bias, colg_y=colg(x),
        row_y=row(xs), row_w=row.weight, row_s=row.weight_scale, row_partial=partial,
        row_q_y=row(cw.QuantizedActivation(q, s)), row_full_input_y=row_full_input(x),
        static_full_y=static(x), static_row_y=row_static(xs), static_scale=static.input_scale,
        types=[type(m).__name__ for m in (col, colg, row)], in_out=[(m.in_features, m.out_features)
                                                                  for m in (col, row)]))


def _float_layers(rank: int, world: int) -> dict:
    group, dev = dist.group.WORLD, _device(rank)
    lin = _float_linear(128, 96, dev, seed=3).float()
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(4)).to(dev)
    col = ColumnParallelLinear.from_linear(lin, group, output_sizes=COL_SIZES, gather_output=True)
    row = RowParallelLinear.from_linear(lin, group)
    a, b = shard_range(128, rank, world)
    with torch.no_grad():
        return _cpu(dict(x=x, w=lin.weight, b=lin.bias, full_y=lin(x), colg_y=col(x), row_y=row(x[:, a:b])))


def layer_cases(rank: int, world: int) -> dict:
    """Column / row sharding of one layer, int8 and fp8, and the float counterparts."""
    out = {q: _catch(_layers_one, rank, world, q) for q in QUANT}
    out["float"] = _catch(_float_layers, rank, world)
    return out


# ----------------------------------------------------------------------------------------------------
# errors


def _mismatched_shape(rank, world):
    return ColumnParallelW8A8Linear.from_float(_float_linear(128, 96 if rank == 0 else 64, _device(rank), 5),
                                               dist.group.WORLD)


def _mismatched_tp_size(rank, world):
    return RowParallelW8A8Linear.from_float(_float_linear(128, 64, _device(rank), 5), dist.group.WORLD,
                                            tp_size=world if rank == 0 else 2 * world)


def _mismatched_decoder(rank, world):
    cfg = TINY if rank == 0 else TINY.replace(intermediate_size=512)
    return TensorParallelLlamaDecoder(cfg, quant="int8", max_batch=2, max_seq_len=16, device=_device(rank),
                                      tp_group=dist.group.WORLD)


def _indivisible_sizes(rank, world):
    return ColumnParallelW8A8Linear.from_float(_float_linear(128, 64, _device(rank), 5), dist.group.WORLD,
                                               output_sizes=[33, 31])


def _misaligned_row(rank, world):
    return RowParallelW8A8Linear.from_float(_float_linear(48, 64, _device(rank), 5), dist.group.WORLD)


def _indivisible_kv_heads(rank, world):
    # 3 key/value heads over 2 ranks: neither split (2 does not divide 3) nor replicated (3 does not divide 2)
    return TensorParallelLlamaDecoder(TINY.replace(num_heads=6, num_kv_heads=3), quant="int8", max_batch=2,
                                      max_seq_len=16, device=_device(rank), tp_group=dist.group.WORLD)


def _group_still_works(rank, world):
    t = torch.tensor([float(rank + 1)], device=_device(rank))
    dist.all_reduce(t)
    return float(t.item())


def error_cases(rank: int, world: int) -> dict:
    """Misuse that every rank must report with the same ValueError, then a collective showing the group is intact."""
    names = ["mismatched_shape", "mismatched_tp_size", "mismatched_decoder", "indivisible_sizes", "misaligned_row",
             "indivisible_kv_heads"]
    out = {n: _catch(globals()["_" + n], rank, world) for n in names}
    out = {n: (v if v[0] == "error" else ("ok", None)) for n, v in out.items()}
    out["group_still_works"] = _catch(_group_still_works, rank, world)
    return out


# ----------------------------------------------------------------------------------------------------
# decoder


def dequantized_float_model(model: nn.Module) -> nn.Module:
    """A float32 copy of ``model`` (a `LlamaDecoder` or a transformers model, unsharded) whose `W8A8Linear` layers
    are float ``nn.Linear`` holding the dequantized weights ``weight * weight_scale``: the same weights, exact
    activations (no activation quantization), float32 arithmetic. What the quantized model approximates."""
    ref = copy.deepcopy(model)
    for name, m in list(ref.named_modules()):
        if isinstance(m, cw.W8A8Linear):
            lin = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, device=m.weight.device,
                            dtype=torch.float32)
            with torch.no_grad():
                lin.weight.copy_(m.weight.float() * m.weight_scale.reshape(-1, 1))
                if m.bias is not None:
                    lin.bias.copy_(m.bias.float())
            parent, _, child = name.rpartition(".")
            setattr(ref.get_submodule(parent) if parent else ref, child, lin)
    ref.to(torch.float32)
    if isinstance(ref, LlamaDecoder):
        ref.dtype = torch.float32
    return ref


def _decoder(rank: int, world: int, quant, dtype: torch.dtype, steps: int, config: LlamaConfig,
             tp_lm_head=None) -> dict:
    if quant == "fp8" and dist.get_backend() == "nccl" and not cw.supports_fp8():
        return "skip: no fp8 kernels on this device"
    group, dev = dist.group.WORLD, _device(rank)
    kw = dict(quant=quant, dtype=dtype, max_batch=4, max_seq_len=32, device=dev, seed=0)
    full = LlamaDecoder(config, **kw)
    tp = TensorParallelLlamaDecoder(config, tp_group=group, tp_size=world, tp_lm_head=tp_lm_head, **kw)
    tp_copy = shard_decoder_(copy.deepcopy(full), group, tp_lm_head=tp_lm_head)
    ref = dequantized_float_model(full) if quant is not None else None
    same_weights = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.dtype == torch.float8_e4m3fn
                       else torch.equal(a, b)
                       for a, b in zip(tp.state_dict().values(), tp_copy.state_dict().values()))
    runner = DecodeGraphRunner(tp_copy, use_graphs=dev.type == "cuda")
    slots = torch.tensor([0, 1, 2], device=dev)
    out = {k: [] for k in ("full", "tp", "runner", "runner_eager", "ref")}
    with torch.no_grad():
        for step in range(steps):
            ids = torch.randint(0, config.vocab_size, (3,), generator=torch.Generator().manual_seed(10 + step)).to(dev)
            pos = torch.full((3,), step, device=dev)
            out["full"].append(full(ids, pos, slots).float().cpu())
            out["tp"].append(tp(ids, pos, slots).float().cpu())
            out["runner"].append(runner.step(ids, pos, slots).float().cpu())
            # the same padded step again, eagerly (it rewrites the same cache entries with the same values)
            out["runner_eager"].append(runner.step(ids, pos, slots, use_graph=False).float().cpu())
            if ref is not None:
                out["ref"].append(ref(ids, pos, slots).float().cpu())
    attn = tp.layers[0].self_attn
    out.update(same_weights=same_weights, heads=(attn.num_heads, attn.num_kv_heads),
               kv_cache_shape=tuple(attn.kv_cache.shape), use_layer_op=[layer.use_layer_op for layer in tp.layers],
               types=sorted({type(m).__name__ for m in tp.modules() if isinstance(m, (nn.Linear, cw.W8A8Linear))}),
               lm_head=type(tp.lm_head).__name__,
               graphs=len(runner.graphs))
    return out


def decoder_cases(rank: int, world: int, cases, steps: int = 4, config: LlamaConfig = TINY) -> dict:
    """``cases``: ``[(name, quant, dtype[, tp_lm_head[, config]])]`` (``tp_lm_head`` None: the default, sharded over
    the vocabulary; ``config`` default ``config``); each: TP model (constructor and `shard_decoder_` of a full copy)
    vs the full model, its `DecodeGraphRunner` (graphs on CUDA, eager on the CPU), and the dequantized float
    reference."""
    return {c[0]: _catch(_decoder, rank, world, c[1], c[2], steps, c[4] if len(c) > 4 else config, *c[3:4])
            for c in cases}


# ----------------------------------------------------------------------------------------------------
# quantize_ on a plain module


class ToyMLP(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))`` with Llama's names, bf16, hidden 128, inner 256."""

    def __init__(self, device=None):
        super().__init__()
        g = torch.Generator().manual_seed(6)
        self.gate_proj, self.up_proj = (nn.Linear(128, 256, bias=False, dtype=torch.bfloat16) for _ in range(2))
        self.down_proj = nn.Linear(256, 128, bias=True, dtype=torch.bfloat16)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        self.to(device)

    def hidden(self, x):
        return torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x)

    def forward(self, x):
        return self.down_proj(self.hidden(x))


def quantize_cases(rank: int, world: int) -> dict:
    """``quantize_(model, tp_group=...)`` on a module with Llama's projection names, all quantized, and with
    ``up_proj`` left in float by ``filter_fn`` (sharded as a float column-parallel layer)."""
    def run(filter_fn):
        dev = _device(rank)
        x = torch.randn(4, 128, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16).to(dev)
        full = cw.quantize_(ToyMLP(dev), filter_fn=filter_fn)
        tp = cw.quantize_(ToyMLP(dev), filter_fn=filter_fn, tp_group=dist.group.WORLD)
        with torch.no_grad():
            out = _cpu(dict(x=x, full_y=full(x), tp_y=tp(x), hidden=full.hidden(x), down_w=full.down_proj.weight,
                            down_s=full.down_proj.weight_scale, down_b=full.down_proj.bias,
                            types={n: type(m).__name__ for n, m in tp.named_children()}))
        out["requantize"] = _catch(cw.quantize_, tp)  # a float shard must not become an unsharded W8A8Linear
        out["requantize"] = out["requantize"] if out["requantize"][0] == "error" else ("ok", None)
        return out

    return {"all": _catch(run, None), "up_float": _catch(run, lambda m, fqn: fqn != "up_proj")}


# ----------------------------------------------------------------------------------------------------
# transformers models: quantize_ and from_pretrained with tp_group


class _ReadLog:
    """Wraps ``safetensors.safe_open`` to record every tensor read: ``(name, "whole" | "slice", shape)``."""

    def __init__(self):
        import safetensors

        self.reads, self._module, self._orig = [], safetensors, safetensors.safe_open
        log, orig = self.reads, self._orig

        class Slice:
            def __init__(self, name, sl):
                self.name, self.sl = name, sl

            def get_dtype(self):
                return self.sl.get_dtype()

            def get_shape(self):
                return self.sl.get_shape()

            def __getitem__(self, idx):
                t = self.sl[idx]
                log.append((self.name, "slice", tuple(t.shape)))
                return t

        class File:
            def __init__(self, *args, **kwargs):
                self.f = orig(*args, **kwargs)

            def __enter__(self):
                self.f.__enter__()
                return self

            def __exit__(self, *exc):
                return self.f.__exit__(*exc)

            def keys(self):
                return self.f.keys()

            def metadata(self):
                return self.f.metadata()

            def get_tensor(self, name):
                t = self.f.get_tensor(name)
                log.append((name, "whole", tuple(t.shape)))
                return t

            def get_slice(self, name):
                return Slice(name, self.f.get_slice(name))

        safetensors.safe_open = File

    def close(self):
        self._module.safe_open = self._orig


def _hf_from_pretrained(rank, world, path, ids):
    log = _ReadLog()
    try:
        model = cw.from_pretrained(path, tp_group=dist.group.WORLD)
    finally:
        log.close()
    with torch.no_grad():
        logits = model(ids).logits
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    return _cpu(dict(logits=logits, reads=log.reads, q_w=attn.q_proj.weight, q_s=attn.q_proj.weight_scale,
                     o_w=attn.o_proj.weight, o_s=attn.o_proj.weight_scale, down_w=mlp.down_proj.weight,
                     types={n: type(m).__name__ for n, m in model.named_modules() if isinstance(m, nn.Linear)
                            or isinstance(m, cw.W8A8Linear)}))


def _hf_quantize(rank, world, ids):
    from _checkpoints import tiny_model  # importable in the worker: spawn passes the parent's sys.path

    model = cw.quantize_(tiny_model("llama", seed=0), filter_fn=lambda m, fqn: fqn != "lm_head",
                         tp_group=dist.group.WORLD)
    with torch.no_grad():
        return _cpu(dict(logits=model(ids).logits,
                         q_type=type(model.model.layers[0].self_attn.q_proj).__name__,
                         o_type=type(model.model.layers[0].self_attn.o_proj).__name__))


def _hf_kv1_from_pretrained(rank, world, path, ids):
    model = cw.from_pretrained(path, tp_group=dist.group.WORLD)
    with torch.no_grad():
        logits = model(ids).logits
    attn = model.model.layers[0].self_attn
    return _cpu(dict(logits=logits, k_w=attn.k_proj.weight, v_w=attn.v_proj.weight, q_w=attn.q_proj.weight,
                     k_type=type(attn.k_proj).__name__, groups=attn.num_key_value_groups))


def _hf_kv1_float(rank, world, ids):
    """The float32 tiny Llama with one key/value head, sharded by ``tensor_parallel_`` (the head replicated)."""
    from _checkpoints import tiny_model

    from cutlass_w8a8.distributed import tensor_parallel_

    model = tensor_parallel_(tiny_model("llama", seed=1, num_key_value_heads=1).float(), dist.group.WORLD)
    with torch.no_grad():
        return _cpu(dict(logits=model(ids).logits, groups=model.model.layers[0].self_attn.num_key_value_groups))


def hf_cases(rank: int, world: int, path: str, ids: torch.Tensor, path_kv1: str = None) -> dict:
    """A compressed-tensors checkpoint of a tiny Llama loaded with ``from_pretrained(tp_group=...)`` (with every
    safetensors read recorded), and the float tiny Llama quantized with ``quantize_(tp_group=...)``; with
    ``path_kv1``, the same checkpoint loading for a tiny Llama with one key/value head (replicated at TP=2), and
    that model in float32 sharded by ``tensor_parallel_``."""
    out = {"from_pretrained": _catch(_hf_from_pretrained, rank, world, path, ids),
           "quantize_": _catch(_hf_quantize, rank, world, ids)}
    if path_kv1 is not None:
        out["from_pretrained_kv1"] = _catch(_hf_kv1_from_pretrained, rank, world, path_kv1, ids)
        out["float_kv1"] = _catch(_hf_kv1_float, rank, world, ids)
    return out


def cpu_core_cases(rank: int, world: int) -> dict:
    """Everything tests/distributed/test_tp_cpu.py checks that runs without transformers, in one pair of processes."""
    return {"layers": layer_cases(rank, world), "errors": error_cases(rank, world),
            "decoder": decoder_cases(rank, world, [("int8", "int8", torch.bfloat16), ("fp8", "fp8", torch.bfloat16),
                                                   ("float32", None, torch.float32),
                                                   ("int8_replicated_lm_head", "int8", torch.bfloat16, False),
                                                   ("int8_kv1", "int8", torch.bfloat16, None, TINY_KV1),
                                                   ("float32_kv1", None, torch.float32, None, TINY_KV1)]),
            "quantize": quantize_cases(rank, world)}


#: The CUDA tests' decoder: SMALL's dimensions (hidden 1024, 16 / 4 heads of 64, MLP 2816, vocab 8192), 2 layers.
SMALL2 = LlamaConfig(num_layers=2)
#: SMALL2 with one key/value head: replicated at TP=2 (each rank keeps it and 8 of the 16 query heads).
SMALL2_KV1 = SMALL2.replace(num_kv_heads=1)


def cuda_cases(rank: int, world: int) -> dict:
    """What tests/distributed/test_tp_cuda.py checks, in one pair of NCCL processes (cuda:0, cuda:1)."""
    if not cw.cuda_ops_available():
        raise RuntimeError(f"the CUDA extension is not built: {cw.extension_status()}")
    return {"layers": layer_cases(rank, world), "errors": error_cases(rank, world),
            "decoder": decoder_cases(rank, world, [("int8", "int8", torch.bfloat16), ("fp8", "fp8", torch.bfloat16),
                                                   ("int8_replicated_lm_head", "int8", torch.bfloat16, False),
                                                   ("int8_kv1", "int8", torch.bfloat16, None, SMALL2_KV1)],
                                     steps=4, config=SMALL2)}


# ----------------------------------------------------------------------------------------------------
# shared by the test files


#: The W8A8 decoder criterion of the tests: ||L2 - Lf|| <= TP_VS_TP1_ACCURACY * ||L1 - Lf|| (tests/distributed/test_tp_cpu.py).
TP_VS_TP1_ACCURACY = 1.25

#: The ValueError (regex) each error_cases scenario must raise on every rank.
ERRORS = {
    "mismatched_shape": r"ColumnParallelW8A8Linear: the ranks of the tensor-parallel group disagree on `out_features` "
                        r"\(rank 0: 96, rank 1: 64\)",
    "mismatched_tp_size": r"RowParallelW8A8Linear: the ranks of the tensor-parallel group disagree on `tp_size` "
                          r"\(rank 0: 2, rank 1: 4\)",
    "mismatched_decoder": r"LlamaDecoder \(tensor parallel\): the ranks of the tensor-parallel group disagree on "
                          r"`intermediate_size` \(rank 0: 256, rank 1: 512\)",
    "indivisible_sizes": r"ColumnParallelW8A8Linear: `output_sizes\[0\]` = 33 is not divisible by the tensor-parallel "
                         r"world size 2",
    "misaligned_row": r"RowParallelW8A8Linear: the shard of each rank would have in_features = 24",
    "indivisible_kv_heads": r"`config.num_kv_heads` = 3 and the tensor-parallel world size 2 divide neither way",
}


def ok_value(entry):
    """The value of a ``("ok", value)`` scenario result; fails the test with the scenario's exception otherwise."""
    assert entry[0] == "ok", f"the scenario raised {entry[1]}: {entry[2]}"
    return entry[1]


def kept_rows(rank, world=2):
    """The full layer's rows that rank ``rank`` keeps in `layer_cases`'s column-parallel layer."""
    return torch.cat([torch.arange(a, b) for a, b in column_rows(COL_SIZES, rank, world)])


def as_fp8(t):
    """Undo `_cpu`'s uint8 view of an e4m3 tensor."""
    return t.view(torch.float8_e4m3fn) if t.dtype == torch.uint8 else t
