// Kernel nodes of our ops inside captured CUDA graphs, remembered so that an instantiated graph can be
// updated in place (new M, new pointers) with cudaGraphExecKernelNodeSetParams instead of being recaptured.
// The Python side is cutlass_w8a8/graphs.py (UpdatableGraph); the method is NVIDIA's "Constructing CUDA
// Graphs with Dynamic Parameters" (stream capture, then kernel-node handles and exec-graph updates).
//
// How a node is found: right after an op launches its kernel on a stream that is being captured, the
// capture's dependency set is exactly the node that launch added (cudaStreamGetCaptureInfo). While
// recording is on (cw8a8_graph_record_begin), each op calls one of the note_* functions below after its
// launch; outside a capture, or with recording off, they return at once and cost one relaxed atomic load.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "gemm/kernel_api.h"

namespace cutlass_w8a8::graph_nodes {

// True while a recording is open (cheap; the note_* functions test it themselves).
bool recording();

// After launching a "row-wise" kernel on `stream`: its grid is (rows, g_y, g_z) with block x handling row x
// of the op's M rows only, and none of its parameters depends on M. Such a node is updated to fewer rows by
// shrinking gridDim.x alone. `op` names the op in error messages. Throws (TORCH_CHECK) when the launch is
// being captured and recorded but its node cannot be identified.
void note_rowwise_launch(cudaStream_t stream, int64_t rows, const char* op);

// After launching a kernel whose FIRST parameter is `int64_t m` (its M) and whose grid and other parameters do
// not depend on M; `num_params` is the kernel's parameter count. Updated by rewriting that parameter.
void note_m_param_launch(cudaStream_t stream, int64_t m, const char* op, int num_params);

// After launching an sm90 scaled_mm kernel described by `args` (args.config < 0: the one dispatch chose).
// A launch that took a workspace cannot be recorded (its update would need a new one): recording it throws.
void note_gemm_launch(cudaStream_t stream, const cw8a8_scaled_mm_args& args, bool has_workspace);

// For a launch that cannot be updated in place: throws when it is being captured into a recording graph, so an
// UpdatableGraph never holds a kernel whose M an update would silently leave behind.
void refuse_launch(cudaStream_t stream, const char* what);

}  // namespace cutlass_w8a8::graph_nodes
