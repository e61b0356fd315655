// moe_decode_experts: the routed experts of a SwiGLU mixture-of-experts layer at decode sizes (T * top_k <= 64
// (token, expert) pairs), equal bit for bit to the unfused chain (cutlass_w8a8/ops/moe.py):
//
//   moe_align -> moe_permute_quant -> grouped_scaled_mm (w13) -> silu_mul_quant -> grouped_scaled_mm (w2)
//   -> moe_unpermute                                              (7 kernels, 5 intermediate tensors)
//
// in two kernels at top_k >= 4 (the fold path: gate/up' -> down_tm', below) and three below (prep -> gate/up ->
// down, expert-major). EXPERIMENT (A/B): CUTLASS_W8A8_MOE_FOLD=0 selects the three-kernel form at top_k >= 4 too
// (prep -> gate/up -> token-major down on the quantized intermediate), so that one GPU run times both; the loser goes.
//
// The three-kernel form:
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
// The fold path (top_k >= 4; no prep, no quantized copies of x or h, no counters, no atomics):
//   gate/up'  the gate/up CTA above, reading x itself (bf16 / fp16 / fp32): per K block each warp quantizes the
//             256 elements of its chunk rows it is about to multiply (lane l: elements 8l .. 8l + 8 of each row) with
//             quantize_one, into shared memory, and takes its A fragments from there (fold_block); the scales are
//             prep's: row-wise, max |x| over the token's H values / QMAX from a pass over the chunk's rows first
//             (fold_row_scales); block, each 1 x 128 group's max / QMAX from a 16-lane butterfly over the lanes that
//             hold the group. The epilogue stores h only (silu_mul's roundings); no tail.
//   down_tm'  the token-major down below, with warp w quantizing its pair's h row the same way, block by block
//             (row-wise: the pair's max |h| over its I values / QMAX first, silu_mul_quant's scale). It writes every
//             (token, column) of out, zeros for a token with no routed pair, so nothing needs zeroing.
// The PDL chain is moe_route -> gate/up' -> down_tm' (down_tm' reads h after its griddepcontrol.wait, when gate/up'
// has finished). Its cost: gate/up' quantizes x once per 16-channel tile (2 I / 16 times per pair, as linear_decode
// does per CTA) and down_tm' quantizes h once per 16-column tile (H / 16 times per pair): 8 divisions a lane and row per
// 256-element block, issued while the block's weight loads are in flight.
//
// Why the results equal the chain's: the same quantized bytes and scales of x (prep = quantize per token / group,
// gathered = moe_permute_quant; fold: the same function on the same values with the same scale, since a max is exact
// in any order), the same per-row GEMM sums (each CTA runs grouped_decode's per-chunk main loop
// with the same block-to-warp assignment and warp-order reduction; a chunk of an expert's rows is its pairs in
// increasing pair index, as in moe_align's order, and a row's result does not depend on which other rows share its
// chunk), the same epilogue and roundings, silu_mul_quant's arithmetic (fold: its scale and quantize_one on the same
// h), and moe_unpermute's sum.
//
// Graphs: grids depend on T, top_k, E, H and I only (slots = min(E, T * top_k)), never on the routing; no host
// synchronisation; the workspace is one tensor from the caching allocator per call (fold: plus an aligned copy of x
// when its rows are not 16-byte aligned). PDL: each kernel waits on
// griddepcontrol before its first global read and lets its dependent launch early (the host launches them with
// programmatic stream serialization when kernels_use_pdl), as the grouped decode GEMM does.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <type_traits>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include "core/checks.hpp"
#include "core/device.hpp"
#include "core/launch.hpp"
#include "core/launch_policy.hpp"
#include "core/limits.hpp"
#include "gemm/decode/decode_host.cuh"  // with_decode_types
#include "gemm/decode/decode_kernels.cuh"  // XVec, quantize4 (linear_decode's in-kernel quantization)
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
  // workspace (fold: h only; the others null)
  uint8_t* qx;                // [T, H] quantized x
  float* sx;                  // [T] or [T, H/128]
  void* h;                    // [P, I] output type: silu(gate) * up, rounded as silu_mul
  uint8_t* q2;                // [P, I] quantized h
  float* sh;                  // [P] or [P, I/128]
  float* y;                   // [P, H] float32: weight * round(down row)
  int* cnt13;                 // [P]: gate/up CTAs done per pair
  int* cnt2;                  // [T, H/16]: down CTAs done per token and column tile
  // EXPERIMENT (A/B): 1 = the folded two-kernel path at top_k >= 4 (gate/up quantizes x, down_tm quantizes h; no
  // prep, no counters), 0 = prep + gate/up with the last-CTA tail + down. From CUTLASS_W8A8_MOE_FOLD (default 1).
  int fold;
  void* out;                  // [T, H] output type
  int t, k, pairs, e, hid, inter;
  uint32_t zero;              // always 0 (tie_to_weight_loads)
};

