// moe_decode_experts: the routed experts of a SwiGLU mixture-of-experts layer at decode sizes (T * top_k <= 64
// (token, expert) pairs) in two kernels at top_k >= 4 and three below, equal bit for bit to the unfused chain
// (cutlass_w8a8/ops/moe.py):
//
//   moe_align -> moe_permute_quant -> grouped_scaled_mm (w13) -> silu_mul_quant -> grouped_scaled_mm (w2)
//   -> moe_unpermute                                              (7 kernels, 5 intermediate tensors)
//
// The two-kernel path (top_k >= 4 and T x H <= 2048, top_k x I <= 6144: own_quant on the host, the measured speed
// rule; CUTLASS_W8A8_MOE_DECODE_PREP=1 forces the three-kernel one and =0 the two-kernel one where its shared
// memory fits, the A/B switch):
//   gate/up'  the gate/up CTA below (moe_decode_gate_up_kernel with XT = x's dtype), except that after finding its
//             slot's pairs it quantizes the x rows of the slot's tokens itself (quantize_x_rows: prep's arithmetic
//             into dynamic shared memory, T rows of own_x_pitch(H) bytes and their scales), its main loop reads A
//             from there (the same fragments as from qx: load_a16 / load_a_scale), and its epilogue stores h and
//             exits: no counters, fences, atomics or last-CTA quantization.
//   down_tm'  the token-major down below (moe_decode_down_tm_kernel with kOwnH), with warp w quantizing its pair's
//             h row itself (quantize_h_row: silu_mul_quant's arithmetic, into its I bytes of dynamic shared memory)
//             before streaming the pair's w2 rows against it. It writes every (token, column) of out, zeros for a
//             token with no routed pair (nothing else zeroes them: prep does not run).
//   PDL chain: routing -> gate/up' -> down_tm' (down_tm' reads h after its griddepcontrol.wait: gate/up' is done).
//   The price: each pair's x row is quantized by every gate/up' CTA of its expert (I / 16 of them) and each h row by
//   every down_tm' CTA of its token (H / 16): redundant work, cheap at T = 1, growing with T; the workspace is h only.
//   The path is left for the three-kernel one when its shared memory would exceed kOwnQuantMaxSmem (64 KiB).
//   (An earlier form, the "fold", quantized block by block inside the main loops; it measured slower on an H200,
//   docs/BENCHMARKS.md.)
//
// The three-kernel path (top_k < 4, or the switch):
//   prep      one CTA per token: x's row quantized per token (or per 1 x 128 group) exactly as quantize_per_token
//             (quantize_per_token_group) does; the token's completion counters zeroed; a token with no routed
//             pair gets its output row zeroed (no later kernel writes it).
//   gate/up   the grouped decode GEMM (gemm/decode/grouped_decode.cu's CTA: 8 warps, 16 weight rows, the same
//             loads, MMAs, block-scale steps and warp-order reduction) over w13, with three changes:
//               - a CTA finds its expert from topk_ids itself (slot s = the s-th smallest routed expert id) and its
//                 rows are that expert's pairs in increasing pair index, the order moe_align's stable sort gives;
//                 no sorted_pairs / offsets tensors exist;
//               - A's rows are gathered: pair p reads the quantized row of token p / top_k (the gather fused into
//                 the A load: per-thread row pointers);
//               - the CTA computes 16 gate channels (rows n0 .. n0 + 16 of w13) and the matching 16 up channels
//                 (I + n0 ..), one after the other with the same 8-warp schedule, so that each value equals the
//                 grouped kernel's; the epilogue rounds both to the output type, applies silu_mul's arithmetic
//                 (quant/silu_mul.cu: silu rounded to the output type, then the product, rounded) and stores
//                 h[p, n0 .. n0 + 16). The last of the I / 16 CTAs to finish a pair (an atomic counter per pair,
//                 after a __threadfence) re-reads h[p] (I values) and quantizes it per token (or per 1 x 128
//                 group): exactly silu_mul_quant's tail. No float atomics: a max is exact in any order and the
//                 quantization runs once per pair, in one CTA.
//   down      (top_k >= 4, down_token_major) token-major: CTA (16-column tile, token) computes out[token, tile]
//             alone. Warp w streams the 16 w2 rows of pair j = w, w + 8, ... against the pair's quantized
//             intermediate row, accumulating K block b into accumulator b % 8 in block order and adding the 8 in
//             order (grouped_decode's 8-warp sums exactly, for any K); it rounds as grouped_scaled_mm does and
//             multiplies by the routing weight (moe_unpermute's product) into shared memory; 16 threads sum the
//             token's routed pairs j = 0 .. top_k - 1 in increasing j from 0 (moe_unpermute's order) and write the
//             row once. No cross-CTA reduction, no counters.
//             (top_k < 4) expert-major: the same grouped decode GEMM over w2 on the quantized intermediate rows
//             (pair-indexed, so gathered too); the epilogue rounds to the output type as grouped_scaled_mm does,
//             multiplies by the pair's routing weight (float32, moe_unpermute's product) and stores y[p, n0 .. n0 +
//             16) in float32. The last
//             CTA of a (token, 16-column tile) to finish (counter per token and tile) sums that token's routed
//             pairs j = 0 .. top_k - 1 in increasing j from 0 (moe_unpermute's order: one float32 rounding per
//             product and per addition) and writes out[token, tile] once, rounded to the output type. The order
//             is fixed by j, not by which CTA finishes last: deterministic.
//
// Why the results equal the chain's: the same quantized bytes and scales of x (prep = quantize per token / group,
// gathered = moe_permute_quant; gate/up' computes them with the same functions from the same values: scale =
// max |x| / QMAX over the row or the 1 x 128 group, exact in any order of the max, then quantize_one per element), the
// same quantized bytes and scales of h (the last gate/up CTA's quantize_pair_row, or down_tm's quantize_h_row: the
// same arithmetic on the same stored h), the same per-row GEMM sums (each CTA runs grouped_decode's per-chunk main loop
// with the same block-to-warp assignment and warp-order reduction; a chunk of an expert's rows is its pairs in
// increasing pair index, as in moe_align's order, and a row's result does not depend on which other rows share its
// chunk), the same epilogue and roundings, silu_mul_quant's arithmetic, and moe_unpermute's sum.
//
// Graphs: grids depend on T, top_k, E, H and I only (slots = min(E, T * top_k)), never on the routing; no host
// synchronisation; the workspace is one tensor from the caching allocator per call (the two-kernel path: h only;
// its shared memory depends on T, H and I only). PDL: each kernel waits on
// griddepcontrol before its first global read and lets its dependent launch early (the host launches them with
// programmatic stream serialization when kernels_use_pdl), as the grouped decode GEMM does.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <string>
#include <type_traits>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include "core/checks.hpp"
#include "core/device.hpp"
#include "core/knobs.hpp"
#include "core/launch.hpp"
#include "core/launch_policy.hpp"
#include "core/limits.hpp"
#include "gemm/decode/decode_host.cuh"  // with_decode_types
#include "gemm/decode/decode_mma.cuh"   // shape constants, BlockFrags, loads, MMA steps, epilogues, block scales
#include "graphs/graph_nodes.hpp"
#include "moe/moe_args.hpp"
#include "ops.hpp"
#include "quant/rowwise_reduce.cuh"  // to_float, from_float, quantize_one, Int8Out / Fp8Out, block_max, PDL

