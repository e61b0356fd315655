// The fragments and MMAs of the decode GEMMs (decode_kernels.cuh has the kernels; README.md the reasoning): the
// shape constants the host needs (grid, split-K workspace), the parameter block, the operand loads, the
// tensor-core steps (int8, e4m3 on sm89 and sm90), the main loops over global memory and the warps' reduction
// (shared by scaled_mm_decode and grouped_decode), the epilogue and the block-scale steps. Torch-free.
//
// Tensor-core mapping (PTX ISA, "Matrix Fragments for mma.m16n8k32"): 16 weight rows (output channels) sit on
// the MMA's M, up to 8 tokens on its N, K on its K. For thread (g = lane / 4, t = lane % 4):
//   A (16 x 32, row):  a0 = row g,     k 4t..4t+3      a1 = row g + 8, k 4t..4t+3
//                      a2 = row g,     k 16+4t..+3     a3 = row g + 8, k 16+4t..+3
//   B (32 x 8, col):   b0 = token g,   k 4t..4t+3      b1 = token g,   k 16+4t..+3
//   C (16 x 8):        c0, c1 = row g, tokens 2t, 2t+1;  c2, c3 = row g + 8, tokens 2t, 2t+1
// A dot product does not change when the same permutation of k is applied to both operands, and the k a
// thread holds depend only on t. So each thread loads 16 CONTIGUOUS bytes [base + 16t, +16) of weight rows g
// and g + 8 (one 128-bit load each) and the same 16 bytes of token g's activations, and feeds them to two
// MMAs: words 0, 1 to MMA #1 and words 2, 3 to MMA #2:
//   MMA #1: a = {Wg.x, Wg8.x, Wg.y, Wg8.y}, b = {X.x, X.y};   MMA #2: a = {Wg.z, Wg8.z, Wg.w, Wg8.w}, b = {X.z, X.w}
// (logical k 4t+i of MMA #1 is physical byte base + 16t + i, logical 16+4t+i is base + 16t + 4 + i; MMA #2 the
// same at + 8 and + 12): one warp consumes 16 rows x 64 bytes of K per "step" of two MMAs per token tile.
// K % 64 != 0 needs no tail code: a thread's 16 bytes at k = 64 s + 16 t are either all inside K or all past
// it (K % 16 == 0), and past it the thread feeds zeros. e4m3 on sm90 (no fp8 mma.sync in hardware) converts
// the pairs to f16 and runs four m16n8k16 per tile instead, with the same kind of permutation (mma_step).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "core/limits.hpp"
#include "quant/rowwise_reduce.cuh"  // to_float, from_float, Int8Out / Fp8Out, quantize_one