// topk_ids[pair], or -1 when outside [0, E) (not routed).
__device__ __forceinline__ int load_id(const MoeDecodeParams& p, int pair) {
  const int64_t idx = static_cast<int64_t>(pair / p.k) * p.ids_s0 + static_cast<int64_t>(pair % p.k) * p.ids_s1;
  const int64_t v = p.ids64 ? static_cast<const int64_t*>(p.ids)[idx] : static_cast<const int32_t*>(p.ids)[idx];
  return v >= 0 && v < p.e ? static_cast<int>(v) : -1;
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
  int routed = 0;
  for (int j = 0; j < p.k; ++j) routed += load_id(p, tok * p.k + j) >= 0 ? 1 : 0;
  if (routed == 0) {
    OutT* o = static_cast<OutT*>(p.out) + static_cast<int64_t>(tok) * p.hid;
    for (int i = threadIdx.x; i < p.hid; i += kPrepThreads) o[i] = from_float<OutT>(0.f);
  }
  const XT* xr = static_cast<const XT*>(p.x) + static_cast<int64_t>(tok) * p.ldx;
  using QT = typename Q::type;
  QT* qr = reinterpret_cast<QT*>(p.qx + static_cast<int64_t>(tok) * p.hid);
  if constexpr (kGroup) {
    // quantize_per_token_group: one warp per 128-element group, 4 elements a lane.
    const int groups = p.hid / kGroupElems, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int gi = warp; gi < groups; gi += kPrepThreads / 32) {
      float v[4], amax = 0.f;
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        v[u] = to_float(xr[gi * kGroupElems + lane * 4 + u]);
        amax = fmaxf(amax, fabsf(v[u]));
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
      const float scale = amax / Q::kMax;
      if (lane == 0) p.sx[static_cast<int64_t>(tok) * groups + gi] = scale;
#pragma unroll
      for (int u = 0; u < 4; ++u) qr[gi * kGroupElems + lane * 4 + u] = quantize_one<Q>(v[u], scale);
    }
  } else {
    float amax = 0.f;
    for (int i = threadIdx.x; i < p.hid; i += kPrepThreads) amax = fmaxf(amax, fabsf(to_float(xr[i])));
    const float scale = block_max<kPrepThreads>(amax) / Q::kMax;
    if (threadIdx.x == 0) p.sx[tok] = scale;
    for (int i = threadIdx.x; i < p.hid; i += kPrepThreads) qr[i] = quantize_one<Q>(to_float(xr[i]), scale);
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

template <int NT>
__device__ __forceinline__ void load_block_acts_gather(BlockFrags<NT>& f, const uint8_t* const (&arow)[NT], int blk,
                                                       int t, int k) {
  const int base = blk * kBlockBytes + 16 * t;
#pragma unroll
  for (int u = 0; u < kSteps; ++u) {
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const int kk = base + u * kStepBytes;
      f.x[u][j] = (arow[j] != nullptr && kk < k) ? __ldg(reinterpret_cast<const uint4*>(arow[j] + kk))
                                                 : make_uint4(0, 0, 0, 0);
    }
  }
}

// load_block_scales with one scale row per accumulator token (8j + 2t + e): null for a token past the chunk.
template <int NT>
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
        const float sa = in_k && sa_row[j][e] != nullptr ? __ldg(sa_row[j][e] + kb) : 0.f;
        sc.s[hh][j][e] = __fmul_rn(sa, sb);
      }
    }
  }
}

// Warp blocks first, first + step, ... (step = kWarps / R when R tiles share the CTA's warps).
template <class Acc, int NT>
__device__ __forceinline__ void mainloop_gather(Acc (&acc)[NT][4], const uint8_t* wg, int64_t ldw,
                                                const uint8_t* const (&arow)[NT], int first, int end, int step, int t,
                                                int k, uint32_t zero) {
  BlockFrags<NT> f;
  for (int blk = first; blk < end; blk += step) {
    load_block_weights(f, wg, ldw, blk, t, k);
    load_block_acts_gather(f, arow, blk, t, k);
    tie_to_weight_loads(f, zero);
    mma_block(acc, f);
  }
}

