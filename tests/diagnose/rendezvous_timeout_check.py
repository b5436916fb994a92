#!/usr/bin/env python3
"""A rank whose peers never come gives up at rendezvous after --timeout (or MESHTORCH_TIMEOUT),
naming the rendezvous, instead of waiting the default 600 s.

usage: rendezvous_timeout_check.py EXAMPLE
"""
import os
import pathlib
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))
from ports import free_port  # noqa: E402


def main():
    example = sys.argv[1]
    failures = []
    for how, extra_args, extra_env, expected_ms in [("--timeout 3", ["--timeout", "3"], {}, 3000),
                                                    ("MESHTORCH_TIMEOUT=2", [], {"MESHTORCH_TIMEOUT": "2"}, 2000)]:
        env = dict(os.environ, RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                   OMP_NUM_THREADS="1", **extra_env)
        start = time.monotonic()
        proc = subprocess.run([example, "-m", "llama-tiny", "--threads", "1", *extra_args], env=env,
                              capture_output=True, text=True, timeout=60)
        elapsed = time.monotonic() - start
        output = proc.stdout + proc.stderr
        print(f"{how}: exit {proc.returncode} after {elapsed:.1f} s\n{output}")
        if proc.returncode == 0:
            failures.append(f"{how}: exit code 0")
        if elapsed > expected_ms / 1000 + 10:
            failures.append(f"{how}: took {elapsed:.1f} s")
        if f"rendezvous at 127.0.0.1:{env['MASTER_PORT']} failed within {expected_ms} ms" not in output:
            failures.append(f"{how}: the error does not name the rendezvous and its timeout")
        if "frame #" in output:
            failures.append(f"{how}: the error carries a C++ backtrace")
    if failures:
        sys.exit("FAILED:\n  " + "\n  ".join(failures))
    print("ok")


if __name__ == "__main__":
    main()
