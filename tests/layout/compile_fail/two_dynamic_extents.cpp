#include <meshtorch/layout/mesh.hpp>
meshtorch::Mesh<meshtorch::DP<meshtorch::dynamic>, meshtorch::TP<meshtorch::dynamic>> mesh;
