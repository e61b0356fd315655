"""MoE benchmark (issues 27 and 35): the grouped GEMM alone and the experts layer at Qwen3-30B-A3B and Mixtral-8x7B
dims, and the whole MoE block with its routing and shared expert at DeepSeek-V3 and GLM-4.5-Air dims.

Models (``--models``): ``qwen3-30b-a3b`` (E 128, top-8, H 2048, I 768) and ``mixtral-8x7b`` (E 8, top-2, H 4096,
I 14336), the defaults of the gemm and layer parts; ``deepseek-v3`` (E 256, top-8, H 7168, I 2048) and
``glm-4.5-air`` (E 128, top-8, H 4096, I 1408), the block part's (and usable by the other two). In the gemm and
layer parts, T = tokens, from 1 to 8192 (``--tokens``); rows = T * top_k; the routing of every token is k distinct
experts drawn uniformly at random (seeded), the rows sorted by expert, ``offsets`` = the cumulative counts (int32).

Part ``gemm`` (the grouped GEMM alone, on the w13 GEMM, N = 2I, K = H, and the w2 GEMM, N = H, K = I):

- ``ours_int8`` / ``ours_fp8``: ``cw.grouped_scaled_mm(a, w.transpose(1, 2), scale_a [rows, 1], scale_b [E, N],
  offsets, bf16)``, a int8 / e4m3 with per-token scales, weights per-channel;
- ``ours_block``: the same with block fp8 scales (scale_a [rows, K/128], scale_b [E, N/128, K/128]);
- ``torch_fp8``: torch's row-wise fp8 grouped GEMM, ``F.scaled_grouped_mm(a, w.transpose(1, 2), scale_a [rows],
  ScalingType.RowWise, scale_b [E, N], ScalingType.RowWise, offs=offsets, output_dtype=bf16)`` where torch has it,
  else ``torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=offsets, out_dtype=bf16)``; a point where it raises
  (e.g. CUBLAS_STATUS_NOT_SUPPORTED) is recorded as "did not run" with the message; torch's default accumulation
  (``use_fast_accum=False``), as bench_gemm.py's ``torch_fp8_rowwise``;
- ``torch_bf16``: ``torch._grouped_mm(x, w.transpose(1, 2), offs=offsets)`` in bfloat16.

- ``--grouped-configs LIST`` (issue 37; bench/_moe_configs.py): also the entries of the sm90 grouped int8, fp8 and
  block tables whose method names (``ours_int8[<entry>]`` / ``ours_fp8[<entry>]`` / ``ours_block[<entry>]``) contain
  one of LIST's substrings (``waves``: the wave-mainloop candidates of a ``CUTLASS_W8A8_TUNE=grouped`` build;
  ``ours_int8[``: every int8 entry), forced with ``_grouped_scaled_mm_config``, each checked against float64 as the
  others and bit for bit against its table's reference entry (int8 and block: the shipped ``*_Large`` entry; row-wise:
  CUTLASS's promoted 128x128 cooperative candidate; fast-accumulation entries, a different sum, are not compared:
  "n/a").

Reported per point: time (us), TOPS (2 * rows * N * K), the ratio torch_fp8 time / ours (> 1: ours faster) and, at
T <= 16, the active experts' weight bytes (experts with at least one row, N * K bytes each, plus their scales) /
time as a fraction of the read rate measured in the same run (``x.amax()`` over 1 GiB, at the start and the end:
the higher one). Before timing, every method's rows are checked against a float64 GEMM of the dequantized operands
(the first rows, up to 64): ours past `GEMM_REL_TOL` aborts the run.

Part ``layer`` (the whole experts module, the routing given as ``top_k_index`` / ``top_k_weights`` to all):

- ``ours_int8`` / ``ours_fp8`` / ``ours_block``: ``cw.W8A8MoE.from_float`` of the bf16 experts, called as
  ``layer(x, topk_ids, topk_weights)`` (align, permute + quantize, two grouped GEMMs, SiLU*mul + quantize,
  unpermute);
- ``hf_grouped_mm``: transformers' ``Qwen3MoeExperts`` (fused ``gate_up_proj`` / ``down_proj``; Mixtral's experts
  have the same layout) built from a ``Qwen3MoeConfig`` at those dims with random weights, with
  ``experts_implementation="grouped_mm"`` (torch._grouped_mm, capturable);
- ``hf_eager``: the same module with ``experts_implementation="eager"`` (a loop over the hit experts: it reads the
  routing back to the host, so it cannot be captured); timed with CUDA events around eager calls, host launches
  included, at T <= ``--eager-max-t`` only.

Part ``block`` (issue 35; bench/_moe_block.py says it in full): transformers' bf16 ``DeepseekV3MoE`` /
``Glm4MoeMoE`` (float32 router, grouped_mm experts, bf16 shared expert) against ours: the same float32 router
logits, ``moe_route`` (sigmoid, correction bias, grouped top-k, renormalized, scaled), the routed experts as a
`W8A8MoE` (int8, fp8, block fp8), and the shared expert either as W8A8Linear SwiGLU (``ours_<scheme>``) or as expert E
of the grouped GEMM (``ours_<scheme>_fused``); which placement is faster is reported per T. T 1 to 4096
(``--block-tokens``); each input set its own hidden states, so its own routing. Memory at DeepSeek-V3 dims: 22.5 GB of
bf16 experts plus 11.3 GB per scheme (the two placements share the routed experts), about 57 GB; fewer schemes with
``--block-schemes``.

Timing (`cutlass_w8a8.testing.timers.bench_gpu_time_interleaved`, as bench_gemm.py): CUDA-graph replays of R calls
over rotating input sets (each with its own routing, so the active experts change from call to call and the
weights are read cold), the methods of a point captured first and their replays interleaved; the median replay / R.
The layer's eager wall-clock time per call (host launches included: what an uncaptured step pays) is reported
beside its graph time for ours.

Targets (issue 27): grouped GEMM ours >= 1.0x torch_fp8 at every T >= 64 and geomean >= 1.2x (issue 37: fp8 and block >=
1.2x at every T >= 512); at T <= 16 the active weights streamed at >= 80% of the read rate; the MoE layer (ours vs
transformers' bf16 grouped_mm experts, graphs) >= 1.8x at T = 1 (Qwen3-30B-A3B dims) and >= 1.4x at T = 4096. Issue 35:
the MoE block at DeepSeek-V3 dims, routing included, ours_block (the checkpoints' block fp8) >= 2.5x transformers' bf16
block at T = 1 and >= 1.5x at T = 4096 (judged for both shared-expert placements).

Part ``decode`` (issue 36; bench/_moe_decode.py says it in full), only when ``--parts`` names it: the MoE layer at
T = 1 .. 16 with its routing (``moe_route`` on router logits), at Qwen3-30B-A3B, Mixtral-8x7B and DeepSeek-V3
(routed experts) dims, int8 / fp8 / block: the fused decode path (``moe_decode_experts``) against the unfused chain
(``fused_decode = False``) and transformers' bf16 experts, in CUDA graphs; per row the time, the active weights'
read fraction, the kernels per layer call (profiler) and fused / unfused; issue 36's targets (T = 1 at Qwen3 dims
<= 20 us on H200, <= 6 kernels, >= 80% of the read rate). Its report is ``moe_decode_<device>.{json,md,png}``.

Writes ``moe_<device>.json``, ``.md`` and ``.png`` to ``--out`` (the gemm, layer and block parts).

Examples::

    python bench/bench_moe.py --quick          # all three parts, fewer T and replays
    python bench/bench_moe.py                  # every T
    python bench/bench_moe.py --parts layer --models qwen3-30b-a3b --tokens 1,4096
    python bench/bench_moe.py --parts block --models deepseek-v3,glm-4.5-air --quick
    python bench/bench_moe.py --parts decode   # issue 36: fused vs unfused at T <= 16 (moe_decode_<device>.*)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Callable, Optional

import torch

from cutlass_w8a8.testing.cli import int_list, name_list
from cutlass_w8a8.testing.report import AccuracyError, provenance, publish, require_cuda_extension, run_checked

# bench/ is on sys.path (python bench/bench_moe.py): the helpers shared by the parts, and the derived numbers, targets
# and reports
from _moe_block import BLOCK_MODELS, SCHEMES, run_block
from _moe_common import checked_rel_err, rel_err, short_error, sync, time_cases, time_eager
from _moe_configs import (base_method, bit_identity, config_markdown, config_methods, reference_names, selected,
                          table_names)
from _moe_decode import (DECODE_MODELS, DECODE_SCHEMES, DECODE_TOKENS, QUICK_DECODE_TOKENS, derive_decode, plot_decode,
                         render_decode_markdown, run_decode)
from _moe_report import OURS_LAYER, derive, plot_results, render_markdown

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEVICE = "cuda"  # tests run the flow on the CPU (the ops' references) by setting this

# name -> (num_experts, top_k, hidden, intermediate, renormalize): the dims of the gemm and layer parts
MOE_MODELS = {"qwen3-30b-a3b": (128, 8, 2048, 768, True), "mixtral-8x7b": (8, 2, 4096, 14336, True),
              **{m: (b.experts, b.top_k, b.hidden, b.intermediate, b.renormalize) for m, b in BLOCK_MODELS.items()}}
MODELS = tuple(MOE_MODELS)  # the block part's models (BLOCK_MODELS) are among them
DEFAULT_MODELS = ("qwen3-30b-a3b", "mixtral-8x7b")  # of the gemm and layer parts; the block part: BLOCK_MODELS
PARTS = ("gemm", "layer", "block", "decode")
DEFAULT_PARTS = ("gemm", "layer", "block")  # decode: only when --parts names it (its own report)
DEFAULT_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
QUICK_TOKENS = (1, 16, 64, 512, 4096)
LAYER_TOKENS = (1, 4, 16, 64, 256, 1024, 4096, 8192)
QUICK_LAYER_TOKENS = (1, 16, 256, 4096)
BLOCK_TOKENS = (1, 4, 16, 64, 256, 1024, 4096)
QUICK_BLOCK_TOKENS = (1, 4096)
GEMM_METHODS = ("ours_int8", "ours_fp8", "ours_block", "torch_fp8", "torch_bf16")
LAYER_METHODS = ("ours_int8", "ours_fp8", "ours_block", "hf_grouped_mm", "hf_eager")
OPTIONAL = frozenset({"ours_block", "torch_fp8", "torch_bf16", "hf_grouped_mm", "hf_eager"})
LAYER_SETS = 8  # rotating input sets (routings) of a layer point
GEMM_REL_TOL = 2e-2      # ours vs float64 of the dequantized operands (bf16 output rounding, fp8 accumulation)
LAYER_REL_TOL = 1.5e-1   # ours vs transformers' bf16 experts (8-bit quantization of weights and activations)
# ours vs transformers' bf16 block: the same routing (checked), so a weighted sum of expert outputs with the layer's
# error each, plus the shared expert's (independent errors: the sum's relative error is at most the largest one's)
BLOCK_REL_TOL = LAYER_REL_TOL



# ----------------------------------------------------------------------------------------------------
# command line


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="MoE grouped GEMM (ours int8 / fp8 / block fp8 vs torch's fp8 scaled_grouped_mm and bf16 "
                    "_grouped_mm), the experts layer (W8A8MoE vs transformers' bf16 experts) at Qwen3-30B-A3B and "
                    "Mixtral-8x7B dims, and the whole MoE block with its routing and shared expert (ours vs "
                    "transformers' bf16 block) at DeepSeek-V3 and GLM-4.5-Air dims; cold-L2 CUDA-graph timing.")
    parser.add_argument("--models", type=name_list(MODELS, ordered=True), default=None, metavar="LIST",
                        help=f"comma-separated among {','.join(MODELS)}; each part runs those it has (the block "
                             f"part: {','.join(BLOCK_MODELS)}). Default: {','.join(DEFAULT_MODELS)} for the gemm "
                             f"and layer parts, {','.join(BLOCK_MODELS)} for the block part")
    parser.add_argument("--parts", type=name_list(PARTS, ordered=True), default=None, metavar="LIST",
                        help="gemm (the grouped GEMM alone), layer (the experts layer, routing given), block (the "
                             "whole MoE block, routing and shared expert included), decode (issue 36: the layer at "
                             "T <= 16 with its routing, fused decode path vs unfused, own report moe_decode_<device>); "
                             "default gemm,layer,block (block left out when --models names none of its models)")
    parser.add_argument("--tokens", type=int_list(), default=None, metavar="LIST",
                        help=f"tokens T of the GEMM part (default {','.join(map(str, DEFAULT_TOKENS))}; --quick "
                             f"{','.join(map(str, QUICK_TOKENS))})")
    parser.add_argument("--layer-tokens", type=int_list(), default=None, metavar="LIST",
                        help=f"tokens T of the layer part (default {','.join(map(str, LAYER_TOKENS))}; --quick "
                             f"{','.join(map(str, QUICK_LAYER_TOKENS))})")
    parser.add_argument("--block-tokens", type=int_list(), default=None, metavar="LIST",
                        help=f"tokens T of the block part (default {','.join(map(str, BLOCK_TOKENS))}; --quick "
                             f"{','.join(map(str, QUICK_BLOCK_TOKENS))})")
    parser.add_argument("--decode-tokens", type=int_list(), default=None, metavar="LIST",
                        help=f"tokens T of the decode part (default {','.join(map(str, DECODE_TOKENS))}; --quick "
                             f"{','.join(map(str, QUICK_DECODE_TOKENS))})")
    parser.add_argument("--decode-schemes", type=name_list(DECODE_SCHEMES, ordered=True), default=list(DECODE_SCHEMES),
                        metavar="LIST", help=f"schemes of the decode part (default {','.join(DECODE_SCHEMES)})")
    parser.add_argument("--block-schemes", type=name_list(SCHEMES, ordered=True), default=list(SCHEMES),
                        metavar="LIST", help=f"our schemes in the block part, among {','.join(SCHEMES)} (default all; "
                        "each holds its own 8-bit experts: 11.3 GB at DeepSeek-V3 dims)")
    parser.add_argument("--grouped-configs", type=lambda s: [x for x in s.split(",") if x], default=None,
                        metavar="LIST", help="gemm part (issue 37): also time the entries of the sm90 grouped int8, fp8 "
                        "and block tables whose method names (ours_int8[<entry>], ...) contain one of these substrings "
                        "(e.g. waves, or ours_int8[ for every int8 entry; the tuning candidates "
                        "need a CUTLASS_W8A8_TUNE=grouped build), forced with _grouped_scaled_mm_config, with each "
                        "table's bit reference (bench/_moe_configs.py)")
    parser.add_argument("--quick", action="store_true", help="fewer T and replays")
    parser.add_argument("--eager-max-t", type=int, default=256,
                        help="eager timings at T <= this (default 256; 0: never): transformers' eager experts (not "
                             "capturable) and our layer; in the block part transformers' block and ours_block")
    parser.add_argument("--replays", type=int, default=None, help="timed replays per point (default 20; 10 quick)")
    parser.add_argument("--eager-steps", type=int, default=None,
                        help="timed eager calls per layer point (default 20; 10 quick)")
    parser.add_argument("--replay-ms", type=float, default=None,
                        help="target duration of one replay in ms (default 1.0; 0.5 quick)")
    parser.add_argument("--rotate-gb", type=float, default=2.0,
                        help="memory cap in GiB for the rotating activation copies of one point")
    parser.add_argument("--out", default=os.path.join(REPO_ROOT, "bench", "results"), metavar="DIR",
                        help="output folder for moe_<device>.{json,md,png} (default: bench/results)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the routings")
    args = parser.parse_args(argv)
    args.tokens = sorted(set(args.tokens or (QUICK_TOKENS if args.quick else DEFAULT_TOKENS)))
    args.layer_tokens = sorted(set(args.layer_tokens or (QUICK_LAYER_TOKENS if args.quick else LAYER_TOKENS)))
    args.block_tokens = sorted(set(args.block_tokens or (QUICK_BLOCK_TOKENS if args.quick else BLOCK_TOKENS)))
    given = args.models
    args.models = list(given or DEFAULT_MODELS)  # the gemm and layer parts'
    args.block_models = [m for m in (given or BLOCK_MODELS) if m in BLOCK_MODELS]
    args.decode_models = [m for m in (given or DECODE_MODELS) if m in DECODE_MODELS]
    args.decode_tokens = sorted(set(args.decode_tokens or (QUICK_DECODE_TOKENS if args.quick else DECODE_TOKENS)))
    if args.parts is None:
        args.parts = [p for p in DEFAULT_PARTS if p != "block" or args.block_models]
    elif "decode" in args.parts and not args.decode_models:
        parser.error(f"--parts decode: --models must name one of {','.join(DECODE_MODELS)}")
    elif "block" in args.parts and not args.block_models:
        parser.error(f"--parts block: --models must name one of {','.join(BLOCK_MODELS)}")
    args.replays = args.replays if args.replays is not None else (10 if args.quick else 20)
    args.eager_steps = args.eager_steps if args.eager_steps is not None else (10 if args.quick else 20)
    args.replay_ms = args.replay_ms if args.replay_ms is not None else (0.5 if args.quick else 1.0)
    if args.replays < 1 or args.eager_steps < 1 or args.replay_ms <= 0 or args.eager_max_t < 0:
        parser.error("--replays and --eager-steps must be >= 1, --replay-ms > 0 and --eager-max-t >= 0")
    return args


# ----------------------------------------------------------------------------------------------------
# operands


def random_routing(tokens: int, num_experts: int, top_k: int, gen: torch.Generator) -> torch.Tensor:
    """``(tokens, top_k)`` int64 expert ids, each row ``top_k`` distinct experts uniformly at random (CPU)."""
    return torch.rand(tokens, num_experts, generator=gen).argsort(dim=1)[:, :top_k]


def routing_offsets(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int32 ``[E]`` end rows of each expert's group of the pairs sorted by expert (CPU)."""
    return torch.bincount(ids.reshape(-1), minlength=num_experts).cumsum(0).to(torch.int32)


