// The device code of scaled_mm_decode and linear_decode (host side: scaled_mm_decode.cu): W8A8 GEMMs for M <= 16
// (decode), written to stream the weights at the memory limit with every SM busy. csrc/gemm/decode/README.md has
// the reasoning and the estimates behind the numbers. Torch-free: the kernels, their parameter block and the
// shape constants the host needs to size the grid and the split-K workspace.
//
//   scaled_mm_decode: D[M, N] = round(scale_a[m] * (scale_b[n] * float(acc[m, n])) + bias[n]),
//                     acc = A[M, K] @ W[N, K]^T (int8: exact int32; e4m3: float32)
//   linear_decode:    the same with A = quantize_per_token(x) computed inside the kernel, bit for bit as
//                     csrc/quant/quantize.cu computes it (so the two paths give identical D).
//   block scales:     (scaled_mm_decode, e4m3; kBlockScaled) D[m, n] = round(sum_kb scale_a[m, kb] *
//                     scale_b[n / 128, kb] * acc_kb[m, n] + bias[n]), acc_kb the float32 dot product over the
//                     128-wide K group kb: decode_mma.cuh, "block scales", and README.md, "Block scales".
//
// Tensor-core mapping, operand loads and the per-step MMAs: decode_mma.cuh.
//
// Work split: a CTA (8 warps) owns 16 weight rows; K is cut into "blocks" of 4 steps (256 bytes), block b
// going to warp b % 8 (within the CTA's split, see below), each warp walking its blocks in increasing order:
// per block a thread issues 8 independent 16-byte weight loads (ld.global.nc.L1::no_allocate: the weights
// are read once) plus one 16-byte activation load per step and token tile (normal cached loads: every CTA
// reads the same M x K activations, which stay in L2 / L1), then runs its 8 (or 16) MMAs, the first of which
// is made to depend on all 8 loads (tie_to_weight_loads) so that ptxas issues them all first. The 8 warps
// accumulators are summed through shared memory in warp order (deterministic), and one thread per (channel,
// token) applies the epilogue. N / 16 CTAs; when that is fewer than the SMs, K is also split across
// `splits` CTAs (grid.y) whose int32 / float32 partial sums go to a workspace from the torch allocator and a
// second small kernel adds them in split order and applies the epilogue.
//
// Token tiles: NT = 1 for M <= 8, 2 for M in 9..16 (tile j holds tokens 8j..8j+7); a kernel built for NT
// tiles serves any m <= 8 NT. The grid depends on N, K and the SM count only, never on M, and M is the
// FIRST kernel parameter (`int64_t m`), so a captured CUDA-graph node is moved to another M by rewriting that
// one parameter (graph_nodes::note_m_param_launch).
//
// linear_decode (fused quantization): every CTA first computes each token row's absmax over the whole K
// (scale = absmax / QMAX, float32, IEEE division), then walks K in chunks of 8 blocks (2048 bytes: one block
// per warp, the same block-to-warp assignment as the unfused kernel): all 256 threads quantize the chunk's
// M x 2048 activations into shared memory (quantize_one: q = sat(rne(x / scale)), 0 for a zero row), then each
// warp runs the same block step as the unfused kernel, reading its activation fragments from shared memory.
// A warp's weight loads are issued after the chunk's quantization: holding them in registers across it (to
// overlap their latency) made the kernel spill, the IEEE division's slow-path call clobbering registers; the
// latency is covered by the other CTA on the SM instead (two per SM). Same quantized values, same scales, same
// MMA sequence per warp, same reductions and epilogue: D equals scaled_mm_decode(quantize_per_token(x)) bit
// for bit. The absmax pass and the quantization are repeated by every CTA (M x K x 2 bytes read from L2 and
// M x K divisions per CTA), which is why it only pays at small M: csrc/gemm/decode/README.md, "Crossover".
//
// add_rms_norm_linear_decode (fused residual add + RMSNorm + quantization; XT = NormX<T>): as linear_decode, with
// A = quantize_per_token(y), y = rms_norm(s) * norm_weight, s = T(x + residual) (or x), computed by every CTA as
// rms_norm.cu's register kernel computes it for K <= 8192 (one block of 256 threads per row, thread i summing the
// squares of vectors i, i + 256, ... of its row in that order, then block_sum): norm_row_scales runs the same
// float operations in the same order for every row at once (the shared arithmetic: quant/rms_norm_row.cuh; the
// reduction: block_sum_rows), so inv_rms, y, the scale and the quantized values equal rms_norm_quant's bit for bit.
// Passes per CTA: s and its sums of squares (the CTA that owns a row, CTA index r mod the grid's CTAs, also
// writes s to residual_out: out of place, since the other CTAs still read residual), then y's absmax, then per
// chunk y again, quantized into shared memory. x, residual and norm_weight are read from L2 three times per CTA.
//
// PDL: the kernels wait on griddepcontrol before their first access to memory another kernel writes (the main
// kernel first asks L2 to prefetch the start of its weight rows: weights are nobody's output) and signal
// launch_dependents once their loads are done; the host launches the main kernel with programmatic stream
// serialization when core/launch_policy.hpp's kernels_use_pdl says so (the PDL switch on, sm90 or newer).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "gemm/decode/decode_mma.cuh"  // DecodeParams, shape constants, loads, MMAs, epilogue, block scales
#include "quant/rms_norm_row.cuh"      // add_vec, sum_squares, normalize, inverse_rms (rms_norm.cu's arithmetic)
#include "quant/rowwise_reduce.cuh"     // to_float, quantize_one, allow_dependent_launch, wait_for_producers

