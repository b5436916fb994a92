"""Free loopback ports for the example checks."""
import random
import socket
import sys


def free_port():
    """A port p with p and p + 1 free (meshrun's node rendezvous uses the master port + 1).

    Drawn below the kernel's ephemeral range (32768-60999), as tests/comm/multiprocess.hpp draws
    its ports: a port the kernel handed out and took back may next be given to another test's Gloo
    ranks, and a rank that connects before our store listens would reach their socket and break
    their connections ("Connection reset by peer" in connectFullMesh)."""
    for _ in range(200):
        port = random.randint(20000, 32000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    sys.exit("no free port pair in 20000-32001")
