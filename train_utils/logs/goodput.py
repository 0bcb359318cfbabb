"""Where a run's wall time goes, across its attempts: the goodput ledger
beside the snapshot (rank 0's, JSON lines), the run's timeline (every rank's
track, ``timeline.Timeline``) and the goodput line at the end of a run.

An attempt is one start of the run's processes: the first start, a torchrun
restart, a requeued Slurm job, a resize. Its wall time runs from its
process's start (``process_start_time``) to its last record; the ledger
splits it into ``CATEGORIES``, which sum to it.

Beside a snapshot in a bucket (``s3://bucket/KEY``) the ledger is the
object ``KEY.goodput.jsonl`` (``BucketLedger``) and the timeline the
objects under ``KEY.timeline/`` (``timeline.Timeline``), both PUT whole
from memory: an object store has no append and no in-place write.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from typing import Callable, Iterator, Mapping, Optional

import torch.distributed as dist

from ..output import print_line
from ..snapshots import BucketError, BucketWriter, in_bucket, read_bytes
from .timeline import Timeline

# The categories of an attempt's wall time (docs/goodput.md defines each):
#   start-up    process start to the first training step (imports, process group, task, model, snapshot load)
#   productive  training steps that count: step time less "data" and "peers"
#   redone      training steps a later attempt trains again: those after the last snapshot a resume finds
#   snapshot    the training loop blocked by a snapshot (its copy to CPU memory, a wait for the write before it)
#   evaluation  held-out evaluations (--eval_every_steps, epoch ends, the test split at the end)
#   data        rank 0's step waiting for its next batch (the phase timer's "data")
#   peers       rank 0's step waiting for other ranks in collectives (the phase timer's "collective")
#   other       the rest: what follows the training loop (a language model's sample), the process's end
CATEGORIES = ("start-up", "productive", "redone", "snapshot", "evaluation", "data", "peers", "other")

# The timeline draws the training steps as one span per window of steps, at
# least this many seconds long (or up to an evaluation, a snapshot, the end),
# its phases laid back to back inside it: a span per step would make a
# day-long run's trace gigabytes, this one a few MB a rank.
TRACE_WINDOW_S = 10.0

_IMPORTED_AT = time.time()  # the earliest time the kit reads where /proc does not say when the process started


def process_start_time() -> float:
    """When this process started, as a Unix time (seconds): on Linux its
    start in /proc/self/stat (clock ticks since boot) set against
    /proc/uptime, good to 10 ms; elsewhere the time this module was
    imported (a second or so after the start, torch's import)."""
    try:
        with open("/proc/self/stat") as f:
            stat = f.read()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        # proc(5): field 22, starttime; the command name (field 2) may hold spaces, so count after its ")".
        start_ticks = int(stat.rpartition(")")[2].split()[19])
        return time.time() - (uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return _IMPORTED_AT


def goodput_paths(snapshot_path: str) -> tuple[Optional[str], Optional[str]]:
    """(the ledger, the timeline) beside ``snapshot_path`` (--snapshot_path,
    a file or a folder of sharded saves): ``<snapshot_path>.goodput.jsonl``
    and ``<snapshot_path>.timeline.json``; for ``s3://bucket/KEY`` the
    objects ``s3://bucket/KEY.goodput.jsonl`` and the folder of track objects
    ``s3://bucket/KEY.timeline`` (``timeline.track_url``). (None, None) for
    another URL (a scheme the kit does not write logs to)."""
    if in_bucket(snapshot_path):
        base = snapshot_path.rstrip("/")
        return base + ".goodput.jsonl", base + ".timeline"
    if "://" in snapshot_path:
        return None, None
    base = os.path.normpath(snapshot_path)
    return base + ".goodput.jsonl", base + ".timeline.json"


def ledger_text(path: str) -> str:
    """The ledger at ``path`` as text: a file, or an ``s3://`` object; ''
    where there is none. Raises OSError for a file that cannot be read,
    ``snapshots.BucketError`` for a store that fails."""
    if in_bucket(path):
        return (read_bytes(path) or b"").decode(errors="replace")
    with contextlib.suppress(FileNotFoundError), open(path, errors="replace") as f:
        return f.read()
    return ""


def parse_ledger(text: str) -> list:
    """The records of a ledger's ``text``, in order; a line a killed writer left torn is skipped."""
    records = []
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if isinstance(record, dict) and "attempt" in record:
                records.append(record)
    return records


def read_ledger(path: str) -> list:
    """The records of the ledger at ``path`` (a file, or an ``s3://``
    object: ``goodput_paths``), in order ([] where there is none); a line a
    killed writer left torn is skipped. Raises as ``ledger_text`` does."""
    return parse_ledger(ledger_text(path))


def attempt_totals(records: list) -> dict:
    """{attempt: {"wall_s", "seconds" {category: s}, "step", "redone_steps",
    "record"}} for the attempts of the ledger's last run (``records`` from
    ``read_ledger``): each attempt's last record, its steps redone (a later
    attempt's "redone" record) moved from "productive" to "redone"."""
    if not records:
        return {}
    run = records[-1].get("run", 0)
    last, redone = {}, {}
    for record in records:
        if record.get("run", 0) != run:
            continue
        (redone if record["record"] == "redone" else last)[record["attempt"]] = record
    totals = {}
    for attempt, record in sorted(last.items()):
        seconds = {name: float(record["seconds"].get(name, 0.0)) for name in CATEGORIES}
        moved = redone.get(attempt, {})
        shift = min(float(moved.get("seconds", 0.0)), seconds["productive"])
        seconds["productive"] -= shift
        seconds["redone"] += shift
        totals[attempt] = {"wall_s": float(record["wall_s"]), "seconds": seconds, "step": record.get("step", 0),
                           "redone_steps": int(moved.get("steps", 0)), "record": record["record"]}
    return totals


def shares(seconds: Mapping[str, float]) -> dict:
    """Each category's share of the total, in whole percent summing to 100
    (largest remainders: the Hamilton method); all 0 for a total of 0."""
    total = sum(seconds.values())
    if total <= 0:
        return {name: 0 for name in seconds}
    exact = {name: 100 * value / total for name, value in seconds.items()}
    whole = {name: int(value) for name, value in exact.items()}
    for name in sorted(exact, key=lambda n: whole[n] - exact[n])[:100 - sum(whole.values())]:
        whole[name] += 1
    return whole


def goodput_line(records: list) -> str:
    """The run's goodput line over every attempt of the ledger's last run:

        goodput 0.91 (start-up 3%, redone 4%, snapshot 1%, data 1%)

    the productive share of the attempts' summed wall time, then every
    other category with a share of 1% or more; with the productive one the
    shares sum to 100% (``shares``)."""
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    for attempt in attempt_totals(records).values():
        for name, value in attempt["seconds"].items():
            seconds[name] += value
    percent = shares(seconds)
    rest = ", ".join(f"{name} {percent[name]}%" for name in CATEGORIES if name != "productive" and percent[name])
    return f"goodput {percent['productive'] / 100:.2f}" + (f" ({rest})" if rest else "")


def launch_info() -> dict:
    """What started this attempt, from the launcher's environment: the Slurm
    job and its requeue count, torchrun's restart count (where set)."""
    names = {"SLURM_JOB_ID": "slurm_job", "SLURM_RESTART_COUNT": "slurm_restart_count",
             "TORCHELASTIC_RESTART_COUNT": "torchrun_restart_count"}
    return {key: os.environ[name] for name, key in names.items() if os.environ.get(name)}


class Ledger:
    """Rank 0's goodput ledger at ``path``, JSON lines, one writer at a time
    (the snapshot's claim). Each record is cumulative for its attempt: a
    ``commit``ted one stays; the others (one a training step) overwrite the
    line after the last committed one in place, so that the ledger grows by
    a line per snapshot, not per step, and a killed attempt keeps its
    last step. Writes go straight to the file (no buffer): a process killed
    by SIGKILL keeps what it wrote."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        self.slot = os.lseek(self.fd, 0, os.SEEK_END)  # where the next line goes
        self.slot_len = 0  # the length of the uncommitted line there
        if self.slot and os.pread(self.fd, 1, self.slot - 1) != b"\n":  # a torn last line: end it
            self.slot += os.pwrite(self.fd, b"\n", self.slot)

    def write(self, record: dict, commit: bool) -> None:
        """Write ``record`` as the line after the last committed one (padded
        with spaces to cover the longer line it replaces); ``commit``: it stays."""
        line = json.dumps(record, separators=(",", ":"))
        data = (line.ljust(self.slot_len - 1) + "\n").encode()
        os.pwrite(self.fd, data, self.slot)
        if commit:
            self.slot, self.slot_len = self.slot + len(data), 0
        else:
            self.slot_len = len(data)

    def read(self) -> list:
        """Every record of the ledger (``read_ledger``)."""
        return read_ledger(self.path)

    def close(self) -> None:
        os.close(self.fd)


class BucketLedger:
    """Rank 0's goodput ledger as the object ``url`` (``s3://bucket/KEY.goodput.jsonl``),
    one writer at a time (the snapshot's lease), its records as ``Ledger``'s.
    An object store has no append and no in-place rewrite, so the ledger
    lives in memory, from ``text`` (the object as ``Goodput.begin`` read
    it), and the object is PUT whole (``snapshots.BucketWriter``): at each
    committed record (an attempt's start, a snapshot, its end) before
    ``write`` returns, and after the others (a step's) at most every
    ``snapshots.bucket.PUT_EVERY_S`` from a background thread: a PUT per step
    would cost more than the step. An attempt killed outright (SIGKILL, a
    lost node) loses at most that many seconds of its last record, so the
    steps it trained in them are missing from its "redone" steps. Raises
    ``snapshots.BucketError`` (``write``, ``close``) when the store refuses."""

    def __init__(self, url: str, text: str) -> None:
        self.url = url
        self.committed = text.encode() if not text or text.endswith("\n") else (text + "\n").encode()
        self.uncommitted = b""  # the line after the committed ones: the attempt's latest step
        self.writer = BucketWriter()

    def write(self, record: dict, commit: bool) -> None:
        """``record`` as the line after the last committed one; ``commit``: it
        stays, and the object is PUT now, else within ``PUT_EVERY_S``."""
        line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        if commit:
            self.committed, self.uncommitted = self.committed + line, b""
        else:
            self.uncommitted = line
        self.writer.put(self.url, [self.committed, self.uncommitted], now=commit)

    def read(self) -> list:
        """Every record of the ledger, as this attempt last wrote it."""
        return parse_ledger((self.committed + self.uncommitted).decode(errors="replace"))

    def close(self) -> None:
        """PUT what is not yet in the store, now; stop the writer."""
        self.writer.close()


class Goodput:
    """This attempt's wall time by category (``CATEGORIES``), measured on
    every rank: rank 0 writes the ledger (``goodput_paths``, beside
    --snapshot_path), every rank its track of the timeline. The Trainer
    calls ``begin`` once the snapshot is loaded (start-up ends),
    ``step`` after every optimizer step, ``timed`` around an evaluation or a
    snapshot's blocking part, ``saved`` after a snapshot, ``marker`` at a
    stop, and ``end`` at the attempt's end, whose answer is the goodput
    line. ``phases``: () -> {"data": s, "collective": s, ...}, this rank's
    seconds per step phase since its start (the phase timer's ``totals``),
    None where there is none ("data" and "peers" then stay 0 and count as
    productive). ``started_at``: the attempt's start, a Unix time
    (``process_start_time`` by default). A path that cannot be written,
    or a bucket that refuses, costs one warning line and the ledger, never
    the run. Beside a snapshot in a bucket the ledger is a ``BucketLedger``."""

    def __init__(self, snapshot_path: str, rank: int, phases: Optional[Callable[[], Mapping[str, float]]] = None,
                 started_at: Optional[float] = None) -> None:
        self.ledger_path, self.trace_path = goodput_paths(snapshot_path)
        self.rank, self.phases = rank, phases
        self.started_at = process_start_time() if started_at is None else started_at
        self.attempt, self.run = 0, 0
        self.ledger = None  # a Ledger (a file) or a BucketLedger (an s3:// object)
        self.timeline: Optional[Timeline] = None
        self.seconds = dict.fromkeys(CATEGORIES, 0.0)
        self.loop_s = 0.0  # training-step seconds of this attempt (productive + data + peers)
        self.phase_base: dict = {}  # the phase timer's totals at the first step
        self.mark = 0.0  # the last boundary (time.time()): the first step, a step, a timed block's end
        self.step_now = 0
        self.window: Optional[dict] = None  # the timeline's steps since its last span
        self.began = self.ended = False

    def begin(self, resumed_from: str, step: int, world_size: int) -> None:
        """Collective: start-up is over, the first training step comes next.
        ``resumed_from``: the position of the snapshot found (its saver's
        steps: ``Found.position`` before the load; '' for a fresh start),
        ``step`` this run's step now. Rank 0 numbers the attempt from the
        ledger, records the steps the previous attempt trained after that
        snapshot as redone (``redone``), and writes the attempt's first
        record; every rank opens its timeline track."""
        now = time.time()
        self.began, self.step_now, self.mark = True, step, now
        self.seconds["start-up"] = now - self.started_at
        self.phase_base = dict(self.phases()) if self.phases else {}
        facts = [0, 0]
        if self.rank == 0 and self.ledger_path:
            try:
                text = ledger_text(self.ledger_path)
                self.attempt, self.run, redone = self._place(parse_ledger(text), resumed_from, step)
                if in_bucket(self.ledger_path):
                    self.ledger = BucketLedger(self.ledger_path, text)
                else:
                    self.ledger = Ledger(self.ledger_path)
                if redone:
                    self.ledger.write(redone, commit=True)
                self._record("start", commit=True, resumed_from=resumed_from or None, start_step=step,
                             world_size=world_size, host=socket.gethostname(), launch=launch_info())
            except (OSError, BucketError) as exc:
                self._drop_ledger(exc)
            facts = [self.attempt, self.run]
            self._open_timeline()  # rank 0 first: it starts the file, which the others append to
        if world_size > 1:
            dist.broadcast_object_list(facts, src=0)
        self.attempt, self.run = facts
        if self.rank != 0:
            self._open_timeline()
        if self.timeline is not None:
            self.timeline.span("start-up", self.started_at, now - self.started_at)
            if resumed_from:
                self.timeline.marker("resume", now, {"from": resumed_from, "step": step})
            self.timeline.flush(now=True)  # in a bucket, a track of an attempt killed soon after still shows it
            self._say_timeline_error()
        self.window = None

    def _open_timeline(self) -> None:
        """This rank's track of the timeline (none without a path or an attempt number)."""
        if self.trace_path and self.attempt:
            self.timeline = Timeline(self.trace_path, self.attempt, self.rank, socket.gethostname())

    def _place(self, records: list, resumed_from: str, step: int) -> tuple[int, int, Optional[dict]]:
        """(this attempt's number, its run's, the "redone" record for the
        previous attempt or None) from the ledger's ``records``. The
        previous attempt's steps after the snapshot this one resumes from
        (``resumed_from``; '' for none) are redone: from its record of
        that snapshot, or from its start where it started from the same
        one, to its last record. A fresh start after an attempt that
        finished, or that resumed from a snapshot, is a new run."""
        if not records:
            return 1, 1, None
        previous = records[-1]["attempt"]
        run = records[-1].get("run", 0)
        mine = [r for r in records if r["attempt"] == previous and r["record"] != "redone"]
        if not mine:
            return previous + 1, run, None
        start, last = mine[0], mine[-1]
        base = next((r for r in reversed(mine) if r["record"] == "snapshot" and resumed_from
                     and r.get("position") == resumed_from), None)
        if base is None and (start.get("resumed_from") or "") == resumed_from and last.get("reason") != "finished":
            base = start
        if base is None:
            # A fresh start after a finished run, or one that found a snapshot this attempt does not: a new run.
            return previous + 1, run + 1 if not resumed_from else run, None
        steps = max(0, int(last.get("step", 0)) - int(base.get("step", 0)))
        productive = float(last["seconds"].get("productive", 0.0))
        if base is not start:
            productive -= float(base["seconds"].get("productive", 0.0))
        redone = {"record": "redone", "run": run, "attempt": previous, "by": previous + 1, "steps": steps,
                  "seconds": max(0.0, productive), "resumed_from": resumed_from or None, "time": time.time()}
        return previous + 1, run, redone

    def step(self, step: int) -> None:
        """Optimizer step ``step`` (the run's) is done: its time counted; rank
        0's ledger line says so (in place); the timeline's window of steps
        drawn once it spans ``TRACE_WINDOW_S``."""
        now = time.time()
        self.loop_s += now - self.mark
        if self.window is None:
            self.window = {"start": self.mark, "first": step, "phases": self._phase_totals()}
        self.mark, self.step_now = now, step
        if self.ledger is not None:
            self._record("step", commit=False, now=now)
        if self.timeline is not None and now - self.window["start"] >= TRACE_WINDOW_S:
            self._draw_window(now)
            self.timeline.flush()

    @contextlib.contextmanager
    def timed(self, category: str) -> Iterator[None]:
        """Count the block's seconds as ``category`` ("snapshot", "evaluation"),
        drawn as a span of that name on this rank's track."""
        start = time.time()
        if self.began and not self.ended:
            self.loop_s += start - self.mark  # a partial step interval: an epoch's end
            self._draw_window(start)
        try:
            yield
        finally:
            end = time.time()
            self.seconds[category] += end - start
            self.mark = end
            if self.timeline is not None:
                self.timeline.span(category, start, end - start)

    def saved(self, position: str) -> None:
        """A snapshot of the run at ``position`` (its save line's, in this
        run's steps: ``snapshots.position``) was taken: rank 0 commits a
        ledger record naming it (a later resume from it finds the steps
        redone after it), every rank marks it and flushes its track (in a
        bucket, PUT now); these writes count as "snapshot"."""
        now = time.time()
        if self.ledger is not None:
            self._record("snapshot", commit=True, now=now, position=position)
        if self.timeline is not None:
            self.timeline.marker("snapshot", now, {"position": position, "step": self.step_now})
            self.timeline.flush(now=True)
        # These writes held the loop too (in a bucket a PUT each, tens of ms): counted as "snapshot".
        self.mark = time.time()
        self.seconds["snapshot"] += self.mark - now

    def marker(self, name: str, args: Optional[dict] = None) -> None:
        """An instant marker on this rank's track now (a stop)."""
        if self.timeline is not None:
            self.timeline.marker(name, time.time(), args)

    def end(self, reason: str) -> str:
        """The attempt ends (``reason``: "finished", "stopped", "failed"): rank
        0 commits its last record; every rank closes its track. Returns rank
        0's goodput line over every attempt of the run (``goodput_line``),
        '' on the other ranks, before ``begin`` and after the first call."""
        if not self.began or self.ended:
            return ""
        now = time.time()
        self._draw_window(now)
        self.ended = True
        line = ""
        if self.ledger is not None:
            try:
                self._record("end", commit=True, now=now, reason=reason)
                if self.ledger is not None:
                    line = goodput_line(self.ledger.read())
                    self.ledger.close()
                    self.ledger = None
            except (OSError, BucketError) as exc:
                self._drop_ledger(exc)
        if self.timeline is not None:
            self.timeline.marker("end", now, {"reason": reason, "step": self.step_now})
            self.timeline.close()
            self._say_timeline_error()
        return line

    def _phase_totals(self) -> dict:
        """The phase timer's seconds since the first step: "data", "collective"."""
        if not self.phases:
            return {"data": 0.0, "collective": 0.0}
        totals = self.phases()
        return {name: float(totals.get(name, 0.0)) - float(self.phase_base.get(name, 0.0))
                for name in ("data", "collective")}

    def _draw_window(self, now: float) -> None:
        """The timeline's span of the steps since its last one, if any: the
        window, and inside it its data, peers and compute seconds back to back."""
        window, self.window = self.window, None
        if window is None or self.timeline is None:
            return
        phases = self._phase_totals()
        data = max(0.0, phases["data"] - window["phases"]["data"])
        peers = max(0.0, phases["collective"] - window["phases"]["collective"])
        length = now - window["start"]
        compute = max(0.0, length - data - peers)
        steps = f"steps {window['first']}-{self.step_now}"
        self.timeline.span(steps, window["start"], length, {"steps": self.step_now - window["first"] + 1,
                                                             "data_s": round(data, 6), "peers_s": round(peers, 6),
                                                             "compute_s": round(compute, 6)})
        at = window["start"]
        for name, seconds in (("waiting for data", data), ("waiting for peers", peers), ("compute", compute)):
            if seconds > 0:
                self.timeline.span(name, at, seconds)
                at += seconds

    def _record(self, kind: str, commit: bool, now: Optional[float] = None, **extra) -> None:
        """Rank 0's cumulative record of this attempt at ``now``: every
        category, "other" the wall time's rest, so they sum to "wall_s"."""
        now = time.time() if now is None else now
        wall = now - self.started_at
        seconds = dict(self.seconds)
        phases = self._phase_totals()
        seconds["data"] = min(max(0.0, phases["data"]), self.loop_s)
        seconds["peers"] = min(max(0.0, phases["collective"]), self.loop_s - seconds["data"])
        seconds["productive"] = self.loop_s - seconds["data"] - seconds["peers"]
        seconds["other"] = 0.0
        seconds["other"] = wall - sum(seconds.values())
        record = {"record": kind, "run": self.run, "attempt": self.attempt, "started": round(self.started_at, 6),
                  "time": round(now, 6), "wall_s": wall, "step": self.step_now,
                  "seconds": seconds, **extra}
        try:
            self.ledger.write(record, commit)
        except (OSError, BucketError) as exc:
            self._drop_ledger(exc)

    def _drop_ledger(self, exc: Exception) -> None:
        """The ledger cannot be written (``exc``: an OSError, or the store's
        BucketError): one warning line, and the run goes on without it."""
        if isinstance(self.ledger, BucketLedger):
            self.ledger.writer.stop()
        elif self.ledger is not None:
            with contextlib.suppress(OSError):
                self.ledger.close()
        self.ledger, self.ledger_path = None, None
        cause = exc.bucket_cause if isinstance(exc, BucketError) else getattr(exc, "strerror", None) or exc
        print_line(f"warning: cannot write the goodput ledger beside --snapshot_path ({cause}); "
                   f"the run goes on without it", sys.stderr)

    def _say_timeline_error(self) -> None:
        if self.timeline is not None and self.timeline.error:
            print_line(f"warning: {self.timeline.error}", sys.stderr)
            self.timeline = None