namespace cutlass_w8a8 {
namespace {

constexpr int kMaxPairs = static_cast<int>(limits::kMoeDecodeMaxPairs);
static_assert(kMaxPairs <= kThreads, "one thread per pair in the expert search");
constexpr int kPrepThreads = 256;

struct MoeDecodeParams {
  const void* x;              // [T, H] bf16 / fp16 / fp32, row stride ldx (elements)
  int64_t ldx;
  const void* ids;            // topk_ids [T, k], int32 or int64 (ids64), strides ids_s0 / ids_s1 (elements)
  int64_t ids_s0, ids_s1;
  int ids64;
  const float* topk_w;        // [T, k] float32, contiguous
  const uint8_t* w13;         // [E, 2I, H]
  const float* s13;           // [E, 2I] / [E]; block [E, ceil(2I/128), H/128]
  int s13_per_channel;
  const uint8_t* w2;          // [E, H, I]
  const float* s2;            // [E, H] / [E]; block [E, ceil(H/128), I/128]
  int s2_per_channel;
  // workspace
  uint8_t* qx;                // [T, H] quantized x
  float* sx;                  // [T] or [T, H/128]
  void* h;                    // [P, I] output type: silu(gate) * up, rounded as silu_mul
  uint8_t* q2;                // [P, I] quantized h
  float* sh;                  // [P] or [P, I/128]
  float* y;                   // [P, H] float32: weight * round(down row)
  int* cnt13;                 // [P]: gate/up CTAs done per pair
  int* cnt2;                  // [T, H/16]: down CTAs done per token and column tile
  void* out;                  // [T, H] output type
  int t, k, pairs, e, hid, inter;
  uint32_t zero;              // always 0 (tie_to_weight_loads)
  int w2_prefetch;            // 1: each gate/up CTA asks L2 for its share of its expert's w2 (w2_l2_prefetch, host:
                              // an A/B switch, off by default)
};

// topk_ids[pair], or -1 when outside [0, E) (not routed).
__device__ __forceinline__ int load_id(const MoeDecodeParams& p, int pair) {
  const int64_t idx = static_cast<int64_t>(pair / p.k) * p.ids_s0 + static_cast<int64_t>(pair % p.k) * p.ids_s1;
  const int64_t v = p.ids64 ? static_cast<const int64_t*>(p.ids)[idx] : static_cast<const int32_t*>(p.ids)[idx];
  return v >= 0 && v < p.e ? static_cast<int>(v) : -1;
}

// --- row quantization: quantize_per_token(_group)'s arithmetic, shared by prep and the last gate/up CTA ------------

// Row `row` of n values (value(i): element i as float) quantized by a block of kBlockThreads threads into qr[0 .. n)
// with its scales: per token (kGroup false) scale = block max |v| / QMAX into scales[row]; per 1 x 128 group (kGroup)
// one warp per group, 4 elements a lane, scale = the group's max |v| / QMAX into scales[row * n / 128 + group]; then
// quantize_one per element. A max is exact in any order: the bytes and scales of quantize_per_token(_group) (prep, x)
// and of silu_mul_quant's tail (quantize_pair_row, h). All threads of the block call it. n and scales are references
// (prep passes p.hid and p.sx): read where they are used, as in the kernel before this function existed.
template <class Q, bool kGroup, int kBlockThreads, class Value>
__device__ __forceinline__ void quantize_row(Value value, const int& n, typename Q::type* qr,
                                             float* const& scales, int row) {
  if constexpr (kGroup) {
    const int groups = n / kGroupElems, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int gi = warp; gi < groups; gi += kBlockThreads / 32) {
      float v[4], amax = 0.f;
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        v[u] = value(gi * kGroupElems + lane * 4 + u);
        amax = fmaxf(amax, fabsf(v[u]));
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
      const float scale = amax / Q::kMax;
      if (lane == 0) scales[static_cast<int64_t>(row) * groups + gi] = scale;
#pragma unroll
      for (int u = 0; u < 4; ++u) qr[gi * kGroupElems + lane * 4 + u] = quantize_one<Q>(v[u], scale);
    }
  } else {
    float amax = 0.f;
    for (int i = threadIdx.x; i < n; i += kBlockThreads) amax = fmaxf(amax, fabsf(value(i)));
    const float scale = block_max<kBlockThreads>(amax) / Q::kMax;
    if (threadIdx.x == 0) scales[row] = scale;
    for (int i = threadIdx.x; i < n; i += kBlockThreads) qr[i] = quantize_one<Q>(value(i), scale);
  }
}

// --- prep: x quantized per token / group, counters zeroed --------------------------------------------------------

template <class XT, class Q, bool kGroup, class OutT>
__global__ void __launch_bounds__(kPrepThreads) moe_decode_prep_kernel(MoeDecodeParams p) {
  allow_dependent_launch();
  wait_for_producers();
  const int tok = blockIdx.x;
  const int tiles = p.hid / kRows;
  for (int i = threadIdx.x; i < p.k; i += kPrepThreads) p.cnt13[tok * p.k + i] = 0;
  for (int i = threadIdx.x; i < tiles; i += kPrepThreads) p.cnt2[static_cast<int64_t>(tok) * tiles + i] = 0;
  // Whether any of the token's pairs is routed: one id per thread, its load in flight during the quantization, and a
  // block-wide OR at the end (each thread reading all k ids in a loop cost k dependent round trips).
  int routed = 0;
  for (int j = threadIdx.x; j < p.k; j += kPrepThreads) routed |= load_id(p, tok * p.k + j) >= 0 ? 1 : 0;
  const XT* xr = static_cast<const XT*>(p.x) + static_cast<int64_t>(tok) * p.ldx;
  using QT = typename Q::type;
  QT* qr = reinterpret_cast<QT*>(p.qx + static_cast<int64_t>(tok) * p.hid);
  // quantize_per_token(_group): per token a block max, per group one warp per 128-element group, 4 elements a lane
  quantize_row<Q, kGroup, kPrepThreads>([&](int i) { return to_float(xr[i]); }, p.hid, qr, p.sx, tok);
  // A token none of whose pairs is routed gets a zero output row (no later kernel writes it).
  if (__syncthreads_or(routed) == 0) {
    OutT* o = static_cast<OutT*>(p.out) + static_cast<int64_t>(tok) * p.hid;
    for (int i = threadIdx.x; i < p.hid; i += kPrepThreads) o[i] = from_float<OutT>(0.f);
  }
}

// --- the slot's expert and its pairs -----------------------------------------------------------------------------

struct SlotShared {
  int ids[kMaxPairs];
  unsigned present[32];  // bitmap of the routed expert ids (E <= 1024)
  int prefix[32];        // routed experts in the words before
  int wcnt[2];           // the expert's pairs in warps 0 and 1
  int rows[kMaxPairs];   // the expert's pairs, increasing
  int expert, m;
  int last[2 * 8];       // per chunk row: the pair (gate/up) or token (down) this CTA finishes, or -1
};
static_assert(limits::kMoeMaxExperts <= 32 * 32, "the expert bitmap is 32 words");
static_assert(kMaxPairs <= 64, "the pairs are in warps 0 and 1");

// Every thread calls it; afterwards s.expert is the slot-th smallest routed expert id (-1: none) and s.rows[0 .. s.m)
// its pairs in increasing order. A bitmap of the routed ids, a scan of its 32 word counts, and ballots: a few
// shared-memory operations per thread whatever P.
__device__ __forceinline__ void find_slot_pairs(const MoeDecodeParams& p, int slot, SlotShared& s) {
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  if (tid < 32) s.present[tid] = 0u;
  if (tid == 0) s.expert = -1;
  const int id = tid < p.pairs ? load_id(p, tid) : -1;
  if (tid < p.pairs) s.ids[tid] = id;
  __syncthreads();
  if (id >= 0) atomicOr(&s.present[id >> 5], 1u << (id & 31));
  __syncthreads();
  if (warp == 0) {
    const int c = __popc(s.present[lane]);
    int incl = c;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int o = __shfl_up_sync(0xffffffffu, incl, off);
      if (lane >= off) incl += o;
    }
    s.prefix[lane] = incl - c;
  }
  __syncthreads();
  if (id >= 0) {
    const int rank = s.prefix[id >> 5] + __popc(s.present[id >> 5] & ((1u << (id & 31)) - 1u));
    if (rank == slot) s.expert = id;  // every pair of that expert writes the same value
  }
  __syncthreads();
  const int e = s.expert;
  const bool in = e >= 0 && id == e;
  const unsigned b = __ballot_sync(0xffffffffu, in);
  if (lane == 0 && warp < 2) s.wcnt[warp] = __popc(b);
  __syncthreads();
  if (in) s.rows[__popc(b & ((1u << lane) - 1u)) + (warp == 1 ? s.wcnt[0] : 0)] = tid;
  if (tid == 0) s.m = s.wcnt[0] + s.wcnt[1];
  __syncthreads();
}

// --- gathered main loops (decode_mma.cuh's mainloop_global(_scaled) with one A row pointer per token tile) -------

// An A fragment's 16 bytes, or a scale: from global memory through the read-only path, or (kSmemA: the two-kernel
// path's own quantized rows, quantize_x_rows / quantize_h_row) from shared memory.
template <bool kSmemA>
__device__ __forceinline__ uint4 load_a16(const uint8_t* ptr) {
  if constexpr (kSmemA) {
    return *reinterpret_cast<const uint4*>(ptr);
  } else {
    return __ldg(reinterpret_cast<const uint4*>(ptr));
  }
}
template <bool kSmemA>
__device__ __forceinline__ float load_a_scale(const float* ptr) {
  if constexpr (kSmemA) {
    return *ptr;
  } else {
    return __ldg(ptr);
  }
}

template <int NT, bool kSmemA = false>
__device__ __forceinline__ void load_block_acts_gather(BlockFrags<NT>& f, const uint8_t* const (&arow)[NT], int blk,
                                                       int t, int k) {
  const int base = blk * kBlockBytes + 16 * t;
#pragma unroll
  for (int u = 0; u < kSteps; ++u) {
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const int kk = base + u * kStepBytes;
      f.x[u][j] = (arow[j] != nullptr && kk < k) ? load_a16<kSmemA>(arow[j] + kk) : make_uint4(0, 0, 0, 0);
    }
  }
}

// load_block_scales with one scale row per accumulator token (8j + 2t + e): null for a token past the chunk.
template <int NT, bool kSmemA = false>
__device__ __forceinline__ void load_block_scales_gather(BlockScales<NT>& sc, const float* const (&sa_row)[NT][2],
                                                         const float* sb_row, int kgroups, int blk) {
#pragma unroll
  for (int hh = 0; hh < kGroupsPerBlock; ++hh) {
    const int kb = blk * kGroupsPerBlock + hh;
    const bool in_k = kb < kgroups;
    const float sb = in_k ? __ldg(sb_row + kb) : 0.f;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float sa = in_k && sa_row[j][e] != nullptr ? load_a_scale<kSmemA>(sa_row[j][e] + kb) : 0.f;
        sc.s[hh][j][e] = __fmul_rn(sa, sb);
      }
    }
  }
}

// Warp blocks first, first + step, ... (step = kWarps / R when R tiles share the CTA's warps).
template <class Acc, int NT, bool kSmemA = false>
__device__ __forceinline__ void mainloop_gather(Acc (&acc)[NT][4], const uint8_t* wg, int64_t ldw,
                                                const uint8_t* const (&arow)[NT], int first, int end, int step, int t,
                                                int k, uint32_t zero) {
  BlockFrags<NT> f;
  for (int blk = first; blk < end; blk += step) {
    load_block_weights(f, wg, ldw, blk, t, k);
    load_block_acts_gather<NT, kSmemA>(f, arow, blk, t, k);
    tie_to_weight_loads(f, zero);
    mma_block(acc, f);
  }
}

template <int NT, bool kSmemA = false>
__device__ __forceinline__ void mainloop_gather_scaled(float (&acc)[NT][4], const uint8_t* wg, int64_t ldw,
                                                       const uint8_t* const (&arow)[NT],
                                                       const float* const (&sa_row)[NT][2], const float* sb_row,
                                                       int kgroups, int first, int end, int step, int t, int k,
                                                       uint32_t zero) {
  BlockFrags<NT> f;
  BlockScales<NT> sc;
  for (int blk = first; blk < end; blk += step) {
    load_block_weights(f, wg, ldw, blk, t, k);
    load_block_acts_gather<NT, kSmemA>(f, arow, blk, t, k);
    load_block_scales_gather<NT, kSmemA>(sc, sa_row, sb_row, kgroups, blk);
    tie_to_weight_loads(f, zero);
    tie_to_scale_loads(f, sc, zero);
    mma_block_scaled(acc, f, sc);
  }
}

// The activation fragments of src copied into dst (the dual forms below: A loaded once for both tiles).
template <int NT>
__device__ __forceinline__ void copy_acts(BlockFrags<NT>& dst, const BlockFrags<NT>& src) {
#pragma unroll
  for (int u = 0; u < kSteps; ++u) {
#pragma unroll
    for (int j = 0; j < NT; ++j) dst.x[u][j] = src.x[u][j];
  }
}

// The dual forms (gate/up's one-pass variant, kDual below): two row tiles of one expert (weights at wga and wgb)
// against the same activations. Each block's weights of both tiles and its activations (once) are loaded before
// either tile's MMAs, so the warp has both tiles' bytes in flight at once; each accumulator then gets the MMAs of
// mainloop_gather(_scaled) for its tile, in the same block order: the same sums, bit for bit.
template <class Acc, int NT>
__device__ __forceinline__ void mainloop_gather_dual(Acc (&acc_a)[NT][4], Acc (&acc_b)[NT][4], const uint8_t* wga,
                                                     const uint8_t* wgb, int64_t ldw, const uint8_t* const (&arow)[NT],
                                                     int first, int end, int step, int t, int k, uint32_t zero) {
  BlockFrags<NT> fa, fb;
  for (int blk = first; blk < end; blk += step) {
    load_block_weights(fa, wga, ldw, blk, t, k);
    load_block_weights(fb, wgb, ldw, blk, t, k);
    load_block_acts_gather(fa, arow, blk, t, k);
    tie_to_weight_loads(fa, zero);
    tie_to_weight_loads(fb, zero);
    mma_block(acc_a, fa);
    copy_acts(fb, fa);
    mma_block(acc_b, fb);
  }
}