namespace cutlass_w8a8 {
namespace {

// 8 consecutive activations (16 bytes) of a bf16 / fp16 row.
template <class XT>
struct alignas(16) XVec {
  XT v[8];
};

// The end of row_scales and norm_row_scales: each thread's running absmax per row (amax[r], over the values it
// read) is reduced across the CTA, lanes by shuffles, then the warps in warp order through s_amax, and
// s_scale[r] = absmax / QMAX for every r < 8 NT (0 for rows no thread read). All threads call it; it synchronizes.
template <class Q, int NT>
__device__ __forceinline__ void scales_from_amax(float (&amax)[8 * NT], float (&s_amax)[kWarps][kMaxTokens],
                                                 float* s_scale) {
  constexpr int kTokens = 8 * NT;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int r = 0; r < kTokens; ++r) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) amax[r] = fmaxf(amax[r], __shfl_xor_sync(0xffffffffu, amax[r], off));
    if (lane == 0) s_amax[warp][r] = amax[r];
  }
  __syncthreads();
  if (threadIdx.x < kTokens) {
    float a = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) a = fmaxf(a, s_amax[w][threadIdx.x]);
    s_scale[threadIdx.x] = a / Q::kMax;
  }
  __syncthreads();
}

// linear_decode, phase 1: scale[r] = max_k |x[r, k]| / QMAX for the rows r < m, into s_scale (all threads call
// it; it synchronizes). max is exact in any order, so this equals quantize.cu's per-token scale bit for bit.
template <class XT, class Q, int NT>
__device__ __forceinline__ void row_scales(const XT* x, int64_t ldx, int m, int k,
                                           float (&s_amax)[kWarps][kMaxTokens], float* s_scale) {
  constexpr int kTokens = 8 * NT;
  float amax[kTokens];
#pragma unroll
  for (int r = 0; r < kTokens; ++r) amax[r] = 0.f;
  const int nvec = k / 8;
#pragma unroll
  for (int r0 = 0; r0 < kTokens; r0 += 8) {  // 8 rows at a time: 8 loads in flight per thread
    if (r0 >= m) break;
    for (int v = threadIdx.x; v < nvec; v += kThreads) {
      XVec<XT> vals[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        if (r0 + i < m) vals[i] = *reinterpret_cast<const XVec<XT>*>(x + (r0 + i) * ldx + v * 8);
      }
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        if (r0 + i < m) {
#pragma unroll
          for (int e = 0; e < 8; ++e) amax[r0 + i] = fmaxf(amax[r0 + i], fabsf(to_float(vals[i].v[e])));
        }
      }
    }
  }
  scales_from_amax<Q, NT>(amax, s_amax, s_scale);
}

