// decode_attention: one query token per sequence attending to its own KV-cache slot (a decode step).
//
//   kvh = h / (H / KVH),  K = kv_cache[slots[b], 0, kvh],  V = kv_cache[slots[b], 1, kvh]
//   p_s = softmax_{s <= positions[b]}(softmax_scale * <q[b, h], K[s]>)
//   out[b, h * D : (h + 1) * D] = round(sum_{s <= positions[b]} p_s V[s])
//
// decode_attention_quant: the same row, rounded to q's dtype, then quantized per token (or with a static scale)
// for the o_proj GEMM, exactly as quantize_per_token / quantize_per_tensor would quantize the stored row: o_proj's
// activation quantization folded into attention, one kernel fewer per layer.
//
// Only positions 0..positions[b] of one slot are read, so the cost grows with the real batch and the real
// sequence lengths, not with the cache's size. All arithmetic is float32 and the result is rounded once to
// q's dtype. Scores are kept in base 2 (q is pre-multiplied by softmax_scale * log2(e), exp2f replaces
// expf: flash-attention's form of the same softmax).
//
// Method: split-KV ("flash-decoding", Dao, Haziza, Massa, Sizov 2023) over the online softmax (Milakov &
// Gimelshein 2018, "Online normalizer calculation for softmax"), in two kernels, or in one where a row's work fits a
// thread-block cluster (the fused path below; fused_plan decides, same bits either way):
//
//   decode_attention_split_kernel, grid (B, H / G', splits), 4 warps. CTA (b, y, z) takes the G' query heads
//     y G' .. y G' + G' - 1, which share one key/value head (G' = the largest of 8, 4, 2, 1 dividing the GQA
//     group H / KVH, at most CUTLASS_W8A8_ATTN_HEADS_PER_CTA: every K and V row the CTA reads serves G' heads),
//     and chunk z of row b's positions 0..positions[b]. The chunk length is computed on the device from
//     positions[b] (split_chunk below), so the grid -- chosen on the host from B, H, G', S, the SM count, the split
//     kernel's occupancy (the default wave rule's input) and the per-process knobs only -- stays valid in a CUDA
//     graph whose positions change between replays. Inside a CTA, a "group" of kLanes lanes handles one position at a
//     time, each lane owning kVecs 16-byte slices of D (dot products: a shuffle reduction over the group); the
//     32 / kLanes groups of a warp read consecutive positions, kUnroll positions per group and step. Each group
//     keeps, per head, its running max m, running sum l and float32 accumulator; groups merge by shuffles, warps
//     through shared memory:
//       M = max_i m_i,  l = sum_i l_i 2^(m_i - M),  acc = sum_i acc_i 2^(m_i - M).
//     The CTA writes (M, l) and acc (unnormalized) per (b, h, z) to a float32 workspace from the caching
//     allocator.
//   decode_attention_combine_cluster_kernel (sm90, H * D <= 8192), grid (B, 8), a cluster of 8 CTAs of 128 threads
//     per row: CTA y merges the active splits of its eighth of row b's H * D / 4 output vectors (one or two per
//     thread, up to 8 loads in flight each), out = acc / l, rounds to q's dtype, and stores its part or quantizes
//     it with the row's scale (the row amax: a max over the cluster). Rows elsewhere (other archs, longer rows,
//     CUTLASS_W8A8_ATTN_COMBINE=row): decode_attention_combine_kernel, grid (B), 1024 threads, the whole row in one
//     CTA. Both end in rowwise_reduce.cuh's finish_regs / finish_loop (the code the row-wise quantization kernels
//     use), so the result equals quantize_per_token(decode_attention(...)) bit for bit, and the two combine kernels
//     give the same bits (the same weights, the same fmaf chain per element, an exact max).
//
//   decode_attention_fused_kernel (sm90, 16-bit q, 32 < D <= 128), grid (B, C), one cluster of C CTAs per row: the
//     split kernel's (head group, split) CTAs of row b become 4-warp "units", U per CTA, running the same code
//     (split_partial) into shared memory; after a cluster barrier each CTA merges part of the row from the units'
//     results through distributed shared memory with the combine's code (split_weights, merge_splits) and stores
//     or quantizes it (the row amax: a max over the cluster). One launch, no workspace, no second kernel. It serves
//     when the row's (H / G') x splits units fit 16 CTAs (at the default cap of 4 heads per CTA, Qwen3-30B-A3B and
//     Llama-3-8B alike at S = 128: 8 x 4 units in 16 CTAs of 2; at a cap of 8, Qwen3 at S = 256: 4 x 8); else
//     (S = 256 at B 1 at the default cap, long caches at small B: more splits) the two kernels run.
//
// Before (one CTA per (row, head), no split; H100, Llama-3-8B heads 32 / 8 x 128, bf16): B = 1 at position 256
// took about 10 us per layer, latency-bound on 32 CTAs each stepping through its positions. The two kernels (H200,
// Qwen3-30B-A3B 32 / 4 x 128, S = 512, B = 1, CUDA graph): ~15.6 us per layer together.
//
// A/B knobs (issue 36), environment variables read once per process on the host; unset is the default, and a bad
// value raises a ValueError naming the variable before any launch:
//   CUTLASS_W8A8_ATTN_SPLITS=ctas (split_rule_waves) the split count of the CTAs-per-SM rule (choose_splits) in
//     place of the default wave rule's (the fewest waves of resident CTAs times positions per CTA);
//   CUTLASS_W8A8_ATTN_MIN_CHUNK   (min_chunk)    the least positions per split of a full cache (default kMinChunk);
//   CUTLASS_W8A8_ATTN_CTAS_PER_SM (ctas_per_sm)  the split CTAs per SM the ctas rule aims at, in [1, 16] (default 2;
//     read and checked under either rule, used by the ctas rule only);
//   CUTLASS_W8A8_ATTN_HEADS_PER_CTA (heads_per_cta_cap) the most query heads per CTA, 1, 2, 4 or 8 (default 4):
//     G' = the largest of 8, 4, 2, 1 dividing the group and at most it (both kernels, the split count, the fused
//     plan); at the same split count the same bits (a head's math does not depend on the CTA's other heads), but
//     the count follows the (row, head group) pairs and, under the wave rule, the launched variant's occupancy;
//     these four change the splits, hence the bits (still from shapes and the split kernel's occupancy only: a
//     captured graph replays as eager runs);
//   CUTLASS_W8A8_ATTN_PREFETCH=1  (attn_prefetch) split_partial issues step i + 1's K and V loads before step i's
//     math (a second register buffer; both kernels): the same float operations in the same order, so the same
//     bits at the same split count; under the wave rule the count follows the launched variant's occupancy, which
//     its registers may lower (then other splits, other bits; SPLITS=ctas keeps the count).
//   CUTLASS_W8A8_ATTN_COMBINE=row (combine_cluster_allowed) the one-CTA-per-row combine where the cluster combine
//     would serve (default: cluster): the same bits.
//
// Row-wise (csrc/graphs/graph_nodes.hpp): block (x, y, z) of any of the kernels reads only row x's inputs and writes
// only row x's outputs and workspace (the fused kernel's and the cluster combine's clusters span y only), and the one
// kernel argument chosen from B (the split count, which sizes the workspace and, in the fused path, the cluster)
// stays valid for fewer rows, so a captured node can be shrunk to fewer rows by its gridDim.x alone (an update keeps
// the fused kernel's cluster dimension, a launch attribute; the cluster combine's is compiled in). PDL: every kernel
// signals its dependents at its start and waits on griddepcontrol before reading anything (core/launch_policy.hpp);
// no host synchronisation, no allocation beyond the outputs and the workspace.
//
// Not checked (it would need a host synchronisation): slots in [0, num_slots) and positions in [0, S).
// The kernels clamp both into range, so a bad value reads the wrong (but allocated) cache entries instead of
// faulting; callers (LlamaDecoder, DecodeGraphRunner) validate them on the host.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include "core/checks.hpp"
#include "core/device.hpp"
#include "core/knobs.hpp"
#include "core/launch_policy.hpp"
#include "core/limits.hpp"
#include "graphs/graph_nodes.hpp"
#include "ops.hpp"
#include "quant/rowwise_args.hpp"
#include "quant/rowwise_reduce.cuh"

