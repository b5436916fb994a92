#!/usr/bin/env python3
"""Who may reach rank 0's rendezvous store: it listens on MASTER_ADDR only (loopback for a job on
this machine), and with MESHTORCH_JOB_TOKEN it refuses, in under a second and naming the peer's
address, every connection that does not open with the token; a rank with a wrong token fails at
once; meshrun --job-token passes the token to its ranks.

usage: store_gate_checks.py MESHRUN EXAMPLE
"""
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))
from ports import free_port  # noqa: E402

failures = []


def check(condition, what):
    print(("ok:     " if condition else "FAILED: ") + what)
    if not condition:
        failures.append(what)


def start_rank(example, rank, port, save_dir, token=None, timeout="6"):
    env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               OMP_NUM_THREADS="1")
    env.pop("MESHTORCH_JOB_TOKEN", None)
    if token is not None:
        env["MESHTORCH_JOB_TOKEN"] = token
    return subprocess.Popen([example, "-m", "llama-tiny", "--threads", "1", "--timeout", timeout,
                             "--save-dir", save_dir], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def wait_listening(port, seconds=20):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if listening_addresses(port):
            return
        time.sleep(0.05)


def listening_addresses(port):
    """Local addresses of the sockets listening on `port`, from /proc/net/tcp{,6}."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = pathlib.Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            address, hex_port = fields[1].split(":")
            if fields[3] == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.append(address)
    return found


def stranger(port, data):
    """Connects, sends `data`, and returns (its own port, the answer, seconds until closed)."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        started = time.monotonic()
        s.sendall(data)
        s.settimeout(5)
        answer = b""
        try:
            while chunk := s.recv(200):
                answer += chunk
        except ConnectionResetError:
            pass
        return s.getsockname()[1], answer.decode(errors="replace"), time.monotonic() - started


def binding(example, save_dir):
    port = free_port()
    rank0 = start_rank(example, 0, port, save_dir, timeout="3")
    wait_listening(port)
    addresses = listening_addresses(port)
    check(addresses == ["0100007F"], f"without a token the store listens on 127.0.0.1 only (found {addresses})")
    try:
        socket.create_connection(("127.0.0.2", port), timeout=1).close()
        check(False, "a connection to another loopback address (127.0.0.2) is refused")
    except OSError as e:
        check(e.errno == 111, f"a connection to another loopback address (127.0.0.2) is refused ({e})")
    rank0.communicate(timeout=60)


def token(example, save_dir):
    port = free_port()
    rank0 = start_rank(example, 0, port, save_dir, token="s3cret")
    wait_listening(port)
    addresses = listening_addresses(port)
    check(addresses == ["0100007F"], f"with a token the gate listens on 127.0.0.1 only (found {addresses})")
    strangers = []
    for what, data, reason in [("sends nothing", b"", "it sent no job token within 800 ms"),
                               ("speaks the store's protocol", b"\x0b\x00\x00\x00\x3c\x3a\x0c\x00",
                                "it presented no job token"),
                               ("has a wrong token", b"meshtorch-job-token nope\n",
                                "it presented a wrong job token")]:
        own_port, answer, seconds = stranger(port, data)
        print(f"a stranger that {what}: {answer.strip()!r} after {seconds:.2f} s")
        check(reason in answer, f"a stranger that {what} is told why: {reason}")
        check(seconds < 1.0, f"a stranger that {what} is refused in under a second ({seconds:.2f} s)")
        strangers.append((what, own_port, reason))
    started = time.monotonic()
    wrong = start_rank(example, 1, port, save_dir, token="wrong")
    output, _ = wrong.communicate(timeout=60)
    seconds = time.monotonic() - started
    print(output)
    check(wrong.returncode != 0, "rank 1 with a wrong token fails")
    check(f"rank 1: the rendezvous store at 127.0.0.1:{port} refused: it presented a wrong job token" in output,
          "rank 1 with a wrong token is told the store refused it and why")
    check(seconds < 10, f"rank 1 with a wrong token fails at once, not after --timeout ({seconds:.1f} s)")
    output, _ = rank0.communicate(timeout=60)
    print(output)
    for what, own_port, reason in strangers:
        check(f"rank 0: the rendezvous store at 127.0.0.1:{port} refused a connection from 127.0.0.1:{own_port}: "
              f"{reason}" in output, f"rank 0 names the stranger that {what} by its address")


def through_meshrun(meshrun, example, save_dir):
    proc = subprocess.run([meshrun, "--nproc-per-node", "2", "--master-port", str(free_port()), "--job-token",
                           "s3cret", "--", example, "-m", "llama-tiny", "--threads", "1", "-b", "2", "--max-steps",
                           "2", "--save-dir", save_dir, "-e", "gate"],
                          env={k: v for k, v in os.environ.items() if k != "MESHTORCH_JOB_TOKEN"},
                          capture_output=True, text=True, timeout=120)
    print(proc.stdout[-2000:] + proc.stderr[-2000:])
    check(proc.returncode == 0, "two ranks under meshrun --job-token meet through the gate and train")
    check("refused" not in proc.stdout + proc.stderr, "no rank of the job is refused")


def main():
    meshrun, example = sys.argv[1], sys.argv[2]
    with tempfile.TemporaryDirectory() as save_dir:
        binding(example, save_dir)
        token(example, save_dir)
        through_meshrun(meshrun, example, save_dir)
    if failures:
        sys.exit("FAILED:\n  " + "\n  ".join(failures))
    print("ok")


if __name__ == "__main__":
    main()
