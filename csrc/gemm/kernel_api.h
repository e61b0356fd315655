// The C interface between the torch extension (`cutlass_w8a8._C`) and the per-architecture kernel
// libraries (`cutlass_w8a8._kernels_sm90`, ...).
//
// Why a C interface: each architecture's kernels are compiled with their own `-gencode` flags (the sm90
// kernels only for sm_90a), which one torch extension cannot do per source file. So every architecture
// is its own shared library with no torch dependency; `_C` finds its entry points with dlsym after
// Python has loaded the library with RTLD_GLOBAL (see cutlass_w8a8/_ext.py). Keeping torch out of the
// kernel translation units also keeps their compile time down.
//
// Everything here is validated by the caller (csrc/gemm/scaled_mm_entry.cu); the kernels trust it.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

// Operand element types.
enum cw8a8_ab_type { CW8A8_AB_INT8 = 0, CW8A8_AB_FP8_E4M3 = 1 };
// Output element types.
enum cw8a8_out_type { CW8A8_OUT_BF16 = 0, CW8A8_OUT_F16 = 1 };

// D[M, N] = scale_a * scale_b * (A[M, K] @ B[K, N]) (+ bias[N]).
//   A: row-major, element (m, k) at a[m * lda + k].
//   B: column-major, element (k, n) at b[n * ldb + k] (the [N, K] row-major weight).
//   D: row-major, element (m, n) at d[m * ldd + n].
//   scale_a: float32, M values (per-token) or 1 (per-tensor); scale_b: N values (per-channel) or 1.
//   bias: N values of the output type, or NULL.
// Block-scaled fp8 (scale_block = 1; float8_e4m3fn operands, K a multiple of 128, KB = K / 128):
//   D[m, n] = sum over kb of scale_a[m * KB + kb] * scale_b[(n / 128) * KB + kb]
//             * (A[m, 128 kb : 128 kb + 128] @ B[128 kb : 128 kb + 128, n])  (+ bias[n]),
//   scale_a float32 [M, KB] row-major (1x128 groups of A), scale_b float32 [ceil(N / 128), KB] row-major (128x128
//   blocks of the [N, K] weight), both contiguous; scale_a_per_token / scale_b_per_channel are then ignored. Only
//   the sm90 library and the decode GEMM implement it (csrc/gemm/EPILOGUES.md writes out the math).
typedef struct cw8a8_scaled_mm_args {
  const void* a;
  const void* b;
  void* d;
  const float* scale_a;
  const float* scale_b;
  const void* bias;
  int64_t m, n, k;
  int64_t lda, ldb, ldd;  // leading strides, in elements
  int scale_a_per_token;    // 1: scale_a has M values; 0: one value
  int scale_b_per_channel;  // 1: scale_b has N values; 0: one value
  int scale_block;          // 1: block-scaled fp8 (above): scale_a [M, K/128], scale_b [ceil(N/128), K/128]
  int ab_type;              // cw8a8_ab_type
  int out_type;             // cw8a8_out_type
  int device;               // CUDA device ordinal the pointers live on
  int sm_count;             // multiprocessors on that device
  int config;               // -1: choose by shape; >= 0: force this entry of the config table (tuning) that
                            // cw8a8_config_table_of(this) names
  int pdl;                  // 1: launch with programmatic dependent launch where the kernel supports it
                            // (the sm90 kernels wait on griddepcontrol before touching global memory)
  int fp8_fast_accum;       // row-wise fp8 (ab_type FP8_E4M3, scale_block 0) with config < 0: 1 chooses among the
                            // fast-accumulation configs, 0 among the accurate ones (partial sums promoted into
                            // float32 every 128 of K); the sm90 library's select_fp8 reads it, int8, block-scaled
                            // fp8, the decode GEMM and the sm80 / sm89 libraries ignore it
  cudaStream_t stream;
} cw8a8_scaled_mm_args;

// Workspace allocator supplied by the caller (the torch caching allocator in practice). Returns NULL on
// failure. The memory must stay valid until the work enqueued on `stream` has run.
typedef void* (*cw8a8_alloc_fn)(void* ctx, size_t bytes);

