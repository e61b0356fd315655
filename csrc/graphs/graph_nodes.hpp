// Kernel nodes of our ops inside captured CUDA graphs, remembered so that an instantiated graph can be
// updated in place (new M, new pointers) with cudaGraphExecKernelNodeSetParams instead of being recaptured.
// The Python side is cutlass_w8a8/graphs (UpdatableGraph), through the non-tensor ops of torch_bindings.cpp; the
// method is NVIDIA's "Constructing CUDA Graphs with Dynamic Parameters" (stream capture, then kernel-node handles
// and exec-graph updates).
//
// How a node is found: right after an op launches its kernel on a stream that is being captured, the
// capture's dependency set is exactly the node that launch added (cudaStreamGetCaptureInfo). While
// recording is open (record_begin), each op calls one of the note_* functions below after its
// launch; outside a capture, or with recording off, they return at once and cost one relaxed atomic load.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include <ATen/ATen.h>
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

// ---- the recording and the updates (torch_bindings.cpp exposes them as ops; errors are RuntimeError unless noted)

// Opens a recording: every op launched while it is open on a capturing stream records its node. Returns the id
// of the first record it will make. One recording at a time ("cutlass_w8a8.graph_record_begin: a graph-node
// recording is already open").
int64_t record_begin();

// Closes the recording and returns one past its last record id. With `check` (the capture succeeded and its graph
// was kept) validates the records against the graph; otherwise forgets them.
int64_t record_end(bool check);

// What one record is: kind (0 row-wise, 1 scaled_mm, 2 M parameter), device, graph (a cudaGraph_t), rows now /
// bound / captured, GEMM N, K (0 for other kinds) and captured config (-1: not a GEMM).
struct RecordInfo {
  int kind = 0;
  int device = 0;
  int64_t graph = 0;
  int64_t rows = 0, bound_rows = 0, captured_rows = 0;
  int64_t n = 0, k = 0;
  int config = -1;
  std::string op;
};
RecordInfo record_info(int64_t record);

// Sets every listed node of instantiated graph `graph_exec` (a cudaGraphExec_t) to `rows` rows (M). All records
// are checked before any node changes: each must be live and validated, and rows in [1, its bound rows]
// (ValueError otherwise, "UpdatableGraph.set_rows: `rows` must be in [1, 64] for the scaled_mm node (record 3),
// got 65").
void set_rows(int64_t graph_exec, at::IntArrayRef records, int64_t rows);

// Forgets records (their graph is gone). Unknown or dead ids are ignored.
void release(at::IntArrayRef records);

// cudaGraphExecUpdate(graph_exec, graph): the "recapture, then update the executable graph" method, for
// bench/bench_graph_update.py's comparison. False when the topology changed (the caller re-instantiates).
bool exec_update(int64_t graph_exec, int64_t graph);

// The _graph_update_scaled_mm op: rebinds recorded GEMM node `record` of `graph_exec` to new operands, checked as
// scaled_mm's out= form (messages name UpdatableGraph.update_scaled_mm), with N, K, dtypes and device as captured
// and M in [1, captured M].
void graph_update_scaled_mm(int64_t graph_exec, int64_t record, const at::Tensor& out, const at::Tensor& a,
                            const at::Tensor& b, const at::Tensor& scale_a, const at::Tensor& scale_b,
                            const std::optional<at::Tensor>& bias);

}  // namespace cutlass_w8a8::graph_nodes