template <int NT>
__device__ __forceinline__ void mainloop_gather_scaled(float (&acc)[NT][4], const uint8_t* wg, int64_t ldw,
                                                       const uint8_t* const (&arow)[NT],
                                                       const float* const (&sa_row)[NT][2], const float* sb_row,
                                                       int kgroups, int first, int end, int step, int t, int k,
                                                       uint32_t zero) {
  BlockFrags<NT> f;
  BlockScales<NT> sc;
  for (int blk = first; blk < end; blk += step) {
    load_block_weights(f, wg, ldw, blk, t, k);
    load_block_acts_gather(f, arow, blk, t, k);
    load_block_scales_gather(sc, sa_row, sb_row, kgroups, blk);
    tie_to_weight_loads(f, zero);
    tie_to_scale_loads(f, sc, zero);
    mma_block_scaled(acc, f, sc);
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

// After a chunk's main loop: the warps' accumulators summed in warp order (tile r: warps r, r + R, ...) and each
// (row, token) thread's epilogue value of tile r left in val[r], rounded to the output type (threads with token >= m:
// unspecified). scale_a(token): the row-wise activation scale of chunk row `token` (unused with block scales). All
// threads call it; it synchronizes.
template <class AB, class OutT, int NT, bool kBlockScaled, int R, class ScaleA>
__device__ __forceinline__ void chunk_epilogue(typename AB::Acc (&red)[kWarps][2][32][4],
                                               const typename AB::Acc (&acc)[NT][4], int m, int e, int64_t row0,
                                               const float* wscale, int wscale_per_channel, int64_t n,
                                               const ScaleA& scale_a, float (&val)[R]) {
  using Acc = typename AB::Acc;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  allow_dependent_launch();

  store_warp_acc(red, acc, warp, lane);
  __syncthreads();
  const int row = threadIdx.x % kRows, token = threadIdx.x / kRows;
  if (token < m) {
    const int jt = token / 8, tt = token % 8;
    const int src = (row % 8) * 4 + tt / 2, reg = (row / 8) * 2 + tt % 2;  // warp_order_sum's C-fragment slot
#pragma unroll
    for (int r = 0; r < R; ++r) {
      Acc sum = red[r][jt][src][reg];
#pragma unroll
      for (int w2 = r + R; w2 < kWarps; w2 += R) sum += red[w2][jt][src][reg];
      const int64_t ch = row0 + kRows * r + row;
      if constexpr (kBlockScaled) {
        val[r] = to_float(epilogue_scaled<OutT>(sum, 0.f));
      } else {
        const float sa = scale_a(token);
        const float sb = wscale_per_channel ? wscale[e * n + ch] : wscale[e];
        val[r] = to_float(epilogue<OutT>(sum, sa, sb, 0.f));
      }
    }
  }
  __syncthreads();  // `red` is reused by the next call
}

// R 16-row weight tiles (rows row0 + 16 r .. + 16 of expert e's [N, K] weight at w, r < R) against the chunk's
// m <= 8 NT pairs s.rows[r0 ..]. Warp w works on tile w % R, K blocks w / R, w / R + 8 / R, ...; tile r's value is
// the sum of its warps' accumulators in warp order. R = 1 is grouped_decode's chunk exactly (block b on warp b % 8,
// warp-order reduction). R > 1 is used only when K has at most 8 / R blocks of 256 bytes, so that every warp holds
// at most one block: the partial sums, and their order (block order), are then those of R = 1 (the warps without a
// block add zeros), and the result is bit for bit the same. Leaves each (row, token) thread's epilogue value of tile
// r in val[r], rounded to the output type (threads with token >= m: unspecified). All threads call it; it
// synchronizes.
template <class AB, class OutT, int NT, bool kBlockScaled, int R>
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
  auto row_of = [&](int slot) -> int64_t {
    const int pair = s.rows[r0 + slot];
    return ca.by_token ? pair / p.k : pair;
  };
  const uint8_t* arow[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j) arow[j] = 8 * j + g < m ? ca.a + row_of(8 * j + g) * ca.lda : nullptr;

  Acc acc[NT][4];
  zero_acc(acc);
  if constexpr (kBlockScaled) {
    const int kgroups = k / kGroupBytes;
    const int64_t nb = (n + kGroupBytes - 1) / kGroupBytes;
    const float* sb_row = wscale + (e * nb + wrow0 / kGroupBytes) * kgroups;
    const float* sa_row[NT][2];
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const int slot = 8 * j + 2 * t + q;
        sa_row[j][q] = slot < m ? ca.scale + row_of(slot) * kgroups : nullptr;
      }
    }
    mainloop_gather_scaled(acc, wg, k, arow, sa_row, sb_row, kgroups, warp / R, nblk, kWarps / R, t, k, p.zero);
  } else {
    mainloop_gather(acc, wg, k, arow, warp / R, nblk, kWarps / R, t, k, p.zero);
  }
  chunk_epilogue<AB, OutT, NT, kBlockScaled, R>(red, acc, m, e, row0, wscale, wscale_per_channel, n,
                                                [&](int token) { return ca.scale[row_of(token)]; }, val);
}

// --- fold (EXPERIMENT (A/B)): the activations quantized inside the GEMMs ------------------------------------------
//
// At top_k >= 4 gate/up reads x itself and down_tm reads h itself, both in their float type, and quantize them on
// the way into the A fragments, so that no prep kernel, no quantized copies (qx / sx, q2 / sh) and no completion
// counters exist. Per K block (256 elements of each of the m rows the warp's MMAs use) the WARP quantizes: lane l
// takes elements [8l, 8l + 8) of every row (one 16-byte load of bf16 / fp16, two of fp32), quantizes them with
// quantize_one (the function prep and silu_mul_quant's tail use) and stores the 8 bytes in the warp's slice of shared
// memory; after __syncwarp each lane reads its fragments (16 bytes per step and token tile) from there, as the unfused
// loop reads them from global memory. So a block costs 8 m divisions per lane (not 64 per fragment-holding lane),
// issued while the block's weight loads are in flight. The scales:
//   block (1 x 128 groups): lanes 0-15 hold group 2 blk of the row and lanes 16-31 group 2 blk + 1, so a 16-lane
//     butterfly gives the group's max |v| and scale = max / QMAX; the warp keeps them in shared memory for the
//     block-scale step (which needs the scales of the C fragment's tokens 2t, 2t + 1, not of its own A row);
//   row-wise: one pass over the whole row before the main loop (gate/up: fold_row_scales per chunk; down_tm: per pair,
//     warp_row_amax), scale = max / QMAX.
// A max is exact in any order and the division is the same IEEE division, so every scale and every quantized byte
// equals prep's (quantize_per_token / quantize_per_token_group) and silu_mul_quant's, and the GEMMs see the bytes
// the unfolded path gives them: the results are the chain's bit for bit.
// A warp's rows sit at a 256-byte pitch with the 64-byte halves of odd rows swapped (byte ^ 64), so the fragment
// reads of rows g and g + 1 (one 8-lane phase of an LDS.128) fall in different banks.
template <int kRowsF>
struct FoldShared {
  alignas(16) uint8_t qa[kWarps][kRowsF][kBlockBytes];  // each warp's current block, quantized (swizzled rows)
  float gscale[kWarps][kRowsF][kGroupsPerBlock];        // block scales: the rows' group scales of that block
  float scale[kRowsF];                                  // row-wise: the chunk rows' scales
};
struct NoFold {};

// max |row[0 .. n)| over one warp (n a multiple of 8, row 16-byte aligned); every lane gets it.
template <class T>
__device__ __forceinline__ float warp_row_amax(const T* row, int n, int lane) {
  float amax = 0.f;
#pragma unroll 4
  for (int v = lane; v < n / 8; v += 32) {
    const XVec<T> x = *reinterpret_cast<const XVec<T>*>(row + 8 * v);
#pragma unroll
    for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(to_float(x.v[i])));
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
  return amax;
}