namespace cutlass_w8a8 {
namespace {

constexpr const char* kOp = "decode_attention";
constexpr const char* kQuantOp = "decode_attention_quant";
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kUnroll = 4;       // positions per group and step (loads issued before the math)
constexpr int64_t kMaxHeads = limits::kAttnMaxHeads;  // H: gridDim.y
constexpr float kLog2e = 1.4426950408889634f;
constexpr int kChunkAlign = 8;   // split chunks are multiples of this many positions
// The host never splits a cache of S positions into more than S / kMinChunk. 32, not 64: on one H200 (split + combine,
// CUDA graph, PDL on) Qwen3-30B-A3B's B 1 / S 512 took 12.85 us at 32, 15.67 at 64 and 14.93 at 16, Llama-3-8B's
// 10.56 / 11.31 / 12.66; B 8 and S 4096 were the same at 32 and 64 (two CTAs per SM bound the splits there);
// bench/results/decode_attention_min_chunk_nvidia-h200.md
constexpr int kMinChunk = 32;
constexpr int kMaxSplits = 64;
constexpr int kCtasPerSm = 2;  // choose_splits' ctas rule: about this many split CTAs per SM (..._CTAS_PER_SM)
constexpr int kMaxHeadsPerCta = 8;  // the kernels are instantiated for G' in {1, 2, 4, 8}: at most this many heads
constexpr int kDefaultHeadsPerCta = 4;  // heads_per_cta_cap's default (..._HEADS_PER_CTA unset): see there
constexpr int kCombineThreads = 1024;  // one thread per 4 outputs of a Llama-3 row (H * D = 4096)
constexpr int kCombineVecs = 2;  // combine: up to 2 vectors of 4 elements per thread in registers (H * D <= 8192)
constexpr int64_t kCombineSmemFloats = 8192;  // combine: at most this many split weights (32 KiB of shared memory)
constexpr int kCombineCluster = 8;             // the cluster combine: CTAs per row (the portable cluster size)
constexpr int kCombineClusterThreads = 128;    // ... threads per CTA: one output vector each for H * D <= 4096
constexpr int kCombineBatch = 8;               // ... split loads in flight per thread (merge_splits)
static_assert(kCombineBatch >= 4 && kCombineBatch <= kMaxSplits, "the cluster combine's loads in flight");

// Element conversions (to_float, from_float), PDL (allow_dependent_launch, wait_for_producers) and the row tails
// (finish_regs, finish_loop): csrc/quant/rowwise_reduce.cuh.

// 2^(m - ref), with 0 for an empty partial result (m = -inf): never (-inf) - (-inf).
__device__ __forceinline__ float rescale(float m, float ref) { return m == -INFINITY ? 0.f : exp2f(m - ref); }

template <class T>
struct Args {
  const T* q;                 // (B, H, D), strides q_stride_b, q_stride_h, 1
  int64_t q_stride_b;
  int64_t q_stride_h;
  bool q_vec16;               // q's pointer and both strides 16-byte aligned: split_partial loads q in 16-byte vectors
  const T* kv;                // (num_slots, 2, KVH, S, D) contiguous, 16-byte aligned
  int64_t num_slots;
  int heads;                  // H
  int kv_heads;
  int seq_len;                // S
  int head_dim;               // D
  int group_size;             // H / KVH: query heads per key/value head
  const int64_t* slots;       // (B,), stride slots_stride
  int64_t slots_stride;
  const int64_t* positions;   // (B,), stride positions_stride
  int64_t positions_stride;
  float scale_log2;           // softmax_scale * log2(e)
  int splits;                 // gridDim.z of the split kernel
  float* part_acc;            // workspace: (B, H, splits, D) float32, unnormalized accumulators
  float2* part_ml;            // workspace: (B, H, splits) (running max M, running sum l)
  // combine outputs: out (B, H * D) contiguous, in T (decode_attention) or the 8-bit type (decode_attention_quant)
  void* out;
  float* scales;              // decode_attention_quant: (B,) row scales
  const float* static_scale;  // decode_attention_quant with a static per-tensor scale, else null
};

// Row b's attended length (positions 0..pos, clamped into the cache) and its chunk length per split: both kernels
// compute them the same way from the same inputs, so the combine reads exactly the splits that ran.
template <class T>
__device__ __forceinline__ int row_length(const Args<T>& a, int64_t b) {
  int64_t pos = a.positions[b * a.positions_stride];
  pos = pos < 0 ? 0 : (pos >= a.seq_len ? a.seq_len - 1 : pos);
  return static_cast<int>(pos) + 1;
}
// Row b's cache slot, clamped into range. The kernels load it beside positions[b] (row_length), before anything
// waits on that load: b < B, so the read is in bounds even for a split that then finds no work.
template <class T>
__device__ __forceinline__ int64_t row_slot(const Args<T>& a, int64_t b) {
  const int64_t slot = a.slots[b * a.slots_stride];
  return slot < 0 ? 0 : (slot >= a.num_slots ? a.num_slots - 1 : slot);
}
__device__ __forceinline__ int split_chunk(int len, int splits) {
  const int per = (len + splits - 1) / splits;
  return (per + kChunkAlign - 1) / kChunkAlign * kChunkAlign;
}

// The shared memory of one split unit (4 warps): the warps' partial results before their merge. kRow >= D.
template <int kG, int kRow>
struct SplitSmem {
  float m[kWarps][kG], l[kWarps][kG];
  float acc[kWarps][kG][kRow];
};

// One split unit: the kThreads threads t = 0 .. kThreads - 1 of 4 whole warps compute the partial result (M, l, acc)
// of query heads h0 .. h0 + kG - 1 of row b (cache slot `slot`: row_slot) over positions [s_begin, s_end) (empty: M = -inf, l = 0, acc = 0) into
// acc_row(g)[d] for d < D and store_ml(g, M, l) (thread 0). Every thread of the CTA must call it
// (it synchronizes the CTA once). Both kernels run this code, so a split's (M, l, acc) are the same bits in both.
//
// kG query heads per unit; kLanes lanes (a power of two, <= 32) per position, each owning kVecs 16-byte vectors of
// the D elements: vector j of a row belongs to lane (j % kLanes) of the group, as its (j / kLanes)-th vector.
// Vectors at or past D (when D is not kLanes * kVecs vectors) are zeros.
template <class T, int kG, int kLanes, int kVecs, bool kPrefetch, class AccRow, class StoreMl>
__device__ __forceinline__ void split_partial(const Args<T>& a, int64_t b, int64_t slot, int h0, int s_begin, int s_end,
                                              int t,
                                              SplitSmem<kG, kLanes * kVecs * 16 / static_cast<int>(sizeof(T))>& sm,
                                              AccRow acc_row, StoreMl store_ml) {
  constexpr int kPer = 16 / static_cast<int>(sizeof(T));  // elements per 16-byte vector
  constexpr int kElems = kVecs * kPer;                     // elements of D per lane
  constexpr int kGroupsPerWarp = 32 / kLanes;
  constexpr int kGroups = kWarps * kGroupsPerWarp;         // positions processed side by side
  constexpr int kStep = kGroups * kUnroll;                 // positions per unit and step
  struct alignas(16) Vec {
    T v[kPer];
  };
  static_assert(sizeof(Vec) == 16, "16-byte vectors");

  const int warp = static_cast<unsigned>(t) / 32, lane = static_cast<unsigned>(t) % 32;  // t >= 0: shifts, masks
  const int lane_in_group = lane % kLanes;
  const int group = warp * kGroupsPerWarp + lane / kLanes;
  const int nvec = a.head_dim / kPer;  // vectors per cached row of D elements

  const int kvh = h0 / a.group_size;
  const int64_t head_rows = int64_t(a.seq_len) * nvec;  // vectors of one (slot, k/v, head)
  const Vec* k_rows = reinterpret_cast<const Vec*>(a.kv) + ((slot * 2) * a.kv_heads + kvh) * head_rows;
  const Vec* v_rows = k_rows + int64_t(a.kv_heads) * head_rows;

  // this lane's slice of the kG queries, scaled: one 16-byte load per vector where the host found q's pointer and
  // strides 16-byte aligned (a.q_vec16; the decoder's q, a view of the fused qkv output, is), else scalar loads (q
  // is a strided view with no alignment promise). The same elements, the same float operations either way.
  // One branch around all kG x kVecs loads, so they are all in flight together (a branch per vector would wait for
  // each vector's conversion before the next load: kG round trips).
  Vec qv[kG][kVecs];
  const T* q_rows = a.q + b * a.q_stride_b + int64_t(h0) * a.q_stride_h;
  if (a.q_vec16) {
#pragma unroll
    for (int g = 0; g < kG; ++g) {
#pragma unroll
      for (int i = 0; i < kVecs; ++i) {
        const int j = lane_in_group + i * kLanes;
        if (j < nvec) {
          qv[g][i] = reinterpret_cast<const Vec*>(q_rows + g * a.q_stride_h)[j];
        } else {
#pragma unroll
          for (int e = 0; e < kPer; ++e) qv[g][i].v[e] = from_float<T>(0.f);
        }
      }
    }
  } else {
#pragma unroll
    for (int g = 0; g < kG; ++g) {
#pragma unroll
      for (int i = 0; i < kVecs; ++i) {
        const int j = lane_in_group + i * kLanes;
#pragma unroll
        for (int e = 0; e < kPer; ++e) {
          qv[g][i].v[e] = j < nvec ? q_rows[g * a.q_stride_h + j * kPer + e] : from_float<T>(0.f);
        }
      }
    }
  }
  float qf[kG][kElems];
#pragma unroll
  for (int g = 0; g < kG; ++g) {
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      const int j = lane_in_group + i * kLanes;
#pragma unroll
      for (int e = 0; e < kPer; ++e) qf[g][i * kPer + e] = j < nvec ? to_float(qv[g][i].v[e]) * a.scale_log2 : 0.f;
    }
  }

  float m[kG], l[kG], acc[kG][kElems];
#pragma unroll
  for (int g = 0; g < kG; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
#pragma unroll
    for (int e = 0; e < kElems; ++e) acc[g][e] = 0.f;
  }

  // This lane's K and V vectors of the step at `base`: kUnroll positions of its group, zeros at positions from s_end
  // on and at vectors past D (nothing read there).
  auto load_step = [&](int base, Vec (&kr)[kUnroll][kVecs], Vec (&vr)[kUnroll][kVecs]) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int s = base + u * kGroups + group;
#pragma unroll
      for (int i = 0; i < kVecs; ++i) {
        const int j = lane_in_group + i * kLanes;
        if (s < s_end && j < nvec) {
          kr[u][i] = k_rows[int64_t(s) * nvec + j];
          vr[u][i] = v_rows[int64_t(s) * nvec + j];
        } else {
#pragma unroll
          for (int e = 0; e < kPer; ++e) kr[u][i].v[e] = vr[u][i].v[e] = from_float<T>(0.f);
        }
      }
    }
  };

  // The math of the step at `base` on its vectors kr, vr: the scores of its kUnroll positions per head, then the
  // online-softmax update of (m, l, acc).
  auto step_math = [&](int base, const Vec (&kr)[kUnroll][kVecs], const Vec (&vr)[kUnroll][kVecs]) {
#pragma unroll
    for (int g = 0; g < kG; ++g) {
      float score[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        float dot = 0.f;
#pragma unroll
        for (int i = 0; i < kVecs; ++i) {
#pragma unroll
          for (int e = 0; e < kPer; ++e) dot = fmaf(qf[g][i * kPer + e], to_float(kr[u][i].v[e]), dot);
        }
#pragma unroll
        for (int off = kLanes / 2; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off);
        score[u] = base + u * kGroups + group < s_end ? dot : -INFINITY;
      }
      float m_new = m[g];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) m_new = fmaxf(m_new, score[u]);
      if (m_new != -INFINITY) {  // else this group has had no position yet: nothing to add
        const float alpha = rescale(m[g], m_new);
        l[g] *= alpha;
#pragma unroll
        for (int e = 0; e < kElems; ++e) acc[g][e] *= alpha;
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const float p = exp2f(score[u] - m_new);  // 0 for a position past the chunk (-inf)
          l[g] += p;
#pragma unroll
          for (int i = 0; i < kVecs; ++i) {
#pragma unroll
            for (int e = 0; e < kPer; ++e) acc[g][i * kPer + e] = fmaf(p, to_float(vr[u][i].v[e]), acc[g][i * kPer + e]);
          }
        }
        m[g] = m_new;
      }
    }
  };

  // The bounds are the same for every thread of the unit, so the shuffles below always see full warps.
  if constexpr (kPrefetch) {
    // CUTLASS_W8A8_ATTN_PREFETCH=1 (host below): each step issues the NEXT step's loads into a second buffer before
    // its own math, so the math overlaps them (software pipelining); the first step's vectors are loaded before the
    // loop, and the last step's "next" is all past s_end (zeros, nothing read). The same math on the same vectors
    // in the same order as the default: the same bits.
    Vec kr[kUnroll][kVecs], vr[kUnroll][kVecs];
    load_step(s_begin, kr, vr);
    for (int base = s_begin; base < s_end; base += kStep) {
      Vec kn[kUnroll][kVecs], vn[kUnroll][kVecs];
      load_step(base + kStep, kn, vn);
      step_math(base, kr, vr);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
        for (int i = 0; i < kVecs; ++i) {
          kr[u][i] = kn[u][i];
          vr[u][i] = vn[u][i];
        }
      }
    }
  } else {
    // the default: a step issues its loads, waits for them, then does its math
    for (int base = s_begin; base < s_end; base += kStep) {
      Vec kr[kUnroll][kVecs], vr[kUnroll][kVecs];
      load_step(base, kr, vr);
      step_math(base, kr, vr);
    }
  }

  // merge the groups of a warp: lanes kLanes, 2 kLanes, ... apart hold the same slice of D
