// Host code shared by the two decode GEMMs' launches: the dense one (scaled_mm_decode.cu: scaled_mm_decode,
// linear_decode, scaled_mm's decode path) and the grouped one (grouped_decode.cu). Torch-free.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "gemm/decode/decode_mma.cuh"  // Int8Ab, Fp8Ab

namespace cutlass_w8a8 {
namespace {

// The operand fields of a decode kernel's parameter block (DecodeParams; grouped_decode.cu's GroupedParams) from a
// checked argument block of kernel_api.h (cw8a8_scaled_mm_args, cw8a8_grouped_mm_args) with `rows` rows of A (M,
// or T): a and its pitch lda, the weight w = b and its pitch ldw = ldb, the scales and their per-token /
// per-channel flags, the bias, out = d and its pitch ldo = ldd, N and K. One row gets pitches 0: the kernels then
// never step a row (its stride(0) may be anything).
template <class Params, class Args>
void set_decode_operands(Params& p, const Args& args, int64_t rows) {
  p.a = static_cast<decltype(p.a)>(args.a);
  p.lda = rows <= 1 ? 0 : args.lda;
  p.w = static_cast<const uint8_t*>(args.b);
  p.ldw = args.ldb;
  p.scale_a = args.scale_a;
  p.scale_a_per_token = args.scale_a_per_token;
  p.scale_b = args.scale_b;
  p.scale_b_per_channel = args.scale_b_per_channel;
  p.bias = args.bias;
  p.out = args.d;
  p.ldo = rows <= 1 ? 0 : args.ldd;
  p.n = args.n;
  p.k = static_cast<int>(args.k);
}

// Calls f(AB{}, OutT{}) with the kernels' operand tag AB (Int8Ab when `int8`, else Fp8Ab: float8_e4m3fn) and output
// type OutT (__nv_bfloat16 when `bf16`, else __half).
template <class F>
void with_decode_types(bool int8, bool bf16, F&& f) {
  auto with_out = [&](auto ab_tag) {
    if (bf16) {
      f(ab_tag, __nv_bfloat16{});
    } else {
      f(ab_tag, __half{});
    }
  };
  if (int8) {
    with_out(Int8Ab{});
  } else {
    with_out(Fp8Ab{});
  }
}

}  // namespace
}  // namespace cutlass_w8a8
