// Rank <-> coordinate maps and axis slices of static and dynamic meshes, checked against tables
// written out by hand. Most checks are static_asserts: they run when this file compiles.
#include <catch2/catch.hpp>

#include <array>
#include <string>
#include <vector>

#include <meshtorch/layout/layout.hpp>

using namespace meshtorch;

namespace {

using Mesh1D = Mesh<DP<4>>;
static_assert(Mesh1D::ndim == 1 && Mesh1D::size == 4 && Mesh1D::is_static);
static_assert(Mesh1D::name == "Mesh<DP<4>>");
static_assert(Mesh1D::coord_of(3) == std::array{3});
static_assert(Mesh1D::rank_of({2}) == 2);
static_assert(Mesh1D::slice_ranks<DP>(2) == std::array{0, 1, 2, 3});
static_assert(Mesh1D::slices<DP>().size() == 1);

// Row-major, last axis fastest: TP neighbours are consecutive ranks.
using Mesh2D = Mesh<DP<2>, TP<3>>;
static_assert(Mesh2D::size == 6 && Mesh2D::index_of<DP> == 0 && Mesh2D::index_of<TP> == 1);
static_assert(Mesh2D::has<TP> && Mesh2D::has<DP> && !Mesh2D::has<FSDP>);
static_assert(Mesh2D::static_extent<TP> == 3);
constexpr std::array<std::array<int, 2>, 6> coords2d{{{0, 0}, {0, 1}, {0, 2}, {1, 0}, {1, 1}, {1, 2}}};
static_assert([] {
  for (int r = 0; r < 6; ++r)
    if (Mesh2D::coord_of(r) != coords2d[r] || Mesh2D::rank_of(coords2d[r]) != r) return false;
  return true;
}());
static_assert(Mesh2D::coord<TP>(5) == 2 && Mesh2D::coord<DP>(5) == 1);
static_assert(Mesh2D::slices<TP>() == std::array{std::array{0, 1, 2}, std::array{3, 4, 5}});
static_assert(Mesh2D::slices<DP>() ==
              std::array{std::array{0, 3}, std::array{1, 4}, std::array{2, 5}});
static_assert(Mesh2D::slice_ranks<DP>(4) == std::array{1, 4});
static_assert(Mesh2D::slice_ranks<TP>(4) == std::array{3, 4, 5});

// HSDP: Mesh<DP<2>, FSDP<2>, TP<2>>.
using Mesh3D = Mesh<DP<2>, FSDP<2>, TP<2>>;
static_assert(Mesh3D::size == 8 && Mesh3D::name == "Mesh<DP<2>, FSDP<2>, TP<2>>");
constexpr std::array<std::array<int, 3>, 8> coords3d{{{0, 0, 0}, {0, 0, 1}, {0, 1, 0}, {0, 1, 1},
                                                      {1, 0, 0}, {1, 0, 1}, {1, 1, 0}, {1, 1, 1}}};
static_assert([] {
  for (int r = 0; r < 8; ++r)
    if (Mesh3D::coord_of(r) != coords3d[r] || Mesh3D::rank_of(coords3d[r]) != r) return false;
  return true;
}());
static_assert(Mesh3D::slices<TP>() ==
              std::array{std::array{0, 1}, std::array{2, 3}, std::array{4, 5}, std::array{6, 7}});
static_assert(Mesh3D::slices<FSDP>() ==
              std::array{std::array{0, 2}, std::array{1, 3}, std::array{4, 6}, std::array{5, 7}});
static_assert(Mesh3D::slices<DP>() ==
              std::array{std::array{0, 4}, std::array{1, 5}, std::array{2, 6}, std::array{3, 7}});
static_assert(Mesh3D::slice_ranks<FSDP>(5) == std::array{5, 7});
static_assert(Mesh3D::slice_ranks<DP>(6) == std::array{2, 6});

// Uneven 3-d mesh, a few ranks by hand: 13 = 1*8 + 1*4 + 1.
using Mesh3DUneven = Mesh<DP<3>, FSDP<2>, TP<4>>;
static_assert(Mesh3DUneven::size == 24);
static_assert(Mesh3DUneven::coord_of(13) == std::array{1, 1, 1});
static_assert(Mesh3DUneven::coord_of(23) == std::array{2, 1, 3});
static_assert(Mesh3DUneven::slice_ranks<TP>(13) == std::array{12, 13, 14, 15});
static_assert(Mesh3DUneven::slice_ranks<FSDP>(13) == std::array{9, 13});
static_assert(Mesh3DUneven::slice_ranks<DP>(13) == std::array{5, 13, 21});
static_assert(Mesh3DUneven::slices<FSDP>().size() == 12);
static_assert(Mesh3DUneven::slices<FSDP>()[5] == std::array{9, 13});

// Dynamic extents: the type knows what is static; MeshShape knows the rest.
using DynamicDP = Mesh<DP<dynamic>, TP<2>>;
static_assert(!DynamicDP::is_static && DynamicDP::dynamic_index == 0);
static_assert(DynamicDP::static_product == 2 && DynamicDP::static_extent<DP> == dynamic);
static_assert(DynamicDP::name == "Mesh<DP<dynamic>, TP<2>>");
template <class M>
concept HasStaticSize = requires { M::size; };
static_assert(!HasStaticSize<DynamicDP> && HasStaticSize<Mesh2D>);

constexpr auto dp4tp2 = MeshShape<DynamicDP>::resolve(8);
static_assert(dp4tp2.extents() == std::array{4, 2} && dp4tp2.size() == 8);
static_assert(dp4tp2.extent<DP>() == 4 && dp4tp2.extent<TP>() == 2);
static_assert(dp4tp2.coord_of(7) == std::array{3, 1} && dp4tp2.coord<DP>(5) == 2);
static_assert(dp4tp2.slice_ranks<DP>(3) == std::vector{1, 3, 5, 7});
// GCC 12 cannot build a nested std::vector from braces in a constant expression; compare to arrays.
template <std::size_t Count, std::size_t Extent>
constexpr bool same_slices(const std::vector<std::vector<int>>& got,
                           const std::array<std::array<int, Extent>, Count>& expected) {
  if (got.size() != Count) return false;
  for (std::size_t n = 0; n < Count; ++n)
    if (got[n] != std::vector<int>(expected[n].begin(), expected[n].end())) return false;
  return true;
}
static_assert(same_slices(dp4tp2.slices<TP>(), std::array{std::array{0, 1}, std::array{2, 3},
                                                          std::array{4, 5}, std::array{6, 7}}));

constexpr auto fsdp2tp3 = MeshShape<Mesh<FSDP<2>, TP<dynamic>>>::resolve(6);
static_assert(fsdp2tp3.extents() == std::array{2, 3});
static_assert(same_slices(fsdp2tp3.slices<FSDP>(),
                          std::array{std::array{0, 3}, std::array{1, 4}, std::array{2, 5}}));

// A static mesh's shape needs no world size, and agrees with the type's own maps.
static_assert(MeshShape<Mesh3D>{}.slice_ranks<FSDP>(5) == std::vector{5, 7});
static_assert(MeshShape<Mesh3D>::resolve(8) == MeshShape<Mesh3D>{});

static_assert(Axis<DP<2>> && Axis<TP<dynamic>> && !Axis<int> && !Axis<std::array<int, 2>>);
static_assert(MeshType<Mesh2D> && !MeshType<DP<2>> && !MeshType<int>);
static_assert(MeshWithAxis<Mesh2D, TP> && !MeshWithAxis<Mesh2D, FSDP>);
static_assert(same_axis_kind<DP<2>, DP<dynamic>> && !same_axis_kind<DP<2>, FSDP<2>>);
static_assert(axis<TP>.name == "TP");

}  // namespace

