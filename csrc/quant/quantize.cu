// Activation quantization: dynamic per-token and static per-tensor, to int8 or float8_e4m3fn.
//
//   dynamic per-token: scale[m] = max_k |x[m, k]| / QMAX;  q[m, k] = sat(rne(x[m, k] / scale[m]))
//   static per-tensor: q[m, k] = sat(rne(x[m, k] / scale))
//
// QMAX is 127 (int8) or 448 (the largest finite e4m3fn). All arithmetic is float32 with IEEE division,
// so results equal the CPU reference (cutlass_w8a8/ops/_reference.py) bit for bit. A row of zeros gets scale 0 and
// q = 0. One kernel launch per call, on the current stream, with no host synchronisation. The arguments are
// checked by quant/rowwise_args.hpp (the CPU implementation's contract); quantize.hpp exports the launches to
// w8a8_linear.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <tuple>

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>

#include "core/checks.hpp"
#include "core/device.hpp"
#include "core/launch_policy.hpp"
#include "graphs/graph_nodes.hpp"
#include "ops.hpp"
#include "quant/quantize.hpp"
#include "quant/rowwise_args.hpp"
#include "quant/rowwise_reduce.cuh"  // to_float, Int8Out / Fp8Out, quantize_one, allow_dependent_launch, block_max

namespace cutlass_w8a8 {
namespace {

// --- dynamic per-token, row held in registers ------------------------------------------------------
//
// One block of kBlock threads per row. Each thread loads kVecs 16-byte vectors of the row into registers, so
// x is read from device memory once; the row length must fit kBlock * kVecs vectors. At most 8 vectors per
// thread: rows of 2049 to 4096 vectors take 512-thread blocks. (With 256 threads x 16 vectors, K = 28672
// bf16 rows quantized at 1.4 TB/s on an H200, against 2.6 TB/s for K = 14336 at 8 vectors per thread.)

constexpr int kThreads = 256;
constexpr int kWideThreads = 512;

template <class T, class Q, int kVecs, int kBlock = kThreads>
__global__ void __launch_bounds__(kBlock) per_token_regs_kernel(const T* __restrict__ x, int64_t x_stride,
                                                                  typename Q::type* __restrict__ q,
                                                                  int64_t q_stride, float* __restrict__ scales,
                                                                  int k) {
  allow_dependent_launch();
  wait_for_producers();
  constexpr int kElems = 16 / sizeof(T);  // elements per 16-byte vector
  struct alignas(16) Vec {
    T v[kElems];
  };
  struct alignas(kElems) QVec {
    typename Q::type v[kElems];
  };
  const int64_t row = blockIdx.x;
  const Vec* xr = reinterpret_cast<const Vec*>(x + row * x_stride);
  QVec* qr = reinterpret_cast<QVec*>(q + row * q_stride);
  const int nvec = k / kElems;

  Vec regs[kVecs];
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    const int idx = threadIdx.x + i * kBlock;
    if (idx < nvec) {
      regs[i] = xr[idx];
#pragma unroll
      for (int j = 0; j < kElems; ++j) amax = fmaxf(amax, fabsf(to_float(regs[i].v[j])));
    }
  }
  amax = block_max<kBlock>(amax);
  const float scale = amax / Q::kMax;
  if (threadIdx.x == 0) scales[row] = scale;
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    const int idx = threadIdx.x + i * kBlock;
    if (idx < nvec) {
      QVec out;
#pragma unroll
      for (int j = 0; j < kElems; ++j) out.v[j] = quantize_one<Q>(to_float(regs[i].v[j]), scale);
      qr[idx] = out;
    }
  }
}

// --- dynamic per-token, any row length or alignment: two passes over the row -------------------------

template <class T, class Q>
__global__ void __launch_bounds__(kThreads) per_token_loop_kernel(const T* __restrict__ x, int64_t x_stride,
                                                                  typename Q::type* __restrict__ q,
                                                                  int64_t q_stride, float* __restrict__ scales,
                                                                  int k) {
  allow_dependent_launch();
  wait_for_producers();
  const int64_t row = blockIdx.x;
  const T* xr = x + row * x_stride;
  typename Q::type* qr = q + row * q_stride;
  float amax = 0.f;
  for (int i = threadIdx.x; i < k; i += kThreads) amax = fmaxf(amax, fabsf(to_float(xr[i])));
  amax = block_max<kThreads>(amax);
  const float scale = amax / Q::kMax;
  if (threadIdx.x == 0) scales[row] = scale;
  for (int i = threadIdx.x; i < k; i += kThreads) qr[i] = quantize_one<Q>(to_float(xr[i]), scale);
}

