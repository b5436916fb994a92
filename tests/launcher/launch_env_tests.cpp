#include <map>
#include <string>

#include <catch2/catch.hpp>

#include <meshtorch/comm/env.hpp>
#include <meshtorch/diagnostics/error_file.hpp>

using meshtorch::EnvError;
using meshtorch::comm::expand_slurm_nodelist;
using meshtorch::comm::launch_env_from;
using meshtorch::comm::LaunchEnv;
using Variables = std::map<std::string, std::string, std::less<>>;

namespace {

LaunchEnv env_from(const Variables& variables) {
  return launch_env_from([&](std::string_view name) -> std::optional<std::string> {
    if (auto found = variables.find(name); found != variables.end()) return found->second;
    return std::nullopt;
  });
}

void check_env(const LaunchEnv& env, int rank, int world, int local_rank, int local_world, const std::string& addr,
               int port, const std::string& launcher) {
  INFO("rank " << env.rank << " world " << env.world_size << " local " << env.local_rank << "/" << env.local_world_size
               << " master " << env.master_addr << ":" << env.master_port << " launcher " << env.launcher);
  CHECK(env.rank == rank);
  CHECK(env.world_size == world);
  CHECK(env.local_rank == local_rank);
  CHECK(env.local_world_size == local_world);
  CHECK(env.master_addr == addr);
  CHECK(env.master_port == port);
  CHECK(env.launcher == launcher);
}

}  // namespace

TEST_CASE("no launcher variables mean one process on its own") {
  check_env(env_from({}), 0, 1, 0, 1, "127.0.0.1", 29500, "single");
}

TEST_CASE("torchrun variables give rank, world, local rank and master") {
  check_env(env_from({{"RANK", "5"},
                      {"WORLD_SIZE", "8"},
                      {"LOCAL_RANK", "1"},
                      {"LOCAL_WORLD_SIZE", "4"},
                      {"MASTER_ADDR", "node7"},
                      {"MASTER_PORT", "1234"}}),
            5, 8, 1, 4, "node7", 1234, "torchrun");
}

TEST_CASE("torchrun variables win over Slurm's and OpenMPI's") {
  check_env(env_from({{"RANK", "1"},
                      {"WORLD_SIZE", "2"},
                      {"SLURM_PROCID", "0"},
                      {"SLURM_NTASKS", "1"},
                      {"OMPI_COMM_WORLD_RANK", "0"}}),
            1, 2, 1, 2, "127.0.0.1", 29500, "torchrun");
}

TEST_CASE("RANK and WORLD_SIZE alone mean every rank is on this host") {
  check_env(env_from({{"RANK", "2"}, {"WORLD_SIZE", "3"}}), 2, 3, 2, 3, "127.0.0.1", 29500, "torchrun");
}

TEST_CASE("Slurm variables give the rank and the first host of the node list as master") {
  Variables slurm{{"SLURM_PROCID", "6"},
                  {"SLURM_NTASKS", "8"},
                  {"SLURM_LOCALID", "2"},
                  {"SLURM_NTASKS_PER_NODE", "4"},
                  {"SLURM_JOB_NODELIST", "gpu[07-08]"},
                  {"SLURM_JOB_ID", "123456"}};
  check_env(env_from(slurm), 6, 8, 2, 4, "gpu07", 10000 + 123456 % 20000, "slurm");
  slurm["MASTER_PORT"] = "4000";
  slurm["MASTER_ADDR"] = "head";
  check_env(env_from(slurm), 6, 8, 2, 4, "head", 4000, "slurm");
}

TEST_CASE("Slurm's SLURM_TASKS_PER_NODE is read at this node's index") {
  Variables slurm{{"SLURM_PROCID", "4"},  {"SLURM_NTASKS", "5"},
                  {"SLURM_LOCALID", "0"}, {"SLURM_TASKS_PER_NODE", "2(x2),1"},
                  {"SLURM_NODEID", "2"},  {"SLURM_JOB_NODELIST", "a1,b[2-3]"}};
  check_env(env_from(slurm), 4, 5, 0, 1, "a1", 29500, "slurm");
  slurm["SLURM_NODEID"] = "3";
  CHECK_THROWS_WITH(env_from(slurm), Catch::Contains("SLURM_NODEID=3"));
}

TEST_CASE("Slurm node lists expand ranges, lists and zero padding") {
  using V = std::vector<std::string>;
  CHECK(expand_slurm_nodelist("node[01-04,07]") == V{"node01", "node02", "node03", "node04", "node07"});
  CHECK(expand_slurm_nodelist("a1,b[9-11],c") == V{"a1", "b9", "b10", "b11", "c"});
  CHECK(expand_slurm_nodelist("rack[1-2]-gpu[0-1]") == V{"rack1-gpu0", "rack1-gpu1", "rack2-gpu0", "rack2-gpu1"});
  CHECK(expand_slurm_nodelist("host") == V{"host"});
  CHECK_THROWS_AS(expand_slurm_nodelist("node[1-"), EnvError);
  CHECK_THROWS_WITH(expand_slurm_nodelist("node[4-2]"), Catch::Contains("node[4-2]"));
}

