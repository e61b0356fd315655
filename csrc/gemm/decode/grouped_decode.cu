// The decode-size grouped GEMM of grouped_scaled_mm (issue 27): mixture-of-experts layers at few rows per expert.
// Interface: grouped_decode.hpp; reasoning: README.md, "Grouped decode GEMM".
//
// For each expert e with rows [c[e - 1], c[e]) of A (c: the clamped offsets, below),
//   row-wise:  D[t, n] = round(s_a(t) * (s_b(e, n) * float(acc[t, n])) + bias[e, n]),  acc = A[t, :] . W_e[n, :]
//   block fp8: D[t, n] = round(sum_kb s_a[t, kb] * s_b[e, n / 128, kb] * acc_kb[t, n] + bias[e, n])
// with the dense decode GEMM's pieces (decode_mma.cuh): a CTA of 8 warps owns 16 weight rows (channels) of one
// expert and walks K in 256-byte blocks (block b to warp b % 8), loading its 8 weight fragments per block with
// ld.global.nc.L1::no_allocate, the activations of up to 16 of the expert's rows with cached loads, and running the
// same tensor-core steps (int8 m16n8k32; e4m3 as f16 m16n8k16 on sm90, m16n8k32 e4m3 on sm89), the same block-scale
// steps and the same float32 epilogue. So one expert's rows get what scaled_mm_decode would give them bit for bit
// (the dense kernel without a split of K: same block-to-warp order, same warp-order reduction).
//
// Grid: (N / 16 row tiles, S slots), S = min(E, T). Only experts with rows ("active") need work, and there are at
// most min(E, T) of them, but which ones is device data (no host sync). So a CTA of slot s first finds the s-th
// active expert itself: all 256 threads read the offsets (E int32, from L2), clamp them, and two block scans (a
// running max, then a count of the experts whose range is not empty) give the s-th active expert and its rows.
// Slots past the number of active experts return. A grid over (tiles, E) instead would launch E / active times
// more CTAs, each waiting for an offsets load before exiting: at E = 128 and T = 1 that is 128 x 96 CTAs for 96
// busy ones, tens of microseconds of empty CTAs against a few microseconds of weight stream. With slots, an
// inactive expert's weight, scales and bias are never read.
//
// Rows: an expert's rows go in chunks of 16 (two 8-token tiles); a chunk of at most 8 rows runs the one-tile
// steps (NT = 1: half the MMAs and activation loads), else two tiles. At T <= 8 a one-tile-only kernel runs
// (fewer registers: three CTAs per SM instead of two). A second chunk (an expert with more than 16
// rows, possible only at T > 16) streams the CTA's [16, K] weight slice again; it was read microseconds before, so
// it mostly comes from L2 (README.md: "Grouped decode GEMM").
//
// Offsets clamp (kernel_api.h's contract: bad offsets must not make the kernel read or write out of bounds):
// c[-1] = 0, c[e] = min(T, max(c[e - 1], offsets[e])), i.e. the running max of the offsets clamped into [0, T].
// For valid offsets (non-decreasing, within [0, T]) c = offsets.
//
// PDL: the kernel waits on griddepcontrol before its first global read (the offsets are the routing kernel's
// output; the expert, hence which weights, is unknown before them, so unlike the dense kernel there is no L2
// prefetch of the weights before the wait) and signals launch_dependents once a chunk's loads are done, as the
// dense decode kernel does; the host launches it with programmatic stream serialization when args.pdl is set.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>

#include "core/launch.hpp"
#include "core/limits.hpp"
#include "gemm/decode/decode_host.cuh"  // set_decode_operands, with_decode_types: the dense decode GEMM's host code
#include "gemm/decode/decode_mma.cuh"  // shape constants, BlockFrags, loads, MMA steps, epilogue, block scales
#include "gemm/decode/grouped_decode.hpp"
#include "quant/rowwise_reduce.cuh"  // wait_for_producers, allow_dependent_launch, to_float, from_float