namespace cutlass_w8a8 {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kRows = 16;                                  // weight rows (channels) per CTA: the MMA's M
constexpr int kMaxTokens = static_cast<int>(limits::kDecodeMaxM);  // M <= 16: two token tiles of 8
constexpr int kStepBytes = 64;                             // K bytes per step (two m16n8k32 MMAs per tile)
constexpr int kSteps = 4;                                  // steps per block
constexpr int kBlockBytes = kStepBytes * kSteps;           // 256: one warp's unit of work
constexpr int kChunkBytes = kBlockBytes * kWarps;          // 2048: linear_decode's shared-memory chunk of K
constexpr int kChunkPitch = kChunkBytes + 64;              // row pitch = 64 (mod 128): conflict-free LDS.128
constexpr int kGroupBytes = static_cast<int>(limits::kBlockSize);  // block scales: a 1 x 128 group of K, 2 steps
constexpr int kGroupsPerBlock = kBlockBytes / kGroupBytes;         // 2: steps 0, 1 and steps 2, 3 of a block
constexpr int kReduceThreads = 256;
constexpr int kMainParams = 2;                             // (int64_t m, DecodeParams p)
constexpr int kReduceParams = 2;

// int8 K is bounded by limits::kInt8MaxK, the same bound as scaled_mm. Any K for fp8 up to limits::kDecodeMaxK
// (2^30), so that K byte offsets (plus a block) stay 32-bit integers in the kernels.
static_assert(limits::kDecodeMaxK + kBlockBytes <= INT32_MAX, "K byte offsets must stay 32-bit");
// Block scales: a group is whole steps, a CTA's 16 rows lie in one 128-row block of N (one scale_b value per CTA
// and group).
static_assert(kGroupBytes % kStepBytes == 0 && kBlockBytes % kGroupBytes == 0 && kGroupBytes % kRows == 0,
              "block-scale groups must be whole steps of a block, and a CTA's rows one 128-row block");

// Everything but M, so that one captured launch serves every M <= its own (see the file comment).
struct DecodeParams {
  const void* a;             // scaled_mm_decode: int8 / e4m3 [M, K]; linear_decode: bf16 / fp16 x [M, K]
  int64_t lda;               // row stride of a, elements
  const uint8_t* w;          // the [N, K] row-major weight (b = w.t()), bytes
  int64_t ldw;               // row stride of w, bytes (= elements)
  const float* scale_a;      // [1] or [M]; linear_decode with splits > 1: the in-kernel scales (workspace);
                             // block scales: [M, K/128] row-major
  const float* scale_b;      // [1] or [N]; block scales: [ceil(N/128), K/128] row-major
  const void* bias;          // [N] in the output type, or nullptr
  void* out;                 // [M, N] row-major, output type
  int64_t ldo;               // row stride of out, elements
  void* partials;            // splits > 1: [splits][16][N] int32 / float32 partial sums
  float* scales_out;         // linear_decode with splits > 1: where CTA (0, 0) writes the 16 row scales
  int64_t n;
  int k;                     // K <= limits::kDecodeMaxK: K offsets are 32-bit in the kernels (fewer registers)
  int scale_a_per_token;     // (both ignored with block scales: the kernel's kBlockScaled)
  int scale_b_per_channel;
  int splits;                // CTAs along K (grid.y)
  int blocks_per_split;      // K blocks per split, a multiple of kWarps
  uint32_t zero;             // always 0: a value ptxas cannot fold (see tie_to_weight_loads)
  uint32_t prefetch_bytes;   // per weight row: L2 prefetch of the first bytes of the CTA's K range (0: none)
  uint32_t prefetch_ctas;    // only CTAs (x + y * gridDim.x) below this prefetch: the first wave, which may
                             // start before the previous kernel ends (later CTAs would fetch what they load)
};

struct Int8Ab {
  using Acc = int32_t;
  using Q = Int8Out;
};
struct Fp8Ab {
  using Acc = float;
  using Q = Fp8Out;
};

// --- device helpers ----------------------------------------------------------------------------------

// wait_for_producers (griddepcontrol.wait) and allow_dependent_launch: quant/rowwise_reduce.cuh.

// Asks L2 to fetch `bytes` (a multiple of 16) from global address `p` (16-byte aligned): one bulk prefetch, no
// registers, no completion to wait for (sm90's cp.async.bulk.prefetch.L2; nothing on older devices). A hint
// only: the kernel's own loads still read the data, from L2 when the prefetch got there first.
__device__ __forceinline__ void prefetch_l2(const void* p, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#endif
}

// 16 weight bytes, read once: not allocated in L1 (which keeps the activations), 256-byte L2 fetches.
__device__ __forceinline__ uint4 load_weights16(const uint8_t* p) {
  uint4 v;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
#else
  v = __ldg(reinterpret_cast<const uint4*>(p));
#endif
  return v;
}

// D = A * B + D for one m16n8k32 tile (fragments as in the file comment). (volatile keeps the front end from
// moving MMAs above the weight loads; ptxas may still reorder, which tie_to_weight_loads prevents.)
__device__ __forceinline__ void mma_16832(int32_t (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                          uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
  __trap();  // the host refuses int8 below compute capability 8.0
#endif
}

[[maybe_unused]] __device__ __forceinline__ void mma_16832(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                                           uint32_t a3, uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
  __trap();  // the host refuses float8_e4m3fn below compute capability 8.9
#endif
}

// sm90 has no fp8 mma.sync in hardware: ptxas expands mma.m16n8k32.e4m3 into 12 e4m3 -> f16 conversions, two
// m16n8k16 f16 HMMAs from zero and 4 FADDs into the accumulator (seen in the SASS), with the A conversions
// repeated for every token tile. The kernels do the same directly instead: each e4m3 pair is converted to an
// f16 pair once (cvt.rn.f16x2.e4m3x2, exact: every e4m3 value is an f16 value) and HMMAs accumulate into the
// float32 accumulator. m16n8k16 f16 fragments (PTX ISA, "mma.m16n8k16 with floating point type"): a0 = row g,
// k {2t, 2t+1}; a1 = row g + 8, same k; a2 = row g, k {2t+8, 2t+9}; a3 = row g + 8, same; b0 = token g,
// k {2t, 2t+1}; b1 = token g, k {2t+8, 2t+9}. Word i (bytes 4i..4i+3) of the thread's 16 bytes feeds MMA i:
// its low byte pair -> a0 / a1 / b0, its high pair -> a2 / a3 / b1: again the same permutation of k for the
// weights and the activations, depending on t only.
[[maybe_unused]] __device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t word, bool high) {
  uint32_t d = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  const uint16_t pair = static_cast<uint16_t>(high ? word >> 16 : word & 0xffffu);
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(d) : "h"(pair));
#endif
  return d;
}

