// Device code shared by the row-wise kernels: quantize.cu, rms_norm.cu and silu_mul.cu (and, for the element
// conversions, quantize_one and the PDL trigger, decode_attention.cu and gemm/decode/decode_kernels.cuh).
//
//   element conversions   to_float / from_float (round to nearest even, as torch rounds a float32 result)
//   8-bit outputs         Int8Out / Fp8Out: QMAX and the saturating conversion; quantize_one
//   PDL                   allow_dependent_launch / wait_for_producers (griddepcontrol)
//   reductions            block_max / block_sum over a block; ClusterReduce over a thread block cluster (sm90)
//   a row's tail          finish_regs / finish_loop: store y, or quantize it (dynamic per row, static, or dynamic
//                         per 1 x 128 group: GroupOut)
//   a fused op            RowwiseIO (its kernel argument's shared fields) and RowwiseOp (its y, then the tail)
//   launch shapes         with_register_config / with_cluster_config; the fused ops' kernels and launch_rowwise,
//                         which picks one from K, the dtype, the alignment and the device only (never M)
//
// Torch-free and header-only; everything lives in an anonymous namespace, so each .cu file gets its own copy
// (the kernels are templates instantiated per file anyway).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cooperative_groups.h>

#include "core/launch.hpp"

#include <cstdint>
#include <type_traits>

namespace cutlass_w8a8 {
namespace {

// --- element conversions -------------------------------------------------------------------------

template <class T>
__device__ __forceinline__ float to_float(T v) {
  if constexpr (std::is_same_v<T, __half>) {
    return __half2float(v);
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __bfloat162float(v);
  } else {
    static_assert(std::is_same_v<T, float>, "to_float: bfloat16, float16 or float32");
    return v;
  }
}

// float -> T, round to nearest even (what torch does when it rounds a float32 result to the tensor's dtype)
template <class T>
__device__ __forceinline__ T from_float(float v) {
  if constexpr (std::is_same_v<T, __half>) {
    return __float2half_rn(v);
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __float2bfloat16_rn(v);
  } else {
    static_assert(std::is_same_v<T, float>, "from_float: bfloat16, float16 or float32");
    return v;
  }
}

// --- 8-bit outputs -------------------------------------------------------------------------------

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

// q = sat(rne(x / scale)) with IEEE division; 0 for a zero scale (a row of zeros).
template <class Q>
__device__ __forceinline__ typename Q::type quantize_one(float x, float scale) {
  return scale == 0.f ? Q::convert(0.f) : Q::convert(x / scale);
}

// The output of the unquantized row-wise ops (rms_norm, silu_mul): y itself, in x's dtype T.
template <class T>
struct FloatOut {
  using type = T;
};

// Dynamic per-group quantization of a fused op's output row (rms_norm_quant / silu_mul_quant with group_size 128):
// Q's conversion, one scale per kGroupElems consecutive elements of the row, scale[row, g] = max |y| over group g /
// QMAX, exactly quantize_per_token_group's rule (quantize_group.cu).
constexpr int kGroupElems = 128;  // limits::kBlockSize (quant/rowwise_args.hpp asserts it)

template <class Q>
struct GroupOut {
  using type = typename Q::type;
  static constexpr float kMax = Q::kMax;
  __device__ __forceinline__ static type convert(float v) { return Q::convert(v); }
};

template <class O>
struct IsQuant : std::true_type {};
template <class T>
struct IsQuant<FloatOut<T>> : std::false_type {};

template <class O>
struct IsGroup : std::false_type {};
template <class Q>
struct IsGroup<GroupOut<Q>> : std::true_type {};

// --- programmatic dependent launch --------------------------------------------------------------------
//
// allow_dependent_launch lets the next kernel on the stream, when it was launched with PDL, be scheduled as
// soon as every block of this grid has signalled (or exited), so its launch and prologue overlap this kernel.
// Correctness does not depend on it: the dependent's griddepcontrol.wait still waits for this whole grid to
// finish and its writes to be visible. wait_for_producers is that wait: a kernel launched with PDL
// (core/launch.hpp) calls it before its first access to memory a predecessor may write, and returns at once
// when it was launched without PDL. Both are no-ops below sm90.
__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void wait_for_producers() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// --- block reductions ----------------------------------------------------------------------------
//
// Every thread of the block must call them (they synchronise) and gets the block's result. The order of
// the float operations is fixed by the block size alone: a thread's partial value, a butterfly over the
// lanes of each warp, then one over the warps' values. Two calls in a row are safe (the second sync of a
// call separates its read of the shared slots from the next call's writes). 0 is the identity of both
// (maxima are taken over absolute values).

struct SumOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
};
struct MaxOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

template <int kThreads, class Op>
__device__ __forceinline__ float block_reduce(float v, Op op) {
  static_assert(kThreads % 32 == 0 && kThreads <= 1024, "block size");
  __shared__ float warp_value[kThreads / 32];
  __shared__ float result;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, off));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_value[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < kThreads / 32 ? warp_value[lane] : 0.f;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, off));
    if (lane == 0) result = v;
  }
  __syncthreads();
  return result;
}

