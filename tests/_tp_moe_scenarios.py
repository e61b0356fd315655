"""Worker functions of the tensor-parallel MoE tests (tests/distributed/test_tp_moe_cpu.py with gloo, tests/distributed/test_tp_moe_cuda.py
with NCCL), run by `cutlass_w8a8.testing.tp.run_workers` in spawned processes, one per rank. Each builds the full
`W8A8MoE` from the same seed on every rank, shards it (`TensorParallelW8A8MoE`), runs both on the same inputs and
returns plain data (CPU tensors, exception names and messages); the tests assert in the parent. Every scenario
records its own exception instead of raising, so one failure does not hide the others (and the ranks stay in
step: every rank runs every collective).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import cutlass_w8a8 as cw
from cutlass_w8a8.distributed.moe import TensorParallelW8A8MoE, shard_moe

from _tp_scenarios import TP_VS_TP1_ACCURACY, _catch, _cpu, _device, as_fp8

E, TOP_K, T = 8, 2, 32

#: name -> (quant dtype, block, static activation scales, H, I)
CASES = {
    "int8": (torch.int8, False, False, 128, 256),
    "fp8": (torch.float8_e4m3fn, False, False, 128, 256),
    "int8_static": (torch.int8, False, True, 128, 256),
    "fp8_block": (torch.float8_e4m3fn, True, False, 256, 256),
}


class Experts(nn.Module):
    """transformers 5's fused experts parameters: ``gate_up_proj`` ``[E, 2I, H]`` (gate rows, then up rows) and
    ``down_proj`` ``[E, H, I]``, bf16, N(0, 0.05) from ``seed``; gate and up drawn independently (so a shard that
    swapped them, or paired rank 0's gate with rank 1's up, gives a different output)."""

    def __init__(self, h: int, i: int, seed: int, device):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.gate_up_proj = nn.Parameter((torch.randn(E, 2 * i, h, generator=g) * 0.05).to(torch.bfloat16).to(device))
        self.down_proj = nn.Parameter((torch.randn(E, h, i, generator=g) * 0.05).to(torch.bfloat16).to(device))


def full_moe(name: str, device, seed: int = 0) -> cw.W8A8MoE:
    qd, block, static, h, i = CASES[name]
    cfg = cw.W8A8Config(dtype=qd, out_dtype=torch.bfloat16, weight_block_size=(128, 128) if block else None)
    kw = dict(a13_scale=torch.tensor([0.07], device=device), a2_scale=torch.tensor([0.05], device=device)) \
        if static else {}
    return cw.W8A8MoE.from_float(Experts(h, i, seed, device), cfg, top_k=TOP_K, renormalize=True, **kw)


def inputs(h: int, device, seed: int = 1):
    """``(x [T, H] bf16, topk_ids [T, 2] int64, topk_weights [T, 2] float32, router_logits [T, E] float32)``: every
    token's two experts distinct; tokens 0-3 all on expert 5 (one expert taking several tokens), expert 7 empty."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, h, generator=g) * 2).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E - 1, generator=g)[:TOP_K] for _ in range(T)])
    ids[:4, 0] = 5
    ids[:4, 1] = torch.tensor([0, 1, 2, 3])
    w = torch.rand(T, TOP_K, generator=g) + 0.1
    w = w / w.sum(-1, keepdim=True)
    logits = torch.randn(T, E, generator=g) * 2
    return x.to(device), ids.to(device), w.to(device), logits.to(device)


def _moe_one(rank: int, world: int, name: str) -> dict:
    dev = _device(rank)
    group = dist.group.WORLD
    full = full_moe(name, dev)
    tp = TensorParallelW8A8MoE.from_full(full, group, tp_size=world)
    tp2 = shard_moe(full, group)
    x, ids, w, logits = inputs(full.hidden_size, dev)
    with torch.no_grad():
        full_y, tp_y = full(x, ids, w), tp(x, ids, w)
        full_yl, tp_yl = full(x, logits), tp(x, logits)
        tp2_y = tp2(x, ids, w)
        tp.reduce_results = False
        partial = tp(x, ids, w)
        tp.reduce_results = True
    b, fb = tp._buffers, full._buffers
    return _cpu(dict(
        x=x, ids=ids, w=w, logits=logits, full_y=full_y, tp_y=tp_y, tp2_y=tp2_y, full_yl=full_yl, tp_yl=tp_yl,
        partial=partial,
        full={k: v for k, v in fb.items() if v is not None}, shard={k: v for k, v in b.items() if v is not None},
        sizes=(tp.intermediate_size, tp.full_intermediate_size, tp.tp_rank, tp.tp_size),
        types=[type(m).__name__ for m in (tp, tp2)], repr=repr(tp)))


def float_reference(d, ids=None, w=None):
    """Y_f in float64: dequantized weights, exact activations, the given routing (default the scenario's)."""
    from _moe_models import dequantize_experts

    f = d["full"]
    w13 = dequantize_experts(as_fp8(f["w13"]), f["w13_scale"], torch.float64)
    w2 = dequantize_experts(as_fp8(f["w2"]), f["w2_scale"], torch.float64)
    x = d["x"].double()
    ids, w = (d["ids"], d["w"].double()) if ids is None else (ids, w.double())
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (w13[e] @ x[t]).chunk(2)
            out[t] += w[t, j] * (w2[e] @ (F.silu(gate) * up))
    return out