template <int NT>
__device__ __forceinline__ void mainloop_gather_scaled_dual(float (&acc_a)[NT][4], float (&acc_b)[NT][4],
                                                            const uint8_t* wga, const uint8_t* wgb, int64_t ldw,
                                                            const uint8_t* const (&arow)[NT],
                                                            const float* const (&sa_row)[NT][2],
                                                            const float* sb_row_a, const float* sb_row_b, int kgroups,
                                                            int first, int end, int step, int t, int k,
                                                            uint32_t zero) {
  BlockFrags<NT> fa, fb;
  BlockScales<NT> sca, scb;
  for (int blk = first; blk < end; blk += step) {
    load_block_weights(fa, wga, ldw, blk, t, k);
    load_block_weights(fb, wgb, ldw, blk, t, k);
    load_block_acts_gather(fa, arow, blk, t, k);
    load_block_scales_gather(sca, sa_row, sb_row_a, kgroups, blk);
    load_block_scales_gather(scb, sa_row, sb_row_b, kgroups, blk);
    tie_to_weight_loads(fa, zero);
    tie_to_weight_loads(fb, zero);
    tie_to_scale_loads(fa, sca, zero);
    tie_to_scale_loads(fb, scb, zero);
    mma_block_scaled(acc_a, fa, sca);
    copy_acts(fb, fa);
    mma_block_scaled(acc_b, fb, scb);
  }
}

// The A operand of one chunk: rows a + row_of(pair) * lda for the chunk's pairs, scales (row-wise: one per row;
// block: K/128 per row).
struct ChunkA {
  const uint8_t* a;
  int64_t lda;
  const float* scale;
  int by_token;  // 1: a row is the pair's token (gate/up, x); 0: the pair itself (down, the intermediate)
};

// The A operand's rows of a chunk (pairs s.rows[r0 .. r0 + m)): chunk_row, the row of chunk slot `slot` (its pair,
// or the pair's token when ca.by_token); chunk_a_rows, lane (g, t)'s row pointers for the MMA's tokens 8 j + g (null
// at m and past); chunk_a_scale_rows (block scales, K / 128 per row), its scale rows for the accumulator's tokens
// 8 j + 2 t + q (null at m and past).
__device__ __forceinline__ int64_t chunk_row(const MoeDecodeParams& p, const SlotShared& s, const ChunkA& ca, int r0,
                                             int slot) {
  const int pair = s.rows[r0 + slot];
  return ca.by_token ? pair / p.k : pair;
}

template <int NT>
__device__ __forceinline__ void chunk_a_rows(const uint8_t* (&arow)[NT], const MoeDecodeParams& p, const SlotShared& s,
                                             const ChunkA& ca, int r0, int m, int g) {
#pragma unroll
  for (int j = 0; j < NT; ++j) arow[j] = 8 * j + g < m ? ca.a + chunk_row(p, s, ca, r0, 8 * j + g) * ca.lda : nullptr;
}

template <int NT>
__device__ __forceinline__ void chunk_a_scale_rows(const float* (&sa_row)[NT][2], const MoeDecodeParams& p,
                                                   const SlotShared& s, const ChunkA& ca, int r0, int m, int t,
                                                   int kgroups) {
#pragma unroll
  for (int j = 0; j < NT; ++j) {
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const int slot = 8 * j + 2 * t + q;
      sa_row[j][q] = slot < m ? ca.scale + chunk_row(p, s, ca, r0, slot) * kgroups : nullptr;
    }
  }
}

// The epilogue value of this thread's (row, token) of tile r: the sum of warps r, r + R, ... of `red` (warp order),
// then the epilogue as grouped_scaled_mm's (row-wise: the token's scale *sa and the channel's or tensor's weight
// scale; block-scaled: the scales were applied per K block), rounded to the output type. Row row0 + (thread % 16) of
// the expert's [n, K] weight; token thread / 16 (< the chunk's m).
template <class AB, class OutT, bool kBlockScaled>
__device__ __forceinline__ float tile_value(const typename AB::Acc (&red)[kWarps][2][32][4], int r, int R,
                                           const float* sa, const float* wscale, int wscale_per_channel, int e,
                                           int64_t n, int64_t row0) {
  using Acc = typename AB::Acc;
  const int row = threadIdx.x % kRows, token = threadIdx.x / kRows;
  const int jt = token / 8, tt = token % 8;
  const int src = (row % 8) * 4 + tt / 2, reg = (row / 8) * 2 + tt % 2;  // warp_order_sum's C-fragment slot
  Acc sum = red[r][jt][src][reg];
  for (int w2 = r + R; w2 < kWarps; w2 += R) sum += red[w2][jt][src][reg];
  if constexpr (kBlockScaled) {
    return to_float(epilogue_scaled<OutT>(sum, 0.f));
  } else {
    const float sb = wscale_per_channel ? wscale[e * n + row0 + row] : wscale[e];
    return to_float(epilogue<OutT>(sum, *sa, sb, 0.f));
  }
}

// R 16-row weight tiles (rows row0 + 16 r .. + 16 of expert e's [N, K] weight at w, r < R) against the chunk's
// m <= 8 NT pairs s.rows[r0 ..]. Warp w works on tile w % R, K blocks w / R, w / R + 8 / R, ...; tile r's value is
// the sum of its warps' accumulators in warp order. R = 1 is grouped_decode's chunk exactly (block b on warp b % 8,
// warp-order reduction). R > 1 is used only when K has at most 8 / R blocks of 256 bytes, so that every warp holds
// at most one block: the partial sums, and their order (block order), are then those of R = 1 (the warps without a
// block add zeros), and the result is bit for bit the same. Leaves each (row, token) thread's epilogue value of tile
// r in val[r], rounded to the output type (threads with token >= m: unspecified). All threads call it; it
// synchronizes.
template <class AB, class OutT, int NT, bool kBlockScaled, int R, bool kSmemA = false>
__device__ __forceinline__ void tiles_chunk(const MoeDecodeParams& p, const SlotShared& s, const ChunkA& ca,
                                            const uint8_t* w, const float* wscale, int wscale_per_channel, int64_t n,
                                            int k, int r0, int m, int64_t row0,
                                            typename AB::Acc (&red)[kWarps][2][32][4], float (&val)[R]) {
  static_assert(R == 1 || R == 2 || R == 4 || R == 8, "R divides the 8 warps");
  using Acc = typename AB::Acc;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int e = s.expert;
  const int64_t wrow0 = row0 + kRows * (warp % R);
  const uint8_t* wg = w + static_cast<int64_t>(e) * n * k + (wrow0 + g) * k + 16 * t;
  const int nblk = (k + kBlockBytes - 1) / kBlockBytes;
  auto row_of = [&](int slot) { return chunk_row(p, s, ca, r0, slot); };
  const uint8_t* arow[NT];
  chunk_a_rows(arow, p, s, ca, r0, m, g);

  Acc acc[NT][4];
  zero_acc(acc);
  if constexpr (kBlockScaled) {
    const int kgroups = k / kGroupBytes;
    const int64_t nb = (n + kGroupBytes - 1) / kGroupBytes;
    const float* sb_row = wscale + (e * nb + wrow0 / kGroupBytes) * kgroups;
    const float* sa_row[NT][2];
    chunk_a_scale_rows(sa_row, p, s, ca, r0, m, t, kgroups);
    mainloop_gather_scaled<NT, kSmemA>(acc, wg, k, arow, sa_row, sb_row, kgroups, warp / R, nblk, kWarps / R, t, k,
                                       p.zero);
  } else {
    mainloop_gather<Acc, NT, kSmemA>(acc, wg, k, arow, warp / R, nblk, kWarps / R, t, k, p.zero);
  }
  allow_dependent_launch();

  store_warp_acc(red, acc, warp, lane);
  __syncthreads();
  const int token = threadIdx.x / kRows;
  if (token < m) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      val[r] = tile_value<AB, OutT, kBlockScaled>(red, r, R, ca.scale ? ca.scale + row_of(token) : nullptr, wscale,
                                                  wscale_per_channel, e, n, row0 + kRows * r);
    }
  }
  __syncthreads();  // `red` is reused by the next call
}

// Two 16-row weight tiles of the slot's expert (rows row0a .. + 16 and row0b .. + 16) against the chunk's m <= 8 NT
// pairs in one pass (mainloop_gather(_scaled)_dual): va / vb equal tiles_chunk<.., R = 1>'s values for row0a /
// row0b bit for bit (same blocks per warp, same MMA order per accumulator, the same warp-order reduction and
// epilogue), with one main loop, one reduction barrier and both tiles' bytes in flight together. red_b is the second
// tile's reduction buffer. All threads call it; it synchronizes.
template <class AB, class OutT, int NT, bool kBlockScaled>
__device__ __forceinline__ void tiles_chunk_dual(const MoeDecodeParams& p, const SlotShared& s, const ChunkA& ca,
                                                 const uint8_t* w, const float* wscale, int wscale_per_channel,
                                                 int64_t n, int k, int r0, int m, int64_t row0a, int64_t row0b,
                                                 typename AB::Acc (&red_a)[kWarps][2][32][4],
                                                 typename AB::Acc (&red_b)[kWarps][2][32][4], float& va, float& vb) {
  using Acc = typename AB::Acc;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int e = s.expert;
  const uint8_t* wbase = w + static_cast<int64_t>(e) * n * k + static_cast<int64_t>(g) * k + 16 * t;
  const uint8_t* wga = wbase + row0a * k;
  const uint8_t* wgb = wbase + row0b * k;
  const int nblk = (k + kBlockBytes - 1) / kBlockBytes;
  auto row_of = [&](int slot) { return chunk_row(p, s, ca, r0, slot); };
  const uint8_t* arow[NT];
  chunk_a_rows(arow, p, s, ca, r0, m, g);

  Acc acc_a[NT][4], acc_b[NT][4];
  zero_acc(acc_a);
  zero_acc(acc_b);
  if constexpr (kBlockScaled) {
    const int kgroups = k / kGroupBytes;
    const int64_t nb = (n + kGroupBytes - 1) / kGroupBytes;
    const float* sb_row_a = wscale + (e * nb + row0a / kGroupBytes) * kgroups;
    const float* sb_row_b = wscale + (e * nb + row0b / kGroupBytes) * kgroups;
    const float* sa_row[NT][2];
    chunk_a_scale_rows(sa_row, p, s, ca, r0, m, t, kgroups);
    mainloop_gather_scaled_dual(acc_a, acc_b, wga, wgb, k, arow, sa_row, sb_row_a, sb_row_b, kgroups, warp, nblk,
                                kWarps, t, k, p.zero);
  } else {
    mainloop_gather_dual(acc_a, acc_b, wga, wgb, k, arow, warp, nblk, kWarps, t, k, p.zero);
  }
  allow_dependent_launch();

  store_warp_acc(red_a, acc_a, warp, lane);
  store_warp_acc(red_b, acc_b, warp, lane);
  __syncthreads();
  const int token = threadIdx.x / kRows;
  if (token < m) {
    const float* sa = ca.scale ? ca.scale + row_of(token) : nullptr;
    va = tile_value<AB, OutT, kBlockScaled>(red_a, 0, 1, sa, wscale, wscale_per_channel, e, n, row0a);
    vb = tile_value<AB, OutT, kBlockScaled>(red_b, 0, 1, sa, wscale, wscale_per_channel, e, n, row0b);
  }
  __syncthreads();  // the buffers are reused by the next chunk
}

