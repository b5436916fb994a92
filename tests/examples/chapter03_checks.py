#!/usr/bin/env python3
"""Checks of examples/03-job-launchers: each script starts a real 2-rank chapter-2 run on this
machine. Cluster tools that are not installed are stood in for by small fakes that do what the
real tool does with the script's command line on one host:
  ssh HOST CMD...   runs CMD through a shell (a separate tmux server per host),
  srun / scontrol   start one task per node with SLURM_NODEID set / name the nodes 127.0.0.1,
  mpirun -np N      starts N copies with OMPI_COMM_WORLD_* set.
A real torchrun is used when one is installed (else that check is skipped, exit 77).

usage: chapter03_checks.py MESHRUN CHAPTER2 {one-node|ssh-tmux|slurm|mpirun|torchrun}
"""
import json
import os
import pathlib
import shutil
import stat
import subprocess
import sys
import tempfile
import time

from ports import free_port

HERE = pathlib.Path(__file__).resolve().parent
SCRIPTS = HERE.parent.parent / "examples" / "03-job-launchers"
TRAIN = ["-m", "llama-tiny", "-d", "builtin", "-s", "64", "-b", "2", "--threads", "1", "--dtype", "float32",
         "--max-steps", "10", "--log-freq", "5", "--ckpt-freq", "100"]

FAKES = {
    "ssh": """#!/usr/bin/env bash
host=$1; shift
mkdir -p "$FAKE_ROOT/tmux-$host"
TMUX_TMPDIR="$FAKE_ROOT/tmux-$host" exec bash -c "$*"
""",
    "scontrol": """#!/usr/bin/env bash
for i in $(seq 1 "$SLURM_JOB_NUM_NODES"); do echo 127.0.0.1; done
""",
    "srun": """#!/usr/bin/env bash
while [[ $1 == --* ]]; do shift; done
pids=()
for ((node = 0; node < SLURM_JOB_NUM_NODES; node++)); do
  SLURM_NODEID=$node SLURM_PROCID=$node "$@" & pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
""",
    "mpirun": """#!/usr/bin/env bash
while [[ $# -gt 0 ]]; do
  case $1 in
    -np) np=$2; shift 2 ;;
    --hostfile|-bind-to|-map-by|-x) shift 2 ;;
    *) break ;;
  esac
done
pids=()
for ((rank = 0; rank < np; rank++)); do
  OMPI_COMM_WORLD_RANK=$rank OMPI_COMM_WORLD_SIZE=$np OMPI_COMM_WORLD_LOCAL_RANK=$rank \
  OMPI_COMM_WORLD_LOCAL_SIZE=$np "$@" > "$FAKE_ROOT/mpi-rank$rank.log" 2>&1 & pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
cat "$FAKE_ROOT"/mpi-rank*.log
exit $status
""",
}


def setup(tmp, meshrun, chapter2):
    """A bin folder holding meshrun, the chapter-2 binary and the fakes; the environment to use it."""
    root = pathlib.Path(tmp)
    bindir = root / "bin"
    bindir.mkdir()
    for name, path in [("meshrun", meshrun), ("02-distributed-data-parallel", chapter2)]:
        (bindir / name).symlink_to(pathlib.Path(path).resolve())
    fakes = root / "fakes"
    fakes.mkdir()
    for name, text in FAKES.items():
        (fakes / name).write_text(text)
        (fakes / name).chmod(0o755)
    env = dict(os.environ, MESHTORCH_BIN=str(bindir), FAKE_ROOT=str(root), OMP_NUM_THREADS="1",
               PATH=f"{fakes}:{os.environ['PATH']}")
    return root, env


