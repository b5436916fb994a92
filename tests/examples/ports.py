"""Free loopback ports for the example checks."""
import socket
import sys


def free_port():
    """A port p with p and p + 1 free (meshrun's node rendezvous uses the master port + 1)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    sys.exit("no free port pair")
