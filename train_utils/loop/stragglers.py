"""A rank slower than its peers, named while it is slow: by rank, host, the
phase of the step it is slow in (``phases.PHASES``) and, for the data phase,
the file:line where its loader spends the time.

Every rank already all-reduces a few numbers once a step (the stop signal's,
``stop.StopSignal.poll``); every ``WINDOW_STEPS``-th of those carries each
rank's seconds per phase over the window as well, so no collective is added.
Every rank then holds every rank's figures and reaches the same verdict; the
rank named sends its host and loader line through the launcher's store, and
rank 0 prints the line. A run on several hosts also times each link between
hosts once a window (``links.LinkProbe``: a point-to-point transfer, the one
exchange the watch adds) and names a link slower than the others.
"""

from __future__ import annotations

import collections
import json
import multiprocessing
import select
import socket
import sys
import threading
import time
from typing import Callable, Optional

import torch

from ..distributed import frame_in_code, run_store
from ..output import print_line
from .links import PROBE_BYTES, LinkProbe
from .phases import StepPhases

# The verdict, one window at a time. A window is WINDOW_STEPS polls of the stop
# signal (one an optimizer step; an evaluation's polls count too, its windows
# hold no step and are skipped). A rank is slow in a phase in a window when its
# seconds a step there exceed RATIO x the median of the other ranks' and exceed
# it by FLOOR_S at least; it is named once it was slow in WINDOWS windows in a
# row, and named no longer once it was not slow in WINDOWS windows in a row.
# A fault is named within (WINDOWS + 1) x WINDOW_STEPS + 1 steps of its start
# (the window it starts in, WINDOWS whole ones, the poll that reads the last).
WINDOW_STEPS = 8
WINDOWS = 3
RATIO = 3.0
FLOOR_S = 0.005
# The phases compared. Not "collective": a rank waits there because another is
# slow (the victims wait, the straggler does not); not "snapshot": rank 0
# alone writes a DDP snapshot, by design.
COMPARED = ("data", "compute")
SAMPLE_EVERY_S = 0.01  # the loader's stack is sampled 100 times a second while this rank waits for data
SEND_EVERY_S = 0.1  # a loader worker sends the rank its counts 10 times a second at most
WHERE_WAIT_POLLS = 64  # rank 0 waits this many polls at most for a named rank's host and line


class PlaceCounts:
    """Samples of where a loader spends its time: ``counts`` {file:line in
    function: samples}, added to by a thread under ``lock`` while the
    training loop reads them (``snapshot``, ``top``)."""

    def __init__(self) -> None:
        self.counts: collections.Counter = collections.Counter()
        self.lock = threading.Lock()

    def snapshot(self) -> collections.Counter:
        """The counts so far (a copy)."""
        with self.lock:
            return collections.Counter(self.counts)

    def top(self, since: collections.Counter) -> str:
        """The place sampled most since the counts ``since`` (a ``snapshot``); '' when none was."""
        recent = self.snapshot() - since
        return recent.most_common(1)[0][0] if recent else ""


class LoaderSampler(PlaceCounts):
    """A daemon thread that, while it is ``wanted`` (an Event: set by the
    watch once this rank waits for data ``FLOOR_S`` a step or more) and
    ``phases`` is in its data phase, reads the main thread's stack every
    ``SAMPLE_EVERY_S`` seconds (``sys._current_frames``) and counts where in
    the kit's or the task's code it is (``frame_in_code``: file:line in
    function). With ``--num_workers 0`` the loader runs in the main thread,
    so the counts say where the loader spends the time. ``top(since)``
    gives the place sampled most since the counts ``since`` (a
    ``snapshot``). Unwanted, the thread sleeps on the Event: a rank whose
    batches come at once pays nothing for it."""

    def __init__(self, phases: StepPhases) -> None:
        self.phases = phases
        super().__init__()
        self.wanted = threading.Event()
        self.main = threading.main_thread().ident
        threading.Thread(target=self._run, daemon=True, name="loader sampler").start()

    def _run(self) -> None:
        while True:
            self.wanted.wait()
            time.sleep(SAMPLE_EVERY_S)
            if self.phases.in_phase("data"):
                frame = sys._current_frames().get(self.main)
                where = frame_in_code(frame) if frame is not None else ""
                with self.lock:
                    self.counts[where or "no frame of the kit or the task"] += 1


