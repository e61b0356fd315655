// decode_attention: one query token per sequence attending to its own KV-cache slot (a decode step).
//
//   kvh = h / (H / KVH),  K = kv_cache[slots[b], 0, kvh],  V = kv_cache[slots[b], 1, kvh]
//   p_s = softmax_{s <= positions[b]}(softmax_scale * <q[b, h], K[s]>)
//   out[b, h * D : (h + 1) * D] = round(sum_{s <= positions[b]} p_s V[s])
//
// Only positions 0..positions[b] of one slot are read, so the cost grows with the real batch and the real
// sequence lengths, not with the cache's size. All arithmetic is float32 and the result is rounded once to
// q's dtype. Scores are kept in base 2 (q is pre-multiplied by softmax_scale * log2(e), exp2f replaces
// expf: flash-attention's form of the same softmax).
//
// Method: online softmax (Milakov & Gimelshein 2018, "Online normalizer calculation for softmax"), split over
// the positions and merged afterwards as in flash-decoding (Dao et al. 2023). One block of 4 warps per (row
// b, query head h): grid (B, H). Inside a warp, a "group" of kLanes lanes handles one position at a time,
// each lane owning kVecs 16-byte slices of D (the dot product is a shuffle reduction over the group); the
// 32 / kLanes groups of a warp read consecutive positions, so a warp's loads are contiguous. Each group keeps
// its own running max m, running sum l and float32 accumulator of its D slice over positions group,
// group + G, group + 2G, ... (G = groups per block), kUnroll positions per step to keep loads in flight.
// The groups of a warp are then merged by shuffles and the 4 warps through shared memory:
//   M = max_i m_i,  l = sum_i l_i 2^(m_i - M),  acc = sum_i acc_i 2^(m_i - M),  out = acc / l.
//
// Block shape, measured (H100, Llama-3-8B heads 32 / 8 x 128, bf16, S = 2048, CUDA-graph replays): 4 warps
// and 4 positions per group and step read B = 64 rows at position 2047 in 378 us (1.4 TB/s of cache; the
// former index_select + SDPA took 589 us) and B = 1 in 42 us (former: 63 us). 8 warps ran B = 1 in 25 us
// but B = 64 at position 128 in 42 us instead of 32 us; 8 positions per step lost from B = 16 on. Small
// batches at long positions are latency-bound (H blocks, each stepping through its positions); splitting
// the positions over several blocks per row (flash-decoding's split-KV and a combine kernel) would help them.
//
// Row-wise (csrc/graphs/graph_nodes.hpp): block (x, y) reads only row x's q, slot and position and writes only row
// x's output, and no kernel argument depends on B, so a captured node can be shrunk to fewer rows by its
// gridDim.x alone. One launch on the current stream, no host synchronisation, no allocation beyond the
// output of the functional form.
//
// Not checked (it would need a host synchronisation): slots in [0, num_slots) and positions in [0, S).
// The kernel clamps both into range, so a bad value reads the wrong (but allocated) cache entries instead of
// faulting; callers (LlamaDecoder, DecodeGraphRunner) validate them on the host.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include "core/checks.hpp"
#include "core/device.hpp"
#include "core/limits.hpp"
#include "graphs/graph_nodes.hpp"
#include "ops.hpp"
#include "quant/rowwise_reduce.cuh"