[[maybe_unused]] __device__ __forceinline__ void mma_16816_f16(float (&d)[4], uint32_t a0, uint32_t a1,
                                                               uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
  __trap();
#endif
}

__device__ __forceinline__ float acc_to_float(int32_t v) { return __int2float_rn(v); }
__device__ __forceinline__ float acc_to_float(float v) { return v; }

// csrc/gemm/EPILOGUES.md: round_out(s_a * (s_b * float(acc)) + c), one multiply and one fused multiply-add in
// float32 (the CUTLASS epilogue's multiply_add with a zero bias when there is none).
template <class OutT, class Acc>
__device__ __forceinline__ OutT epilogue(Acc acc, float sa, float sb, float bias) {
  return from_float<OutT>(__fmaf_rn(sa, __fmul_rn(sb, acc_to_float(acc)), bias));
}

// Block scales: the accumulator is already scaled (mma_block_scaled); round_out(acc + c), one addition in float32.
template <class OutT>
__device__ __forceinline__ OutT epilogue_scaled(float acc, float bias) {
  return from_float<OutT>(__fadd_rn(acc, bias));
}

template <class OutT>
__device__ __forceinline__ float bias_term(const DecodeParams& p, int64_t ch) {
  return p.bias != nullptr ? to_float(static_cast<const OutT*>(p.bias)[ch]) : 0.f;
}

template <class OutT>
__device__ __forceinline__ void channel_terms(const DecodeParams& p, int64_t ch, float* sb, float* bias) {
  *sb = p.scale_b_per_channel ? p.scale_b[ch] : p.scale_b[0];
  *bias = bias_term<OutT>(p, ch);
}

// One block of one warp: the weight fragments of rows g and g + 8 and the activation fragments of token 8j + g
// for each of the 4 steps.
template <int NT>
struct BlockFrags {
  uint4 w[kSteps][2];
  uint4 x[kSteps][NT];
};

// Weights of block `blk`: `wg` points at byte 16t of row g. Past K the fragment is zero.
template <int NT>
__device__ __forceinline__ void load_block_weights(BlockFrags<NT>& f, const uint8_t* wg, int64_t ldw, int blk,
                                                   int t, int k) {
  const int base = blk * kBlockBytes;
#pragma unroll
  for (int u = 0; u < kSteps; ++u) {
    const int off = base + u * kStepBytes;
    if (off + 16 * t < k) {
      f.w[u][0] = load_weights16(wg + off);
      f.w[u][1] = load_weights16(wg + 8 * ldw + off);
    } else {
      f.w[u][0] = make_uint4(0, 0, 0, 0);
      f.w[u][1] = make_uint4(0, 0, 0, 0);
    }
  }
}

