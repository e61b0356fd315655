// The routing of one token by one warp: transformers' MoE routers on a row of E router logits (ops/moe.py's
// moe_route documents the semantics). Shared by routing.cu's route_kernel (moe_topk_softmax, moe_route: logits read
// from global memory) and router_route.cu's router_route_kernel (moe_router_route: logits computed by the same
// kernel and held in shared memory); each passes `logit(i)`, the float32 value of logit i, and gets the same
// float32 operations in the same order.
//
// The warp writes the row's ranking keys, as float32, into `row` (E floats of shared memory, its own):
//   softmax: the logits; max and sum(exp(l - max)) reduced over them (a lane's strided partial, then a butterfly:
//            a fixed order, the one of torch's persistent warp softmax, so exp(l - max) / sum is torch's CUDA softmax
//            bit for bit); with a correction bias the key is then exp(l - max) / sum + bias;
//   sigmoid: 1 / (1 + exp(-l)) (torch's CUDA sigmoid: IEEE division, expf, no fast-math), plus the bias if any.
// Grouped top-k (n_group > 1): lane g < n_group scans group g for its first two experts in the ranking order and
// sums their choice values (the key, or for softmax without bias the probability of the logit); topk_group rounds
// of a warp argmax over the lanes keep the groups (group score descending, group index ascending); each lane then
// marks which of its strided experts are in kept groups. The top_k: k rounds over the eligible non-NaN experts in the
// order (key descending, index ascending); round j takes the first pair strictly after the one round j - 1 took, so
// equal keys come out lower index first and nothing is taken twice, without marking the row. Each lane keeps its
// own first candidate; a round is two redux.sync (largest key, then least index) and a rescan by the one lane whose
// candidate was taken (the former per-round scan by every lane and 5-step shuffle argmax took ~0.6 us a round on an
// H200: moe_route's top-8 of 128 at 6.1 us against 2.0 us for top-1, 2026-11-29).
// weight = the expert's score (softmax without bias: from its logit key; with a bias: recomputed from the logit
// re-read through `logit(i)`, the same float32 operations); renormalized: divided by the sum of the k weights,
// added in j order (the CPU reference's order), + 1e-20 for sigmoid; then times the scaling factor.
// With k <= 32 lane j computes round j's weight after the rounds and the sum runs through shuffles in j order (the
// same float32 operations); above 32 the weights are computed as the rounds go.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

namespace cutlass_w8a8 {
namespace moe_routing {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kNoIndex = 0x7fffffff;

// Whether (v, i) comes before (bv, bi) in the selection order; bi == kNoIndex is "nothing yet".
__device__ __forceinline__ bool ranks_before(float v, int i, float bv, int bi) {
  return i != kNoIndex && (bi == kNoIndex || v > bv || (v == bv && i < bi));
}

// A non-NaN float32 as an unsigned key in the same order (larger value, larger key; -0 and +0 the same key, as they
// compare equal); every key is above 0, the key of "no candidate".
__device__ __forceinline__ unsigned ordered_key(float v) {
  const unsigned u = __float_as_uint(v == 0.f ? 0.f : v);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// torch's CUDA sigmoid of a float32 (aten/src/ATen/native/cuda/UnarySpecialOpsKernel.cu): 1 / (1 + exp(-x)).
__device__ __forceinline__ float sigmoid_f32(float x) { return 1.f / (1.f + expf(-x)); }

// (best_v, best_i) := the first in the selection order over the warp's lanes (a total order on non-NaN values, so
// every lane ends with the same pair).
__device__ __forceinline__ void warp_argmax(float& best_v, int& best_i) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float ov = __shfl_xor_sync(kFullMask, best_v, off);
    const int oi = __shfl_xor_sync(kFullMask, best_i, off);
    if (ranks_before(ov, oi, best_v, best_i)) {
      best_v = ov;
      best_i = oi;
    }
  }
}

// The routing spec and the outputs (the token's row t of weights / ids).
struct RouteArgs {
  int64_t rows, stride0, stride1;  // router_logits [rows, e] (route_kernel only)
  int e, k;
  const float* bias;               // nullptr: no correction bias
  int64_t bias_stride;
  int n_group, group_size, topk_group;  // n_group 1: no groups
  bool renormalize;
  float renorm_eps;                // added to the sum before the division (1e-20 for sigmoid, else 0)
  float scale;                     // the weights' last factor
  float* weights;                  // [rows, k] contiguous
  int* ids;                        // [rows, k] contiguous
};

// Route token t: every lane of the warp calls it (it shuffles and __syncwarp's); `row`: E floats of shared memory
// the warp owns; `logit(i)`: float32 logit i of the token (any lane may ask for any i).
template <bool kSigmoid, class Logit>
__device__ __forceinline__ void route_row(const Logit& logit, float* row, const RouteArgs& a, int64_t t, int lane) {
  const int e = a.e;
  const bool biased = a.bias != nullptr;
  const bool logit_keys = !kSigmoid && !biased;  // softmax without bias ranks the logits themselves

  float mx = -INFINITY, sum = 0.f;
  if constexpr (kSigmoid) {
    for (int i = lane; i < e; i += 32) {
      const float s = sigmoid_f32(logit(i));
      row[i] = biased ? s + a.bias[i * a.bias_stride] : s;
    }
  } else {
    for (int i = lane; i < e; i += 32) {
      const float v = logit(i);
      row[i] = v;
      mx = fmaxf(mx, v);
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, off));
    for (int i = lane; i < e; i += 32) sum += expf(row[i] - mx);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(kFullMask, sum, off);
    if (biased) {
      for (int i = lane; i < e; i += 32) row[i] = expf(row[i] - mx) / sum + a.bias[i * a.bias_stride];
    }
  }
  __syncwarp();  // the group scan below reads other lanes' entries

