"""Test hook, not used in training: ``fault_point`` kills, raises or hangs a
chosen rank at a chosen step when the tests set DDP_TEST_FAULT; otherwise it
returns at once. The tests in tests/ drive it; nothing else should.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Optional

import torch.distributed as dist

from .output import is_distributed, print_line


_fault_counts: dict = {}


_fault_spec: Optional[str] = None  # DDP_TEST_FAULT as read at the first call ("" when off)


def fault_point(point: str) -> None:
    """Test hook: a no-op unless the environment variable DDP_TEST_FAULT is set.

    DDP_TEST_FAULT="POINT:RANK:N:ACTION" makes rank RANK, on the N-th call
    (1-based) of ``fault_point(POINT)`` in this process, do ACTION: ``kill``
    (SIGKILL itself), ``raise`` (RuntimeError) or ``hang`` (sleep an hour).
    Points: ``step`` (before each training step) and ``save`` (inside
    atomic_save, after the temporary file is written, before the rename). It
    fires only in a job's first attempt (TORCHELASTIC_RESTART_COUNT unset or
    0), so a torchrun restart runs clean. The environment is read once per
    process: two os.environ lookups per step cost a small model ~3%.
    """
    global _fault_spec
    if _fault_spec is None:
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        _fault_spec = os.environ.get("DDP_TEST_FAULT", "") if first_attempt else ""
    if not _fault_spec:
        return
    _fault_counts[point] = count = _fault_counts.get(point, 0) + 1
    want_point, want_rank, want_count, action = _fault_spec.split(":")
    rank = dist.get_rank() if is_distributed() else 0
    if (point, rank, count) != (want_point, int(want_rank), int(want_count)):
        return
    print_line(f"DDP_TEST_FAULT: {action} at {point} {count} on rank {rank}", sys.stderr)
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "raise":
        raise RuntimeError(f"DDP_TEST_FAULT: injected failure at {point} {count} on rank {rank}")
    elif action == "hang":
        time.sleep(3600)
