// The decode-size grouped GEMM of grouped_scaled_mm (issue 27; mixture-of-experts at few rows per expert):
// csrc/gemm/decode/grouped_decode.cu, reasoning in csrc/gemm/decode/README.md, "Grouped decode GEMM".
//
// Serves a checked cw8a8_grouped_mm_args (gemm/kernel_api.h) with 1 <= T <= grouped_decode_max_rows(): for each
// expert e with rows [offsets[e - 1], offsets[e]) (offsets clamped on the device into a non-decreasing sequence
// within [0, T], see launch_grouped_decode), D[t, :] = epilogue(A[t, :] @ B_e) with the decode GEMM's tiling,
// MMA steps, block-scale steps and epilogue (decode_mma.cuh). Only the active experts' weights are read: the CTAs
// of an expert with no rows never touch its weight, scales or bias.
#pragma once

#include <cstdint>

#include "gemm/kernel_api.h"

namespace cutlass_w8a8 {

// The largest T (rows of A, i.e. tokens x top_k) the grouped decode kernel serves; the grouped_scaled_mm entry
// (csrc/gemm/grouped_mm_entry.cu) dispatches T <= this to launch_grouped_decode, larger T to the CUTLASS
// ptr-array grouped GEMM. The reasoning for the value is at its definition (grouped_decode.cu).
int64_t grouped_decode_max_rows();

// Launches the grouped decode GEMM on args.stream (args.pdl: programmatic dependent launch, the kernel waits on
// griddepcontrol before reading anything another kernel writes). args are checked by the caller: 1 <= t <=
// grouped_decode_max_rows(), K and N positive multiples of 16, K <= 2**30, a / b / d / scales / bias 16-byte or
// element aligned as scaled_mm requires, lda and ldb multiples of 16, stride_b_e a multiple of 16. Offsets are read
// on the device only and clamped: c[-1] = 0, c[e] = min(T, max(c[e - 1], offsets[e])); expert e owns rows
// [c[e - 1], c[e]), and rows >= c[E - 1] are not written. No host synchronisation, no allocation. Throws (TORCH_CHECK)
// only for states the caller's checks exclude (e.g. a misaligned operand), and for a failed launch.
void launch_grouped_decode(const cw8a8_grouped_mm_args& args);

}  // namespace cutlass_w8a8

// The same functions under the short namespace some issue-27 files use.
namespace cw8a8 {
using cutlass_w8a8::grouped_decode_max_rows;
using cutlass_w8a8::launch_grouped_decode;
}  // namespace cw8a8
