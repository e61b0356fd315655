// Kernel nodes of our ops in captured CUDA graphs, and their in-place updates (see graph_nodes.hpp).
#include "graphs/graph_nodes.hpp"

#include <atomic>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include "gemm/kernel_libraries.hpp"
#include "gemm/scaled_mm_args.hpp"

namespace cutlass_w8a8 {

namespace graph_nodes {
namespace {

enum class Kind : int { kRowwise = 0, kGemm = 1, kMParam = 2 };

struct Record {
  Kind kind = Kind::kRowwise;
  std::string op;
  int device = 0;
  cudaGraph_t graph = nullptr;
  cudaGraphNode_t node = nullptr;
  int64_t captured_rows = 0;  // M at capture
  int64_t bound_rows = 0;     // M of the buffers the node reads now: the most rows an update may ask for
  int64_t rows = 0;           // M the node runs now
  bool checked = false;       // validated after the capture (record_end)
  bool live = true;
  int num_params = 0;  // kMParam nodes: the kernel's parameter count (parameter 0 is `int64_t m`)
  // GEMM nodes
  cw8a8_scaled_mm_args args{};  // what the node runs now (args.config: -1, dispatch by shape)
  int config = -1;              // config at capture (an index into the table of args: cw8a8_config_table_of)
  unsigned cluster[3] = {1, 1, 1};
  bool pdl_edge = false;        // captured behind a programmatic (PDL) edge: only PDL-safe kernels may run here
};

std::mutex g_mutex;
std::vector<Record> g_records;
std::atomic<int> g_open{0};
int64_t g_first = 0;  // first id of the open recording

// The node the last launch on `stream` added, when the stream is being captured; nullptr otherwise.
cudaGraphNode_t captured_node(cudaStream_t stream, const char* op, cudaGraph_t* graph) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  unsigned long long id = 0;
  const cudaGraphNode_t* deps = nullptr;
  size_t count = 0;
#if CUDART_VERSION >= 13000
  C10_CUDA_CHECK(cudaStreamGetCaptureInfo(stream, &status, &id, graph, &deps, nullptr, &count));
#else
  C10_CUDA_CHECK(cudaStreamGetCaptureInfo_v2(stream, &status, &id, graph, &deps, &count));
#endif
  if (status != cudaStreamCaptureStatusActive) return nullptr;
  TORCH_CHECK(count == 1 && deps != nullptr, "cutlass_w8a8 graph recording: after ", op, " the capture has ",
              count, " frontier nodes instead of the one kernel it launched");
  cudaGraphNodeType type{};
  C10_CUDA_CHECK(cudaGraphNodeGetType(deps[0], &type));
  TORCH_CHECK(type == cudaGraphNodeTypeKernel, "cutlass_w8a8 graph recording: the node ", op,
              " added is not a kernel node (type ", static_cast<int>(type), ")");
  return deps[0];
}

int current_device() {
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  return device;
}

void add(Record&& r) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_records.push_back(std::move(r));
}

Record& record_at(int64_t id, const char* what) {
  TORCH_CHECK_VALUE(id >= 0 && id < static_cast<int64_t>(g_records.size()) && g_records[id].live, what,
                    ": `record` ", id, " is not a live graph-node record");
  return g_records[id];
}

// Describes (and, with exec, applies) the GEMM node for `args`: the config dispatch picks for the new shape
// when it has the captured config's cluster shape (a node's cluster dimensions are a launch attribute the
// update cannot change) and, for a node captured behind a PDL edge, is PDL-safe (an edge the update cannot remove:
// a kernel that reads memory before griddepcontrol.wait must not run behind it), else the captured config, which
// is correct for any M.
void apply_gemm(const Record& r, cw8a8_scaled_mm_args args, cudaGraphExec_t exec, cw8a8_kernel_node* desc) {
  cw8a8_scaled_mm_node_fn node_fn = sm90_scaled_mm_node_fn();
  char err[512] = {0};
  args.config = -1;
  TORCH_CHECK(node_fn(&args, desc, nullptr, nullptr, err, sizeof(err)) == 0, "cutlass_w8a8 graph update (",
              r.op, "): ", err);
  if (std::memcmp(desc->cluster, r.cluster, sizeof(r.cluster)) != 0 || (r.pdl_edge && desc->pdl_safe == 0)) {
    args.config = r.config;
  }
  TORCH_CHECK(node_fn(&args, desc, exec, r.node, err, sizeof(err)) == 0, "cutlass_w8a8 graph update (", r.op,
              "): ", err);
}

// Row-wise nodes: a new gridDim.x; M-parameter nodes: a new first parameter.
void apply_simple(const Record& r, int64_t rows, cudaGraphExec_t exec) {
  cudaKernelNodeParams p{};
  C10_CUDA_CHECK(cudaGraphKernelNodeGetParams(r.node, &p));
  if (r.kind == Kind::kRowwise) {
    p.gridDim.x = static_cast<unsigned>(rows);
    C10_CUDA_CHECK(cudaGraphExecKernelNodeSetParams(exec, r.node, &p));
    return;
  }
  // kMParam: the node's own parameter values, with parameter 0 replaced by the new M
  void* params[64];
  TORCH_CHECK(r.num_params >= 1 && r.num_params <= 64 && p.kernelParams != nullptr, "cutlass_w8a8 graph update (",
              r.op, "): unexpected parameter list");
  for (int i = 0; i < r.num_params; ++i) params[i] = p.kernelParams[i];
  int64_t m = rows;
  params[0] = &m;
  p.kernelParams = params;
  C10_CUDA_CHECK(cudaGraphExecKernelNodeSetParams(exec, r.node, &p));
}

}  // namespace

