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
    (``time_gradient_wait``); ``"collective"`` waiting in collectives the loop
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
    called). Not thread-safe: one training loop owns it (``in_phase`` may be
    read from another thread).
    """

    def __init__(self, device: Optional[torch.device] = None) -> None:
        self.cuda = device is not None and device.type == "cuda"
        self._totals = dict.fromkeys(PHASES, 0.0)
        self._step = dict.fromkeys(PHASES, 0.0)  # the step being timed
        self._last = dict.fromkeys(PHASES, 0.0)  # the last step closed
        self._started: dict = {}  # phase -> perf_counter() at its start (host-timed phases)
        self._events: Optional[tuple] = None  # CUDA: the compute phase's start event, while it runs
        self._pending: collections.deque = collections.deque()  # CUDA: (start, end, own end or None) to read
        # This compute phase's end of its own backward work and the return of backward() (time_gradient_wait):
        # perf_counter() seconds on the host, CUDA events on CUDA; None: not noted.
        self._own_end = self._backward_end = None
        self.steps = 0  # steps closed
        self._contexts: dict = {}  # phase -> its _Timed (phase)
        self.listeners: list[Callable[[str, float, float], None]] = []

    # Timing

    def start(self, phase: str) -> None:
        """Phase ``phase`` (one of ``PHASES``) starts now."""
        if phase == "compute" and self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self._events = (start,)
        self._started[phase] = time.perf_counter()
        if phase == "compute":
            self._own_end = self._backward_end = None

    def stop(self, phase: str) -> float:
        """Phase ``phase`` ends now; returns its host seconds (the time the
        host spent in it; on CUDA the compute phase is counted from its
        events later, ``end_step``)."""
        started = self._started.pop(phase)
        seconds = time.perf_counter() - started
        if phase == "compute" and self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            waited = (self._own_end, self._backward_end) if None not in (self._own_end, self._backward_end) \
                else None
            self._pending.append((self._events[0], end, waited))
            self._events = None
        else:
            if phase == "compute":  # less the wait for slower ranks in the gradient all-reduce
                waited = 0.0
                if self._own_end is not None and self._backward_end is not None:
                    waited = min(max(0.0, self._backward_end - self._own_end), seconds)
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

    def phase(self, phase: str) -> "_Timed":
        """``with phases.phase("snapshot"): ...``: ``start``, then ``stop``
        however the block ends (a context object made once per phase: a
        step pays no generator for it)."""
        timed = self._contexts.get(phase)
        if timed is None:
            timed = self._contexts[phase] = _Timed(self, phase)
        return timed

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

    def note_own_backward_end(self) -> None:
        """This rank's own backward work reached a watched parameter now
        (``time_gradient_wait``'s hooks): the latest call marks the end of
        its own backward work, on the host (``time.perf_counter``) or, on
        CUDA, by an event on the current stream."""
        if "compute" not in self._started:
            return  # a backward outside the timed step (DDP's bucket rebuild after a resume)
        self._own_end = self._mark()

    def note_backward_end(self) -> None:
        """``backward()`` returned (the loop calls it): from the last
        ``note_own_backward_end`` to now this rank waited for the gradient
        all-reduce (DDP finishes it before backward returns; on CUDA the
        stream waits for it), which counts as collective, not compute."""
        if "compute" in self._started:
            self._backward_end = self._mark()

    def _mark(self):
        """Now: ``time.perf_counter()``, or on CUDA an event recorded on the current stream."""
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

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
        the totals; from a step with its own backward's end and backward's
        return noted (``time_gradient_wait``), the time between them counts
        as collective, the rest as compute. Never waits for the GPU."""
        while self._pending and self._pending[0][1].query():
            start, end, marks = self._pending.popleft()
            total = start.elapsed_time(end) / 1000
            waited = marks[0].elapsed_time(marks[1]) / 1000 if marks is not None else 0.0
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


class _Timed:
    """``StepPhases.phase``'s context: the phase timed around a ``with`` block."""

    __slots__ = ("phases", "name")

    def __init__(self, phases: StepPhases, name: str) -> None:
        self.phases, self.name = phases, name

    def __enter__(self) -> None:
        self.phases.start(self.name)

    def __exit__(self, *exc) -> None:
        self.phases.stop(self.name)


def time_gradient_wait(model: torch.nn.Module, phases: StepPhases, watched: int = 2) -> list:
    """Tell ``phases`` when this rank's own backward work ends in each step:
    a hook on the gradients of ``model``'s first ``watched`` parameters
    (``register_post_accumulate_grad_hook``; in registration order, the
    last a backward pass reaches in a model that runs its layers in that
    order) calls ``StepPhases.note_own_backward_end``. The time from the
    last such call to ``note_backward_end`` (the loop's, once ``backward()``
    returns) is the wait for DDP's gradient all-reduce: for a fast rank,
    the wait for the slowest. Returns the hooks' handles (``remove()``).

    It changes nothing DDP computes (no communication hook: DDP's own
    all-reduce, the same bits), and costs one Python call per watched
    parameter a backward pass. Not for a model FSDP shards: its gathers
    and reductions sit inside the forward and backward."""
    handles = []
    for parameter in [p for p in model.parameters() if p.requires_grad][:watched]:
        handles.append(parameter.register_post_accumulate_grad_hook(lambda _: phases.note_own_backward_end()))
    return handles
