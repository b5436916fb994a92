// What each rank runs in the multi-process tests (hidden test cases, started by drivers.cpp or
// by any launcher that sets the torchrun variables), and single-process checks.
#include <pthread.h>
#include <signal.h>

#include <chrono>
#include <cstdlib>
#include <iostream>
#include <mutex>
#include <numeric>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/torch.h>

#include <meshtorch/comm/comm.hpp>
#include <meshtorch/comm/init.hpp>
#include <meshtorch/comm/shared_memory_backend.hpp>
#include <meshtorch/diagnostics/stack_dump.hpp>
#include <meshtorch/layout/layout.hpp>

using namespace meshtorch;
using namespace meshtorch::comm;
using namespace meshtorch::diagnostics;
using namespace std::chrono_literals;

namespace {

constexpr auto f64 = torch::kFloat64;

std::string show(const torch::Tensor& t) {
  std::ostringstream out;
  out << t;
  return out.str();
}

// Checks exact equality and prints both tensors when they differ.
void expect_equal(const torch::Tensor& actual, const torch::Tensor& expected, const std::string& what) {
  INFO(what << "\nactual:\n" << show(actual) << "\nexpected:\n" << show(expected));
  REQUIRE(actual.sizes() == expected.sizes());
  CHECK(torch::equal(actual.to(f64), expected.to(f64)));
}

InitOptions test_options(std::chrono::milliseconds timeout = 30s) {
  InitOptions options;
  options.timeout = timeout;
  return options;
}

torch::Tensor ranks_tensor(const std::vector<int>& ranks) {
  std::vector<double> values(ranks.begin(), ranks.end());
  return torch::tensor(values, f64);
}

// Every collective over one group, against values computed from the group's membership.
void check_collectives(const AxisGroup& group) {
  const int n = group.size(), me = group.rank(), rank = group.global_rank();
  const std::string where = group.describe();
  INFO(where);
  std::vector<int> plus_one(group.ranks());
  for (int& r : plus_one) ++r;
  const double sum_plus_one = std::accumulate(plus_one.begin(), plus_one.end(), 0.0);

  // The group really holds the ranks it claims, in coordinate order.
  expect_equal(all_gather(group, torch::full({1}, rank, f64)), ranks_tensor(group.ranks()), "membership");

  expect_equal(all_reduce(group, torch::full({2, 3}, rank + 1.0, f64)), torch::full({2, 3}, sum_plus_one, f64),
               "all_reduce sum");
  expect_equal(all_reduce(group, torch::full({2}, rank + 1.0, f64), ReduceOp::avg),
               torch::full({2}, sum_plus_one / n, f64), "all_reduce avg");
  expect_equal(all_reduce(group, torch::full({2}, rank, f64), ReduceOp::max),
               torch::full({2}, group.ranks().back(), f64), "all_reduce max");
  expect_equal(all_reduce(group, torch::full({2}, rank, f64), ReduceOp::min),
               torch::full({2}, group.ranks().front(), f64), "all_reduce min");
  torch::Tensor transposed = torch::full({3, 2}, rank + 1.0, f64).t();
  all_reduce(group, transposed);
  expect_equal(transposed, torch::full({2, 3}, sum_plus_one, f64), "all_reduce in place on a non-contiguous tensor");

  std::vector<torch::Tensor> rows, columns;
  for (int r : group.ranks()) {
    rows.push_back(torch::full({1, 2}, r, f64));
    columns.push_back(torch::full({2, 1}, r, f64));
  }
  expect_equal(all_gather(group, torch::full({1, 2}, rank, f64), 0), torch::cat(rows, 0), "all_gather dim 0");
  expect_equal(all_gather(group, torch::full({2, 1}, rank, f64), -1), torch::cat(columns, 1), "all_gather dim -1");

  const torch::Tensor base = torch::arange(n * 2 * 3, f64).view({n * 2, 3});
  expect_equal(reduce_scatter(group, base * (rank + 1), 0), base.chunk(n, 0)[me] * sum_plus_one,
               "reduce_scatter sum dim 0");
  expect_equal(reduce_scatter(group, base.t() * (rank + 1), 1, ReduceOp::avg),
               base.t().chunk(n, 1)[me] * (sum_plus_one / n), "reduce_scatter avg dim 1");

  expect_equal(broadcast(group, torch::full({3}, rank, f64), n - 1), torch::full({3}, group.ranks().back(), f64),
               "broadcast from the last group rank");

  // Rank r holds [100 r + j]; piece j (columns 2j, 2j+1) goes to group rank j.
  const torch::Tensor mine = torch::arange(2 * n, f64).repeat({2, 1}) + 100.0 * rank;
  std::vector<torch::Tensor> received;
  for (int r : group.ranks())
    received.push_back((torch::arange(2 * n, f64).repeat({2, 1}) + 100.0 * r).chunk(n, 1)[me]);
  expect_equal(all_to_all(group, mine, 1, 0), torch::cat(received, 0), "all_to_all");

  barrier(group);

  // Two collectives in flight at once, waited for in reverse order.
  auto reduced = all_reduce_async(group, torch::full({4}, 1.0, f64));
  auto gathered = all_gather_async(group, torch::full({1}, rank, f64));
  expect_equal(gathered.wait(), ranks_tensor(group.ranks()), "all_gather_async");
  expect_equal(reduced.wait(), torch::full({4}, static_cast<double>(n), f64), "all_reduce_async");
  CHECK(reduced.is_completed());

  auto coalesced =
      all_reduce_coalesced(group, {torch::full({2, 2}, rank + 1.0, f64), torch::full({3}, 2.0 * (rank + 1), f64)});
  expect_equal(coalesced[0], torch::full({2, 2}, sum_plus_one, f64), "all_reduce_coalesced [0]");
  expect_equal(coalesced[1], torch::full({3}, 2 * sum_plus_one, f64), "all_reduce_coalesced [1]");

  auto gathered_many = all_gather_coalesced(group, {torch::full({1, 2}, rank, f64), torch::full({1}, -rank, f64)});
  expect_equal(gathered_many[0], torch::cat(rows, 0), "all_gather_coalesced [0]");
  expect_equal(gathered_many[1], -ranks_tensor(group.ranks()), "all_gather_coalesced [1]");

  auto scattered_many = reduce_scatter_coalesced(group, {base * (rank + 1), torch::arange(2 * n, f64) * (rank + 1)});
  expect_equal(scattered_many[0], base.chunk(n, 0)[me] * sum_plus_one, "reduce_scatter_coalesced [0]");
  expect_equal(scattered_many[1], torch::arange(2 * n, f64).chunk(n, 0)[me] * sum_plus_one,
               "reduce_scatter_coalesced [1]");

  auto broadcast_many = broadcast_coalesced(group, {torch::full({2}, rank, f64), torch::full({1, 3}, rank, f64)}, 0);
  expect_equal(broadcast_many[1], torch::full({1, 3}, group.ranks().front(), f64), "broadcast_coalesced");

  // Metadata over the group's CPU side: strings of different lengths, values of several types.
  std::vector<std::string> names;
  for (int r : group.ranks()) names.push_back("rank-" + std::string(static_cast<std::size_t>(r + 1), '*'));
  CHECK(all_gather_object(group, names[me]) == names);
  CHECK(broadcast_value(group, rank, n - 1) == group.ranks().back());
  CHECK(broadcast_value(group, std::int64_t{1} << 60 | rank, 0) == (std::int64_t{1} << 60 | group.ranks().front()));
  CHECK(broadcast_value(group, rank == group.ranks().front(), 0));
  CHECK(broadcast_value(group, 0.5 + rank, 0) == 0.5 + group.ranks().front());
}

// Every placement pair, checked against slicing the full tensor.
void check_redistribute(const AxisGroup& group) {
  const int n = group.size(), me = group.rank();
  const double scale = group.size() * (group.size() + 1) / 2.0;  // sum of (coordinate + 1)
  INFO(group.describe());
  const torch::Tensor full = torch::arange(n * 2 * n * 3, f64).view({n * 2, n * 3});
  const torch::Tensor row_shard = full.chunk(n, 0)[me], column_shard = full.chunk(n, 1)[me];
  const torch::Tensor addend = full * (me + 1);

  expect_equal(redistribute<Replicate, Shard<0>>(full, group), row_shard, "Replicate -> Shard<0>");
  expect_equal(redistribute<Replicate, Shard<-1>>(full, group), column_shard, "Replicate -> Shard<-1>");
  expect_equal(redistribute<Shard<0>, Replicate>(row_shard, group), full, "Shard<0> -> Replicate");
  expect_equal(redistribute<Shard<1>, Replicate>(column_shard, group), full, "Shard<1> -> Replicate");
  expect_equal(redistribute<Shard<0>, Shard<1>>(row_shard, group), column_shard, "Shard<0> -> Shard<1>");
  expect_equal(redistribute<Shard<1>, Shard<0>>(column_shard, group), row_shard, "Shard<1> -> Shard<0>");
  expect_equal(redistribute<Shard<-1>, Shard<1>>(column_shard, group), column_shard,
               "Shard<-1> -> Shard<1> moves nothing");
  expect_equal(redistribute<Partial, Replicate>(addend, group), full * scale, "Partial -> Replicate");
  expect_equal(redistribute<Partial, Shard<1>>(addend, group), column_shard * scale, "Partial -> Shard<1>");
  expect_equal(redistribute<Partial, Partial>(addend, group), addend, "Partial -> Partial");
  expect_equal(redistribute<Replicate, Replicate>(full, group), full, "Replicate -> Replicate");
}

template <MeshType M>
void check_mesh(const DeviceMesh<M>& mesh) {
  INFO(mesh.shape().to_string() << " on rank " << mesh.rank());
  for (std::size_t axis_index = 0; axis_index < M::ndim; ++axis_index) {
    const AxisGroup& group = mesh.axis_group(axis_index);
    CHECK(group.ranks() == mesh.shape().axis_slice_ranks(axis_index, mesh.rank()));
    CHECK(group.rank() == mesh.coords()[axis_index]);
    check_collectives(group);
    check_redistribute(group);
  }
  check_collectives(mesh.world());
}

}  // namespace

