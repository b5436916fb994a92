#!/usr/bin/env python3
"""usage: launch.py MESHRUN NPROC PROGRAM ARGS...: runs PROGRAM on NPROC ranks on a free port.

LAUNCH_TIMEOUT (seconds, default 80) bounds the whole run."""
import os
import pathlib
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))
from ports import free_port  # noqa: E402  (below the ephemeral range: see ports.py)

port = free_port()
meshrun, nproc, *program = sys.argv[1:]
env = dict(os.environ, OMP_NUM_THREADS="1")
sys.exit(subprocess.run([meshrun, "--nproc-per-node", nproc, "--master-port", str(port), "--prefix-output", "--",
                         *program], env=env, timeout=float(os.environ.get("LAUNCH_TIMEOUT", "80"))).returncode)