// --- static per-tensor ---------------------------------------------------------------------------------
//
// Row-wise like the per-token kernels: block (x, y) quantizes columns [y * chunk, (y + 1) * chunk) of row x, so
// the grid is (M, chunks) and no parameter depends on M (a CUDA-graph node of it is updated to fewer rows by
// shrinking gridDim.x alone: csrc/graphs/graph_nodes.hpp).

constexpr int kTensorChunk = kThreads * 8;  // columns per block, unless K needs more than 65535 blocks a row

template <class T, class Q>
__global__ void __launch_bounds__(kThreads) per_tensor_kernel(const T* __restrict__ x, int64_t x_stride,
                                                              typename Q::type* __restrict__ q, int64_t q_stride,
                                                              const float* __restrict__ scale_ptr, int64_t k,
                                                              int64_t chunk) {
  allow_dependent_launch();
  wait_for_producers();
  const float scale = *scale_ptr;
  const int64_t row = blockIdx.x;
  const T* xr = x + row * x_stride;
  typename Q::type* qr = q + row * q_stride;
  const int64_t begin = static_cast<int64_t>(blockIdx.y) * chunk;
  const int64_t end = begin + chunk < k ? begin + chunk : k;
  for (int64_t col = begin + threadIdx.x; col < end; col += kThreads) {
    qr[col] = quantize_one<Q>(to_float(xr[col]), scale);
  }
}

template <class T, class Q>
void launch_per_token(const quant::Rows& r, float* s, cudaStream_t stream) {
  const bool pdl = kernels_use_pdl(c10::cuda::current_device());
  const int64_t m = r.m;
  const int k = r.k;
  const T* x = static_cast<const T*>(r.x);
  auto* q = static_cast<typename Q::type*>(r.q);
  constexpr int kElems = 16 / sizeof(T);
  const bool vectorizable = k % kElems == 0 && r.x_stride % kElems == 0 && is_aligned(x, 16) &&
                            r.q_stride % kElems == 0 && is_aligned(q, kElems);
  const int64_t nvec = k / kElems;
  const dim3 grid(static_cast<unsigned>(m));
  cudaError_t err = cudaSuccess;
  if (vectorizable && nvec <= int64_t(kThreads) * 16) {
    const int per_thread = static_cast<int>((nvec + kThreads - 1) / kThreads);
    if (per_thread <= 1) {
      err = launch_kernel(per_token_regs_kernel<T, Q, 1>, grid, dim3(kThreads), 0, stream, pdl, x, r.x_stride, q,
                          r.q_stride, s, k);
    } else if (per_thread <= 2) {
      err = launch_kernel(per_token_regs_kernel<T, Q, 2>, grid, dim3(kThreads), 0, stream, pdl, x, r.x_stride, q,
                          r.q_stride, s, k);
    } else if (per_thread <= 4) {
      err = launch_kernel(per_token_regs_kernel<T, Q, 4>, grid, dim3(kThreads), 0, stream, pdl, x, r.x_stride, q,
                          r.q_stride, s, k);
    } else if (per_thread <= 8) {
      err = launch_kernel(per_token_regs_kernel<T, Q, 8>, grid, dim3(kThreads), 0, stream, pdl, x, r.x_stride, q,
                          r.q_stride, s, k);
    } else {  // 2049..4096 vectors: 512 threads x 8
      err = launch_kernel(per_token_regs_kernel<T, Q, 8, kWideThreads>, grid, dim3(kWideThreads), 0, stream, pdl, x,
                          r.x_stride, q, r.q_stride, s, k);
    }
  } else {
    err = launch_kernel(per_token_loop_kernel<T, Q>, grid, dim3(kThreads), 0, stream, pdl, x, r.x_stride, q,
                        r.q_stride, s, k);
  }
  C10_CUDA_CHECK(err);
  graph_nodes::note_rowwise_launch(stream, m, "quantize_per_token");
}