TEST_CASE("rank body: collectives on Mesh<DP<dynamic>, TP<2>>", "[.rank_collectives_dp_tp]") {
  auto mesh = init<Mesh<DP<dynamic>, TP<2>>>(test_options());
  const int world = mesh.world_size();
  CHECK(mesh.size<DP>() == world / 2);
  CHECK(mesh.size<TP>() == 2);
  CHECK(mesh.coord<TP>() == mesh.rank() % 2);
  CHECK(mesh.coord<DP>() == mesh.rank() / 2);
  CHECK(mesh.group<TP>().ranks() == std::vector<int>{mesh.rank() / 2 * 2, mesh.rank() / 2 * 2 + 1});
  check_mesh(mesh);
  // The axis-key forms reach the same groups.
  expect_equal(all_reduce(mesh, axis<TP>, torch::ones({2}, f64)), torch::full({2}, 2.0, f64),
               "all_reduce(mesh, axis<TP>, ...)");
  expect_equal(redistribute<Shard<0>, Replicate>(torch::full({1}, mesh.coord<DP>(), f64), mesh, axis<DP>),
               torch::arange(mesh.size<DP>(), f64), "redistribute(..., mesh, axis<DP>)");
  barrier(mesh.world());
}

TEST_CASE("rank body: collectives on Mesh<DP<2>, FSDP<dynamic>, TP<1>>", "[.rank_collectives_3d]") {
  auto mesh = init<Mesh<DP<2>, FSDP<dynamic>, TP<1>>>(test_options());
  CHECK(mesh.size<FSDP>() == mesh.world_size() / 2);
  CHECK(mesh.group<TP>().size() == 1);
  check_mesh(mesh);
  // The merged data-parallel group: every rank at this TP coordinate, DP-major.
  const AxisGroup& data_parallel = mesh.group<DP, FSDP>();
  CHECK(data_parallel.ranks() == mesh.shape().slice_ranks<DP, FSDP>(mesh.rank()));
  CHECK(data_parallel.size() == mesh.world_size());
  CHECK(data_parallel.rank() == mesh.coord<DP>() * mesh.size<FSDP>() + mesh.coord<FSDP>());
  check_collectives(data_parallel);
  barrier(mesh.world());
}