// Makes the block's first MMA depend on all 8 weight loads of the block (through `zero`, a kernel argument that
// is always 0 and that ptxas cannot fold), so that every weight load is issued before the first MMA. Without it
// ptxas sank the last step's loads below the first step's MMAs in the fp8 kernels (the MMAs wait for their data
// in order: a second memory round trip per block). Costs 4 logic instructions per block.
template <int NT>
__device__ __forceinline__ void tie_to_weight_loads(BlockFrags<NT>& f, uint32_t zero) {
  uint32_t d = zero;
#pragma unroll
  for (int u = 0; u < kSteps; ++u) d &= f.w[u][0].x & f.w[u][1].x;
  f.w[0][0].x |= d;
}

// Activations of block `blk` from global memory (scaled_mm_decode): token 8j + g, bytes [16t, +16) of each step.
template <int NT>
__device__ __forceinline__ void load_block_acts_global(BlockFrags<NT>& f, const uint8_t* a, int64_t lda, int m,
                                                       int blk, int g, int t, int k) {
  const int base = blk * kBlockBytes + 16 * t;
#pragma unroll
  for (int u = 0; u < kSteps; ++u) {
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const int token = 8 * j + g;
      const int kk = base + u * kStepBytes;
      f.x[u][j] = (token < m && kk < k) ? __ldg(reinterpret_cast<const uint4*>(a + token * lda + kk))
                                        : make_uint4(0, 0, 0, 0);
    }
  }
}

// Activations of step u of block `blk` from the shared-memory chunk that starts at K byte `c0` (linear_decode;
// one step at a time, so that only one step's activation fragments occupy registers).
template <int NT>
__device__ __forceinline__ void load_step_acts_shared(uint4 (&x)[NT], const uint8_t* q_s, int m, int blk, int u,
                                                      int c0, int g, int t, int k) {
  const int kk = blk * kBlockBytes + u * kStepBytes + 16 * t;
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const int token = 8 * j + g;
    x[j] = (token < m && kk < k)
               ? *reinterpret_cast<const uint4*>(q_s + token * kChunkPitch + (kk - c0))
               : make_uint4(0, 0, 0, 0);
  }
}

// The MMAs of one step, in a fixed order (token tile, then the step's MMAs in order), and of one block (steps in
// order): both ops run exactly this sequence. int8: two m16n8k32 per tile (file comment).
template <int NT>
__device__ __forceinline__ void mma_step(int32_t (&acc)[NT][4], const uint4 (&w)[2], const uint4 (&x)[NT]) {
  const uint4 wg = w[0], wg8 = w[1];
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    mma_16832(acc[j], wg.x, wg8.x, wg.y, wg8.y, x[j].x, x[j].y);
    mma_16832(acc[j], wg.z, wg8.z, wg.w, wg8.w, x[j].z, x[j].w);
  }
}

// e4m3: two m16n8k32 per tile on sm89 (native fp8 MMA); on sm90 four m16n8k16 f16 per tile after converting
// the weight words once for all tiles (see e4m3x2_to_f16x2).
template <int NT>
__device__ __forceinline__ void mma_step(float (&acc)[NT][4], const uint4 (&w)[2], const uint4 (&x)[NT]) {
  const uint4 wg = w[0], wg8 = w[1];
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const uint32_t rg[4] = {wg.x, wg.y, wg.z, wg.w}, rg8[4] = {wg8.x, wg8.y, wg8.z, wg8.w};
  uint32_t a[4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    a[i][0] = e4m3x2_to_f16x2(rg[i], false);
    a[i][1] = e4m3x2_to_f16x2(rg8[i], false);
    a[i][2] = e4m3x2_to_f16x2(rg[i], true);
    a[i][3] = e4m3x2_to_f16x2(rg8[i], true);
  }
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const uint32_t rx[4] = {x[j].x, x[j].y, x[j].z, x[j].w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      mma_16816_f16(acc[j], a[i][0], a[i][1], a[i][2], a[i][3], e4m3x2_to_f16x2(rx[i], false),
                    e4m3x2_to_f16x2(rx[i], true));
    }
  }
