#!/usr/bin/env python3
"""A rank stopped with SIGSTOP in a 2-rank run under meshrun with --timeout 10: every process
must end within 20 s with a non-zero exit code, the output must name the stopped rank and its
last collective, and meshtorch-diagnose on the log folder must say the same.

Before the stop, `meshrun --dump-stacks` must have every rank write its threads' stacks to its
log while the run goes on, and the surviving rank writes them again before the watchdog ends it.

With "abort" as the last argument the rank gets SIGABRT instead: it must leave its flight
recorder dump behind (written on the fatal signal), and meshtorch-diagnose must name it.

usage: stalled_rank_checks.py MESHRUN EXAMPLE MESHTORCH_DIAGNOSE [STOPPED_RANK [abort]]
"""
import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))
from ports import free_port  # noqa: E402

TIMEOUT_S = 10
DEADLINE_S = 20
# "all_reduce #57 over the world group [0, 1] (gloo)"; FSDP's ops name their unit too.
COLLECTIVE = r".+? #\d+ over the \S+ group \[[\d, ]+\] \(\w+\)"


def children(pid):
    """pid -> RANK of meshrun's child processes."""
    ranks = {}
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat[stat.rindex(")") + 2:].split()[1])
            if ppid != pid:
                continue
            env = dict(v.split("=", 1) for v in (entry / "environ").read_bytes().decode(errors="replace").split("\0") if "=" in v)
            if "RANK" in env:
                ranks[int(entry.name)] = int(env["RANK"])
        except (OSError, ValueError, IndexError):
            continue
    return ranks