def assert_sharded_vs_unsharded(d: dict, yf: torch.Tensor, full: str = "full_y", tp: str = "tp_y",
                                check_tp_vs_tp1: bool = True) -> None:
    """The TP criterion on one rank's results `d` against `yf`, the float64 reference output (`float_reference`):
    the unsharded layer's output ``d[full]`` within 10 % of `yf` (relative L2 norm), the sharded ``d[tp]`` at most
    TP_VS_TP1_ACCURACY times the unsharded error and, with `check_tp_vs_tp1`, the two at most (1 +
    TP_VS_TP1_ACCURACY) times that error apart. Raises AssertionError with the norms (called by the tests in the
    parent, not by the workers)."""
    y1, y2 = d[full].double(), d[tp].double()
    e1, e2 = float((y1 - yf).norm()), float((y2 - yf).norm())
    assert e1 / float(yf.norm()) < 0.1, e1 / float(yf.norm())
    assert e2 <= TP_VS_TP1_ACCURACY * e1, (e1, e2)
    if check_tp_vs_tp1:
        e12 = float((y2 - y1).norm())
        assert e12 <= (1 + TP_VS_TP1_ACCURACY) * e1, (e12, e1)


def w13_rows(i: int, rank: int, world: int) -> torch.Tensor:
    """The rows of a full ``[E, 2I, H]`` w13 that rank ``rank`` keeps: its gate rows, then the same up rows."""
    part = i // world
    return torch.cat([torch.arange(rank * part, (rank + 1) * part),
                      torch.arange(i + rank * part, i + (rank + 1) * part)])


def _block_indivisible(rank, world):
    """Block-scaled fp8 experts with I = 384: shards of 192, not whole 128-row blocks."""
    cfg = cw.W8A8Config(dtype=torch.float8_e4m3fn, weight_block_size=(128, 128))
    full = cw.W8A8MoE.from_float(Experts(256, 384, 3, _device(rank)), cfg, top_k=TOP_K)
    return TensorParallelW8A8MoE.from_full(full, dist.group.WORLD)


def _mismatched(rank, world):
    full = cw.W8A8MoE.from_float(Experts(128, 256 if rank == 0 else 512, 3, _device(rank)), top_k=TOP_K)
    return shard_moe(full, dist.group.WORLD)


def _group_still_works(rank, world):
    t = torch.tensor([float(rank + 1)], device=_device(rank))
    dist.all_reduce(t)
    return float(t.item())


#: The ValueError (regex) each error scenario must raise on every rank.
MOE_ERRORS = {
    "block_indivisible": r"TensorParallelW8A8MoE: block-scaled fp8 experts \(128 x 128 blocks\) cannot be split over "
                         r"2 ranks: intermediate_size I = 384 gives shards of I / 2 = 192, not a multiple of 128",
    "mismatched": r"TensorParallelW8A8MoE: the ranks of the tensor-parallel group disagree on `intermediate_size` "
                  r"\(rank 0: 256, rank 1: 512\)",
}


def moe_cases(rank: int, world: int, names=tuple(CASES)) -> dict:
    """Every case of `CASES` (sharded vs full), then the error scenarios and a collective after them."""
    out = {n: _catch(_moe_one, rank, world, n) for n in names}
    errors = {n: _catch(globals()["_" + n], rank, world) for n in MOE_ERRORS}
    out["errors"] = {n: (v if v[0] == "error" else ("ok", None)) for n, v in errors.items()}
    out["group_still_works"] = _catch(_group_still_works, rank, world)
    return out


# ----------------------------------------------------------------------------------------------------
# a tiny transformers Qwen3-MoE model: quantize_(tp_group=...)


def _qwen3_moe_tp(rank, world, ids):
    from _moe_models import tiny_moe_model

    model = cw.quantize_(tiny_moe_model("qwen3_moe", seed=0), tp_group=dist.group.WORLD)
    with torch.no_grad():
        logits = model(ids).logits
    experts = [type(m).__name__ for m in model.modules() if isinstance(m, cw.W8A8MoE)]
    return _cpu(dict(logits=logits, experts=experts))


def hf_moe_cases(rank: int, world: int, ids: torch.Tensor) -> dict:
    return {"qwen3_moe": _catch(_qwen3_moe_tp, rank, world, ids)}


def cuda_moe_cases(rank: int, world: int) -> dict:
    """What tests/distributed/test_tp_moe_cuda.py checks, in one pair of NCCL processes (cuda:0, cuda:1)."""
    if not cw.cuda_ops_available():
        raise RuntimeError(f"the CUDA extension is not built: {cw.extension_status()}")
    if torch.cuda.get_device_capability(rank) != (9, 0):
        return {"skip": f"the grouped GEMM runs on sm90 only; cuda:{rank} is sm"
                        f"{''.join(map(str, torch.cuda.get_device_capability(rank)))}"}
    return moe_cases(rank, world)