// Returns 0 on success. On failure returns non-zero and writes a NUL-terminated message into err.
typedef int (*cw8a8_scaled_mm_fn)(const cw8a8_scaled_mm_args* args, cw8a8_alloc_fn alloc, void* alloc_ctx,
                                  char* err, size_t err_len);

// A kernel launch described without launching it: what a CUDA-graph kernel node needs to be updated in place
// (cudaGraphExecKernelNodeSetParams) to run `args`. The kernel takes one by-value parameter, `params`.
#define CW8A8_NODE_PARAMS_BYTES 4096
typedef struct cw8a8_kernel_node {
  void* func;               // the __global__ function
  unsigned grid[3];         // gridDim
  unsigned block[3];        // blockDim
  unsigned cluster[3];      // thread-block cluster shape the kernel was compiled for (1, 1, 1: none)
  size_t smem_bytes;        // dynamic shared memory
  int config;               // the config table entry this describes
  int pdl_safe;             // 1: every global read of the kernel waits on griddepcontrol, so it may sit behind a
                            // programmatic (PDL) edge; 0: the library launches it without PDL, and a graph node
                            // captured with a PDL edge must never be switched to it
  size_t params_bytes;      // bytes of `params` used
  unsigned char params[CW8A8_NODE_PARAMS_BYTES];  // the kernel's parameter block (CUTLASS Params), bytes
} cw8a8_kernel_node;

// Fills `node` for `args` (args.config < 0: the config the library would choose, as scaled_mm does) and sets
// the kernel's dynamic shared-memory limit on the current device. Nothing is launched. When `exec` is not
// NULL, also applies the description to kernel node `graph_node` of that instantiated graph
// (cudaGraphExecKernelNodeSetParams, called from inside the library, whose runtime registered the kernel).
// Returns 0, or non-zero with a message in err (e.g. a config that needs a workspace, which a node update
// cannot provide).
typedef int (*cw8a8_scaled_mm_node_fn)(const cw8a8_scaled_mm_args* args, cw8a8_kernel_node* node,
                                       cudaGraphExec_t exec, cudaGraphNode_t graph_node, char* err,
                                       size_t err_len);

// A library's config tables, one per kernel family. The ids of the first two equal the cw8a8_ab_type of their
// operands (per-tensor / per-token / per-channel scales), so callers that pass an ab_type keep working; block-scaled
// fp8 (scale_block = 1) has a table of its own. `config` of cw8a8_scaled_mm_args, cw8a8_kernel_node.config and
// _scaled_mm_config's `config` index the table of their arguments, cw8a8_config_table_of.
enum cw8a8_config_table {
  CW8A8_TABLE_INT8 = 0,       // = CW8A8_AB_INT8
  CW8A8_TABLE_FP8 = 1,        // = CW8A8_AB_FP8_E4M3
  CW8A8_TABLE_FP8_BLOCK = 2,  // float8_e4m3fn with scale_block = 1 (sm90 only; the other libraries have 0 entries)
};

static inline int cw8a8_config_table_of(const cw8a8_scaled_mm_args* args) {
  return args->scale_block ? CW8A8_TABLE_FP8_BLOCK : args->ab_type;
}

// Number of entries in a library's config table `table` (a cw8a8_config_table: shipped configs, then any tuning
// candidates built in; 0 for a table the library does not have) and the name of entry i (NULL past the end).
// The sm90 library exports them as cw8a8_sm90_num_configs / cw8a8_sm90_config_name (bench/tune_sm90.py reads them
// with ctypes; names read "[swap_]<tile M>x<N>x<K>_c<cluster M>x<N>_<pingpong|cooperative>_persistent[_fastaccum]
// [_waves][_swizzle<S>]" in every table, the kernel's own frame). A tuning build (setup.py CUTLASS_W8A8_TUNE) may hold the
// candidates of some tables only. The sm90 library also exports cw8a8_sm90_select_config: the index its dispatch
// picks for a shape (and, for the fp8 table, fp8_fast_accum as in cw8a8_scaled_mm_args; only bench/tune_sm90.py
// reads it).
typedef int (*cw8a8_num_configs_fn)(int table);
typedef const char* (*cw8a8_config_name_fn)(int table, int i);
typedef int (*cw8a8_select_config_fn)(int table, int64_t m, int64_t n, int64_t k, int sm_count, int fp8_fast_accum);

