// C entry points of _kernels_sm80: int8 scaled_mm on sm80 / sm86 / sm89 (CUTLASS 2.x).
#include "gemm/sm80/scaled_mm_sm80_entry.cuh"

using Table = cutlass_w8a8::sm80::Int8Configs;

extern "C" {

__attribute__((visibility("default"))) int cw8a8_sm80_scaled_mm(const cw8a8_scaled_mm_args* args,
                                                                 cw8a8_alloc_fn alloc, void* ctx, char* err,
                                                                 size_t err_len) {
  return cutlass_w8a8::sm80::scaled_mm<cutlass::arch::Sm80, int8_t, Table>(args, alloc, ctx, err, err_len,
                                                                           CW8A8_AB_INT8, "_kernels_sm80");
}

__attribute__((visibility("default"))) int cw8a8_sm80_num_configs(int ab_type) {
  return cutlass_w8a8::sm80::num_configs<Table>(ab_type, CW8A8_AB_INT8);
}

}  // extern "C"