template <int kThreads>
__device__ __forceinline__ float block_max(float v) {
  return block_reduce<kThreads>(v, MaxOp{});
}

template <int kThreads>
__device__ __forceinline__ float block_sum(float v) {
  return block_reduce<kThreads>(v, SumOp{});
}

// block_sum of `rows` values at once (v[r] a thread's partial sum of row r, r < rows <= R), with block_sum's float
// operations in block_sum's order for each row (a butterfly over the lanes, the warps' values through shared
// memory, a butterfly over them in warp 0 with zeros past the last warp): out[r] (shared memory, R floats) is what
// block_sum<kThreads>(v[r]) returns, for two synchronisations in all instead of two per row. `warp_value`: shared
// memory of kThreads / 32 rows of kPitch >= R floats. Every thread must call it; out is valid after it returns.
template <int kThreads, int R, int kPitch>
__device__ __forceinline__ void block_sum_rows(const float (&v)[R], int rows, float (*warp_value)[kPitch],
                                               float* out) {
  static_assert(kThreads % 32 == 0 && kThreads <= 1024 && R <= kPitch, "block size, rows");
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    if (r >= rows) break;
    float x = v[r];
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) x = x + __shfl_xor_sync(0xffffffffu, x, off);
    if (lane == 0) warp_value[warp][r] = x;
  }
  __syncthreads();
  if (warp == 0) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (r >= rows) break;
      float x = lane < kThreads / 32 ? warp_value[lane][r] : 0.f;
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) x = x + __shfl_xor_sync(0xffffffffu, x, off);
      if (lane == 0) out[r] = x;
    }
  }
  __syncthreads();
}

// --- cluster-wide reductions (sm90) -------------------------------------------------------------------
//
// A row too long for one block to finish quickly at small M (decode) is split over a cluster of C blocks
// along grid y (thread block clusters: sm90 and newer). The blocks' partial sums or maxima meet through
// distributed shared memory: block rank r publishes its value, every block reads ranks 0 .. C-1 in that
// order, so the result is deterministic and the same in every block. C = 1: the block's own value.

template <int C>
struct ClusterReduce {
  template <class Op>
  __device__ __forceinline__ static float run(float block_value, Op op) {
    if constexpr (C == 1) {
      return block_value;
    } else {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
      __shared__ float slot, result;
      cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
      if (threadIdx.x == 0) slot = block_value;
      cluster.sync();
      if (threadIdx.x == 0) {
        float total = *cluster.map_shared_rank(&slot, 0);
#pragma unroll
        for (int r = 1; r < C; ++r) total = op(total, *cluster.map_shared_rank(&slot, r));
        result = total;
      }
      // Every block has read every slot before any block rewrites its own or exits; also publishes `result`
      // to this block's threads (a cluster barrier is a block barrier too).
      cluster.sync();
      return result;
#else
      return block_value;  // not reached: cluster kernels launch only where their sm90 code was built
#endif
    }
  }
};