def _sync() -> None:
    sync(DEVICE)


def _quant_rows(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric quantization of float ``x`` ``(R, C)``: ``(q, scale (R, 1) float32)``."""
    qmax = 127.0 if dtype == torch.int8 else 448.0
    scale = (x.abs().amax(dim=1, keepdim=True).float() / qmax).clamp_min(1e-12)
    q = (x.float() / scale)
    q = q.round().clamp(-127, 127).to(dtype) if dtype == torch.int8 else q.clamp(-448, 448).to(dtype)
    return q, scale


def _quant_blocks(w: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 per (rows x cols) block of ``w`` ``(E, N, K)``: ``(q, scale (E, ceil(N/rows), K/cols))``."""
    e, n, k = w.shape
    nb = -(-n // rows)
    pad = torch.zeros(e, nb * rows, k, dtype=w.dtype, device=w.device)
    pad[:, :n] = w
    blocks = pad.view(e, nb, rows, k // cols, cols)
    scale = (blocks.abs().amax(dim=(2, 4)).float() / 448.0).clamp_min(1e-12)
    q = (blocks.float() / scale[:, :, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q.view(e, nb * rows, k)[:, :n].contiguous(), scale


class GemmWeights:
    """One GEMM's weights (``(E, N, K)`` bf16 random, std 0.02, from the CUDA generator ``gen``) and their int8 /
    e4m3 per-channel and block forms."""

    def __init__(self, e: int, n: int, k: int, gen: torch.Generator):
        self.e, self.n, self.k = e, n, k
        self.w_bf16 = (torch.randn(e, n, k, generator=gen, device=DEVICE) * 0.02).to(torch.bfloat16)
        flat = self.w_bf16.view(e * n, k)
        q8, s8 = _quant_rows(flat, torch.int8)
        qf, sf = _quant_rows(flat, torch.float8_e4m3fn)
        self.w_int8, self.s_int8 = q8.view(e, n, k), s8.view(e, n)
        self.w_fp8, self.s_fp8 = qf.view(e, n, k), sf.view(e, n)
        self.w_block, self.s_block = _quant_blocks(self.w_bf16, 128, 128)


def gemm_activations(rows: int, k: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Activations of one point (CUDA generator ``gen``): bf16 ``x`` and its int8 / e4m3 per-token and e4m3
    1x128-group forms."""
    x = torch.randn(rows, k, generator=gen, device=DEVICE).to(torch.bfloat16)
    a8, sa8 = _quant_rows(x, torch.int8)
    af, saf = _quant_rows(x, torch.float8_e4m3fn)
    g = x.view(rows, k // 128, 128).float()
    sab = (g.abs().amax(dim=2) / 448.0).clamp_min(1e-12)
    ab = (g / sab[:, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(rows, k)
    return {"x": x, "a_int8": a8, "sa_int8": sa8, "a_fp8": af, "sa_fp8": saf, "a_block": ab, "sa_block": sab}


def torch_fp8_grouped() -> tuple[Optional[Callable], str]:
    """torch's row-wise fp8 grouped GEMM as ``fn(a, b, scale_a [R], scale_b [E, N], offs) -> bf16``, and its name."""
    F = torch.nn.functional
    private = getattr(torch, "_scaled_grouped_mm", None)

    def private_fn(a, b, sa, sb, offs):
        return private(a, b, sa, sb, offs=offs, out_dtype=torch.bfloat16)

    rw = getattr(getattr(F, "ScalingType", None), "RowWise", None)
    if hasattr(F, "scaled_grouped_mm") and rw is not None:
        state = {"public": True}

        def fn(a, b, sa, sb, offs):
            if state["public"]:
                try:
                    return F.scaled_grouped_mm(a, b, sa, rw, sb, rw, offs=offs, output_dtype=torch.bfloat16)
                except TypeError:  # another signature in this torch: the private op from now on
                    if private is None:
                        raise
                    state["public"] = False
            return private_fn(a, b, sa, sb, offs)
        return fn, "F.scaled_grouped_mm(RowWise) (torch._scaled_grouped_mm if its signature differs)"
    if private is not None:
        return private_fn, "torch._scaled_grouped_mm"
    return None, "torch has no fp8 grouped GEMM"


def gemm_methods(cw: Any, wts: GemmWeights, torch_fp8: Optional[Callable]) -> dict[str, Callable]:
    """``name -> fn(act, offs)``: each method as a function of one rotating input set (`gemm_activations`, the
    offsets on the device)."""
    gsm = cw.grouped_scaled_mm
    bf16 = torch.bfloat16
    b8, bf, bb, bw = (w.transpose(1, 2) for w in (wts.w_int8, wts.w_fp8, wts.w_block, wts.w_bf16))
    m = {
        "ours_int8": lambda a, o: gsm(a["a_int8"], b8, a["sa_int8"], wts.s_int8, o, bf16),
        "ours_fp8": lambda a, o: gsm(a["a_fp8"], bf, a["sa_fp8"], wts.s_fp8, o, bf16),
        "ours_block": lambda a, o: gsm(a["a_block"], bb, a["sa_block"], wts.s_block, o, bf16),
        "torch_bf16": lambda a, o: torch._grouped_mm(a["x"], bw, offs=o),
    }
    if torch_fp8 is not None:
        m["torch_fp8"] = lambda a, o: torch_fp8(a["a_fp8"], bf, a["sa_fp8"].view(-1), wts.s_fp8, o)
    return m


def gemm_reference(wts: GemmWeights, act: dict, offs_cpu: torch.Tensor, method: str, rows: int) -> torch.Tensor:
    """float64 ``(rows, N)`` of the first ``rows`` rows of ``method``'s dequantized operands."""
    ends = offs_cpu.tolist()
    out = torch.empty(rows, wts.n, dtype=torch.float64, device=DEVICE)
    start = 0
    for e, end in enumerate(ends):
        lo, hi = start, min(end, rows)
        start = end
        if hi <= lo:
            continue
        if method in ("ours_int8", "ours_fp8", "torch_fp8"):
            kind = "int8" if method == "ours_int8" else "fp8"
            a = act[f"a_{kind}"][lo:hi].double() * act[f"sa_{kind}"][lo:hi].double()
            w = getattr(wts, f"w_{kind}")[e].double() * getattr(wts, f"s_{kind}")[e].double()[:, None]
        elif method == "ours_block":
            a = act["a_block"][lo:hi].double() * act["sa_block"][lo:hi].double().repeat_interleave(128, 1)
            s = wts.s_block[e].double().repeat_interleave(128, 0)[:wts.n].repeat_interleave(128, 1)
            w = wts.w_block[e].double() * s
        else:
            a, w = act["x"][lo:hi].double(), wts.w_bf16[e].double()
        out[lo:hi] = a @ w.t()
        if end >= rows:
            break
    return out


def active_weight_bytes(wts: GemmWeights, offs_cpu: torch.Tensor, method: str) -> int:
    """Bytes of the weights (and scales) of the experts with at least one row."""
    counts = torch.diff(offs_cpu.long(), prepend=torch.zeros(1, dtype=torch.long))
    active = int((counts > 0).sum())
    per = wts.n * wts.k * (2 if method == "torch_bf16" else 1)
    if method == "ours_block":
        per += wts.s_block[0].numel() * 4
    elif method != "torch_bf16":
        per += wts.n * 4
    return active * per


def copies_for(set_bytes: int, bu: Any, args: argparse.Namespace, l2_bytes: int) -> int:
    """Rotating input sets of a point: enough that their active weights and activations exceed twice the L2 (at
    least 4 routings, at most 32), within ``--rotate-gb`` (but never fewer than 2 routings)."""
    return max(2, min(bu.rotation_count(set_bytes, l2_bytes, int(args.rotate_gb * 2**30), 4), 32))


def measure_gemm_point(model: str, gemm: str, t: int, wts: GemmWeights, top_k: int, args: argparse.Namespace,
                       cw: Any, bu: Any, l2_bytes: int, torch_fp8: Optional[Callable], gen: torch.Generator,
                       cgen: torch.Generator, entries: Optional[dict] = None,
                       refs: Optional[dict] = None) -> dict:
    """Check and time one (model, GEMM, T) point over rotating input sets, each with its own routing (``gen``, CPU)
    and activations (``cgen``, CUDA); times in ms per call. ``entries``: forced grouped-table entries timed too
    (bench/_moe_configs.py `selected`), their outputs compared bit for bit with their table's reference entry
    (``refs``: `reference_names`)."""
    rows = t * top_k
    sets, offs_list = [], []
    first = None
    n_sets = None
    while n_sets is None or len(sets) < n_sets:
        ids = random_routing(t, wts.e, top_k, gen)
        offs_cpu = routing_offsets(ids, wts.e)
        act = gemm_activations(rows, wts.k, cgen)
        sets.append((act, offs_cpu.to(DEVICE)))
        offs_list.append(offs_cpu)
        if n_sets is None:
            first = offs_cpu
            set_bytes = active_weight_bytes(wts, offs_cpu, "ours_fp8") + sum(v.numel() * v.element_size()
                                                                             for v in act.values())
            n_sets = copies_for(set_bytes, bu, args, l2_bytes)
    methods = gemm_methods(cw, wts, torch_fp8)
    if entries:
        methods.update(config_methods(cw, wts, entries))
    forced_outs: dict[str, torch.Tensor] = {}
    errors: dict[str, str] = {}
    if torch_fp8 is None:
        errors["torch_fp8"] = "torch has no fp8 grouped GEMM"
    accuracy: dict[str, float] = {}
    check_rows = min(rows, 64)
    for name, fn in list(methods.items()):
        try:
            out = fn(*sets[0])
            _sync()
        except Exception as exc:  # noqa: BLE001 (torch's unsupported cases are results)
            if name not in OPTIONAL:
                raise
            errors[name] = short_error(exc)
            del methods[name]
            continue
        err = rel_err(out[:check_rows], gemm_reference(wts, sets[0][0], first, base_method(name), check_rows))
        accuracy[name] = err
        if name != base_method(name):
            forced_outs[name] = out
        if name.startswith("ours") and not err < GEMM_REL_TOL:
            raise AccuracyError(f"{model} {gemm} T={t}: {name} relative error {err:.3g} vs float64 "
                                f"(bound {GEMM_REL_TOL:g})")
    cases = {name: (fn, sets) for name, fn in methods.items()}
    timings = time_cases(cases, errors, bu, args, OPTIONAL)
    times = {name: tm.median_ms for name, tm in timings.items()}
    active = {name: active_weight_bytes(wts, first, name) for name in GEMM_METHODS}
    # the active bytes of the timed calls: the mean over the rotating sets
    active_mean = {name: statistics.mean(active_weight_bytes(wts, o, base_method(name)) for o in offs_list)
                   for name in times}
    configs = ({"bit_identical": bit_identity(forced_outs, int(first[-1]), refs or {}), "references": refs}
               if forced_outs else None)
    del cases, methods, sets, forced_outs
    return {"configs": configs, "model": model, "gemm": gemm, "T": t, "rows": rows, "N": wts.n, "K": wts.k, "E": wts.e,
            "time_ms": times, "errors": errors, "rel_err_vs_fp64": accuracy,
            "active_experts": int((torch.diff(first.long(), prepend=torch.zeros(1, dtype=torch.long)) > 0).sum()),
            "active_weight_bytes": active, "active_weight_bytes_mean": active_mean,
            "timing": {name: {"calls_per_replay": tm.calls_per_replay, "copies": tm.copies, "min_ms": tm.min_ms,
                              "max_ms": tm.max_ms} for name, tm in timings.items()}}


def run_gemm(args: argparse.Namespace, cw: Any, bu: Any, results: dict) -> None:
    l2_bytes = bu.l2_cache_bytes()
    torch_fp8, results["torch_fp8_api"] = torch_fp8_grouped()
    gen = torch.Generator().manual_seed(args.seed)
    cgen = torch.Generator(device=DEVICE).manual_seed(args.seed)
    names = table_names(cw) if args.grouped_configs else None
    entries = selected(names, args.grouped_configs) if names else None
    refs = reference_names(names) if names else None
    if entries:
        results["grouped_configs"] = {family: [name for _, name in items] for family, items in entries.items()}
    for model in args.models:
        e, k_top, h, inter, _ = MOE_MODELS[model]
        for gemm, (n, k) in (("w13", (2 * inter, h)), ("w2", (h, inter))):
            wts = GemmWeights(e, n, k, cgen)
            for t in args.tokens:
                p = measure_gemm_point(model, gemm, t, wts, k_top, args, cw, bu, l2_bytes, torch_fp8, gen, cgen,
                                       entries, refs)
                results["gemm_points"].append(p)
                tm = p["time_ms"]
                print(f"  gemm {model} {gemm} T={t}: " + ", ".join(f"{m} {tm[m] * 1e3:.1f} us" for m in tm)
                      + ("" if not p["errors"] else f" (did not run: {', '.join(p['errors'])})")
                      + ("" if not p["configs"] else " bit-identical to the reference: "
                         + ", ".join(f"{m} {v}" for m, v in p["configs"]["bit_identical"].items())), flush=True)
            del wts
            torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------------
# the layer


def hf_experts(e: int, top_k: int, h: int, inter: int, implementation: str, gen: torch.Generator,
               weights: Optional[torch.nn.Module] = None) -> torch.nn.Module:
    """transformers' Qwen3MoeExperts at these dims, bf16 on the GPU, ``experts_implementation`` as given; random
    weights (std 0.02, CUDA generator ``gen``) or ``weights``' parameters shared."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = Qwen3MoeConfig(hidden_size=h, moe_intermediate_size=inter, num_experts=e, num_experts_per_tok=top_k,
                         norm_topk_prob=True, hidden_act="silu")
    cfg._experts_implementation = implementation
    with torch.device("meta"):
        mod = Qwen3MoeExperts(cfg)
    if weights is not None:
        mod.gate_up_proj, mod.down_proj = weights.gate_up_proj, weights.down_proj
        return mod.requires_grad_(False)
    mod = mod.to(torch.bfloat16).to_empty(device=DEVICE)  # bf16 on the device directly (no float32 copy)
    with torch.no_grad():
        for p in (mod.gate_up_proj, mod.down_proj):
            p.normal_(0.0, 0.02, generator=gen)
    return mod.requires_grad_(False)


def measure_layer_point(model: str, t: int, layers: dict, top_k: int, e: int, h: int, args: argparse.Namespace,
                        bu: Any, l2_bytes: int, gen: torch.Generator, cgen: torch.Generator) -> dict:
    """Check (ours vs transformers' bf16 experts) and time one (model, T) layer point over `LAYER_SETS` rotating
    input sets, each with its own routing; ms per call."""
    sets = []
    for _ in range(LAYER_SETS):
        ids = random_routing(t, e, top_k, gen).to(DEVICE)
        w = torch.rand(t, top_k, generator=gen)
        # bf16 routing weights, as transformers' router hands them to its experts
        w = (w / w.sum(1, keepdim=True)).to(torch.bfloat16).to(DEVICE)
        x = torch.randn(t, h, generator=cgen, device=DEVICE).to(torch.bfloat16)
        sets.append((x, ids, w))
    errors: dict[str, str] = {}
    accuracy: dict[str, float] = {}
    ref = None
    if "hf_grouped_mm" in layers:
        try:
            ref = layers["hf_grouped_mm"](*sets[0]).float()
        except Exception as exc:  # noqa: BLE001
            errors["hf_grouped_mm"] = short_error(exc)
    cases = {}
    for name, mod in layers.items():
        if name == "hf_eager" or name in errors:
            continue
        fn = (lambda x, i, w, mod=mod: mod(x, i, w))
        try:
            out = fn(*sets[0])
            _sync()
        except Exception as exc:  # noqa: BLE001
            if name not in OPTIONAL:
                raise
            errors[name] = short_error(exc)
            continue
        if ref is not None and name != "hf_grouped_mm":
            accuracy[name] = checked_rel_err(out, ref, LAYER_REL_TOL, f"{model} layer T={t}: {name}",
                                             "transformers' bf16 experts")
        cases[name] = (fn, sets)
    timings = time_cases(cases, errors, bu, args, OPTIONAL)
    times = {name: tm.median_ms for name, tm in timings.items()}
    # eager calls (host launches included) of every method that ran eagerly: ours, and transformers' grouped_mm
    # (also where its capture failed)
    eager_fns = {name: (lambda mod=layers[name], s=sets[0]: mod(*s)) for name in (*OURS_LAYER, "hf_grouped_mm")
                 if name in cases}
    if "hf_eager" in layers and t <= args.eager_max_t:
        eager_fns["hf_eager"] = lambda mod=layers["hf_eager"], s=sets[0]: mod(*s)
    eager = {}
    try:
        eager = time_eager(eager_fns, steps=args.eager_steps, warmup=min(3, args.eager_steps), device=DEVICE)
    except Exception as exc:  # noqa: BLE001
        errors["eager"] = short_error(exc)
    if "hf_eager" in eager:
        times["hf_eager"] = eager["hf_eager"]["median_ms"]
    return {"model": model, "T": t, "time_ms": times, "eager_ms": {n: v["median_ms"] for n, v in eager.items()},
            "eager_host_ms": {n: v["host_ms"] for n, v in eager.items()}, "errors": errors,
            "rel_err_vs_hf_bf16": accuracy}


def run_layer(args: argparse.Namespace, cw: Any, bu: Any, results: dict) -> None:
    l2_bytes = bu.l2_cache_bytes()
    gen = torch.Generator().manual_seed(args.seed + 1)
    cgen = torch.Generator(device=DEVICE).manual_seed(args.seed + 1)
    try:
        import transformers
        results["transformers_version"] = transformers.__version__
    except ImportError as exc:
        results["layer_note"] = f"transformers not importable ({exc}): no transformers baseline"
    for model in args.models:
        e, top_k, h, inter, renorm = MOE_MODELS[model]
        layers: dict[str, torch.nn.Module] = {}
        try:
            base = hf_experts(e, top_k, h, inter, "grouped_mm", cgen)
            layers["hf_grouped_mm"] = base
            layers["hf_eager"] = hf_experts(e, top_k, h, inter, "eager", gen, weights=base)
        except Exception as exc:  # noqa: BLE001 (no transformers, or its API moved: ours still runs)
            results.setdefault("layer_errors", {})[model] = short_error(exc)
            base = torch.nn.Module()
            base.gate_up_proj = torch.nn.Parameter((torch.randn(e, 2 * inter, h, generator=cgen, device=DEVICE)
                                                    * 0.02).to(torch.bfloat16), requires_grad=False)
            base.down_proj = torch.nn.Parameter((torch.randn(e, h, inter, generator=cgen, device=DEVICE)
                                                 * 0.02).to(torch.bfloat16), requires_grad=False)
        configs = {"ours_int8": cw.W8A8Config(dtype=torch.int8),
                   "ours_fp8": cw.W8A8Config(dtype=torch.float8_e4m3fn),
                   "ours_block": cw.W8A8Config(dtype=torch.float8_e4m3fn, weight_block_size=(128, 128))}
        built = {}
        for name, cfg in configs.items():
            try:
                built[name] = cw.W8A8MoE.from_float(base, cfg, top_k, renorm)
            except Exception as exc:  # noqa: BLE001
                if name not in OPTIONAL:
                    raise
                results.setdefault("layer_errors", {})[f"{model} {name}"] = short_error(exc)
        layers = {**built, **layers}
        for t in args.layer_tokens:
            p = measure_layer_point(model, t, layers, top_k, e, h, args, bu, l2_bytes, gen, cgen)
            results["layer_points"].append(p)
            tm = p["time_ms"]
            print(f"  layer {model} T={t}: " + ", ".join(f"{m} {tm[m] * 1e3:.1f} us" for m in tm)
                  + ("" if not p["errors"] else f" (did not run: {', '.join(p['errors'])})"), flush=True)
        del layers, built, base
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------------
# main


def run(args: argparse.Namespace, cw: Any, bu: Any) -> dict[str, Any]:
    name = torch.cuda.get_device_name()
    results: dict[str, Any] = {
        **provenance(name, REPO_ROOT),
        "read_GBps": bu.read_bandwidth_gbps(),
        "models": {m: dict(zip(("E", "top_k", "H", "I", "renormalize"), MOE_MODELS[m])) for m in args.models
                   if {"gemm", "layer"} & set(args.parts)},
        "parts": args.parts, "tokens": args.tokens, "layer_tokens": args.layer_tokens,
        "block_tokens": args.block_tokens, "block_schemes": args.block_schemes,
        "timing": {"method": "CUDA-graph replay over rotating input sets (own routing each), methods interleaved, "
                             "median replay / calls", "replays": args.replays, "replay_ms": args.replay_ms},
        "tolerances": {"gemm_rel_vs_fp64": GEMM_REL_TOL, "layer_rel_vs_hf_bf16": LAYER_REL_TOL,
                       "block_rel_vs_hf_bf16": BLOCK_REL_TOL},
        "gemm_points": [], "layer_points": [], "block_points": [],
    }
    if "decode" in args.parts:
        results["decode"] = run_decode_part(args, cw, bu, name)
    if "gemm" in args.parts:
        run_gemm(args, cw, bu, results)
    if "layer" in args.parts:
        run_layer(args, cw, bu, results)
    if "block" in args.parts:
        run_block(args, cw, bu, results, DEVICE, BLOCK_REL_TOL)
    results["read_GBps_end"] = bu.read_bandwidth_gbps()
    results["read_GBps_max"] = max(results["read_GBps"], results["read_GBps_end"])
    derive(results, bu.geomean)
    return results


def run_decode_part(args: argparse.Namespace, cw: Any, bu: Any, name: str) -> dict[str, Any]:
    """The decode part's own results dict (its report is ``moe_decode_<device>``), with its targets."""
    dec: dict[str, Any] = {
        **provenance(name, REPO_ROOT),
        "read_GBps": bu.read_bandwidth_gbps(),
        "models": {m: dict(zip(("E", "top_k", "H", "I", "renormalize"), MOE_MODELS[m])) for m in args.decode_models},
        "decode_tokens": args.decode_tokens, "decode_schemes": args.decode_schemes,
        "timing": {"method": "CUDA-graph replay over rotating input sets (own routing each), methods interleaved, "
                             "median replay / calls", "replays": args.replays, "replay_ms": args.replay_ms},
        "tolerances": {"layer_rel_vs_hf_bf16": LAYER_REL_TOL, "fused_vs_unfused": "bit for bit"},
        "decode_points": [],
    }
    try:
        import transformers
        dec["transformers_version"] = transformers.__version__
    except ImportError:
        pass
    run_decode(args, cw, bu, dec, DEVICE, MOE_MODELS, hf_experts, LAYER_REL_TOL)
    dec["read_GBps_end"] = bu.read_bandwidth_gbps()
    dec["read_GBps_max"] = max(dec["read_GBps"], dec["read_GBps_end"])
    derive_decode(dec, args.decode_schemes)
    return dec


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    cw = require_cuda_extension("bench_moe.py")
    from cutlass_w8a8.testing import timers as bu
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    with torch.no_grad():
        results = run_checked("bench_moe.py", run, args, cw, bu)
    results["total_seconds"] = time.perf_counter() - t0
    decode = results.pop("decode", None)
    if set(args.parts) - {"decode"}:
        markdown = "\n".join([render_markdown(results), *config_markdown(results["gemm_points"])])
        publish(results, markdown, args.out, "moe", plot_results)
    if decode is not None:
        publish(decode, render_decode_markdown(decode), args.out, "moe_decode", plot_decode)
    return 0


if __name__ == "__main__":
    sys.exit(main())