  // The score of expert i whose key is `key` (the unbiased weight).
  auto score_of = [&](int i, float key) -> float {
    if (logit_keys) return expf(key - mx) / sum;
    if (kSigmoid && !biased) return key;
    const float x = logit(i);
    if constexpr (kSigmoid) {
      return sigmoid_f32(x);
    } else {
      return expf(x - mx) / sum;
    }
  };

  // Grouped top-k: the kept groups, then each lane's eligible experts (bit m: expert lane + 32 m; E <= 1024).
  unsigned kept = 1u;
  unsigned eligible = 0xffffffffu;
  if (a.n_group > 1) {
    const int gs = a.group_size;
    float gscore = 0.f;
    if (lane < a.n_group) {
      float v1 = -INFINITY, v2 = -INFINITY;
      int i1 = kNoIndex, i2 = kNoIndex;
      for (int i = lane * gs; i < (lane + 1) * gs; ++i) {
        const float v = row[i];
        if (ranks_before(v, i, v1, i1)) {
          v2 = v1;
          i2 = i1;
          v1 = v;
          i1 = i;
        } else if (ranks_before(v, i, v2, i2)) {
          v2 = v;
          i2 = i;
        }
      }
      // gs >= 2, so i1 and i2 are experts of the group whatever the values
      gscore = logit_keys ? score_of(i1, v1) + score_of(i2, v2) : v1 + v2;
    }
    kept = 0u;
    for (int r = 0; r < a.topk_group; ++r) {
      float best_v = -INFINITY;
      int best_i = kNoIndex;
      if (lane < a.n_group && !((kept >> lane) & 1u) && !isnan(gscore)) {
        best_v = gscore;
        best_i = lane;
      }
      warp_argmax(best_v, best_i);
      if (best_i == kNoIndex) best_i = __ffs(~kept) - 1;  // only NaN group scores left: the lowest group not kept
      kept |= 1u << best_i;
    }
    eligible = 0u;
    for (int i = lane, m = 0; i < e; i += 32, ++m) {
      if ((kept >> (i / gs)) & 1u) eligible |= 1u << m;
    }
  }

  float* w_out = a.weights + t * a.k;
  int* id_out = a.ids + t * a.k;
  // Each lane holds its candidate: the first, in the selection order, of its eligible experts (lane + 32 m) that
  // rank after the pair the last round took. A round takes the warp's first candidate with two redux.sync (the
  // largest ordered key, then the least index among the lanes holding it): the same pair the former butterfly of
  // (value, index) comparisons took, since the order is total on non-NaN keys. Only the lane whose candidate was
  // taken looks for its next one; the others' candidates still rank after the taken pair. NaN keys are never
  // candidates (a NaN row's output is unspecified: ids stay in range).
  float cand_v;
  int cand_i;
  auto next_candidate = [&](float prev_v, int prev_i) {
    cand_v = -INFINITY;
    cand_i = kNoIndex;
    for (int i = lane, m = 0; i < e; i += 32, ++m) {
      const float v = row[i];
      const bool after_prev = v < prev_v || (v == prev_v && i > prev_i);
      if (((eligible >> m) & 1u) && !isnan(v) && after_prev && ranks_before(v, i, cand_v, cand_i)) {
        cand_v = v;
        cand_i = i;
      }
    }
  };
  next_candidate(INFINITY, -1);  // (+inf, -1): before every pair
  // k <= 32: lane j keeps round j's pair and, after the rounds, computes its weight (the rounds' serial chain keeps
  // only the selection); the sum is then taken in j order through shuffles, the same float32 additions as before.
  // k > 32: the weights as the rounds go, lane 0 writing them.
  const bool in_regs = a.k <= 32;
  float my_v = 0.f;
  int my_id = 0;
  float total = 0.f;
  for (int j = 0; j < a.k; ++j) {
    const unsigned key = cand_i == kNoIndex ? 0u : ordered_key(cand_v);
    const unsigned top = __reduce_max_sync(kFullMask, key);
    int best_i = static_cast<int>(__reduce_min_sync(kFullMask, key == top ? static_cast<unsigned>(cand_i)
                                                                          : static_cast<unsigned>(kNoIndex)));
    float best_v;
    if (top == 0u) {  // no candidate left: only NaN keys (unspecified output): keep ids in range, in a kept group
      best_i = (__ffs(kept) - 1) * (a.n_group > 1 ? a.group_size : 0);
      best_v = NAN;
    } else {
      best_v = __shfl_sync(kFullMask, cand_v, best_i & 31);
      if (lane == (best_i & 31)) next_candidate(best_v, best_i);
    }
    if (in_regs) {
      if (lane == j) {
        my_v = best_v;
        my_id = best_i;
      }
    } else {
      const float w = score_of(best_i, best_v);
      total += w;
      if (lane == 0) {
        id_out[j] = best_i;
        w_out[j] = w;
      }
    }
  }
  if (in_regs) {
    const float my_w = lane < a.k ? score_of(my_id, my_v) : 0.f;
    for (int j = 0; j < a.k; ++j) total += __shfl_sync(kFullMask, my_w, j);
    if (lane < a.k) {
      float w = my_w;
      if (a.renormalize) w = w / (total + a.renorm_eps);
      w_out[lane] = w * a.scale;
      id_out[lane] = my_id;
    }
    return;
  }
  const float denom = total + a.renorm_eps;
  __syncwarp();  // lane 0's weights are visible to the warp
  for (int j = lane; j < a.k; j += 32) {
    float w = w_out[j];
    if (a.renormalize) w = w / denom;
    w_out[j] = w * a.scale;
  }
}

}  // namespace moe_routing
}  // namespace cutlass_w8a8