#pragma unroll
  for (int g = 0; g < kG; ++g) {
#pragma unroll
    for (int off = kLanes; off < 32; off <<= 1) {
      const float m_other = __shfl_xor_sync(0xffffffffu, m[g], off);
      const float l_other = __shfl_xor_sync(0xffffffffu, l[g], off);
      const float m_max = fmaxf(m[g], m_other);
      const float w_self = rescale(m[g], m_max), w_other = rescale(m_other, m_max);
      l[g] = l[g] * w_self + l_other * w_other;
#pragma unroll
      for (int e = 0; e < kElems; ++e) {
        const float acc_other = __shfl_xor_sync(0xffffffffu, acc[g][e], off);
        acc[g][e] = acc[g][e] * w_self + acc_other * w_other;
      }
      m[g] = m_max;
    }
  }

  // merge the warps through shared memory; element d of the padded row is vector d / kPer of its lane
  if (lane < kLanes) {
#pragma unroll
    for (int g = 0; g < kG; ++g) {
#pragma unroll
      for (int i = 0; i < kVecs; ++i) {
#pragma unroll
        for (int e = 0; e < kPer; ++e) sm.acc[warp][g][(lane + i * kLanes) * kPer + e] = acc[g][i * kPer + e];
      }
    }
  }
  if (lane == 0) {
#pragma unroll
    for (int g = 0; g < kG; ++g) {
      sm.m[warp][g] = m[g];
      sm.l[warp][g] = l[g];
    }
  }
  __syncthreads();
  for (int g = 0; g < kG; ++g) {
    float m_max = sm.m[0][g];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) m_max = fmaxf(m_max, sm.m[w][g]);  // finite unless the chunk is empty
    float weight[kWarps], l_total = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      weight[w] = rescale(sm.m[w][g], m_max);
      l_total += sm.l[w][g] * weight[w];
    }
    float* acc_out = acc_row(g);
    for (int d = t; d < a.head_dim; d += kThreads) {
      float o = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) o += sm.acc[w][g][d] * weight[w];
      acc_out[d] = o;
    }
    if (t == 0) store_ml(g, m_max, l_total);
  }
}

// CTA (b, y, z): query heads y kG .. y kG + kG - 1 of row b over chunk z of its positions, into the workspace. (The
// minimum of 1 block per SM keeps ptxas from capping small instantiations at 64 registers, where one spilled.)
template <class T, int kG, int kLanes, int kVecs, bool kPrefetch>
__global__ void __launch_bounds__(kThreads, 1) decode_attention_split_kernel(const Args<T> a) {
  allow_dependent_launch();  // the combine kernel may be scheduled; it waits for this grid
  wait_for_producers();      // q and the cache row come from the rotary kernel
  constexpr int kRow = kLanes * kVecs * 16 / static_cast<int>(sizeof(T));
  __shared__ SplitSmem<kG, kRow> sm;
  const int64_t b = blockIdx.x;
  const int h0 = blockIdx.y * kG;
  const int split = blockIdx.z;
  const int64_t slot = row_slot(a, b);  // loaded beside positions[b]: one round trip for both
  const int len = row_length(a, b);
  const int chunk = split_chunk(len, a.splits);
  const int s_begin = split * chunk;
  if (s_begin >= len) return;  // an idle split: the combine does not read it
  const int s_end = min(len, s_begin + chunk);
  auto part = [&](int g) { return (b * a.heads + h0 + g) * a.splits + split; };
  split_partial<T, kG, kLanes, kVecs, kPrefetch>(
      a, b, slot, h0, s_begin, s_end, threadIdx.x, sm, [&](int g) { return a.part_acc + part(g) * a.head_dim; },
      [&](int g, float m, float l) { a.part_ml[part(g)] = make_float2(m, l); });
}

// sum_s acc_s w_s over the n_active splits of one head, 4 elements at acc_at(s) (16-byte aligned float32, global or
// shared memory, a cluster's included), with the weights wh[s] (split_weights), rounded to T. Both paths merge with
// this code: the same fmaf chain in the same order.
// kBatch: independent loads in flight per step (4, or kCombineBatch in the cluster combine); the sums are the
// same for every kBatch: one fmaf per split, in split order.
template <class T, int kBatch = 4, class AccAt>
__device__ __forceinline__ Vec<T, 4> merge_splits(AccAt acc_at, const float* wh, int n_active) {
  float o[4] = {0.f, 0.f, 0.f, 0.f};
  for (int s0 = 0; s0 < n_active; s0 += kBatch) {  // up to kBatch independent loads in flight, then sums in order
    float4 v[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      if (s0 + u < n_active) v[u] = *reinterpret_cast<const float4*>(acc_at(s0 + u));
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      if (s0 + u < n_active) {
        const float ws = wh[s0 + u];
        o[0] = fmaf(v[u].x, ws, o[0]);
        o[1] = fmaf(v[u].y, ws, o[1]);
        o[2] = fmaf(v[u].z, ws, o[2]);
        o[3] = fmaf(v[u].w, ws, o[3]);
      }
    }
  }
  Vec<T, 4> y;
#pragma unroll
  for (int j = 0; j < 4; ++j) y.v[j] = from_float<T>(o[j]);
  return y;
}

// Vector idx (4 elements) of row b's attention output: the splits of its head merged, divided by the sum, rounded
// to T. 4 divides D (a multiple of 8), so a vector never straddles two heads. `w` (shared memory, [H - h0][n_active]:
// heads h0 ..): each split's weight 2^(m_s - M) / l of its head (split_weights), or null: computed here from the
// workspace.
template <class T, int kBatch = 4>
__device__ __forceinline__ Vec<T, 4> combine_vec(const Args<T>& a, int64_t b, int n_active, int idx,
                                                 const float* w, int h0 = 0) {
  const int e = idx * 4;
  const int h = e / a.head_dim, d = e - h * a.head_dim;
  const int64_t part0 = (b * a.heads + h) * a.splits;
  const float* acc0 = a.part_acc + part0 * a.head_dim + d;
  if (w != nullptr) {
    return merge_splits<T, kBatch>([&](int s) { return acc0 + int64_t(s) * a.head_dim; }, w + (h - h0) * n_active,
                                   n_active);
  }
  float o[4] = {0.f, 0.f, 0.f, 0.f};
  float m_max = -INFINITY;
  for (int s = 0; s < n_active; ++s) m_max = fmaxf(m_max, a.part_ml[part0 + s].x);
  float l_total = 0.f;
  for (int s = 0; s < n_active; ++s) l_total += a.part_ml[part0 + s].y * rescale(a.part_ml[part0 + s].x, m_max);
  const float inv = 1.f / l_total;
  for (int s = 0; s < n_active; ++s) {
    const float ws = rescale(a.part_ml[part0 + s].x, m_max) * inv;
    const float4 v = *reinterpret_cast<const float4*>(acc0 + int64_t(s) * a.head_dim);
    o[0] = fmaf(v.x, ws, o[0]);
    o[1] = fmaf(v.y, ws, o[1]);
    o[2] = fmaf(v.z, ws, o[2]);
    o[3] = fmaf(v.w, ws, o[3]);
  }
  Vec<T, 4> y;
#pragma unroll
  for (int j = 0; j < 4; ++j) y.v[j] = from_float<T>(o[j]);
  return y;
}

// wh[s] = 2^(m_s - M) / l for the n_active (<= kMaxSplits = 64) splits of one head, (m_s, l_s) = ml_at(s), by one
// whole warp: its lanes over the splits (two each), warp reductions for M and l. The same float operations as the
// direct form of combine_vec, in a fixed order that depends on nothing but n_active.
template <class MlAt>
__device__ __forceinline__ void head_split_weights(int n_active, MlAt ml_at, float* wh) {
  const int lane = threadIdx.x % 32;
  float2 ml[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int s = lane + 32 * i;
    ml[i] = s < n_active ? ml_at(s) : make_float2(-INFINITY, 0.f);
  }
  float m_max = fmaxf(ml[0].x, ml[1].x);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) m_max = fmaxf(m_max, __shfl_xor_sync(0xffffffffu, m_max, off));
  // l0 r0 + l1 r1 with its contraction written out, so that no caller's inlining can choose another: the one nvcc
  // made of main's combine_weights (l0 r0 rounded, then fma(l1, r1, .): rescale's branch puts the first product in
  // another basic block, so only the second one was fused; its PTX shows fma.rn.f32 l1, r1, (l0 r0))
  float l = fmaf(ml[1].y, rescale(ml[1].x, m_max), ml[0].y * rescale(ml[0].x, m_max));
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) l += __shfl_xor_sync(0xffffffffu, l, off);
  const float inv = 1.f / l;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int s = lane + 32 * i;
    if (s < n_active) wh[s] = rescale(ml[i].x, m_max) * inv;
  }
}

// head_split_weights of all `heads` heads, (m_s, l_s) of head h = ml_at(h, s), into w[h][s] (shared memory): the
// CTA's `warps` warps take one head each in turn. Every thread calls it (it synchronizes).
template <class MlAt>
__device__ __forceinline__ void split_weights(int heads, int warps, int n_active, MlAt ml_at, float* w) {
  for (int h = threadIdx.x / 32; h < heads; h += warps) {
    head_split_weights(n_active, [&](int s) { return ml_at(h, s); }, w + h * n_active);
  }
  __syncthreads();
}

// split_weights of row b from the workspace.
template <class T>
__device__ __forceinline__ void combine_weights(const Args<T>& a, int64_t b, int n_active, float* w) {
  const int64_t part0 = b * a.heads * a.splits;
  split_weights(a.heads, kCombineThreads / 32, n_active,
                [&](int h, int s) { return a.part_ml[part0 + int64_t(h) * a.splits + s]; }, w);
}

// The splits of row b that hold positions, ceil(len / chunk): the ones the split kernel wrote and the combine reads.
template <class T>
__device__ __forceinline__ int active_splits(const Args<T>& a, int64_t b) {
  const int len = row_length(a, b);
  const int chunk = split_chunk(len, a.splits);
  return (len + chunk - 1) / chunk;
}

// Row b = blockIdx.x: out row = the merged attention output (O = FloatOut<T>) or its quantization (Int8Out /
// Fp8Out, dynamic per-token scale or a static one), through rowwise_reduce.cuh's row tails. kVecsRegs > 0: the
// row's H * D / 4 vectors fit kVecsRegs per thread and are held in registers, and the split weights are computed
// once per head into dynamic shared memory (H * n_active floats, bounded by the host); 0: recomputed per pass.
template <class T, class O, int kVecsRegs>
__global__ void __launch_bounds__(kCombineThreads) decode_attention_combine_kernel(const Args<T> a) {
  extern __shared__ float s_weights[];
  allow_dependent_launch();  // o_proj's GEMM may be scheduled (and prefetch its weights); it waits for this grid
  wait_for_producers();      // the split kernel's workspace
  const int64_t b = blockIdx.x;
  const int n_active = active_splits(a, b);
  const int nvec = a.heads * a.head_dim / 4;
  auto* out_row = static_cast<typename O::type*>(a.out) + b * (int64_t(nvec) * 4);
  if constexpr (kVecsRegs > 0) {
    combine_weights(a, b, n_active, s_weights);
    Vec<T, 4> y[kVecsRegs];
#pragma unroll
    for (int i = 0; i < kVecsRegs; ++i) {
      const int idx = threadIdx.x + i * kCombineThreads;
      if (idx < nvec) y[i] = combine_vec(a, b, n_active, idx, s_weights);
    }
    finish_regs<T, O, 4, kVecsRegs, kCombineThreads, 1>(y, 0, nvec, out_row, a.scales, a.static_scale, b);
  } else {
    finish_loop<T, O, 4, kCombineThreads>(
        [&](int idx) { return combine_vec(a, b, n_active, idx, static_cast<const float*>(nullptr)); }, nvec,
        out_row, a.scales, a.static_scale, b);
  }
}

