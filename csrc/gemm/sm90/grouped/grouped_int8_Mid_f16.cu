// GInt8_Mid (grouped_sm90_config.cuh), int8_t operands, cutlass::half_t output: one
// instantiation per file so that the build compiles them in parallel.
#include "gemm/sm90/grouped/grouped_sm90.cuh"

namespace cutlass_w8a8::sm90::grouped {
template int run_grouped_mm<int8_t, cutlass::half_t, GInt8_Mid, false>(const cw8a8_grouped_mm_args&, cw8a8_alloc_fn, void*,
                                                        char*, size_t);
}  // namespace cutlass_w8a8::sm90::grouped
