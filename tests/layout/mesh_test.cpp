// Rank <-> coordinate maps and axis slices of static and dynamic meshes, checked against tables
// written out by hand. Most checks are static_asserts: they run when this file compiles.
#include <array>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include <meshtorch/layout/layout.hpp>

using namespace meshtorch;

namespace {

// GCC 12 cannot build a nested std::vector from braces in a constant expression; compare to arrays.
template <std::size_t Count, std::size_t Extent>
constexpr bool same_slices(const std::vector<std::vector<int>>& got,
                           const std::array<std::array<int, Extent>, Count>& expected) {
  if (got.size() != Count) return false;
  for (std::size_t n = 0; n < Count; ++n)
    if (got[n] != std::vector<int>(expected[n].begin(), expected[n].end())) return false;
  return true;
}

using Mesh1D = Mesh<DP<4>>;
static_assert(Mesh1D::ndim == 1 && Mesh1D::size == 4 && Mesh1D::is_static);
static_assert(Mesh1D::name == "Mesh<DP<4>>");
constexpr MeshShape<Mesh1D> shape1d;
static_assert(shape1d.coord_of(3) == std::array{3});
static_assert(shape1d.rank_of({2}) == 2);
static_assert(shape1d.slice_ranks<DP>(2) == std::vector{0, 1, 2, 3});
static_assert(shape1d.slices<DP>().size() == 1);

// Row-major, last axis fastest: TP neighbours are consecutive ranks.
using Mesh2D = Mesh<DP<2>, TP<3>>;
constexpr MeshShape<Mesh2D> shape2d;
static_assert(Mesh2D::size == 6 && Mesh2D::index_of<DP> == 0 && Mesh2D::index_of<TP> == 1);
static_assert(Mesh2D::has<TP> && Mesh2D::has<DP> && !Mesh2D::has<FSDP>);
static_assert(Mesh2D::static_extent<TP> == 3);
constexpr std::array<std::array<int, 2>, 6> coords2d{{{0, 0}, {0, 1}, {0, 2}, {1, 0}, {1, 1}, {1, 2}}};
static_assert([] {
  for (int r = 0; r < 6; ++r)
    if (shape2d.coord_of(r) != coords2d[r] || shape2d.rank_of(coords2d[r]) != r) return false;
  return true;
}());
static_assert(shape2d.coord<TP>(5) == 2 && shape2d.coord<DP>(5) == 1);
static_assert(same_slices(shape2d.slices<TP>(), std::array{std::array{0, 1, 2}, std::array{3, 4, 5}}));
static_assert(same_slices(shape2d.slices<DP>(), std::array{std::array{0, 3}, std::array{1, 4}, std::array{2, 5}}));
static_assert(shape2d.slice_ranks<DP>(4) == std::vector{1, 4});
static_assert(shape2d.slice_ranks<TP>(4) == std::vector{3, 4, 5});
// Merging both axes of a 2-d mesh gives the world, in rank order.
static_assert(shape2d.slice_ranks<DP, TP>(4) == std::vector{0, 1, 2, 3, 4, 5});
static_assert(Mesh2D::mask_of<TP, DP> == 3u && Mesh2D::mask_of<TP> == 2u);

// HSDP and 3D: Mesh<DP<2>, FSDP<2>, TP<2>>.
using Mesh3D = Mesh<DP<2>, FSDP<2>, TP<2>>;
constexpr MeshShape<Mesh3D> shape3d;
static_assert(Mesh3D::size == 8 && Mesh3D::name == "Mesh<DP<2>, FSDP<2>, TP<2>>");
constexpr std::array<std::array<int, 3>, 8> coords3d{
    {{0, 0, 0}, {0, 0, 1}, {0, 1, 0}, {0, 1, 1}, {1, 0, 0}, {1, 0, 1}, {1, 1, 0}, {1, 1, 1}}};
static_assert([] {
  for (int r = 0; r < 8; ++r)
    if (shape3d.coord_of(r) != coords3d[r] || shape3d.rank_of(coords3d[r]) != r) return false;
  return true;
}());
static_assert(same_slices(shape3d.slices<TP>(),
                          std::array{std::array{0, 1}, std::array{2, 3}, std::array{4, 5}, std::array{6, 7}}));
static_assert(same_slices(shape3d.slices<FSDP>(),
                          std::array{std::array{0, 2}, std::array{1, 3}, std::array{4, 6}, std::array{5, 7}}));
static_assert(same_slices(shape3d.slices<DP>(),
                          std::array{std::array{0, 4}, std::array{1, 5}, std::array{2, 6}, std::array{3, 7}}));
static_assert(shape3d.slice_ranks<FSDP>(5) == std::vector{5, 7});
static_assert(shape3d.slice_ranks<DP>(6) == std::vector{2, 6});
// The data-parallel group of 3D: the ranks at the same TP coordinate, DP-major.
static_assert(same_slices(shape3d.slices<DP, FSDP>(), std::array{std::array{0, 2, 4, 6}, std::array{1, 3, 5, 7}}));
static_assert(shape3d.slice_ranks<DP, FSDP>(5) == std::vector{1, 3, 5, 7});
static_assert(shape3d.size(Mesh3D::mask_of<DP, FSDP>) == 4);

// Uneven 3-d mesh, a few ranks by hand: 13 = 1*8 + 1*4 + 1.
using Mesh3DUneven = Mesh<DP<3>, FSDP<2>, TP<4>>;
constexpr MeshShape<Mesh3DUneven> uneven;
static_assert(Mesh3DUneven::size == 24);
static_assert(uneven.coord_of(13) == std::array{1, 1, 1});
static_assert(uneven.coord_of(23) == std::array{2, 1, 3});
static_assert(uneven.slice_ranks<TP>(13) == std::vector{12, 13, 14, 15});
static_assert(uneven.slice_ranks<FSDP>(13) == std::vector{9, 13});
static_assert(uneven.slice_ranks<DP>(13) == std::vector{5, 13, 21});
static_assert(uneven.slices<FSDP>().size() == 12);
static_assert(uneven.slices<FSDP>()[5] == std::vector{9, 13});
static_assert(uneven.slice_ranks<DP, FSDP>(13) == std::vector{1, 5, 9, 13, 17, 21});

// Dynamic extents: the type knows what is static; MeshShape knows the rest.
using DynamicDP = Mesh<DP<dynamic>, TP<2>>;
static_assert(!DynamicDP::is_static && DynamicDP::dynamic_count == 1);
static_assert(DynamicDP::static_product == 2 && DynamicDP::static_extent<DP> == dynamic);
static_assert(DynamicDP::name == "Mesh<DP<dynamic>, TP<2>>");
template <class M>
concept HasStaticSize = requires {
  M::size;
};
static_assert(!HasStaticSize<DynamicDP> && HasStaticSize<Mesh2D>);

constexpr auto dp4tp2 = MeshShape<DynamicDP>::resolve(8);
static_assert(dp4tp2.extents() == std::array{4, 2} && dp4tp2.size() == 8);
static_assert(dp4tp2.extent<DP>() == 4 && dp4tp2.extent<TP>() == 2);
static_assert(dp4tp2.coord_of(7) == std::array{3, 1} && dp4tp2.coord<DP>(5) == 2);
static_assert(dp4tp2.slice_ranks<DP>(3) == std::vector{1, 3, 5, 7});
static_assert(same_slices(dp4tp2.slices<TP>(),
                          std::array{std::array{0, 1}, std::array{2, 3}, std::array{4, 5}, std::array{6, 7}}));

constexpr auto fsdp2tp3 = MeshShape<Mesh<FSDP<2>, TP<dynamic>>>::resolve(6);
static_assert(fsdp2tp3.extents() == std::array{2, 3});
static_assert(same_slices(fsdp2tp3.slices<FSDP>(), std::array{std::array{0, 3}, std::array{1, 4}, std::array{2, 5}}));

// Only the dynamic extents are stored, as std::extents stores them: a static mesh's shape is empty.
static_assert(sizeof(MeshShape<Mesh2D>) == 1);  // the size of an object with no data
static_assert(sizeof(MeshShape<Mesh<FSDP<2>, TP<dynamic>>>) == sizeof(int));
static_assert(sizeof(MeshShape<Mesh<DP<dynamic>, FSDP<2>, TP<dynamic>>>) == 2 * sizeof(int));
static_assert(MeshShape<Mesh<DP<dynamic>, FSDP<2>, TP<dynamic>>>::resolve(12, std::array{3}).extents() ==
              std::array{3, 2, 2});

// A static mesh's shape needs no world size.
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
  CHECK(MeshShape<Mesh<DP<2>, FSDP<dynamic>, TP<2>>>::resolve(12).extents() == std::array{2, 3, 2});
  CHECK(MeshShape<Mesh<DP<2>, FSDP<dynamic>, TP<2>>>::resolve(12).to_string() == "Mesh<DP=2, FSDP=3, TP=2>");
}

