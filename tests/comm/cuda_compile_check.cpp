// Compiles (never runs) the NCCL paths of the comm layer: built only by the CUDA compile check.
#include <meshtorch/comm/comm.hpp>
#include <meshtorch/layout/layout.hpp>

namespace mt = meshtorch;
template mt::comm::DeviceMesh<mt::Mesh<mt::DP<mt::dynamic>, mt::TP<2>>> mt::comm::init(
    mt::comm::InitOptions);