#else
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    mma_16832(acc[j], wg.x, wg8.x, wg.y, wg8.y, x[j].x, x[j].y);
    mma_16832(acc[j], wg.z, wg8.z, wg.w, wg8.w, x[j].z, x[j].w);
  }
#endif
}

template <class Acc, int NT>
__device__ __forceinline__ void mma_block(Acc (&acc)[NT][4], const BlockFrags<NT>& f) {
#pragma unroll
  for (int u = 0; u < kSteps; ++u) mma_step(acc, f.w[u], f.x[u]);
}

// The accumulators (C fragments) of NT token tiles, zeroed.
template <class Acc, int NT>
__device__ __forceinline__ void zero_acc(Acc (&acc)[NT][4]) {
#pragma unroll
  for (int j = 0; j < NT; ++j) {
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[j][i] = Acc(0);
  }
}

// One warp's share of a main loop that reads the activations from global memory (scaled_mm_decode's, and each
// grouped_decode chunk's): K blocks first, first + kWarps, ... below `end` of the 16 weight rows at `wg` (this
// thread's byte 16t of row g, pitch ldw) and the m activation rows at `a` (pitch lda), each block's weight loads
// tied before its MMAs, accumulated into acc.
template <class Acc, int NT>
__device__ __forceinline__ void mainloop_global(Acc (&acc)[NT][4], const uint8_t* wg, int64_t ldw, const uint8_t* a,
                                                int64_t lda, int m, int first, int end, int g, int t, int k,
                                                uint32_t zero) {
  BlockFrags<NT> f;
  for (int blk = first; blk < end; blk += kWarps) {
    load_block_weights(f, wg, ldw, blk, t, k);
    load_block_acts_global(f, a, lda, m, blk, g, t, k);
    tie_to_weight_loads(f, zero);
    mma_block(acc, f);
  }
}

// The warps' accumulators summed in warp order through shared memory `red`: store_warp_acc puts each warp's C
// fragments at red[warp][tile][lane]; after a barrier, warp_order_sum reads the sum of (row, token) over the warps,
// from lane 4 (row % 8) + (token % 8) / 2, register 2 (row / 8) + token % 2, of tile token / 8 (the C fragment
// layout).
template <class Acc, int NT, int kTiles>
__device__ __forceinline__ void store_warp_acc(Acc (&red)[kWarps][kTiles][32][4], const Acc (&acc)[NT][4], int warp,
                                               int lane) {
  using Acc4 = std::conditional_t<std::is_same_v<Acc, float>, float4, int4>;
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    *reinterpret_cast<Acc4*>(&red[warp][j][lane][0]) = Acc4{acc[j][0], acc[j][1], acc[j][2], acc[j][3]};
  }
}

template <class Acc, int kTiles>
__device__ __forceinline__ Acc warp_order_sum(const Acc (&red)[kWarps][kTiles][32][4], int row, int token) {
  const int j = token / 8, tt = token % 8;
  const int src = (row % 8) * 4 + tt / 2, reg = (row / 8) * 2 + tt % 2;
  Acc sum = red[0][j][src][reg];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) sum += red[w][j][src][reg];
  return sum;
}

// --- block scales (e4m3, scale_a [M, K/128], scale_b [ceil(N/128), K/128]) ---------------------------------------
//
// Block `blk` holds groups 2 blk (steps 0, 1) and 2 blk + 1 (steps 2, 3) of K. A thread's accumulators are
// tokens 8j + 2t (c0, c2) and 8j + 2t + 1 (c1, c3) of tile j, for rows g and g + 8 of the CTA, which all lie in
// weight-row block row0 / 128. So per group a thread needs scale_b[row0 / 128, kb] (one value for the whole CTA)
// and scale_a[token, kb] for its 2 NT tokens: s[h][j][e] = scale_a[8j + 2t + e, 2 blk + h] * scale_b[.., 2 blk + h],
// 0 for a token >= m or a group past K (whose weight fragments are zero anyway). Loaded with the block's other
// operands, before its MMAs.
template <int NT>
struct BlockScales {
  float s[kGroupsPerBlock][NT][2];
};