namespace cutlass_w8a8 {
namespace {

// The largest T served (grouped_decode_max_rows). 64 rather than 16: a decode step at batch 8 with top-8 routing
// has 64 rows. With many experts (Qwen3-30B-A3B: E = 128) they land on ~50 experts of ~1.3 rows each, the regime
// this kernel is for (each active expert's weight streamed once, one-tile MMAs), while a CUTLASS grouped tile of
// 64 or 128 rows per expert would hold one or two real rows, plus the ptr-array setup kernel. With few experts
// (Mixtral: E = 8, top-2, 64 rows = 32 tokens) an expert holds ~16 rows, one or two chunks. The cost above 16 rows:
// an expert with r rows streams its weight ceil(r / 16) times, the later passes mostly from L2, and each CTA reads
// its expert's rows of A (T x K bytes at most, from L2 / L1). Worst case, all 64 rows on one expert: 4 passes,
// about what the dense decode GEMM at M = 64 would cost in 4 calls. Beyond 64 rows the per-expert row counts of
// real routings grow past a tile, and the CUTLASS kernel's reuse of each weight tile across 64-128 rows wins.
// bench/bench_moe.py measures both sides; lower this if it shows the CUTLASS path ahead at 17..64.
constexpr int64_t kGroupedDecodeMaxRows = 64;
static_assert(2 * 8 <= kMaxTokens, "a chunk (two 8-token tiles) is at most the dense decode kernel's token tiles");

struct GroupedParams {
  const uint8_t* a;          // [T, K] int8 / e4m3, row stride lda (0 when T == 1)
  int64_t lda;
  const uint8_t* w;          // expert e's [N, K] weight at w + e * stride_b_e, row stride ldw (bytes = elements)
  int64_t ldw;
  int64_t stride_b_e;
  const float* scale_a;      // [T] or [1]; block: [T, K/128]
  const float* scale_b;      // [E, N] or [E]; block: [E, ceil(N/128), K/128]
  const void* bias;          // [E, N] output type, or nullptr
  void* out;                 // [T, N] output type, row stride ldo (0 when T == 1)
  int64_t ldo;
  const int32_t* offsets;    // [E] end row of each expert (device data, clamped)
  int64_t n;
  int k;                     // <= limits::kDecodeMaxK (32-bit K byte offsets, as the dense kernel)
  int t;                     // rows of A, <= kGroupedDecodeMaxRows
  int num_experts;
  int scale_a_per_token;     // row-wise only
  int scale_b_per_channel;   // row-wise only
  uint32_t zero;             // always 0 (tie_to_weight_loads)
};

// --- finding the slot's expert -----------------------------------------------------------------------------------

struct IntMax {
  __device__ int operator()(int x, int y) const { return max(x, y); }
};
struct IntSum {
  __device__ int operator()(int x, int y) const { return x + y; }
};

// Block-wide inclusive scan of v over the 256 threads in thread order (op: max or sum, identity 0 for the values
// used here, which are >= 0). Returns the inclusive value; *excl gets the exclusive one (0 for thread 0), *total the
// block's. All threads must call it; it synchronizes, and s_warp can be reused after it returns.
template <class Op>
__device__ __forceinline__ int block_scan(int v, int (&s_warp)[kWarps], Op op, int* excl, int* total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int o = __shfl_up_sync(0xffffffffu, v, off);
    if (lane >= off) v = op(v, o);
  }
  int up = __shfl_up_sync(0xffffffffu, v, 1);  // the previous lane's inclusive value within the warp
  if (lane == 31) s_warp[warp] = v;
  __syncthreads();
  int before = 0, all = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    if (w < warp) before = op(before, s_warp[w]);
    all = op(all, s_warp[w]);
  }
  __syncthreads();
  *excl = lane == 0 ? before : op(before, up);
  *total = all;
  return op(before, v);
}

