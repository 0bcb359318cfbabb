"""Start a script's ranks on this host as a Kubernetes Job's pods start
them: each rank its own process with the plain environment (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT; no LOCAL_RANK, no torchrun agent).

    python support/pods.py --nproc_per_node=N SCRIPT [ARGS ...]

What the tests and the benchmark use where the launcher is not what they
test. A rank's start costs a fork, not a fresh import of torch: the tests'
fork server (``support/forkserver.py``, named by ``FORKSERVER_SOCKET``)
forks the ranks where there is one, else this launcher imports torch once
and forks them from itself. Either way a rank runs SCRIPT as ``python
SCRIPT ARGS`` would, with torch already imported and nothing of the
project (forkserver.py's docstring says what differs from a fresh
interpreter); the runs under torchrun and Slurm start every rank fresh.
What torchrun itself adds (its restarts, its relayed signals, its root
cause, elastic membership) is tested under torchrun.

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
import sys
import time

import forkserver  # beside this file
from ports import free_port  # beside this file

GRACE_S = 30.0  # torchrun's default between SIGTERM and SIGKILL of a failed group
RELAYED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


class Rank:
    """One forked rank: its ``pid`` and, once it has ended, its
    ``returncode`` (``subprocess.Popen``'s: -N when ended by signal N)."""

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None

    def poll(self):
        """The rank's returncode, or None while it runs."""
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        """Send ``signum`` to the rank if it still runs."""
        if self.poll() is None:
            os.kill(self.pid, signum)


def rank_environment(rank: int, world_size: int, port: int) -> dict:
    """This process's environment as rank ``rank`` of ``world_size`` gets it:
    RANK, WORLD_SIZE, MASTER_ADDR=127.0.0.1 and MASTER_PORT=``port`` set,
    torchrun's own variables removed."""
    env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT"):
        env.pop(name, None)
    return env


def start_ranks(nproc: int, script: str, args: list) -> list | None:
    """Start ``nproc`` ranks of ``script``: from the fork server where it
    takes them, else forked from this process. In the launcher: the ranks
    (``forkserver.Served`` or ``Rank``). In a rank forked here: None, once
    its script ended (``forkserver.become`` returned)."""
    port = free_port()
    environments = [rank_environment(rank, nproc, port) for rank in range(nproc)]
    served = []
    for env in environments:
        rank = forkserver.start([script, *args], env)
        if rank is None:
            break
        served.append(rank)
    if len(served) == nproc:
        return served
    for rank in served:  # the server refused a later one: none of its ranks is started
        rank.send_signal(signal.SIGKILL)
    imported = forkserver.preload()
    sys.stdout.flush()
    sys.stderr.flush()
    ranks = []
    for env in environments:
        pid = os.fork()
        if pid == 0:
            forkserver.become([script, *args], env, imported)
            return None
        ranks.append(Rank(pid))
    return ranks


def exit_status(returncode: int) -> int:
    """A shell's exit status for a child's ``returncode`` (-N: 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


def wait_for(ranks: list) -> int:
    """Wait for every rank; once one fails, SIGTERM the others and SIGKILL
    those still running ``GRACE_S`` seconds later. Returns the exit status
    (module docstring)."""
    failed, killed_at = None, None
    while any(rank.poll() is None for rank in ranks):
        if failed is None:
            failed = next((rank for rank in ranks if rank.returncode not in (None, 0)), None)
            if failed is not None:
                for rank in ranks:
                    rank.send_signal(signal.SIGTERM)
                killed_at = time.monotonic() + GRACE_S
        elif time.monotonic() > killed_at:
            for rank in ranks:
                rank.send_signal(signal.SIGKILL)
        time.sleep(0.05)
    failed = failed or next((rank for rank in ranks if rank.returncode != 0), None)
    return 0 if failed is None else exit_status(failed.returncode)


def main() -> int | None:
    """Parse the command line, start the ranks, wait for them. Returns the
    exit status, or None in a forked rank whose script has ended."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc_per_node", type=int, required=True, help="ranks to start (world size)")
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    ranks: list = []

    def relay(signum, _frame):
        for rank in ranks:
            rank.send_signal(signum)

    # Signals wait until the relay is in place: none is lost, none reaches a rank's start.
    signal.pthread_sigmask(signal.SIG_BLOCK, RELAYED)
    started = start_ranks(args.nproc_per_node, args.script, args.args)
    if started is None:
        return None
    ranks.extend(started)
    for signum in RELAYED:
        signal.signal(signum, relay)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, RELAYED)
    return wait_for(ranks)


if __name__ == "__main__":
    status = main()
    if status is not None:
        sys.exit(status)