// h[pair] (I values of the output type, written by every gate/up CTA of the pair) quantized per token or per
// 1 x 128 group into q2[pair] / sh[pair]: silu_mul_quant's tail (scale = max |h| / QMAX, quantize_one). All threads.
template <class Q, bool kGroup, class OutT>
__device__ __forceinline__ void quantize_pair_row(const MoeDecodeParams& p, int pair) {
  const int inter = p.inter;
  const auto* hr =
      reinterpret_cast<const unsigned short*>(static_cast<const OutT*>(p.h) + static_cast<int64_t>(pair) * inter);
  auto hval = [&](int i) {
    const unsigned short bits = __ldcg(hr + i);  // written by other CTAs of this grid: read from L2
    return to_float(*reinterpret_cast<const OutT*>(&bits));
  };
  using QT = typename Q::type;
  QT* qr = reinterpret_cast<QT*>(p.q2 + static_cast<int64_t>(pair) * inter);
  quantize_row<Q, kGroup, kThreads>(hval, inter, qr, p.sh, pair);
}

// --- the two-kernel path's own quantization (top_k >= 4; own_quant on the host) ------------------------------------
//
// Each gate/up CTA quantizes the x rows of its slot's tokens itself, and each token-major down CTA the h rows of its
// token's pairs, into shared memory, with prep's / quantize_pair_row's arithmetic: scale = max |v| / QMAX over the
// row (per token) or over each 1 x 128 group, q = quantize_one(v, scale). A max is exact in any order, so the scales
// and the bytes equal those the three-kernel path writes to qx / sx and q2 / sh, whatever the thread mapping.

// Shared-memory row pitch of the quantized x rows: at least H bytes, a multiple of 16 (the A loads are 16 bytes),
// 64 mod 128, so that the two rows read by one 8-thread phase of a 16-byte load (rows g and g + 1: four 16-byte
// columns each) fall on different banks.
__host__ __device__ __forceinline__ int own_x_pitch(int hid) { return (hid + 63) / 128 * 128 + 64; }

// At T <= 4, every thread asks L1 for one 128-byte line of x's rows (the T rows whole, 4 KiB each at H 2048 bf16),
// before the expert search that quantize_x_rows waits for: its loads then hit L1 instead of waiting on L2. A hint:
// no registers held, no effect on any value.
template <class XT>
__device__ __forceinline__ void prefetch_x_rows(const MoeDecodeParams& p) {
  if (p.t > 4) return;
  const int lines = static_cast<int>((static_cast<int64_t>(p.hid) * sizeof(XT) + 127) / 128);
  for (int i = threadIdx.x; i < p.t * lines; i += kThreads) {
    const char* row = reinterpret_cast<const char*>(static_cast<const XT*>(p.x) + (i / lines) * p.ldx);
    asm volatile("prefetch.global.L1 [%0];" ::"l"(row + static_cast<int64_t>(i % lines) * 128));
  }
}

// The eight values of an 8-element run starting at v[0] (x: any alignment, scalar loads issued together).
template <class T>
__device__ __forceinline__ void load8(const T* v, float (&out)[8]) {
#pragma unroll
  for (int u = 0; u < 8; ++u) out[u] = to_float(v[u]);
}

// Eight quantized values to shared memory (dst: 8-byte aligned) as one 8-byte store.
template <class Q>
__device__ __forceinline__ void store_q8(uint8_t* dst, const float (&v)[8], float scale) {
  union {
    typename Q::type q[8];
    uint2 u;
  } pk;
#pragma unroll
  for (int u = 0; u < 8; ++u) pk.q[u] = quantize_one<Q>(v[u], scale);
  *reinterpret_cast<uint2*>(dst) = pk.u;
}

