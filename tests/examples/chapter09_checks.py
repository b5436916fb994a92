#!/usr/bin/env python3
"""End-to-end checks of examples/09-diagnosing-errors: each failure caused on purpose on 2 ranks
under meshrun, and what meshtorch reports for it.

usage: chapter09_checks.py MESHRUN EXAMPLE MESHTORCH_DIAGNOSE {hang|desync|desync-gloo|crash|nan|slow|elastic-restart}
"""
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from ports import free_port  # noqa: E402

TIMEOUT_S = 10
FLAGS = ["-m", "llama-tiny", "-d", "builtin", "-s", "32", "-b", "2", "--threads", "1", "--dtype", "float32",
         "--log-freq", "2", "--timeout", str(TIMEOUT_S)]


class Run:
    """A 2-rank run under meshrun whose output is read as it comes."""

    def __init__(self, meshrun, example, logs, *args, meshrun_args=()):
        cmd = [meshrun, "--nproc-per-node", "2", "--master-port", str(free_port()), "--log-dir", str(logs),
               "--redirects", "0", "--prefix-output", *meshrun_args, "--", example, *FLAGS, *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=dict(os.environ, OMP_NUM_THREADS="1"))
        self.lines = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self.reader.start()

    def text(self):
        return "".join(self.lines)

    def wait_for(self, needle, seconds):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if needle in self.text():
                return time.monotonic()
            if self.proc.poll() is not None and needle not in self.text():
                time.sleep(0.5)
                if needle in self.text():
                    return time.monotonic()
                break
            time.sleep(0.1)
        sys.exit(f"'{needle}' did not appear within {seconds} s:\n{self.text()}")

    def finish(self, seconds=120):
        try:
            code = self.proc.wait(seconds)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            sys.exit(f"meshrun still runs after {seconds} s:\n{self.text()}")
        self.reader.join(10)
        print(self.text())
        return code


def require(condition, what, output):
    if not condition:
        sys.exit(f"FAILED: {what}\n{output}")


def diagnose(tool, logs):
    proc = subprocess.run([tool, str(logs)], capture_output=True, text=True, timeout=60)
    print(f"meshtorch-diagnose ({proc.returncode}):\n{proc.stdout}{proc.stderr}")
    return proc.stdout


def hang(meshrun, example, diagnose_tool, logs):
    run = Run(meshrun, example, logs, "--fault", "hang", "--fault-step", "3", "--max-steps", "1000")
    caused = run.wait_for("causing the 'hang' fault at step 3", 120)
    # While it hangs: every rank's stacks on request; rank 1's main thread sleeps in the fault.
    time.sleep(2)
    request = subprocess.run([meshrun, "--dump-stacks", "--pid", str(run.proc.pid)], capture_output=True, text=True,
                             timeout=30)
    require(request.returncode == 0, f"meshrun --dump-stacks failed: {request.stderr}", run.text())
    run.wait_for("rank 1: end of stacks", 30)
    block = re.search(r"rank 1: stacks of every thread.*?rank 1: end of stacks", run.text(), re.S)
    require(block and "nanosleep" in block.group(0), "rank 1's stacks do not show it asleep", run.text())
    code = run.finish()
    elapsed = time.monotonic() - caused
    output = run.text()
    print(f"meshrun exited with {code} {elapsed:.1f} s after the fault")
    require(code != 0, "meshrun exited with 0", output)
    require(elapsed < TIMEOUT_S + 30, f"the job ended {elapsed:.1f} s after the fault", output)
    require("[meshrun] the job stalled: rank 1 " in output, "meshrun's summary does not name rank 1", output)
    require("culprit: rank 1 " in diagnose(diagnose_tool, logs), "meshtorch-diagnose does not name rank 1", output)


def run_desync(meshrun, example, logs):
    """Runs the desync fault; returns meshrun's output, which must be a failure."""
    run = Run(meshrun, example, logs, "--fault", "desync", "--fault-step", "3", "--max-steps", "1000")
    code = run.finish()
    output = run.text()
    require(code != 0, "meshrun exited with 0", output)
    return output


