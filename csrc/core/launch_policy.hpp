// Launch policy: whether kernels launch with programmatic dependent launch (PDL), and which GEMM kernel family
// serves scaled_mm at decode sizes. Decided here and nowhere else.
//
// With PDL a kernel's CTAs start their prologue while the previous kernel on the stream finishes and wait on
// griddepcontrol before reading its results. Every kernel of this extension waits before its first access to
// memory another kernel writes, and signals its dependents early (the row-wise ops, rotary, attention: at their
// start; the decode GEMM: once its loads are issued), so a decode step is one chain in which each kernel's launch,
// prologue and weight prefetch (the decode GEMM's L2 prefetch) overlap its predecessor. Results are identical
// either way; only the gaps between kernels change.
#pragma once

#include <cstdint>

#include "core/device.hpp"

namespace cutlass_w8a8 {

// PDL applies to the CUTLASS sm90 scaled_mm GEMMs with M (tokens) up to this. Measured on an H200
// (bench/results/gemm_nvidia-h200.md, PDL columns, from a sweep with PDL at every M): PDL sped up every shape at
// M <= 16 (GEMM 1.00-1.22x, W8A8Linear forward 0.98-1.23x) but slowed most larger-M points (down to 0.76x for
// the GEMM and 0.63x for the forward).
constexpr int64_t kPdlMaxM = 16;

// The process-wide switch (cutlass_w8a8.pdl_enabled / set_pdl): on unless CUTLASS_W8A8_PDL=0 was in the
// environment at the first query. set_pdl changes it for later launches and returns the previous setting.
bool pdl_enabled();
bool set_pdl(bool enabled);

// A CUTLASS scaled_mm launch on `backend` with M = m. Only the sm90 kernels wait on griddepcontrol (the CUTLASS
// 2.x ones must never be launched with PDL), and only for m <= kPdlMaxM, except while recording an UpdatableGraph
// (`recording`): such a node is meant to be resized, typically down to decode sizes, and an update cannot add
// the programmatic edge later.
bool gemm_uses_pdl(GemmBackend backend, int64_t m, bool recording);

// The extension's own kernels (decode GEMM, row-wise quantization / norm / activation, rotary + cache write,
// decode attention): on compute capability 9.0 or newer, whenever the switch is on. They all wait on
// griddepcontrol before touching memory a predecessor may write (a no-op when launched without PDL).
bool kernels_use_pdl(int device);

// scaled_mm's decode bound: M up to this goes to the decode GEMM (gemm/decode, scaled_mm_decode) instead of
// CUTLASS. Measured on an H100 (bench/results/decode_gemm_nvidia-h100-80gb-hbm3.md): the decode kernel was
// faster on every Llama-3 8B / 70B shape at M <= 8 but one (70B down, 1-3% slower), and mixed at 9..16.
constexpr int64_t kDecodeGemmMaxM = 8;

// The bound in effect (kDecodeGemmMaxM unless changed; 0 turns the decode path off) and its setter, which returns
// the previous bound (the non-tensor op _set_decode_gemm_max_m: benchmarks A/B the two kernel families with it).
int64_t decode_gemm_max_m();
int64_t set_decode_gemm_max_m(int64_t m);

// Whether scaled_mm runs the decode GEMM for M = m on `backend`: sm90 only (where it was measured), m within the
// bound, and not while recording an UpdatableGraph (a recorded GEMM node must be a CUTLASS node, whose operands
// UpdatableGraph.update_scaled_mm can rebind).
bool scaled_mm_uses_decode(GemmBackend backend, int64_t m, bool recording);

}  // namespace cutlass_w8a8
