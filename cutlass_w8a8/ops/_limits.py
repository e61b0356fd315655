"""Every size limit and dtype set of the ops' argument contracts, for the CPU and fake implementations.

csrc/core/limits.hpp holds the same numbers for the CUDA checks (kInt8MaxK, kGemmAlign, ...);
tests/ops/test_limits.py pins the two equal. The checks in `_checks.py` use these names, never literals.
"""

from __future__ import annotations

import torch

# int8 products are at most 128 * 128 = 2**14 in magnitude, so an int32 sum of K of them cannot overflow
# while K * 2**14 <= 2**31 - 1, i.e. K <= 131071; the largest multiple of 16 below that is 131056.
INT8_MAX_K = (2**31 - 1) // (128 * 128) // 16 * 16
# GEMM K and N: positive multiples of this many elements (16-byte TMA / cp.async rows of 8-bit operands).
GEMM_ALIGN = 16
# GEMM M (rows of `a`): below 2**31 (32-bit grid and row indices).
MAX_M = 2**31
# Row-wise ops (quantize, rms_norm, silu_mul): at most 2**31 - 1 rows (blocks of gridDim.x), K below 2**31.
MAX_ROWS = 2**31 - 1
MAX_ROW_K = 2**31
# Decode GEMMs (scaled_mm_decode, linear_decode): M in [1, 16] (two mma token tiles of 8), K <= 2**30
# (32-bit K byte offsets).
DECODE_MAX_M = 16
DECODE_MAX_K = 2**30
# add_rms_norm_linear_decode: K <= 8192, the rows rms_norm's one-block register kernel serves (256 threads, at most
# 4 vectors of 8 each): the order of its sum of squares, which the fused decode GEMM repeats.
NORM_DECODE_MAX_K = 8192
# decode_attention: head dim D a multiple of 8 in [8, 256]; S (cache positions) below 2**30 (the kernels' int
# position arithmetic, csrc/core/limits.hpp); H at most
# 65535 (query heads are gridDim.y).
ATTN_MAX_HEAD_DIM = 256
ATTN_HEAD_DIM_MULTIPLE = 8
ATTN_MAX_SEQ = 2**30
ATTN_MAX_HEADS = 65535

# MoE routing (moe_topk_softmax, moe_align): at most this many experts (a router row is one warp's shared-memory
# slice; moe_align's per-expert counts live in one block's shared memory).
MOE_MAX_EXPERTS = 1024
# moe_route's grouped top-k: at most this many expert groups (one warp lane scores one group).
MOE_MAX_GROUPS = 32
# moe_decode_experts (the fused decode path of a MoE layer): at most this many (token, expert) pairs T * top_k
# (a decode step at batch 8 with top-8; each CTA keeps the pairs' expert ids in shared memory).
MOE_DECODE_MAX_PAIRS = 64
# moe_router_route (the router GEMM and the routing in one kernel, csrc/moe/router_route.cu): at most this many
# tokens T (two 8-token mma tiles; each CTA of the cluster holds ceil(T / 8) tokens' logits). THE ONE PLACE the
# decode rule's limit is decided too: W8A8MoE (moe/layer.py `router_route_applies`) takes the fused op at
# 1 <= T <= it and the router GEMM + moe_route above.
MOE_ROUTER_ROUTE_MAX_T = 16
# moe_router_route: H a positive multiple of this many elements (one warp step: 4 lanes x 16 elements).
MOE_ROUTER_H_MULTIPLE = 64
# moe_router_route's speed rule (W8A8MoE.router_route_pays): the fused kernel serves a router of at least
# MOE_ROUTER_ROUTE_MIN_EXPERTS experts whose weight is at most MOE_ROUTER_ROUTE_MAX_WEIGHT_BYTES: the range measured,
# Mixtral-8x7B's 8 x 4096 to Kimi-K2's 384 x 7168 bf16 (5.25 MiB); outside it the two ops, unmeasured. On an H200
# against F.linear + moe_route in CUDA graphs (bench/results/moe_router_nvidia-h200.md, 2026-11-29, after the
# (16-expert tile, H slice) units and the 16-CTA cluster for routers of 1 MiB or more), T = 1 / 8: Qwen3-30B-A3B
# 1.50x / 1.48x, OLMoE 1.55x / 1.50x, Mixtral 1.86x / 1.76x, GLM-4.5 1.85x / 2.97x, DeepSeek-V3 1.55x / 2.19x,
# Kimi-K2 1.47x / 2.12x (before those units: DeepSeek-V3 0.90x and Mixtral 1.00x at T = 1, so the rule stopped at
# 512 KiB and 64 experts).
MOE_ROUTER_ROUTE_MIN_EXPERTS = 8
MOE_ROUTER_ROUTE_MAX_WEIGHT_BYTES = 6 * 1024 * 1024

# Block-scaled fp8 (DeepSeek-V3 / compressed-tensors FP8_BLOCK): activations in 1 x BLOCK_SIZE groups along K,
# weights in BLOCK_SIZE x BLOCK_SIZE blocks; the GEMM's K must be a multiple of it, and so is the only group size
# quantize_per_token_group accepts.
BLOCK_SIZE = 128


def blocks(v: int) -> int:
    """ceil(v / BLOCK_SIZE): the number of BLOCK_SIZE-long blocks covering ``v`` (the last one may be partial); the
    one ceil division of the block-scaled shapes (``(ceil(N / 128), ceil(K / 128))`` weight scales)."""
    return -(-v // BLOCK_SIZE)


# Row-wise fp8 GEMMs on sm90: True runs the fast-accumulation configs (the tensor cores' partial sums kept over the
# whole K loop: faster, relative error up to ~4.5e-3 of the result's norm at bf16 output, csrc/gemm/EPILOGUES.md), False
# the accurate ones (partial sums promoted into float32 every 128 of K, within the bf16 rounding, ~1.7e-3). THE ONE
# PLACE the default of `fp8_fast_accum` is decided: the default of the ops' schema argument (scaled_mm, scaled_mm_out,
# w8a8_linear), of the wrappers and of W8A8Config.fp8_fast_accum read it; csrc/core/limits.hpp kFp8FastAccumDefault
# (decode_layer, which has no such argument) is pinned equal by tests/ops/test_limits.py. Issue 37 flips it to False
# once the accurate configs' small-M rows are measured.
FP8_FAST_ACCUM = True

# Largest finite magnitude of each quantized dtype: the divisor of the dynamic scales (amax / QMAX).
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
# 8-bit GEMM operands (and the quantization ops' target dtypes).
AB_DTYPES = (torch.int8, torch.float8_e4m3fn)
# GEMM outputs (and the model dtypes of decode_layer).
OUT_DTYPES = (torch.bfloat16, torch.float16)
# Float inputs of the row-wise ops (quantize, rms_norm, silu_mul) and of w8a8_linear.
X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# decode_attention and rope_kv_cache_.
ATTN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# linear_decode's x (and so its output).
DECODE_X_DTYPES = (torch.bfloat16, torch.float16)
