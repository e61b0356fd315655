// Every size limit of the ops' argument contracts, in one place. cutlass_w8a8/ops/_limits.py holds the same
// numbers for the CPU and fake implementations; tests/ops/test_limits.py parses this file and pins the two equal.
#pragma once

#include <cstdint>

namespace cutlass_w8a8::limits {

// int8 products are at most 128 * 128 = 2^14 in magnitude, so an int32 sum of K of them cannot overflow while
// K * 2^14 <= 2^31 - 1, i.e. K <= 131071; the largest multiple of 16 below that is 131056 (INT8_MAX_K).
constexpr int64_t kInt8MaxK = (int64_t{2147483647} / (128 * 128)) / 16 * 16;
// GEMM K and N: positive multiples of this many elements (16-byte TMA / cp.async rows of 8-bit operands).
constexpr int64_t kGemmAlign = 16;
// GEMM M (rows of a): below 2^31 (32-bit grid and row indices).
constexpr int64_t kMaxM = int64_t{1} << 31;
// Row-wise ops (quantize, rms_norm, silu_mul): at most 2^31 - 1 rows, and K below 2^31.
constexpr int64_t kMaxRows = int64_t{2147483647};
constexpr int64_t kMaxRowK = int64_t{1} << 31;
// Decode GEMMs (scaled_mm_decode, linear_decode): M in [1, 16] (two mma token tiles of 8), K <= 2^30
// (32-bit K byte offsets).
constexpr int64_t kDecodeMaxM = 16;
constexpr int64_t kDecodeMaxK = int64_t{1} << 30;
// add_rms_norm_linear_decode: K <= 8192, the rows rms_norm.cu serves with its one-block register kernel (256
// threads, at most 4 vectors of 8 each): the order of its sum of squares, which the fused decode GEMM repeats.
constexpr int64_t kNormDecodeMaxK = 8192;
// Block-scaled fp8 (DeepSeek-V3 / compressed-tensors FP8_BLOCK): activations in 1 x kBlockSize groups along K,
// weights in kBlockSize x kBlockSize blocks; scaled_mm's K must then be a multiple of it (and N any multiple of
// kGemmAlign: the last weight block may be partial). The sm90 blockwise kernels' TileK and scale granularity.
constexpr int64_t kBlockSize = 128;
// decode_attention: head dim D a multiple of 8 in [8, 256]; at most 65535 query heads (gridDim.y); S (cache
// positions) below 2^30: the split kernel indexes positions with int and a step reads up to 2 x its step (<= 1024
// positions) past its base (CUTLASS_W8A8_ATTN_PREFETCH), so no position arithmetic overflows below 2^30.
constexpr int64_t kAttnMaxHeadDim = 256;
constexpr int64_t kAttnMaxHeads = 65535;
constexpr int64_t kAttnHeadDimMultiple = 8;
constexpr int64_t kAttnMaxSeq = int64_t{1} << 30;

// MoE routing (moe_topk_softmax, moe_align): at most this many experts (a router row is one warp's shared-memory
// slice; moe_align's per-expert counts live in one block's shared memory).
constexpr int64_t kMoeMaxExperts = 1024;
// moe_route's grouped top-k: at most this many expert groups (one warp lane scores one group).
constexpr int64_t kMoeMaxGroups = 32;
// moe_decode_experts (the fused decode path of a MoE layer): at most this many (token, expert) pairs T * top_k
// (a decode step at batch 8 with top-8; each CTA keeps the pairs' expert ids in shared memory).
constexpr int64_t kMoeDecodeMaxPairs = 64;
// moe_router_route (moe/router_route.cu): at most this many tokens (two 8-token mma tiles), H a positive multiple
// of kMoeRouterHMultiple (one warp step: 4 lanes x 16 elements). ops/_limits.py owns the decode rule's use of it.
constexpr int64_t kMoeRouterRouteMaxT = 16;
constexpr int64_t kMoeRouterHMultiple = 64;

// Row-wise fp8 on sm90: 1 runs the fast-accumulation configs, 0 the accurate ones (ops/_limits.py FP8_FAST_ACCUM,
// where the default is decided; pinned equal by tests/ops/test_limits.py). Used only where an op has no
// `fp8_fast_accum` argument of its own (decode_layer); the ops that have one get their schema default from Python.
constexpr int64_t kFp8FastAccumDefault = 1;

}  // namespace cutlass_w8a8::limits
