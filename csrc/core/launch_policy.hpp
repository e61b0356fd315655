// Launch policy: whether kernels launch with programmatic dependent launch (PDL). Decided here and nowhere else.
//
// With PDL a kernel's CTAs start their prologue while the previous kernel on the stream finishes (the
// quantization kernels signal early) and wait on griddepcontrol before reading its results. Results are identical
// either way; only the gap between kernels changes.
#pragma once

#include <cstdint>

#include "core/device.hpp"

namespace cutlass_w8a8 {

// PDL applies to scaled_mm GEMMs with M (tokens) up to this. Measured on an H200 (bench/results/gemm_nvidia-h200.md,
// PDL columns, from a sweep with PDL at every M): PDL sped up every shape at M <= 16 (GEMM 1.00-1.22x, W8A8Linear
// forward 0.98-1.23x) but slowed most larger-M points (down to 0.76x for the GEMM and 0.63x for the forward).
constexpr int64_t kPdlMaxM = 16;

// The process-wide switch (cutlass_w8a8.pdl_enabled / set_pdl): on unless CUTLASS_W8A8_PDL=0 was in the
// environment at the first query. set_pdl changes it for later launches and returns the previous setting.
bool pdl_enabled();
bool set_pdl(bool enabled);

// A scaled_mm launch on `backend` with M = m. Only the sm90 kernels wait on griddepcontrol (the CUTLASS 2.x
// ones must never be launched with PDL), and only for m <= kPdlMaxM, except while recording an UpdatableGraph
// (`recording`): such a node is meant to be resized, typically down to decode sizes, and an update cannot add
// the programmatic edge later.
bool gemm_uses_pdl(GemmBackend backend, int64_t m, bool recording);

// The decode GEMMs (gemm/decode): at any M they serve (<= 16), on compute capability 9.0 or newer.
bool decode_uses_pdl(int device);

}  // namespace cutlass_w8a8