bool recording() { return g_open.load(std::memory_order_relaxed) > 0; }

namespace {

// A row-wise or M-parameter launch: its node, M, and (kMParam) the kernel's parameter count.
void note_rows_launch(cudaStream_t stream, Kind kind, int64_t rows, const char* op, int num_params) {
  if (!recording() || rows <= 0) return;
  Record r;
  r.node = captured_node(stream, op, &r.graph);
  if (r.node == nullptr) return;
  r.kind = kind;
  r.op = op;
  r.device = current_device();
  r.captured_rows = r.bound_rows = r.rows = rows;
  r.num_params = num_params;
  add(std::move(r));
}

}  // namespace

void note_rowwise_launch(cudaStream_t stream, int64_t rows, const char* op) {
  note_rows_launch(stream, Kind::kRowwise, rows, op, 0);
}

void refuse_launch(cudaStream_t stream, const char* what) {
  if (!recording()) return;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  TORCH_CHECK(status != cudaStreamCaptureStatusActive, "cutlass_w8a8 graph recording: ", what,
              " cannot be updated in place, so it cannot be captured into an UpdatableGraph");
}

void note_m_param_launch(cudaStream_t stream, int64_t m, const char* op, int num_params) {
  note_rows_launch(stream, Kind::kMParam, m, op, num_params);
}

void note_gemm_launch(cudaStream_t stream, const cw8a8_scaled_mm_args& args, bool has_workspace) {
  if (!recording()) return;
  Record r;
  r.node = captured_node(stream, "scaled_mm", &r.graph);
  if (r.node == nullptr) return;
  TORCH_CHECK(!has_workspace, "cutlass_w8a8 graph recording: this scaled_mm config (", args.config,
              ") uses a workspace, so its node cannot be updated in place; record graphs with the shipped configs");
  r.kind = Kind::kGemm;
  r.op = "scaled_mm";
  r.device = args.device;
  r.captured_rows = r.bound_rows = r.rows = args.m;
  r.args = args;
  r.args.stream = nullptr;
  add(std::move(r));
}

// Checks the records of a finished capture against the graph's nodes (outside the capture: graph queries and
// the GEMM description only run here) and fills in each GEMM node's captured config and cluster shape.
void check_records(int64_t first, int64_t end) {
  std::lock_guard<std::mutex> lock(g_mutex);
  for (int64_t id = first; id < end; ++id) {
    Record& r = g_records[id];
    if (!r.live || r.checked) continue;
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(r.device));
    cudaKernelNodeParams p{};
    C10_CUDA_CHECK(cudaGraphKernelNodeGetParams(r.node, &p));
    if (r.kind == Kind::kMParam) {
      TORCH_CHECK(p.kernelParams != nullptr && *static_cast<const int64_t*>(p.kernelParams[0]) == r.captured_rows,
                  "cutlass_w8a8 graph recording: ", r.op, "'s first kernel parameter is not its M = ", r.captured_rows);
    } else if (r.kind == Kind::kRowwise) {
      TORCH_CHECK(static_cast<int64_t>(p.gridDim.x) == r.captured_rows, "cutlass_w8a8 graph recording: ", r.op,
                  " launched gridDim.x = ", p.gridDim.x, " for ", r.captured_rows, " rows (not a row-wise kernel)");
    } else {
      cw8a8_kernel_node desc{};
      char err[512] = {0};
      cw8a8_scaled_mm_args args = r.args;
      args.config = -1;
      TORCH_CHECK(sm90_scaled_mm_node_fn()(&args, &desc, nullptr, nullptr, err, sizeof(err)) == 0,
                  "cutlass_w8a8 graph recording: ", err);
      TORCH_CHECK(p.gridDim.x == desc.grid[0] && p.gridDim.y == desc.grid[1] && p.gridDim.z == desc.grid[2] &&
                      p.blockDim.x == desc.block[0] && p.sharedMemBytes == desc.smem_bytes,
                  "cutlass_w8a8 graph recording: the scaled_mm node's launch (grid ", p.gridDim.x, "x",
                  p.gridDim.y, ", block ", p.blockDim.x, ", smem ", p.sharedMemBytes,
                  ") is not the one its description gives (grid ", desc.grid[0], "x", desc.grid[1], ", block ",
                  desc.block[0], ", smem ", desc.smem_bytes, ")");
      r.config = desc.config;
      std::memcpy(r.cluster, desc.cluster, sizeof(r.cluster));
      // The library launches a kernel that is not PDL-safe without PDL whatever args.pdl says (kernel_api.h).
      r.pdl_edge = r.args.pdl != 0 && desc.pdl_safe != 0;
    }
    r.checked = true;
  }
}