TEST_CASE("rank body: a mesh whose extents are all dynamic, given at init", "[.rank_collectives_flexible]") {
  auto options = test_options();
  options.extents = {1, from_world_size, 2};
  auto mesh = init<Mesh<DP<dynamic>, FSDP<dynamic>, TP<dynamic>>>(options);
  CHECK(mesh.size<DP>() == 1);
  CHECK(mesh.size<TP>() == 2);
  CHECK(mesh.size<FSDP>() == mesh.world_size() / 2);
  check_mesh(mesh);
  const AxisGroup& data_parallel = mesh.group<DP, FSDP>();
  CHECK(data_parallel.axis_name() == "DP+FSDP");
  CHECK(data_parallel.ranks() == mesh.shape().slice_ranks<FSDP>(mesh.rank()));
  CHECK(mesh.group<FSDP, TP>().size() == mesh.world_size());
  check_collectives(data_parallel);
  barrier(mesh.world());
}

TEST_CASE("rank body: differentiable collectives over TP", "[.rank_differentiable]") {
  auto mesh = init<Mesh<DP<dynamic>, TP<2>>>(test_options());
  const AxisGroup& tp = mesh.group<TP>();
  const int n = tp.size(), r = tp.rank();
  const double s = n * (n + 1) / 2.0;  // sum over the group of (coordinate + 1)
  auto leaf = [](torch::Tensor t) { return t.set_requires_grad(true); };
  // Plain blocks, not SECTIONs: Catch reruns a test case per section, which would init the mesh
  // again.

  {
    INFO("f: identity forward, all-reduce backward");
    auto x = leaf(torch::full({2, 3}, r + 1.0, f64));
    auto y = copy_to_parallel_region(x, tp);
    expect_equal(y, x.detach(), "f forward");
    (y * torch::full({2, 3}, 10.0 * (r + 1), f64)).sum().backward();
    expect_equal(x.grad(), torch::full({2, 3}, 10 * s, f64), "f backward");
  }
  {
    INFO("g: all-reduce forward, identity backward");
    auto x = leaf(torch::full({2, 3}, r + 1.0, f64));
    auto y = reduce_from_parallel_region(x, tp);
    expect_equal(y, torch::full({2, 3}, s, f64), "g forward");
    (y * torch::full({2, 3}, 10.0 * (r + 1), f64)).sum().backward();
    expect_equal(x.grad(), torch::full({2, 3}, 10.0 * (r + 1), f64), "g backward");
    // Every Redistribution runs through one autograd node type (its steps are values), so a
    // program compiles that node once, not once per placement pair.
    auto f_out = copy_to_parallel_region(leaf(torch::ones({2}, f64)), tp);
    REQUIRE(y.grad_fn());
    REQUIRE(f_out.grad_fn());
    CHECK(y.grad_fn()->name() == f_out.grad_fn()->name());
  }
  {
    INFO("scatter: local chunk forward, all-gather backward");
    auto x = leaf(torch::arange(2 * 2 * n, f64).view({2, 2 * n}));
    auto y = scatter_to_parallel_region<-1>(x, tp);
    expect_equal(y, x.detach().chunk(n, 1)[r], "scatter forward");
    (y * (r + 1.0)).sum().backward();
    std::vector<torch::Tensor> blocks;
    for (int c = 0; c < n; ++c) blocks.push_back(torch::full({2, 2}, c + 1.0, f64));
    expect_equal(x.grad(), torch::cat(blocks, 1), "scatter backward");
  }
  {
    INFO("gather: all-gather forward, local chunk backward");
    auto x = leaf(torch::full({2, 2}, static_cast<double>(r), f64));
    auto y = gather_from_parallel_region<-1>(x, tp);
    std::vector<torch::Tensor> blocks;
    for (int c = 0; c < n; ++c) blocks.push_back(torch::full({2, 2}, static_cast<double>(c), f64));
    expect_equal(y, torch::cat(blocks, 1), "gather forward");
    const auto w = torch::arange(2 * 2 * n, f64).view({2, 2 * n}) * (r + 1);
    (y * w).sum().backward();
    expect_equal(x.grad(), w.chunk(n, 1)[r], "gather backward");
  }
  {
    INFO("sequence gather: all-gather forward, reduce-scatter backward");
    auto x = leaf(torch::full({2, 3}, static_cast<double>(r), f64));
    auto y = gather_from_sequence_parallel_region<0>(x, tp);
    std::vector<torch::Tensor> blocks;
    for (int c = 0; c < n; ++c) blocks.push_back(torch::full({2, 3}, static_cast<double>(c), f64));
    expect_equal(y, torch::cat(blocks, 0), "sequence gather forward");
    const auto pattern = torch::arange(2 * n * 3, f64).view({2 * n, 3});
    (y * pattern * (r + 1)).sum().backward();
    expect_equal(x.grad(), pattern.chunk(n, 0)[r] * s, "sequence gather backward");
  }
  {
    INFO("sequence reduce-scatter: reduce-scatter forward, all-gather backward");
    const auto pattern = torch::arange(2 * n * 3, f64).view({2 * n, 3});
    auto x = leaf(pattern * (r + 1));
    auto y = reduce_scatter_to_sequence_parallel_region<0>(x, tp);
    expect_equal(y, pattern.chunk(n, 0)[r] * s, "sequence reduce-scatter forward");
    (y * (r + 1.0)).sum().backward();
    std::vector<torch::Tensor> blocks;
    for (int c = 0; c < n; ++c) blocks.push_back(torch::full({2, 3}, c + 1.0, f64));
    expect_equal(x.grad(), torch::cat(blocks, 0), "sequence reduce-scatter backward");
  }
  {
    INFO("a column- then row-parallel pair equals the unsharded product");
    // y = relu(x A) B with A split by columns and B by rows: f before, g after, as in Megatron.
    torch::manual_seed(0);  // the same full weights on every rank
    const auto x_full = torch::randn({3, 4}, f64), a_full = torch::randn({4, 2 * n}, f64),
               b_full = torch::randn({2 * n, 5}, f64);
    auto x = leaf(x_full.clone());
    auto a = leaf(a_full.chunk(n, 1)[r].clone()), b = leaf(b_full.chunk(n, 0)[r].clone());
    auto y = reduce_from_parallel_region(torch::relu(copy_to_parallel_region(x, tp).matmul(a)).matmul(b), tp);
    y.pow(2).sum().backward();

    auto xr = leaf(x_full.clone()), ar = leaf(a_full.clone()), br = leaf(b_full.clone());
    auto yr = torch::relu(xr.matmul(ar)).matmul(br);
    yr.pow(2).sum().backward();
    INFO("forward\n" << show(y) << "\nreference\n" << show(yr));
    CHECK(torch::allclose(y, yr));
    CHECK(torch::allclose(x.grad(), xr.grad()));
    CHECK(torch::allclose(a.grad(), ar.grad().chunk(n, 1)[r]));
    CHECK(torch::allclose(b.grad(), br.grad().chunk(n, 0)[r]));
  }
  barrier(mesh.world());
}