// Elements [blk * 256 + 8 lane, + 8) of `row` (none past k, a multiple of 16) quantized with `scale` (row-wise) or
// with their group's scale (kGroup: computed here over the group's 16 lanes, and returned) into dst's bytes
// [8 lane, + 8) ^ swz. All 32 lanes call it.
template <class XT, class Q, bool kGroup>
__device__ __forceinline__ float fold_block_row(const XT* row, int blk, int k, float scale, uint8_t* dst, int swz,
                                                int lane) {
  const int col = blk * kBlockBytes + 8 * lane;
  const bool in = col < k;
  float v[8];
  if (in) {
    const XVec<XT> x = *reinterpret_cast<const XVec<XT>*>(row + col);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = to_float(x.v[i]);
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = 0.f;
  }
  if constexpr (kGroup) {
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(v[i]));
#pragma unroll
    for (int off = 8; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    scale = amax / Q::kMax;
  }
  if (in) {
    uint2 q;
    q.x = quantize4<Q>(v[0], v[1], v[2], v[3], scale);
    q.y = quantize4<Q>(v[4], v[5], v[6], v[7], scale);
    *reinterpret_cast<uint2*>(dst + ((8 * lane) ^ swz)) = q;
  }
  return scale;
}

// Asks L1 to fetch the line holding global address `p` (prefetch.global.L1): no registers held, nothing to wait for;
// a later load of that line hits L1, or waits on the line already in flight.
__device__ __forceinline__ void prefetch_l1(const void* p) {
  asm volatile("prefetch.global.L1 [%0];" ::"l"(p));
}

// The warp quantizes K block `blk` of its m rows (row_of(r): the row's first element; scale_of(r): its row-wise scale)
// into qa (m x 256 bytes) and, with block scales, their group scales into gs[r][2]. The whole warp calls it.
// Each lane first asks L1 for its 8 elements of rows 1 .. m - 1 (one line a row: 16 or 32 aligned bytes), so that the
// row loop's loads, one row at a time, do not each wait for their own L2 round trip. (Loading 4 rows into registers
// before quantizing them, as quantize_chunk does, made 28 of the 36 fold gate/up' kernels spill, 8 to 144 bytes:
// the block's weight fragments are in flight across the divisions, and the 3-CTA kernels were at 76 of 80 registers.)
template <class XT, class Q, bool kGroup, class RowOf, class ScaleOf>
__device__ __forceinline__ void fold_block(const RowOf& row_of, const ScaleOf& scale_of, int m, int blk, int k,
                                           uint8_t* qa, float* gs, int lane) {
  if (blk * kBlockBytes + 8 * lane < k) {
#pragma unroll 1
    for (int r = 1; r < m; ++r) prefetch_l1(row_of(r) + blk * kBlockBytes + 8 * lane);
  }
  __syncwarp();  // every lane has read the previous block's fragments
#pragma unroll 1
  for (int r = 0; r < m; ++r) {
    const float sc = fold_block_row<XT, Q, kGroup>(row_of(r), blk, k, kGroup ? 0.f : scale_of(r),
                                                   qa + r * kBlockBytes, (r & 1) << 6, lane);
    if constexpr (kGroup) {
      if (lane % 16 == 0) gs[r * kGroupsPerBlock + lane / 16] = sc;
    }
  }
  __syncwarp();  // the block is in shared memory
}

// The A fragments of block `blk` from the warp's quantized rows (as load_block_acts_gather: zeros for a row >= m or
// past K).
template <int NT>
__device__ __forceinline__ void load_block_acts_fold(BlockFrags<NT>& f, const uint8_t* qa, int m, int blk, int g,
                                                     int t, int k) {
#pragma unroll
  for (int u = 0; u < kSteps; ++u) {
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const int r = 8 * j + g;
      const int kk = blk * kBlockBytes + u * kStepBytes + 16 * t;
      f.x[u][j] = (r < m && kk < k) ? *reinterpret_cast<const uint4*>(
                                          qa + r * kBlockBytes + ((u * kStepBytes + 16 * t) ^ ((r & 1) << 6)))
                                    : make_uint4(0, 0, 0, 0);
    }
  }
}

// load_block_scales_gather with the activation group scales from the warp's gs[r][2] (fold_block).
template <int NT>
__device__ __forceinline__ void load_block_scales_fold(BlockScales<NT>& sc, const float* gs, const float* sb_row,
                                                       int kgroups, int m, int blk, int t) {
#pragma unroll
  for (int hh = 0; hh < kGroupsPerBlock; ++hh) {
    const int kb = blk * kGroupsPerBlock + hh;
    const bool in_k = kb < kgroups;
    const float sb = in_k ? __ldg(sb_row + kb) : 0.f;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int r = 8 * j + 2 * t + e;
        const float sa = in_k && r < m ? gs[r * kGroupsPerBlock + hh] : 0.f;
        sc.s[hh][j][e] = __fmul_rn(sa, sb);
      }
    }
  }
}

// Row-wise fold: fs.scale[r] = max |x[token of chunk row r]| / QMAX for r < m (prep's per-token scale). Warp w
// takes rows w, w + 8. All threads call it; it synchronizes.
template <class XT, class Q, int kRowsF>
__device__ __forceinline__ void fold_row_scales(const MoeDecodeParams& p, const SlotShared& s, int r0, int m,
                                                FoldShared<kRowsF>& fs) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int r = warp; r < m; r += kWarps) {
    const XT* row = static_cast<const XT*>(p.x) + static_cast<int64_t>(s.rows[r0 + r] / p.k) * p.ldx;
    const float amax = warp_row_amax(row, p.hid, lane);
    if (lane == 0) fs.scale[r] = amax / Q::kMax;
  }
  __syncthreads();
}

