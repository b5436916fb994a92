#include <meshtorch/layout/mesh.hpp>
meshtorch::Mesh<meshtorch::DP<2>, int> mesh;
