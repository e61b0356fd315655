// Per-process A/B switches of the kernels, read from the environment (decode attention's and the MoE decode
// path's): one parser, one message form.
#pragma once

#include <cstdlib>
#include <initializer_list>
#include <string>
#include <utility>

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

// The integer value of environment variable `name`: `fallback` when unset or empty; a value that is not a whole
// decimal integer, or that `ok` refuses, raises a ValueError "<op>: <name> must be <what>, got '<value>'". Read once
// per process as env_choice's values are.
template <class Ok>
int env_int(const char* op, const char* name, int fallback, Ok&& ok, const std::string& what) {
  const char* env = std::getenv(name);
  if (env == nullptr || *env == '\0') return fallback;
  char* end = nullptr;
  const long value = std::strtol(env, &end, 10);
  TORCH_CHECK_VALUE(end != nullptr && *end == '\0' && std::forward<Ok>(ok)(value), op, ": ", name, " must be ", what,
                    ", got '", env, "'");
  return static_cast<int>(value);
}

}  // namespace cutlass_w8a8