TEST_CASE("rank body: rank 1 starts with another mesh type", "[.rank_mesh_mismatch]") {
  const int rank = launch_env().rank;
  try {
    if (rank == 1)
      init<Mesh<DP<dynamic>>>(test_options());
    else
      init<Mesh<DP<dynamic>, TP<2>>>(test_options());
    FAIL("init succeeded although rank 1 runs another mesh");
  } catch (const CommError& e) {
    std::cout << "rank " << rank << " caught: " << e.what() << "\n";
    const std::string message = e.what();
    CHECK_THAT(message, Catch::Contains("rank 1 was started with 'Mesh<DP<dynamic>> on cpu'") &&
                            Catch::Contains("rank 0 with 'Mesh<DP<dynamic>, TP<2>> on cpu'"));
  }
}

TEST_CASE("rank body: the last rank starts with other flags", "[.rank_flags_mismatch]") {
  const auto env = launch_env();
  auto options = test_options();
  // One flag a line, as train::flags_fingerprint writes them: the error names the differing one.
  options.fingerprint = env.rank == env.world_size - 1 ? "seed=1\ntp=4\nlr=1\n" : "seed=1\ntp=2\nlr=1\n";
  try {
    init<Mesh<DP<dynamic>>>(options);
    FAIL("init succeeded although the last rank has other flags");
  } catch (const CommError& e) {
    std::cout << "rank " << env.rank << " caught: " << e.what() << "\n";
    CHECK_THAT(std::string(e.what()), Catch::Contains("was started with 'tp=4' but rank 0 with 'tp=2'"));
  }
}