// Cluster kernels carry their cluster shape in the binary (__cluster_dims__), so a plain <<<grid, block>>>
// launch, a captured graph node and a node updated to fewer rows (gridDim.x) all keep it. The attribute exists
// for sm90 only: the device passes for older targets compile these kernels without it, and to a trap.
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
#define CW8A8_CLUSTER_DIMS(x, y, z) __cluster_dims__(x, y, z)
#define CW8A8_HAS_CLUSTERS 1
#else
#define CW8A8_CLUSTER_DIMS(x, y, z)
#define CW8A8_HAS_CLUSTERS 0
#endif

// Vector indices [begin, end) of block y of a row of nvec vectors split over C blocks.
template <int C>
__device__ __forceinline__ void block_part(int nvec, int& begin, int& end) {
  const int per_block = (nvec + C - 1) / C;
  begin = C == 1 ? 0 : static_cast<int>(blockIdx.y) * per_block;
  end = C == 1 ? nvec : min(nvec, begin + per_block);
}

// --- a row's tail: y (rounded to T) -> output row -----------------------------------------------------
//
// Unquantized (O = FloatOut<T>): store y. Quantized (O = Int8Out / Fp8Out): scale = max|y| / QMAX (dynamic;
// `static_scale` null) or *static_scale, written to scales[row] either way, then q = quantize_one(y, scale),
// as quantize.cu quantizes a stored y. Per group (O = GroupOut<Q>): scale[g] = max|y| over the 128 elements of
// group g / QMAX, written to scales[row * groups + g], q = quantize_one(y, scale[g]), as quantize_group.cu
// quantizes a stored y (`static_scale` unused: group scales are dynamic).

template <class T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

// max |y| over the N elements of a vector, folded into amax.
template <class T, int N>
__device__ __forceinline__ float vec_amax(float amax, const Vec<T, N>& y) {
#pragma unroll
  for (int j = 0; j < N; ++j) amax = fmaxf(amax, fabsf(to_float(y.v[j])));
  return amax;
}

template <class O, class T, int N>
__device__ __forceinline__ Vec<typename O::type, N> quantize_vec(const Vec<T, N>& y, float scale) {
  Vec<typename O::type, N> q;
#pragma unroll
  for (int j = 0; j < N; ++j) q.v[j] = quantize_one<O>(to_float(y.v[j]), scale);
  return q;
}

// y held in registers: kVecs vectors of N elements per thread, vector idx = begin + threadIdx.x + i * kB, valid
// below `end`: this block's part [begin, end) of the row, of a cluster of C blocks (C = 1: the whole row).
//
// GroupOut: the 128 / N vectors of a group are held by 128 / N consecutive threads (16: a half warp, or 32: a warp)
// for the same i, since begin is a multiple of 128 / N (the caller's launch guarantees it: cluster parts are used
// only when they split the row on group boundaries) and kB is a multiple of 32; so the group's absmax is a
// butterfly over those lanes, and idx < end holds for all of them or none (end is a multiple of 128 / N too).
template <class T, class O, int N, int kVecs, int kB, int C>
__device__ __forceinline__ void finish_regs(const Vec<T, N> (&y)[kVecs], int begin, int end,
                                            typename O::type* out_row, float* scales, const float* static_scale,
                                            int64_t row, int groups = 0) {
  if constexpr (IsGroup<O>::value) {
    constexpr int kGroupVecs = kGroupElems / N;
    static_assert(kGroupVecs == 16 || kGroupVecs == 32, "a group is a half warp or a warp of 16-byte vectors");
    const unsigned mask = kGroupVecs == 32 ? 0xffffffffu : 0xffffu << (threadIdx.x % 32 / 16 * 16);
    auto* out = reinterpret_cast<Vec<typename O::type, N>*>(out_row);
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      const int idx = begin + threadIdx.x + i * kB;
      if (idx < end) {
        float amax = vec_amax(0.f, y[i]);
#pragma unroll
        for (int off = kGroupVecs / 2; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(mask, amax, off));
        const float scale = amax / O::kMax;
        if (idx % kGroupVecs == 0) scales[row * groups + idx / kGroupVecs] = scale;
        out[idx] = quantize_vec<O>(y[i], scale);
      }
    }
  } else if constexpr (!IsQuant<O>::value) {
    auto* out = reinterpret_cast<Vec<T, N>*>(out_row);
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      const int idx = begin + threadIdx.x + i * kB;
      if (idx < end) out[idx] = y[i];
    }
  } else {
    float scale;
    if (static_scale == nullptr) {  // uniform over the block and the cluster: all take the same branch
      float amax = 0.f;
#pragma unroll
      for (int i = 0; i < kVecs; ++i) {
        if (begin + threadIdx.x + i * kB < end) amax = vec_amax(amax, y[i]);
      }
      scale = ClusterReduce<C>::run(block_max<kB>(amax), MaxOp{}) / O::kMax;
    } else {
      scale = *static_scale;
    }
    if (threadIdx.x == 0 && blockIdx.y == 0) scales[row] = scale;
    auto* out = reinterpret_cast<Vec<typename O::type, N>*>(out_row);
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      const int idx = begin + threadIdx.x + i * kB;
      if (idx < end) out[idx] = quantize_vec<O>(y[i], scale);
    }
  }
}