template <class Q>
__device__ __forceinline__ uint32_t quantize4(float x0, float x1, float x2, float x3, float scale) {
  const uint32_t q0 = static_cast<uint8_t>(quantize_one<Q>(x0, scale));
  const uint32_t q1 = static_cast<uint8_t>(quantize_one<Q>(x1, scale));
  const uint32_t q2 = static_cast<uint8_t>(quantize_one<Q>(x2, scale));
  const uint32_t q3 = static_cast<uint8_t>(quantize_one<Q>(x3, scale));
  return q0 | (q1 << 8) | (q2 << 16) | (q3 << 24);
}

// 8 quantized values of row r's columns [col, col + 8) into q_s (one 8-byte store): quantize_one of each of the
// vector's 8 elements with the row's scale. V: an 8-element vector of bf16 / fp16 (XVec or Vec).
template <class Q, class V>
__device__ __forceinline__ void store_quantized8(const V& v, float scale, uint8_t* q_s, int r, int col) {
  uint2 q;
  q.x = quantize4<Q>(to_float(v.v[0]), to_float(v.v[1]), to_float(v.v[2]), to_float(v.v[3]), scale);
  q.y = quantize4<Q>(to_float(v.v[4]), to_float(v.v[5]), to_float(v.v[6]), to_float(v.v[7]), scale);
  *reinterpret_cast<uint2*>(q_s + r * kChunkPitch + col) = q;
}

// linear_decode, phase 2 (per chunk): q_s[r][0 .. c1 - c0) = quantize(x[r, c0 .. c1)) for r < m. Thread i
// takes the 8 columns [8i, 8i + 8) of every row (c1 - c0 <= 2048 = 8 * 256). No synchronization inside.
// Rows go 4 at a time (4 loads in flight per thread), which keeps the kernel within 128 registers.
template <class XT, class Q, int NT>
__device__ __forceinline__ void quantize_chunk(const XT* x, int64_t ldx, int m, int c0, int c1,
                                               const float* s_scale, uint8_t* q_s) {
  constexpr int kTokens = 8 * NT;
  constexpr int kGroup = 4;
  const int col = threadIdx.x * 8;
  if (c0 + col >= c1) return;
#pragma unroll 1
  for (int r0 = 0; r0 < kTokens; r0 += kGroup) {
    if (r0 >= m) break;
    XVec<XT> vals[kGroup];
#pragma unroll
    for (int i = 0; i < kGroup; ++i) {
      if (r0 + i < m) vals[i] = *reinterpret_cast<const XVec<XT>*>(x + (r0 + i) * ldx + c0 + col);
    }
#pragma unroll
    for (int i = 0; i < kGroup; ++i) {
      if (r0 + i < m) {
        store_quantized8<Q>(vals[i], s_scale[r0 + i], q_s, r0 + i, col);
      }
    }
  }
}

// --- add_rms_norm_linear_decode: the fused residual add and RMSNorm ---------------------------------------------

// The XT of decode_gemm_kernel for add_rms_norm_linear_decode: x (and the output) of type T, normalized in the kernel.
template <class T>
struct NormX {
  using type = T;
};

// add_rms_norm_linear_decode's parameter block: the GEMM's (a = x), then the fused norm's operands. (A type of its
// own rather than more DecodeParams fields: a larger DecodeParams changed ptxas's register allocation of the other
// decode kernels.)
struct NormDecodeParams : DecodeParams {
  const void* residual;     // [M, K] in x's type, ldr apart; nullptr: s = x
  int64_t ldr;
  void* residual_out;       // [M, K] in x's type, ldro apart: s, written by one CTA per row
  int64_t ldro;
  const void* norm_weight;  // [K] in x's type
  float eps;
};