class PipeFlag:
    """A flag that processes started from this one (loader workers: the
    flag is pickled into them under a fork server or spawn, inherited under
    fork) wait on without polling: it is set while its pipe holds one
    message. This process ``set``s and ``clear``s it; any holder can ask
    ``is_set()`` and ``wait(timeout)`` (a select on the pipe: the waiter
    reads nothing). No lock or semaphore is shared: a worker terminated
    while it waits (the DataLoader ends its workers after every epoch)
    cannot leave anything held. A multiprocessing Event could: its
    Condition's ``notify_all`` waits for every waiter counted as asleep to
    wake, a terminated one never does, and ``set`` would hang (the Python
    docs' ``Process.terminate`` warning)."""

    def __init__(self) -> None:
        self._reader, self._writer = multiprocessing.Pipe(duplex=False)
        self._set = False  # this process's view: it alone writes and reads the message

    def set(self) -> None:
        if not self._set:
            self._writer.send_bytes(b"1")
            self._set = True

    def clear(self) -> None:
        if self._set:
            self._reader.recv_bytes()
            self._set = False

    def is_set(self) -> bool:
        return self._reader.poll()

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Blocks until the flag is set, or ``timeout`` seconds (None: no
        limit); returns whether it is set."""
        return self._reader.poll(timeout)

    def __getstate__(self) -> dict:
        return {"_reader": self._reader, "_set": None}  # a holder only waits: no writing end


class WorkerStacks(PlaceCounts):
    """The stacks of a training loader's worker processes, sampled for
    ``StragglerWatch`` as ``LoaderSampler`` samples the rank's own: with
    ``--num_workers`` > 0 the loader spends its time in the workers.

    Made in the rank before its loader (``loaders.loader_workers``) and sent
    to each worker with the loader's ``worker_init_fn``, which calls
    ``start_in_worker()``: a daemon thread that, while ``wanted`` (a
    ``PipeFlag``, set by the watch once this rank waits for data
    ``FLOOR_S`` a step or more; unset, the thread sleeps in a select and
    the worker runs nothing of it), reads the worker's main thread's stack
    every ``SAMPLE_EVERY_S`` seconds and counts where in the kit's or the
    task's code it is (``frame_in_code``: file:line in function); a worker
    idle in torch's worker loop counts nothing. The worker sends its counts
    to the rank at most every ``SEND_EVERY_S`` seconds and when ``wanted``
    clears, one message ``b"COUNT PLACE"`` a place through a pipe that all
    the workers share, each message one write of at most ``select.PIPE_BUF``
    bytes, which a pipe never interleaves with another's (POSIX write(2)).
    A daemon thread of the rank adds them up. ``snapshot()`` and
    ``top(since)`` are ``LoaderSampler``'s, over every worker of the loader
    (workers restart every epoch; their counts add up in the rank). The
    kit starts workers by a fork server or spawn; a worker forked from the
    rank would also hold the rank's frames below torch's worker loop, which
    it would count while idle."""

    def __init__(self) -> None:
        self.wanted = PipeFlag()
        self._reader, self._writer = multiprocessing.Pipe(duplex=False)
        super().__init__()
        threading.Thread(target=self._collect, daemon=True, name="loader worker samples").start()

    def __getstate__(self) -> dict:
        return {"wanted": self.wanted, "_writer": self._writer}  # what a worker needs: the flag, the writing end

    def _collect(self) -> None:
        """The rank's thread: adds up the counts the workers send."""
        while True:
            try:
                message = self._reader.recv_bytes()
            except (EOFError, OSError):
                return
            count, _, place = message.decode(errors="replace").partition(" ")
            with self.lock:
                self.counts[place] += int(count)

    def start_in_worker(self) -> None:
        """In a loader worker's main thread (its ``worker_init_fn``): starts
        the thread that samples this thread's stack."""
        threading.Thread(target=self._sample, args=(threading.get_ident(),), daemon=True,
                         name="loader worker sampler").start()

    def _sample(self, main: int) -> None:
        """The worker's thread: samples thread ``main`` while ``wanted``, sends the counts."""
        counts: collections.Counter = collections.Counter()
        sent_at = time.monotonic()
        while True:
            if counts and (not self.wanted.is_set() or time.monotonic() - sent_at >= SEND_EVERY_S):
                try:
                    for place, count in counts.items():
                        self._writer.send_bytes(f"{count} {place}".encode()[:select.PIPE_BUF - 4])  # 4: its length
                except OSError:  # the rank is gone: this worker ends with it (loaders.worker_started)
                    return
                counts.clear()
                sent_at = time.monotonic()
            self.wanted.wait()
            time.sleep(SAMPLE_EVERY_S)
            frame = sys._current_frames().get(main)
            where = frame_in_code(frame) if frame is not None else ""
            if where:
                counts[where] += 1


