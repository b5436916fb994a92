#!/usr/bin/env python3
"""meshtorch-top on this node and over a hosts file (ssh stood in for by a fake that runs the
command here): rank processes are found by their launcher variables, with their state (a rank
stopped with SIGSTOP shows as stopped), and an unreachable host is named.

usage: top_checks.py MESHTORCH_TOP
"""
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile

FAKE_SSH = """#!/bin/sh
# ssh [-o OPTION]... HOST COMMAND: runs COMMAND here; the host "down" is unreachable.
while [ "$1" = "-o" ]; do shift 2; done
host="$1"; shift
if [ "$host" = down ]; then echo "ssh: connect to host down port 22: Connection refused" >&2; exit 255; fi
exec sh -c "$*"
"""


def main():
    top = sys.argv[1]
    sleeping = subprocess.Popen(["sleep", "120"], env=dict(os.environ, RANK="7", LOCAL_RANK="3"))
    stopped = subprocess.Popen(["sleep", "120"], env=dict(os.environ, RANK="8", LOCAL_RANK="0"))
    os.kill(stopped.pid, signal.SIGSTOP)
    try:
        sample = json.loads(subprocess.run([top, "--local", "--json", "--once", "--interval", "0.2"], check=True,
                                           capture_output=True, text=True, timeout=30).stdout)
        ranks = {r["pid"]: r for r in sample["ranks"]}
        assert ranks[sleeping.pid]["rank"] == "7" and ranks[sleeping.pid]["local_rank"] == "3", ranks
        assert ranks[sleeping.pid]["state"] == "sleeping", ranks[sleeping.pid]
        assert ranks[stopped.pid]["state"] == "stopped", ranks[stopped.pid]
        assert 0 <= sample["cpu_percent"] <= 100 and sample["memory_total_bytes"] > 0, sample
        assert os.getpid() not in ranks, "a process without launcher variables is listed"

        table = subprocess.run([top, "--local", "--once", "--interval", "0.2"], check=True, capture_output=True,
                               text=True, timeout=30).stdout
        print(table)
        assert f"rank    7 (local  3) pid {sleeping.pid:>7} sleeping" in table, table
        assert f"rank    8 (local  0) pid {stopped.pid:>7} stopped" in table, table

        with tempfile.TemporaryDirectory() as tmp:
            fakes = pathlib.Path(tmp) / "fakes"
            fakes.mkdir()
            (fakes / "ssh").write_text(FAKE_SSH)
            (fakes / "ssh").chmod(0o755)
            hosts = pathlib.Path(tmp) / "hosts"
            hosts.write_text("# the job's nodes\nnode-a slots=2\nnode-b\ndown\n")
            env = dict(os.environ, PATH=f"{fakes}:{os.environ['PATH']}")
            table = subprocess.run([top, "--hosts", str(hosts), "--once", "--interval", "0.2"], check=True,
                                   capture_output=True, text=True, timeout=60, env=env).stdout
            print(table)
            assert table.count(f"pid {stopped.pid:>7} stopped") == 2, table
            assert "down: unreachable (ssh: connect to host down port 22: Connection refused)" in table, table
    finally:
        for proc in (sleeping, stopped):
            proc.kill()
            proc.wait()
    print("ok")


if __name__ == "__main__":
    main()