template <class XT>
struct NormOf : std::false_type {
  using elem = XT;  // the element type of `a` (void: 8-bit, read as bytes)
  using params = DecodeParams;
};
template <class T>
struct NormOf<NormX<T>> : std::true_type {
  using elem = T;
  using params = NormDecodeParams;
};

// The loads of both passes of norm_row_scales: the 16-byte vector v of x's rows r0 .. r0 + kGroup - 1 into s and,
// when there is a residual, of its rows into r (rows >= m are not read; all loads issued before any use).
template <class T, int N, int kGroup>
__device__ __forceinline__ void load_norm_rows(Vec<T, N> (&s)[kGroup], Vec<T, N> (&r)[kGroup], const T* x,
                                               const T* res, const NormDecodeParams& p, int r0, int m, int v) {
  using V = Vec<T, N>;
#pragma unroll
  for (int i = 0; i < kGroup; ++i) {
    if (r0 + i < m) {
      s[i] = reinterpret_cast<const V*>(x + (r0 + i) * p.lda)[v];
      if (res != nullptr) r[i] = reinterpret_cast<const V*>(res + (r0 + i) * p.ldr)[v];
    }
  }
}

// Phase 1 of the fused norm: for the rows r < m, s = T(x + residual) (or x), inv_rms into s_inv[r] exactly as
// rms_norm.cu computes it for this row (thread i: vectors i, i + kThreads, ... in order, then block_sum's order),
// the absmax of y = normalize(s, w, inv_rms) over the row, and s_scale[r] = absmax / QMAX (0 for r >= m). The CTA
// owning row r (CTA index r mod the number of CTAs) writes s to residual_out. All threads call it; it synchronizes.
template <class T, class Q, int NT>
__device__ __forceinline__ void norm_row_scales(const NormDecodeParams& p, int m, float (&s_amax)[kWarps][kMaxTokens],
                                                float* s_inv, float* s_scale) {
  constexpr int kTokens = 8 * NT;
  constexpr int kGroup = 2;  // rows at a time: x and residual loads in flight per thread
  constexpr int N = 16 / sizeof(T);
  using V = Vec<T, N>;
  const T* x = static_cast<const T*>(p.a);
  const T* res = static_cast<const T*>(p.residual);
  T* rout = static_cast<T*>(p.residual_out);
  const V* wv = static_cast<const V*>(p.norm_weight);
  const int nvec = p.k / N;
  const unsigned cta = blockIdx.x + blockIdx.y * gridDim.x, nctas = gridDim.x * gridDim.y;

  // s, its sums of squares, residual_out
  float ss[kTokens];
#pragma unroll
  for (int r = 0; r < kTokens; ++r) ss[r] = 0.f;
#pragma unroll
  for (int r0 = 0; r0 < kTokens; r0 += kGroup) {
    if (r0 >= m) break;
    for (int v = threadIdx.x; v < nvec; v += kThreads) {
      V s[kGroup], r[kGroup];
      load_norm_rows(s, r, x, res, p, r0, m, v);
#pragma unroll
      for (int i = 0; i < kGroup; ++i) {
        if (r0 + i < m) {
          if (res != nullptr) add_vec<T, N>(s[i], r[i]);
          ss[r0 + i] += sum_squares<T, N>(s[i]);
          if (cta == static_cast<unsigned>(r0 + i) % nctas) reinterpret_cast<V*>(rout + (r0 + i) * p.ldro)[v] = s[i];
        }
      }
    }
  }
  block_sum_rows<kThreads>(ss, m, s_amax, s_inv);
  if (threadIdx.x < m) s_inv[threadIdx.x] = inverse_rms(s_inv[threadIdx.x], p.k, p.eps);
  __syncthreads();

  // max |y| per row
  float amax[kTokens];
#pragma unroll
  for (int r = 0; r < kTokens; ++r) amax[r] = 0.f;
#pragma unroll
  for (int r0 = 0; r0 < kTokens; r0 += kGroup) {
    if (r0 >= m) break;
    for (int v = threadIdx.x; v < nvec; v += kThreads) {
      V s[kGroup], r[kGroup];
      const V w = wv[v];
      load_norm_rows(s, r, x, res, p, r0, m, v);
#pragma unroll
      for (int i = 0; i < kGroup; ++i) {
        if (r0 + i < m) {
          if (res != nullptr) add_vec<T, N>(s[i], r[i]);
          amax[r0 + i] = vec_amax(amax[r0 + i], normalize<T, N>(s[i], w, s_inv[r0 + i]));
        }
      }
    }
  }
  scales_from_amax<Q, NT>(amax, s_amax, s_scale);
}