struct ExpertRows {
  int expert;  // -1: the slot has no active expert
  int start, end;
};

// The slot-th expert (in expert order) whose clamped row range [c[e - 1], c[e]) is not empty. All threads call it
// and get the same answer.
__device__ __forceinline__ ExpertRows find_slot_expert(const GroupedParams& p, int slot, int (&s_warp)[kWarps],
                                                       int (&s_found)[3]) {
  if (threadIdx.x == 0) s_found[0] = -1;  // published by the scans' barriers below
  int carry_end = 0;  // c[base - 1]
  int carry_cnt = 0;  // active experts before base
  for (int base = 0; base < p.num_experts; base += kThreads) {
    const int e = base + static_cast<int>(threadIdx.x);
    const int v = e < p.num_experts ? min(max(p.offsets[e], 0), p.t) : 0;
    int excl, total;
    const int incl = block_scan(v, s_warp, IntMax{}, &excl, &total);
    const int c = max(incl, carry_end), prev = max(excl, carry_end);
    const int active = e < p.num_experts && c > prev ? 1 : 0;
    int cexcl, ctotal;
    block_scan(active, s_warp, IntSum{}, &cexcl, &ctotal);
    if (active && carry_cnt + cexcl == slot) {
      s_found[0] = e;
      s_found[1] = prev;
      s_found[2] = c;
    }
    carry_end = max(carry_end, total);
    carry_cnt += ctotal;
    if (carry_cnt > slot) break;  // found (the same decision in every thread: block-wide values)
  }
  __syncthreads();
  return ExpertRows{s_found[0], s_found[1], s_found[2]};
}

// --- one chunk of an expert's rows -------------------------------------------------------------------------------

// D[r0 .. r0 + m) x [row0, row0 + 16) of expert e, m <= 8 NT: the dense decode kernel's main loop (no split of K)
// over the expert's weight rows and the chunk's activation rows, its warp-order reduction through `red` and its
// epilogue with the expert's scale_b / bias. All threads call it; it synchronizes.
template <class AB, class OutT, int NT, bool kBlockScaled>
__device__ __forceinline__ void grouped_chunk(const GroupedParams& p, int e, int r0, int m, int64_t row0,
                                              typename AB::Acc (&red)[kWarps][2][32][4]) {
  using Acc = typename AB::Acc;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const uint8_t* wg = p.w + e * p.stride_b_e + (row0 + g) * p.ldw + 16 * t;
  const uint8_t* a = p.a + r0 * p.lda;
  const int nblk = (p.k + kBlockBytes - 1) / kBlockBytes;

  Acc acc[NT][4];
  zero_acc(acc);
  if constexpr (kBlockScaled) {
    const int kgroups = p.k / kGroupBytes;  // K / 128
    const int64_t nb = (p.n + kGroupBytes - 1) / kGroupBytes;
    const float* sb_row = p.scale_b + (e * nb + row0 / kGroupBytes) * kgroups;
    const float* sa = p.scale_a + static_cast<int64_t>(r0) * kgroups;
    mainloop_global_scaled(acc, wg, p.ldw, a, p.lda, m, sa, sb_row, kgroups, warp, nblk, g, t, p.k, p.zero);
  } else {
    mainloop_global(acc, wg, p.ldw, a, p.lda, m, warp, nblk, g, t, p.k, p.zero);
  }
  allow_dependent_launch();  // this chunk's loads are done (idempotent: later chunks signal again)

  // Sum the 8 warps' accumulators in warp order, as decode_gemm_kernel.
  store_warp_acc(red, acc, warp, lane);
  __syncthreads();
  const int row = threadIdx.x % kRows, token = threadIdx.x / kRows;  // 256 threads: 16 rows x 16 tokens
  if (token < m) {
    const Acc sum = warp_order_sum(red, row, token);
    const int64_t ch = row0 + row;
    const int64_t ech = e * p.n + ch;  // index into [E, N]
    const float bias = p.bias != nullptr ? to_float(static_cast<const OutT*>(p.bias)[ech]) : 0.f;
    OutT* dst = static_cast<OutT*>(p.out) + (r0 + token) * p.ldo + ch;
    if constexpr (kBlockScaled) {
      *dst = epilogue_scaled<OutT>(sum, bias);
    } else {
      const float sa = p.scale_a_per_token ? p.scale_a[r0 + token] : p.scale_a[0];
      const float sb = p.scale_b_per_channel ? p.scale_b[ech] : p.scale_b[e];
      *dst = epilogue<OutT>(sum, sa, sb, bias);
    }
  }
  __syncthreads();  // `red` is read before the next chunk overwrites it
}