// Row b = blockIdx.x, its part y = blockIdx.y of kCombineCluster (block_part): the cluster combine. The split weights
// of the heads its vectors lie in (the row combine's, head by head: head_split_weights), its kVecs vectors per
// thread merged with kCombineBatch loads in flight (combine_vec: the row combine's fmaf chain), then finish_regs over
// the cluster (the row amax: ClusterReduce's max over the 8 CTAs, exact). At B 1 the row combine read the row's
// H x splits x D float32 partial results on one SM: 6.4 us of Qwen3-30B-A3B's 15.2 us at S 1024 (32 splits) on an
// H200 (bench/results/decode_attention_knobs_nvidia-h200.md); a cluster reads them on 8.
template <class T, class O, int kVecs>
__global__ void CW8A8_CLUSTER_DIMS(1, kCombineCluster, 1) __launch_bounds__(kCombineClusterThreads)
    decode_attention_combine_cluster_kernel(const Args<T> a) {
#if !CW8A8_HAS_CLUSTERS
  __trap();  // not reached: the host launches it where clusters_available (sm90 code loaded)
#else
  extern __shared__ float s_weights[];  // [heads of this CTA's part][n_active], from head h_begin
  allow_dependent_launch();  // o_proj's GEMM may be scheduled (and prefetch its weights); it waits for this grid
  wait_for_producers();      // the split kernel's workspace
  const int64_t b = blockIdx.x;
  const int n_active = active_splits(a, b);
  const int nvec = a.heads * a.head_dim / 4;
  int begin, end;
  block_part<kCombineCluster>(nvec, begin, end);
  const int h_begin = begin * 4 / a.head_dim;
  if (begin < end) {
    const int64_t part0 = b * a.heads * a.splits;
    const int h_end = ((end - 1) * 4) / a.head_dim + 1;
    for (int h = h_begin + static_cast<int>(threadIdx.x) / 32; h < h_end; h += kCombineClusterThreads / 32) {
      head_split_weights(n_active, [&](int s) { return a.part_ml[part0 + int64_t(h) * a.splits + s]; },
                         s_weights + (h - h_begin) * n_active);
    }
  }
  __syncthreads();
  Vec<T, 4> y[kVecs];
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    const int idx = begin + static_cast<int>(threadIdx.x) + i * kCombineClusterThreads;
    if (idx < end) y[i] = combine_vec<T, kCombineBatch>(a, b, n_active, idx, s_weights, h_begin);
  }
  auto* out_row = static_cast<typename O::type*>(a.out) + b * (int64_t(nvec) * 4);
  finish_regs<T, O, 4, kVecs, kCombineClusterThreads, kCombineCluster>(y, begin, end, out_row, a.scales,
                                                                        a.static_scale, b);
#endif
}

// --- the one-kernel path: a cluster per row -------------------------------------------------------------------
//
// decode_attention_fused_kernel, grid (B, C), cluster (1, C), U split units (4 warps each) per CTA: the row's
// (H / G') x splits units u = hg * splits + z -- head group hg, split z, exactly the split kernel's CTAs -- are
// numbered across the cluster, unit u in CTA rank u / U, warps 4 (u % U) .. 4 (u % U) + 3. Each unit runs
// split_partial into its CTA's shared memory; a cluster barrier; then each CTA takes an even share of the row's
// H * D / 4 output vectors, computes the split weights of the heads they lie in from the units' (M, l)
// (head_split_weights, reading them through distributed shared memory), merges its vectors (merge_splits, the
// units' acc read remotely in split order), and
// stores them, or quantizes them with the row scale: max |y| over the row, a block max then a max over the
// cluster's CTAs (exact in any order), / QMAX, as finish_regs does. Same splits (choose_splits), same per-split
// arithmetic, same merge: the two-kernel path's result bit for bit, in one launch and without the workspace.
// fused_plan (host) says when it serves. Row-wise: block (x, y) reads and writes row x only; the cluster spans y.
constexpr int kFusedMaxCluster = 16;  // CTAs per cluster (non-portable above 8: sm90 allows 16)
constexpr int kFusedMaxUnits = 4;     // split units per CTA (512 threads)
constexpr int kFusedYRegs = 4;        // output vectors (4 elements) per thread in registers

// Units per CTA allowed for kG heads per unit: 4 (512 threads, <= 128 registers a thread) for kG = 1, else 2 (256
// threads, <= 255 registers: the split step of 2 heads takes 128 or more, of 8 heads ~245, without spills).
constexpr int fused_max_units(int g) { return g >= 2 ? 2 : kFusedMaxUnits; }

template <int kG, int kRow>
struct FusedUnitSmem {
  SplitSmem<kG, kRow> split;
  alignas(16) float acc[kG][kRow];  // the unit's merged acc per head, read by the whole cluster
  float2 ml[kG];                    // the unit's (M, l) per head
};

// Dynamic shared memory of the fused kernel for U units: U FusedUnitSmem (the split weights and the row amax are
// static shared memory).
template <class T, int kG, int kLanes, int kVecs>
constexpr size_t fused_unit_smem() {
  return sizeof(FusedUnitSmem<kG, kLanes * kVecs * 16 / static_cast<int>(sizeof(T))>);
}

template <class T, class O, int kG, int kLanes, int kVecs, bool kPrefetch>
__global__ void __launch_bounds__(fused_max_units(kG) * kThreads) decode_attention_fused_kernel(const Args<T> a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  __trap();  // not reached: the host launches it on sm90 and newer only (fused_plan)
#else
  constexpr int kRow = kLanes * kVecs * 16 / static_cast<int>(sizeof(T));
  using Unit = FusedUnitSmem<kG, kRow>;
  extern __shared__ __align__(16) unsigned char fused_smem[];
  __shared__ float s_w[kFusedMaxCluster * kFusedMaxUnits * kG];  // H * n_active <= kG * units
  __shared__ float s_warp_amax[kFusedMaxUnits * kWarps], s_amax;
  allow_dependent_launch();  // o_proj's GEMM may be scheduled; it waits for this grid
  wait_for_producers();      // q and the cache row come from the rotary kernel
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  Unit* units = reinterpret_cast<Unit*>(fused_smem);
  const int rank = static_cast<int>(cluster.block_rank());
  const int ctas = static_cast<int>(cluster.num_blocks());
  const int kU = static_cast<int>(blockDim.x) / kThreads;  // units per CTA (the host's plan)
  const int nb = kU * kThreads;                            // threads per CTA
  const int64_t b = blockIdx.x;
  const int tid = static_cast<int>(threadIdx.x);
  const int sub = tid / kThreads;
  const int unit = rank * kU + sub;
  const int hg = unit / a.splits, split = unit - hg * a.splits;
  const int64_t slot = row_slot(a, b);  // loaded beside positions[b]: one round trip for both
  const int len = row_length(a, b);
  const int chunk = split_chunk(len, a.splits);
  const int n_active = (len + chunk - 1) / chunk;
  const int s_begin = split * chunk;
  const int s_end = min(len, s_begin + chunk);  // <= s_begin for an idle split: nothing read, never merged
  Unit& mine = units[sub];
  split_partial<T, kG, kLanes, kVecs, kPrefetch>(
      a, b, slot, hg * kG, s_begin, s_end, tid % kThreads, mine.split,
      [&](int g) { return &mine.acc[g][0]; }, [&](int g, float m, float l) { mine.ml[g] = make_float2(m, l); });
  cluster.sync();  // every unit's (M, l, acc) is in its CTA's shared memory

  // head h's split s: unit (h / kG) * splits + s, its head h % kG
  auto unit_of = [&](int h, int s) -> Unit* {
    const int u = (h / kG) * a.splits + s;
    return cluster.map_shared_rank(units, u / kU) + u % kU;
  };
  // This CTA's share of the row: vectors [begin, end) of its H * D / 4 (4 elements each), an even split over the
  // cluster, at most kFusedYRegs per thread (fused_plan); the split weights of the heads they lie in.
  const int nvec = a.heads * a.head_dim / 4;
  const int per_cta = (nvec + ctas - 1) / ctas;
  const int begin = min(nvec, rank * per_cta), end = min(nvec, begin + per_cta);
  if (begin < end) {
    const int h_begin = begin * 4 / a.head_dim, h_end = ((end - 1) * 4) / a.head_dim + 1;
    for (int h = h_begin + tid / 32; h < h_end; h += nb / 32) {
      head_split_weights(n_active, [&](int s) { return unit_of(h, s)->ml[h % kG]; }, s_w + h * n_active);
    }
  }
  __syncthreads();

  Vec<T, 4> y[kFusedYRegs];
#pragma unroll
  for (int i = 0; i < kFusedYRegs; ++i) {
    const int idx = begin + tid + i * nb;
    if (idx < end) {
      const int e = idx * 4;
      const int h = e / a.head_dim, d = e - h * a.head_dim;
      y[i] = merge_splits<T>([&](int s) { return &unit_of(h, s)->acc[h % kG][d]; }, s_w + h * n_active, n_active);
    }
  }

  auto* out =
      reinterpret_cast<Vec<typename O::type, 4>*>(static_cast<typename O::type*>(a.out) + b * (int64_t(nvec) * 4));
  if constexpr (IsQuant<O>::value) {
    static_assert(!IsGroup<O>::value, "decode_attention_quant: per-token or static per-tensor scales");
    float scale;
    if (a.static_scale == nullptr) {  // uniform over the cluster: all take the same branch
      float amax = 0.f;
#pragma unroll
      for (int i = 0; i < kFusedYRegs; ++i) {
        if (begin + tid + i * nb < end) amax = vec_amax(amax, y[i]);
      }
      // max is exact: any grouping gives the row's max |y|, the value finish_regs finds
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
      if (tid % 32 == 0) s_warp_amax[tid / 32] = amax;
      __syncthreads();
      if (tid == 0) {
        float block_amax = s_warp_amax[0];
        for (int w = 1; w < nb / 32; ++w) block_amax = fmaxf(block_amax, s_warp_amax[w]);
        s_amax = block_amax;
      }
      cluster.sync();
      float row_amax = *cluster.map_shared_rank(&s_amax, 0);
      for (int r = 1; r < ctas; ++r) row_amax = fmaxf(row_amax, *cluster.map_shared_rank(&s_amax, r));
      scale = row_amax / O::kMax;
    } else {
      scale = *a.static_scale;
    }
    if (rank == 0 && tid == 0) a.scales[b] = scale;
#pragma unroll
    for (int i = 0; i < kFusedYRegs; ++i) {
      const int idx = begin + tid + i * nb;
      if (idx < end) out[idx] = quantize_vec<O>(y[i], scale);
    }
  } else {
#pragma unroll
    for (int i = 0; i < kFusedYRegs; ++i) {
      const int idx = begin + tid + i * nb;
      if (idx < end) out[idx] = y[i];
    }
  }
  cluster.sync();  // no CTA leaves while another may still read its shared memory
#endif
}