// Phase 2 of the fused norm (per chunk), as quantize_chunk: q_s[r][0 .. c1 - c0) = quantize(y[r, c0 .. c1)) for
// r < m, y recomputed from x, residual and norm_weight with the row's s_inv, quantized with its s_scale. Rows go
// 2 at a time (x and residual of each, and the weights: 5 loads in flight), within 128 registers.
template <class T, class Q, int NT>
__device__ __forceinline__ void norm_quantize_chunk(const NormDecodeParams& p, int m, int c0, int c1, const float* s_inv,
                                                    const float* s_scale, uint8_t* q_s) {
  constexpr int kTokens = 8 * NT;
  constexpr int kGroup = 2;
  constexpr int N = 16 / sizeof(T);
  static_assert(N == 8, "a thread's 8 columns are one 16-byte vector");
  using V = Vec<T, N>;
  const int col = threadIdx.x * 8;
  if (c0 + col >= c1) return;
  const T* x = static_cast<const T*>(p.a);
  const T* res = static_cast<const T*>(p.residual);
  const V w = *reinterpret_cast<const V*>(static_cast<const T*>(p.norm_weight) + c0 + col);
#pragma unroll 1
  for (int r0 = 0; r0 < kTokens; r0 += kGroup) {
    if (r0 >= m) break;
    V s[kGroup], r[kGroup];
#pragma unroll
    for (int i = 0; i < kGroup; ++i) {
      if (r0 + i < m) {
        s[i] = *reinterpret_cast<const V*>(x + (r0 + i) * p.lda + c0 + col);
        if (res != nullptr) r[i] = *reinterpret_cast<const V*>(res + (r0 + i) * p.ldr + c0 + col);
      }
    }
#pragma unroll
    for (int i = 0; i < kGroup; ++i) {
      if (r0 + i < m) {
        if (res != nullptr) add_vec<T, N>(s[i], r[i]);
        const V y = normalize<T, N>(s[i], w, s_inv[r0 + i]);
        store_quantized8<Q>(y, s_scale[r0 + i], q_s, r0 + i, col);
      }
    }
  }
}

// --- the kernels -------------------------------------------------------------------------------------------

