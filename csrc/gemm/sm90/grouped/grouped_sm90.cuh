// The sm90 grouped (mixture-of-experts) GEMM: CUTLASS's ptr-array grouped kernels
// (KernelPtrArrayTmaWarpSpecialized{Cooperative,Pingpong}[FP8FastAccum | FP8Blockwise], GroupProblemShape) with the
// per-group problem sizes, operand pointers, strides and scale pointers built on the device, so that nothing about
// the routing is read on the host (no synchronisation; the launch captures into a CUDA graph whatever the routing).
//
// One call (cw8a8_grouped_mm_args, gemm/kernel_api.h):
//   1. one allocation from the caller's allocator: the per-group arrays below, then CUTLASS's workspace (the
//      per-SM TMA descriptors the kernel rewrites when it moves to another group);
//   2. grouped_setup_kernel on args.stream (one CTA): reads `offsets`, clamps them to a non-decreasing sequence
//      within [0, T] (a running maximum, then min T), and writes for each expert e with rows [start, end):
//      problem size, A / B / D pointers and strides, the scale and bias pointers (and the block-scale layouts);
//   3. the CUTLASS kernel, its grid sized by the SM count (the host problem sizes are null, so the persistent group
//      tile scheduler walks the device problem sizes; a group with no rows has no tiles and is skipped).
// Both are launched without programmatic dependent launch: the group tile scheduler reads the problem sizes before
// any griddepcontrol wait, so the GEMM must not start before the setup kernel has finished.
//
// Epilogues (the kernel's own frame; swapped configs have the weight's N as rows and the tokens as columns):
//   row-wise: D = scale_tok * (scale_ch * float(acc)) + bias, rounded once, the dense kernels' ScaleEpilogue
//     (scaled_mm_sm90_epilogue.cuh) with the broadcasts in their array-of-pointers form (Sm90ColBroadcast /
//     Sm90RowBroadcast with a float* element: one pointer per group) and a run-time bool stride choosing vector or
//     scalar: per-token scale_a (pointer scale_a + start, vector) or per-tensor (scale_a, scalar); per-channel
//     scale_b (scale_b + e * N, vector) or per-expert (scale_b + e, scalar); bias (bias + e * N, vector) or no bias
//     (a null array: zero).
//   block fp8: example 68's mainloop with per-group scale pointers and layouts (scale_a + start * KB with M = rows of
//     the group; scale_b + e * NB * KB), D = acc + bias.
#pragma once

#include <cstdint>
#include <cstdio>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/numeric_types.h>
#include <cutlass/gemm/group_array_problem_shape.hpp>

#include "gemm/sm90/grouped/grouped_sm90_config.cuh"
#include "gemm/sm90/scaled_mm_sm90_gemm.cuh"  // GemmTypes: the dense kernels' mainloops, epilogues and scales
#include "gemm/sm90/scaled_mm_sm90_launch.cuh"  // GemmLauncher::ensure_smem_attribute, detail::fail, the GDC guard

namespace cutlass_w8a8::sm90::grouped {

namespace detail {

constexpr size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

}  // namespace detail

// The grouped kernels' CUTLASS types (scaled_mm_sm90_gemm.cuh): the dense kernels' mainloops and epilogues in their
// ptr-array form (one pointer and stride per group; the block scales' layouts per group too), over the device's
// group problem sizes.
template <class ElementAB, class ElementD, class Cfg, bool kBlock>
using GroupedMmTypes = GemmTypes<ElementAB, ElementD, Cfg, kBlock, /*kPtrArray=*/true,
                                 cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>>;

template <class ElementAB_, class ElementD_, class Cfg, bool kBlock>
struct GroupedMmKernel : GroupedMmTypes<ElementAB_, ElementD_, Cfg, kBlock> {
  using Types = GroupedMmTypes<ElementAB_, ElementD_, Cfg, kBlock>;
  using typename Types::ElementAB, typename Types::ElementD, typename Types::Epilogue, typename Types::EpilogueEVT;
  using typename Types::CollectiveMainloop, typename Types::Gemm, typename Types::ScaleConfig;
  using typename Types::LayoutSFA, typename Types::LayoutSFB;
  using typename Types::StrideA, typename Types::StrideB, typename Types::StrideD;
  using Types::kSwapAB;
  using UnderlyingProblemShape = typename Types::ProblemShape::UnderlyingProblemShape;
  static constexpr int kScaleBlock = Types::Scales::kBlock;
  static_assert(cute::is_same_v<StrideA, typename Types::GemmKernel::InternalStrideA>, "one group's stride");