// The most query heads per CTA (G'): kDefaultHeadsPerCta (4), or CUTLASS_W8A8_ATTN_HEADS_PER_CTA (1, 2, 4 or 8), read
// once per process. The default was 8 until the tenth session's H200 runs (bench_decode_attention.py, Qwen3-30B-A3B
// and Llama-3-8B heads, B 1-32, S 256-16384, alternating processes): a cap of 4 took Qwen3's split + combine to
// 0.847x (B 1), 0.910x (B 4), 0.935x (B 8), 0.998x (B 32) of the cap of 8 (geomean per batch), Llama-3-8B (G 4)
// unchanged, and the Qwen3-MoE decoder's int8 batch-1 step from 2.831 to 2.685 ms. Why: at G' = 8 the 16-bit
// split kernel at D = 128 holds 244 registers (2 CTAs per SM) and serializes its 8 heads' math; a cap of 4 gives
// Qwen3-30B-A3B (32 / 4 heads) Llama-3-8B's CTA shape (G' = 4, 166 registers, 3 per SM) at twice the CTAs, each
// K / V row read by two CTAs (on an H200 at B 1, S 512 and 16 splits, eager: Qwen3's split kernel 7.62 us at G' = 8,
// Llama-3-8B's 4.70 us at G' = 4 with twice the K / V bytes; decode_attention_min_chunk_nvidia-h200.md). Every G' in {1, 2, 4, 8} is
// instantiated for every dtype, D and output (with_split_kernel, launch_fused_for_group), so any cap is safe. A
// CTA's per-head math does not depend on the other heads it holds: at the same split count the same bits; but the
// split count follows the launched variant (the (row, head group) pairs, and under the wave rule its occupancy),
// so another value may change the splits, hence the bits.
int heads_per_cta_cap() {
  static_assert(kDefaultHeadsPerCta <= kMaxHeadsPerCta, "the default cap is one of the instantiated G'");
  static const int value = env_int(kOp, "CUTLASS_W8A8_ATTN_HEADS_PER_CTA", kDefaultHeadsPerCta,
                                   [](long v) { return v == 1 || v == 2 || v == 4 || v == 8; }, "1, 2, 4 or 8");
  return value;
}

// Query heads per CTA: the largest of 8, 4, 2, 1 that divides the GQA group and is at most heads_per_cta_cap(). The
// one function every consumer asks (run, decode_attention_path, decode_attention_heads_per_cta; the split count, its
// occupancy query and the fused plan take its g).
int heads_per_cta(int64_t group_size) {
  const int cap = heads_per_cta_cap();
  for (int g : {8, 4, 2}) {
    if (g <= cap && group_size % g == 0) return g;
  }
  return 1;
}

// The least positions per split of a full cache: kMinChunk, or CUTLASS_W8A8_ATTN_MIN_CHUNK (a multiple of
// kChunkAlign in [kChunkAlign, 4096]), read once per process. An experiment's knob (bench_decode_attention.py
// sweeps it in separate processes): fewer positions per split give more CTAs and fewer serial load steps per CTA,
// and more partial results for the combine; another value changes the splits, hence the bits.
int min_chunk() {
  static const int value = env_int(
      kOp, "CUTLASS_W8A8_ATTN_MIN_CHUNK", kMinChunk,
      [](long v) { return v >= kChunkAlign && v <= 4096 && v % kChunkAlign == 0; },
      "a multiple of " + std::to_string(kChunkAlign) + " in [" + std::to_string(kChunkAlign) + ", 4096]");
  return value;
}

// The split kernel's CTAs per SM that choose_splits' ctas rule (CUTLASS_W8A8_ATTN_SPLITS=ctas) aims at: kCtasPerSm,
// or CUTLASS_W8A8_ATTN_CTAS_PER_SM (an integer in [1, 16]), read once per process and checked under either rule. An
// experiment's knob (issue 36; bench_decode_attention.py, a process per value): more CTAs per SM give more splits
// where B x H / G' is small against the SMs (Qwen3-30B-A3B's B 8 at S 4096: at the default G' = 4 64 pairs, 5
// splits at 2, 17 at 8 on 132 SMs; at G' = 8 32 pairs, 9 and 33), so shorter walks per CTA and, where registers let more CTAs be resident (the G' = 8 16-bit kernel: 2 per SM
// at 229-245 registers; G' = 4: 3), more loads in flight per SM; and more partial results for the combine. Under the
// ctas rule another value changes the splits, hence the bits.
int ctas_per_sm() {
  static const int value = env_int(kOp, "CUTLASS_W8A8_ATTN_CTAS_PER_SM", kCtasPerSm,
                                   [](long v) { return v >= 1 && v <= 16; }, "an integer in [1, 16]");
  return value;
}

// Whether split_partial loads each step's K and V one step ahead (its kPrefetch; both kernels, the same bits at the
// same split count, which under the wave rule follows the variant's occupancy: see the file comment): an A/B
// switch, CUTLASS_W8A8_ATTN_PREFETCH=1 (read once per process), off by default (unset, empty or 0) until measured.
// Another value raises a ValueError naming the variable (a typo would otherwise measure the default).
// The second buffer costs registers (nvcc 13.0, sm_90a, ptxas): the split kernel at G' = 8, 16-bit, goes from 229-245
// to 243-255 registers, and bf16 spills there (28-72 bytes; Qwen3-30B-A3B's <bf16, 8, 16>: 64 B stored, 60 B
// loaded), and so does float32's <float, 8, 32, 2> (D > 128: 241 to 254 registers, 208 B); the fused kernel spills
// at G' = 8 (bf16 284-292 B, fp16 16 B) and at G' = 1 (16-28 B: 512 threads cap it at 128 registers). The launch
// bounds already allow 255 registers wherever it spills at G' = 8 (more is not possible); G' = 1's would need fewer
// units per CTA, i.e. another fused plan, so they stay.
bool attn_prefetch() {
  static const bool value = env_choice(kOp, "CUTLASS_W8A8_ATTN_PREFETCH", {"0", "1"}) == "1";
  return value;
}

// Whether the cluster combine may serve (CUTLASS_W8A8_ATTN_COMBINE, read once per process): unset, empty or
// "cluster" (the default), or "row" (the one-CTA-per-row combine everywhere: an A/B switch, the same bits). Another
// value raises a ValueError naming the variable.
bool combine_cluster_allowed() {
  static const bool value = env_choice(kOp, "CUTLASS_W8A8_ATTN_COMBINE", {"cluster", "row"}) != "row";
  return value;
}

// Calls f(kernel) with the split kernel instantiation for T, G' = g and D = head_dim: the narrowest lane group that
// holds a row of D elements (nvec 16-byte vectors over kLanes lanes). The one place that picks it: the launch and the
// occupancy query of the wave rule (split_ctas_resident) ask here.
template <class T, int kG, bool kPrefetch, class F>
void with_split_kernel_for_head_dim(int head_dim, F&& f) {
  const int nvec = head_dim * static_cast<int>(sizeof(T)) / 16;
  if (nvec <= 1) {
    f(decode_attention_split_kernel<T, kG, 1, 1, kPrefetch>);
  } else if (nvec <= 2) {
    f(decode_attention_split_kernel<T, kG, 2, 1, kPrefetch>);
  } else if (nvec <= 4) {
    f(decode_attention_split_kernel<T, kG, 4, 1, kPrefetch>);
  } else if (nvec <= 8) {
    f(decode_attention_split_kernel<T, kG, 8, 1, kPrefetch>);
  } else if (nvec <= 16) {  // D = 128 in 16-bit types
    f(decode_attention_split_kernel<T, kG, 16, 1, kPrefetch>);
  } else if (nvec <= 32) {
    f(decode_attention_split_kernel<T, kG, 32, 1, kPrefetch>);
  } else if constexpr (sizeof(T) == 4) {  // float32 with D > 128 (16-bit types never get here: D <= 256)
    f(decode_attention_split_kernel<T, kG, 32, 2, kPrefetch>);
  }
}

template <class T, bool kPrefetch, class F>
void with_split_kernel(int g, int head_dim, F&& f) {
  switch (g) {
    case 8: with_split_kernel_for_head_dim<T, 8, kPrefetch>(head_dim, f); break;
    case 4: with_split_kernel_for_head_dim<T, 4, kPrefetch>(head_dim, f); break;
    case 2: with_split_kernel_for_head_dim<T, 2, kPrefetch>(head_dim, f); break;
    case 1: with_split_kernel_for_head_dim<T, 1, kPrefetch>(head_dim, f); break;
    default: TORCH_CHECK(false, "decode_attention: internal error: G' = ", g, " (heads_per_cta gives 8, 4, 2 or 1)");
  }
}

// The split rule (CUTLASS_W8A8_ATTN_SPLITS, read once per process): unset, empty or "waves" (the default: the
// fewest-waves rule of choose_splits), or "ctas" (about ctas_per_sm() CTAs per SM, the default before it; an A/B
// switch). Another value raises a ValueError naming the variable.
bool split_rule_waves() {
  static const bool value = env_choice(kOp, "CUTLASS_W8A8_ATTN_SPLITS", {"waves", "ctas"}) != "ctas";
  return value;
}

// How many CTAs of the split kernel that run() launches for (dtype, G', D, prefetch) are resident per SM
// (cudaOccupancyMaxActiveBlocksPerMultiprocessor: registers and shared memory), asked once per key and cached. The
// current device must be `device`. Only the wave rule asks.
int split_ctas_resident(int device, at::ScalarType dtype, int g, int64_t head_dim, bool prefetch) {
  static std::mutex mutex;
  static std::map<std::array<int, 5>, int> cache;
  const std::array<int, 5> key{device, static_cast<int>(dtype), g, static_cast<int>(head_dim), prefetch ? 1 : 0};
  std::lock_guard<std::mutex> lock(mutex);
  const auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  int resident = 0;
  bool asked = false;
  auto ask = [&](auto kernel) {
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, kernel, kThreads, 0));
    asked = true;
  };
  auto for_type = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    if (prefetch) {
      with_split_kernel<T, true>(g, static_cast<int>(head_dim), ask);
    } else {
      with_split_kernel<T, false>(g, static_cast<int>(head_dim), ask);
    }
  };
  switch (dtype) {
    case at::kBFloat16: for_type(static_cast<__nv_bfloat16*>(nullptr)); break;
    case at::kHalf: for_type(static_cast<__half*>(nullptr)); break;
    default: for_type(static_cast<float*>(nullptr)); break;
  }
  // no instantiation: a D the op refuses (decode_attention_path takes any D): nothing cached
  TORCH_CHECK_VALUE(asked, "decode_attention: no split kernel for D = ", head_dim, " in ", dtype);
  resident = std::max(resident, 1);
  cache.emplace(key, resident);
  return resident;
}