TEST_CASE("rank body: a world size that does not fit the mesh", "[.rank_world_mismatch]") {
  using TooWide = Mesh<DP<dynamic>, TP<3>>;
  CHECK_THROWS_WITH(init<TooWide>(test_options()),
                    Catch::Contains("is not a multiple of 3") && Catch::Contains("Mesh<DP<dynamic>, TP<3>>"));
}

TEST_CASE("rank body: a collective a peer never joins times out", "[.rank_timeout]") {
  // The group's own timeout also bounds how long its destructor waits for the stuck collective.
  auto mesh = init<Mesh<DP<dynamic>>>(test_options(4s));
  if (mesh.rank() == 0) {
    const auto start = std::chrono::steady_clock::now();
    const auto dp = mesh.group<DP>().with_timeout(1s);
    CHECK_THROWS_WITH(all_reduce(dp, torch::ones({2})),
                      Catch::Contains("all_reduce over the DP group [0, 1] on rank 0 failed"));
    CHECK(std::chrono::steady_clock::now() - start < 3s);
  } else {
    std::this_thread::sleep_for(2s);
  }
}

TEST_CASE("rank body: collectives through shared memory", "[.rank_shared_memory]") {
  auto mesh = init<Mesh<DP<dynamic>, TP<2>>>(test_options());
  REQUIRE(mesh.world().backend()->getBackendName() == "shm");
  REQUIRE(mesh.group<TP>().backend()->getBackendName() == "shm");
  check_mesh(mesh);
  const AxisGroup& world = mesh.world();
  const int n = world.size(), me = world.rank();
  // Larger than a slot (1 MiB at most): many steps a collective, and odd element counts.
  const int64_t big = (int64_t{3} << 20) + 7;
  const double ranks_sum = n * (n - 1) / 2.0;
  expect_equal(all_reduce(world, torch::full({big}, me + 0.5, torch::kFloat32)),
               torch::full({big}, ranks_sum + 0.5 * n, torch::kFloat32), "all_reduce of 12 MB of fp32");
  const auto ramp = torch::arange(big, torch::kFloat64);
  const auto gathered = all_gather(world, ramp + 1e7 * me);
  for (int r = 0; r < n; ++r) CHECK(torch::equal(gathered.narrow(0, r * big, big), ramp + 1e7 * r));
  const auto rows = torch::arange(n * big, torch::kInt64).view({n, big});
  // An integer factor: an int64 tensor times a double would be float32, inexact at these values.
  const int64_t factor = n * (n + 1) / 2;
  expect_equal(reduce_scatter(world, rows * (me + 1), 0), rows[me].unsqueeze(0) * factor,
               "reduce_scatter of 24 MB a rank of int64");
  expect_equal(broadcast(world, torch::full({big}, me, torch::kInt32), n - 1), torch::full({big}, n - 1, torch::kInt32),
               "broadcast of 12 MB from the last rank");
  // bf16 adds in float and rounds; max and min of integers; an empty tensor still takes its step.
  expect_equal(all_reduce(world, torch::full({1000}, 0.25 * (me + 1), torch::kBFloat16)),
               torch::full({1000}, 0.25 * (ranks_sum + n), torch::kBFloat16), "all_reduce of bf16");
  expect_equal(all_reduce(world, torch::full({5}, int64_t{1} << (40 + me), torch::kInt64), ReduceOp::max),
               torch::full({5}, int64_t{1} << (40 + n - 1), torch::kInt64), "all_reduce max of int64");
  CHECK(all_reduce(world, torch::empty({0}, torch::kFloat32)).numel() == 0);
  // Bools are Gloo's: its all_gather, in the same group.
  expect_equal(all_gather(world, torch::full({1}, me % 2 == 0, torch::kBool)).to(torch::kInt64),
               torch::arange(n, torch::kInt64).remainder(2).eq(0).to(torch::kInt64), "all_gather of bool, by Gloo");
  // Every rank holds bitwise the same sum of values that round differently in each order.
  const auto noisy = torch::randn({4099}, torch::TensorOptions().dtype(torch::kFloat32)) * (me + 1) * 1e3;
  const auto summed = all_reduce(world, noisy.clone());
  const auto everyone = all_gather(world, summed.unsqueeze(0));
  for (int r = 1; r < n; ++r) CHECK(torch::equal(everyone[r], everyone[0]));
  check_collectives(world);
  check_collectives(mesh.group<TP>());
  barrier(world);
}

