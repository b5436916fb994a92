#pragma once
// A string built during constant evaluation, so that types can carry printable names
// ("Mesh<DP<2>, TP<dynamic>>") without a run-time formatting library.
#include <array>
#include <cstddef>
#include <string_view>

namespace meshtorch {

template <std::size_t Capacity>
struct FixedString {
  std::array<char, Capacity + 1> chars{};
  std::size_t length = 0;

  constexpr FixedString& append(std::string_view text) {
    for (char c : text) {
      // Overflow is a constant-evaluation error rather than a silent truncation.
      if (length == Capacity) throw "FixedString capacity exceeded";
      chars[length++] = c;
    }
    return *this;
  }

  constexpr FixedString& append_number(long long value) {
    if (value < 0) {
      append("-");
      value = -value;
    }
    char digits[24]{};
    int count = 0;
    do {
      digits[count++] = static_cast<char>('0' + value % 10);
      value /= 10;
    } while (value != 0);
    while (count > 0) append(std::string_view(&digits[--count], 1));
    return *this;
  }

  constexpr std::string_view view() const { return {chars.data(), length}; }
};

}  // namespace meshtorch
