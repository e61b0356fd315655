// Device helpers shared by the activation-quantization kernels (quantize.cu), the fused norm / activation +
// quantization kernels (fused_quant.cu) and decode attention (element conversions only): element
// conversions, the int8 / e4m3 output conversions, block reductions and the programmatic-dependent-launch
// trigger.
//
// Everything here is header-only and lives in an anonymous namespace, so each .cu file gets its own copy
// (the kernels are templates instantiated per file anyway).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace cutlass_w8a8 {
namespace {

// --- element conversions -------------------------------------------------------------------------

template <class T>
__device__ __forceinline__ float to_float(T v);
template <>
__device__ __forceinline__ float to_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

// float -> T, round to nearest even (what torch does when it rounds a float32 result to the tensor's dtype)
template <class T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

struct Int8Out {
  using type = int8_t;
  static constexpr float kMax = 127.f;
  __device__ __forceinline__ static int8_t convert(float v) {
    // round to nearest even, then saturate (a static scale can put values out of range)
    int r = __float2int_rn(v);
    r = r > 127 ? 127 : (r < -128 ? -128 : r);
    return static_cast<int8_t>(r);
  }
};

struct Fp8Out {
  using type = __nv_fp8_storage_t;  // the bits of a float8_e4m3fn
  static constexpr float kMax = 448.f;
  __device__ __forceinline__ static __nv_fp8_storage_t convert(float v) {
    // round to nearest even; saturate to +-448 instead of producing NaN
    return __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
  }
};

template <class Q>
__device__ __forceinline__ typename Q::type quantize_one(float x, float scale) {
  return scale == 0.f ? Q::convert(0.f) : Q::convert(x / scale);
}

// --- programmatic dependent launch --------------------------------------------------------------------
//
// Lets the next kernel on the stream, when it was launched with PDL (the sm90 GEMM that consumes q), be
// scheduled as soon as every block of this grid has started, so its launch and prologue overlap this
// kernel. Correctness does not depend on it: the GEMM's griddepcontrol.wait still waits for this whole grid
// to finish and its writes to be visible. A no-op below sm90 and for dependents launched without PDL.
__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// --- block reductions ----------------------------------------------------------------------------
//
// Every thread of the block must call them (they synchronise) and gets the block's result. The order of
// the float operations is fixed by the block size alone: a thread's partial value, a butterfly over the
// lanes of each warp, then one over the warps' values. Two calls in a row are safe (the second sync of a
// call separates its read of the shared slots from the next call's writes).

template <int kThreads>
__device__ __forceinline__ float block_max(float v) {
  static_assert(kThreads % 32 == 0 && kThreads <= 1024, "block size");
  __shared__ float warp_max[kThreads / 32];
  __shared__ float result;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_max[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < kThreads / 32 ? warp_max[lane] : 0.f;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
    if (lane == 0) result = v;
  }
  __syncthreads();
  return result;
}

template <int kThreads>
__device__ __forceinline__ float block_sum(float v) {
  static_assert(kThreads % 32 == 0 && kThreads <= 1024, "block size");
  __shared__ float warp_sum[kThreads / 32];
  __shared__ float result;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_sum[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < kThreads / 32 ? warp_sum[lane] : 0.f;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    if (lane == 0) result = v;
  }
  __syncthreads();
  return result;
}

}  // namespace
}  // namespace cutlass_w8a8