TEST_CASE("OpenMPI variables give the rank; MASTER_ADDR defaults only on one node") {
  Variables mpi{{"OMPI_COMM_WORLD_RANK", "3"},
                {"OMPI_COMM_WORLD_SIZE", "4"},
                {"OMPI_COMM_WORLD_LOCAL_RANK", "3"},
                {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}};
  check_env(env_from(mpi), 3, 4, 3, 4, "127.0.0.1", 29500, "openmpi");
  mpi["OMPI_COMM_WORLD_LOCAL_RANK"] = "1";
  mpi["OMPI_COMM_WORLD_LOCAL_SIZE"] = "2";
  CHECK_THROWS_WITH(env_from(mpi), Catch::Contains("MASTER_ADDR is not set"));
  mpi["MASTER_ADDR"] = "10.0.0.1";
  mpi["MASTER_PORT"] = "29400";
  check_env(env_from(mpi), 3, 4, 1, 2, "10.0.0.1", 29400, "openmpi");
}

TEST_CASE("missing or contradictory variables name the variable and its value") {
  auto throws_naming = [](const Variables& variables, const std::string& expected) {
    try {
      env_from(variables);
      FAIL("no EnvError; expected one containing: " << expected);
    } catch (const EnvError& e) {
      CHECK_THAT(e.what(), Catch::Contains(expected));
    }
  };
  throws_naming({{"WORLD_SIZE", "2"}}, "RANK is not set");
  throws_naming({{"RANK", "0"}}, "WORLD_SIZE is not set");
  throws_naming({{"RANK", "2"}, {"WORLD_SIZE", "2"}}, "RANK=2 is not below WORLD_SIZE=2");
  throws_naming({{"RANK", "x1"}, {"WORLD_SIZE", "2"}}, "RANK='x1' is not an integer");
  throws_naming({{"RANK", "0"}, {"WORLD_SIZE", "0"}}, "WORLD_SIZE=0 is out of range");
  throws_naming({{"RANK", "-1"}, {"WORLD_SIZE", "2"}}, "RANK=-1 is out of range");
  throws_naming(
      {{"RANK", "0"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "2"}, {"LOCAL_WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}},
      "LOCAL_RANK=2 is not below LOCAL_WORLD_SIZE=2");
  throws_naming({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}, {"LOCAL_WORLD_SIZE", "4"}},
                "LOCAL_WORLD_SIZE=4 exceeds WORLD_SIZE=2");
  throws_naming({{"RANK", "0"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "0"}, {"LOCAL_WORLD_SIZE", "2"}},
                "MASTER_ADDR is not set");
  throws_naming({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"MASTER_PORT", "70000"}}, "MASTER_PORT=70000");
  throws_naming({{"SLURM_PROCID", "0"}, {"SLURM_LOCALID", "0"}}, "SLURM_NTASKS is not set");
  throws_naming({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "0"}},
                "neither SLURM_NTASKS_PER_NODE nor SLURM_TASKS_PER_NODE");
  throws_naming({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "0"}, {"SLURM_NTASKS_PER_NODE", "1"}},
                "SLURM_JOB_NODELIST is not set");
  throws_naming({{"SLURM_PROCID", "3"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "0"}, {"SLURM_NTASKS_PER_NODE", "1"}},
                "SLURM_PROCID=3 is not below SLURM_NTASKS=2");
  throws_naming({{"OMPI_COMM_WORLD_SIZE", "2"}}, "OMPI_COMM_WORLD_RANK is not set");
  throws_naming({{"OMPI_COMM_WORLD_RANK", "0"},
                 {"OMPI_COMM_WORLD_SIZE", "2"},
                 {"OMPI_COMM_WORLD_LOCAL_RANK", "2"},
                 {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}},
                "OMPI_COMM_WORLD_LOCAL_RANK=2 is not below OMPI_COMM_WORLD_LOCAL_SIZE=2");
}

TEST_CASE("the error file holds torchelastic's JSON layout with the exception chain") {
  std::exception_ptr error;
  try {
    try {
      throw std::invalid_argument("bad \"shape\"\n");
    } catch (...) {
      std::throw_with_nested(std::runtime_error("loading model"));
    }
  } catch (...) {
    error = std::current_exception();
  }
  auto json = meshtorch::diagnostics::error_file_json(error);
  INFO(json);
  CHECK_THAT(json, Catch::StartsWith("{\"message\": {\"message\": \""));
  CHECK_THAT(json, Catch::Contains("loading model"));
  CHECK_THAT(json, Catch::Contains("\"extraInfo\": {\"py_callstack\": "));
  CHECK_THAT(json, Catch::Contains("caused by: std::invalid_argument: bad \\\"shape\\\"\\n"));
  CHECK_THAT(json, Catch::Contains("\"timestamp\": \""));
}
