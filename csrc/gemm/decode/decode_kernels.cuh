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
//                     128-wide K group kb: see "block scales" below and README.md, "Block scales".
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
// PDL: the kernels wait on griddepcontrol before their first access to memory another kernel writes (the main
// kernel first asks L2 to prefetch the start of its weight rows: weights are nobody's output) and signal
// launch_dependents once their loads are done; the host launches the main kernel with programmatic stream
// serialization when core/launch_policy.hpp's kernels_use_pdl says so (the PDL switch on, sm90 or newer).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "core/limits.hpp"
#include "quant/rowwise_reduce.cuh"  // to_float, from_float, Int8Out / Fp8Out, quantize_one, allow_dependent_launch

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
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int i = 0; i < 4; ++i) part[j][i] = 0.f;
    }
#pragma unroll
    for (int u = h * kStepsPerGroup; u < (h + 1) * kStepsPerGroup; ++u) mma_step(part, f.w[u], f.x[u]);
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[j][i] = __fmaf_rn(part[j][i], sc.s[h][j][i % 2], acc[j][i]);
    }
  }
}

// 8 consecutive activations (16 bytes) of a bf16 / fp16 row.
template <class XT>
struct alignas(16) XVec {
  XT v[8];
};

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

template <class Q>
__device__ __forceinline__ uint32_t quantize4(float x0, float x1, float x2, float x3, float scale) {
  const uint32_t q0 = static_cast<uint8_t>(quantize_one<Q>(x0, scale));
  const uint32_t q1 = static_cast<uint8_t>(quantize_one<Q>(x1, scale));
  const uint32_t q2 = static_cast<uint8_t>(quantize_one<Q>(x2, scale));
  const uint32_t q3 = static_cast<uint8_t>(quantize_one<Q>(x3, scale));
  return q0 | (q1 << 8) | (q2 << 16) | (q3 << 24);
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
        const float s = s_scale[r0 + i];
        const XVec<XT>& v = vals[i];
        uint2 q;
        q.x = quantize4<Q>(to_float(v.v[0]), to_float(v.v[1]), to_float(v.v[2]), to_float(v.v[3]), s);
        q.y = quantize4<Q>(to_float(v.v[4]), to_float(v.v[5]), to_float(v.v[6]), to_float(v.v[7]), s);
        *reinterpret_cast<uint2*>(q_s + (r0 + i) * kChunkPitch + col) = q;
      }
    }
  }
}

// --- the kernels -------------------------------------------------------------------------------------------

// AB: Int8Ab / Fp8Ab. OutT: __nv_bfloat16 / __half. NT: token tiles (m <= 8 NT). XT: void (scaled_mm_decode:
// `a` holds the quantized activations) or the type of x (linear_decode: quantized here; the output type is
// x's). kBlockScaled: e4m3 with block scales (scaled_mm_decode only; scale_a [M, K/128], scale_b
// [ceil(N/128), K/128], K a multiple of 128): each group's partial dot products are scaled into the float32
// accumulators (mma_block_scaled), and the epilogue adds only the bias. Grid (N / 16, splits), 256 threads.
template <class AB, class OutT, int NT, class XT, bool kBlockScaled = false>
__global__ void __launch_bounds__(kThreads, 2) decode_gemm_kernel(int64_t m64, DecodeParams p) {
  using Acc = typename AB::Acc;
  constexpr bool kFused = !std::is_void_v<XT>;
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
#pragma unroll
  for (int j = 0; j < NT; ++j) {
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[j][i] = Acc(0);
  }
  BlockFrags<NT> f;

  if constexpr (kBlockScaled) {
    const uint8_t* a = static_cast<const uint8_t*>(p.a);
    const int kgroups = p.k / kGroupBytes;  // K / 128: the row length of both scale matrices
    const float* sb_row = p.scale_b + (row0 / kGroupBytes) * kgroups;
    BlockScales<NT> sc;
    for (int blk = bs + warp; blk < be; blk += kWarps) {
      load_block_weights(f, wg, p.ldw, blk, t, p.k);
      load_block_acts_global(f, a, p.lda, m, blk, g, t, p.k);
      load_block_scales(sc, p.scale_a, sb_row, kgroups, m, blk, t);
      tie_to_weight_loads(f, p.zero);
      tie_to_scale_loads(f, sc, p.zero);
      mma_block_scaled(acc, f, sc);
    }
  } else if constexpr (!kFused) {
    const uint8_t* a = static_cast<const uint8_t*>(p.a);
    for (int blk = bs + warp; blk < be; blk += kWarps) {
      load_block_weights(f, wg, p.ldw, blk, t, p.k);
      load_block_acts_global(f, a, p.lda, m, blk, g, t, p.k);
      tie_to_weight_loads(f, p.zero);
      mma_block(acc, f);
    }
  } else {
    const XT* x = static_cast<const XT*>(p.a);
    // Chunk c holds blocks [bs + 8c, bs + 8c + 8): warp w takes block bs + 8c + w, as in the unfused loop.
    const int nchunks = (be - bs + kWarps - 1) / kWarps;
    row_scales<XT, typename AB::Q, NT>(x, p.lda, m, p.k, s_amax, s_scale);
    int blk = bs + warp;
    for (int c = 0; c < nchunks; ++c, blk += kWarps) {
      const int c0 = (bs + c * kWarps) * kBlockBytes;
      const int c1 = min(min(c0 + kChunkBytes, be * kBlockBytes), p.k);
      if (c > 0) __syncthreads();  // every warp has read the previous chunk before it is overwritten
      quantize_chunk<XT, typename AB::Q, NT>(x, p.lda, m, c0, c1, s_scale, &q_s[0][0]);
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
  using Acc4 = std::conditional_t<std::is_same_v<Acc, float>, float4, int4>;
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    *reinterpret_cast<Acc4*>(&red[warp][j][lane][0]) = Acc4{acc[j][0], acc[j][1], acc[j][2], acc[j][3]};
  }
  __syncthreads();
  const int row = threadIdx.x % kRows, token = threadIdx.x / kRows;
  if (token < m && token < 8 * NT) {
    // The accumulator of (row, token) sits in lane 4 (row % 8) + (token % 8) / 2, register
    // 2 (row / 8) + token % 2, of tile token / 8 (the C fragment layout).
    const int j = token / 8, tt = token % 8;
    const int src = (row % 8) * 4 + tt / 2, reg = (row / 8) * 2 + tt % 2;
    Acc sum = red[0][j][src][reg];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) sum += red[w][j][src][reg];
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