// y recomputed by `produce(idx)` on each pass over the row (rows too long for registers, or misaligned).
// GroupOut: warp w takes groups w, w + kB / 32, ...; lane l produces vectors l, l + 32, ... of the group (N = 1:
// 4 elements a lane; 16-byte vectors: one, or none for lanes 16..31 when a group is 16 vectors), the group's absmax
// is a butterfly over the warp. (rms_norm's loop reads back residual elements other threads wrote: the block
// reduction before this tail synchronized the block, which makes them visible.)
template <class T, class O, int N, int kB, class Produce>
__device__ __forceinline__ void finish_loop(Produce produce, int nvec, typename O::type* out_row, float* scales,
                                            const float* static_scale, int64_t row, int groups = 0) {
  if constexpr (IsGroup<O>::value) {
    constexpr int kGroupVecs = kGroupElems / N;
    constexpr int kPerLane = (kGroupVecs + 31) / 32;
    static_assert(kGroupElems % N == 0 && kB % 32 == 0, "whole vectors per group, whole warps");
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    auto* out = reinterpret_cast<Vec<typename O::type, N>*>(out_row);
    for (int grp = warp; grp < groups; grp += kB / 32) {
      Vec<T, N> y[kPerLane];
      float amax = 0.f;
#pragma unroll
      for (int r = 0; r < kPerLane; ++r) {
        const int v = lane + 32 * r;
        if (v < kGroupVecs) {
          y[r] = produce(grp * kGroupVecs + v);
          amax = vec_amax(amax, y[r]);
        }
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
      const float scale = amax / O::kMax;
      if (lane == 0) scales[row * groups + grp] = scale;
#pragma unroll
      for (int r = 0; r < kPerLane; ++r) {
        const int v = lane + 32 * r;
        if (v < kGroupVecs) out[grp * kGroupVecs + v] = quantize_vec<O>(y[r], scale);
      }
    }
  } else if constexpr (!IsQuant<O>::value) {
    auto* out = reinterpret_cast<Vec<T, N>*>(out_row);
    for (int idx = threadIdx.x; idx < nvec; idx += kB) out[idx] = produce(idx);
  } else {
    float scale;
    if (static_scale == nullptr) {
      float amax = 0.f;
      for (int idx = threadIdx.x; idx < nvec; idx += kB) amax = vec_amax(amax, produce(idx));
      scale = block_max<kB>(amax) / O::kMax;
    } else {
      scale = *static_scale;
    }
    if (threadIdx.x == 0) scales[row] = scale;
    auto* out = reinterpret_cast<Vec<typename O::type, N>*>(out_row);
    for (int idx = threadIdx.x; idx < nvec; idx += kB) out[idx] = quantize_vec<O>(produce(idx), scale);
  }
}

// --- a fused row-wise op: its y, then the row's tail ---------------------------------------------------------
//
// The fields every fused row-wise op's kernel argument starts with (rms_norm.cu's RmsNormParams, silu_mul.cu's and
// moe/permute_quant.cu's): where its input rows are, where the output row goes, and how long it is.
template <class T, class OutT>
struct RowwiseIO {
  using elem_type = T;
  const T* x;                 // the input rows, x_stride elements apart (not __restrict__: rms_norm's residual may
  int64_t x_stride;           // legally be x itself); which one feeds output row r is the op's choice
  OutT* out;                  // [rows, len] contiguous
  float* scales;              // quantized outputs: [rows], or [rows, len / 128] (GroupOut); else unused
  const float* static_scale;  // one float32 (static per-tensor), or nullptr (dynamic per-token or per-group)
  int len;                    // elements of an output row
};

// The Op of launch_rowwise (below) of a fused row-wise op Y on element type T with output O: output row blockIdx.x
// (or block y's part of it over a cluster of C blocks) is Y's y, then finish_regs / finish_loop store or quantize it.
// Y provides
//   Params<T, OutT>                      its kernel argument, a RowwiseIO<T, OutT> with the op's own fields after it
//   regs<kVecs, kB, C>(p, row, y, begin, end)
//                                        y[i] = vector begin + threadIdx.x + i * kB of the row's y, for those below
//                                        end (kVecs 16-byte vectors per thread of kB, held in registers)
//   loop<N, kB>(p, row)                  produce(idx) -> Vec<T, N>, vector idx of the row's y (N elements a load:
//                                        16 / sizeof(T) vectorized, 1 any alignment), after any pass over the row
//                                        it needs first
// The kernels' names carry Y (rowwise_regs_kernel<RowwiseOp<RmsNormRow, T, O>, ...>): bench/_decoder_kernels.py
// tells the norm and activation kernels apart by it.
template <class Y, class T, class O>
struct RowwiseOp {
  using Params = typename Y::template Params<T, typename O::type>;

  template <int kVecs, int kB, int C>
  __device__ __forceinline__ static void regs(const Params& p) {
    constexpr int N = 16 / sizeof(T);
    const int64_t row = blockIdx.x;
    int begin, end;
    block_part<C>(p.len / N, begin, end);
    Vec<T, N> y[kVecs];
    Y::template regs<kVecs, kB, C>(p, row, y, begin, end);
    finish_regs<T, O, N, kVecs, kB, C>(y, begin, end, p.out + row * int64_t(p.len), p.scales, p.static_scale, row,
                                       p.len / kGroupElems);
  }

  template <int N, int kB>
  __device__ __forceinline__ static void loop(const Params& p) {
    const int64_t row = blockIdx.x;
    finish_loop<T, O, N, kB>(Y::template loop<N, kB>(p, row), p.len / N, p.out + row * int64_t(p.len), p.scales,
                             p.static_scale, row, p.len / kGroupElems);
  }
};

// --- launch shapes of the fused row-wise ops (rms_norm.cu, silu_mul.cu) ----------------------------------
//
// Per row of nvec 16-byte vectors, chosen from K, the dtype, the alignment and the device only (never M, so a
// row's result does not depend on the batch, and a captured node stays valid for fewer rows):
//
//   bfloat16 / float16, 1024 < nvec <= 8192 (K in (8192, 65536]), sm90 code built and running:
//     a cluster of C = 8 blocks of 256 threads per row (grid (M, 8)), each holding its part in registers
//     (1, 2 or 4 vectors per thread). One block per row is latency-bound at decode sizes: on an H100
//     silu_mul_quant of one 14336-wide bfloat16 row took 11.0 us on one SM (the whole row's exp and division
//     on it) and 3.8 us on a cluster of 8 (the unfused torch chain: 7.1 us).
//   otherwise, nvec <= 4096: one block per row holding it in registers, 1 to 8 vectors per thread of 256, or
//     8 of 512 threads (as quantize.cu's per-token kernel).
//   longer rows: one block looping over global memory (vectorized); misaligned rows: element by element.

constexpr int kBlock = 256;
constexpr int kWideBlock = 512;
constexpr int kClusterBlocks = 8;  // C of every cluster config

// Calls launch(kVecs constant, kBlock constant) for the one-block register kernel that fits `nvec` vectors, or
// returns false when none does.
template <class F>
bool with_register_config(int64_t nvec, F&& launch) {
  using std::integral_constant;
  const int64_t per_thread = (nvec + kBlock - 1) / kBlock;
  if (per_thread <= 1) {
    launch(integral_constant<int, 1>{}, integral_constant<int, kBlock>{});
  } else if (per_thread <= 2) {
    launch(integral_constant<int, 2>{}, integral_constant<int, kBlock>{});
  } else if (per_thread <= 4) {
    launch(integral_constant<int, 4>{}, integral_constant<int, kBlock>{});
  } else if (per_thread <= 8) {
    launch(integral_constant<int, 8>{}, integral_constant<int, kBlock>{});
  } else if (nvec <= int64_t(kWideBlock) * 8) {
    launch(integral_constant<int, 8>{}, integral_constant<int, kWideBlock>{});
  } else {
    return false;
  }
  return true;
}

// Calls launch(kVecs, C constants) for the cluster kernel that fits `nvec` vectors (C blocks of kBlock threads,
// kVecs vectors each), or returns false for rows that one block serves as fast (<= 4 vectors per thread: on an
// H100 rms_norm_quant of 4096-wide bfloat16 rows took 4.1 us in one block, 5.3 us in a cluster of two, whose
// two cluster-wide reductions cost more than the split saves) or that are too long (> 8192 vectors).
template <class F>
bool with_cluster_config(int64_t nvec, F&& launch) {
  using std::integral_constant;
  if (nvec <= 4 * kBlock) return false;
  if (nvec <= 8 * kBlock) {
    launch(integral_constant<int, 1>{}, integral_constant<int, kClusterBlocks>{});
  } else if (nvec <= 16 * kBlock) {
    launch(integral_constant<int, 2>{}, integral_constant<int, kClusterBlocks>{});
  } else if (nvec <= 32 * kBlock) {
    launch(integral_constant<int, 4>{}, integral_constant<int, kClusterBlocks>{});
  } else {
    return false;
  }
  return true;
}

// The three kernels of a fused row-wise op `Op` (a RowwiseOp: rms_norm.cu's, silu_mul.cu's, permute_quant.cu's),
// which provides `Params` (the kernel argument, by value) and the device functions
//   Op::regs<kVecs, kB, C>(p)  row blockIdx.x (C = 1), or block y's part of it over a cluster of C blocks (sm90),
//                              kVecs 16-byte vectors per thread of kB held in registers
//   Op::loop<N, kB>(p)         row blockIdx.x by one block of kB threads looping over it, N elements a load
//                              (16 / sizeof(T): vectorized; 1: any alignment)
template <class Op, int kVecs, int kB>
__global__ void __launch_bounds__(kB) rowwise_regs_kernel(const typename Op::Params p) {
  allow_dependent_launch();
  wait_for_producers();
  Op::template regs<kVecs, kB, 1>(p);
}

template <class Op, int kVecs, int kB, int C>
__global__ void CW8A8_CLUSTER_DIMS(1, C, 1) __launch_bounds__(kB)
    rowwise_cluster_kernel(const typename Op::Params p) {
#if CW8A8_HAS_CLUSTERS
  allow_dependent_launch();
  wait_for_producers();
  Op::template regs<kVecs, kB, C>(p);
#else
  __trap();
#endif
}

template <class Op, int N, int kB>
__global__ void __launch_bounds__(kB) rowwise_loop_kernel(const typename Op::Params p) {
  allow_dependent_launch();
  wait_for_producers();
  Op::template loop<N, kB>(p);
}

// One launch of the fused row-wise op `Op` on M rows of nvec 16-byte vectors of T: the cluster kernel, the
// register kernel or the loop kernel, in that order of preference (see above), with PDL when `pdl`
// (core/launch_policy.hpp's kernels_use_pdl). `part_multiple`: the cluster kernel only when each block's part of
// the row (ceil(nvec / C) vectors) is a multiple of it (GroupOut: the vectors of a 128-element group, so that no
// group straddles two blocks). Returns the launch's error.
template <class T, class Op>
[[nodiscard]] cudaError_t launch_rowwise(const typename Op::Params& p, int64_t nvec, int64_t m, bool vectorizable, bool clusters,
                    bool pdl, cudaStream_t stream, int64_t part_multiple = 1) {
  constexpr int N = 16 / sizeof(T);
  bool launched = false;
  cudaError_t err = cudaSuccess;
  if constexpr (!std::is_same_v<T, float>) {
    if (vectorizable && clusters && (nvec + kClusterBlocks - 1) / kClusterBlocks % part_multiple == 0) {
      launched = with_cluster_config(nvec, [&](auto vecs, auto c) {
        const dim3 grid(static_cast<unsigned>(m), decltype(c)::value);
        err = launch_kernel(rowwise_cluster_kernel<Op, decltype(vecs)::value, kBlock, decltype(c)::value>, grid,
                      dim3(kBlock), 0, stream, pdl, p);
      });
    }
  }
  const dim3 grid(static_cast<unsigned>(m));
  if (!launched && vectorizable) {
    launched = with_register_config(nvec, [&](auto vecs, auto block) {
      err = launch_kernel(rowwise_regs_kernel<Op, decltype(vecs)::value, decltype(block)::value>, grid,
                    dim3(block.value), 0, stream, pdl, p);
    });
  }
  if (!launched) {
    if (vectorizable) {
      err = launch_kernel(rowwise_loop_kernel<Op, N, kBlock>, grid, dim3(kBlock), 0, stream, pdl, p);
    } else {
      err = launch_kernel(rowwise_loop_kernel<Op, 1, kBlock>, grid, dim3(kBlock), 0, stream, pdl, p);
    }
  }
  return err;
}

// The element type of x and the output of a row-wise op, as the host names them.
enum class RowElem { kBFloat16, kHalf, kFloat };
enum class RowOut { kSame, kInt8, kFp8 };  // kSame: y itself, in x's dtype (unquantized)

// Calls f(T{}, GroupOut<Q>{}) with T the element type of x and Q = Int8Out (`out` kInt8) or Fp8Out (kFp8): the
// fused ops' per-group quantization (group_size 128).
template <class F>
void dispatch_rowwise_groups(RowElem x, RowOut out, F&& f) {
  auto with_out = [&](auto t) {
    if (out == RowOut::kInt8) {
      f(t, GroupOut<Int8Out>{});
    } else {
      f(t, GroupOut<Fp8Out>{});
    }
  };
  switch (x) {
    case RowElem::kBFloat16: with_out(__nv_bfloat16{}); break;
    case RowElem::kHalf: with_out(__half{}); break;
    case RowElem::kFloat: with_out(float{}); break;
  }
}

// Calls f(T{}, O{}) with T the element type of x (__nv_bfloat16, __half or float) and O the output conversion:
// FloatOut<T>, Int8Out or Fp8Out.
template <class F>
void dispatch_rowwise(RowElem x, RowOut out, F&& f) {
  auto with_out = [&](auto t) {
    using T = decltype(t);
    switch (out) {
      case RowOut::kSame: f(t, FloatOut<T>{}); break;
      case RowOut::kInt8: f(t, Int8Out{}); break;
      case RowOut::kFp8: f(t, Fp8Out{}); break;
    }
  };
  switch (x) {
    case RowElem::kBFloat16: with_out(__nv_bfloat16{}); break;
    case RowElem::kHalf: with_out(__half{}); break;
    case RowElem::kFloat: with_out(float{}); break;
  }
}

}  // namespace
}  // namespace cutlass_w8a8