def require_last_bucket_before(report, seq, transport):
    """The ring holds DDP's last completed bucket two collectives before the extra one."""
    require(re.search(rf"all_reduce #{seq - 2} over the DP group \[0, 1\] \({transport}\) \[\d+\] Float \(completed\): "
                      rf"DDP all_reduce", report), "the ring does not show DDP's last completed bucket", report)


def desync(meshrun, example, diagnose_tool, logs):
    """Rank 1 all-reduces one element where rank 0 all-reduces DDP's gradient bucket. Through shared
    memory (the default CPU transport) both ranks see at once that their steps differ and fail with
    a message naming both collectives; every rank's flight recorder is written on the failure, and
    meshtorch-diagnose names the desync with both shapes, after DDP's last completed bucket."""
    output = run_desync(meshrun, example, logs)
    mismatch = re.search(r"the ranks issued different collectives \(a collective mismatch\): group rank (\d) is in "
                         r"all_reduce \(sum\) of (\d+) bytes of Float, group rank (\d) in all_reduce \(sum\) of (\d+) "
                         r"bytes of Float", output)
    require(mismatch, "meshrun's summary does not carry the transport's mismatch message from the error file", output)
    sizes = {int(mismatch.group(1)): int(mismatch.group(2)), int(mismatch.group(3)): int(mismatch.group(4))}
    require(sizes.get(1) == 4 and sizes.get(0, 0) > 4, f"the message's sizes by rank are {sizes}", output)
    report = diagnose(diagnose_tool, logs)
    found = re.search(r"culprit: desync: ranks issued a collective on tensors of different shapes or dtypes: rank 1 is "
                      r"in all_reduce #(\d+) over the DP group \[0, 1\] \(shm\) on Float\[1\] while rank 0 is in "
                      r"all_reduce #\d+ on Float\[\d+\]", report)
    require(found, "meshtorch-diagnose does not name rank 1's one-element all_reduce", report)
    seq = int(found.group(1))
    require(f"all_reduce #{seq} over the DP group [0, 1] (shm) [1] Float (failed)" in report,
            "the ring does not show the one-element all_reduce that failed", report)
    require_last_bucket_before(report, seq, "shm")


def desync_gloo(meshrun, example, diagnose_tool, logs):
    """The same over Gloo's sockets (MESHTORCH_CPU_TRANSPORT=gloo): Gloo sees the sizes differ and
    aborts rank 1; the flight recorder shows the extra collective, with its shape, after the last one
    both ranks completed."""
    os.environ["MESHTORCH_CPU_TRANSPORT"] = "gloo"
    output = run_desync(meshrun, example, logs)
    require("rank 1 (node 0, local rank 1, attempt 0) failed first: it was killed by SIGABRT" in output,
            "meshrun does not report rank 1's abort", output)
    require("Is there a distributed collective mismatch in your code?" in output,
            "meshrun's summary does not carry Gloo's mismatch message from the error file", output)
    report = diagnose(diagnose_tool, logs)
    extra = re.search(r"culprit: rank 1 ended on a fatal signal SIGABRT; it was in all_reduce #(\d+) over the DP group",
                      report)
    require(extra, "meshtorch-diagnose does not name rank 1 and its collective", report)
    seq = int(extra.group(1))
    require(f"all_reduce #{seq} over the DP group [0, 1] (gloo) [1] Float (waiting)" in report,
            "the ring does not show the one-element all_reduce in flight", report)
    require_last_bucket_before(report, seq, "gloo")


def crash(meshrun, example, diagnose_tool, logs):
    run = Run(meshrun, example, logs, "--fault", "crash", "--fault-step", "3", "--max-steps", "1000")
    code = run.finish()
    output = run.text()
    require(code == 128 + 11, f"meshrun exited with {code}, not 139 (SIGSEGV)", output)
    require("rank 1 (node 0, local rank 1, attempt 0) failed first: it was killed by SIGSEGV" in output,
            "meshrun does not report rank 1 killed by SIGSEGV", output)
    block = re.search(r"rank 1: stacks of every thread \(pid \d+, fatal signal SIGSEGV\).*?rank 1: end of stacks",
                      output, re.S)
    require(block and re.search(r"in (cause_fault|train|main)\b", block.group(0)),
            "rank 1 wrote no stacks of the crash naming the example's code", output)
    require("culprit: rank 1 ended on a fatal signal SIGSEGV" in diagnose(diagnose_tool, logs),
            "meshtorch-diagnose does not name rank 1's crash", output)


