// Rotary embedding of one decode token's query and key heads, in place, and the write of its key and value
// heads into the slot cache: the glue between the qkv projection and decode_attention, in one row-wise
// kernel instead of four torch kernels (the gather of the complex pairs, the multiply, the scatter back and
// the cache's index_put_).
//
//   qkv (B, H + 2 KVH, D): heads ordered q, k, v (vLLM's QKVParallelLinear); rows may be padded (stride(0)).
//   rope (B, R / 2, 2) float32: (cos, sin) of each row's position, for frequency j; R, the rotary width, is read from
//   its shape (1 <= R / 2 <= D / 2; vLLM's rot_dim).
//   Each q and k head: the "neox" rotation of the pairs (x[j], x[j + R/2]), j < R/2, by rope[b, j], in float32 with
//   each product and difference rounded separately (no fused multiply-add, as a complex multiply written out), then
//   rounded once to the element type; x[R:] is left as it is (partial rotary, R < D: GLM-4.5's
//   partial_rotary_factor; transformers' q_pass / k_pass). Then kv_cache[slot, 0, g, position] = k head g (all D
//   elements) and kv_cache[slot, 1, g, position] = v head g.
//   R == D and R < D are two instantiations (kPartial): the full-width one is the kernel as it was before partial
//   rotary (its own trailing rot_half argument unused).
//
// With q_norm / k_norm (Qwen3's head norms, both or neither; (D,) in qkv's dtype): every q head, then every k head,
// is first replaced by rms_norm(head) * weight as csrc/quant/rms_norm.cu computes it (float32 inside: inv = 1 /
// sqrt(sum_k(x_k^2) / D + eps), y = T((x * inv) * w), one rounding to T), and the rotation reads those rounded
// values: the chain rms_norm -> copy back -> rope_kv_cache_ in one kernel (x[R:] normalized the same way, not
// rotated). The sum of squares runs in this kernel's own fixed order (each thread's pair, a butterfly over the
// lanes, the warps in order), not rms_norm.cu's, so a normalized element can differ from the chain's in the last bit
// of T where the float32 value lies within a few float32 roundings of a tie (tests/ops/test_rope_kv_cache.py bounds
// it); deterministic, and independent of B.
//
// Grid (B, H + 2 KVH): block (b, y) handles head y of row b only, so the grid is row-wise (csrc/graphs/graph_nodes.hpp).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <utility>

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include "core/checks.hpp"
#include "core/device.hpp"
#include "core/launch_policy.hpp"
#include "graphs/graph_nodes.hpp"
#include "ops.hpp"
#include "quant/rowwise_reduce.cuh"  // to_float, from_float, PDL (allow_dependent_launch, wait_for_producers)