class StragglerWatch:
    """This rank's part in naming stragglers, fed by the stop signal's
    all-reduce (``StopSignal.watch``): ``payload()`` before each poll's
    all-reduce (a 1-D float32 tensor of ``world_size`` x ``len(COMPARED)``
    seconds at every ``WINDOW_STEPS``-th poll, this rank's own in its slots
    and zeros elsewhere, so that a MAX all-reduce gathers every rank's;
    None between), ``compare(values)`` with that all-reduce's result at the
    next poll. On rank 0 it prints, once when a rank starts being slow::

        straggler: rank 1 (host node7) is slow in data: 52.3 ms a step against 1.1 ms on the other ranks (median), over steps 17-40; its loader spends the time at my_task.py:21 in __getitem__

    and once when it ends::

        straggler: rank 1 (host node7) is no longer slow in data: 1.2 ms a step against 1.1 ms, over steps 81-104

    With loader workers the line ends ``its loader workers spend the time
    at my_task.py:21 in __getitem__``: the place sampled most over the
    window across the rank's workers (``WorkerStacks``).

    On several hosts (``hosts`` given, two links between hosts or more), a
    link between hosts is compared with the others the same way, by the
    seconds its probe took (``links.LinkProbe``), and named by its two ends::

        straggler: the link from rank 4 (host node2) to rank 5 (host node3) is slow: 256 KiB in 131.2 ms (2.0 MB/s) against 0.4 ms on the other links between hosts (median), over steps 17-40

    ``phases``: this rank's ``StepPhases``; ``step``: () -> the run's
    optimizer steps so far (``Progress.step``); ``num_workers``: the
    training loader's (0: its stack is sampled, ``LoaderSampler``);
    ``hosts``: every rank's host, indexed by rank (None: no link probed);
    ``device``: the training's device, where the link probe's tensors live;
    ``worker_stacks``: with workers, the ``WorkerStacks`` its workers
    sample into (``loaders.worker_stacks``; None: a loader whose workers
    sample nothing, and the line says so). Either loader sampler runs only
    while this rank waits for data ``FLOOR_S`` a step or more, and never at
    one rank (``world_size`` 1: no peers to compare). The threshold
    (``RATIO``, ``FLOOR_S``, ``WINDOWS``) and its measured false-alarm rate
    are in docs/runs.md.
    """

    def __init__(self, phases: StepPhases, rank: int, world_size: int, step: Callable[[], int],
                 num_workers: int = 0, hosts: Optional[list] = None,
                 device: Optional[torch.device] = None, worker_stacks: Optional[WorkerStacks] = None) -> None:
        self.phases, self.rank, self.world_size, self.step = phases, rank, world_size, step
        self.hosts = hosts
        probe = LinkProbe(hosts, rank, device or torch.device("cpu")) if hosts and world_size > 1 else None
        self.links = probe if probe is not None and probe.active else None
        self.num_workers = num_workers
        self.sampler = None if world_size == 1 else LoaderSampler(phases) if num_workers == 0 else worker_stacks
        self.polls = 0
        self.sent: Optional[tuple] = None  # (first step, last step, steps) of the window in flight
        self._mark = (phases.totals(), phases.steps, self.sampler.snapshot() if self.sampler else None)
        self._where_since = self._mark[2]  # the sampler's counts at the window in flight's start
        self.slow_runs: dict = collections.defaultdict(int)  # (rank, phase) -> windows slow in a row
        self.clear_runs: dict = collections.defaultdict(int)  # (rank, phase) -> windows not slow in a row
        self.run_from: dict = {}  # (rank, phase) -> the first step of its current run of slow (or clear) windows
        self.named: set = set()  # the (rank, phase) pairs named slow now ("link": the link into that rank)
        self.events = 0  # lines this rank has a part in so far (the store keys' numbers)
        self.pending: list = []  # rank 0: lines waiting for a named rank's host and loader line
        self.store = None

    def payload(self) -> Optional[torch.Tensor]:
        """Before a poll's all-reduce: this rank's window figures at every
        ``WINDOW_STEPS``-th poll (see the class; a 1-D float32 tensor of
        ``world_size`` x (``len(COMPARED)`` + 1), the last column the seconds
        of this rank's link probe, 0.0 for none), else None; at those polls
        the link probe runs first (``LinkProbe.measure``, collective among
        the ends of the links between hosts). Rank 0 prints the lines whose
        named rank has answered (``_print_pending``)."""
        self.polls += 1
        if self.pending:
            self._print_pending()
        if self.polls % WINDOW_STEPS:
            return None
        totals, steps, step = self.phases.totals(), self.phases.steps, self.step()
        before, steps_before, samples = self._mark
        self._mark = (totals, steps, self.sampler.snapshot() if self.sampler else None)
        # The run's steps of the window: its last is the run's step now (a resumed run's too), its first
        # as many steps before as this rank closed in it.
        self.sent = (step - (steps - steps_before) + 1, step, steps - steps_before)
        self._where_since = samples
        mine = [totals[phase] - before[phase] for phase in COMPARED]
        mine.append(self.links.measure() if self.links is not None else 0.0)
        if self.sampler is not None:  # this rank waits for data: sample where, in case it is the slow one
            if self.sent[2] > 0 and mine[COMPARED.index("data")] / self.sent[2] > FLOOR_S:
                self.sampler.wanted.set()
            elif self.sent[2] > 0:
                self.sampler.wanted.clear()
        values = torch.zeros(self.world_size, len(COMPARED) + 1)
        values[self.rank] = torch.tensor(mine)
        return values.flatten()

    def compare(self, values: torch.Tensor) -> None:
        """With the all-reduced ``payload`` (every rank's window figures):
        the verdict of the window (``slow_ranks``), the same on every rank;
        a rank named or no longer named acts (``_announce``)."""
        first, last, steps = self.sent
        table = values.view(self.world_size, len(COMPARED) + 1)
        if self.links is not None:  # a probe per window, an evaluation's window too
            self._compare_links(table[:, -1].tolist(), first, last)
        if steps <= 0:  # an evaluation's window: no step to compare
            return
        per_step = (table[:, :-1] / steps).tolist()
        medians, slow = slow_ranks(per_step)
        for column, phase in enumerate(COMPARED):
            for rank in range(self.world_size):
                run_from, change = self._count(rank, phase, (rank, column) in slow, first)
                if change is not None:
                    figures = (per_step[rank][column], medians[(rank, column)], run_from, last)
                    self._announce(rank, phase, figures, started=change)

    def _count(self, rank: int, phase: str, slow: bool, first: int) -> tuple:
        """Count the window for (``rank``, ``phase``): slow or not, in a row,
        and mark it named (``named``) or no longer. Returns (the first step
        of its current run of windows, True where it is to be named now,
        False where it is to be named no longer, None where nothing changes)."""
        key = (rank, phase)
        runs, other = (self.slow_runs, self.clear_runs) if slow else (self.clear_runs, self.slow_runs)
        runs[key] += 1
        other[key] = 0
        if runs[key] == 1:
            self.run_from[key] = first
        if key not in self.named and self.slow_runs[key] >= WINDOWS:
            self.named.add(key)
            return self.run_from[key], True
        if key in self.named and self.clear_runs[key] >= WINDOWS:
            self.named.discard(key)
            return self.run_from[key], False
        return self.run_from[key], None

    def _compare_links(self, seconds: list, first: int, last: int) -> None:
        """The links' verdict of the window: ``seconds`` by rank, each
        rank's probe in from its previous rank (0.0: none). Rank 0 prints
        the line of a link named or no longer named (both ends' hosts are
        known: no store)."""
        ranks = [rank for rank in self.links.links if seconds[rank] > 0]
        if len(ranks) < 2:  # no figures yet (CUDA's first window)
            return
        medians, slow = slow_ranks([[seconds[rank]] for rank in ranks])
        for place, rank in enumerate(ranks):
            run_from, change = self._count(rank, "link", (place, 0) in slow, first)
            if change is not None and self.rank == 0:
                previous = (rank - 1) % self.world_size
                print_line(link_line(previous, self.hosts[previous], rank, self.hosts[rank],
                                     (seconds[rank], medians[(place, 0)], run_from, last), change))

    def _announce(self, rank: int, phase: str, figures: tuple, started: bool) -> None:
        """``rank`` starts (``started``) or stops being slow in ``phase``:
        the rank itself sends its host and, for data, its loader's line
        through the store; rank 0 prints the line once it has them."""
        self.events += 1
        key = f"{self.events}/{rank}"
        if rank == self.rank and rank != 0:
            store = self._store()
            if store is not None:
                store.set(key, json.dumps({"host": socket.gethostname(), "where": self._where(phase)}))
        if self.rank == 0:
            found = {"host": socket.gethostname(), "where": self._where(phase)} if rank == 0 else None
            self.pending.append([key, rank, phase, figures, started, found, self.polls])
            self._print_pending()

    def _where(self, phase: str) -> str:
        """For data: where this rank's loader spent the window's time."""
        if phase != "data":
            return ""
        if self.sampler is None:
            return f"in its {self.num_workers} loader worker processes (their stacks are not sampled)"
        top = self.sampler.top(self._where_since)
        loader = "its loader workers spend" if self.num_workers else "its loader spends"
        return f"{loader} the time at {top}" if top else ""

    def _store(self):
        """The launcher's store, under ``straggler/`` (``run_store``); None where there is none."""
        if self.store is None:
            try:
                self.store = run_store("straggler") or False
            except Exception:  # noqa: BLE001 - no store to reach: the line names no host
                self.store = False
        return self.store or None

    def _print_pending(self) -> None:
        """Rank 0: print each pending line whose named rank answered (or
        after ``WHERE_WAIT_POLLS`` polls without an answer), in order."""
        while self.pending:
            key, rank, phase, figures, started, found, at = self.pending[0]
            if found is None:
                store = self._store()
                try:
                    if store is not None and store.check([key]):
                        found = json.loads(store.get(key))
                except Exception:  # noqa: BLE001 - the store is gone: name what is known
                    store = None
                if found is None and store is not None and self.polls - at < WHERE_WAIT_POLLS:
                    return
            self.pending.pop(0)
            print_line(straggler_line(rank, phase, figures, started, found or {}))


