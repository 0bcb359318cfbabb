"""Where each training step's time goes on this rank: waiting for the next
batch, computing, waiting in collectives, blocking for a snapshot.

``StepPhases`` times them without a device sync in the step: on the CPU with
the host's clock (``time.perf_counter``), on CUDA the compute phase from
CUDA events that are read once they have completed (a step or more late,
``torch.cuda.Event.query``), never waited for. The straggler watch
(``stragglers.StragglerWatch``) compares the ranks' phases; the totals are
this rank's account of its time.
"""

from __future__ import annotations

import collections
import contextlib
import time
from typing import Callable, Iterable, Iterator, Optional

import torch

# The phases of a step, in the order a step runs them.
PHASES = ("data", "compute", "collective", "snapshot")


class StepPhases:
    """This rank's time per step phase, in seconds (float), since the run's
    start on this rank.

    Phases (``PHASES``): ``"data"`` waiting for the next batch (the loader's
    ``next``); ``"compute"`` forward, backward and the optimizer step, less
    the time this rank waited in DDP's gradient all-reduce for slower ranks
    (``time_gradient_sync``); ``"collective"`` waiting in collectives the loop
    can time apart (that gradient wait, the stop signal's all-reduce);
    ``"snapshot"`` the time the step blocks for a snapshot.

    Time a phase with ``with phases.phase("data"): ...`` or
    ``phases.start("data")`` ... ``phases.stop("data")``; ``data(batches)``
    wraps a loader's iterable so that each ``next`` counts as data.
    ``end_step()`` closes an optimizer step (its micro-batches together):
    ``last_step()`` then gives its seconds per phase, ``totals()`` the sums
    so far.

    On CUDA (``device.type == "cuda"``) the compute phase is timed by a pair
    of CUDA events (``torch.cuda.Event(enable_timing=True)``) on the current
    stream, read at a later ``end_step`` once the end event has completed
    (``query``): no step waits for the GPU. ``last_step()["compute"]`` is then
    the latest step whose events completed (usually the one before), and
    ``totals()["compute"]`` lags by the steps still on the GPU. Elsewhere
    every phase is host time.

    ``listeners``: callables ``(phase, start_s, seconds)`` called as each
    host-timed phase ends (``start_s``: ``time.perf_counter()`` at its
    start), e.g. a timeline's writer; none by default (then nothing is
    called). Not thread-safe, except ``note_gradient_wait``: one training
    loop owns it.
    """

    def __init__(self, device: Optional[torch.device] = None) -> None:
        self.cuda = device is not None and device.type == "cuda"
        self._totals = dict.fromkeys(PHASES, 0.0)
        self._step = dict.fromkeys(PHASES, 0.0)  # the step being timed
        self._last = dict.fromkeys(PHASES, 0.0)  # the last step closed
        self._started: dict = {}  # phase -> perf_counter() at its start (host-timed phases)
        self._events: Optional[tuple] = None  # CUDA: the compute phase's start event, while it runs
        self._pending: collections.deque = collections.deque()  # CUDA: (start, end, own end or None) to read
        self._sync = [0.0, 0.0]  # this step's gradient all-reduce: (last launch, last completion), perf_counter
        self._sync_event = None  # CUDA: an event at the last gradient bucket's launch (own compute done)
        self.steps = 0  # steps closed
        self.listeners: list[Callable[[str, float, float], None]] = []

    # Timing

    def start(self, phase: str) -> None:
        """Phase ``phase`` (one of ``PHASES``) starts now."""
        if phase == "compute" and self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self._events = (start,)
            self._sync_event = None
        self._started[phase] = time.perf_counter()
        if phase == "compute":
            self._sync = [0.0, 0.0]

    def stop(self, phase: str) -> float:
        """Phase ``phase`` ends now; returns its host seconds (the time the
        host spent in it; on CUDA the compute phase is counted from its
        events later, ``end_step``)."""
        started = self._started.pop(phase)
        seconds = time.perf_counter() - started
        if phase == "compute" and self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pending.append((self._events[0], end, self._sync_event))
            self._events = self._sync_event = None
        else:
            if phase == "compute":  # less the wait for slower ranks in the gradient all-reduce
                launched, done = self._sync
                waited = max(0.0, done - launched) if launched and done >= launched else 0.0
                waited = min(waited, seconds)
                seconds -= waited
                self._step["collective"] += waited
            self._step[phase] += seconds
        for listener in self.listeners:
            listener(phase, started, seconds)
        return seconds

    def in_phase(self, phase: str) -> bool:
        """Whether ``phase`` runs now (started, not stopped): read from
        another thread too (the loader's sampler, ``stragglers``)."""
        return phase in self._started

    @contextlib.contextmanager
    def phase(self, phase: str) -> Iterator[None]:
        """``with phases.phase("snapshot"): ...``: ``start``, then ``stop``
        however the block ends."""
        self.start(phase)
        try:
            yield
        finally:
            self.stop(phase)

    def data(self, batches: Iterable) -> Iterator:
        """``batches``' items, each ``next`` on it timed as the data phase."""
        iterator = iter(batches)
        while True:
            self.start("data")
            try:
                item = next(iterator)
            except StopIteration:
                self._started.pop("data", None)  # the epoch's end is no wait for data
                return
            finally:
                if "data" in self._started:
                    self.stop("data")
            yield item

    def note_gradient_wait(self, launched: float, done: float) -> None:
        """One gradient bucket's all-reduce was launched at ``launched`` and
        completed at ``done`` (``time.perf_counter()`` seconds): kept when it
        is the step's latest. Called from the process group's thread
        (``time_gradient_sync``)."""
        self._sync = [max(self._sync[0], launched), max(self._sync[1], done)]

    def note_gradient_launch_event(self) -> None:
        """CUDA: the gradient bucket launched now is this step's latest so
        far: an event on the current stream marks where this rank's own
        backward work ends (``time_gradient_sync``)."""
        if self.cuda and self._events is not None:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._sync_event = event

    def end_step(self) -> dict:
        """Close the optimizer step: its seconds per phase go to the totals
        and to ``last_step``; on CUDA the compute events that have completed
        are read now (``_read_events``). Returns ``last_step()``."""
        self._read_events()
        for phase, seconds in self._step.items():
            self._totals[phase] += seconds
        self._last, self._step = self._step, dict.fromkeys(PHASES, 0.0)
        if self.cuda and self._read_compute is not None:
            self._last["compute"], self._last["collective"] = self._read_compute
        self.steps += 1
        return dict(self._last)

    _read_compute: Optional[tuple] = None  # CUDA: (compute, gradient wait) of the latest step read

    def _read_events(self) -> None:
        """CUDA: the compute phases whose end event completed, oldest first:
        their GPU seconds (``Event.elapsed_time``, milliseconds / 1000) go to
        the totals; from a step with a gradient bucket's event
        (``note_gradient_launch_event``), the time from it to the end counts
        as collective, the rest as compute. Never waits for the GPU."""
        while self._pending and self._pending[0][1].query():
            start, end, own = self._pending.popleft()
            total = start.elapsed_time(end) / 1000
            waited = own.elapsed_time(end) / 1000 if own is not None and own.query() else 0.0
            waited = min(max(waited, 0.0), total)
            self._totals["compute"] += total - waited
            self._totals["collective"] += waited
            self._read_compute = (total - waited, self._step["collective"] + waited)

    # Reading

    def totals(self) -> dict[str, float]:
        """{phase: seconds} over every step closed since the run's start on
        this rank (on CUDA, compute: the steps whose events were read)."""
        return dict(self._totals)

    def last_step(self) -> dict[str, float]:
        """{phase: seconds} of the last step closed (``end_step``; on CUDA,
        compute from the latest step whose events were read)."""
        return dict(self._last)


