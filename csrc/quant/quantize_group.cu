// Dynamic per-token-group quantization (1 x 128 groups along K), to int8 or float8_e4m3fn:
//
//   scale[m, g] = max_{k in group g} |x[m, k]| / QMAX;   q[m, k] = sat(rne(x[m, k] / scale[m, k / 128]))
//
// the per-token rule of quantize.cu applied to each 128-wide group of a row (QMAX 127 or 448, float32 with IEEE
// division, a group of zeros gets scale 0 and q = 0), so the result equals the CPU reference
// (cutlass_w8a8/ops/_reference.py) bit for bit. These are the activations of block-scaled fp8 GEMMs (scale_a
// [M, K/128]; DeepSeek-V3 / compressed-tensors FP8_BLOCK). One kernel launch per call, on the current stream, no
// host synchronisation, outputs from the caching allocator; quantize.hpp exports the launch to w8a8_linear.
//
// Kernel shape: a group of 128 elements is 16 (bfloat16 / float16) or 32 (float32) 16-byte vectors, and as many
// lanes own it, one vector each: a lane loads its vector, the group's absmax is a butterfly over those lanes, and
// each lane quantizes and stores its own elements (8 or 4 bytes of q). x is read once, q written once. Blocks of
// 128 threads hold 8 (16-bit x) or 4 (float32) groups; the grid is (M, chunks): block (x, y) handles row x only
// and groups y * G', y * G' + gridDim.y * G', ... of it, no parameter depends on M, so a captured node is resized
// to fewer rows by shrinking gridDim.x (graphs/graph_nodes.hpp, note_rowwise_launch). A row whose start or pitch
// is not 16-byte aligned is read element by element (same lanes, same elements, same result).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cstdint>
#include <tuple>

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>

#include "core/checks.hpp"
#include "core/device.hpp"
#include "core/launch.hpp"
#include "core/launch_policy.hpp"
#include "core/limits.hpp"
#include "graphs/graph_nodes.hpp"
#include "ops.hpp"
#include "quant/quantize.hpp"
#include "quant/rowwise_args.hpp"
#include "quant/rowwise_reduce.cuh"  // to_float, Int8Out / Fp8Out, quantize_one, PDL