// gate/up: x's rows of the tokens of the slot's pairs s.rows[0 .. s.m), quantized into qs[token * lds ..] with
// scales ss[token] (per token) or ss[token * H/128 + group]. Thread i takes elements 8 i .. 8 i + 8 of each run of
// 2048 (kThreads x 8); a 1 x 128 group is 16 consecutive threads (a half-warp: a 16-lane butterfly). Tokens < 32
// (the host takes this path at T <= 16). All threads call it after find_slot_pairs; it ends with a barrier.
template <class XT, class Q, bool kGroup>
__device__ __forceinline__ void quantize_x_rows(const MoeDecodeParams& p, const SlotShared& s, uint8_t* qs, float* ss,
                                                int lds) {
  unsigned mask = 0u;  // the slot's tokens (repeated experts may give a token several pairs of one slot)
  for (int r = 0; r < s.m; ++r) mask |= 1u << (s.rows[r] / p.k);
  const int hid = p.hid;
  constexpr int kRun = kThreads * 8;
  const int e0 = 8 * static_cast<int>(threadIdx.x);
  for (unsigned mm = mask; mm != 0u; mm &= mm - 1u) {
    const int tok = __ffs(mm) - 1;  // uniform: every thread has the same mask
    const XT* xr = static_cast<const XT*>(p.x) + static_cast<int64_t>(tok) * p.ldx;
    uint8_t* qr = qs + static_cast<int64_t>(tok) * lds;
    if constexpr (kGroup) {
      const int groups = hid / kGroupElems;
      for (int c = 0; c < hid; c += kRun) {
        const int i = c + e0;
        float v[8], amax = 0.f;
        if (i < hid) {
          load8(xr + i, v);
#pragma unroll
          for (int u = 0; u < 8; ++u) amax = fmaxf(amax, fabsf(v[u]));
        }
#pragma unroll
        for (int off = 8; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
        if (i < hid) {
          const float scale = amax / Q::kMax;  // quantize_per_token_group's scale
          if (threadIdx.x % 16 == 0) ss[tok * groups + i / kGroupElems] = scale;
          store_q8<Q>(qr + i, v, scale);
        }
      }
    } else {
      float amax = 0.f;
#pragma unroll 4
      for (int c = 0; c < hid; c += kRun) {
        const int i = c + e0;
        if (i < hid) {
          float v[8];
          load8(xr + i, v);
#pragma unroll
          for (int u = 0; u < 8; ++u) amax = fmaxf(amax, fabsf(v[u]));
        }
      }
      const float scale = block_max<kThreads>(amax) / Q::kMax;  // quantize_per_token's scale
      if (threadIdx.x == 0) ss[tok] = scale;
      for (int c = 0; c < hid; c += kRun) {
        const int i = c + e0;
        if (i < hid) {
          float v[8];
          load8(xr + i, v);  // the second read of the row hits L1
          store_q8<Q>(qr + i, v, scale);
        }
      }
    }
  }
  __syncthreads();
}

// Token-major down: h[pair] (I values of the output type, from gate/up) quantized by one warp into q[0 .. I) with
// its scale returned (per token) or written to gs[group] (1 x 128 groups): quantize_pair_row's arithmetic. Lane l
// takes elements 8 l .. 8 l + 8 of each run of 256 (h's rows are 16-byte aligned: one 16-byte load); a group is 16
// lanes. The whole warp calls it; it ends with __syncwarp.
template <class Q, bool kGroup, class OutT>
__device__ __forceinline__ float quantize_h_row(const MoeDecodeParams& p, int pair, uint8_t* q, float* gs) {
  const int inter = p.inter, lane = threadIdx.x % 32;
  const OutT* hr = static_cast<const OutT*>(p.h) + static_cast<int64_t>(pair) * inter;
  auto load = [&](int i, float (&v)[8]) {
    // written by the previous grid (gate/up), complete after griddepcontrol.wait: the read-only path, as the
    // three-kernel path's loads of q2 (the second pass hits L1)
    const uint4 raw = __ldg(reinterpret_cast<const uint4*>(hr + i));
    const OutT* e = reinterpret_cast<const OutT*>(&raw);
#pragma unroll
    for (int u = 0; u < 8; ++u) v[u] = to_float(e[u]);
  };
  float scale = 0.f;
  if constexpr (kGroup) {
    for (int c = 0; c < inter; c += 256) {
      const int i = c + 8 * lane;
      float v[8], amax = 0.f;
      if (i < inter) {
        load(i, v);
#pragma unroll
        for (int u = 0; u < 8; ++u) amax = fmaxf(amax, fabsf(v[u]));
      }
#pragma unroll
      for (int off = 8; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
      if (i < inter) {
        const float sc = amax / Q::kMax;  // silu_mul_quant's group scale
        if (lane % 16 == 0) gs[i / kGroupElems] = sc;
        store_q8<Q>(q + i, v, sc);
      }
    }
  } else {
    float amax = 0.f;
#pragma unroll 4
    for (int c = 0; c < inter; c += 256) {
      const int i = c + 8 * lane;
      if (i < inter) {
        float v[8];
        load(i, v);
#pragma unroll
        for (int u = 0; u < 8; ++u) amax = fmaxf(amax, fabsf(v[u]));
      }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    scale = amax / Q::kMax;  // silu_mul_quant's per-token scale
    for (int c = 0; c < inter; c += 256) {
      const int i = c + 8 * lane;
      if (i < inter) {
        float v[8];
        load(i, v);
        store_q8<Q>(q + i, v, scale);
      }
    }
  }
  __syncwarp();
  return scale;
}

// Signals that this CTA's stores to the pair / (token, tile) slots are done, and tells whether it was the last of
// `total` CTAs: CUTLASS's semaphore pattern (the CTA's stores, a barrier, then one thread's device-scope fence and
// atomic; the last one fences again before its CTA reads the others' stores).
__device__ __forceinline__ bool arrive_last(int* counter, int total) {
  __threadfence();
  const int done = atomicAdd(counter, 1);
  const bool last = done == total - 1;
  if (last) __threadfence();
  return last;
}

// CTAs per SM the kernels are compiled for: as grouped_decode_kernel (three for the one-tile row-wise variants).
// The one-pass gate/up (kDual) holds both tiles' weight fragments at once (64 registers): at three CTAs (80
// registers) ptxas spills them to local memory inside the main loop (int8 200 B, fp8 188 B); at two it does not
// (128 / 114 registers), but then Qwen3-30B-A3B's 384 gate/up CTAs at T = 1 take 1.45 waves of 264. Both are built
// for the A/B: kDual 1 keeps the default's CTAs per SM, kDual 2 the two (the one-tile row-wise kernels only; the
// others are at two either way, and their kDual 1 spills at two too, nvcc 13.0 sm_90a: two token tiles int8 168 B,
// fp8 144 B, block fp8 476 B; one token tile block fp8 8 B).
template <int kMaxNT, bool kBlockScaled, int kDual = 0>
constexpr int kCtasPerSm = kMaxNT == 1 && !kBlockScaled && kDual != 2 ? 3 : 2;

// --- gate/up: grid (I / 16, slots) --------------------------------------------------------------------------------

// Part `part` of `parts` of an expert's `bytes` contiguous weight bytes at w (16-byte aligned, bytes a multiple of
// 16): one bulk L2 prefetch of ceil(bytes / parts) bytes rounded up to 16 (the last part shorter, none past the end).
// gate/up's CTAs of a slot (I / 16 of them) so ask L2 for the whole of its expert's w2 [H, I] while they stream w13:
// the down kernel, which waits for gate/up, then reads w2 from L2 (w2_l2_prefetch on the host says when).
__device__ __forceinline__ void prefetch_share(const uint8_t* w, int64_t bytes, int part, int parts) {
  const int64_t share = ((bytes + parts - 1) / parts + 15) / 16 * 16;
  const int64_t off = static_cast<int64_t>(part) * share;
  if (off < bytes) prefetch_l2(w + off, static_cast<uint32_t>(min(share, bytes - off)));
}

// kDual 1 / 2: both tiles in one pass (tiles_chunk_dual: the same bits, one main loop; 2: compiled for fewer CTAs
// per SM, kCtasPerSm; the A/B switch CUTLASS_W8A8_MOE_GATE_UP_DUAL, host below); 0: the gate tile, then the up tile.
// XT (the two-kernel path, own_quant on the host; kDual 0 only): x's dtype; the CTA quantizes its slot's tokens' x
// rows itself into dynamic shared memory (quantize_x_rows: p.t rows of own_x_pitch(H) bytes, then the scales), its
// main loop reads A there, and the epilogue stores h and exits (no counters, no h quantization: the token-major down
// quantizes h). void: the three-kernel path (qx / sx from prep; the last CTA of a pair quantizes h into q2 / sh).
template <class AB, class OutT, int kMaxNT, bool kBlockScaled, int kDual, class XT = void>
__global__ void __launch_bounds__(kThreads, (kCtasPerSm<kMaxNT, kBlockScaled, kDual>))
    moe_decode_gate_up_kernel(MoeDecodeParams p) {
  using Acc = typename AB::Acc;
  using Q = typename AB::Q;
  constexpr bool kOwnX = !std::is_void_v<XT>;
  static_assert(!kOwnX || kDual == 0, "the two-kernel path runs gate/up one tile after the other");
  __shared__ alignas(16) Acc red[kDual != 0 ? 2 : 1][kWarps][2][32][4];
  __shared__ SlotShared s;
  extern __shared__ __align__(16) uint8_t own_smem[];  // kOwnX: the quantized x rows, then their scales
  wait_for_producers();  // topk_ids and weights (routing), x; qx / sx (prep) on the three-kernel path
  if constexpr (kOwnX) prefetch_x_rows<XT>(p);  // x's lines on their way to L1 during the expert search
  find_slot_pairs(p, static_cast<int>(blockIdx.y), s);
  if (s.expert < 0) return;
  const int inter = p.inter, hid = p.hid;
  if (p.w2_prefetch && threadIdx.x == 0) {
    prefetch_share(p.w2 + static_cast<int64_t>(s.expert) * hid * inter, static_cast<int64_t>(hid) * inter,
                   static_cast<int>(blockIdx.x), static_cast<int>(gridDim.x));
  }
  const int64_t n13 = 2 * static_cast<int64_t>(inter);
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kRows;
  ChunkA ca{p.qx, hid, p.sx, 1};
  if constexpr (kOwnX) {
    const int lds = own_x_pitch(hid);
    float* ss = reinterpret_cast<float*>(own_smem + static_cast<int64_t>(p.t) * lds);
    quantize_x_rows<XT, Q, kBlockScaled>(p, s, own_smem, ss, lds);
    ca = ChunkA{own_smem, lds, ss, 1};
  }
  constexpr int kChunk = 8 * kMaxNT;
  const int row = threadIdx.x % kRows, token = threadIdx.x / kRows;
  for (int r0 = 0; r0 < s.m; r0 += kChunk) {
    const int m = min(kChunk, s.m - r0);
    float gate[1], up[1];
    if constexpr (kDual != 0) {
      if (kMaxNT == 1 || m <= 8) {
        tiles_chunk_dual<AB, OutT, 1, kBlockScaled>(p, s, ca, p.w13, p.s13, p.s13_per_channel, n13, hid, r0, m, n0,
                                                    inter + n0, red[0], red[1], gate[0], up[0]);
      } else {
        tiles_chunk_dual<AB, OutT, 2, kBlockScaled>(p, s, ca, p.w13, p.s13, p.s13_per_channel, n13, hid, r0, m, n0,
                                                    inter + n0, red[0], red[1], gate[0], up[0]);
      }
    } else if (kMaxNT == 1 || m <= 8) {
      tiles_chunk<AB, OutT, 1, kBlockScaled, 1, kOwnX>(p, s, ca, p.w13, p.s13, p.s13_per_channel, n13, hid, r0, m,
                                                       n0, red[0], gate);
      tiles_chunk<AB, OutT, 1, kBlockScaled, 1, kOwnX>(p, s, ca, p.w13, p.s13, p.s13_per_channel, n13, hid, r0, m,
                                                       inter + n0, red[0], up);
    } else {
      tiles_chunk<AB, OutT, 2, kBlockScaled, 1, kOwnX>(p, s, ca, p.w13, p.s13, p.s13_per_channel, n13, hid, r0, m,
                                                       n0, red[0], gate);
      tiles_chunk<AB, OutT, 2, kBlockScaled, 1, kOwnX>(p, s, ca, p.w13, p.s13, p.s13_per_channel, n13, hid, r0, m,
                                                       inter + n0, red[0], up);
    }
    if (token < m) {
      // silu_mul (quant/silu_mul.cu): silu rounded to the output type, then the product, rounded
      const OutT act = from_float<OutT>(gate[0] / (1.f + expf(-gate[0])));
      const OutT hv = from_float<OutT>(__fmul_rn(to_float(act), up[0]));
      const int pair = s.rows[r0 + token];
      static_cast<OutT*>(p.h)[static_cast<int64_t>(pair) * inter + n0 + row] = hv;
    }
    if constexpr (!kOwnX) {
      __syncthreads();
      if (row == 0 && token < m) {
        const int pair = s.rows[r0 + token];
        s.last[token] = arrive_last(p.cnt13 + pair, static_cast<int>(gridDim.x)) ? pair : -1;
      }
      __syncthreads();
      for (int i = 0; i < m; ++i) {
        if (s.last[i] >= 0) quantize_pair_row<Q, kBlockScaled, OutT>(p, s.last[i]);  // uniform: shared
      }
      __syncthreads();  // s.last is rewritten by the next chunk
    }
  }
}

// --- down: grid (H / (16 R), slots) -------------------------------------------------------------------------------

template <class AB, class OutT, int kMaxNT, bool kBlockScaled, int R>
__global__ void __launch_bounds__(kThreads, (kCtasPerSm<kMaxNT, kBlockScaled>))
    moe_decode_down_kernel(MoeDecodeParams p) {
  using Acc = typename AB::Acc;
  __shared__ alignas(16) Acc red[kWarps][2][32][4];
  __shared__ SlotShared s;
  wait_for_producers();  // q2 / sh (gate/up); the counters were zeroed by prep, which gate/up waited for
  find_slot_pairs(p, static_cast<int>(blockIdx.y), s);
  if (s.expert < 0) return;
  const int inter = p.inter, hid = p.hid;
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kRows * R;
  const ChunkA ca{p.q2, inter, p.sh, 0};
  constexpr int kChunk = 8 * kMaxNT;
  const int row = threadIdx.x % kRows, token = threadIdx.x / kRows;
  for (int r0 = 0; r0 < s.m; r0 += kChunk) {
    const int m = min(kChunk, s.m - r0);
    float v[R];
    if (kMaxNT == 1 || m <= 8) {
      tiles_chunk<AB, OutT, 1, kBlockScaled, R>(p, s, ca, p.w2, p.s2, p.s2_per_channel, hid, inter, r0, m, n0, red, v);
    } else {
      tiles_chunk<AB, OutT, 2, kBlockScaled, R>(p, s, ca, p.w2, p.s2, p.s2_per_channel, hid, inter, r0, m, n0, red, v);
    }
    if (token < m) {
      const int pair = s.rows[r0 + token];
      const float wt = p.topk_w[pair];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        p.y[static_cast<int64_t>(pair) * hid + n0 + kRows * r + row] = __fmul_rn(wt, v[r]);  // moe_unpermute's product
      }
    }
    __syncthreads();
    if (row == 0 && token < m) {
      const int tok = s.rows[r0 + token] / p.k;
      int routed = 0;
      for (int j = 0; j < p.k; ++j) routed += s.ids[tok * p.k + j] >= 0 ? 1 : 0;
      s.last[token] = arrive_last(p.cnt2 + static_cast<int64_t>(tok) * gridDim.x + blockIdx.x, routed) ? tok : -1;
    }
    __syncthreads();
    // The CTA that completed (token, columns) sums the token's routed pairs in increasing j (moe_unpermute's order).
    if (token < m && s.last[token] >= 0) {
      const int tok = s.last[token];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const int64_t col = n0 + kRows * r + row;
        float acc = 0.f;
        for (int j = 0; j < p.k; ++j) {
          const int pair = tok * p.k + j;
          if (s.ids[pair] >= 0) acc = __fadd_rn(acc, __ldcg(p.y + static_cast<int64_t>(pair) * hid + col));
        }
        static_cast<OutT*>(p.out)[static_cast<int64_t>(tok) * hid + col] = from_float<OutT>(acc);
      }
    }
    __syncthreads();
  }
}

// One K block (blk) of the token-major down's pair: tm_load_block loads its weight fragments (wg, K = I), its
// activation fragments (arow: the pair's quantized h row, from shared memory when kSmemA) and (kBlockScaled) its
// block scales (sa_row / sb_row, kgroups per row); tm_mma_block ties the MMAs to those loads and runs them into acc
// (mma_block, or mma_block_scaled with the block scales).
template <bool kBlockScaled, bool kSmemA>
__device__ __forceinline__ void tm_load_block(BlockFrags<1>& f, BlockScales<1>& sc, const uint8_t* wg,
                                              const uint8_t* const (&arow)[1], const float* const (&sa_row)[1][2],
                                              const float* sb_row, int kgroups, int blk, int t, int inter) {
  load_block_weights(f, wg, inter, blk, t, inter);
  load_block_acts_gather<1, kSmemA>(f, arow, blk, t, inter);
  if constexpr (kBlockScaled) load_block_scales_gather<1, kSmemA>(sc, sa_row, sb_row, kgroups, blk);
}

template <bool kBlockScaled, class Acc>
__device__ __forceinline__ void tm_mma_block(Acc (&acc)[1][4], BlockFrags<1>& f, const BlockScales<1>& sc,
                                             uint32_t zero) {
  tie_to_weight_loads(f, zero);
  if constexpr (kBlockScaled) {
    tie_to_scale_loads(f, sc, zero);
    mma_block_scaled(acc, f, sc);
  } else {
    mma_block(acc, f);
  }
}

// The token-major down's pair without kPrefetch: block b = base + v on accumulator v (v < kWarps), loaded then
// multiplied one block at a time (tm_load_block, tm_mma_block).
template <bool kBlockScaled, bool kSmemA, class Acc>
__device__ __forceinline__ void tm_mainloop(Acc (&acc)[kWarps][1][4], BlockFrags<1>& f, BlockScales<1>& sc,
                                            const uint8_t* wg, const uint8_t* const (&arow)[1],
                                            const float* const (&sa_row)[1][2], const float* sb_row, int kgroups,
                                            int nblk, int t, int inter, uint32_t zero) {
  for (int base = 0; base < nblk; base += kWarps) {
#pragma unroll
    for (int v = 0; v < kWarps; ++v) {
      const int blk = base + v;
      if (blk < nblk) {
        tm_load_block<kBlockScaled, kSmemA>(f, sc, wg, arow, sa_row, sb_row, kgroups, blk, t, inter);
        tm_mma_block<kBlockScaled>(acc[v], f, sc, zero);
      }
    }
  }
}

// --- down, token-major: grid (H / 16, T) ------------------------------------------------------------------------
//
// CTA (x, t) computes out[t, 16 x .. 16 x + 16) alone: warp w takes the token's pairs j = w, w + 8, ... and streams
// pair j's expert rows (16 rows of w2, K = I) against the pair's quantized intermediate row (one token: the MMA's
// first column). So no cross-CTA reduction: each warp leaves w_j * round(row j) in shared memory, and 16 threads sum
// the pairs in increasing j from 0 (moe_unpermute's order). The K blocks of one pair are accumulated as the
// expert-major kernel's 8 warps accumulate them (block b into accumulator b % 8, each in block order), then the 8
// accumulators are added in order: the same sums as grouped_decode / the chain, bit for bit, for any K. An expert
// shared by several tokens is streamed once per token (the later reads mostly from L2).
//
// kPrefetch (the A/B switch CUTLASS_W8A8_MOE_DOWN_PREFETCH=1, host below): block b + 1's weight and activation
// fragments (and block scales) are loaded before block b's MMAs (two buffers), so a warp has two blocks of its pair in
// flight instead of one at a time (without it the SASS is load, MMA, load, MMA: one round trip per 256-byte block, 3
// for Qwen3-30B-A3B's I = 768, 8 for DeepSeek-V3's 2048). The MMAs, their order and the accumulators are the same:
// the same bits. The second buffer needs about 40 more registers: compiled for two CTAs per SM ptxas spilled 480-676
// bytes (nvcc 13.0 sm_90a), so this variant is compiled for one (164-168 registers, no spills); Qwen3's 128 CTAs at
// T = 1 fit one wave either way.
//
// kOwnH (the two-kernel path, own_quant on the host): warp w quantizes its pair's h row itself (quantize_h_row:
// silu_mul_quant's scale and bytes) into its I bytes of dynamic shared memory (then 8 x I / 128 group scales), and
// its main loop reads A there; otherwise A is the pair's row of q2 / sh (the three-kernel path).
template <class AB, class OutT, bool kBlockScaled, bool kPrefetch, bool kOwnH = false>
__global__ void __launch_bounds__(kThreads, kPrefetch ? 1 : 2) moe_decode_down_tm_kernel(MoeDecodeParams p) {
  using Acc = typename AB::Acc;
  using Q = typename AB::Q;
  // kPrefetch keeps block b in buf[b % 2] as buf[v & 1] (b = base + v, base a multiple of kWarps): needs kWarps even
  static_assert(kWarps % 2 == 0, "kPrefetch's buffer parity: kWarps must be even");
  __shared__ float s_prod[kMaxPairs][kRows];
  __shared__ int s_routed[kMaxPairs];
  extern __shared__ __align__(16) uint8_t own_smem[];  // kOwnH: each warp's quantized h row, then group scales
  wait_for_producers();  // h (kOwnH) or q2 / sh (gate/up)
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int tok = blockIdx.y;
  const int inter = p.inter, hid = p.hid;
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kRows;
  const int nblk = (inter + kBlockBytes - 1) / kBlockBytes;
  for (int j = warp; j < p.k; j += kWarps) {
    const int pair = tok * p.k + j;
    const int e = load_id(p, pair);
    if (lane == 0) s_routed[j] = e >= 0 ? 1 : 0;
    if (e < 0) continue;  // a whole warp
    const uint8_t* wg = p.w2 + (static_cast<int64_t>(e) * hid + n0 + g) * inter + 16 * t;
    const uint8_t* qa = nullptr;                   // the pair's quantized h row
    [[maybe_unused]] const float* gsa = nullptr;  // its group scales (block)
    [[maybe_unused]] float sa_own = 0.f;          // its scale (row-wise, kOwnH)
    if constexpr (!kOwnH) {
      qa = p.q2 + static_cast<int64_t>(pair) * inter;
      gsa = p.sh + static_cast<int64_t>(pair) * (inter / kGroupBytes);
    } else {
      uint8_t* qw = own_smem + static_cast<int64_t>(warp) * inter;
      float* gw =
          reinterpret_cast<float*>(own_smem + static_cast<int64_t>(kWarps) * inter) + warp * (inter / kGroupElems);
      __syncwarp();  // the warp's previous pair has read its buffers
      sa_own = quantize_h_row<Q, kBlockScaled, OutT>(p, pair, qw, gw);
      qa = qw;
      gsa = gw;
    }
    const uint8_t* arow[1] = {g == 0 ? qa : nullptr};
    Acc acc[kWarps][1][4];
#pragma unroll
    for (int v = 0; v < kWarps; ++v) zero_acc(acc[v]);
    BlockFrags<1> f;
    if constexpr (kBlockScaled) {
      const int kgroups = inter / kGroupBytes;
      const int64_t nb = (hid + kGroupBytes - 1) / kGroupBytes;
      const float* sb_row = p.s2 + (e * nb + n0 / kGroupBytes) * kgroups;
      const float* sa_row[1][2] = {{t == 0 ? gsa : nullptr, nullptr}};
      BlockScales<1> sc;
      if constexpr (kPrefetch) {
        BlockFrags<1> buf[2];  // as in the row-wise branch below, with the block scales one block ahead too
        BlockScales<1> scb[2];
        load_block_weights(buf[0], wg, inter, 0, t, inter);
        load_block_acts_gather<1, kOwnH>(buf[0], arow, 0, t, inter);
        load_block_scales_gather<1, kOwnH>(scb[0], sa_row, sb_row, kgroups, 0);
        for (int base = 0; base < nblk; base += kWarps) {
#pragma unroll
          for (int v = 0; v < kWarps; ++v) {
            const int blk = base + v;
            if (blk < nblk) {
              if (blk + 1 < nblk) {
                load_block_weights(buf[(v + 1) & 1], wg, inter, blk + 1, t, inter);
                load_block_acts_gather<1, kOwnH>(buf[(v + 1) & 1], arow, blk + 1, t, inter);
                load_block_scales_gather<1, kOwnH>(scb[(v + 1) & 1], sa_row, sb_row, kgroups, blk + 1);
              }
              tie_to_weight_loads(buf[v & 1], p.zero);
              tie_to_scale_loads(buf[v & 1], scb[v & 1], p.zero);
              mma_block_scaled(acc[v], buf[v & 1], scb[v & 1]);
            }
          }
        }
      } else {
        tm_mainloop<kBlockScaled, kOwnH>(acc, f, sc, wg, arow, sa_row, sb_row, kgroups, nblk, t, inter, p.zero);
      }
    } else if constexpr (kPrefetch) {
      // buf[v & 1] holds block base + v's weights and activations, loaded one block ahead (kWarps is even, so the
      // parity of a block's buffer is the same in every base round)
      BlockFrags<1> buf[2];
      load_block_weights(buf[0], wg, inter, 0, t, inter);
      load_block_acts_gather<1, kOwnH>(buf[0], arow, 0, t, inter);
      for (int base = 0; base < nblk; base += kWarps) {
#pragma unroll
        for (int v = 0; v < kWarps; ++v) {
          const int blk = base + v;
          if (blk < nblk) {
            if (blk + 1 < nblk) {
              load_block_weights(buf[(v + 1) & 1], wg, inter, blk + 1, t, inter);
              load_block_acts_gather<1, kOwnH>(buf[(v + 1) & 1], arow, blk + 1, t, inter);
            }
            tie_to_weight_loads(buf[v & 1], p.zero);
            mma_block(acc[v], buf[v & 1]);
          }
        }
      }
    } else {
      BlockScales<1> sc;  // unused: row-wise scales apply in the epilogue
      const float* sa_row[1][2] = {{nullptr, nullptr}};
      tm_mainloop<kBlockScaled, kOwnH>(acc, f, sc, wg, arow, sa_row, nullptr, 0, nblk, t, inter, p.zero);
    }
    // Token 0 of the C fragment: lanes t == 0 hold rows g (register 0) and g + 8 (register 2).
    if (t == 0) {
      const float wt = p.topk_w[pair];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int reg = 2 * half;
        Acc sum = acc[0][0][reg];
#pragma unroll
        for (int v = 1; v < kWarps; ++v) sum += acc[v][0][reg];  // grouped_decode's warp-order reduction
        const int row = g + 8 * half;
        float val;
        if constexpr (kBlockScaled) {
          val = to_float(epilogue_scaled<OutT>(sum, 0.f));
        } else {
          const float sa = kOwnH ? sa_own : p.sh[pair];
          const float sb = p.s2_per_channel ? p.s2[static_cast<int64_t>(e) * hid + n0 + row] : p.s2[e];
          val = to_float(epilogue<OutT>(sum, sa, sb, 0.f));
        }
        s_prod[j][row] = __fmul_rn(wt, val);  // moe_unpermute's product
      }
    }
  }
  allow_dependent_launch();
  __syncthreads();
  if (threadIdx.x < kRows) {
    float acc = 0.f;
    for (int j = 0; j < p.k; ++j) {
      if (s_routed[j]) acc = __fadd_rn(acc, s_prod[j][threadIdx.x]);
    }
    static_cast<OutT*>(p.out)[static_cast<int64_t>(tok) * hid + n0 + threadIdx.x] = from_float<OutT>(acc);
  }
}