TEST_CASE("rank body: collectives over Gloo's sockets alone", "[.rank_gloo_transport]") {
  auto mesh = init<Mesh<DP<dynamic>, TP<2>>>(test_options());
  REQUIRE(mesh.world().backend()->getBackendName() == "gloo");
  check_collectives(mesh.world());
  check_collectives(mesh.group<TP>());
  barrier(mesh.world());
}

TEST_CASE("rank body: rank 1 starts with another CPU transport", "[.rank_transport_mismatch]") {
  const int rank = launch_env().rank;
  if (rank == 1) ::setenv("MESHTORCH_CPU_TRANSPORT", "gloo", 1);
  const auto start = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH(init<Mesh<DP<dynamic>>>(test_options()),
                    Catch::Contains("rank 1 was started with 'MESHTORCH_CPU_TRANSPORT=gloo' but rank 0 with "
                                    "'MESHTORCH_CPU_TRANSPORT=shm'"));
  CHECK(std::chrono::steady_clock::now() - start < 10s);
}

TEST_CASE("rank body: a rank that gives up on the group is named by its peer at once",
          "[.rank_shared_memory_gave_up]") {
  auto mesh = init<Mesh<DP<dynamic>>>(test_options(30s));
  const auto dp = mesh.group<DP>();
  if (mesh.rank() == 0) {
    // Rank 0 gives up waiting after 1 s; rank 1 comes to the same all_reduce only once it has.
    CHECK_THROWS_WITH(all_reduce(dp.with_timeout(1s), torch::ones({2})), Catch::Contains("timed out after 1000 ms"));
    barrier(mesh.world());  // another group than the broken one
  } else {
    barrier(mesh.world());
    const auto start = std::chrono::steady_clock::now();
    CHECK_THROWS_WITH(all_reduce(dp, torch::ones({2})),
                      Catch::Contains("group rank 0 gave up on the group while group rank 1 waited for it") &&
                          Catch::Contains("timed out after 1000 ms"));
    CHECK(std::chrono::steady_clock::now() - start < 5s);  // not rank 1's own 30 s
  }
  barrier(mesh.world());
}

TEST_CASE("rank body: ranks that issue different collectives are told so at once", "[.rank_shared_memory_mismatch]") {
  auto mesh = init<Mesh<DP<dynamic>>>(test_options(20s));
  const auto start = std::chrono::steady_clock::now();
  const auto dp = mesh.group<DP>();
  const auto mine = mesh.rank() == 0 ? torch::ones({4}) : torch::ones({1});
  CHECK_THROWS_WITH(all_reduce(dp, mine),
                    Catch::Contains("the ranks issued different collectives (a collective mismatch)") &&
                        Catch::Contains("all_reduce (sum) of 16 bytes of Float") &&
                        Catch::Contains("all_reduce (sum) of 4 bytes of Float"));
  // The group is broken: the next collective fails at once, with the first failure's reason.
  CHECK_THROWS_WITH(all_gather(dp, torch::ones({2})),
                    Catch::Contains("the shared-memory group is broken since an earlier collective failed") &&
                        Catch::Contains("collective mismatch"));
  CHECK(std::chrono::steady_clock::now() - start < 5s);
}

TEST_CASE("rank body: a peer that exits is named at once, not at the timeout", "[.rank_shared_memory_exit]") {
  auto mesh = init<Mesh<DP<dynamic>>>(test_options(30s));
  if (mesh.rank() == 1) std::_Exit(0);  // gone, without a word to its group
  const auto start = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH(all_reduce(mesh.group<DP>(), torch::ones({2})),
                    Catch::Contains("all_reduce over the DP group [0, 1] on rank 0 failed") &&
                        Catch::Contains("group rank 1 (pid ") &&
                        Catch::Contains("has exited while group rank 0 waits"));
  CHECK(std::chrono::steady_clock::now() - start < 5s);
}

TEST_CASE("MESHTORCH_CPU_TRANSPORT takes shm (the default) or gloo and refuses anything else, naming both",
          "[comm][single]") {
  const char* before = std::getenv("MESHTORCH_CPU_TRANSPORT");
  const std::string kept = before ? before : "";
  ::setenv("MESHTORCH_CPU_TRANSPORT", "shm", 1);
  CHECK(cpu_transport_from_environment() == CpuTransport::shared_memory);
  ::setenv("MESHTORCH_CPU_TRANSPORT", "gloo", 1);
  CHECK(cpu_transport_from_environment() == CpuTransport::gloo);
  ::setenv("MESHTORCH_CPU_TRANSPORT", "tcp", 1);
  CHECK_THROWS_WITH(
      cpu_transport_from_environment(),
      Catch::Contains("MESHTORCH_CPU_TRANSPORT is 'tcp': expected 'shm' (the default") && Catch::Contains("or 'gloo'"));
  ::unsetenv("MESHTORCH_CPU_TRANSPORT");
  CHECK(cpu_transport_from_environment() == CpuTransport::shared_memory);
  if (before)
    ::setenv("MESHTORCH_CPU_TRANSPORT", kept.c_str(), 1);
  else
    ::unsetenv("MESHTORCH_CPU_TRANSPORT");
}

