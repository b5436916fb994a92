// comm::init called with only the umbrella header: its body (Gloo, rendezvous, watchdog) is
// comm/init.hpp, and the error must say to include it.
#include <meshtorch/meshtorch.hpp>

int main() {
  auto mesh = meshtorch::comm::init<meshtorch::Mesh<meshtorch::DP<meshtorch::dynamic>>>({.extents = {2}});
  return mesh.rank();
}