def check_metrics(exp_dir):
    records = [json.loads(line) for line in (pathlib.Path(exp_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [r["global_step"] for r in records] == [5, 10], records
    print("losses:", [round(r["running_loss"], 6) for r in records])


def run(cmd, env, cwd, timeout=300):
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc


def one_node(meshrun, chapter2):
    with tempfile.TemporaryDirectory() as tmp:
        root, env = setup(tmp, meshrun, chapter2)
        env.update(MASTER_PORT=str(free_port()))
        run([SCRIPTS / "run-one-node.sh", "2", *TRAIN, "-e", "one", "--save-dir", root / "runs"], env, root)
        assert len(list((root / "logs").glob("*/*/stdout.log"))) == 2
        check_metrics(root / "runs" / "one")


def wait_for_tmux_sessions(root, env, hosts, session, timeout=240):
    """The runs live in detached tmux sessions (one tmux server per faked host): wait until
    every host's has ended."""
    deadline = time.time() + timeout
    for host in hosts:
        tmux_env = dict(env, TMUX_TMPDIR=str(root / f"tmux-{host}"))
        while subprocess.run(["tmux", "has-session", "-t", session], env=tmux_env,
                             capture_output=True).returncode == 0:
            assert time.time() < deadline, "the tmux sessions did not end"
            time.sleep(0.5)


def ssh_tmux(meshrun, chapter2):
    with tempfile.TemporaryDirectory() as tmp:
        root, env = setup(tmp, meshrun, chapter2)
        (root / "hosts").write_text("# two nodes\n127.0.0.1\nlocalhost\n")
        env.update(MASTER_PORT=str(free_port()), WORKDIR=str(root), SESSION="ddp-test")
        run([SCRIPTS / "launch-ssh-tmux.sh", root / "hosts", "1", *TRAIN, "-e", "ssh", "--save-dir", root / "runs"],
            env, root)
        wait_for_tmux_sessions(root, env, ["127.0.0.1", "localhost"], "ddp-test")
        logs = sorted((root / "logs").glob("*/*/stdout.log"))
        assert len(logs) == 2, logs
        assert "rank 1 of 2" in logs[1].read_text(), logs[1].read_text()
        check_metrics(root / "runs" / "ssh")


def slurm(meshrun, chapter2):
    with tempfile.TemporaryDirectory() as tmp:
        root, env = setup(tmp, meshrun, chapter2)
        (root / "logs").mkdir()
        # job.sbatch takes the port 20000 + job id % 20000: pick a job id that lands on a free one.
        port = free_port()
        while not 20000 <= port < 40000:
            port = free_port()
        env.update(SLURM_JOB_NODELIST="fake[1-2]", SLURM_JOB_NUM_NODES="2", SLURM_GPUS_ON_NODE="1",
                   SLURM_JOB_ID=str(port - 20000))
        run(["bash", SCRIPTS / "job.sbatch", *TRAIN, "--save-dir", root / "runs"], env, root)
        logs = sorted((root / "logs" / env["SLURM_JOB_ID"]).glob("*/*/stdout.log"))
        assert len(logs) == 2 and "rank 1 of 2" in logs[1].read_text(), logs
        check_metrics(root / "runs" / f"ddp-{env['SLURM_JOB_ID']}")


def mpirun(meshrun, chapter2):
    with tempfile.TemporaryDirectory() as tmp:
        root, env = setup(tmp, meshrun, chapter2)
        (root / "hosts").write_text("127.0.0.1 slots=2\n")
        env.update(MASTER_PORT=str(free_port()))
        proc = run([SCRIPTS / "run-mpirun.sh", root / "hosts", "2", *TRAIN, "-e", "mpi", "--save-dir", root / "runs"],
                   env, root)
        assert "rank 1 of 2" in proc.stdout, proc.stdout
        check_metrics(root / "runs" / "mpi")


def torchrun(meshrun, chapter2):
    # PyTorch's own torchrun: on the PATH, or the one in the benchmarks' environment.
    bench_bin = HERE.parent.parent / "bench" / ".venv" / "bin"
    found = shutil.which("torchrun") or shutil.which("torchrun", path=str(bench_bin))
    if not found:
        print("torchrun is not installed (nor bench/setup-python run): skipped")
        sys.exit(77)
    with tempfile.TemporaryDirectory() as tmp:
        root, env = setup(tmp, meshrun, chapter2)
        env["PATH"] = str(pathlib.Path(found).parent) + os.pathsep + env["PATH"]
        run([SCRIPTS / "run-torchrun.sh", "1", "2", f"127.0.0.1:{free_port()}", *TRAIN, "-e", "tr", "--save-dir",
             root / "runs"], env, root)
        check_metrics(root / "runs" / "tr")


if __name__ == "__main__":
    {"one-node": one_node, "ssh-tmux": ssh_tmux, "slurm": slurm, "mpirun": mpirun, "torchrun": torchrun}[sys.argv[3]](sys.argv[1], sys.argv[2])
    print("ok")