// ---- torch op: rebind a recorded GEMM node to new operands ------------------------------------------------

void graph_update_scaled_mm(int64_t graph_exec, int64_t record, const at::Tensor& out, const at::Tensor& a,
                            const at::Tensor& b, const at::Tensor& scale_a, const at::Tensor& scale_b,
                            const std::optional<at::Tensor>& bias) {
  constexpr const char* op = "graph_update_scaled_mm";
  cw8a8_scaled_mm_args args =
      check_and_pack_scaled_mm("UpdatableGraph.update_scaled_mm", out, a, b, scale_a, scale_b, bias);
  TORCH_CHECK_VALUE(graph_exec != 0, op, ": `graph_exec` is null (instantiate the graph first)");
  std::lock_guard<std::mutex> lock(g_mutex);
  Record& r = record_at(record, op);
  TORCH_CHECK_VALUE(r.kind == Kind::kGemm && r.checked, op, ": `record` ", record, " is a ", r.op,
                    " node, not a checked scaled_mm node");
  TORCH_CHECK_VALUE(args.device == r.device, op, ": `a` is on cuda:", args.device,
                    " but the captured GEMM ran on cuda:", r.device);
  TORCH_CHECK_TYPE(args.ab_type == r.args.ab_type, op, ": `a` must have the captured operand dtype (",
                   r.args.ab_type == CW8A8_AB_INT8 ? "int8" : "float8_e4m3fn", ")");
  TORCH_CHECK_TYPE(args.out_type == r.args.out_type, op, ": `out` must have the captured output dtype (",
                   r.args.out_type == CW8A8_OUT_BF16 ? "bfloat16" : "float16", ")");
  // Block-scaled and row-wise GEMMs are different kernels (config tables): a node keeps its kind of scales.
  TORCH_CHECK_VALUE(args.scale_block == r.args.scale_block, op, ": `scale_a` and `scale_b` must be ",
                    r.args.scale_block ? "block scales (scale_a [M, K/128], scale_b [ceil(N/128), K/128])"
                                       : "row-wise scales (per-tensor, per-token or per-channel)",
                    " as captured");
  TORCH_CHECK_VALUE(args.n == r.args.n && args.k == r.args.k, op, ": `b` must keep the captured N = ", r.args.n,
                    " and K = ", r.args.k, ", got N = ", args.n, ", K = ", args.k);
  TORCH_CHECK_VALUE(args.m >= 1 && args.m <= r.captured_rows, op, ": `a` must have M = a.shape[0] in [1, ",
                    r.captured_rows, "] (the captured M), got ", args.m);
  args.sm_count = r.args.sm_count;
  args.pdl = r.args.pdl;
  args.fp8_fast_accum = r.args.fp8_fast_accum;  // the node keeps the captured accumulation (fast or accurate rows)
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(r.device));
  cw8a8_kernel_node desc{};
  apply_gemm(r, args, reinterpret_cast<cudaGraphExec_t>(graph_exec), &desc);
  r.args = args;
  r.bound_rows = r.rows = args.m;
}

// ---- the recording and the updates ----------------------------------------------------------------------

namespace {

// Rethrows an error of an update step with the caller's prefix, as the first line Python shows.
[[noreturn]] void rethrow(const char* what, const c10::Error& e) {
  TORCH_CHECK(false, what, ": ", e.msg());
}

}  // namespace