// Grid (N / 16, min(E, T)), 256 threads. kMaxNT = 2 (T > 8): chunks of 16 rows, each run with one token tile when
// it holds at most 8 rows, else two; the two-tile code sets the register count (<= 128: two CTAs per SM, as the
// dense decode kernel). kMaxNT = 1 (T <= 8, so no expert has more than 8 rows): the one-tile code only, whose
// smaller register count lets three CTAs share an SM (row-wise scales; launch bounds 3), so that one CTA's expert
// search (an L2 round trip for the offsets, with no weight load in flight) overlaps two others' weight streams.
//
// CTAs per SM the one-tile row-wise kernels are compiled for (ptxas then keeps them within 80 registers; nvcc 13.0,
// sm_90a: int8 80 registers and no spill, e4m3 80 and an 8-byte spill: one LDL.64 per 256-byte K block, from L1).
// The block-scaled one-tile kernel stays at two (at three it spilled 40 bytes, two local stores per K block).
// An A/B knob for the first GPU run (README.md, "Grouped decode GEMM").
constexpr int kOneTileCtasPerSm = 3;

template <class AB, class OutT, int kMaxNT, bool kBlockScaled>
__global__ void __launch_bounds__(kThreads, kMaxNT == 1 && !kBlockScaled ? kOneTileCtasPerSm : 2)
    grouped_decode_kernel(GroupedParams p) {
  static_assert(!kBlockScaled || std::is_same_v<AB, Fp8Ab>, "block scales: e4m3 only");
  static_assert(kMaxNT == 1 || kMaxNT == 2, "one or two token tiles");
  using Acc = typename AB::Acc;
  constexpr int kRowsPerChunk = 8 * kMaxNT;
  __shared__ alignas(16) Acc red[kWarps][2][32][4];
  __shared__ int s_warp[kWarps];
  __shared__ int s_found[3];

  wait_for_producers();  // the offsets, A and the scales may be outputs of the kernels before (PDL)
  const ExpertRows er = find_slot_expert(p, static_cast<int>(blockIdx.y), s_warp, s_found);
  if (er.expert < 0) return;  // fewer active experts than slots: never touches a weight
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kRows;
  if constexpr (kMaxNT == 1) {
    // T <= 8: the clamped rows of one expert are at most T, one chunk (no loop: fewer live registers).
    grouped_chunk<AB, OutT, 1, kBlockScaled>(p, er.expert, er.start, min(er.end - er.start, 8), row0, red);
  } else {
    for (int r0 = er.start; r0 < er.end; r0 += kRowsPerChunk) {
      const int m = min(kRowsPerChunk, er.end - r0);
      if (m <= 8) {
        grouped_chunk<AB, OutT, 1, kBlockScaled>(p, er.expert, r0, m, row0, red);
      } else {
        grouped_chunk<AB, OutT, 2, kBlockScaled>(p, er.expert, r0, m, row0, red);
      }
    }
  }
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

template <class AB, class OutT, bool kBlockScaled>
void launch_typed(const GroupedParams& p, dim3 grid, cudaStream_t stream, bool pdl) {
  if (p.t <= 8) {
    C10_CUDA_CHECK(
        launch_kernel(grouped_decode_kernel<AB, OutT, 1, kBlockScaled>, grid, dim3(kThreads), 0, stream, pdl, p));
  } else {
    C10_CUDA_CHECK(
        launch_kernel(grouped_decode_kernel<AB, OutT, 2, kBlockScaled>, grid, dim3(kThreads), 0, stream, pdl, p));
  }
}

}  // namespace