// tiles_chunk (R = 1) for gate/up with x quantized in the main loop (fold_block): the same weight loads, block-to-warp
// assignment, MMAs, block-scale steps, reduction and epilogue, on the same quantized bytes and scales (row-wise: the
// chunk rows' scales in fs.scale, from fold_row_scales).
template <class AB, class OutT, int NT, bool kBlockScaled, class XT, int kRowsF>
__device__ __forceinline__ void tiles_chunk_fold(const MoeDecodeParams& p, const SlotShared& s, FoldShared<kRowsF>& fs,
                                                 const uint8_t* w, const float* wscale, int wscale_per_channel,
                                                 int64_t n, int k, int r0, int m, int64_t row0,
                                                 typename AB::Acc (&red)[kWarps][2][32][4], float (&val)[1]) {
  static_assert(8 * NT <= kRowsF, "the chunk's rows fit the fold buffer");
  using Acc = typename AB::Acc;
  using Q = typename AB::Q;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int e = s.expert;
  const uint8_t* wg = w + static_cast<int64_t>(e) * n * k + (row0 + g) * k + 16 * t;
  const int nblk = (k + kBlockBytes - 1) / kBlockBytes;
  uint8_t* qa = &fs.qa[warp][0][0];
  float* gs = &fs.gscale[warp][0][0];
  auto row_of = [&](int r) {
    return static_cast<const XT*>(p.x) + static_cast<int64_t>(s.rows[r0 + r] / p.k) * p.ldx;
  };
  auto scale_of = [&](int r) { return fs.scale[r]; };

  Acc acc[NT][4];
  zero_acc(acc);
  BlockFrags<NT> f;
  if constexpr (kBlockScaled) {
    const int kgroups = k / kGroupBytes;
    const int64_t nb = (n + kGroupBytes - 1) / kGroupBytes;
    const float* sb_row = wscale + (e * nb + row0 / kGroupBytes) * kgroups;
    BlockScales<NT> sc;
    for (int blk = warp; blk < nblk; blk += kWarps) {
      load_block_weights(f, wg, k, blk, t, k);
      fold_block<XT, Q, true>(row_of, scale_of, m, blk, k, qa, gs, lane);
      load_block_acts_fold(f, qa, m, blk, g, t, k);
      load_block_scales_fold(sc, gs, sb_row, kgroups, m, blk, t);
      tie_to_weight_loads(f, p.zero);
      tie_to_scale_loads(f, sc, p.zero);
      mma_block_scaled(acc, f, sc);
    }
  } else {
    for (int blk = warp; blk < nblk; blk += kWarps) {
      load_block_weights(f, wg, k, blk, t, k);
      fold_block<XT, Q, false>(row_of, scale_of, m, blk, k, qa, gs, lane);
      load_block_acts_fold(f, qa, m, blk, g, t, k);
      tie_to_weight_loads(f, p.zero);
      mma_block(acc, f);
    }
  }
  chunk_epilogue<AB, OutT, NT, kBlockScaled, 1>(red, acc, m, e, row0, wscale, wscale_per_channel, n, scale_of, val);
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
  if constexpr (kGroup) {
    const int groups = inter / kGroupElems, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int gi = warp; gi < groups; gi += kWarps) {
      float v[4], amax = 0.f;
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        v[u] = hval(gi * kGroupElems + lane * 4 + u);
        amax = fmaxf(amax, fabsf(v[u]));
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
      const float scale = amax / Q::kMax;
      if (lane == 0) p.sh[static_cast<int64_t>(pair) * groups + gi] = scale;
#pragma unroll
      for (int u = 0; u < 4; ++u) qr[gi * kGroupElems + lane * 4 + u] = quantize_one<Q>(v[u], scale);
    }
  } else {
    float amax = 0.f;
    for (int i = threadIdx.x; i < inter; i += kThreads) amax = fmaxf(amax, fabsf(hval(i)));
    const float scale = block_max<kThreads>(amax) / Q::kMax;
    if (threadIdx.x == 0) p.sh[pair] = scale;
    for (int i = threadIdx.x; i < inter; i += kThreads) qr[i] = quantize_one<Q>(hval(i), scale);
  }
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
template <int kMaxNT, bool kBlockScaled>
constexpr int kCtasPerSm = kMaxNT == 1 && !kBlockScaled ? 3 : 2;

// --- gate/up: grid (I / 16, slots) --------------------------------------------------------------------------------

