"""Test hook, not used in training: ``fault_point`` kills, raises, hangs or
waits for a stop signal on a chosen rank at a chosen point when the tests set
DDP_TEST_FAULT; otherwise it returns at once. The tests in tests/ drive it.

Only train.py calls it, at points a reader sees (start-up, each step, the
snapshot's rename, the finished run); no function of train_utils does, so no
collective path of the library holds a test hook.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Optional

import torch.distributed as dist

from .output import is_distributed, print_line
from .stop import received_stop_signal


class _Hook:
    """This process's fault hook: module-level on purpose, since the hook counts
    calls per process ("the N-th call in this process") and is test-only."""

    spec: Optional[str] = None  # DDP_TEST_FAULT as read at the first call ("" when off)
    first_attempt = True  # not a torchrun restart, nor a requeued Slurm job
    counts: dict = {}  # point -> calls so far


_HOOK = _Hook()


def fault_point(point: str) -> None:
    """Test hook: a no-op unless the environment variable DDP_TEST_FAULT is set.

    DDP_TEST_FAULT="POINT:RANK:N:ACTION" makes rank RANK (``*``: every rank),
    on the N-th call (1-based) of ``fault_point(POINT)`` in this process, do
    ACTION: ``kill`` (SIGKILL itself), ``raise`` (RuntimeError), ``hang``
    (sleep an hour; a stop signal during start-up still ends it) or
    ``wait_signal`` (sleep until this process got a stop signal, at most an
    hour, then go on). Points: ``step`` (before each training step), ``save``
    (atomic_save's ``before_rename``: after the temporary file is written, before
    the rename), ``startup`` (before the task loads: in start-up, after the
    process group exists) and ``finished`` (a run that holds every epoch,
    before it tells the batch shell so). ``kill``, ``raise``, ``hang`` and
    ``wait_signal_once`` (``wait_signal`` in the first attempt only) fire only
    in a job's first attempt (TORCHELASTIC_RESTART_COUNT and
    SLURM_RESTART_COUNT unset or 0), so a restart or a requeued job runs
    clean; ``wait_signal`` in every attempt. The environment is read once per
    process: two os.environ lookups per step cost a small model ~3%.
    """
    if _HOOK.spec is None:
        _HOOK.first_attempt = all(os.environ.get(name, "0") in ("", "0")
                                  for name in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"))
        _HOOK.spec = os.environ.get("DDP_TEST_FAULT", "")
    if not _HOOK.spec:
        return
    _HOOK.counts[point] = count = _HOOK.counts.get(point, 0) + 1
    want_point, want_rank, want_count, action = _HOOK.spec.split(":")
    rank = dist.get_rank() if is_distributed() else int(os.environ.get("RANK", "0"))
    if (point, count) != (want_point, int(want_count)) or want_rank not in ("*", str(rank)):
        return
    if action != "wait_signal" and not _HOOK.first_attempt:
        return
    print_line(f"DDP_TEST_FAULT: {action} at {point} {count} on rank {rank}", sys.stderr)
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "raise":
        raise RuntimeError(f"DDP_TEST_FAULT: injected failure at {point} {count} on rank {rank}")
    elif action == "hang":
        time.sleep(3600)
    elif action in ("wait_signal", "wait_signal_once"):
        deadline = time.monotonic() + 3600
        while not received_stop_signal() and time.monotonic() < deadline:
            time.sleep(0.1)
