"""Start a script's ranks on this host as a Kubernetes Job's pods start
them: each rank its own process with the plain environment (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT; no LOCAL_RANK, no torchrun agent).

    python support/pods.py --nproc_per_node=N SCRIPT [ARGS ...]

What the tests and the benchmark use where the launcher is not what they
test: a torchrun agent costs about 2 CPU-seconds a start on this project's
test machine (it imports torch), this launcher imports nothing of it. What
torchrun itself adds (its restarts, its relayed signals, its root cause,
elastic membership) is tested under torchrun.

Like a Job whose pods share the terminal: the ranks write to this process's
stdout and stderr; SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1 and SIGUSR2 sent
here reach every rank (a pod's deletion, a Ctrl-C); and once a rank exits
with an error the others get SIGTERM, then SIGKILL after ``GRACE_S``, as
torchrun ends a failed group (a JobSet's failure policy). Exit status: 0
when every rank exits 0, else the first failed rank's status (128 + N for a
rank ended by signal N)."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time

GRACE_S = 30.0  # torchrun's default between SIGTERM and SIGKILL of a failed group
RELAYED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def free_port() -> int:
    """A TCP port nothing listens on right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ranks(nproc: int, command: list[str]) -> list[subprocess.Popen]:
    """Start ``command`` ``nproc`` times, rank i with RANK=i, WORLD_SIZE,
    MASTER_ADDR=127.0.0.1 and a free MASTER_PORT, inheriting this process's
    stdout, stderr and the rest of its environment."""
    port = str(free_port())
    ranks = []
    for rank in range(nproc):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT"):
            env.pop(name, None)
        ranks.append(subprocess.Popen(command, env=env))
    return ranks


def exit_status(returncode: int) -> int:
    """A shell's exit status for a child's ``returncode`` (-N: 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


def wait_for(ranks: list[subprocess.Popen]) -> int:
    """Wait for every rank; once one fails, SIGTERM the others and SIGKILL
    those still running ``GRACE_S`` seconds later. Returns the exit status
    (module docstring)."""
    failed, killed_at = None, None
    while any(rank.poll() is None for rank in ranks):
        if failed is None:
            failed = next((rank for rank in ranks if rank.returncode not in (None, 0)), None)
            if failed is not None:
                for rank in ranks:
                    if rank.poll() is None:
                        rank.send_signal(signal.SIGTERM)
                killed_at = time.monotonic() + GRACE_S
        elif time.monotonic() > killed_at:
            for rank in ranks:
                if rank.poll() is None:
                    rank.kill()
        time.sleep(0.05)
    failed = failed or next((rank for rank in ranks if rank.returncode != 0), None)
    return 0 if failed is None else exit_status(failed.returncode)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc_per_node", type=int, required=True, help="ranks to start (world size)")
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    ranks: list[subprocess.Popen] = []

    def relay(signum, _frame):
        for rank in ranks:
            if rank.poll() is None:
                rank.send_signal(signum)

    for signum in RELAYED:
        signal.signal(signum, relay)
    ranks.extend(start_ranks(args.nproc_per_node, [sys.executable, args.script, *args.args]))
    return wait_for(ranks)


if __name__ == "__main__":
    sys.exit(main())