// Splits per row. The wave rule (the default; split_rule_waves), given `resident` split CTAs per SM: the s in
// [1, cap] with the least ceil(pairs x s / (resident x SMs)) x (chunk(s) + min_chunk()) over the B x H / G' (row, head
// group) pairs, chunk(s) = ceil(S / s) rounded up to kChunkAlign as split_chunk walks it -- waves of CTAs times the
// positions each CTA walks, the time of a latency-bound walk, plus a CTA's fixed cost counted as min_chunk()
// positions (without it many waves of short walks tie with a few long ones and the partial results to combine
// grow); s replaces the current choice only when 3% cheaper than it (a near-tie keeps the fewer splits: the model
// is not that precise). The ctas rule (CUTLASS_W8A8_ATTN_SPLITS=ctas, the default before it): about ctas_per_sm()
// (default 2) CTAs per SM, splits = ceil(ctas_per_sm() x SMs / pairs).
// On an H200 the ctas rule put Qwen3-30B-A3B's B 8 at 9 splits, 288 CTAs against 264 resident: a second wave of 24
// (bench/results/decode_attention_knobs_nvidia-h200.md); Llama-3-8B's rows there ranked as the wave count ranks
// them. On the H200 sweep of bench/results/decode_attention_combine_nvidia-h200.md the wave rule, then without the
// chunk's rounding, took 0.854x the ctas rule's time in geomean (0.76x at B 32), but 1.16x at Qwen3 B 1, S 4096
// (63 splits of 72 positions against 64 of 64: the rounding's case) and 1.01-1.04x at Llama-3-8B B 1 / 4, S 512.
// With the rounding (the default), on the same 64-row H200 sweep against SPLITS=ctas (2026-11-29, ninth session,
// bench/results/decode_attention_waves_nvidia-h200.md): geomean 0.850x, 0.96x / 0.88x / 0.81x / 0.76x at B 1 / 4 /
// 8 / 32, best 0.586x (Qwen3 B 8, S 16384), worst 1.039x (Llama-3-8B B 4, S 512: 0.5 us); Qwen3 B 1, S 4096 no
// longer loses.
// Both: at most cap = min(S / min_chunk() (a split of a full cache keeps at least that many positions), kMaxSplits,
// kCombineSmemFloats / H (the combine kernel's H x splits weights in shared memory)). From B, H, G', S, the SM count,
// the kernel's occupancy and the per-process knobs only (never the positions: see the file comment), so a captured
// graph's grid and workspace stay valid at replay. The one function every consumer asks: run() (the split kernel's
// grid, the workspace size, the combine's Args::splits, the fused plan) and decode_attention_path.
int choose_splits(int64_t batch, int64_t heads, int64_t head_groups, int64_t seq_len, int sms, int resident) {
  const int cps = ctas_per_sm();  // read under either rule: a bad value raises whichever rule runs
  const int64_t pairs = batch * head_groups;
  int64_t cap = std::max<int64_t>(seq_len / min_chunk(), 1);
  cap = std::min<int64_t>(cap, kMaxSplits);
  cap = std::max<int64_t>(std::min<int64_t>(cap, kCombineSmemFloats / heads), 1);  // the combine's weights
  if (split_rule_waves()) {
    const int64_t slots = std::max<int64_t>(int64_t(resident) * sms, 1);
    const int64_t fixed = min_chunk();
    auto cost = [&](int64_t s) {  // in double: no overflow at any B, H, S
      // the chunk a split walks is rounded up to kChunkAlign positions (split_chunk): at S 4096 63 splits walk 72
      // positions each (57 of them hold work), 64 splits 64
      const int64_t per = (seq_len + s - 1) / s;
      const int64_t chunk = (per + kChunkAlign - 1) / kChunkAlign * kChunkAlign;
      return double((pairs * s + slots - 1) / slots) * double(chunk + fixed);
    };
    int64_t best = 1;
    double best_cost = cost(1);
    for (int64_t s = 2; s <= cap; ++s) {
      const double c = cost(s);
      if (c < 0.97 * best_cost) best = s, best_cost = c;
    }
    return static_cast<int>(best);
  }
  const int64_t splits = (int64_t(cps) * sms + pairs - 1) / pairs;
  return static_cast<int>(std::max<int64_t>(std::min<int64_t>(splits, cap), 1));
}

// choose_splits for one call: the wave rule's occupancy asked only when that rule is on.
int splits_for(int device, int64_t batch, int64_t heads, int g, int64_t seq_len, int64_t head_dim,
               at::ScalarType dtype, bool prefetch) {
  const int resident = split_rule_waves() ? split_ctas_resident(device, dtype, g, head_dim, prefetch) : 0;
  return choose_splits(batch, heads, heads / g, seq_len, device_info(device).sm_count, resident);
}

template <class T, bool kPrefetch>
void launch_split_for_group(const Args<T>& args, int64_t batch, int64_t heads, int g, cudaStream_t stream,
                            bool pdl) {
  const dim3 grid(static_cast<unsigned>(batch), static_cast<unsigned>(heads / g), static_cast<unsigned>(args.splits));
  with_split_kernel<T, kPrefetch>(g, args.head_dim, [&](auto kernel) {
    C10_CUDA_CHECK(launch_kernel(kernel, grid, dim3(kThreads), 0, stream, pdl, args));
  });
}

// The combine kernel for a row of nvec = H * D / 4 vectors: the cluster combine (kVecs 1 or 2 a thread) on sm90
// where clusters_available and the knob allows it, for nvec <= 8 x 128 x 2 (H * D <= 8192); else the row combine,
// its vectors in registers (H * D <= 8192) or recomputed per pass (longer rows). From H, D and the device only, so
// the choice is the same for every B (a captured graph shrunk to fewer rows keeps it).
template <class T, class O>
void launch_combine(const Args<T>& args, int64_t batch, int device, cudaStream_t stream, bool pdl) {
  const int64_t nvec = int64_t(args.heads) * args.head_dim / 4;
  // H * splits <= kCombineSmemFloats (choose_splits): the split weights in shared memory
  const size_t smem = sizeof(float) * static_cast<size_t>(args.heads) * args.splits;
  constexpr int64_t kClusterPart = int64_t(kCombineCluster) * kCombineClusterThreads;  // vectors at one a thread
  if (nvec <= 2 * kClusterPart && combine_cluster_allowed() && device_info(device).major == 9 &&
      clusters_available(device)) {
    // a CTA's part (block_part): ceil(nvec / 8) vectors, which lie in at most part * 4 / D + 2 heads (from the head
    // of its first vector); the weights of those heads only
    const int64_t part = (nvec + kCombineCluster - 1) / kCombineCluster;
    const int64_t part_heads = std::min<int64_t>(args.heads, part * 4 / args.head_dim + 2);
    const size_t cluster_smem = sizeof(float) * static_cast<size_t>(part_heads) * args.splits;
    const dim3 grid(static_cast<unsigned>(batch), static_cast<unsigned>(kCombineCluster));
    if (nvec <= kClusterPart) {
      C10_CUDA_CHECK(launch_kernel(decode_attention_combine_cluster_kernel<T, O, 1>, grid,
                                   dim3(kCombineClusterThreads), cluster_smem, stream, pdl, args));
    } else {
      C10_CUDA_CHECK(launch_kernel(decode_attention_combine_cluster_kernel<T, O, 2>, grid,
                                   dim3(kCombineClusterThreads), cluster_smem, stream, pdl, args));
    }
    return;
  }
  const dim3 grid(static_cast<unsigned>(batch));
  if (nvec <= int64_t(kCombineThreads) * kCombineVecs) {
    C10_CUDA_CHECK(launch_kernel(decode_attention_combine_kernel<T, O, kCombineVecs>, grid, dim3(kCombineThreads),
                                 smem, stream, pdl, args));
  } else {
    C10_CUDA_CHECK(launch_kernel(decode_attention_combine_kernel<T, O, 0>, grid, dim3(kCombineThreads), 0, stream,
                                 pdl, args));
  }
}

// Whether the one-kernel path may serve (the private switch _set_decode_attention_fused: tests and benchmarks turn
// it on and off to compare the two paths). Off by default: on an H200 (bench/results/decode_attention_nvidia-h200,
// 2026-11-29) it was 1.05x the two kernels at Qwen3-30B-A3B B = 1, S = 512 (0.99x with int8 out), and 0.39-0.65x
// wherever it served 8 or more rows (Qwen3 B 8 / 16, Llama-3-8B B 16): clusters of 16 CTAs are resident a few at
// a time, so those rows ran in waves. It stays a candidate until a rule that keeps it within one wave wins there.
// (Measured at kMinChunk 64; at 32 the two kernels took Qwen3's B 1, S 512 in 12.85 us, below the fused 14.86.)
std::atomic<bool> g_fused_enabled{false};

// The one-kernel path's shape for one launch: `units` split units per CTA (0: the path does not serve) and `ctas`
// CTAs per cluster (one cluster per row).
struct FusedPlan {
  int units = 0;
  int ctas = 0;
};

