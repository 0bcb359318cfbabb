"""train.py with one fault injected from the test side: a rank killed,
failing, hung or held at a chosen point of a real run. The kit itself reads
no test variable and holds no hook; this launcher patches a few of its
functions, then runs train.py as ``__main__``.

Run it wherever ``train.py ARGS`` runs, with the same ARGS: under torchrun
(``torchrun ... tests/train_with_fault.py ARGS``), srun, a Slurm wrapper
(``SCRIPT_NAME=tests/train_with_fault.py``) or a container that sees the
project folder. The environment variable DDP_TEST_FAULT="POINT:RANK:N:ACTION"
chooses the fault: rank RANK (``*``: every rank), at the N-th time (1-based,
in this process) it reaches POINT, does ACTION. Without it, nothing is patched.

Points, and the function patched for each:

  startup   before the task loads (start-up, the process group up):
            ``train_utils.downloaders_first``, first thing
  step      before each training micro-batch: ``Watch.step``, after it
            (the time-out watch has noted the step)
  evaluate  the start of an epoch's evaluation (its stop polls counted):
            ``train_utils.fewest_batches``, first thing
  save      between a snapshot's written temporary file and its rename (DDP's
            file, FSDP's meta file that completes a folder): the ``os.replace``
            of ``train_utils.snapshots.file``
  finished  a run that holds every epoch, before it tells the batch shell so:
            ``train_utils.report_run_finished``, first thing
  poll      the stop signal's all-reduce once a step: ``StopSignal.poll``,
            first thing (``skip`` there skips that call, and its collective)

Actions: ``kill`` (SIGKILL itself), ``kill_once_saved`` (every rank, not
only RANK, waits there for its snapshot write in flight to be committed and
meets the others in a barrier; then RANK SIGKILLs itself: the job dies with
the snapshots it started on disk, however slow the writer thread is on a loaded
machine; only where every rank reaches the point together, as a step),
``sigstop`` (SIGSTOP itself: frozen, as
by a debugger or a swapped-out node), ``raise`` (RuntimeError), ``skip`` (the
point's call is skipped), ``hang`` (sleep
an hour; a stop signal during start-up still ends it), ``wait_signal`` (sleep
until this process got a stop signal, at most an hour, then go on) and
``wait_signal_once``, and ``sleepN`` (sleep N seconds, then go on: a slow
disk, a slow step). ``kill``, ``kill_once_saved``, ``raise``, ``hang``, ``sleepN`` and
``wait_signal_once`` act in a job's first attempt only (TORCHELASTIC_RESTART_COUNT and
SLURM_RESTART_COUNT unset or 0), so a restart or a requeued job runs clean;
``wait_signal`` in every attempt. Before acting, it prints
``DDP_TEST_FAULT: ACTION at POINT N on rank R`` to stderr, the line the tests
wait for.
"""

from __future__ import annotations

import functools
import os
import runpy
import signal
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


class Fault:
    """The fault DDP_TEST_FAULT names (``spec``), and how often each point was reached."""

    def __init__(self, spec: str) -> None:
        self.point, self.rank, count, self.action = spec.split(":")
        self.count = int(count)
        self.reached: dict = {}  # point -> times reached in this process
        self.first_attempt = all(os.environ.get(name, "0") in ("", "0")
                                 for name in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"))

    def at(self, point: str) -> bool:
        """``point`` is reached: act if it is the chosen one, on the chosen rank.
        True where the action is ``skip``: the caller skips the point's call."""
        import torch.distributed as dist

        from train_utils.output import print_line
        from train_utils.loop.stop import received_stop_signal

        self.reached[point] = count = self.reached.get(point, 0) + 1
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
        if (point, count) != (self.point, self.count):
            return False
        if self.action != "wait_signal" and not self.first_attempt:
            return False
        if self.action == "kill_once_saved":
            _wait_for_snapshot_writes()
        if self.rank not in ("*", str(rank)):
            return False
        print_line(f"DDP_TEST_FAULT: {self.action} at {point} {count} on rank {rank}", sys.stderr)
        if self.action in ("kill", "kill_once_saved"):
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.action == "raise":
            raise RuntimeError(f"DDP_TEST_FAULT: injected failure at {point} {count} on rank {rank}")
        elif self.action == "sigstop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif self.action == "hang":
            time.sleep(3600)
        elif self.action.startswith("sleep"):
            time.sleep(float(self.action[len("sleep"):]))
        elif self.action in ("wait_signal", "wait_signal_once"):
            deadline = time.monotonic() + 3600
            while not received_stop_signal() and time.monotonic() < deadline:
                time.sleep(0.1)
        return self.action == "skip"


def _wait_for_snapshot_writes() -> None:
    """Join this process's snapshot-writer thread (``SnapshotWriter``'s, if
    one is running: its write then committed), then a barrier of every rank."""
    import threading

    import torch.distributed as dist

    for thread in threading.enumerate():
        if thread.name == "snapshot-writer":
            thread.join()
    if dist.is_initialized():
        dist.barrier()


def _first(fault: Fault, point: str, function):
    """``function`` that reaches ``point`` before it runs."""

    @functools.wraps(function)
    def faulted(*args, **kwargs):
        fault.at(point)
        return function(*args, **kwargs)

    return faulted


def _after(fault: Fault, point: str, function):
    """``function`` that reaches ``point`` once it has run."""

    @functools.wraps(function)
    def faulted(*args, **kwargs):
        result = function(*args, **kwargs)
        fault.at(point)
        return result

    return faulted


def _skippable(fault: Fault, point: str, function, skipped_result):
    """``function`` that reaches ``point`` before it runs, and returns
    ``skipped_result`` without running where the fault skips it."""

    @functools.wraps(function)
    def faulted(*args, **kwargs):
        return skipped_result if fault.at(point) else function(*args, **kwargs)

    return faulted


class _OsReplacingWithFault:
    """The ``os`` module as train_utils.snapshots.file sees it: ``replace``, the
    rename that publishes a written snapshot, reaches ``save`` first."""

    def __init__(self, fault: Fault) -> None:
        self._fault = fault

    def __getattr__(self, name: str):
        return getattr(os, name)

    def replace(self, source, target) -> None:
        self._fault.at("save")
        os.replace(source, target)


def install(spec: str) -> None:
    """Patch the kit's functions for the fault ``spec`` (DDP_TEST_FAULT's form)."""
    import train_utils
    import train_utils.snapshots.file
    import train_utils.distributed.timeouts

    fault = Fault(spec)
    train_utils.downloaders_first = _first(fault, "startup", train_utils.downloaders_first)
    train_utils.distributed.timeouts.Watch.step = _after(fault, "step", train_utils.distributed.timeouts.Watch.step)
    train_utils.fewest_batches = _first(fault, "evaluate", train_utils.fewest_batches)
    train_utils.snapshots.file.os = _OsReplacingWithFault(fault)
    train_utils.report_run_finished = _first(fault, "finished", train_utils.report_run_finished)
    train_utils.StopSignal.poll = _skippable(fault, "poll", train_utils.StopSignal.poll, False)


if __name__ == "__main__":
    sys.path[0] = str(REPO)  # the project's modules, as when train.py runs itself
    sys.argv[0] = str(REPO / "train.py")  # argparse's prog, in usage and error lines
    if os.environ.get("DDP_TEST_FAULT"):
        install(os.environ["DDP_TEST_FAULT"])
    runpy.run_path(sys.argv[0], run_name="__main__")
