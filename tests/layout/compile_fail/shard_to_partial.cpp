#include <meshtorch/layout/redistribution.hpp>
constexpr auto collective = meshtorch::collective_for<meshtorch::Shard<0>, meshtorch::Partial>;