TEST_CASE("a one-rank mesh needs no peers and its collectives return their input", "[comm][single]") {
  LaunchEnv env;
  env.master_port = 0;  // 0: the store picks a free port; nobody else needs to find it
  auto options = test_options(10s);
  options.env = env;
  auto mesh = init<Mesh<DP<dynamic>, TP<1>>>(options);
  CHECK(mesh.size<DP>() == 1);
  CHECK(mesh.fingerprint() == std::string("Mesh<DP<dynamic>, TP<1>> on cpu\nMESHTORCH_CPU_TRANSPORT=") +
                                  (cpu_transport_from_environment() == CpuTransport::shared_memory ? "shm" : "gloo"));
  const auto t = torch::arange(4, f64);
  expect_equal(all_reduce(mesh.group<DP>(), t.clone(), ReduceOp::avg), t, "all_reduce");
  expect_equal(all_gather(mesh.group<TP>(), t), t, "all_gather");
  expect_equal(reduce_scatter(mesh.group<TP>(), t), t, "reduce_scatter");
  expect_equal(all_to_all(mesh.group<TP>(), t.view({2, 2}), 0, 1), t.view({2, 2}), "all_to_all");
  expect_equal(redistribute<Partial, Shard<0>>(t, mesh, axis<DP>), t, "Partial -> Shard<0>");
  CHECK_THROWS_WITH(all_gather(mesh.group<DP>(), t, 3),
                    Catch::Contains("all_gather over the DP group [0] on rank 0 failed: dim 3 is "
                                    "out of range"));
}

TEST_CASE("a cuda mesh in a CPU build is a ConfigError naming the fix", "[comm][single]") {
#if !defined(MESHTORCH_WITH_CUDA)
  LaunchEnv env;
  env.master_port = 0;
  auto options = test_options(10s);
  options.env = env;
  options.device = Device::cuda;
  CHECK_THROWS_WITH(init<Mesh<TP<1>>>(options), Catch::Contains("-DMESHTORCH_CUDA=ON"));
#endif
}

TEST_CASE("a collective refuses a tensor on another device than its group's, naming both", "[comm][single]") {
  LaunchEnv env;
  env.master_port = 0;
  auto options = test_options(10s);
  options.env = env;
  auto mesh = init<Mesh<DP<dynamic>, TP<1>>>(options);
  const auto& dp = mesh.group<DP>();
  const auto on_meta = torch::empty({4}, torch::TensorOptions().device(torch::kMeta).dtype(f64));
  // Checked in a group of one rank too, where nothing is sent: a CPU tensor on an NCCL group
  // would otherwise pass every single-process run and fail on the first multi-GPU one.
  const auto refused = [](const std::string& collective) {
    return Catch::Contains(collective +
                           " over the DP group [0] on rank 0 failed: it was handed a tensor on "
                           "meta but the group moves cpu tensors");
  };
  CHECK_THROWS_AS(all_reduce(dp, on_meta), CommError);
  CHECK_THROWS_WITH(all_reduce(dp, on_meta), refused("all_reduce"));
  CHECK_THROWS_WITH(all_gather(dp, on_meta), refused("all_gather"));
  CHECK_THROWS_WITH(reduce_scatter(dp, on_meta), refused("reduce_scatter"));
  CHECK_THROWS_WITH(broadcast(dp, on_meta), refused("broadcast"));
  CHECK_THROWS_WITH(all_to_all(dp, on_meta, 0, 0), refused("all_to_all"));
  CHECK_THROWS_WITH(all_reduce_coalesced(dp, {on_meta}), refused("all_reduce_coalesced"));
  CHECK_THROWS_WITH(all_gather_coalesced(dp, {on_meta}), refused("all_gather_coalesced"));
  CHECK_THROWS_WITH(reduce_scatter_coalesced(dp, {on_meta}), refused("reduce_scatter_coalesced"));
  CHECK_THROWS_WITH(broadcast_coalesced(dp, {on_meta}), refused("broadcast_coalesced"));
  // A CPU group's metadata side is the group itself.
  CHECK(dp.metadata().backend().get() == dp.backend().get());
  CHECK(all_gather_object(dp, "only") == std::vector<std::string>{"only"});
}

