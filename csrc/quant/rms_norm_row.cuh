// The RMSNorm arithmetic of one row, shared by rms_norm.cu (rms_norm, fused_add_rms_norm, rms_norm_quant) and the
// decode GEMM's fused input norm (gemm/decode/decode_kernels.cuh, add_rms_norm_linear_decode), so that both compute
// the residual add, the float32 sum of squares of each 16-byte vector, the inverse RMS and y with the same float
// operations in the same order (rms_norm.cu's file comment has the arithmetic):
//
//   residual add   s = T(float(x) + float(r))                           (add_vec; add_residual also stores s)
//   squares        sum_j __fmul_rn(float(s_j), float(s_j)) over a vector, in j order, from 0 (sum_squares)
//   inverse RMS    1 / sqrt(sum_sq / K + eps)                           (inverse_rms)
//   y              T((float(s) * inv) * float(w))                       (normalize)
//
// How a row's vector sums meet (each thread's vectors in increasing order, then block_sum's butterfly) is the
// caller's: quant/rowwise_reduce.cuh block_sum, and block_sum_rows for several rows at once in the same order.
// Torch-free and header-only (anonymous namespace, as rowwise_reduce.cuh).
#pragma once

#include "quant/rowwise_reduce.cuh"  // Vec, to_float, from_float

namespace cutlass_w8a8 {
namespace {

// s = T(float(s) + float(r)) element by element (torch's `residual += x` in T).
template <class T, int N>
__device__ __forceinline__ void add_vec(Vec<T, N>& s, const Vec<T, N>& r) {
#pragma unroll
  for (int j = 0; j < N; ++j) s.v[j] = from_float<T>(to_float(s.v[j]) + to_float(r.v[j]));
}

// sum of float(s)^2 over the vector, in element order from 0.
template <class T, int N>
__device__ __forceinline__ float sum_squares(const Vec<T, N>& s) {
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const float f = to_float(s.v[j]);
    ss += __fmul_rn(f, f);  // the square rounded on its own (as torch's pow), not fused into the sum
  }
  return ss;
}

// s = x, or residual = s = T(x + residual) (in place); returns sum of float(s)^2 over the vector.
template <class T, int N>
__device__ __forceinline__ float add_residual(Vec<T, N>& s, T* residual_vec_ptr) {
  if (residual_vec_ptr != nullptr) {
    auto* rp = reinterpret_cast<Vec<T, N>*>(residual_vec_ptr);
    const Vec<T, N> r = *rp;
    add_vec<T, N>(s, r);
    *rp = s;
  }
  return sum_squares<T, N>(s);
}

template <class T, int N>
__device__ __forceinline__ Vec<T, N> normalize(const Vec<T, N>& s, const Vec<T, N>& w, float inv_rms) {
  Vec<T, N> y;
#pragma unroll
  for (int j = 0; j < N; ++j) y.v[j] = from_float<T>(__fmul_rn(__fmul_rn(to_float(s.v[j]), inv_rms), to_float(w.v[j])));
  return y;
}

__device__ __forceinline__ float inverse_rms(float sum_sq, int k, float eps) {
  // F.rms_norm: rsqrt(mean(s^2) + eps), the mean as sum / K; IEEE division and square root.
  return 1.f / sqrtf(sum_sq / static_cast<float>(k) + eps);
}

}  // namespace
}  // namespace cutlass_w8a8