namespace cutlass_w8a8 {
namespace {

constexpr const char* kOp = "decode_attention";
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kUnroll = 4;       // positions per group and step (loads issued before the math)
constexpr int64_t kMaxHeads = limits::kAttnMaxHeads;  // H: gridDim.y
constexpr float kLog2e = 1.4426950408889634f;

// Element conversions (to_float, from_float): csrc/quant/rowwise_reduce.cuh.

// 2^(m - ref), with 0 for an empty partial result (m = -inf): never (-inf) - (-inf).
__device__ __forceinline__ float rescale(float m, float ref) { return m == -INFINITY ? 0.f : exp2f(m - ref); }

template <class T>
struct Args {
  const T* q;                 // (B, H, D), strides q_stride_b, q_stride_h, 1
  int64_t q_stride_b;
  int64_t q_stride_h;
  const T* kv;                // (num_slots, 2, KVH, S, D) contiguous, 16-byte aligned
  int64_t num_slots;
  int kv_heads;
  int seq_len;                // S
  int head_dim;               // D
  int group_size;             // H / KVH: query heads per key/value head
  const int64_t* slots;       // (B,), stride slots_stride
  int64_t slots_stride;
  const int64_t* positions;   // (B,), stride positions_stride
  int64_t positions_stride;
  T* out;                     // (B, H * D) contiguous
  float scale_log2;           // softmax_scale * log2(e)
};

// kLanes lanes (a power of two, <= 32) per position, each owning kVecs 16-byte vectors of the D elements:
// vector j of a row belongs to lane (j % kLanes) of the group, as its (j / kLanes)-th vector. Vectors at or
// past D (when D is not kLanes * kVecs vectors) are zeros.
template <class T, int kLanes, int kVecs>
__global__ void __launch_bounds__(kThreads) decode_attention_kernel(const Args<T> a) {
  constexpr int kPer = 16 / static_cast<int>(sizeof(T));  // elements per 16-byte vector
  constexpr int kElems = kVecs * kPer;                     // elements of D per lane
  constexpr int kGroupsPerWarp = 32 / kLanes;
  constexpr int kGroups = kWarps * kGroupsPerWarp;         // positions processed side by side
  constexpr int kStep = kGroups * kUnroll;                 // positions per block and step
  struct alignas(16) Vec {
    T v[kPer];
  };
  static_assert(sizeof(Vec) == 16, "16-byte vectors");

  const int64_t b = blockIdx.x;
  const int h = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int lane_in_group = lane % kLanes;
  const int group = warp * kGroupsPerWarp + lane / kLanes;
  const int nvec = a.head_dim / kPer;  // vectors per cached row of D elements

  int64_t slot = a.slots[b * a.slots_stride];
  slot = slot < 0 ? 0 : (slot >= a.num_slots ? a.num_slots - 1 : slot);
  int64_t pos = a.positions[b * a.positions_stride];
  pos = pos < 0 ? 0 : (pos >= a.seq_len ? a.seq_len - 1 : pos);
  const int len = static_cast<int>(pos) + 1;  // positions 0..pos
  const int kvh = h / a.group_size;
  const int64_t head_rows = int64_t(a.seq_len) * nvec;  // vectors of one (slot, k/v, head)
  const Vec* k_rows = reinterpret_cast<const Vec*>(a.kv) + ((slot * 2) * a.kv_heads + kvh) * head_rows;
  const Vec* v_rows = k_rows + int64_t(a.kv_heads) * head_rows;

  // this lane's slice of q, scaled (scalar loads: q is a strided view with no alignment promise)
  float qf[kElems];
  const T* q_row = a.q + b * a.q_stride_b + h * a.q_stride_h;
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    const int j = lane_in_group + i * kLanes;
#pragma unroll
    for (int e = 0; e < kPer; ++e) {
      qf[i * kPer + e] = j < nvec ? to_float(q_row[j * kPer + e]) * a.scale_log2 : 0.f;
    }
  }

  float m = -INFINITY, l = 0.f, acc[kElems];
#pragma unroll
  for (int e = 0; e < kElems; ++e) acc[e] = 0.f;