def slow_ranks(per_step: list) -> tuple:
    """``medians``, {(rank, column): the median of the other ranks}, for
    each column of ``per_step`` (a list by rank of seconds a step per phase
    of ``COMPARED``, or of other seconds, as many for each rank) and each
    rank, with ``slow``: the set of the pairs where the rank is slower than
    ``RATIO`` x that median and by ``FLOOR_S`` at least. Returns (medians, slow). Each median in O(1) from the column
    sorted once (``_median_without``): O(n log n) a column for n ranks."""
    medians, slow = {}, set()
    for column in range(len(per_step[0]) if per_step else 0):
        order = sorted(range(len(per_step)), key=lambda rank: per_step[rank][column])
        values = [per_step[rank][column] for rank in order]
        for place, rank in enumerate(order):
            peers = medians[(rank, column)] = _median_without(values, place)
            if values[place] > RATIO * peers and values[place] - peers > FLOOR_S:
                slow.add((rank, column))
    return medians, slow


def _median_without(values: list, place: int) -> float:
    """The median of sorted ``values`` without the one at index ``place``
    (the mean of the middle two for an even count left)."""
    left = len(values) - 1

    def at(index: int) -> float:  # the index-th of the values left
        return values[index if index < place else index + 1]

    if left % 2:
        return at(left // 2)
    return (at(left // 2 - 1) + at(left // 2)) / 2


def link_line(sender: int, sender_host: str, receiver: int, receiver_host: str, figures: tuple,
              started: bool) -> str:
    """The line rank 0 prints for the link from rank ``sender`` to rank
    ``receiver`` (see ``StragglerWatch``): ``figures`` (the seconds its
    probe of ``PROBE_BYTES`` took, the other links' median, the window's
    first and last step). MB/s: 10^6 bytes a second."""
    seconds, peers, first, last = figures
    link = f"straggler: the link from rank {sender} (host {sender_host}) to rank {receiver} (host {receiver_host})"
    size = f"{PROBE_BYTES // 1024} KiB"
    if not started:
        return (f"{link} is no longer slow: {size} in {1000 * seconds:.1f} ms against {1000 * peers:.1f} ms, "
                f"over steps {first}-{last}")
    return (f"{link} is slow: {size} in {1000 * seconds:.1f} ms ({PROBE_BYTES / seconds / 1e6:.1f} MB/s) against "
            f"{1000 * peers:.1f} ms on the other links between hosts (median), over steps {first}-{last}")


def straggler_line(rank: int, phase: str, figures: tuple, started: bool, found: dict) -> str:
    """The line rank 0 prints (see ``StragglerWatch``): ``figures`` (this
    rank's seconds a step, the other ranks' median, the window's first and
    last step), ``found`` the rank's {"host", "where"}."""
    seconds, peers, first, last = figures
    host = found.get("host") or "unknown"
    if not started:
        return (f"straggler: rank {rank} (host {host}) is no longer slow in {phase}: {1000 * seconds:.1f} ms a "
                f"step against {1000 * peers:.1f} ms, over steps {first}-{last}")
    where = f"; {found['where']}" if found.get("where") else ""
    return (f"straggler: rank {rank} (host {host}) is slow in {phase}: {1000 * seconds:.1f} ms a step against "
            f"{1000 * peers:.1f} ms on the other ranks (median), over steps {first}-{last}{where}")
