#include <meshtorch/layout/mesh.hpp>
meshtorch::Mesh<meshtorch::DP<2>, meshtorch::TP<2>, meshtorch::DP<4>> mesh;