// --- host --------------------------------------------------------------------------------------------------------

int64_t align16(int64_t bytes) { return (bytes + 15) / 16 * 16; }

// The down GEMM's form: token-major (moe_decode_down_tm_kernel) at top_k >= 4, expert-major (moe_decode_down_kernel)
// below. Measured on one H200 (CUDA graphs, routing included; issue 36's closing note), token-major / expert-major
// layer time: 0.78-0.88 at Qwen3-30B-A3B dims (top-8, T = 1 and 8, int8 / fp8 / block), 0.75-0.84 at DeepSeek-V3's
// (top-8, int8 / block), 0.88 at OLMoE's (top-8), 0.95 at Qwen2-MoE's (top-4), but 1.10 at Mixtral's (top-2: 2 of the
// token-major CTA's 8 warps have a pair, and each streams I = 14336 alone).
constexpr int kTokenMajorMinTopK = 4;
bool down_token_major(int top_k) { return top_k >= kTokenMajorMinTopK; }

// Weight tiles per down CTA: the largest R in {8, 4, 2, 1} with K (= I) at most 8 / R blocks of 256 bytes (every
// warp one block at most: the sums equal R = 1's, see tiles_chunk) and H a multiple of 16 R.
int down_tiles(int64_t inter, int64_t hid) {
  const int64_t nblk = (inter + kBlockBytes - 1) / kBlockBytes;
  for (int r = 8; r > 1; r /= 2) {
    if (nblk * r <= kWarps && hid % (kRows * r) == 0) return r;
  }
  return 1;
}

