// One kernel launch with or without programmatic dependent launch (the decision: core/launch_policy.hpp).
// cudaLaunchKernelEx on `stream` with the programmatic-stream-serialization attribute when `pdl`; the kernel then
// may start before its predecessor on the stream has finished, and must wait on griddepcontrol (wait_for_producers
// in quant/rowwise_reduce.cuh) before it touches memory the predecessor writes. Returns the launch's error (wrap
// the call in C10_CUDA_CHECK). Torch-free: the kernel headers include it.
#pragma once

#include <cstddef>
#include <utility>

#include <cuda_runtime.h>

namespace cutlass_w8a8 {

template <class... KArgs, class... Args>
[[nodiscard]] inline cudaError_t launch_kernel(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                          bool pdl, Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

// launch_kernel with thread-block clusters of `cluster` CTAs (sm90 and newer; each grid dimension a multiple of
// the cluster's). A cluster of more than 8 CTAs needs the kernel's cudaFuncAttributeNonPortableClusterSizeAllowed,
// set by the caller once per kernel and device.
template <class... KArgs, class... Args>
[[nodiscard]] inline cudaError_t launch_kernel_cluster(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem,
                                                       cudaStream_t stream, bool pdl, dim3 cluster, Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = cluster.x;
  attr[0].val.clusterDim.y = cluster.y;
  attr[0].val.clusterDim.z = cluster.z;
  attr[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[1].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 2 : 1;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

}  // namespace cutlass_w8a8