TEST_CASE("a group of a CUDA mesh refuses CPU tensors and points at its metadata side", "[comm][single]") {
  // Built as comm::init builds a CUDA group, bound to GPU 0; with one rank no backend is reached.
  const AxisGroup tp("TP", {0}, 0, /*backend=*/{}, 10s, Device::cuda, /*metadata_backend=*/{}, /*cuda_device=*/0);
  CHECK(tp.device_name() == "cuda:0");
  CHECK_THROWS_WITH(all_reduce(tp, torch::ones({2})),
                    Catch::Contains("all_reduce over the TP group [0] on rank 0 failed: it was handed a tensor "
                                    "on cpu but the group moves cuda:0 tensors; move the tensor to cuda:0, or send "
                                    "CPU metadata through group.metadata()"));
  CHECK_THROWS_WITH(broadcast(tp, torch::ones({2})), Catch::Contains("broadcast over the TP group [0]"));
  const AxisGroup metadata = tp.metadata();
  CHECK(metadata.device() == Device::cpu);
  CHECK(metadata.ranks() == tp.ranks());
  CHECK(broadcast_value(tp, 7) == 7);
  CHECK(all_gather_object(tp, "meta") == std::vector<std::string>{"meta"});
  // With more ranks the companion is needed, and a group made without one says so.
  const AxisGroup wide("TP", {0, 1}, 0, {}, 10s, Device::cuda, {}, 0);
  CHECK_THROWS_WITH(wide.metadata(), Catch::Contains("has no CPU companion group for metadata"));
}

TEST_CASE("a wait on the CPU, or on a GPU group bound to no device, ends the collective in the recorder",
          "[comm][single]") {
  // A GPU group's wait leaves it waiting for its stream's event (tests/cuda); without a bound
  // device there is no stream to ask, so it ends at its wait, as on the CPU, with no CUDA call.
  auto& recorder = FlightRecorder::instance();
  REQUIRE(recorder.enabled());
  const auto state_of = [&](std::uint64_t id) {
    for (const auto& entry : recorder.entries())
      if (entry["id"] == id) return entry["state"].get<std::string>();
    return std::string("not recorded");
  };
  int backend = 0;
  for (const auto device : {Device::cpu, Device::cuda}) {
    const AxisGroup group("FSDP", {0, 1}, 0, {}, 10s, device);
    const std::vector<std::int64_t> shape{4};
    const auto id = recorder.record(&backend, "FSDP", {0, 1}, "test", "all_gather", shape, "Float");
    recorder.waiting(id);
    meshtorch::comm::detail::record_completion(id, group);
    CHECK(state_of(id) == "completed");
  }
}

TEST_CASE("each local rank gets its own GPU, or a start-up error naming --nproc-per-node", "[comm][single]") {
  CHECK(cuda_device_for(0, 8) == 0);
  CHECK(cuda_device_for(7, 8) == 7);
  // One visible GPU: the launcher shows each rank its own (Slurm's --gpus-per-task=1).
  CHECK(cuda_device_for(5, 1) == 0);
  // 8 ranks on a node of 4 GPUs would share them; NCCL refuses that at its first collective.
  CHECK_THROWS_AS(cuda_device_for(4, 4), ConfigError);
  CHECK_THROWS_WITH(cuda_device_for(4, 4), Catch::Contains("local rank 4") && Catch::Contains("sees 4 GPUs") &&
                                               Catch::Contains("--nproc-per-node 4") &&
                                               Catch::Contains("CUDA_VISIBLE_DEVICES"));
  CHECK_THROWS_WITH(cuda_device_for(-1, 4), Catch::Contains("local rank -1 is negative"));
}

TEST_CASE("--device cuda in a CPU build is a ConfigError naming the fix", "[comm][single]") {
#if !defined(MESHTORCH_WITH_CUDA)
  CHECK_THROWS_AS(local_cuda_device(0), ConfigError);
  CHECK_THROWS_WITH(local_cuda_device(0), Catch::Contains("--device cuda: this program was built without CUDA") &&
                                              Catch::Contains("-DMESHTORCH_CUDA=ON"));
#endif
}

namespace meshtorch::diagnostics {
// The recorder's lock, held by the thread a test chooses.
struct FlightRecorderTestAccess {
  static std::timed_mutex& lock_of(FlightRecorder& recorder) { return recorder.mutex_; }
};
}  // namespace meshtorch::diagnostics

TEST_CASE("rank body: a fatal signal in the thread that holds the flight recorder's lock", "[.rank_fatal_signal]") {
  // The watchdog of rank 1 of 2 with a collective timeout of 4 s (a fatal budget of 2 s), on a
  // store of its own: no peer is needed to crash.
  auto& watchdog = Watchdog::instance();
  watchdog.attach(c10::make_intrusive<c10d::HashStore>(), 1, 2, 4s, "test-host");
  watchdog.arm(std::getenv("MESHTORCH_TEST_DUMP_DIR"));
  install_stack_dumps();
  // A thread with every signal blocked never answers the stack capture: the deadline cuts its wait.
  std::thread([] {
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, nullptr);
    std::this_thread::sleep_for(60s);
  }).detach();
  auto& recorder = FlightRecorder::instance();
  const int backend = 0;
  const std::vector<int> ranks{0, 1};
  const std::vector<std::int64_t> shape{8};
  recorder.waiting(recorder.record(&backend, "DP", ranks, "gloo", "all_reduce", shape, "Float"));
  // std::abort raises SIGABRT in this thread, which holds the lock every dump reads under.
  std::lock_guard held(FlightRecorderTestAccess::lock_of(recorder));
  std::abort();
}