template <class AB, class OutT, int kMaxNT, bool kBlockScaled>
void launch_down(const MoeDecodeParams& p, int r, unsigned slots, cudaStream_t stream, bool pdl) {
  auto go = [&](auto kernel, int rr) {
    const dim3 grid(static_cast<unsigned>(p.hid / (kRows * rr)), slots);
    C10_CUDA_CHECK(launch_kernel(kernel, grid, dim3(kThreads), 0, stream, pdl, p));
  };
  switch (r) {
    case 8: go(moe_decode_down_kernel<AB, OutT, kMaxNT, kBlockScaled, 8>, 8); break;
    case 4: go(moe_decode_down_kernel<AB, OutT, kMaxNT, kBlockScaled, 4>, 4); break;
    case 2: go(moe_decode_down_kernel<AB, OutT, kMaxNT, kBlockScaled, 2>, 2); break;
    default: go(moe_decode_down_kernel<AB, OutT, kMaxNT, kBlockScaled, 1>, 1); break;
  }
}

// How gate/up runs its two tiles (moe_decode_gate_up_kernel's kDual; the same bits every way): an A/B switch,
// CUTLASS_W8A8_MOE_GATE_UP_DUAL (read once per process): unset, empty or 0, one tile after the other (the default
// until measured); 1, one pass at the default's CTAs per SM; 2, one pass compiled for two CTAs per SM (kCtasPerSm).
// Another value raises a ValueError naming the variable (a typo would otherwise measure the default).
int gate_up_dual() {
  static const int value = [] {
    const std::string v = env_choice("moe_decode_experts", "CUTLASS_W8A8_MOE_GATE_UP_DUAL", {"0", "1", "2"});
    return v == "1" ? 1 : (v == "2" ? 2 : 0);
  }();
  return value;
}

// Whether the token-major down kernel loads each block one block ahead (moe_decode_down_tm_kernel's kPrefetch; the
// same bits either way): an A/B switch, CUTLASS_W8A8_MOE_DOWN_PREFETCH=1 (read once per process), off by default
// (unset, empty or 0) until measured. Another value raises a ValueError naming the variable.
bool down_prefetch() {
  static const bool value = env_choice("moe_decode_experts", "CUTLASS_W8A8_MOE_DOWN_PREFETCH", {"0", "1"}) == "1";
  return value;
}

// Whether gate/up asks L2 for the routed experts' w2 (moe_decode_gate_up_kernel's prefetch_share; the same bits
// either way: a hint): an A/B switch, CUTLASS_W8A8_MOE_W2_PREFETCH=1 (read once per process), off by default (unset,
// empty or 0). With it on, where the w2 of every slot's expert (slots x H x I bytes, slots = min(E, T x top_k): an
// upper bound of the experts routed) fits in half the device's L2, so that the rows are still there when the down
// kernel reads them while gate/up streams w13 through the same L2. Measured on an H200 (2026-11-30,
// bench/results/moe_decode_w2_prefetch_nvidia-h200.md; Qwen3-30B-A3B dims, the layer with its routing, two rounds):
// T = 1 int8 23.7 us against 24.0-24.1 off, block fp8 29.5 against 29.6; T = 2 (25.2 MB, within the bound) slower,
// int8 42.6 against 38.5, block fp8 41.1 against 38.7; the decoder's int8 graph step at batch 1 2.719 ms against
// 2.708 off. Hence off. Another value raises a ValueError naming the variable.
const std::string& w2_prefetch_switch() {
  static const std::string value = env_choice("moe_decode_experts", "CUTLASS_W8A8_MOE_W2_PREFETCH", {"0", "1"});
  return value;
}
bool w2_l2_prefetch(int64_t slots, int64_t hid, int64_t inter, int64_t l2_bytes) {
  return w2_prefetch_switch() == "1" && slots * hid * inter <= l2_bytes / 2;
}

template <class AB, class OutT, int kMaxNT, bool kBlockScaled>
void launch_gate_up(const MoeDecodeParams& p, const dim3& grid, cudaStream_t stream, bool pdl) {
  const int dual = gate_up_dual();
  if constexpr (kMaxNT == 1 && !kBlockScaled) {  // the one variant whose CTAs per SM differ between 1 and 2
    if (dual == 2) {
      C10_CUDA_CHECK(launch_kernel(moe_decode_gate_up_kernel<AB, OutT, kMaxNT, kBlockScaled, 2>, grid,
                                   dim3(kThreads), 0, stream, pdl, p));
      return;
    }
  }
  if (dual != 0) {
    C10_CUDA_CHECK(launch_kernel(moe_decode_gate_up_kernel<AB, OutT, kMaxNT, kBlockScaled, 1>, grid,
                                 dim3(kThreads), 0, stream, pdl, p));
  } else {
    C10_CUDA_CHECK(launch_kernel(moe_decode_gate_up_kernel<AB, OutT, kMaxNT, kBlockScaled, 0>, grid,
                                 dim3(kThreads), 0, stream, pdl, p));
  }
}

template <class AB, class OutT, bool kBlockScaled>
void launch_gemms(const MoeDecodeParams& p, int slots, cudaStream_t stream, bool pdl) {
  const dim3 g13(static_cast<unsigned>(p.inter / kRows), static_cast<unsigned>(slots));
  const int r = down_tiles(p.inter, p.hid);
  const bool tm = down_token_major(p.k);
  if (p.pairs <= 8) {
    launch_gate_up<AB, OutT, 1, kBlockScaled>(p, g13, stream, pdl);
    if (!tm) launch_down<AB, OutT, 1, kBlockScaled>(p, r, static_cast<unsigned>(slots), stream, pdl);
  } else {
    launch_gate_up<AB, OutT, 2, kBlockScaled>(p, g13, stream, pdl);
    if (!tm) launch_down<AB, OutT, 2, kBlockScaled>(p, r, static_cast<unsigned>(slots), stream, pdl);
  }
  if (tm) {
    const dim3 g2(static_cast<unsigned>(p.hid / kRows), static_cast<unsigned>(p.t));
    if (down_prefetch()) {
      C10_CUDA_CHECK(launch_kernel(moe_decode_down_tm_kernel<AB, OutT, kBlockScaled, true>, g2, dim3(kThreads), 0,
                                   stream, pdl, p));
    } else {
      C10_CUDA_CHECK(launch_kernel(moe_decode_down_tm_kernel<AB, OutT, kBlockScaled, false>, g2, dim3(kThreads), 0,
                                   stream, pdl, p));
    }
  }
}

// --- the two-kernel path (top_k >= 4): gate/up quantizes x, the token-major down quantizes h --------------------

// CUTLASS_W8A8_MOE_DECODE_PREP, an A/B switch read once per process: unset or empty, the speed rule below picks the
// path; 1 forces the three-kernel path (prep -> gate/up with the last-CTA quantization of h -> down) where the
// two-kernel one would apply; 0 forces the two-kernel path wherever top_k >= 4 and its shared memory fits (the rule's
// bounds ignored: the A/B runs and the tests of the two-kernel path at wide shapes). Another value raises a
// ValueError naming the variable. Both paths give the same bits.
const std::string& decode_prep_switch() {
  static const std::string value = env_choice("moe_decode_experts", "CUTLASS_W8A8_MOE_DECODE_PREP", {"0", "1"});
  return value;
}

// The two-kernel path's dynamic shared memory: gate/up, T quantized x rows of own_x_pitch(H) bytes, then their
// scales (T, or T x H / 128); the token-major down, 8 warps' quantized h rows (I bytes each), then their group scales
// (8 x I / 128, block only). The path is taken only when both fit kOwnQuantMaxSmem (each kernel's opt-in, set once
// per kernel and device): at Qwen3-30B-A3B dims (H 2048, I 768) gate/up needs 2.1 KB at T = 1 and 16.9 KB at T = 8,
// down 6 KB; at DeepSeek-V3's (H 7168, I 2048) 7.1 KB / 59.7 KB (block fp8, T = 8) and 16.5 KB.
constexpr int64_t kOwnQuantMaxSmem = 64 * 1024;
int64_t own_x_smem(int64_t t, int64_t hid, bool group) {
  return t * own_x_pitch(static_cast<int>(hid)) + (group ? t * (hid / kGroupElems) : t) * 4;
}
int64_t own_h_smem(int64_t inter, bool group) {
  return kWarps * inter + (group ? kWarps * (inter / kGroupElems) * 4 : 0);
}
static_assert(kMaxPairs / kTokenMajorMinTopK <= 32, "quantize_x_rows' token mask is 32 bits");

// The speed rule: the two-kernel path's redundant quantization, per CTA, at most what measured a win. On an H200
// (bench_moe.py --parts decode, alternating with the three-kernel path, two rounds, the tenth session) it won at
// Qwen3-30B-A3B dims at T = 1 (each gate/up CTA quantizing T x H = 2048 x elements, each down CTA top_k x I = 6144
// h elements: the layer 26.5 -> 24.4 us int8, 27.6 -> 25.9 fp8, 31.1 -> 29.5 block fp8) and lost at T = 8 (16384 x
// elements: 100 -> 114 us int8) and at DeepSeek-V3's at T = 1 (7168 / 16384: 110 -> 128 us int8; at T = 8 670 ->
// 817 us). Between those points nothing was measured: the bounds sit at the winning point.
constexpr int64_t kOwnQuantMaxXElems = 2048;  // T x H per gate/up CTA
constexpr int64_t kOwnQuantMaxHElems = 6144;  // top_k x I per down CTA

// Whether this call runs the two-kernel path: the token-major down (top_k >= 4), not forced off, both kernels' shared
// memory within kOwnQuantMaxSmem, and the redundant quantization within the speed rule's bounds unless the switch
// is 0 (else the three-kernel path, which needs no shared memory of this kind). The one rule: moe_decode_experts
// launches by it and moe_decode_path (cutlass_w8a8._ext.moe_decode_path: tests, benchmarks) answers by it.
bool own_quant(int64_t t, int64_t k, int64_t hid, int64_t inter, bool group) {
  const std::string& forced = decode_prep_switch();
  const bool fits = own_x_smem(t, hid, group) <= kOwnQuantMaxSmem && own_h_smem(inter, group) <= kOwnQuantMaxSmem;
  const bool pays = t * hid <= kOwnQuantMaxXElems && k * inter <= kOwnQuantMaxHElems;
  return down_token_major(static_cast<int>(k)) && forced != "1" && fits && (forced == "0" || pays);
}