// AB: Int8Ab / Fp8Ab. OutT: __nv_bfloat16 / __half. NT: token tiles (m <= 8 NT). XT: void (scaled_mm_decode:
// `a` holds the quantized activations) or the type of x (linear_decode: quantized here; the output type is
// x's), or NormX<T> (add_rms_norm_linear_decode: x of type T, added to the residual, normalized and quantized
// here; the output type is T; its parameter block is a NormDecodeParams). kBlockScaled: e4m3 with block scales (scaled_mm_decode only; scale_a [M, K/128], scale_b
// [ceil(N/128), K/128], K a multiple of 128): each group's partial dot products are scaled into the float32
// accumulators (mma_block_scaled), and the epilogue adds only the bias. Grid (N / 16, splits), 256 threads.
template <class AB, class OutT, int NT, class XT, bool kBlockScaled = false>
__global__ void __launch_bounds__(kThreads, 2) decode_gemm_kernel(int64_t m64, typename NormOf<XT>::params p) {
  using Acc = typename AB::Acc;
  constexpr bool kFused = !std::is_void_v<XT>;
  constexpr bool kNorm = NormOf<XT>::value;
  using XE = typename NormOf<XT>::elem;  // x's element type (XT itself unless NormX)
  static_assert(!kBlockScaled || (std::is_same_v<AB, Fp8Ab> && !kFused), "block scales: scaled_mm_decode, e4m3");
  constexpr int kQRows = kFused ? 8 * NT : 1;
  constexpr int kQPitch = kFused ? kChunkPitch : 16;
  __shared__ alignas(16) Acc red[kWarps][NT][32][4];        // the warps' partial accumulators
  __shared__ alignas(16) uint8_t q_s[kQRows][kQPitch];      // linear_decode: the quantized chunk
  __shared__ float s_amax[kWarps][kMaxTokens];
  __shared__ float s_scale[kMaxTokens];

  const int m = static_cast<int>(m64);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kRows;
  const uint8_t* wg = p.w + (row0 + g) * p.ldw + 16 * t;
  const int nblk = (p.k + kBlockBytes - 1) / kBlockBytes;
  const int bs = static_cast<int>(blockIdx.y) * p.blocks_per_split;
  const int be = min(bs + p.blocks_per_split, nblk);
  // Before the PDL wait: the weights are no kernel's output, so their first bytes can stream into L2 while the
  // previous kernels finish (the gap a decode step would otherwise leave HBM idle in). One thread per row.
  if (p.prefetch_bytes != 0 && threadIdx.x < kRows && blockIdx.x + blockIdx.y * gridDim.x < p.prefetch_ctas) {
    const int kb = bs * kBlockBytes;
    const int avail = (p.k - kb) & ~15;  // K is a multiple of 16 (checked), kb of 256
    const uint32_t bytes = min(p.prefetch_bytes, static_cast<uint32_t>(max(avail, 0)));
    if (bytes != 0) prefetch_l2(p.w + (row0 + threadIdx.x) * p.ldw + kb, bytes);
  }
  wait_for_producers();  // before any access to memory another kernel writes (PDL)

  Acc acc[NT][4];
  zero_acc(acc);

  if constexpr (kBlockScaled) {
    const uint8_t* a = static_cast<const uint8_t*>(p.a);
    const int kgroups = p.k / kGroupBytes;  // K / 128: the row length of both scale matrices
    const float* sb_row = p.scale_b + (row0 / kGroupBytes) * kgroups;
    mainloop_global_scaled(acc, wg, p.ldw, a, p.lda, m, p.scale_a, sb_row, kgroups, bs + warp, be, g, t, p.k, p.zero);
  } else if constexpr (!kFused) {
    mainloop_global(acc, wg, p.ldw, static_cast<const uint8_t*>(p.a), p.lda, m, bs + warp, be, g, t, p.k, p.zero);
  } else {
    BlockFrags<NT> f;
    const XE* x = static_cast<const XE*>(p.a);
    // Chunk c holds blocks [bs + 8c, bs + 8c + 8): warp w takes block bs + 8c + w, as in the unfused loop.
    const int nchunks = (be - bs + kWarps - 1) / kWarps;
    [[maybe_unused]] float* s_inv = nullptr;  // the fused norm's inverse RMS per row
    if constexpr (kNorm) {
      __shared__ float s_inv_rms[kMaxTokens];
      s_inv = s_inv_rms;
      norm_row_scales<XE, typename AB::Q, NT>(p, m, s_amax, s_inv, s_scale);
    } else {
      row_scales<XE, typename AB::Q, NT>(x, p.lda, m, p.k, s_amax, s_scale);
    }
    int blk = bs + warp;
    for (int c = 0; c < nchunks; ++c, blk += kWarps) {
      const int c0 = (bs + c * kWarps) * kBlockBytes;
      const int c1 = min(min(c0 + kChunkBytes, be * kBlockBytes), p.k);
      if (c > 0) __syncthreads();  // every warp has read the previous chunk before it is overwritten
      if constexpr (kNorm) {
        norm_quantize_chunk<XE, typename AB::Q, NT>(p, m, c0, c1, s_inv, s_scale, &q_s[0][0]);
      } else {
        quantize_chunk<XE, typename AB::Q, NT>(x, p.lda, m, c0, c1, s_scale, &q_s[0][0]);
      }
      __syncthreads();  // the chunk is in shared memory
      if (blk < be) {
        load_block_weights(f, wg, p.ldw, blk, t, p.k);
        tie_to_weight_loads(f, p.zero);
#pragma unroll
        for (int u = 0; u < kSteps; ++u) {
          uint4 xs[NT];
          load_step_acts_shared(xs, &q_s[0][0], m, blk, u, c0, g, t, p.k);
          mma_step(acc, f.w[u], xs);
        }
      }
    }
  }
  allow_dependent_launch();  // all loads are done: a PDL-launched successor may be scheduled

  // Sum the 8 warps' accumulators in warp order, then one thread per (channel, token) finishes.
  store_warp_acc(red, acc, warp, lane);
  __syncthreads();
  const int row = threadIdx.x % kRows, token = threadIdx.x / kRows;
  if (token < m && token < 8 * NT) {
    const Acc sum = warp_order_sum(red, row, token);
    const int64_t ch = row0 + row;
    if (p.splits == 1) {
      if constexpr (kBlockScaled) {
        static_cast<OutT*>(p.out)[token * p.ldo + ch] = epilogue_scaled<OutT>(sum, bias_term<OutT>(p, ch));
      } else {
        float sa;
        if constexpr (kFused) {
          sa = s_scale[token];
        } else {
          sa = p.scale_a_per_token ? p.scale_a[token] : p.scale_a[0];
        }
        float sb, bias;
        channel_terms<OutT>(p, ch, &sb, &bias);
        static_cast<OutT*>(p.out)[token * p.ldo + ch] = epilogue<OutT>(sum, sa, sb, bias);
      }
    } else {
      static_cast<Acc*>(p.partials)[(static_cast<int64_t>(blockIdx.y) * kMaxTokens + token) * p.n + ch] = sum;
      if constexpr (kFused) {
        if (blockIdx.x == 0 && blockIdx.y == 0 && row == 0) p.scales_out[token] = s_scale[token];
      }
    }
  }
}