  // The bound is the same for every thread of the block, so the shuffles below always see full warps.
  for (int base = 0; base < len; base += kStep) {
    Vec kr[kUnroll][kVecs], vr[kUnroll][kVecs];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int s = base + u * kGroups + group;
#pragma unroll
      for (int i = 0; i < kVecs; ++i) {
        const int j = lane_in_group + i * kLanes;
        if (s < len && j < nvec) {
          kr[u][i] = k_rows[int64_t(s) * nvec + j];
          vr[u][i] = v_rows[int64_t(s) * nvec + j];
        } else {
#pragma unroll
          for (int e = 0; e < kPer; ++e) kr[u][i].v[e] = vr[u][i].v[e] = from_float<T>(0.f);
        }
      }
    }
    float score[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      float dot = 0.f;
#pragma unroll
      for (int i = 0; i < kVecs; ++i) {
#pragma unroll
        for (int e = 0; e < kPer; ++e) dot = fmaf(qf[i * kPer + e], to_float(kr[u][i].v[e]), dot);
      }
#pragma unroll
      for (int off = kLanes / 2; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off);
      score[u] = base + u * kGroups + group < len ? dot : -INFINITY;
    }
    float m_new = m;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) m_new = fmaxf(m_new, score[u]);
    if (m_new != -INFINITY) {  // else this group has had no position yet: nothing to add
      const float alpha = rescale(m, m_new);
      l *= alpha;
#pragma unroll
      for (int e = 0; e < kElems; ++e) acc[e] *= alpha;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const float p = exp2f(score[u] - m_new);  // 0 for a position past len (-inf)
        l += p;
#pragma unroll
        for (int i = 0; i < kVecs; ++i) {
#pragma unroll
          for (int e = 0; e < kPer; ++e) acc[i * kPer + e] = fmaf(p, to_float(vr[u][i].v[e]), acc[i * kPer + e]);
        }
      }
      m = m_new;
    }
  }

  // merge the groups of a warp: lanes kLanes, 2 kLanes, ... apart hold the same slice of D
#pragma unroll
  for (int off = kLanes; off < 32; off <<= 1) {
    const float m_other = __shfl_xor_sync(0xffffffffu, m, off);
    const float l_other = __shfl_xor_sync(0xffffffffu, l, off);
    const float m_max = fmaxf(m, m_other);
    const float w_self = rescale(m, m_max), w_other = rescale(m_other, m_max);
    l = l * w_self + l_other * w_other;
#pragma unroll
    for (int e = 0; e < kElems; ++e) {
      const float acc_other = __shfl_xor_sync(0xffffffffu, acc[e], off);
      acc[e] = acc[e] * w_self + acc_other * w_other;
    }
    m = m_max;
  }

  // merge the warps through shared memory; element d of the padded row is vector d / kPer of its lane
  constexpr int kRow = kLanes * kElems;  // >= D
  __shared__ float s_m[kWarps], s_l[kWarps];
  __shared__ float s_acc[kWarps][kRow];
  if (lane < kLanes) {
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
#pragma unroll
      for (int e = 0; e < kPer; ++e) s_acc[warp][(lane + i * kLanes) * kPer + e] = acc[i * kPer + e];
    }
  }
  if (lane == 0) {
    s_m[warp] = m;
    s_l[warp] = l;
  }
  __syncthreads();
  float m_max = s_m[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) m_max = fmaxf(m_max, s_m[w]);  // finite: position 0 is always read
  float weight[kWarps], l_total = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    weight[w] = rescale(s_m[w], m_max);
    l_total += s_l[w] * weight[w];
  }
  T* out_row = a.out + b * (int64_t(a.group_size) * a.kv_heads * a.head_dim) + int64_t(h) * a.head_dim;
  for (int d = threadIdx.x; d < a.head_dim; d += kThreads) {
    float o = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) o += s_acc[w][d] * weight[w];
    out_row[d] = from_float<T>(o / l_total);
  }
}

template <class T, int kLanes, int kVecs>
void launch(const Args<T>& args, int64_t batch, int64_t heads, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(batch), static_cast<unsigned>(heads));
  decode_attention_kernel<T, kLanes, kVecs><<<grid, kThreads, 0, stream>>>(args);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The narrowest group that holds a row of D elements: nvec 16-byte vectors over kLanes lanes.