TEST_CASE("a dynamic extent is the world size over the static extents") {
  CHECK(MeshShape<Mesh<DP<dynamic>>>::resolve(5).extents() == std::array{5});
  CHECK(MeshShape<Mesh<DP<2>, FSDP<dynamic>, TP<2>>>::resolve(12).extents() ==
        std::array{2, 3, 2});
  CHECK(MeshShape<Mesh<DP<2>, FSDP<dynamic>, TP<2>>>::resolve(12).to_string() ==
        "Mesh<DP=2, FSDP=3, TP=2>");
}

TEST_CASE("a world size the mesh cannot fit is an EnvError naming the mesh and the fix") {
  CHECK_THROWS_WITH(MeshShape<DynamicDP>::resolve(7),
                    "world size 7 is not a multiple of 2, the product of the static extents of "
                    "Mesh<DP<dynamic>, TP<2>>; launch a multiple of 2 ranks");
  CHECK_THROWS_WITH(MeshShape<Mesh2D>::resolve(4),
                    "world size 4 does not match Mesh<DP<2>, TP<3>>, which has 6 ranks; launch 6 "
                    "ranks, or make one axis meshtorch::dynamic");
  CHECK_THROWS_AS(MeshShape<DynamicDP>::resolve(0), EnvError);
}

TEST_CASE("every rank lies in exactly one slice of each axis, at its own coordinate") {
  const auto shape = MeshShape<Mesh<DP<dynamic>, FSDP<2>, TP<2>>>::resolve(12);
  for (std::size_t axis_index = 0; axis_index < 3; ++axis_index) {
    std::vector<int> seen(12, 0);
    for (const auto& slice : shape.slices(axis_index)) {
      REQUIRE(static_cast<int>(slice.size()) == shape.extent(axis_index));
      for (int position = 0; position < static_cast<int>(slice.size()); ++position) {
        const int rank = slice[position];
        ++seen[rank];
        INFO("axis " << axis_index << " rank " << rank);
        CHECK(shape.coord_of(rank)[axis_index] == position);
        CHECK(shape.slice_ranks(axis_index, rank) == slice);
      }
    }
    CHECK(seen == std::vector<int>(12, 1));
  }
}