namespace cutlass_w8a8 {
namespace {

constexpr int kGroupThreads = 128;
constexpr int kGroup = static_cast<int>(limits::kBlockSize);  // 128 elements per group
constexpr int kMaxChunks = 65535;                              // gridDim.y

// The lanes that own one group of T (16 / sizeof(T) elements each) and the groups one block holds.
template <class T>
struct GroupShape {
  static constexpr int kElems = 16 / sizeof(T);
  static constexpr int kLanes = kGroup / kElems;  // 16 or 32: a half warp or a warp
  static constexpr int kPerBlock = kGroupThreads / kLanes;
  static_assert(kLanes == 16 || kLanes == 32, "a group is a half warp or a warp");
};

// kVec: x rows are 16-byte aligned (start and pitch); otherwise element loads of the same elements.
template <class T, class Q, bool kVec>
__global__ void __launch_bounds__(kGroupThreads)
    per_group_kernel(const T* __restrict__ x, int64_t x_stride, typename Q::type* __restrict__ q, int64_t q_stride,
                     float* __restrict__ scales, int64_t s_stride, int64_t groups) {
  allow_dependent_launch();
  wait_for_producers();
  using S = GroupShape<T>;
  constexpr int kElems = S::kElems, kLanes = S::kLanes;
  struct alignas(16) XVec {
    T v[kElems];
  };
  struct alignas(kElems) QVec {
    typename Q::type v[kElems];
  };
  const int64_t row = blockIdx.x;
  const int lane = threadIdx.x % kLanes;
  // The shuffle mask of this lane's group: its half of the warp, or the whole warp.
  const unsigned mask = kLanes == 32 ? 0xffffffffu : 0xffffu << (threadIdx.x % 32 / 16 * 16);
  const T* xr = x + row * x_stride;
  typename Q::type* qr = q + row * q_stride;
  float* sr = scales + row * s_stride;
  const int64_t step = static_cast<int64_t>(gridDim.y) * S::kPerBlock;
  for (int64_t grp = static_cast<int64_t>(blockIdx.y) * S::kPerBlock + threadIdx.x / kLanes; grp < groups;
       grp += step) {
    const int64_t col = grp * kGroup + lane * kElems;  // this lane's elements [col, col + kElems)
    XVec v;
    if constexpr (kVec) {
      v = *reinterpret_cast<const XVec*>(xr + col);
    } else {
#pragma unroll
      for (int j = 0; j < kElems; ++j) v.v[j] = xr[col + j];
    }
    float amax = 0.f;
#pragma unroll
    for (int j = 0; j < kElems; ++j) amax = fmaxf(amax, fabsf(to_float(v.v[j])));
#pragma unroll
    for (int off = kLanes / 2; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(mask, amax, off));
    const float scale = amax / Q::kMax;
    if (lane == 0) sr[grp] = scale;
    QVec out;
#pragma unroll
    for (int j = 0; j < kElems; ++j) out.v[j] = quantize_one<Q>(to_float(v.v[j]), scale);
    *reinterpret_cast<QVec*>(qr + col) = out;  // q rows are K bytes apart, K a multiple of 128: aligned
  }
}

template <class T, class Q>
void launch_per_group(const quant::Rows& r, float* scales, int64_t s_stride, cudaStream_t stream) {
  using S = GroupShape<T>;
  const bool pdl = kernels_use_pdl(c10::cuda::current_device());
  const T* x = static_cast<const T*>(r.x);
  auto* q = static_cast<typename Q::type*>(r.q);
  const int64_t groups = r.k / kGroup;
  const bool vec = is_aligned(x, 16) && (r.m <= 1 || r.x_stride % S::kElems == 0);
  const int64_t chunks = std::min<int64_t>((groups + S::kPerBlock - 1) / S::kPerBlock, kMaxChunks);
  const dim3 grid(static_cast<unsigned>(r.m), static_cast<unsigned>(chunks));
  cudaError_t err;
  if (vec) {
    err = launch_kernel(per_group_kernel<T, Q, true>, grid, dim3(kGroupThreads), 0, stream, pdl, x, r.x_stride, q,
                        r.q_stride, scales, s_stride, groups);
  } else {
    err = launch_kernel(per_group_kernel<T, Q, false>, grid, dim3(kGroupThreads), 0, stream, pdl, x, r.x_stride, q,
                        r.q_stride, scales, s_stride, groups);
  }
  C10_CUDA_CHECK(err);
  graph_nodes::note_rowwise_launch(stream, r.m, "quantize_per_token_group");
}

}  // namespace

namespace quant {

void launch_quantize_per_token_group(const Rows& r, float* scales, int64_t scale_stride, at::ScalarType dtype,
                                     cudaStream_t stream) {
  dispatch_rowwise(row_elem(r.x_type), row_out(dtype), [&](auto t, auto qt) {
    if constexpr (IsQuant<decltype(qt)>::value) {
      launch_per_group<decltype(t), decltype(qt)>(r, scales, scale_stride, stream);
    }
  });
}

}  // namespace quant

// ops/_checks.py check_quantize_group: quantize_per_token's checks of x (..., K) and dtype, then group_size = 128,
// then K a multiple of it.
std::tuple<at::Tensor, at::Tensor> quantize_per_token_group(const at::Tensor& x, int64_t group_size,
                                                            at::ScalarType dtype) {
  constexpr const char* op = "quantize_per_token_group";
  quant::check_quant_input(op, x, dtype);
  CW8A8_CHECK_VALUE(group_size == limits::kBlockSize, op, "group_size", "must be ", limits::kBlockSize, ", got ",
                    group_size);
  const int64_t k = x.size(-1);
  CW8A8_CHECK_VALUE(k % group_size == 0, op, "x", "K = x.shape[1] must be a multiple of group_size = ", group_size,
                    ", got ", k);
  quant::check_on_cuda(op, x);
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor x2 = quant::rows_of(x);
  const int64_t m = x2.size(0);
  at::Tensor q = at::empty(x.sizes(), x.options().dtype(dtype));
  auto scale_shape = x.sizes().vec();
  scale_shape.back() = k / group_size;
  at::Tensor scales = at::empty(scale_shape, x.options().dtype(at::kFloat));
  if (m == 0 || k == 0) return {q, scales};
  CW8A8_CHECK_VALUE(m <= limits::kMaxRows, op, "x", "has ", m, " rows; at most 2**31 - 1 are supported");
  quant::launch_quantize_per_token_group(quant::rows(x2, q.data_ptr(), k), scales.data_ptr<float>(), k / group_size,
                                         dtype, current_stream(x));
  return {q, scales};
}

}  // namespace cutlass_w8a8
