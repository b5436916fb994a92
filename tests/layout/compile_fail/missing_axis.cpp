#include <meshtorch/layout/mesh.hpp>
constexpr auto tp_index = meshtorch::Mesh<meshtorch::DP<2>>::index_of<meshtorch::TP>;