def alive(pid):
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def main():
    meshrun, example, diagnose = sys.argv[1:4]
    stopped_rank = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    abort = len(sys.argv) > 5 and sys.argv[5] == "abort"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("MESHTORCH_FLIGHT_RECORDER_DIR", None)
    with tempfile.TemporaryDirectory() as tmp:
        logs = pathlib.Path(tmp) / "logs"
        cmd = [meshrun, "--nproc-per-node", "2", "--master-port", str(free_port()), "--log-dir", str(logs),
               "--redirects", "0", "--prefix-output", "--",
               example, "-m", "llama-tiny", "-d", "builtin", "-s", "32", "-b", "2", "--threads", "1",
               "--dtype", "float32", "--log-freq", "10", "--max-steps", "1000000", "--timeout", str(TIMEOUT_S)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        lines = []
        training = threading.Event()

        def read():
            for line in proc.stdout:
                lines.append(line)
                if "global_step=" in line:
                    training.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            if not training.wait(120):
                sys.exit("the run did not start training within 120 s:\n" + "".join(lines))
            time.sleep(1)
            ranks = children(proc.pid)
            victim = next((pid for pid, rank in ranks.items() if rank == stopped_rank), None)
            survivor = next((pid for pid, rank in ranks.items() if rank != stopped_rank), None)
            if victim is None or survivor is None:
                sys.exit(f"rank {stopped_rank} or its peer not found among meshrun's children {ranks}")
            # A dump on request (SIGUSR2) while the run goes on.
            requested = logs / "0" / "flight_recorder" / f"rank_{1 - stopped_rank}.json"
            os.kill(survivor, signal.SIGUSR2)
            for _ in range(50):
                if requested.exists():
                    break
                time.sleep(0.1)
            if not requested.exists() or '"reason": "request (SIGUSR2)"' not in requested.read_text():
                sys.exit(f"SIGUSR2 wrote no dump at {requested}:\n" + "".join(lines))
            if proc.poll() is not None:
                sys.exit("the run ended after SIGUSR2:\n" + "".join(lines))
            if not abort:
                check_stack_request(meshrun, proc, lines)
            os.kill(victim, signal.SIGABRT if abort else signal.SIGSTOP)
            stopped_at = time.monotonic()
            print(f"stopped rank {stopped_rank} (pid {victim})", flush=True)
            try:
                code = proc.wait(DEADLINE_S + 20)
            except subprocess.TimeoutExpired:
                sys.exit(f"meshrun still runs {DEADLINE_S + 20} s after the stop:\n" + "".join(lines))
            elapsed = time.monotonic() - stopped_at
            reader.join(10)
        finally:
            if proc.poll() is None:
                proc.kill()
            for pid in children(proc.pid):
                os.kill(pid, signal.SIGKILL)
        output = "".join(lines)
        print(output)
        print(f"meshrun exited with {code} {elapsed:.1f} s after the stop")
        if abort:
            check_abort(diagnose, logs, stopped_rank, code, output)
            return
        failures = []
        if elapsed > DEADLINE_S:
            failures.append(f"ended {elapsed:.1f} s after the stop, more than {DEADLINE_S} s")
        if code == 0:
            failures.append("meshrun exited with code 0")
        still = [pid for pid in ranks if alive(pid)]
        if still:
            failures.append(f"rank processes {still} still exist")
        missed = re.search(rf"rank {stopped_rank} did not arrive at ({COLLECTIVE}), where", output)
        if not missed:
            failures.append(f"the output does not say which collective rank {stopped_rank} did not arrive at")
        if f"the job stalled: rank {stopped_rank} did not arrive" not in output:
            failures.append("meshrun's summary does not name the stopped rank")
        last = re.search(rf"its last collective was ({COLLECTIVE})", output)
        if not last:
            failures.append("the output does not name the stopped rank's last collective")
        diagnosis = subprocess.run([diagnose, str(logs)], capture_output=True, text=True, timeout=60)
        print(f"meshtorch-diagnose {logs} ({diagnosis.returncode}):\n{diagnosis.stdout}{diagnosis.stderr}")
        if diagnosis.returncode != 0:
            failures.append(f"meshtorch-diagnose exited with {diagnosis.returncode}")
        if missed and f"culprit: rank {stopped_rank} did not arrive at {missed.group(1)}" not in diagnosis.stdout:
            failures.append("meshtorch-diagnose does not name the same rank and collective")
        if last and f"its last collective was {last.group(1)}" not in diagnosis.stdout:
            failures.append("meshtorch-diagnose does not name the same last collective")
        survivor_rank = 1 - stopped_rank
        if not re.search(rf"rank {survivor_rank}: stacks of every thread \(pid \d+, the watchdog ends this rank", output):
            failures.append(f"rank {survivor_rank} wrote no stacks before the watchdog ended it")
        if failures:
            sys.exit("FAILED:\n  " + "\n  ".join(failures))
        print("ok")


def check_stack_request(meshrun, proc, lines):
    """meshrun --dump-stacks has every rank write its threads' stacks to its log, symbolised, and
    the run goes on."""
    start = len(lines)
    request = subprocess.run([meshrun, "--dump-stacks", "--pid", str(proc.pid)], capture_output=True, text=True,
                             timeout=30)
    if request.returncode != 0:
        sys.exit(f"meshrun --dump-stacks failed ({request.returncode}): {request.stderr}")
    began = time.monotonic()
    while time.monotonic() - began < 30:
        text = "".join(lines[start:])
        if all(f"rank {r}: end of stacks" in text for r in (0, 1)):
            break
        time.sleep(0.2)
    text = "".join(lines[start:])
    print(f"stacks written {time.monotonic() - began:.1f} s after meshrun --dump-stacks", flush=True)
    for rank in (0, 1):
        block = re.search(rf"rank {rank}: stacks of every thread \(pid \d+, request \(SIGUSR1\)\)(.*?)"
                          rf"rank {rank}: end of stacks", text, re.S)
        if not block:
            sys.exit(f"rank {rank} wrote no stacks after meshrun --dump-stacks:\n{text}")
        # Each line carries its rank's prefix; the main thread's stack names the example's functions,
        # or stops, said so, in a BLAS kernel without unwind tables (MKL's sgemm).
        main = re.search(r"the main thread:(.*?)\[rank\d\]:thread ", block.group(1), re.S)
        if not main or not (re.search(r"in (main|train)\b", main.group(1)) or
                            "the stack stops here: a frame without unwind information" in main.group(1)):
            sys.exit(f"rank {rank}'s stacks do not show the main thread in main/train:\n{block.group(1)}")
    if proc.poll() is not None:
        sys.exit("the run ended after meshrun --dump-stacks:\n" + "".join(lines))


def check_abort(diagnose, logs, rank, code, output):
    failures = []
    if code == 0:
        failures.append("meshrun exited with code 0")
    if f"rank {rank} (node 0, local rank {rank}, attempt 0) failed first: it was killed by SIGABRT" not in output:
        failures.append(f"meshrun does not report rank {rank} killed by SIGABRT")
    dump = logs / "0" / "flight_recorder" / f"rank_{rank}.json"
    if not dump.exists() or '"reason": "fatal signal SIGABRT"' not in dump.read_text():
        failures.append(f"no dump written on the fatal signal at {dump}")
    diagnosis = subprocess.run([diagnose, str(logs)], capture_output=True, text=True, timeout=60)
    print(f"meshtorch-diagnose {logs} ({diagnosis.returncode}):\n{diagnosis.stdout}{diagnosis.stderr}")
    if f"culprit: rank {rank} ended on a fatal signal SIGABRT" not in diagnosis.stdout:
        failures.append("meshtorch-diagnose does not name the rank that died")
    if failures:
        sys.exit("FAILED:\n  " + "\n  ".join(failures))
    print("ok")


if __name__ == "__main__":
    main()
