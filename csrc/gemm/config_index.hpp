// `index_of<Cfg, Table>`: the position of a kernel config in a dispatch table (a std::tuple of config types),
// shared by the per-arch kernel libraries (torch-free, header-only). The dispatch functions return table
// indices by name with it (`index_of<Int8_M32, Int8Configs>`), and it is a compile error unless the config
// occurs in the table exactly once, so reordering or inserting a table row cannot silently change a bucket.
#pragma once

#include <tuple>
#include <type_traits>

namespace cutlass_w8a8::gemm {

template <class Cfg, class... Cs>
constexpr int index_in(const std::tuple<Cs...>*) {
  constexpr bool same[] = {std::is_same_v<Cfg, Cs>...};
  int index = -1;
  for (int i = 0; i < static_cast<int>(sizeof...(Cs)); ++i) {
    if (same[i]) index = index == -1 ? i : -2;
  }
  return index;
}

template <class Cfg, class Table>
struct IndexOf {
  static constexpr int value = index_in<Cfg>(static_cast<const Table*>(nullptr));
  static_assert(value >= 0, "the config is not in the table, or is in it more than once");
};

template <class Cfg, class Table>
inline constexpr int index_of = IndexOf<Cfg, Table>::value;

}  // namespace cutlass_w8a8::gemm
