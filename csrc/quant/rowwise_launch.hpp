// The launch of a fused row-wise op, once for rms_norm / fused_add_rms_norm / rms_norm_quant (quant/rms_norm.cu),
// silu_mul / silu_mul_quant (quant/silu_mul.cu) and moe_permute_quant (moe/permute_quant.cu): the element type and
// output conversion from the dtypes, the device's clusters and PDL, the current stream, and one launch_rowwise
// (quant/rowwise_reduce.cuh: the cluster, register or loop kernel, chosen from the row length, the dtype and the
// alignment only, never from the number of rows).
#pragma once

#include <cstdint>
#include <optional>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>

#include "core/device.hpp"
#include "core/launch_policy.hpp"
#include "quant/rowwise_args.hpp"
#include "quant/rowwise_reduce.cuh"

namespace cutlass_w8a8::quant {

// What an op's kernel needs for one (T, O) instantiation: its parameter block `p` (Row<T, O>::Params), the row
// length in vectors of 16 / sizeof(T) elements, whether the vectorized kernels may run (lengths, strides and
// pointers 16-byte aligned), and the multiple each cluster block's part of a row must be (launch_rowwise).
template <class Params>
struct RowwiseLaunch {
  Params p;
  int64_t nvec;
  bool vectorizable;
  int64_t part_multiple;
};

// Launches Row<T, O> (an Op of launch_rowwise) on `rows` rows on x's device and current stream, with T x's element
// type and O the output conversion: x's dtype when `qtype` is nullopt, else int8 / float8_e4m3fn per row (dynamic,
// or static with the op's scale) or, with group_size != 0, per 1 x 128 group. make(T{}, O{}) returns the
// RowwiseLaunch<Row<T, O>::Params>. PDL from core/launch_policy.hpp's kernels_use_pdl, clusters from
// core/device.hpp's clusters_available. Returns the stream launched on.
template <template <class, class> class Row, class Make>
cudaStream_t launch_rowwise_op(const at::Tensor& x, std::optional<at::ScalarType> qtype, int64_t group_size,
                               int64_t rows, Make&& make) {
  const bool clusters = clusters_available(x.get_device());
  const bool pdl = kernels_use_pdl(x.get_device());
  cudaStream_t stream = current_stream(x);
  auto launch = [&](auto t, auto o) {
    using T = decltype(t);
    using O = decltype(o);
    const RowwiseLaunch<typename Row<T, O>::Params> l = make(t, o);
    C10_CUDA_CHECK((launch_rowwise<T, Row<T, O>>(l.p, l.nvec, rows, l.vectorizable, clusters, pdl, stream,
                                                 l.part_multiple)));
  };
  if (group_size != 0) {
    dispatch_rowwise_groups(row_elem(x.scalar_type()), row_out(qtype), launch);
  } else {
    dispatch_rowwise(row_elem(x.scalar_type()), row_out(qtype), launch);
  }
  return stream;
}

}  // namespace cutlass_w8a8::quant