template <class T>
void launch_for_head_dim(const Args<T>& args, int64_t batch, int64_t heads, cudaStream_t stream) {
  const int nvec = args.head_dim * static_cast<int>(sizeof(T)) / 16;
  if (nvec <= 1) {
    launch<T, 1, 1>(args, batch, heads, stream);
  } else if (nvec <= 2) {
    launch<T, 2, 1>(args, batch, heads, stream);
  } else if (nvec <= 4) {
    launch<T, 4, 1>(args, batch, heads, stream);
  } else if (nvec <= 8) {
    launch<T, 8, 1>(args, batch, heads, stream);
  } else if (nvec <= 16) {  // D = 128 in 16-bit types
    launch<T, 16, 1>(args, batch, heads, stream);
  } else if (nvec <= 32) {
    launch<T, 32, 1>(args, batch, heads, stream);
  } else if constexpr (sizeof(T) == 4) {  // float32 with D > 128 (16-bit types never get here: D <= 256)
    launch<T, 32, 2>(args, batch, heads, stream);
  }
}

// How Python prints a softmax_scale that fails the finiteness check.
const char* py_nonfinite(double v) { return std::isnan(v) ? "nan" : v > 0 ? "inf" : "-inf"; }

// The checks of the CPU and fake implementations (ops/_checks.py check_decode_attention), in their order, with their exception
// types and first-line messages. A CPU tensor given with CUDA ones fails the device check of the one Python names.
void check_args(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& slots,
                const at::Tensor& positions, double softmax_scale, const at::Tensor* out) {
  const auto qt = q.scalar_type();
  CW8A8_CHECK_TYPE(qt == at::kBFloat16 || qt == at::kHalf || qt == at::kFloat, kOp, "q",
                   "must be bfloat16, float16 or float32, got ", py_dtype(qt));
  CW8A8_CHECK_TYPE(kv_cache.scalar_type() == qt, kOp, "kv_cache", "must have q's dtype ", py_dtype(qt), ", got ",
                   py_dtype(kv_cache.scalar_type()));
  CW8A8_CHECK_TYPE(slots.scalar_type() == at::kLong, kOp, "slots", "must be int64, got ",
                   py_dtype(slots.scalar_type()));
  CW8A8_CHECK_TYPE(positions.scalar_type() == at::kLong, kOp, "positions", "must be int64, got ",
                   py_dtype(positions.scalar_type()));
  if (out != nullptr) {
    CW8A8_CHECK_TYPE(out->scalar_type() == qt, kOp, "out", "must have q's dtype ", py_dtype(qt), ", got ",
                     py_dtype(out->scalar_type()));
  }
  CW8A8_CHECK_VALUE(std::isfinite(softmax_scale), kOp, "softmax_scale", "must be finite, got ",
                    py_nonfinite(softmax_scale));
  check_same_device(kOp, "kv_cache", kv_cache, "q", q);
  check_same_device(kOp, "slots", slots, "q", q);
  check_same_device(kOp, "positions", positions, "q", q);
  if (out != nullptr) check_same_device(kOp, "out", *out, "q", q);

  CW8A8_CHECK_VALUE(q.dim() == 3, kOp, "q", "must be 3-D (B, H, D), got shape ", py_tuple(q.sizes()));
  const int64_t batch = q.size(0), heads = q.size(1), d = q.size(2);
  CW8A8_CHECK_VALUE(d > 0 && d <= limits::kAttnMaxHeadDim && d % limits::kAttnHeadDimMultiple == 0, kOp, "q",
                    "head dim D = q.shape[2] must be a multiple of ", limits::kAttnHeadDimMultiple, " in [",
                    limits::kAttnHeadDimMultiple, ", ", limits::kAttnMaxHeadDim, "], got ", d);
  CW8A8_CHECK_VALUE(heads <= kMaxHeads, kOp, "q", "H = q.shape[1] must be at most ", kMaxHeads, ", got ", heads);
  CW8A8_CHECK_VALUE(kv_cache.dim() == 5 && kv_cache.size(0) >= 1 && kv_cache.size(1) == 2 &&
                        kv_cache.size(2) >= 1 && kv_cache.size(3) >= 1 && kv_cache.size(4) == d,
                    kOp, "kv_cache", "must be (num_slots, 2, KVH, S, D) with D = q.shape[2] = ", d,
                    " and num_slots, KVH, S >= 1, got shape ", py_tuple(kv_cache.sizes()));
  const int64_t kv_heads = kv_cache.size(2);
  CW8A8_CHECK_VALUE(heads % kv_heads == 0, kOp, "kv_cache", "KVH = kv_cache.shape[2] = ", kv_heads,
                    " must divide H = q.shape[1] = ", heads);
  CW8A8_CHECK_VALUE(kv_cache.size(3) < limits::kAttnMaxSeq, kOp, "kv_cache",
                    "S = kv_cache.shape[3] must be below 2**31, got ", kv_cache.size(3));
  CW8A8_CHECK_VALUE(slots.dim() == 1 && slots.size(0) == batch, kOp, "slots",
                    "must be (B,) with B = q.shape[0] = ", batch, ", got shape ", py_tuple(slots.sizes()));
  CW8A8_CHECK_VALUE(positions.dim() == 1 && positions.size(0) == batch, kOp, "positions",
                    "must be (B,) with B = q.shape[0] = ", batch, ", got shape ", py_tuple(positions.sizes()));
  CW8A8_CHECK_VALUE(q.stride(2) == 1, kOp, "q", "must have stride(2) == 1, got strides ", py_tuple(q.strides()));
  check_contiguous(kOp, "kv_cache", kv_cache);
  check_aligned16(kOp, "kv_cache", kv_cache);
  if (out != nullptr) {
    CW8A8_CHECK_VALUE(out->dim() == 2 && out->size(0) == batch && out->size(1) == heads * d, kOp, "out",
                      "must be (B, H * D) = (", batch, ", ", heads * d, "), got shape ", py_tuple(out->sizes()));
    check_contiguous(kOp, "out", *out);
  }
  check_cuda(kOp, "q", q);  // holds after the device checks: the op reached CUDA through one of its tensors
}