def nan(meshrun, example, diagnose_tool, logs):
    run = Run(meshrun, example, logs, "--fault", "nan", "--fault-step", "3", "--max-steps", "1000")
    code = run.finish()
    output = run.text()
    require(code != 0, "meshrun exited with 0", output)
    for rank in (0, 1):
        require(re.search(rf"\[rank{rank}\]:.*the loss of global_step 3 is nan", output),
                f"rank {rank} does not stop at step 3 naming the NaN", output)


def slow(meshrun, example, diagnose_tool, logs):
    """--measure-waiting: with rank 1 100 ms slower per step, rank 0's time/waiting (what rank 0
    prints) is about 100 ms; without the fault it is a small fraction of that."""
    def waiting(*fault):
        with tempfile.TemporaryDirectory() as tmp:
            run = Run(meshrun, example, logs / (fault[1] if fault else "none"), "--save-dir", tmp, "-e", "w",
                      "--max-steps", "12", "--ckpt-freq", "1000", "--measure-waiting", *fault)
            require(run.finish() == 0, "the run failed", run.text())
            records = [json.loads(line) for line in (pathlib.Path(tmp) / "w" / "metrics.jsonl").read_text().splitlines()]
            require(all("time/waiting" in r for r in records), "no time/waiting in the metrics", run.text())
            return records[-1]["time/waiting"]
    balanced, slowed = waiting(), waiting("--fault", "slow", "--fault-step", "1")
    print(f"rank 0's time/waiting: {balanced:.1f} ms per step balanced, {slowed:.1f} ms with rank 1 100 ms slower")
    require(80 <= slowed <= 400, f"time/waiting {slowed:.1f} ms with a 100 ms slower rank", "")
    require(balanced < 0.5 * slowed, f"time/waiting {balanced:.1f} ms without the fault", "")


def elastic_restart(meshrun, example, diagnose_tool, logs):
    with tempfile.TemporaryDirectory() as tmp:
        common = ["--save-dir", tmp, "--ckpt-freq", "4", "--max-steps", "12"]
        straight = Run(meshrun, example, logs / "straight", *common, "-e", "straight")
        require(straight.finish() == 0, "the straight run failed", straight.text())
        restarted = Run(meshrun, example, logs / "elastic", *common, "-e", "elastic", "--fault", "crash",
                        "--fault-step", "6", meshrun_args=["--max-restarts", "1"])
        code = restarted.finish()
        output = restarted.text()
        require(code == 0, f"meshrun exited with {code}", output)
        require("failed first: it was killed by SIGSEGV" in output and "restarting all ranks (restart 1 of 1)" in output,
                "meshrun did not restart after the crash", output)
        require("resumed from" in output and "at global_step 4" in output, "the restart did not resume at step 4",
                output)
        require("finished successfully" in output and "after 1 restart(s)" in output, "no success after 1 restart",
                output)
        a = [json.loads(line) for line in (pathlib.Path(tmp) / "straight" / "metrics.jsonl").read_text().splitlines()]
        b = [json.loads(line) for line in (pathlib.Path(tmp) / "elastic" / "metrics.jsonl").read_text().splitlines()]
        # Attempt 0 logged steps 2 and 4 (and nothing of step 6: it crashed there); attempt 1 resumed at 4.
        steps_b = [r["global_step"] for r in b]
        require(steps_b == [2, 4, 6, 8, 10, 12], f"logged steps {steps_b}", output)
        for x, y in zip(a, b):
            print(f"step {x['global_step']}: straight {x['running_loss']:.9f} restarted {y['running_loss']:.9f}")
            require(abs(x["running_loss"] - y["running_loss"]) <= 1e-6 * abs(x["running_loss"]), "losses differ",
                    output)


def main():
    meshrun, example, diagnose_tool, check = sys.argv[1:5]
    with tempfile.TemporaryDirectory() as tmp:
        {"hang": hang, "desync": desync, "desync-gloo": desync_gloo, "crash": crash, "nan": nan, "slow": slow,
         "elastic-restart": elastic_restart}[check](meshrun, example, diagnose_tool, pathlib.Path(tmp) / "logs")
    print("ok")


if __name__ == "__main__":
    main()
