#!/usr/bin/env python3
"""usage: launch.py MESHRUN NPROC PROGRAM ARGS...: runs PROGRAM on NPROC ranks on a free port.

LAUNCH_TIMEOUT (seconds, default 80) bounds the whole run."""
import os
import socket
import subprocess
import sys

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
meshrun, nproc, *program = sys.argv[1:]
env = dict(os.environ, OMP_NUM_THREADS="1")
sys.exit(subprocess.run([meshrun, "--nproc-per-node", nproc, "--master-port", str(port), "--prefix-output", "--",
                         *program], env=env, timeout=float(os.environ.get("LAUNCH_TIMEOUT", "80"))).returncode)