// The dispatch rule between the two paths, in one place. The fused kernel serves when
//   - the switch is on, the device is sm90 (clusters of 16 measured there; newer archs keep the two kernels until
//     measured) running _C's sm90 code (clusters_available), and q is 16-bit with 32 < D <= 128 (kLanes 8 or 16,
//     one 16-byte vector a lane: the instantiated kernels);
//   - H * D / 4 <= kCombineThreads * kCombineVecs: the two-kernel path then merges with the split weights in shared
//     memory (split_weights + merge_splits), the arithmetic the fused kernel repeats;
//   - the row's (H / G') x splits units fit one cluster: U units per CTA (1, 2 or 4; at most 2 for G' >= 2) with
//     units / U <= kFusedMaxCluster CTAs, the smallest such U (more SMs, fewer warps each); and the row's output
//     vectors fit kFusedYRegs a thread;
//   - a cluster above the portable 8 CTAs is resident on the device (fused_plan_resident: asked once, cached);
//     else the next U (fewer CTAs), else the two kernels.
// On 132 SMs (bf16, the wave rule at 2 resident split CTAs per SM for G' = 8 and 3 for G' = 4: ctas_per_sm's
// comment), at the default cap of 4 heads per CTA (CUTLASS_W8A8_ATTN_HEADS_PER_CTA): Qwen3-30B-A3B (32 / 4 heads x
// 128: 8 groups of 4) and Llama-3-8B (32 / 8 x 128) alike: at S = 128 at most 4 splits, 8 x 4 units, U = 2, one
// cluster of at most 16 CTAs; at S >= 256, B <= 8: 8 x 5 or more units, more than 2 x 16: the two kernels (at B = 16
// the fused path under either rule: 8 x 3 units, 12 CTAs of 2); at S = 4096 the two kernels. At a cap of 8, Qwen3 at
// B = 1, S = 256: 8 splits under either rule, 4 x 8 units, U = 2, one cluster of 16 CTAs (at S = 512: 16 splits, the
// two kernels); at B = 8, S = 4096 the ctas rule's 9 splits take the two kernels, the wave rule's 8 one cluster.
// Once per fused-kernel instantiation and device: allow clusters above the portable 8 CTAs (a driver call: never
// per launch). Needed before a launch of more than 8 CTAs a cluster, and before asking the occupancy of one.
template <class T, class O, int kG, int kLanes, bool kPrefetch>
void allow_nonportable_clusters(int device) {
  static std::array<std::once_flag, 64> once;
  std::call_once(once.at(static_cast<size_t>(device)), [&] {
    C10_CUDA_CHECK(cudaFuncSetAttribute(decode_attention_fused_kernel<T, O, kG, kLanes, 1, kPrefetch>,
                                        cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  });
}

// Whether one cluster of `ctas` CTAs of `units` units of the fused kernel <T, O, kG, kLanes> can be resident on the
// current device (cudaOccupancyMaxActiveClusters > 0). A cluster above 8 CTAs needs that many SMs with room in one
// GPC, and a CTA of the kG = 8 kernel takes a whole SM's register file: H100 / H200 SXM (132 SMs) have such GPCs,
// sm90 parts with smaller GPCs may not, and there the two kernels serve rather than a launch that fails.
template <class T, class O, int kG, int kLanes, bool kPrefetch>
bool fused_cluster_resident(int device, int units, int ctas) {
  allow_nonportable_clusters<T, O, kG, kLanes, kPrefetch>(device);
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(1, static_cast<unsigned>(ctas));
  cfg.blockDim = dim3(static_cast<unsigned>(units * kThreads));
  cfg.dynamicSmemBytes = fused_unit_smem<T, kG, kLanes, 1>() * static_cast<size_t>(units);
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = 1;
  attr.val.clusterDim.y = static_cast<unsigned>(ctas);
  attr.val.clusterDim.z = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  int clusters = 0;
  if (cudaOccupancyMaxActiveClusters(&clusters, decode_attention_fused_kernel<T, O, kG, kLanes, 1, kPrefetch>, &cfg) !=
      cudaSuccess) {
    (void)cudaGetLastError();  // an unsupported configuration: not resident; leave no error for the next check
    return false;
  }
  return clusters > 0;
}

// The same for every output variant the launch may pick (q's dtype, int8, fp8), so the path does not depend on it.
template <class T, int kG, int kLanes, bool kPrefetch>
bool fused_resident_all_outputs(int device, int units, int ctas) {
  return fused_cluster_resident<T, FloatOut<T>, kG, kLanes, kPrefetch>(device, units, ctas) &&
         fused_cluster_resident<T, Int8Out, kG, kLanes, kPrefetch>(device, units, ctas) &&
         fused_cluster_resident<T, Fp8Out, kG, kLanes, kPrefetch>(device, units, ctas);
}

template <class T, int kG, bool kPrefetch>
bool fused_resident_for_lanes(int lanes, int device, int units, int ctas) {
  return lanes == 8 ? fused_resident_all_outputs<T, kG, 8, kPrefetch>(device, units, ctas)
                    : fused_resident_all_outputs<T, kG, 16, kPrefetch>(device, units, ctas);
}

template <class T, bool kPrefetch>
bool fused_resident_for_group(int g, int lanes, int device, int units, int ctas) {
  switch (g) {
    case 8: return fused_resident_for_lanes<T, 8, kPrefetch>(lanes, device, units, ctas);
    case 4: return fused_resident_for_lanes<T, 4, kPrefetch>(lanes, device, units, ctas);
    case 2: return fused_resident_for_lanes<T, 2, kPrefetch>(lanes, device, units, ctas);
    default: return fused_resident_for_lanes<T, 1, kPrefetch>(lanes, device, units, ctas);
  }
}

// fused_cluster_resident for a plan above 8 CTAs a cluster, asked once per (device, dtype, G', lanes, units, CTAs,
// prefetch: the kernel variant that will run) and cached (a plan of at most 8 CTAs is the portable size: no check).
// The current device must be `device`.
bool fused_plan_resident(int device, at::ScalarType dtype, int g, int lanes, int units, int ctas, bool prefetch) {
  if (ctas <= 8) return true;
  static std::mutex mutex;
  static std::map<std::array<int, 7>, bool> cache;
  const std::array<int, 7> key{device, static_cast<int>(dtype), g, lanes, units, ctas, prefetch ? 1 : 0};
  std::lock_guard<std::mutex> lock(mutex);
  const auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  bool resident;
  if (dtype == at::kBFloat16) {
    resident = prefetch ? fused_resident_for_group<__nv_bfloat16, true>(g, lanes, device, units, ctas)
                        : fused_resident_for_group<__nv_bfloat16, false>(g, lanes, device, units, ctas);
  } else {
    resident = prefetch ? fused_resident_for_group<__half, true>(g, lanes, device, units, ctas)
                        : fused_resident_for_group<__half, false>(g, lanes, device, units, ctas);
  }
  cache.emplace(key, resident);
  return resident;
}

FusedPlan fused_plan(int64_t heads, int g, int64_t head_dim, at::ScalarType dtype, int splits, int device,
                     bool prefetch) {
  // sm90, and its cluster code is what got loaded (core/device.hpp's clusters_available: not a compute_80 PTX JIT,
  // whose fused kernel is the __trap of its pre-sm90 pass)
  const int elem_bytes = static_cast<int>(c10::elementSize(dtype));
  if (!g_fused_enabled.load(std::memory_order_relaxed) || elem_bytes != 2 || device_info(device).major != 9 ||
      !clusters_available(device)) {
    return {};
  }
  const int64_t lane_vecs = head_dim * elem_bytes / 16;
  if (lane_vecs <= 4 || lane_vecs > 16) return {};
  const int64_t nvec = heads * head_dim / 4;
  if (nvec > int64_t(kCombineThreads) * kCombineVecs) return {};
  const int64_t units = heads / g * splits;
  for (int u = 1; u <= fused_max_units(g); u *= 2) {
    if (units % u == 0 && units / u <= kFusedMaxCluster && nvec <= int64_t(kFusedYRegs) * units * kThreads) {
      const int ctas = static_cast<int>(units / u);
      if (!fused_plan_resident(device, dtype, g, lane_vecs <= 8 ? 8 : 16, u, ctas, prefetch)) {
        continue;  // fewer, fuller CTAs
      }
      return {u, ctas};
    }
  }
  return {};
}

template <class T, class O, int kG, int kLanes, bool kPrefetch>
void launch_fused(const Args<T>& args, int64_t batch, const FusedPlan& plan, int device, cudaStream_t stream,
                  bool pdl) {
  auto* kernel = decode_attention_fused_kernel<T, O, kG, kLanes, 1, kPrefetch>;
  if (plan.ctas > 8) allow_nonportable_clusters<T, O, kG, kLanes, kPrefetch>(device);
  const size_t smem = fused_unit_smem<T, kG, kLanes, 1>() * static_cast<size_t>(plan.units);
  const dim3 grid(static_cast<unsigned>(batch), static_cast<unsigned>(plan.ctas));
  C10_CUDA_CHECK(launch_kernel_cluster(kernel, grid, dim3(plan.units * kThreads), smem, stream, pdl,
                                       dim3(1, static_cast<unsigned>(plan.ctas), 1), args));
}

template <class T, class O, int kG, bool kPrefetch>
void launch_fused_for_head_dim(const Args<T>& args, int64_t batch, const FusedPlan& plan, int device,
                               cudaStream_t stream, bool pdl) {
  if (args.head_dim * static_cast<int>(sizeof(T)) / 16 <= 8) {
    launch_fused<T, O, kG, 8, kPrefetch>(args, batch, plan, device, stream, pdl);
  } else {
    launch_fused<T, O, kG, 16, kPrefetch>(args, batch, plan, device, stream, pdl);
  }
}

template <class T, class O, bool kPrefetch>
void launch_fused_for_group(const Args<T>& args, int64_t batch, int g, const FusedPlan& plan, int device,
                            cudaStream_t stream, bool pdl) {
  if constexpr (sizeof(T) == 2) {
    switch (g) {
      case 8: launch_fused_for_head_dim<T, O, 8, kPrefetch>(args, batch, plan, device, stream, pdl); break;
      case 4: launch_fused_for_head_dim<T, O, 4, kPrefetch>(args, batch, plan, device, stream, pdl); break;
      case 2: launch_fused_for_head_dim<T, O, 2, kPrefetch>(args, batch, plan, device, stream, pdl); break;
      default: launch_fused_for_head_dim<T, O, 1, kPrefetch>(args, batch, plan, device, stream, pdl); break;
    }
  }
}

// How Python prints a softmax_scale that fails the finiteness check.
const char* py_nonfinite(double v) { return std::isnan(v) ? "nan" : v > 0 ? "inf" : "-inf"; }

// The checks of the CPU and fake implementations (ops/_checks.py check_decode_attention), in their order, with their exception
// types and first-line messages. A CPU tensor given with CUDA ones fails the device check of the one Python names.
void check_args(const char* op, const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& slots,
                const at::Tensor& positions, double softmax_scale, const at::Tensor* out) {
  const auto qt = q.scalar_type();
  CW8A8_CHECK_TYPE(qt == at::kBFloat16 || qt == at::kHalf || qt == at::kFloat, op, "q",
                   "must be bfloat16, float16 or float32, got ", py_dtype(qt));
  CW8A8_CHECK_TYPE(kv_cache.scalar_type() == qt, op, "kv_cache", "must have q's dtype ", py_dtype(qt), ", got ",
                   py_dtype(kv_cache.scalar_type()));
  CW8A8_CHECK_TYPE(slots.scalar_type() == at::kLong, op, "slots", "must be int64, got ",
                   py_dtype(slots.scalar_type()));
  CW8A8_CHECK_TYPE(positions.scalar_type() == at::kLong, op, "positions", "must be int64, got ",
                   py_dtype(positions.scalar_type()));
  if (out != nullptr) {
    CW8A8_CHECK_TYPE(out->scalar_type() == qt, op, "out", "must have q's dtype ", py_dtype(qt), ", got ",
                     py_dtype(out->scalar_type()));
  }
  CW8A8_CHECK_VALUE(std::isfinite(softmax_scale), op, "softmax_scale", "must be finite, got ",
                    py_nonfinite(softmax_scale));
  check_same_device(op, "kv_cache", kv_cache, "q", q);
  check_same_device(op, "slots", slots, "q", q);
  check_same_device(op, "positions", positions, "q", q);
  if (out != nullptr) check_same_device(op, "out", *out, "q", q);

  CW8A8_CHECK_VALUE(q.dim() == 3, op, "q", "must be 3-D (B, H, D), got shape ", py_tuple(q.sizes()));
  const int64_t batch = q.size(0), heads = q.size(1), d = q.size(2);
  CW8A8_CHECK_VALUE(d > 0 && d <= limits::kAttnMaxHeadDim && d % limits::kAttnHeadDimMultiple == 0, op, "q",
                    "head dim D = q.shape[2] must be a multiple of ", limits::kAttnHeadDimMultiple, " in [",
                    limits::kAttnHeadDimMultiple, ", ", limits::kAttnMaxHeadDim, "], got ", d);
  CW8A8_CHECK_VALUE(heads <= kMaxHeads, op, "q", "H = q.shape[1] must be at most ", kMaxHeads, ", got ", heads);
  CW8A8_CHECK_VALUE(kv_cache.dim() == 5 && kv_cache.size(0) >= 1 && kv_cache.size(1) == 2 &&
                        kv_cache.size(2) >= 1 && kv_cache.size(3) >= 1 && kv_cache.size(4) == d,
                    op, "kv_cache", "must be (num_slots, 2, KVH, S, D) with D = q.shape[2] = ", d,
                    " and num_slots, KVH, S >= 1, got shape ", py_tuple(kv_cache.sizes()));
  const int64_t kv_heads = kv_cache.size(2);
  CW8A8_CHECK_VALUE(heads % kv_heads == 0, op, "kv_cache", "KVH = kv_cache.shape[2] = ", kv_heads,
                    " must divide H = q.shape[1] = ", heads);
  CW8A8_CHECK_VALUE(kv_cache.size(3) < limits::kAttnMaxSeq, op, "kv_cache",
                    "S = kv_cache.shape[3] must be below 2**30, got ", kv_cache.size(3));
  CW8A8_CHECK_VALUE(slots.dim() == 1 && slots.size(0) == batch, op, "slots",
                    "must be (B,) with B = q.shape[0] = ", batch, ", got shape ", py_tuple(slots.sizes()));
  CW8A8_CHECK_VALUE(positions.dim() == 1 && positions.size(0) == batch, op, "positions",
                    "must be (B,) with B = q.shape[0] = ", batch, ", got shape ", py_tuple(positions.sizes()));
  CW8A8_CHECK_VALUE(q.stride(2) == 1, op, "q", "must have stride(2) == 1, got strides ", py_tuple(q.strides()));
  check_contiguous(op, "kv_cache", kv_cache);
  check_aligned16(op, "kv_cache", kv_cache);
  if (out != nullptr) {
    CW8A8_CHECK_VALUE(out->dim() == 2 && out->size(0) == batch && out->size(1) == heads * d, op, "out",
                      "must be (B, H * D) = (", batch, ", ", heads * d, "), got shape ", py_tuple(out->sizes()));
    check_contiguous(op, "out", *out);
  }
  check_cuda(op, "q", q);  // holds after the device checks: the op reached CUDA through one of its tensors
}

// decode_attention_quant's own checks, after decode_attention's (ops/_checks.py, in its order): the quantized
// dtype, then the static scale (float32, on q's device, one value).
void check_quant_args(const at::Tensor& q, at::ScalarType dtype, const std::optional<at::Tensor>& scale) {
  quant::check_quant_dtype(kQuantOp, dtype);
  if (!scale) return;
  check_float32(kQuantOp, "scale", *scale);
  check_same_device(kQuantOp, "scale", *scale, "q", q);
  CW8A8_CHECK_VALUE(scale->numel() == 1, kQuantOp, "scale", "must hold one value (static per-tensor), got shape ",
                    py_tuple(scale->sizes()));
}

// Both kernels on the current stream: the split kernel into a float32 workspace from the caching allocator, then
// the combine kernel into `out` (B, H * D): q's dtype (qtype empty), or the 8-bit `qtype` with the row scales
// written to `scales` (B,) (a static `scale`: its value).
void run(at::Tensor& out, const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& slots,
         const at::Tensor& positions, double softmax_scale, std::optional<at::ScalarType> qtype, float* scales,
         const float* static_scale, const char* op) {
  const int64_t batch = q.size(0), heads = q.size(1), d = q.size(2);
  if (batch == 0 || heads == 0) return;
  c10::cuda::CUDAGuard guard(q.device());
  cudaStream_t stream = current_stream(q);
  const int device = q.get_device();
  const bool pdl = kernels_use_pdl(device);
  const int64_t kv_heads = kv_cache.size(2);
  const int g = heads_per_cta(heads / kv_heads);
  const bool prefetch = attn_prefetch();  // before any launch: a bad value raises here
  (void)combine_cluster_allowed();        // likewise
  const int splits = splits_for(device, batch, heads, g, kv_cache.size(3), d, q.scalar_type(), prefetch);
  const FusedPlan plan = fused_plan(heads, g, d, q.scalar_type(), splits, device, prefetch);
  const int64_t parts = batch * heads * splits;
  at::Tensor workspace;  // the two-kernel path's partial results (the fused path keeps them in shared memory)
  if (plan.units == 0) workspace = at::empty({parts * (d + 2)}, q.options().dtype(at::kFloat));
  auto fill = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    Args<T> args;
    args.q = reinterpret_cast<const T*>(q.data_ptr());
    args.q_stride_b = q.stride(0);
    args.q_stride_h = q.stride(1);
    // 16-byte q loads (split_partial): the pointer and both strides (in elements of T) 16-byte aligned; D is a
    // multiple of 8 (check_args), so a lane's vectors j < D / (16 / sizeof(T)) lie inside the row
    constexpr int64_t kPerVec = 16 / static_cast<int64_t>(sizeof(T));
    args.q_vec16 = reinterpret_cast<uintptr_t>(q.data_ptr()) % 16 == 0 && q.stride(0) % kPerVec == 0 &&
                   q.stride(1) % kPerVec == 0;
    args.kv = reinterpret_cast<const T*>(kv_cache.data_ptr());
    args.num_slots = kv_cache.size(0);
    args.heads = static_cast<int>(heads);
    args.kv_heads = static_cast<int>(kv_heads);
    args.seq_len = static_cast<int>(kv_cache.size(3));
    args.head_dim = static_cast<int>(d);
    args.group_size = static_cast<int>(heads / kv_heads);
    args.slots = slots.data_ptr<int64_t>();
    args.slots_stride = slots.stride(0);
    args.positions = positions.data_ptr<int64_t>();
    args.positions_stride = positions.stride(0);
    args.scale_log2 = static_cast<float>(softmax_scale) * kLog2e;
    args.splits = splits;
    if (plan.units == 0) {
      args.part_acc = workspace.data_ptr<float>();
      args.part_ml = reinterpret_cast<float2*>(workspace.data_ptr<float>() + parts * d);  // 8-byte aligned: d even
    } else {
      args.part_acc = nullptr;
      args.part_ml = nullptr;
    }
    args.out = out.data_ptr();
    args.scales = scales;
    args.static_scale = static_scale;
    if (plan.units > 0) {  // the one-kernel path (fused_plan)
      auto go = [&](auto prefetch_tag) {
        constexpr bool kPrefetch = decltype(prefetch_tag)::value;
        if (!qtype) {
          launch_fused_for_group<T, FloatOut<T>, kPrefetch>(args, batch, g, plan, device, stream, pdl);
        } else if (*qtype == at::kChar) {
          launch_fused_for_group<T, Int8Out, kPrefetch>(args, batch, g, plan, device, stream, pdl);
        } else {
          launch_fused_for_group<T, Fp8Out, kPrefetch>(args, batch, g, plan, device, stream, pdl);
        }
      };
      if (prefetch) {
        go(std::true_type{});
      } else {
        go(std::false_type{});
      }
      graph_nodes::note_rowwise_launch(stream, batch, op);
      return;
    }
    if (prefetch) {
      launch_split_for_group<T, true>(args, batch, heads, g, stream, pdl);
    } else {
      launch_split_for_group<T, false>(args, batch, heads, g, stream, pdl);
    }
    graph_nodes::note_rowwise_launch(stream, batch, op);
    if (!qtype) {
      launch_combine<T, FloatOut<T>>(args, batch, device, stream, pdl);
    } else if (*qtype == at::kChar) {
      launch_combine<T, Int8Out>(args, batch, device, stream, pdl);
    } else {
      launch_combine<T, Fp8Out>(args, batch, device, stream, pdl);
    }
    graph_nodes::note_rowwise_launch(stream, batch, op);
  };
  switch (q.scalar_type()) {
    case at::kBFloat16: fill(static_cast<__nv_bfloat16*>(nullptr)); break;
    case at::kHalf: fill(static_cast<__half*>(nullptr)); break;
    default: fill(static_cast<float*>(nullptr)); break;
  }
}

}  // namespace

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& slots,
                            const at::Tensor& positions, double softmax_scale) {
  check_args(kOp, q, kv_cache, slots, positions, softmax_scale, nullptr);
  at::Tensor out = at::empty({q.size(0), q.size(1) * q.size(2)}, q.options());
  run(out, q, kv_cache, slots, positions, softmax_scale, std::nullopt, nullptr, nullptr, kOp);
  return out;
}

