#include <meshtorch/layout/mesh.hpp>
// Mesh<FSDP, TP> has no DP axis, so there is no DP+FSDP group to merge.
constexpr auto mask = meshtorch::Mesh<meshtorch::FSDP<2>, meshtorch::TP<2>>::mask_of<meshtorch::DP, meshtorch::FSDP>;