// Launches kKernel with `smem` bytes of dynamic shared memory, after raising its limit to kOwnQuantMaxSmem once per
// kernel and device (a driver call: never per launch).
template <auto kKernel>
void launch_own(const dim3& grid, int64_t smem, int device, cudaStream_t stream, bool pdl, const MoeDecodeParams& p) {
  static std::array<std::once_flag, 64> once;
  std::call_once(once.at(static_cast<size_t>(device)), [] {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(kOwnQuantMaxSmem)));
  });
  C10_CUDA_CHECK(launch_kernel(kKernel, grid, dim3(kThreads), static_cast<size_t>(smem), stream, pdl, p));
}

// gate/up (x quantized in each CTA, h stored) -> token-major down (h quantized in each CTA), PDL between them.
template <class XT, class AB, class OutT, bool kBlockScaled>
void launch_own_quant(const MoeDecodeParams& p, int slots, int device, cudaStream_t stream, bool pdl) {
  const bool group = kBlockScaled;
  const dim3 g13(static_cast<unsigned>(p.inter / kRows), static_cast<unsigned>(slots));
  const int64_t smem13 = own_x_smem(p.t, p.hid, group);
  if (p.pairs <= 8) {
    launch_own<moe_decode_gate_up_kernel<AB, OutT, 1, kBlockScaled, 0, XT>>(g13, smem13, device, stream, pdl, p);
  } else {
    launch_own<moe_decode_gate_up_kernel<AB, OutT, 2, kBlockScaled, 0, XT>>(g13, smem13, device, stream, pdl, p);
  }
  const dim3 g2(static_cast<unsigned>(p.hid / kRows), static_cast<unsigned>(p.t));
  const int64_t smem2 = own_h_smem(p.inter, group);
  if (down_prefetch()) {
    launch_own<moe_decode_down_tm_kernel<AB, OutT, kBlockScaled, true, true>>(g2, smem2, device, stream, pdl, p);
  } else {
    launch_own<moe_decode_down_tm_kernel<AB, OutT, kBlockScaled, false, true>>(g2, smem2, device, stream, pdl, p);
  }
}

template <class XT, class Q, class OutT>
void launch_prep(const MoeDecodeParams& p, bool group, cudaStream_t stream, bool pdl) {
  const dim3 grid(static_cast<unsigned>(p.t));
  if (group) {
    C10_CUDA_CHECK(launch_kernel(moe_decode_prep_kernel<XT, Q, true, OutT>, grid, dim3(kPrepThreads), 0, stream,
                                 pdl, p));
  } else {
    C10_CUDA_CHECK(launch_kernel(moe_decode_prep_kernel<XT, Q, false, OutT>, grid, dim3(kPrepThreads), 0, stream,
                                 pdl, p));
  }
}

}  // namespace

at::Tensor moe_decode_experts(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                              const at::Tensor& w13, const at::Tensor& w13_scale, const at::Tensor& w2,
                              const at::Tensor& w2_scale, int64_t group_size, at::ScalarType out_dtype) {
  constexpr const char* op = "moe_decode_experts";
  moe::check_decode_experts(op, x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, group_size, out_dtype);
  gate_up_dual();  // the A/B switches: a bad value raises here, before any launch
  down_prefetch();
  decode_prep_switch();
  w2_prefetch_switch();
  c10::cuda::CUDAGuard guard(x.device());
  const int device = x.device().index();
  const DeviceInfo& info = device_info(device);
  TORCH_CHECK_NOT_IMPLEMENTED(info.major == 9 && info.minor == 0, "cutlass_w8a8.", op,
                              ": needs compute capability 9.0 (sm90, as grouped_scaled_mm); device ", device, " is ",
                              info.major, ".", info.minor);
  const int64_t t = x.size(0), hid = x.size(1), k = topk_ids.size(1), e = w13.size(0), inter = w2.size(2);
  at::Tensor out = at::empty({t, hid}, x.options().dtype(out_dtype));
  if (t == 0) return out;
  const int64_t pairs = t * k;
  const bool group = group_size != 0;
  const bool int8 = w13.scalar_type() == at::kChar;

  const at::Tensor x2 = x.stride(1) == 1 ? x : x.contiguous();
  const at::Tensor tw = topk_weights.contiguous();
  // The two-kernel path (own_quant) needs h only. The three-kernel path's workspace: qx [T, H] | sx | h [P, I]
  // (2-byte output type) | q2 [P, I] | sh | y [P, H] f32 | counters.
  const bool own = own_quant(t, k, hid, inter, group);
  const int64_t sx_n = group ? t * (hid / limits::kBlockSize) : t;
  const int64_t sh_n = group ? pairs * (inter / limits::kBlockSize) : pairs;
  const int64_t cnt_n = pairs + t * (hid / kRows);
  int64_t off = 0;
  const int64_t o_h = off; off += align16(pairs * inter * 2);
  const int64_t o_qx = off; off += own ? 0 : align16(t * hid);
  const int64_t o_sx = off; off += own ? 0 : align16(sx_n * 4);
  const int64_t o_q2 = off; off += own ? 0 : align16(pairs * inter);
  const int64_t o_sh = off; off += own ? 0 : align16(sh_n * 4);
  const int64_t o_y = off; off += own ? 0 : align16(pairs * hid * 4);
  const int64_t o_cnt = off; off += own ? 0 : align16(cnt_n * 4);
  at::Tensor ws = at::empty({off}, x.options().dtype(at::kByte));
  uint8_t* base = ws.data_ptr<uint8_t>();

  MoeDecodeParams p{};
  p.x = x2.data_ptr();
  p.ldx = t > 1 ? x2.stride(0) : hid;
  p.ids = topk_ids.data_ptr();
  p.ids_s0 = topk_ids.stride(0);
  p.ids_s1 = topk_ids.stride(1);
  p.ids64 = topk_ids.scalar_type() == at::kLong ? 1 : 0;
  p.topk_w = tw.data_ptr<float>();
  p.w13 = static_cast<const uint8_t*>(w13.data_ptr());
  p.s13 = w13_scale.data_ptr<float>();
  p.s13_per_channel = !group && w13_scale.dim() == 2 && w13_scale.size(1) == 2 * inter ? 1 : 0;
  p.w2 = static_cast<const uint8_t*>(w2.data_ptr());
  p.s2 = w2_scale.data_ptr<float>();
  p.s2_per_channel = !group && w2_scale.dim() == 2 && w2_scale.size(1) == hid ? 1 : 0;
  p.h = base + o_h;
  if (!own) {  // the two-kernel path leaves these null
    p.qx = base + o_qx;
    p.sx = reinterpret_cast<float*>(base + o_sx);
    p.q2 = base + o_q2;
    p.sh = reinterpret_cast<float*>(base + o_sh);
    p.y = reinterpret_cast<float*>(base + o_y);
    p.cnt13 = reinterpret_cast<int*>(base + o_cnt);
    p.cnt2 = p.cnt13 + pairs;
  }
  p.out = out.data_ptr();
  p.t = static_cast<int>(t);
  p.k = static_cast<int>(k);
  p.pairs = static_cast<int>(pairs);
  p.e = static_cast<int>(e);
  p.hid = static_cast<int>(hid);
  p.inter = static_cast<int>(inter);
  p.zero = 0;
  p.w2_prefetch = w2_l2_prefetch(std::min<int64_t>(e, pairs), hid, inter, info.l2_bytes) ? 1 : 0;

  cudaStream_t stream = current_stream(x);
  // T is in the grids: an UpdatableGraph cannot rewrite these launches (as grouped_scaled_mm's).
  graph_nodes::refuse_launch(stream, op);
  const bool pdl = kernels_use_pdl(device);
  const int slots = static_cast<int>(std::min<int64_t>(e, pairs));
  with_decode_types(int8, out_dtype == at::kBFloat16, [&](auto ab_tag, auto out_tag) {
    using AB = decltype(ab_tag);
    using OutT = decltype(out_tag);
    using Q = typename AB::Q;
    if (own) {
      auto two = [&](auto x_tag) {
        using XT = decltype(x_tag);
        if constexpr (std::is_same_v<AB, Fp8Ab>) {
          if (group) {
            launch_own_quant<XT, AB, OutT, true>(p, slots, device, stream, pdl);
            return;
          }
        }
        launch_own_quant<XT, AB, OutT, false>(p, slots, device, stream, pdl);
      };
      switch (x2.scalar_type()) {
        case at::kBFloat16: two(__nv_bfloat16{}); break;
        case at::kHalf: two(__half{}); break;
        default: two(float{}); break;
      }
      return;
    }
    switch (x2.scalar_type()) {
      case at::kBFloat16: launch_prep<__nv_bfloat16, Q, OutT>(p, group, stream, pdl); break;
      case at::kHalf: launch_prep<__half, Q, OutT>(p, group, stream, pdl); break;
      default: launch_prep<float, Q, OutT>(p, group, stream, pdl); break;
    }
    if constexpr (std::is_same_v<AB, Fp8Ab>) {
      if (group) {
        launch_gemms<AB, OutT, true>(p, slots, stream, pdl);
        return;
      }
    }
    launch_gemms<AB, OutT, false>(p, slots, stream, pdl);
  });
  return out;
}

std::string moe_decode_path(int64_t tokens, int64_t top_k, int64_t hidden, int64_t intermediate,
                            int64_t group_size) {
  constexpr const char* op = "cutlass_w8a8._moe_decode_path";
  constexpr int64_t max_pairs = limits::kMoeDecodeMaxPairs;
  TORCH_CHECK_VALUE(tokens >= 1 && top_k >= 1, op, ": `tokens` and `top_k` must be positive, got ", tokens, ", ",
                    top_k);
  TORCH_CHECK_VALUE(tokens <= max_pairs && top_k <= max_pairs && tokens * top_k <= max_pairs, op, ": `tokens` x `top_k` = ",
                    tokens, " x ", top_k, " (token, expert) pairs; the decode path serves at most ", max_pairs);
  TORCH_CHECK_VALUE(group_size == 0 || group_size == limits::kBlockSize, op,
                    ": `group_size` must be 0 (per-token) or ", limits::kBlockSize, " (block fp8), got ", group_size);
  // as the op's checks (moe_args.hpp): multiples of 16, of 128 with block scales; below 2^30 (int arithmetic)
  const int64_t align = group_size != 0 ? limits::kBlockSize : limits::kGemmAlign;
  TORCH_CHECK_VALUE(hidden > 0 && hidden % align == 0 && hidden <= limits::kDecodeMaxK, op,
                    ": `hidden` must be a positive multiple of ", align, " (group_size = ", group_size,
                    ") at most 2^30, got ", hidden);
  TORCH_CHECK_VALUE(intermediate > 0 && intermediate % align == 0 && intermediate <= limits::kDecodeMaxK, op,
                    ": `intermediate` must be a positive multiple of ", align, " (group_size = ", group_size,
                    ") at most 2^30, got ", intermediate);
  return own_quant(tokens, top_k, hidden, intermediate, group_size != 0) ? "two-kernel" : "three-kernel";
}

}  // namespace cutlass_w8a8