template <class T, class Q>
void launch_per_tensor(const quant::Rows& r, const float* scale, cudaStream_t stream) {
  const bool pdl = kernels_use_pdl(c10::cuda::current_device());
  const int64_t m = r.m;
  const int k = r.k;
  const int64_t chunks = std::min<int64_t>((k + kTensorChunk - 1) / kTensorChunk, 65535);
  const int64_t chunk = (k + chunks - 1) / chunks;
  const dim3 grid(static_cast<unsigned>(m), static_cast<unsigned>(chunks));
  C10_CUDA_CHECK(launch_kernel(per_tensor_kernel<T, Q>, grid, dim3(kThreads), 0, stream, pdl,
                               static_cast<const T*>(r.x), r.x_stride, static_cast<typename Q::type*>(r.q),
                               r.q_stride, scale, static_cast<int64_t>(k), chunk));
  graph_nodes::note_rowwise_launch(stream, m, "quantize_per_tensor");
}

// Calls f(T{}, Q{}) with T the element type of x and Q the 8-bit output's conversion.
template <class F>
void dispatch_types(at::ScalarType x_type, at::ScalarType q_type, F&& f) {
  dispatch_rowwise(quant::row_elem(x_type), quant::row_out(q_type), [&](auto t, auto q) {
    if constexpr (IsQuant<decltype(q)>::value) f(t, q);
  });
}

}  // namespace

namespace quant {

at::Tensor rows_of(const at::Tensor& x) {
  const int64_t k = x.size(-1);
  int64_t m = 1;  // explicit: reshape cannot infer -1 when K is 0
  for (int64_t d = 0; d + 1 < x.dim(); ++d) m *= x.size(d);
  at::Tensor x2 = x.reshape({m, k});
  if (x2.size(0) > 0 && k > 0 && x2.stride(1) != 1) x2 = x2.contiguous();
  return x2;
}

Rows rows(const at::Tensor& x2, void* q, int64_t q_stride) {
  return Rows{x2.data_ptr(), x2.stride(0), q, q_stride, x2.size(0), static_cast<int>(x2.size(1)), x2.scalar_type()};
}

void launch_quantize_per_token(const Rows& r, float* scales, at::ScalarType dtype, cudaStream_t stream) {
  dispatch_types(r.x_type, dtype, [&](auto t, auto qt) { launch_per_token<decltype(t), decltype(qt)>(r, scales, stream); });
}

void launch_quantize_per_tensor(const Rows& r, const float* scale, at::ScalarType dtype, cudaStream_t stream) {
  dispatch_types(r.x_type, dtype, [&](auto t, auto qt) { launch_per_tensor<decltype(t), decltype(qt)>(r, scale, stream); });
}

}  // namespace quant

std::tuple<at::Tensor, at::Tensor> quantize_per_token(const at::Tensor& x, at::ScalarType dtype) {
  constexpr const char* op = "quantize_per_token";
  quant::check_quant_input(op, x, dtype);
  quant::check_on_cuda(op, x);
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor x2 = quant::rows_of(x);
  const int64_t m = x2.size(0), k = x2.size(1);
  auto [q, scales] = quant::empty_row_outputs(x, k, dtype, /*with_scales=*/true);
  if (m == 0) return {q, scales};
  at::Tensor q2 = q.view({m, k});
  at::Tensor flat = scales.view({m});
  quant::launch_quantize_per_token(quant::rows(x2, q2.data_ptr(), q2.stride(0)), flat.data_ptr<float>(), dtype,
                                   current_stream(x));
  return {q, scales};
}

at::Tensor quantize_per_tensor(const at::Tensor& x, const at::Tensor& scale, at::ScalarType dtype) {
  constexpr const char* op = "quantize_per_tensor";
  quant::check_quant_input(op, x, dtype);
  quant::check_static_scale(op, x, scale);
  quant::check_on_cuda(op, x);
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor x2 = quant::rows_of(x);
  const int64_t m = x2.size(0), k = x2.size(1);
  at::Tensor q = quant::empty_row_outputs(x, k, dtype, /*with_scales=*/false).out;
  if (m == 0 || k == 0) return q;
  at::Tensor q2 = q.view({m, k});
  quant::launch_quantize_per_tensor(quant::rows(x2, q2.data_ptr(), q2.stride(0)), scale.data_ptr<float>(), dtype,
                                    current_stream(x));
  return q;
}

}  // namespace cutlass_w8a8