template <int NT>
__device__ __forceinline__ void load_block_scales(BlockScales<NT>& sc, const float* scale_a, const float* sb_row,
                                                  int kgroups, int m, int blk, int t) {
#pragma unroll
  for (int h = 0; h < kGroupsPerBlock; ++h) {
    const int kb = blk * kGroupsPerBlock + h;
    const bool in_k = kb < kgroups;
    const float sb = in_k ? __ldg(sb_row + kb) : 0.f;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int token = 8 * j + 2 * t + e;
        const float sa = in_k && token < m ? __ldg(scale_a + token * kgroups + kb) : 0.f;
        sc.s[h][j][e] = __fmul_rn(sa, sb);
      }
    }
  }
}

// As tie_to_weight_loads for the block's scales: without it ptxas issued the scale loads after the block's first
// MMA (which waits for the weights from HBM), and the first group's scaling then waited for a second, L2 round
// trip. The scales come from L1 / L2 before the weights arrive, so the tie costs no time; 2 NT logic instructions.
template <int NT>
__device__ __forceinline__ void tie_to_scale_loads(BlockFrags<NT>& f, const BlockScales<NT>& sc, uint32_t zero) {
  uint32_t d = zero;
#pragma unroll
  for (int h = 0; h < kGroupsPerBlock; ++h) {
#pragma unroll
    for (int j = 0; j < NT; ++j) d &= __float_as_uint(sc.s[h][j][0]) & __float_as_uint(sc.s[h][j][1]);
  }
  f.w[0][0].x |= d;
}

// The block's MMAs group by group: each group's 2 steps accumulate from zero in float32, and the partial dot
// products are added to the accumulators scaled by their token's s (acc = fma(part, s, acc)).
template <int NT>
__device__ __forceinline__ void mma_block_scaled(float (&acc)[NT][4], const BlockFrags<NT>& f,
                                                 const BlockScales<NT>& sc) {
  constexpr int kStepsPerGroup = kGroupBytes / kStepBytes;
#pragma unroll
  for (int h = 0; h < kGroupsPerBlock; ++h) {
    float part[NT][4];
    zero_acc(part);
#pragma unroll
    for (int u = h * kStepsPerGroup; u < (h + 1) * kStepsPerGroup; ++u) mma_step(part, f.w[u], f.x[u]);
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[j][i] = __fmaf_rn(part[j][i], sc.s[h][j][i % 2], acc[j][i]);
    }
  }
}

// mainloop_global with block scales (e4m3): each block's scales too (load_block_scales: `scale_a`'s m rows of
// kgroups = K / 128, `sb_row` the weight rows' 128-row block row), tied before its MMAs like the weights, and the MMAs
// group by group (mma_block_scaled).
template <int NT>
__device__ __forceinline__ void mainloop_global_scaled(float (&acc)[NT][4], const uint8_t* wg, int64_t ldw,
                                                       const uint8_t* a, int64_t lda, int m, const float* scale_a,
                                                       const float* sb_row, int kgroups, int first, int end, int g,
                                                       int t, int k, uint32_t zero) {
  BlockFrags<NT> f;
  BlockScales<NT> sc;
  for (int blk = first; blk < end; blk += kWarps) {
    load_block_weights(f, wg, ldw, blk, t, k);
    load_block_acts_global(f, a, lda, m, blk, g, t, k);
    load_block_scales(sc, scale_a, sb_row, kgroups, m, blk, t);
    tie_to_weight_loads(f, zero);
    tie_to_scale_loads(f, sc, zero);
    mma_block_scaled(acc, f, sc);
  }
}

}  // namespace
}  // namespace cutlass_w8a8