namespace cutlass_w8a8 {
namespace {

constexpr const char* kOp = "rope_kv_cache_";
constexpr int kMaxThreads = 256;  // threads per block: D / 2 (at least 32), at most this

// The sum of v over the block (blockDim.x a multiple of 32, at most kMaxThreads; every thread calls it and gets the
// result): a butterfly over the lanes of each warp, then the warps' values added in warp order by every thread.
__device__ __forceinline__ float head_sum(float v) {
  __shared__ float warp_value[kMaxThreads / 32];
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_value[warp] = v;
  __syncthreads();
  float total = 0.f;
  const int warps = static_cast<int>(blockDim.x) / 32;
  for (int w = 0; w < warps; ++w) total += warp_value[w];
  return total;
}

// kPartial: R = 2 rot_half < D (rot_half >= 1); otherwise R = D and rot_half is not read.
template <class T, bool kPartial>
__global__ void rope_kv_cache_kernel(T* __restrict__ qkv, int64_t qkv_row_stride, const float* __restrict__ rope,
                                     T* __restrict__ cache, const int64_t* __restrict__ slots, int64_t slots_stride,
                                     const int64_t* __restrict__ positions, int64_t positions_stride, int heads,
                                     int kv_heads, int head_dim, int64_t seq_len, int64_t num_slots,
                                     const T* __restrict__ q_norm, const T* __restrict__ k_norm, float eps,
                                     int rot_half) {
  allow_dependent_launch();  // PDL: the successor (attention) may be scheduled; it waits for this grid
  wait_for_producers();      // the qkv GEMM's output
  const int64_t b = blockIdx.x;
  const int y = blockIdx.y;
  const int half = head_dim / 2;
  T* x = qkv + b * qkv_row_stride + static_cast<int64_t>(y) * head_dim;
  // Out-of-range slots and positions (the caller's duty, unchecked on the device) are clamped, as
  // decode_attention does: a wrong row, never a write outside the cache.
  const int64_t slot = min(max(slots[b * slots_stride], int64_t{0}), num_slots - 1);
  const int64_t pos = min(max(positions[b * positions_stride], int64_t{0}), seq_len - 1);
  // cache row of (slot, which, g, pos): ((slot * 2 + which) * KVH + g) * S + pos
  auto cache_row = [&](int which, int g) {
    return cache + (((slot * 2 + which) * kv_heads + g) * seq_len + pos) * head_dim;
  };
  if (y >= heads + kv_heads) {  // a value head: copy
    T* dst = cache_row(1, y - heads - kv_heads);
    for (int i = threadIdx.x; i < head_dim; i += blockDim.x) dst[i] = x[i];
    return;
  }
  const int rh = kPartial ? rot_half : half;  // the rotated pairs (x[j], x[j + rh]), j < rh
  const float* r = rope + b * static_cast<int64_t>(rh) * 2;
  T* dst = y >= heads ? cache_row(0, y - heads) : nullptr;
  // the head norm (uniform over the block: y is the block's): inv = 1 / sqrt(mean(x^2) + eps), as rms_norm.cu
  const T* w = q_norm == nullptr ? nullptr : (y < heads ? q_norm : k_norm);
  float inv_rms = 0.f;
  if (w != nullptr) {
    float ss = 0.f;
    for (int j = threadIdx.x; j < half; j += blockDim.x) {
      const float x1 = to_float(x[j]), x2 = to_float(x[j + half]);
      ss += __fmul_rn(x1, x1);  // each square rounded on its own (as torch's pow), not fused into the sum
      ss += __fmul_rn(x2, x2);
    }
    inv_rms = 1.f / sqrtf(head_sum(ss) / static_cast<float>(head_dim) + eps);
  }
  for (int j = threadIdx.x; j < rh; j += blockDim.x) {
    const float c = r[2 * j], s = r[2 * j + 1];
    float x1 = to_float(x[j]), x2 = to_float(x[j + rh]);
    if (w != nullptr) {  // y = T((x * inv) * w), rounded to T before the rotation reads it (the chain's copy back)
      x1 = to_float(from_float<T>(__fmul_rn(__fmul_rn(x1, inv_rms), to_float(w[j]))));
      x2 = to_float(from_float<T>(__fmul_rn(__fmul_rn(x2, inv_rms), to_float(w[j + rh]))));
    }
    const T o1 = from_float<T>(__fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s)));
    const T o2 = from_float<T>(__fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s)));
    x[j] = o1;
    x[j + rh] = o2;
    if (dst != nullptr) {
      dst[j] = o1;
      dst[j + rh] = o2;
    }
  }
  if constexpr (kPartial) {
    // x[R:], not rotated: normalized in place with the norms (the same y = T((x * inv) * w)), and into the cache
    // for a k head. Each thread's elements are its own (no other thread reads or writes them after head_sum).
    if (w == nullptr && dst == nullptr) return;  // a q head without norms: nothing to do
    for (int i = 2 * rh + threadIdx.x; i < head_dim; i += blockDim.x) {
      T v = x[i];
      if (w != nullptr) {
        v = from_float<T>(__fmul_rn(__fmul_rn(to_float(v), inv_rms), to_float(w[i])));
        x[i] = v;
      }
      if (dst != nullptr) dst[i] = v;
    }
  }
}

}  // namespace