// Grouped GEMM for mixture-of-experts (issue 27): the rows of A are grouped by expert, expert e owning rows
// [offsets[e - 1], offsets[e]) (offsets[-1] read as 0), and
//   D[t, n] = scale_a(t) * scale_b(e, n) * (A[t, :] @ B_e[:, n]) (+ bias[e * N + n])   for t in expert e's rows,
//   A: [T, K] row-major, element (t, k) at a[t * lda + k].
//   B_e: column-major [K, N] (the expert's [N, K] row-major weight), element (k, n) at b[e * stride_b_e + n * ldb + k].
//   D: [T, N] row-major, element (t, n) at d[t * ldd + n]; rows t >= offsets[E - 1] are not written.
//   scale_a: float32, T values (per-token) or 1 (per-tensor); scale_b: E * N values (per-channel, [E, N] row-major)
//   or E values (one per expert).
//   Block-scaled fp8 (scale_block = 1; e4m3 operands, K % 128 == 0, KB = K / 128, NB = ceil(N / 128)):
//   D[t, n] = sum over kb of scale_a[t * KB + kb] * scale_b[(e * NB + n / 128) * KB + kb] * (A[t, kb] . B_e[kb, n]).
//   offsets: int32 [E] in device memory, read only on the device (no host synchronisation); the library clamps
//   them into a non-decreasing sequence within [0, T] before use, so bad offsets cannot make it read or write
//   out of bounds (the CPU reference raises on them instead).
typedef struct cw8a8_grouped_mm_args {
  const void* a;
  const void* b;
  void* d;
  const float* scale_a;
  const float* scale_b;
  const void* bias;         // E * N values of the output type ([E, N] row-major), or NULL
  const int32_t* offsets;   // [E], device
  int64_t t, n, k, num_experts;
  int64_t lda, ldb, ldd;    // leading strides, in elements
  int64_t stride_b_e;       // elements between two experts' weights (N * K for a contiguous [E, N, K] weight)
  int scale_a_per_token;    // 1: scale_a has T values; 0: one value
  int scale_b_per_channel;  // 1: scale_b has E * N values; 0: E values
  int scale_block;          // 1: block-scaled fp8 (above)
  int ab_type;              // cw8a8_ab_type
  int out_type;             // cw8a8_out_type
  int device;
  int sm_count;
  int config;               // -1: choose by shape; >= 0: force an entry of the library's grouped table
  int pdl;
  cudaStream_t stream;
} cw8a8_grouped_mm_args;

// Same conventions as cw8a8_scaled_mm_fn (workspace from `alloc`: the per-expert problem sizes and pointer arrays,
// built on the device by a small kernel on `stream` before the GEMM). The sm90 library exports it as
// cw8a8_sm90_grouped_mm.
typedef int (*cw8a8_grouped_mm_fn)(const cw8a8_grouped_mm_args* args, cw8a8_alloc_fn alloc, void* alloc_ctx,
                                   char* err, size_t err_len);

// The grouped table a call's `config` indexes (the ids of cw8a8_config_table, as cw8a8_config_table_of). The sm90
// library exports each table's size and names as cw8a8_sm90_grouped_num_configs / cw8a8_sm90_grouped_config_name
// (cw8a8_num_configs_fn / cw8a8_config_name_fn): its shipped configs (indices 0 / 1 / 2: few / mid / many rows per
// expert), then any tuning candidates a tuning build (setup.py CUTLASS_W8A8_TUNE naming grouped) compiled.
static inline int cw8a8_grouped_table_of(const cw8a8_grouped_mm_args* args) {
  return args->scale_block ? CW8A8_TABLE_FP8_BLOCK : args->ab_type;
}

#ifdef __cplusplus
}
#endif
