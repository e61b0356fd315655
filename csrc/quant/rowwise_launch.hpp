// The launch of a fused row-wise op, once for rms_norm / fused_add_rms_norm / rms_norm_quant (quant/rms_norm.cu),
// silu_mul / silu_mul_quant (quant/silu_mul.cu) and moe_permute_quant (moe/permute_quant.cu): the element type and
// output conversion from the dtypes, the kernel argument's RowwiseIO fields, whether the vectorized kernels may run,
// the device's clusters and PDL, the current stream, and one launch_rowwise (quant/rowwise_reduce.cuh: the cluster,
// register or loop kernel, chosen from the row length, the dtype and the alignment only, never from the number of
// rows). run_rowwise_op adds what the ops on the rows of x share: the outputs and the CUDA-graph node record.
#pragma once

#include <cstdint>
#include <optional>
#include <tuple>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include "core/checks.hpp"
#include "core/device.hpp"
#include "core/launch_policy.hpp"
#include "graphs/graph_nodes.hpp"
#include "quant/quantize.hpp"
#include "quant/rowwise_args.hpp"
#include "quant/rowwise_reduce.cuh"

namespace cutlass_w8a8::quant {

// The RowwiseIO fields of one launch, untyped: `rows` output rows of `len` elements at `out` (contiguous), their
// float32 `scales` (quantized outputs; else null) and the static scale (or null), from input rows at `x`, `x_stride`
// elements apart. `group_parts`: a cluster kernel only when each block's part of the row is whole 128-element
// groups (launch_rowwise's part_multiple).
struct RowwiseRows {
  const void* x;
  int64_t x_stride;
  void* out;
  float* scales;
  const float* static_scale;
  int64_t len;
  int64_t rows;
  bool group_parts;
};

// Launches RowwiseOp<Y, T, O> (quant/rowwise_reduce.cuh) on `r` on x's device and current stream, with T x's element
// type and O the output conversion: x's dtype when `qtype` is nullopt, else int8 / float8_e4m3fn per row (dynamic,
// or static with r.static_scale) or, with group_size != 0, per 1 x 128 group. fill(p) sets the op's own fields of its
// kernel argument p (Y::Params<T, OutT>, the RowwiseIO fields already set from `r`) and returns whether they allow
// the vectorized kernels (16-byte aligned); x, out, len and x_stride must allow them too. PDL from
// core/launch_policy.hpp's kernels_use_pdl, clusters from core/device.hpp's clusters_available. Returns the stream
// launched on.
template <class Y, class Fill>
cudaStream_t launch_rowwise_op(const at::Tensor& x, std::optional<at::ScalarType> qtype, int64_t group_size,
                               const RowwiseRows& r, Fill&& fill) {
  const bool clusters = clusters_available(x.get_device());
  const bool pdl = kernels_use_pdl(x.get_device());
  cudaStream_t stream = current_stream(x);
  auto launch = [&](auto t, auto o) {
    using T = decltype(t);
    using Op = RowwiseOp<Y, T, decltype(o)>;
    using OutT = typename decltype(o)::type;
    constexpr int N = 16 / sizeof(T);
    typename Op::Params p;
    p.x = static_cast<const T*>(r.x);
    p.x_stride = r.x_stride;
    p.out = static_cast<OutT*>(r.out);
    p.scales = r.scales;
    p.static_scale = r.static_scale;
    p.len = static_cast<int>(r.len);
    const bool op_vectorizable = fill(p);
    const bool vectorizable = op_vectorizable && r.len % N == 0 && p.x_stride % N == 0 && is_aligned(p.x, 16) &&
                              is_aligned(p.out, N * sizeof(OutT));
    const int64_t part_multiple = r.group_parts ? kGroupElems / N : 1;  // no group across two cluster blocks
    C10_CUDA_CHECK((launch_rowwise<T, Op>(p, r.len / N, r.rows, vectorizable, clusters, pdl, stream, part_multiple)));
  };
  if (group_size != 0) {
    dispatch_rowwise_groups(row_elem(x.scalar_type()), row_out(qtype), launch);
  } else {
    dispatch_rowwise(row_elem(x.scalar_type()), row_out(qtype), launch);
  }
  return stream;
}

// A checked fused row-wise op on the rows of x [..., K] (rms_norm.cu, silu_mul.cu): y [..., len] in x's dtype, or
// with `qtype` q [..., len] and its float32 scales ([..., 1] per row, or [..., len / 128] with group_size 128), from
// the caching allocator on x's device; then launch_rowwise_op of Y on the rows (x as rows_of's [M, K]; `scale`, the
// static scale, or none), recorded for CUDA-graph node updates (graphs/graph_nodes.hpp) under `op`. Returns
// (y or q, the scales: undefined without qtype); nothing is launched for M = 0.
template <class Y, class Fill>
std::tuple<at::Tensor, at::Tensor> run_rowwise_op(const char* op, const at::Tensor& x, int64_t len,
                                                  std::optional<at::ScalarType> qtype,
                                                  const std::optional<at::Tensor>& scale, int64_t group_size,
                                                  bool group_parts, Fill&& fill) {
  check_on_cuda(op, x);
  c10::cuda::CUDAGuard guard(x.device());
  const int64_t m = x.numel() / x.size(-1);
  const RowOutputs y = empty_row_outputs(x, len, qtype.value_or(x.scalar_type()), qtype.has_value(), group_size);
  if (m == 0) return {y.out, y.scales};

  const at::Tensor x2 = rows_of(x);
  const RowwiseRows r{x2.data_ptr(), x2.stride(0), y.out.data_ptr(),
                      qtype.has_value() ? y.scales.data_ptr<float>() : nullptr,
                      scale.has_value() ? scale->data_ptr<float>() : nullptr, len, m, group_parts};
  const cudaStream_t stream = launch_rowwise_op<Y>(x, qtype, group_size, r, fill);
  graph_nodes::note_rowwise_launch(stream, m, op);
  return {y.out, y.scales};
}

}  // namespace cutlass_w8a8::quant
