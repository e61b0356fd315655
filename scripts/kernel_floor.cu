// The cost of one dependent step between kernels on this GPU, three ways: what a persistent decoder-layer kernel
// (issue 18, "fewer, fatter kernels") could save over the chain of kernels a decode step is now.
//
// Each step does the work of a decode step's glue kernel at batch 1: one CTA of 256 threads reads a 4096-element
// float row that the previous step wrote, reduces it (a block-wide sum, as RMSNorm does) and writes the row + the
// mean back. N = 320 steps (10 per layer of a 32-layer step):
//   1. graph, PDL off: N kernels captured in a CUDA graph, plain stream order.
//   2. graph, PDL on: the same kernels launched with programmatic stream serialization; each signals its
//      dependents at its start and waits (griddepcontrol.wait) before reading, as the extension's kernels do.
//   3. persistent: one cooperative kernel of 2 CTAs per SM doing the N steps in turn, CTA 0 working and every CTA
//      meeting at a grid-wide barrier (cooperative_groups grid.sync) between steps, as a persistent layer kernel
//      whose phases (GEMMs over all SMs, then a norm on one CTA) must meet.
// Prints microseconds per step (median of 20 timed runs, CUDA events). Also checks the final row (each step adds
// the running mean; the three must agree exactly, same float operations in the same order).
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -Icsrc -o /tmp/kernel_floor scripts/kernel_floor.cu && /tmp/kernel_floor
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "core/launch.hpp"  // launch_kernel: the extension's own PDL launch (torch-free)

namespace cg = cooperative_groups;

constexpr int kRow = 4096;
constexpr int kThreads = 256;
constexpr int kSteps = 320;

#define CHECK(x)                                                                              \
  do {                                                                                        \
    cudaError_t e_ = (x);                                                                     \
    if (e_ != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)

__device__ void glue_step(const float* in, float* out) {
  __shared__ float partial[kThreads / 32];
  float v[kRow / kThreads];
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < kRow / kThreads; ++i) {
    v[i] = in[threadIdx.x + i * kThreads];
    s += v[i];
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = s;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) total += partial[w];
  const float mean = total * (1.f / kRow) * 1e-3f;
#pragma unroll
  for (int i = 0; i < kRow / kThreads; ++i) out[threadIdx.x + i * kThreads] = v[i] + mean;
  __syncthreads();
}

__global__ void glue_kernel(const float* in, float* out) {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");
  glue_step(in, out);
}

__global__ void persistent_kernel(float* a, float* b, int steps) {
  cg::grid_group grid = cg::this_grid();
  for (int s = 0; s < steps; ++s) {
    const float* in = (s % 2 == 0) ? a : b;
    float* out = (s % 2 == 0) ? b : a;
    if (blockIdx.x == 0) glue_step(in, out);
    grid.sync();
  }
}

static void launch_glue(const float* in, float* out, cudaStream_t stream, bool pdl) {
  CHECK(cutlass_w8a8::launch_kernel(glue_kernel, dim3(1), dim3(kThreads), 0, stream, pdl, in, out));
}

static float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int main() {
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  float *a, *b;
  CHECK(cudaMalloc(&a, kRow * sizeof(float)));
  CHECK(cudaMalloc(&b, kRow * sizeof(float)));
  std::vector<float> init(kRow);
  for (int i = 0; i < kRow; ++i) init[i] = static_cast<float>((i * 7919) % 1000) / 1000.f;
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  auto reset = [&] { CHECK(cudaMemcpyAsync(a, init.data(), kRow * sizeof(float), cudaMemcpyHostToDevice, stream)); };
  std::vector<float> results[3];
  const char* names[3] = {"graph, PDL off", "graph, PDL on", "persistent, grid barrier"};
  float us[3];

  for (int mode = 0; mode < 2; ++mode) {
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    for (int s = 0; s < kSteps; ++s) launch_glue(s % 2 == 0 ? a : b, s % 2 == 0 ? b : a, stream, mode == 1);
    CHECK(cudaStreamEndCapture(stream, &graph));
    CHECK(cudaGraphInstantiate(&exec, graph, 0));
    std::vector<float> t;
    for (int r = 0; r < 23; ++r) {
      reset();
      CHECK(cudaEventRecord(e0, stream));
      CHECK(cudaGraphLaunch(exec, stream));
      CHECK(cudaEventRecord(e1, stream));
      CHECK(cudaStreamSynchronize(stream));
      float ms = 0.f;
      CHECK(cudaEventElapsedTime(&ms, e0, e1));
      if (r >= 3) t.push_back(ms);
    }
    us[mode] = median(t) * 1e3f / kSteps;
    results[mode].resize(kRow);
    CHECK(cudaMemcpy(results[mode].data(), kSteps % 2 == 0 ? a : b, kRow * sizeof(float), cudaMemcpyDeviceToHost));
    CHECK(cudaGraphExecDestroy(exec));
    CHECK(cudaGraphDestroy(graph));
  }

  int per_sm = 0;
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, persistent_kernel, kThreads, 0));
  const int ctas = prop.multiProcessorCount * std::min(per_sm, 2);
  {
    std::vector<float> t;
    int steps = kSteps;
    for (int r = 0; r < 23; ++r) {
      reset();
      void* args[] = {&a, &b, &steps};
      CHECK(cudaEventRecord(e0, stream));
      CHECK(cudaLaunchCooperativeKernel(reinterpret_cast<void*>(persistent_kernel), dim3(ctas), dim3(kThreads), args,
                                        0, stream));
      CHECK(cudaEventRecord(e1, stream));
      CHECK(cudaStreamSynchronize(stream));
      float ms = 0.f;
      CHECK(cudaEventElapsedTime(&ms, e0, e1));
      if (r >= 3) t.push_back(ms);
    }
    us[2] = median(t) * 1e3f / kSteps;
    results[2].resize(kRow);
    CHECK(cudaMemcpy(results[2].data(), kSteps % 2 == 0 ? a : b, kRow * sizeof(float), cudaMemcpyDeviceToHost));
  }
  const bool same = results[0] == results[1] && results[0] == results[2];
  std::printf("%s, %d SMs: one dependent glue step (1 CTA x %d threads, a %d-float row read, reduced, written), "
              "%d steps\n", prop.name, prop.multiProcessorCount, kThreads, kRow, kSteps);
  for (int i = 0; i < 3; ++i) std::printf("  %-28s %6.2f us per step\n", names[i], us[i]);
  std::printf("  persistent kernel: %d CTAs (%d per SM resident at most)\n", ctas, per_sm);
  std::printf("  final rows equal across the three: %s\n", same ? "yes" : "NO");
  return same ? 0 : 1;
}