int64_t record_begin() {
  std::lock_guard<std::mutex> lock(g_mutex);
  TORCH_CHECK(g_open.load() == 0, "cutlass_w8a8.graph_record_begin: a graph-node recording is already open");
  g_first = static_cast<int64_t>(g_records.size());
  g_open.store(1);
  return g_first;
}

int64_t record_end(bool check) {
  int64_t first = 0, end = 0;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    TORCH_CHECK(g_open.load() != 0, "cutlass_w8a8.graph_record_end: no graph-node recording is open");
    g_open.store(0);
    first = g_first;
    end = static_cast<int64_t>(g_records.size());
    if (!check) {
      for (int64_t id = first; id < end; ++id) g_records[id].live = false;
      return end;
    }
  }
  try {
    check_records(first, end);
  } catch (const c10::Error& e) {
    rethrow("cutlass_w8a8.graph_record_end", e);
  }
  return end;
}

RecordInfo record_info(int64_t id) {
  std::lock_guard<std::mutex> lock(g_mutex);
  TORCH_CHECK(id >= 0 && id < static_cast<int64_t>(g_records.size()) && g_records[id].live,
              "cutlass_w8a8.graph_record_info: record ", id, " is not a live graph-node record");
  const Record& r = g_records[id];
  RecordInfo info;
  info.kind = static_cast<int>(r.kind);
  info.device = r.device;
  info.graph = reinterpret_cast<int64_t>(r.graph);
  info.rows = r.rows;
  info.bound_rows = r.bound_rows;
  info.captured_rows = r.captured_rows;
  info.n = r.kind == Kind::kGemm ? r.args.n : 0;
  info.k = r.kind == Kind::kGemm ? r.args.k : 0;
  info.config = r.config;
  info.op = r.op;
  return info;
}

void set_rows(int64_t graph_exec, at::IntArrayRef ids, int64_t rows) {
  constexpr const char* what = "UpdatableGraph.set_rows";
  TORCH_CHECK(graph_exec != 0, what, ": the graph is not instantiated");
  auto* exec = reinterpret_cast<cudaGraphExec_t>(graph_exec);
  std::lock_guard<std::mutex> lock(g_mutex);
  for (const int64_t id : ids) {
    TORCH_CHECK(id >= 0 && id < static_cast<int64_t>(g_records.size()) && g_records[id].live && g_records[id].checked,
                what, ": record ", id, " is not a live, checked record");
    const Record& r = g_records[id];
    TORCH_CHECK_VALUE(rows >= 1 && rows <= r.bound_rows, what, ": `rows` must be in [1, ", r.bound_rows, "] for the ",
                      r.op, " node (record ", id, "), got ", rows);
  }
  try {
    int device = -1;
    std::optional<c10::cuda::CUDAGuard> guard;
    for (const int64_t id : ids) {
      Record& r = g_records[id];
      if (r.rows == rows) continue;
      if (r.device != device) {
        guard.emplace(static_cast<c10::DeviceIndex>(r.device));
        device = r.device;
      }
      if (r.kind != Kind::kGemm) {
        apply_simple(r, rows, exec);
      } else {
        cw8a8_scaled_mm_args args = r.args;
        args.m = rows;
        cw8a8_kernel_node desc{};
        apply_gemm(r, args, exec, &desc);
        r.args.m = rows;
      }
      r.rows = rows;
    }
  } catch (const c10::Error& e) {
    rethrow(what, e);
  }
}

void release(at::IntArrayRef ids) {
  std::lock_guard<std::mutex> lock(g_mutex);
  for (const int64_t id : ids) {
    if (id >= 0 && id < static_cast<int64_t>(g_records.size())) g_records[id].live = false;
  }
}

bool exec_update(int64_t graph_exec, int64_t graph) {
  cudaGraphExecUpdateResultInfo info{};
  const cudaError_t ce = cudaGraphExecUpdate(reinterpret_cast<cudaGraphExec_t>(graph_exec),
                                             reinterpret_cast<cudaGraph_t>(graph), &info);
  if (ce == cudaSuccess) return true;
  (void)cudaGetLastError();
  TORCH_CHECK(ce == cudaErrorGraphExecUpdateFailure, "cutlass_w8a8.graph_exec_update: cudaGraphExecUpdate: ",
              cudaGetErrorString(ce), " (result ", static_cast<int>(info.result), ")");
  return false;
}

}  // namespace graph_nodes
}  // namespace cutlass_w8a8