TEST_CASE("several axes may be dynamic: the extents given at init, one left to the world size") {
  using Flexible = Mesh<DP<dynamic>, FSDP<dynamic>, TP<dynamic>>;
  const std::array given{2, from_world_size, 2};
  CHECK(MeshShape<Flexible>::resolve(8, given).extents() == std::array{2, 2, 2});
  CHECK(MeshShape<Flexible>::resolve(16, std::array{1, 16}).to_string() == "Mesh<DP=1, FSDP=16, TP=1>");
  CHECK_THROWS_AS(MeshShape<Flexible>::resolve(16, std::array{1}), EnvError);  // FSDP and TP both missing
  CHECK(MeshShape<Flexible>::resolve(4, std::array{1, 2, 2}).size() == 4);
  CHECK(MeshShape<Mesh<FSDP<dynamic>, TP<dynamic>>>::resolve(6, std::array{0, 3}).extents() == std::array{2, 3});
  CHECK_THROWS_WITH(MeshShape<Flexible>::resolve(8, std::array{1, 2, 2}),
                    "world size 8 does not match Mesh<DP=1, FSDP=2, TP=2>, which has 4 ranks; launch 4 ranks");
  CHECK_THROWS_WITH(MeshShape<Flexible>::resolve(8, std::array{0, 0, 2}),
                    "Mesh<DP<dynamic>, FSDP<dynamic>, TP<dynamic>>: axes DP and FSDP both take their extent from "
                    "the world size; give all dynamic extents but one");
  CHECK_THROWS_WITH(MeshShape<Flexible>::resolve(12, std::array{2, 0, 5}),
                    "world size 12 is not a multiple of 10, the product of the other extents of "
                    "Mesh<DP<dynamic>, FSDP<dynamic>, TP<dynamic>>; launch a multiple of 10 ranks");
  CHECK_THROWS_AS(MeshShape<DynamicDP>::resolve(4, std::array{1, 2}), EnvError);
}

TEST_CASE("a world size the mesh cannot fit is an EnvError naming the mesh and the fix") {
  CHECK_THROWS_WITH(MeshShape<DynamicDP>::resolve(7),
                    "world size 7 is not a multiple of 2, the product of the other extents of "
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
    for (const auto& slice : shape.slices(1u << axis_index)) {
      REQUIRE(static_cast<int>(slice.size()) == shape.extent(axis_index));
      for (int position = 0; position < static_cast<int>(slice.size()); ++position) {
        const int rank = slice[position];
        ++seen[rank];
        INFO("axis " << axis_index << " rank " << rank);
        CHECK(shape.coord_of(rank)[axis_index] == position);
        CHECK(shape.axis_slice_ranks(axis_index, rank) == slice);
      }
    }
    CHECK(seen == std::vector<int>(12, 1));
  }
}
