// moe_permute_quant: the tokens gathered into the experts' order (moe_align's sorted_pairs) and quantized for the
// first grouped GEMM, in one kernel:
//
//   row s of q = quantize(x[sorted_pairs[s] / top_k])      s in [0, T * top_k)
//
// per token (dynamic: scale[s] = max |row| / QMAX), per tensor (a static scale, repeated into scale[s]) or per 1 x
// 128 group (scale[s, g]), to int8 or float8_e4m3fn. The quantization is the row-wise kernels' tail
// (quant/rowwise_reduce.cuh finish_regs / finish_loop), the code silu_mul_quant and rms_norm_quant run and that
// equals quantize_per_token / quantize_per_tensor / quantize_per_token_group bit for bit; so q and the scales are
// those of gathering the rows, then quantizing them. The launch shapes are launch_rowwise's (one block per output
// row, a cluster of 8 on sm90 for rows of more than 8192 bf16 elements): chosen from H, the dtype and the alignment,
// never from the routing. A pair index outside [0, T * top_k) (device data, not checked: no host sync) is clamped
// into it, as the CPU reference does.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <optional>
#include <tuple>

#include <c10/cuda/CUDAGuard.h>

#include "core/checks.hpp"
#include "moe/moe_args.hpp"
#include "ops.hpp"
#include "quant/rowwise_args.hpp"
#include "quant/rowwise_launch.hpp"
#include "quant/rowwise_reduce.cuh"

namespace cutlass_w8a8 {
namespace {

// The kernel argument: x [T, H] rows, x_stride apart; out [n, H] contiguous (len = H); scales [n] (per row), or
// [n, H / 128] (GroupOut); static_scale null: dynamic.
template <class T, class OutT>
struct PermuteParams : RowwiseIO<T, OutT> {
  const int* sorted_pairs;  // [n]
  int64_t n;                // T * top_k: the output rows
  int top_k;
};

// The source row of output row `row`: the pair's token, the pair clamped into [0, n).
template <class P>
__device__ __forceinline__ int64_t source_row(const P& p, int64_t row) {
  int64_t pair = p.sorted_pairs[row];
  pair = pair < 0 ? 0 : (pair >= p.n ? p.n - 1 : pair);
  return pair / p.top_k;
}

// y = the gathered row, as loaded, for RowwiseOp (quant/rowwise_reduce.cuh, launched by launch_rowwise_op).
struct PermuteRow {
  template <class T, class OutT>
  using Params = PermuteParams<T, OutT>;

  template <int kVecs, int kB, int C, class T, class OutT, int N>
  __device__ __forceinline__ static void regs(const Params<T, OutT>& p, int64_t row, Vec<T, N> (&y)[kVecs], int begin,
                                              int end) {
    const auto* in = reinterpret_cast<const Vec<T, N>*>(p.x + source_row(p, row) * p.x_stride);
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      const int idx = begin + threadIdx.x + i * kB;
      if (idx < end) y[i] = in[idx];
    }
  }

  template <int N, int kB, class T, class OutT>
  __device__ __forceinline__ static auto loop(const Params<T, OutT>& p, int64_t row) {
    const auto* in = reinterpret_cast<const Vec<T, N>*>(p.x + source_row(p, row) * p.x_stride);
    return [=](int idx) { return in[idx]; };
  }
};

}  // namespace

std::tuple<at::Tensor, at::Tensor> moe_permute_quant(const at::Tensor& x, const at::Tensor& sorted_pairs,
                                                     int64_t top_k, at::ScalarType dtype,
                                                     const std::optional<at::Tensor>& scale, int64_t group_size) {
  constexpr const char* op = "moe_permute_quant";
  moe::check_permute_quant(op, x, sorted_pairs, top_k, dtype, scale, group_size);
  quant::check_on_cuda(op, x);
  c10::cuda::CUDAGuard guard(x.device());
  const int64_t t = x.size(0), h = x.size(1), n = t * top_k;
  at::Tensor q = at::empty({n, h}, x.options().dtype(dtype));
  at::Tensor scales = at::empty({n, group_size != 0 ? h / group_size : 1}, x.options().dtype(at::kFloat));
  if (n == 0) return {q, scales};

  const at::Tensor x2 = x.stride(1) == 1 ? x : x.contiguous();
  const at::Tensor pairs = sorted_pairs.contiguous();
  // the rows of x; a single row's stride may be anything, so it is given as H (vectorizable)
  const quant::RowwiseRows rows{x2.data_ptr(), t > 1 ? x2.stride(0) : h, q.data_ptr(), scales.data_ptr<float>(),
                                scale.has_value() ? scale->data_ptr<float>() : nullptr, h, n,
                                /*group_parts=*/group_size != 0};
  quant::launch_rowwise_op<PermuteRow>(x, dtype, group_size, rows, [&](auto& p) {
    p.sorted_pairs = pairs.data_ptr<int>();
    p.n = n;
    p.top_k = static_cast<int>(top_k);
    return true;
  });
  return {q, scales};
}

}  // namespace cutlass_w8a8
