"""Snapshots written while training goes on: the state copied to the CPU,
then written by a background thread; at most one write in flight; when the
next one is due (--snapshot_every_s), decided by rank 0's clock.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional

import torch


def cpu_copy(obj: object) -> object:
    """``obj`` with every tensor in it replaced by a copy of its own on the
    CPU (detached; same dtype and shape), so that training can go on changing
    the originals while the copy is written. Dicts (an ``OrderedDict`` stays
    one, and keeps a state dict's ``_metadata``), lists and tuples are copied
    level by level; anything else (numbers, strings, None) is shared, not
    copied. A copy of a GPU tensor waits for the GPU's queued work on it."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        copied = type(obj)((key, cpu_copy(value)) for key, value in obj.items())
        if hasattr(obj, "_metadata"):  # a module's state_dict: versions load_state_dict reads
            copied._metadata = obj._metadata
        return copied
    if isinstance(obj, (list, tuple)):
        return type(obj)(cpu_copy(value) for value in obj)
    return obj


class SnapshotWriter:
    """Runs each snapshot's write, at most one at a time.

    ``asynchronous``: ``start`` hands the write to a background thread and
    returns at once (the caller has copied what the write needs, ``cpu_copy``,
    or DCP has staged it); else the write runs in ``start`` itself. Either
    way its outcome is collected by ``wait``: ``start`` waits first for the
    write in flight, so a second one never overlaps it, and a stop or the end
    of the run calls ``wait`` too. An exception of the write is raised by that
    ``wait`` (in the calling thread), not lost in the background.
    """

    def __init__(self, asynchronous: bool) -> None:
        self.asynchronous = asynchronous
        self._thread: Optional[threading.Thread] = None
        self._label: Optional[str] = None  # what the write in flight (or just done) saves
        self._error: Optional[BaseException] = None

    def start(self, write: Callable[[], None], label: str) -> Optional[str]:
        """Wait for the write in flight (``wait``: its label is returned, or
        its exception raised, and then ``write`` is not started); then run
        ``write()``, a function of no arguments, in the background
        (asynchronous) or here. ``label`` names what it saves, for ``wait``."""
        done = self.wait()
        self._label, self._error = label, None
        if self.asynchronous:
            self._thread = threading.Thread(target=self._run, args=(write,), name="snapshot-writer")
            self._thread.start()
        else:
            self._run(write)
        return done

    def _run(self, write: Callable[[], None]) -> None:
        try:
            write()
        except BaseException as exc:  # kept for wait(), in the caller's thread
            self._error = exc

    def wait(self) -> Optional[str]:
        """Block until no write is in flight. Returns the label of the write
        that finished since the last ``wait`` (None: none did); raises the
        exception that write raised (an OSError for a full disk, say: the
        previous snapshot is then the intact one)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        label, error = self._label, self._error
        self._label = self._error = None
        if error is not None:
            raise error
        return label

    @property
    def in_flight(self) -> bool:
        """A write has started and not yet been collected by ``wait``."""
        return self._label is not None


class SnapshotClock:
    """``--snapshot_every_s``: when a time-based snapshot is due, as rank 0's
    clock says.

    Each optimizer step rank 0 calls ``ask`` and sends the answer with the
    stop-signal poll (``StopSignal.poll``'s ``request``), whose all-reduce
    hands every rank the same answer one step later, so all ranks snapshot
    after the same step. ``ask`` is True once the interval (seconds, from
    the last ``saved``, or from the clock's making) has passed, then False at
    the next call, whose poll returns that answer: so one request makes one
    snapshot, even when the interval is shorter than a step. ``every_s`` 0:
    never due. ``clock``: seconds, monotonic (time.monotonic; a test passes
    its own).
    """

    def __init__(self, every_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s, self.clock = every_s, clock
        self.last = clock()
        self.asked = False
        self.stale = False  # a snapshot was taken after the request now travelling was sent

    def ask(self) -> bool:
        """Whether to request a snapshot at this step (see the class)."""
        if self.asked:  # the request sent at the last step is answered at this one
            self.asked = False
            return False
        self.asked = bool(self.every_s) and self.clock() - self.last >= self.every_s
        return self.asked

    def due(self, requested: bool) -> bool:
        """Collective in effect: whether to snapshot after this step, given
        ``requested``, the poll's answer (the same on every rank): not when a
        snapshot was taken after that request was sent (at an epoch's end, or
        by --snapshot_every_steps), which the interval then counts from.
        Call it on every rank after every poll."""
        due, self.stale = requested and not self.stale, False
        return due

    def saved(self) -> None:
        """A snapshot was taken now (every rank calls this): the interval
        starts again, and a request already sent is dropped (``due``)."""
        self.last = self.clock()
        self.stale = True
