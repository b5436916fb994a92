#!/usr/bin/env python3
"""meshtorch-doctor on 2 ranks under meshrun: every check reports, and each condition it looks for
(a low open-files limit, a save folder without room for two checkpoints, a timeout close to the
step time) is reported as such, with the flags of a chapter's command accepted as they are.

usage: doctor_checks.py MESHRUN DOCTOR
"""
import json
import os
import pathlib
import resource
import subprocess
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))
from ports import free_port  # noqa: E402


def doctor(meshrun, binary, *args, open_files=None):
    def limit():
        if open_files:
            resource.setrlimit(resource.RLIMIT_NOFILE, (open_files, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    cmd = [meshrun, "--nproc-per-node", "2", "--master-port", str(free_port()), "--",
           binary, "--threads", "1", "--timeout", "30", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, preexec_fn=limit,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    print(f"$ {' '.join(cmd[5:])}\n{proc.stdout}", flush=True)
    return proc


def expect(proc, *lines, code=0):
    failures = [f"exit code {proc.returncode}, expected {code}"] if (proc.returncode == 0) != (code == 0) else []
    failures += [f"missing: {line}" for line in lines if line not in proc.stdout]
    if failures:
        sys.exit("FAILED:\n  " + "\n  ".join(failures) + f"\n{proc.stdout}\n{proc.stderr}")


def main():
    meshrun, binary = sys.argv[1:3]
    with tempfile.TemporaryDirectory() as tmp:
        runs = f"{tmp}/runs"
        # A healthy setup: every check reports; --tp (chapter 6's flag) is accepted and ignored.
        proc = doctor(meshrun, binary, "-m", "llama-tiny", "--save-dir", runs, "--tp", "2")
        expect(proc, "[ok]   rendezvous   2 ranks on 1 node(s) met", "[ok]   clocks       the ranks' wall clocks agree within",
               f"[ok]   save folder  {runs} is seen by every rank", "a checkpoint of llama-tiny with AdamW takes",
               "[info] GPUs", "[info] timeout      30 s; no step times to compare with")
        # A low open-files limit is named, with the ranks and the command that raises it.
        proc = doctor(meshrun, binary, "-m", "llama-tiny", "--save-dir", runs, open_files=1024)
        expect(proc, "[warn] open files   rank(s) 0, 1 may open only 1024 files", "ulimit -n")
        # A save folder without room for two checkpoints of the model fails the check.
        proc = doctor(meshrun, binary, "-m", "llama-3.1-405b", "--save-dir", runs)
        expect(proc, "[FAIL] save folder", "a checkpoint of llama-3.1-405b with AdamW takes", code=1)
        # A timeout close to the slowest logged step is a warning.
        exp = pathlib.Path(runs) / "slow"
        exp.mkdir(parents=True)
        (exp / "metrics.jsonl").write_text("".join(json.dumps({"global_step": s, "time/total": t}) + "\n"
                                                   for s, t in [(10, 1500.0), (20, 4000.0)]))
        proc = doctor(meshrun, binary, "-m", "llama-tiny", "--save-dir", runs, "-e", "slow")
        expect(proc, f"[warn] timeout      30 s is 8x the slowest step in {exp / 'metrics.jsonl'} (4000 ms)",
               "raise --timeout")
    print("ok")


if __name__ == "__main__":
    main()