  // The per-group arrays, in the workspace (each segment 128-byte aligned).
  struct Arrays {
    UnderlyingProblemShape* problem;
    const ElementAB** ptr_a;
    const ElementAB** ptr_b;
    ElementD** ptr_d;
    StrideA* stride_a;
    StrideB* stride_b;
    StrideD* stride_d;
    const float** scale_row;  // ScaleTokens' pointers unswapped... see write_group: the kernel rows' broadcast
    const float** scale_col;  // the kernel columns' broadcast
    const ElementD** bias;
    const float** sfa;        // block: the kernel rows' scale factors
    const float** sfb;        // block: the kernel columns' scale factors
    LayoutSFA* layout_sfa;
    LayoutSFB* layout_sfb;
  };

  // Bytes of the arrays for `e` groups, and their placement at `base` (128-byte aligned).
  static size_t arrays_bytes(int64_t e, Arrays* out, char* base) {
    size_t off = 0;
    auto take = [&](auto*& p, size_t elem_bytes) {
      using P = std::remove_reference_t<decltype(p)>;
      if (out != nullptr) p = reinterpret_cast<P>(base + off);
      off = detail::align_up(off + elem_bytes * static_cast<size_t>(e), 128);
    };
    Arrays tmp{};
    Arrays& a = out != nullptr ? *out : tmp;
    take(a.problem, sizeof(UnderlyingProblemShape));
    take(a.ptr_a, sizeof(void*));
    take(a.ptr_b, sizeof(void*));
    take(a.ptr_d, sizeof(void*));
    take(a.stride_a, sizeof(StrideA));
    take(a.stride_b, sizeof(StrideB));
    take(a.stride_d, sizeof(StrideD));
    take(a.scale_row, sizeof(void*));
    take(a.scale_col, sizeof(void*));
    take(a.bias, sizeof(void*));
    if constexpr (kBlock) {
      take(a.sfa, sizeof(void*));
      take(a.sfb, sizeof(void*));
      take(a.layout_sfa, sizeof(LayoutSFA));
      take(a.layout_sfb, sizeof(LayoutSFB));
    }
    return off;
  }

  // Expert e's rows [start, end) of A and D.
  CUTLASS_DEVICE static void write_group(const cw8a8_grouped_mm_args& p, const Arrays& arr, int64_t e,
                                         int64_t start, int64_t end) {
    const int rows = static_cast<int>(end - start);
    const int n = static_cast<int>(p.n);
    const int k = static_cast<int>(p.k);
    const ElementAB* act = static_cast<const ElementAB*>(p.a) + start * p.lda;
    const ElementAB* wgt = static_cast<const ElementAB*>(p.b) + e * p.stride_b_e;
    ElementD* out = static_cast<ElementD*>(p.d) + start * p.ldd;
    const float* tok_scale = nullptr;
    const float* ch_scale = nullptr;
    if constexpr (kBlock) {
      const int64_t kb = p.k / kScaleBlock;
      const int64_t nb = (p.n + kScaleBlock - 1) / kScaleBlock;
      tok_scale = p.scale_a + start * kb;
      ch_scale = p.scale_b + e * nb * kb;
    } else {
      tok_scale = p.scale_a_per_token ? p.scale_a + start : p.scale_a;
      ch_scale = p.scale_b_per_channel ? p.scale_b + e * p.n : p.scale_b + e;
    }
    StrideA sa{};
    StrideB sb{};
    StrideD sd{};
    if constexpr (kSwapAB) {
      arr.problem[e] = UnderlyingProblemShape{n, rows, k};
      arr.ptr_a[e] = wgt;
      arr.ptr_b[e] = act;
      cute::get<0>(sa) = p.ldb;
      cute::get<0>(sb) = p.lda;
      cute::get<1>(sd) = p.ldd;  // column-major in the kernel's frame: D^T
      arr.scale_row[e] = ch_scale;
      arr.scale_col[e] = tok_scale;
    } else {
      arr.problem[e] = UnderlyingProblemShape{rows, n, k};
      arr.ptr_a[e] = act;
      arr.ptr_b[e] = wgt;
      cute::get<0>(sa) = p.lda;
      cute::get<0>(sb) = p.ldb;
      cute::get<0>(sd) = p.ldd;
      arr.scale_row[e] = tok_scale;
      arr.scale_col[e] = ch_scale;
    }
    arr.ptr_d[e] = out;
    arr.stride_a[e] = sa;
    arr.stride_b[e] = sb;
    arr.stride_d[e] = sd;
    arr.bias[e] = p.bias != nullptr ? static_cast<const ElementD*>(p.bias) + e * p.n : nullptr;
    if constexpr (kBlock) {
      arr.sfa[e] = arr.scale_row[e];
      arr.sfb[e] = arr.scale_col[e];
      const auto shape = kSwapAB ? cute::make_shape(n, rows, k, 1) : cute::make_shape(rows, n, k, 1);
      arr.layout_sfa[e] = ScaleConfig::tile_atom_to_shape_SFA(shape);
      arr.layout_sfb[e] = ScaleConfig::tile_atom_to_shape_SFB(shape);
    }
  }

