#include <meshtorch/layout/mesh.hpp>
meshtorch::Mesh<meshtorch::DP<2>, meshtorch::TP<0>> mesh;
