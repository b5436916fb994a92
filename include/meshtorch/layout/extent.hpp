#pragma once
// meshtorch::dynamic marks a mesh extent that is resolved from the world size at init, the way
// std::dynamic_extent marks a span or mdspan extent known only at run time.
#include <cstddef>
#include <span>

namespace meshtorch {

inline constexpr std::size_t dynamic = std::dynamic_extent;

}  // namespace meshtorch