void decode_attention_out(at::Tensor& out, const at::Tensor& q, const at::Tensor& kv_cache,
                          const at::Tensor& slots, const at::Tensor& positions, double softmax_scale) {
  check_args(kOp, q, kv_cache, slots, positions, softmax_scale, &out);
  run(out, q, kv_cache, slots, positions, softmax_scale, std::nullopt, nullptr, nullptr, kOp);
}

bool set_decode_attention_fused(bool enabled) { return g_fused_enabled.exchange(enabled); }

std::string decode_attention_path(int64_t device, int64_t batch, int64_t heads, int64_t kv_heads, int64_t seq_len,
                                  int64_t head_dim, at::ScalarType dtype) {
  constexpr const char* op = "cutlass_w8a8._decode_attention_path";
  TORCH_CHECK_VALUE(device >= 0 && device < 64, op, ": `device` must be a CUDA device index, got ", device);
  TORCH_CHECK_VALUE(batch >= 1 && heads >= 1 && kv_heads >= 1 && seq_len >= 1 && head_dim >= 1, op,
                    ": `batch`, `heads`, `kv_heads`, `seq_len` and `head_dim` must be positive, got ", batch, ", ",
                    heads, ", ", kv_heads, ", ", seq_len, ", ", head_dim);
  TORCH_CHECK_VALUE(heads % kv_heads == 0, op, ": `kv_heads` = ", kv_heads, " must divide `heads` = ", heads);
  const int d = static_cast<int>(device);
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(d));  // clusters_available queries the current device
  const int g = heads_per_cta(heads / kv_heads);
  const bool prefetch = attn_prefetch();
  (void)combine_cluster_allowed();  // a bad value raises here as in the op
  const int splits = splits_for(d, batch, heads, g, seq_len, head_dim, dtype, prefetch);
  const FusedPlan plan = fused_plan(heads, g, head_dim, dtype, splits, d, prefetch);
  return plan.units > 0 ? "fused" : "split";
}

int64_t decode_attention_heads_per_cta(int64_t group) {
  constexpr const char* op = "cutlass_w8a8._decode_attention_heads_per_cta";
  TORCH_CHECK_VALUE(group >= 1 && group <= limits::kAttnMaxHeads, op,
                    ": `group` (query heads per KV head, H / KVH) must be in [1, ", limits::kAttnMaxHeads, "], got ",
                    group);
  return heads_per_cta(group);
}

std::tuple<at::Tensor, at::Tensor> decode_attention_quant(const at::Tensor& q, const at::Tensor& kv_cache,
                                                          const at::Tensor& slots, const at::Tensor& positions,
                                                          double softmax_scale, at::ScalarType dtype,
                                                          const std::optional<at::Tensor>& scale) {
  check_args(kQuantOp, q, kv_cache, slots, positions, softmax_scale, nullptr);
  check_quant_args(q, dtype, scale);
  at::Tensor out = at::empty({q.size(0), q.size(1) * q.size(2)}, q.options().dtype(dtype));
  at::Tensor scales = at::empty({q.size(0), 1}, q.options().dtype(at::kFloat));
  run(out, q, kv_cache, slots, positions, softmax_scale, dtype, scales.data_ptr<float>(),
      scale ? scale->data_ptr<float>() : nullptr, kQuantOp);
  return {out, scales};
}

}  // namespace cutlass_w8a8