void run(at::Tensor& out, const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& slots,
         const at::Tensor& positions, double softmax_scale) {
  const int64_t batch = q.size(0), heads = q.size(1);
  if (batch == 0 || heads == 0) return;
  c10::cuda::CUDAGuard guard(q.device());
  cudaStream_t stream = current_stream(q);
  auto fill = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    Args<T> args;
    args.q = reinterpret_cast<const T*>(q.data_ptr());
    args.q_stride_b = q.stride(0);
    args.q_stride_h = q.stride(1);
    args.kv = reinterpret_cast<const T*>(kv_cache.data_ptr());
    args.num_slots = kv_cache.size(0);
    args.kv_heads = static_cast<int>(kv_cache.size(2));
    args.seq_len = static_cast<int>(kv_cache.size(3));
    args.head_dim = static_cast<int>(kv_cache.size(4));
    args.group_size = static_cast<int>(heads / kv_cache.size(2));
    args.slots = slots.data_ptr<int64_t>();
    args.slots_stride = slots.stride(0);
    args.positions = positions.data_ptr<int64_t>();
    args.positions_stride = positions.stride(0);
    args.out = reinterpret_cast<T*>(out.data_ptr());
    args.scale_log2 = static_cast<float>(softmax_scale) * kLog2e;
    launch_for_head_dim<T>(args, batch, heads, stream);
  };
  switch (q.scalar_type()) {
    case at::kBFloat16: fill(static_cast<__nv_bfloat16*>(nullptr)); break;
    case at::kHalf: fill(static_cast<__half*>(nullptr)); break;
    default: fill(static_cast<float*>(nullptr)); break;
  }
  graph_nodes::note_rowwise_launch(stream, batch, kOp);
}

}  // namespace

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& slots,
                            const at::Tensor& positions, double softmax_scale) {
  check_args(q, kv_cache, slots, positions, softmax_scale, nullptr);
  at::Tensor out = at::empty({q.size(0), q.size(1) * q.size(2)}, q.options());
  run(out, q, kv_cache, slots, positions, softmax_scale);
  return out;
}

void decode_attention_out(at::Tensor& out, const at::Tensor& q, const at::Tensor& kv_cache,
                          const at::Tensor& slots, const at::Tensor& positions, double softmax_scale) {
  check_args(q, kv_cache, slots, positions, softmax_scale, &out);
  run(out, q, kv_cache, slots, positions, softmax_scale);
}

}  // namespace cutlass_w8a8
