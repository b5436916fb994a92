#include <meshtorch/layout/redistribution.hpp>
constexpr auto collective = meshtorch::collective_for<meshtorch::Replicate, meshtorch::Partial>;