int64_t grouped_decode_max_rows() { return kGroupedDecodeMaxRows; }

void launch_grouped_decode(const cw8a8_grouped_mm_args& args) {
  constexpr const char* who = "cutlass_w8a8 grouped decode GEMM: ";
  // The caller's checks (grouped_mm_entry.cu) make all of these hold; they guard the kernel's assumptions.
  TORCH_CHECK(args.t >= 1 && args.t <= kGroupedDecodeMaxRows, who, "T = ", args.t, " is outside [1, ",
              kGroupedDecodeMaxRows, "]");
  TORCH_CHECK(args.num_experts >= 1 && args.num_experts <= INT32_MAX, who, "bad expert count ", args.num_experts);
  TORCH_CHECK(args.n >= kRows && args.n % kRows == 0 && args.n / kRows <= INT32_MAX, who,
              "N must be a positive multiple of 16, got ", args.n);
  TORCH_CHECK(args.k >= 16 && args.k % 16 == 0 && args.k <= limits::kDecodeMaxK, who,
              "K must be a multiple of 16 in [16, 2**30], got ", args.k);
  TORCH_CHECK(args.ab_type == CW8A8_AB_INT8 || args.ab_type == CW8A8_AB_FP8_E4M3, who, "bad operand type");
  TORCH_CHECK(args.out_type == CW8A8_OUT_BF16 || args.out_type == CW8A8_OUT_F16, who, "bad output type");
  TORCH_CHECK(!args.scale_block || (args.ab_type == CW8A8_AB_FP8_E4M3 && args.k % limits::kBlockSize == 0), who,
              "block scales need e4m3 operands and K a multiple of 128");
  TORCH_CHECK(aligned16(args.a) && aligned16(args.b) && (args.t <= 1 || args.lda % 16 == 0) &&
                  args.ldb % 16 == 0 && args.ldb >= args.k && args.stride_b_e % 16 == 0,
              who, "operands must be 16-byte aligned with strides that are multiples of 16 (lda = ", args.lda,
              ", ldb = ", args.ldb, ", stride_b_e = ", args.stride_b_e, ")");
  TORCH_CHECK(args.a != nullptr && args.b != nullptr && args.d != nullptr && args.scale_a != nullptr &&
                  args.scale_b != nullptr && args.offsets != nullptr,
              who, "null operand");

  GroupedParams p{};
  set_decode_operands(p, args, args.t);  // decode_host.cuh, as the dense decode GEMM's
  p.stride_b_e = args.stride_b_e;
  p.offsets = args.offsets;
  p.t = static_cast<int>(args.t);
  p.num_experts = static_cast<int>(args.num_experts);
  p.zero = 0;

  const int64_t slots = std::min<int64_t>(args.num_experts, args.t);  // at most min(E, T) experts have rows
  const dim3 grid(static_cast<unsigned>(args.n / kRows), static_cast<unsigned>(slots));
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(args.device));
  const bool pdl = args.pdl != 0;
  with_decode_types(args.ab_type == CW8A8_AB_INT8, args.out_type == CW8A8_OUT_BF16, [&](auto ab_tag, auto out_tag) {
    using AB = decltype(ab_tag);
    using OutT = decltype(out_tag);
    if constexpr (std::is_same_v<AB, Fp8Ab>) {
      if (args.scale_block) {
        launch_typed<AB, OutT, true>(p, grid, args.stream, pdl);
        return;
      }
    }
    launch_typed<AB, OutT, false>(p, grid, args.stream, pdl);
  });
}

}  // namespace cutlass_w8a8
