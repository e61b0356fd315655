// Per-process A/B switches of the kernels, read from the environment (decode attention's and the MoE decode
// path's): one parser, one message form.
#pragma once

#include <cstdlib>
#include <initializer_list>
#include <string>

#include <c10/util/Exception.h>

namespace cutlass_w8a8 {

// The value of environment variable `name`: "" when unset or empty, else one of `allowed`; any other value raises a
// ValueError "<op>: <name> must be <a>, <b> or <c> (or unset), got '<value>'" (a typo would otherwise measure the
// default). Callers keep the result in a function-local static, so the variable is read once per process; a read
// that raised is tried again on the next call (C++ retries a static initialization that threw).
inline std::string env_choice(const char* op, const char* name, std::initializer_list<const char*> allowed) {
  const char* env = std::getenv(name);
  const std::string value = env == nullptr ? "" : env;
  if (value.empty()) return value;
  bool ok = false;
  std::string choices;
  size_t i = 0;
  for (const char* a : allowed) {
    ok = ok || value == a;
    choices += i == 0 ? "" : (i + 1 == allowed.size() ? " or " : ", ");
    choices += a;
    ++i;
  }
  TORCH_CHECK_VALUE(ok, op, ": ", name, " must be ", choices, " (or unset), got '", value, "'");
  return value;
}

}  // namespace cutlass_w8a8
