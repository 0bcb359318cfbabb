"""How a process of the kit ends: one door, ``end_process``, whatever ended
it (a run finished or stopped, a user's error, a time-out, a stop signal, a
lost peer, a loader worker whose rank is gone).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import NoReturn, Optional

import torch.distributed as dist

from .distributed import model_sharded, stop_answering
from .output import is_distributed
from .snapshots import release_claim


def end_process(status: int, *, at_once: bool = False, orderly: Optional[bool] = None) -> NoReturn:
    """End this process with exit status ``status``; never returns.

    In order: on an orderly end (``orderly``, by default ``status`` 0: every
    rank ends alike, a run finished or stopped after its snapshot) every
    rank's answering thread stops (no time-out report from here on:
    ``stop_answering``); unless
    ``at_once``, the process group is destroyed (one left over makes NCCL
    warn of a leak on every rank); the snapshot's claim this process took is
    given back (``release_claim``: outside Slurm the next run may take the
    snapshot, on any host); stdout and stderr are flushed. Then the process
    exits through the interpreter's teardown (``sys.exit``), or at once
    (``os._exit``) where that teardown is unsafe:

    * ``at_once``: the process group is broken or in an unknown state (a
      collective timed out, a peer is gone, a stop signal ends the rank
      mid-step, or the other ranks may be anywhere in start-up): tearing it
      down could wait for ranks that never come;
    * a model sharded here (``distributed.model_sharded``): FSDP's process
      group outlives ``destroy_process_group`` and gloo's threads can abort
      the interpreter's teardown (docs/fsdp.md);
    * a thread other than the main one (a loader worker's watcher), where
      ``sys.exit`` would end that thread alone.

    Safe in a signal handler (``at_once``): a flush the signal interrupted
    is skipped. What the run writes is closed before this (the last
    snapshot, the W&B run, TensorBoard: ``Trainer.close``)."""
    if (status == 0 if orderly is None else orderly) and not at_once:
        stop_answering()
    if not at_once and is_distributed():
        with contextlib.suppress(RuntimeError):  # a group already failing: leaving is what matters
            dist.destroy_process_group()
    release_claim()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed pipe, or a write the signal interrupted
            stream.flush()
    if at_once or model_sharded() or threading.current_thread() is not threading.main_thread():
        os._exit(status)
    sys.exit(status)