  static typename Gemm::Arguments make_arguments(const cw8a8_grouped_mm_args& p, const Arrays& arr) {
    const ElementD* const* bias = p.bias != nullptr ? arr.bias : nullptr;
    typename EpilogueEVT::Arguments evt_args{};
    typename CollectiveMainloop::Arguments mainloop_args{};
    if constexpr (kBlock) {
      evt_args = Epilogue::block_args(bias);
      mainloop_args = {arr.ptr_a, arr.stride_a, arr.ptr_b, arr.stride_b, arr.sfa, arr.layout_sfa, arr.sfb,
                       arr.layout_sfb};
    } else {
      // The arrays hold the kernel rows' and columns' pointers (write_group): the tokens' scales are the rows'
      // unswapped, the columns' swapped.
      evt_args = Epilogue::rowwise_args(kSwapAB ? arr.scale_col : arr.scale_row, p.scale_a_per_token,
                                        kSwapAB ? arr.scale_row : arr.scale_col, p.scale_b_per_channel, bias);
      mainloop_args = {arr.ptr_a, arr.stride_a, arr.ptr_b, arr.stride_b};
    }
    typename Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGrouped,
        {static_cast<int>(p.num_experts), arr.problem, nullptr},
        mainloop_args,
        {evt_args, nullptr, nullptr, arr.ptr_d, arr.stride_d},
    };
    args.hw_info.device_id = p.device;
    args.hw_info.sm_count = p.sm_count;
    return args;
  }
};

constexpr int kSetupThreads = 1024;

// One CTA of kSetupThreads: the clamped offsets by a running maximum (chunks of kSetupThreads experts, a
// Hillis-Steele scan in shared memory each), then each thread writes its expert's group.
template <class K>
__global__ void __launch_bounds__(kSetupThreads)
    grouped_setup_kernel(const cw8a8_grouped_mm_args p, typename K::Arrays arr) {
  __shared__ int64_t scan[kSetupThreads];
  const int tid = static_cast<int>(threadIdx.x);
  int64_t carry = 0;  // the clamped end of the last expert of the previous chunks
  for (int64_t base = 0; base < p.num_experts; base += kSetupThreads) {
    const int64_t e = base + tid;
    int64_t v = 0;
    if (e < p.num_experts) {
      const int64_t o = static_cast<int64_t>(p.offsets[e]);
      v = o < 0 ? 0 : (o > p.t ? p.t : o);
    }
    scan[tid] = v;
    __syncthreads();
    for (int s = 1; s < kSetupThreads; s <<= 1) {
      const int64_t x = tid >= s ? scan[tid - s] : int64_t{0};
      __syncthreads();
      if (x > scan[tid]) scan[tid] = x;
      __syncthreads();
    }
    const int64_t end = scan[tid] > carry ? scan[tid] : carry;
    const int64_t prev = tid == 0 ? carry : scan[tid - 1];
    const int64_t start = prev > carry ? prev : carry;
    const int64_t last = scan[kSetupThreads - 1];
    __syncthreads();
    if (e < p.num_experts) K::write_group(p, arr, e, start, end);
    if (last > carry) carry = last;
  }
}