// splits > 1: D[token, ch] = epilogue(sum over splits s = 0, 1, ... of partials[s][token][ch]). One thread per
// channel, tokens < m. Grid ceil(N / 256); launched after the main kernel (stream order). kBlockScaled: the
// partials are already scaled, so only the bias is added (epilogue_scaled).
template <class Acc, class OutT, bool kBlockScaled = false>
__global__ void __launch_bounds__(kReduceThreads) decode_reduce_kernel(int64_t m64, DecodeParams p) {
  allow_dependent_launch();
  wait_for_producers();
  const int m = static_cast<int>(m64);
  const int64_t ch = static_cast<int64_t>(blockIdx.x) * kReduceThreads + threadIdx.x;
  if (ch >= p.n) return;
  const Acc* part = static_cast<const Acc*>(p.partials);
  float sb = 1.f, bias;
  if constexpr (kBlockScaled) {
    bias = bias_term<OutT>(p, ch);
  } else {
    channel_terms<OutT>(p, ch, &sb, &bias);
  }
  for (int token = 0; token < m; ++token) {
    Acc sum = part[token * p.n + ch];
    for (int s = 1; s < p.splits; ++s) sum += part[(static_cast<int64_t>(s) * kMaxTokens + token) * p.n + ch];
    if constexpr (kBlockScaled) {
      static_cast<OutT*>(p.out)[token * p.ldo + ch] = epilogue_scaled<OutT>(sum, bias);
    } else {
      const float sa = p.scale_a_per_token ? p.scale_a[token] : p.scale_a[0];
      static_cast<OutT*>(p.out)[token * p.ldo + ch] = epilogue<OutT>(sum, sa, sb, bias);
    }
  }
}

}  // namespace
}  // namespace cutlass_w8a8
