// Transitional umbrella: the helpers that lived here are now core/device.hpp (current_stream, device_info, the
// arch ladder), core/checks.hpp (argument checks, py_dtype / py_tuple) and core/limits.hpp (kInt8MaxK). Files
// still including this header keep compiling; include those headers directly instead, then delete this one.
#pragma once

#include "core/checks.hpp"
#include "core/device.hpp"
#include "core/limits.hpp"

namespace cutlass_w8a8 {

// Old name of limits::kInt8MaxK.
constexpr int64_t kMaxInt8K = limits::kInt8MaxK;

}  // namespace cutlass_w8a8
