// The compile-time redistribution table (see docs/layouts.md).
#include <catch2/catch.hpp>

#include <meshtorch/layout/format.hpp>
#include <meshtorch/layout/layout.hpp>

using namespace meshtorch;

namespace {

static_assert(collective_for<Replicate, Replicate> == Collective::none);
static_assert(collective_for<Replicate, Shard<0>> == Collective::local_chunk);
static_assert(collective_for<Replicate, Shard<-1>> == Collective::local_chunk);
static_assert(collective_for<Shard<1>, Replicate> == Collective::all_gather);
static_assert(collective_for<Shard<1>, Shard<1>> == Collective::none);
static_assert(collective_for<Shard<0>, Shard<1>> == Collective::all_to_all);
static_assert(collective_for<Partial, Replicate> == Collective::all_reduce);
static_assert(collective_for<Partial, Shard<0>> == Collective::reduce_scatter);
static_assert(collective_for<Partial, Partial> == Collective::none);

template <class From, class To>
concept Redistributable = requires {
  collective_for<From, To>;
};
static_assert(!Redistributable<int, Replicate>);

static_assert(Placement<Replicate> && Placement<Shard<-2>> && Placement<Partial>);
static_assert(!Placement<int> && !Placement<DP<2>>);
static_assert(Shard<-1>::name == "Shard<-1>" && Shard<12>::name == "Shard<12>");
static_assert(normalize_dim(-1, 3) == 2 && normalize_dim(0, 3) == 0);
static_assert(normalize_dim(3, 3) == -1 && normalize_dim(-4, 3) == -1);

}  // namespace

#if __has_include(<fmt/format.h>)
TEST_CASE("meshes, shapes, placements and collectives print plainly") {
  CHECK(fmt::format("{}", Mesh<DP<dynamic>, TP<8>>{}) == "Mesh<DP<dynamic>, TP<8>>");
  CHECK(fmt::format("{}", MeshShape<Mesh<DP<dynamic>, TP<2>>>::resolve(4)) == "Mesh<DP=2, TP=2>");
  CHECK(fmt::format("{} -> {}: {}", Shard<-1>{}, Replicate{}, collective_for<Shard<-1>, Replicate>) ==
        "Shard<-1> -> Replicate: all_gather");
}
#endif