def time_gradient_sync(model: torch.nn.Module, phases: StepPhases) -> bool:
    """Register a DDP communication hook on ``model`` (a
    ``DistributedDataParallel``) that all-reduces each gradient bucket as
    DDP's own does and tells ``phases`` when each was launched and when it
    completed (``StepPhases.note_gradient_wait``; on CUDA an event at each
    launch, ``note_gradient_launch_event``): the time a rank waits there for
    slower ranks counts as collective, not compute. Before the first
    backward. Returns False, registering nothing, for another model.

    The same arithmetic as DDP's built-in all-reduce: each gradient
    multiplied by 1 / world_size (a float scalar, as
    ``Reducer::mark_variable_ready_dense`` in
    torch/csrc/distributed/c10d/reducer.cpp does), then summed (gloo's or
    NCCL's all-reduce of the bucket): the same bits.
    """
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        return False
    import torch.distributed as dist

    group = model.process_group
    scale = 1.0 / group.size()

    def hook(_state, bucket):  # no annotation: DDP checks it against the real type, not a string
        launched = time.perf_counter()
        phases.note_gradient_launch_event()
        buffer = bucket.buffer()
        buffer.mul_(scale)
        future = dist.all_reduce(buffer, group=group, async_op=True).get_future()

        def done(fut):
            phases.note_gradient_wait(launched, time.perf_counter())
            return fut.value()[0]

        return future.then(done)

    model.register_comm_hook(None, hook)
    return True