void rope_kv_cache_(at::Tensor& qkv, const at::Tensor& rope, at::Tensor& kv_cache, const at::Tensor& slots,
                    const at::Tensor& positions, int64_t num_heads, int64_t num_kv_heads,
                    const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm, double eps) {
  const auto dt = qkv.scalar_type();
  CW8A8_CHECK_TYPE(dt == at::kBFloat16 || dt == at::kHalf || dt == at::kFloat, kOp, "qkv",
                   "must be bfloat16, float16 or float32, got ", c10::toString(dt));
  CW8A8_CHECK_TYPE(kv_cache.scalar_type() == dt, kOp, "kv_cache", "must have qkv's dtype");
  CW8A8_CHECK_TYPE(rope.scalar_type() == at::kFloat, kOp, "rope", "must be float32");
  CW8A8_CHECK_TYPE(slots.scalar_type() == at::kLong, kOp, "slots", "must be int64");
  CW8A8_CHECK_TYPE(positions.scalar_type() == at::kLong, kOp, "positions", "must be int64");
  CW8A8_CHECK_VALUE(qkv.is_cuda(), kOp, "qkv", "must be a CUDA tensor");
  const bool one_device = rope.device() == qkv.device() && kv_cache.device() == qkv.device() &&
                          slots.device() == qkv.device() && positions.device() == qkv.device();
  CW8A8_CHECK_VALUE(one_device, kOp, "qkv", "and `rope`, `kv_cache`, `slots`, `positions` must be on one device");
  CW8A8_CHECK_VALUE(num_heads > 0 && num_kv_heads > 0, kOp, "num_heads", "and `num_kv_heads` must be positive");
  CW8A8_CHECK_VALUE(qkv.dim() == 3 && qkv.size(1) == num_heads + 2 * num_kv_heads, kOp, "qkv",
                    "must be (B, num_heads + 2 num_kv_heads, D), got ", qkv.sizes());
  const int64_t b = qkv.size(0), d = qkv.size(2);
  CW8A8_CHECK_VALUE(d >= 2 && d % 2 == 0 && qkv.stride(2) == 1 && qkv.stride(1) == d, kOp, "qkv",
                    "must have contiguous heads of even D (strides (*, D, 1)), got strides ", qkv.strides());
  CW8A8_CHECK_VALUE(kv_cache.dim() == 5 && kv_cache.size(1) == 2 && kv_cache.size(2) == num_kv_heads &&
                        kv_cache.size(4) == d && kv_cache.is_contiguous(),
                    kOp, "kv_cache", "must be contiguous (slots, 2, num_kv_heads, S, D), got ", kv_cache.sizes());
  // the rotary width R = 2 rope.size(1) (partial rotary, GLM's partial_rotary_factor): 2 <= R <= D
  CW8A8_CHECK_VALUE(rope.dim() == 3 && rope.size(0) == b && rope.size(1) >= 1 && rope.size(1) <= d / 2 &&
                        rope.size(2) == 2 && rope.is_contiguous(),
                    kOp, "rope", "must be contiguous (B, R / 2, 2) with 1 <= R / 2 <= D / 2 = ", d / 2, ", got ",
                    rope.sizes());
  CW8A8_CHECK_VALUE(slots.dim() == 1 && slots.size(0) == b, kOp, "slots", "must be (B,), got ", slots.sizes());
  CW8A8_CHECK_VALUE(positions.dim() == 1 && positions.size(0) == b, kOp, "positions", "must be (B,), got ",
                    positions.sizes());
  CW8A8_CHECK_VALUE(kv_cache.size(0) > 0 && kv_cache.size(3) > 0, kOp, "kv_cache", "must not be empty");
  // the head norms: both or neither, (D,) contiguous in qkv's dtype on its device; eps finite and >= 0
  CW8A8_CHECK_VALUE(q_norm.has_value() == k_norm.has_value(), kOp, "q_norm",
                    "and `k_norm` must be given together (Qwen3's head norms) or both be None");
  for (const auto& [name, t] : {std::pair<const char*, const std::optional<at::Tensor>*>{"q_norm", &q_norm},
                                std::pair<const char*, const std::optional<at::Tensor>*>{"k_norm", &k_norm}}) {
    if (!t->has_value()) continue;
    const at::Tensor& wt = **t;
    CW8A8_CHECK_TYPE(wt.scalar_type() == dt, kOp, name, "must have qkv's dtype");
    CW8A8_CHECK_VALUE(wt.device() == qkv.device(), kOp, name, "must be on qkv's device");
    CW8A8_CHECK_VALUE(wt.dim() == 1 && wt.size(0) == d && wt.stride(0) == 1, kOp, name,
                      "must be contiguous (D,) = [", d, "], got ", wt.sizes());
  }
  CW8A8_CHECK_VALUE(!q_norm.has_value() || (eps >= 0.0 && std::isfinite(eps)), kOp, "eps",
                    "must be given with q_norm and k_norm, a finite number >= 0");
  if (b == 0) return;
  c10::cuda::CUDAGuard guard(qkv.device());
  cudaStream_t stream = current_stream(qkv);
  const dim3 grid(static_cast<unsigned>(b), static_cast<unsigned>(num_heads + 2 * num_kv_heads));
  const bool norms = q_norm.has_value();
  int threads = static_cast<int>(std::min<int64_t>(std::max<int64_t>(d / 2, 32), kMaxThreads));
  if (norms) threads = (threads + 31) / 32 * 32;  // whole warps for the sum of squares (head_sum)
  const bool pdl = kernels_use_pdl(qkv.get_device());
  const bool partial = rope.size(1) != d / 2;  // R < D
  auto launch = [&](auto tag) {
    using T = decltype(tag);
    C10_CUDA_CHECK(launch_kernel(
        partial ? rope_kv_cache_kernel<T, true> : rope_kv_cache_kernel<T, false>, grid, dim3(threads), 0, stream, pdl,
        reinterpret_cast<T*>(qkv.data_ptr()),
        qkv.stride(0), rope.data_ptr<float>(), reinterpret_cast<T*>(kv_cache.data_ptr()),
        slots.data_ptr<int64_t>(), slots.stride(0), positions.data_ptr<int64_t>(), positions.stride(0),
        static_cast<int>(num_heads), static_cast<int>(num_kv_heads), static_cast<int>(d), kv_cache.size(3),
        kv_cache.size(0), norms ? reinterpret_cast<const T*>(q_norm->data_ptr()) : nullptr,
        norms ? reinterpret_cast<const T*>(k_norm->data_ptr()) : nullptr, static_cast<float>(eps),
        static_cast<int>(rope.size(1))));
  };
  if (dt == at::kBFloat16) {
    launch(__nv_bfloat16{});
  } else if (dt == at::kHalf) {
    launch(__half{});
  } else {
    launch(float{});
  }
  graph_nodes::note_rowwise_launch(stream, b, "rope_kv_cache_");
}

}  // namespace cutlass_w8a8