template <class K>
int run_grouped(const cw8a8_grouped_mm_args& p, cw8a8_alloc_fn alloc, void* alloc_ctx, char* err, size_t err_len) {
  using Gemm = typename K::Gemm;
  using GemmKernel = typename K::GemmKernel;
  if (p.t == 0 || p.num_experts == 0) return 0;

  // Sizes first (no pointers yet): the arrays, then CUTLASS's workspace, from one allocation.
  typename K::Arrays arr{};
  const size_t arrays = K::arrays_bytes(p.num_experts, nullptr, nullptr);
  typename Gemm::Arguments args = K::make_arguments(p, arr);
  const size_t cutlass_ws = Gemm::get_workspace_size(args);
  char* ws = static_cast<char*>(alloc(alloc_ctx, arrays + cutlass_ws + 128));
  if (ws == nullptr) {
    std::snprintf(err, err_len, "could not allocate a %zu-byte workspace", arrays + cutlass_ws + 128);
    return 1;
  }
  ws = reinterpret_cast<char*>(detail::align_up(reinterpret_cast<uintptr_t>(ws), 128));
  K::arrays_bytes(p.num_experts, &arr, ws);
  void* gemm_ws = cutlass_ws > 0 ? static_cast<void*>(ws + arrays) : nullptr;
  args = K::make_arguments(p, arr);

  cutlass::Status st = Gemm::can_implement(args);
  if (st != cutlass::Status::kSuccess) return ::cutlass_w8a8::sm90::detail::fail(err, err_len, "CUTLASS can_implement", st);

  grouped_setup_kernel<K><<<1, kSetupThreads, 0, p.stream>>>(p, arr);  // the argument block itself, by value
  cudaError_t ce = cudaGetLastError();
  if (ce != cudaSuccess) {
    std::snprintf(err, err_len, "grouped setup kernel launch failed: %s", cudaGetErrorString(ce));
    return 1;
  }

  if (cutlass_ws > 0) {
    st = GemmKernel::initialize_workspace(args, gemm_ws, p.stream, nullptr);
    if (st != cutlass::Status::kSuccess) {
      return ::cutlass_w8a8::sm90::detail::fail(err, err_len, "CUTLASS initialize_workspace", st);
    }
  }
  if (GemmLauncher<K>::ensure_smem_attribute(p.device, err, err_len) != 0) return 1;
  typename GemmKernel::Params params = GemmKernel::to_underlying_arguments(args, gemm_ws);
  // Without PDL (see the top of this file).
  st = Gemm::run(params, p.stream, /*cuda_adapter=*/nullptr, /*launch_with_pdl=*/false);
  if (st != cutlass::Status::kSuccess) {
    ce = cudaGetLastError();
    std::snprintf(err, err_len, "CUTLASS run: %s (%s)", cutlass::cutlassGetStatusString(st), cudaGetErrorString(ce));
    return 1;
  }
  ce = cudaGetLastError();
  if (ce != cudaSuccess) {
    std::snprintf(err, err_len, "kernel launch failed: %s", cudaGetErrorString(ce));
    return 1;
  }
  return 0;
}

template <class ElementAB, class ElementD, class Cfg, bool kBlock>
int run_grouped_mm(const cw8a8_grouped_mm_args& args, cw8a8_alloc_fn alloc, void* alloc_ctx, char* err,
                   size_t err_len) {
  return run_grouped<GroupedMmKernel<ElementAB, ElementD, Cfg, kBlock>>(args, alloc, alloc_ctx, err, err_len);
}

}  // namespace cutlass_w8a8::sm90::grouped
