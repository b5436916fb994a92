"""Runs one rank's program in a session of its own, as torchrun starts each rank, and passes its
exit status back. Used by bench/runner.py between meshrun and our chapter-2 binary:

    meshrun --nproc-per-node 2 -- python bench/rank_session.py build/bin/02-distributed-data-parallel ...

Why: on Linux with autogroup scheduling (/proc/sys/kernel/sched_autogroup_enabled = 1) each
session is one scheduling group with one fair share of the CPU. torchrun puts every rank in a
session of its own; meshrun keeps its ranks in its session (each rank leads a process group, so
it cannot call setsid itself). With other load on the machine, torchrun's two ranks then get two
shares and meshrun's two ranks one, which measures the launchers, not DDP. A rank leads its
process group, so setsid() needs a fork: the program runs in the child; SIGTERM, SIGINT and
SIGHUP sent to this process (meshrun stops ranks that way) are passed on to the child's session.
Standard library only, so it starts in milliseconds.
"""

import os
import signal
import sys


def main():
    if len(sys.argv) < 2:
        sys.exit("usage: rank_session.py PROGRAM [ARGS...]")
    child = os.fork()
    if child == 0:
        os.setsid()
        try:
            os.execvp(sys.argv[1], sys.argv[1:])
        except OSError as e:
            print(f"rank_session.py: cannot run {sys.argv[1]}: {e}", file=sys.stderr)
            os._exit(127)

    def forward(signo, _frame):
        try:
            os.killpg(child, signo)
        except ProcessLookupError:
            pass

    for signo in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signo, forward)
    while True:
        try:
            _, status = os.waitpid(child, 0)
            break
        except InterruptedError:
            continue
    sys.exit(os.waitstatus_to_exitcode(status) if not os.WIFSIGNALED(status) else 128 + os.WTERMSIG(status))


if __name__ == "__main__":
    main()
