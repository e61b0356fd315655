// C entry points of _kernels_sm89: float8_e4m3fn scaled_mm on sm89 (CUTLASS 2.x, Ada's e4m3 MMA). The kernel
// template, tables and entry are sm80's (csrc/gemm/sm80/), instantiated with ArchTag Sm89.
#include "gemm/sm80/scaled_mm_sm80_entry.cuh"

using Table = cutlass_w8a8::sm80::Fp8Configs;

extern "C" {

__attribute__((visibility("default"))) int cw8a8_sm89_scaled_mm(const cw8a8_scaled_mm_args* args,
                                                                 cw8a8_alloc_fn alloc, void* ctx, char* err,
                                                                 size_t err_len) {
  return cutlass_w8a8::sm80::scaled_mm<cutlass::arch::Sm89, cutlass::float_e4m3_t, Table>(
      args, alloc, ctx, err, err_len, CW8A8_AB_FP8_E4M3, "_kernels_sm89");
}

__attribute__((visibility("default"))) int cw8a8_sm89_num_configs(int ab_type) {
  return cutlass_w8a8::sm80::num_configs<Table>(ab_type, CW8A8_AB_FP8_E4M3);
}

}  // extern "C"