// XT void: x comes quantized by prep, and the last CTA of each pair quantizes h (the counters). XT the type of x
// (fold, EXPERIMENT (A/B)): x quantized in the main loop, h only stored (down_tm quantizes it).
template <class AB, class OutT, int kMaxNT, bool kBlockScaled, class XT = void>
__global__ void __launch_bounds__(kThreads, (kCtasPerSm<kMaxNT, kBlockScaled>))
    moe_decode_gate_up_kernel(MoeDecodeParams p) {
  using Acc = typename AB::Acc;
  using Q = typename AB::Q;
  constexpr bool kFold = !std::is_void_v<XT>;
  using FS = std::conditional_t<kFold, FoldShared<8 * kMaxNT>, NoFold>;
  __shared__ alignas(16) Acc red[kWarps][2][32][4];
  __shared__ SlotShared s;
  __shared__ FS fs;
  wait_for_producers();  // topk_ids and weights (routing), x, qx / sx (prep)
  find_slot_pairs(p, static_cast<int>(blockIdx.y), s);
  if (s.expert < 0) return;
  const int inter = p.inter, hid = p.hid;
  const int64_t n13 = 2 * static_cast<int64_t>(inter);
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kRows;
  const ChunkA ca{p.qx, hid, p.sx, 1};
  constexpr int kChunk = 8 * kMaxNT;
  const int row = threadIdx.x % kRows, token = threadIdx.x / kRows;
  if constexpr (kFold && !kBlockScaled) {
    // Row-wise fold: fold_row_scales (a pass over each chunk row's x, then a barrier) runs before the first weight
    // load. So that the weight stream starts as early as in the unfolded kernel, first ask L2 for every warp's first
    // K block (warp w's first load_block_weights reads block w: bytes [0, min(H, 2048)) of each row) of the CTA's 16
    // gate rows (warps 0-3) and 16 up rows (warps 4-7), one bulk prefetch per row from lanes 0-3 of each warp (the
    // prefetch takes a warp-uniform address: 4 per warp, not 32). A hint only: no registers held, nothing to wait
    // for, the loads and the arithmetic unchanged.
    const int lane = threadIdx.x % 32;
    if (lane < 4) {
      const int r = 4 * static_cast<int>(threadIdx.x / 32) + lane;  // 0 .. 31
      const int64_t wrow = static_cast<int64_t>(s.expert) * n13 + (r < kRows ? 0 : inter) + n0 + r % kRows;
      prefetch_l2(p.w13 + wrow * hid, static_cast<uint32_t>(min(hid, kChunkBytes)));  // H % 16 == 0
    }
  }
  for (int r0 = 0; r0 < s.m; r0 += kChunk) {
    const int m = min(kChunk, s.m - r0);
    float gate[1], up[1];
    if constexpr (kFold) {
      if constexpr (!kBlockScaled) fold_row_scales<XT, Q>(p, s, r0, m, fs);
      if (kMaxNT == 1 || m <= 8) {
        tiles_chunk_fold<AB, OutT, 1, kBlockScaled, XT>(p, s, fs, p.w13, p.s13, p.s13_per_channel, n13, hid, r0, m,
                                                        n0, red, gate);
        tiles_chunk_fold<AB, OutT, 1, kBlockScaled, XT>(p, s, fs, p.w13, p.s13, p.s13_per_channel, n13, hid, r0, m,
                                                        inter + n0, red, up);
      } else if constexpr (kMaxNT == 2) {
        tiles_chunk_fold<AB, OutT, 2, kBlockScaled, XT>(p, s, fs, p.w13, p.s13, p.s13_per_channel, n13, hid, r0, m,
                                                        n0, red, gate);
        tiles_chunk_fold<AB, OutT, 2, kBlockScaled, XT>(p, s, fs, p.w13, p.s13, p.s13_per_channel, n13, hid, r0, m,
                                                        inter + n0, red, up);
      }
    } else if (kMaxNT == 1 || m <= 8) {
      tiles_chunk<AB, OutT, 1, kBlockScaled, 1>(p, s, ca, p.w13, p.s13, p.s13_per_channel, n13, hid, r0, m, n0, red,
                                                gate);
      tiles_chunk<AB, OutT, 1, kBlockScaled, 1>(p, s, ca, p.w13, p.s13, p.s13_per_channel, n13, hid, r0, m,
                                                inter + n0, red, up);
    } else {
      tiles_chunk<AB, OutT, 2, kBlockScaled, 1>(p, s, ca, p.w13, p.s13, p.s13_per_channel, n13, hid, r0, m, n0, red,
                                                gate);
      tiles_chunk<AB, OutT, 2, kBlockScaled, 1>(p, s, ca, p.w13, p.s13, p.s13_per_channel, n13, hid, r0, m,
                                                inter + n0, red, up);
    }
    if (token < m) {
      // silu_mul (quant/silu_mul.cu): silu rounded to the output type, then the product, rounded
      const OutT act = from_float<OutT>(gate[0] / (1.f + expf(-gate[0])));
      const OutT hv = from_float<OutT>(__fmul_rn(to_float(act), up[0]));
      const int pair = s.rows[r0 + token];
      static_cast<OutT*>(p.h)[static_cast<int64_t>(pair) * inter + n0 + row] = hv;
    }
    if constexpr (!kFold) {
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
    // fold: the next chunk's first writes to shared memory (fs.scale, fs.qa, red) follow tiles_chunk_fold's final
    // barrier, after every read of this chunk's.
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
// kFold (EXPERIMENT (A/B)): the warp reads the pair's h row (the output type) and quantizes it itself, block by block
// (fold_block; row-wise, the pair's scale from a pass over the row first), instead of reading q2 / sh.
template <class AB, class OutT, bool kBlockScaled, bool kFold = false>
__global__ void __launch_bounds__(kThreads, 2) moe_decode_down_tm_kernel(MoeDecodeParams p) {
  using Acc = typename AB::Acc;
  using Q = typename AB::Q;
  __shared__ float s_prod[kMaxPairs][kRows];
  __shared__ int s_routed[kMaxPairs];
  __shared__ alignas(16) uint8_t s_qa[kFold ? kWarps : 1][kFold ? kBlockBytes : 16];  // fold: each warp's block
  __shared__ float s_gs[kFold ? kWarps : 1][kGroupsPerBlock];                       // fold: its group scales
  wait_for_producers();  // h, or q2 / sh (gate/up)
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
    const uint8_t* arow[1] = {g == 0 && !kFold ? p.q2 + static_cast<int64_t>(pair) * inter : nullptr};
    // fold: the pair's h row, its row-wise scale (prep's arithmetic: max |h| / QMAX), the warp's buffers
    const OutT* hrow = static_cast<const OutT*>(p.h) + static_cast<int64_t>(pair) * inter;
    [[maybe_unused]] float sa_fold = 0.f;  // row-wise: computed with block 0's weights in flight
    auto row_of = [&](int) { return hrow; };
    auto scale_of = [&](int) { return sa_fold; };
    uint8_t* qa = &s_qa[0][0] + (kFold ? warp * kBlockBytes : 0);
    float* gs = &s_gs[kFold ? warp : 0][0];
    Acc acc[kWarps][1][4];
#pragma unroll
    for (int v = 0; v < kWarps; ++v) zero_acc(acc[v]);
    BlockFrags<1> f;
    if constexpr (kBlockScaled) {
      const int kgroups = inter / kGroupBytes;
      const int64_t nb = (hid + kGroupBytes - 1) / kGroupBytes;
      const float* sb_row = p.s2 + (e * nb + n0 / kGroupBytes) * kgroups;
      const float* sa_row[1][2] = {
          {t == 0 && !kFold ? p.sh + static_cast<int64_t>(pair) * kgroups : nullptr, nullptr}};
      BlockScales<1> sc;
      for (int base = 0; base < nblk; base += kWarps) {
#pragma unroll
        for (int v = 0; v < kWarps; ++v) {
          const int blk = base + v;
          if (blk < nblk) {
            load_block_weights(f, wg, inter, blk, t, inter);
            if constexpr (kFold) {
              fold_block<OutT, Q, true>(row_of, scale_of, 1, blk, inter, qa, gs, lane);
              load_block_acts_fold(f, qa, 1, blk, g, t, inter);
              load_block_scales_fold(sc, gs, sb_row, kgroups, 1, blk, t);
            } else {
              load_block_acts_gather(f, arow, blk, t, inter);
              load_block_scales_gather(sc, sa_row, sb_row, kgroups, blk);
            }
            tie_to_weight_loads(f, p.zero);
            tie_to_scale_loads(f, sc, p.zero);
            mma_block_scaled(acc[v], f, sc);
          }
        }
      }
    } else {
      for (int base = 0; base < nblk; base += kWarps) {
#pragma unroll
        for (int v = 0; v < kWarps; ++v) {
          const int blk = base + v;
          if (blk < nblk) {
            load_block_weights(f, wg, inter, blk, t, inter);
            if constexpr (kFold) {
              if (blk == 0) sa_fold = warp_row_amax(hrow, inter, lane) / Q::kMax;
              fold_block<OutT, Q, false>(row_of, scale_of, 1, blk, inter, qa, gs, lane);
              load_block_acts_fold(f, qa, 1, blk, g, t, inter);
            } else {
              load_block_acts_gather(f, arow, blk, t, inter);
            }
            tie_to_weight_loads(f, p.zero);
            mma_block(acc[v], f);
          }
        }
      }
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
          const float sa = kFold ? sa_fold : p.sh[pair];
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

template <class AB, class OutT, bool kBlockScaled>
void launch_gemms(const MoeDecodeParams& p, int slots, cudaStream_t stream, bool pdl) {
  const dim3 g13(static_cast<unsigned>(p.inter / kRows), static_cast<unsigned>(slots));
  const int r = down_tiles(p.inter, p.hid);
  const bool tm = down_token_major(p.k);
  if (p.pairs <= 8) {
    C10_CUDA_CHECK(launch_kernel(moe_decode_gate_up_kernel<AB, OutT, 1, kBlockScaled>, g13, dim3(kThreads), 0,
                                 stream, pdl, p));
    if (!tm) launch_down<AB, OutT, 1, kBlockScaled>(p, r, static_cast<unsigned>(slots), stream, pdl);
  } else {
    C10_CUDA_CHECK(launch_kernel(moe_decode_gate_up_kernel<AB, OutT, 2, kBlockScaled>, g13, dim3(kThreads), 0,
                                 stream, pdl, p));
    if (!tm) launch_down<AB, OutT, 2, kBlockScaled>(p, r, static_cast<unsigned>(slots), stream, pdl);
  }
  if (tm) {
    const dim3 g2(static_cast<unsigned>(p.hid / kRows), static_cast<unsigned>(p.t));
    C10_CUDA_CHECK(launch_kernel(moe_decode_down_tm_kernel<AB, OutT, kBlockScaled>, g2, dim3(kThreads), 0, stream,
                                 pdl, p));
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

// EXPERIMENT (A/B), fold: gate/up quantizing x (moe_route -> gate/up -> down_tm, PDL between them), top_k >= 4.
template <class XT, class AB, class OutT, bool kBlockScaled>
void launch_fold(const MoeDecodeParams& p, int slots, cudaStream_t stream, bool pdl) {
  const dim3 g13(static_cast<unsigned>(p.inter / kRows), static_cast<unsigned>(slots));
  if (p.pairs <= 8) {
    C10_CUDA_CHECK(launch_kernel(moe_decode_gate_up_kernel<AB, OutT, 1, kBlockScaled, XT>, g13, dim3(kThreads), 0,
                                 stream, pdl, p));
  } else {
    C10_CUDA_CHECK(launch_kernel(moe_decode_gate_up_kernel<AB, OutT, 2, kBlockScaled, XT>, g13, dim3(kThreads), 0,
                                 stream, pdl, p));
  }
  const dim3 g2(static_cast<unsigned>(p.hid / kRows), static_cast<unsigned>(p.t));
  C10_CUDA_CHECK(launch_kernel(moe_decode_down_tm_kernel<AB, OutT, kBlockScaled, true>, g2, dim3(kThreads), 0, stream,
                               pdl, p));
}

template <class XT, class AB, class OutT, bool kBlockScaled>
void launch_path(const MoeDecodeParams& p, bool group, int slots, cudaStream_t stream, bool pdl) {
  if (p.fold) {
    launch_fold<XT, AB, OutT, kBlockScaled>(p, slots, stream, pdl);
    return;
  }
  launch_prep<XT, typename AB::Q, OutT>(p, group, stream, pdl);
  launch_gemms<AB, OutT, kBlockScaled>(p, slots, stream, pdl);
}

// EXPERIMENT (A/B): CUTLASS_W8A8_MOE_FOLD=0 keeps the three-kernel form at top_k >= 4 (prep, gate/up with its
// last-CTA tail, down_tm on q2 / sh); unset or anything else: the folded two-kernel one. Read on every call (a
// getenv, no driver query) so that one process can time both by setting os.environ between captures. Delete it and
// the losing path after the A/B.
bool moe_fold_enabled() {
  const char* v = std::getenv("CUTLASS_W8A8_MOE_FOLD");
  return v == nullptr || std::string(v) != "0";
}

}  // namespace

at::Tensor moe_decode_experts(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                              const at::Tensor& w13, const at::Tensor& w13_scale, const at::Tensor& w2,
                              const at::Tensor& w2_scale, int64_t group_size, at::ScalarType out_dtype) {
  constexpr const char* op = "moe_decode_experts";
  moe::check_decode_experts(op, x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, group_size, out_dtype);
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

  const bool fold = down_token_major(k) && moe_fold_enabled();  // EXPERIMENT (A/B)
  at::Tensor x2 = x.stride(1) == 1 ? x : x.contiguous();
  if (fold) {
    // The folded gate/up reads x in 16-byte vectors: rows 16-byte aligned (a fresh copy when a view is not).
    const int64_t ldx_bytes = (t > 1 ? x2.stride(0) : hid) * static_cast<int64_t>(x2.element_size());
    if (reinterpret_cast<uintptr_t>(x2.data_ptr()) % 16 != 0 || ldx_bytes % 16 != 0) {
      x2 = x2.clone(at::MemoryFormat::Contiguous);
    }
  }
  const at::Tensor tw = topk_weights.contiguous();
  // One workspace: qx [T, H] | sx | h [P, I] (2-byte output type) | q2 [P, I] | sh | y [P, H] f32 | counters;
  // fold: h only.
  const int64_t sx_n = group ? t * (hid / limits::kBlockSize) : t;
  const int64_t sh_n = group ? pairs * (inter / limits::kBlockSize) : pairs;
  const int64_t cnt_n = pairs + t * (hid / kRows);
  int64_t off = 0;
  const int64_t o_h = off; off += align16(pairs * inter * 2);
  const int64_t o_qx = off; off += fold ? 0 : align16(t * hid);
  const int64_t o_sx = off; off += fold ? 0 : align16(sx_n * 4);
  const int64_t o_q2 = off; off += fold ? 0 : align16(pairs * inter);
  const int64_t o_sh = off; off += fold ? 0 : align16(sh_n * 4);
  const int64_t o_y = off; off += fold ? 0 : align16(pairs * hid * 4);
  const int64_t o_cnt = off; off += fold ? 0 : align16(cnt_n * 4);
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
  if (!fold) {
    p.qx = base + o_qx;
    p.sx = reinterpret_cast<float*>(base + o_sx);
    p.q2 = base + o_q2;
    p.sh = reinterpret_cast<float*>(base + o_sh);
    p.y = reinterpret_cast<float*>(base + o_y);
    p.cnt13 = reinterpret_cast<int*>(base + o_cnt);
    p.cnt2 = p.cnt13 + pairs;
  }
  p.fold = fold ? 1 : 0;
  p.out = out.data_ptr();
  p.t = static_cast<int>(t);
  p.k = static_cast<int>(k);
  p.pairs = static_cast<int>(pairs);
  p.e = static_cast<int>(e);
  p.hid = static_cast<int>(hid);
  p.inter = static_cast<int>(inter);
  p.zero = 0;

  cudaStream_t stream = current_stream(x);
  // T is in the grids: an UpdatableGraph cannot rewrite these launches (as grouped_scaled_mm's).
  graph_nodes::refuse_launch(stream, op);
  const bool pdl = kernels_use_pdl(device);
  const int slots = static_cast<int>(std::min<int64_t>(e, pairs));
  with_decode_types(int8, out_dtype == at::kBFloat16, [&](auto ab_tag, auto out_tag) {
    using AB = decltype(ab_tag);
    using OutT = decltype(out_tag);
    auto with_x = [&](auto x_tag) {
      using XT = decltype(x_tag);
      if constexpr (std::is_same_v<AB, Fp8Ab>) {
        if (group) {
          launch_path<XT, AB, OutT, true>(p, group, slots, stream, pdl);
          return;
        }
      }
      launch_path<XT, AB, OutT, false>(p, group, slots, stream, pdl);
    };
    switch (x2.scalar_type()) {
      case at::kBFloat16: with_x(__nv_bfloat16{}); break;
      case at::kHalf: with_x(__half{}); break;
      default: with_x(float{}); break;
    }
  });
  return out;
}

}  // namespace cutlass_w8a8
