"""The run's timeline: one Chrome-trace JSON file beside the snapshot, a track
per rank per attempt, written as it goes so that a killed attempt keeps its part.

Beside a snapshot in a bucket (``s3://``) the timeline is a folder of
objects, each rank's track of each attempt its own (``track_url``), which
``read_trace`` merges: several ranks cannot append to one object, an object
store having no append, and a track of each rank's own needs no collective
to gather it. Each object is PUT whole from the rank's memory (see
``Timeline``).
"""

from __future__ import annotations

import json
import os
from typing import Optional

from ..snapshots import BucketError, BucketWriter, in_bucket, list_urls, read_bytes

# The trace event format (Google's "Trace Event Format" document, the JSON
# Array Format): a JSON array of events whose closing "]" may be missing, which
# chrome://tracing and Perfetto's JSON importer both accept. Each event here is
# written as ",\n{...}" after the first, so the file always ends in a whole
# event: a killed writer leaves a prefix that "]" closes.
OPEN = "["
SEPARATOR = ",\n"
# A track in a bucket is PUT whole at every flush: once a part of it holds this many bytes, its next events
# go to a new object (its next part), so that a day-long track costs PUTs of at most this size, not of the
# whole track every 10 s.
TRACK_PART_BYTES = 256 * 1024


def track_url(trace_url: str, attempt: int, rank: int, part: int) -> str:
    """The object of part ``part`` (from 0) of rank ``rank``'s track of attempt
    ``attempt`` in the timeline at ``trace_url`` (``s3://bucket/KEY.timeline``):
    ``<trace_url>/attempt-0002.rank-00003.part-0000.json``, each a complete
    JSON-array trace (Perfetto opens one alone); the numbers zero-padded so
    that the names sort in that order."""
    return f"{trace_url}/attempt-{attempt:04d}.rank-{rank:05d}.part-{part:04d}.json"


def parse_trace(text: str) -> list:
    """The events of a JSON-array trace as Perfetto reads one without its
    closing bracket: "]" added where it is missing, a trailing comma dropped.
    Raises ValueError (json.JSONDecodeError) for text that is not such an array."""
    text = text.rstrip()
    if not text.endswith("]"):
        text = text.rstrip(",") + "]"
    return json.loads(text)


def read_trace(path: str) -> list:
    """The events of the timeline at ``path``: a file (``parse_trace``), or,
    for an ``s3://`` URL, every track object under it (``track_url``) merged
    in the order of their names. Raises ValueError (json.JSONDecodeError)
    for a file or object that is not a JSON-array trace, OSError for a file
    that cannot be read, and ``snapshots.BucketError`` for a store that fails."""
    if in_bucket(path):
        return [event for url in list_urls(path) for event in parse_trace((read_bytes(url) or b"[]").decode())]
    with open(path) as f:
        return parse_trace(f.read())


class Timeline:
    """This rank's track of attempt ``attempt`` (pid = the attempt, tid = the
    rank: Perfetto shows one process per attempt, one thread per rank in
    it) in the trace file at ``path``, which every rank of every attempt
    appends to. Events are buffered and each ``flush`` appends them in one
    ``write`` (O_APPEND: the ranks' writes do not interleave on a local or
    cluster file system that honours it). Timestamps are Unix times in
    microseconds, so the attempts line up on one axis. ``path`` None: a
    timeline that writes nothing. A file that cannot be written turns the
    timeline off (``error`` says why), never the run.

    ``path`` an ``s3://`` URL (``KEY.timeline`` beside a snapshot in a
    bucket): the track is this rank's objects there (``track_url``), kept
    in memory and PUT whole by a ``snapshots.BucketWriter`` at each
    ``flush``: at once where ``now`` (``Goodput`` flushes so at the
    attempt's start, so that a track exists from then, at each snapshot
    and at ``close``), else within ``snapshots.bucket.PUT_EVERY_S`` (its
    background thread: a window of steps). A rank killed outright loses at
    most the events of its last ``PUT_EVERY_S``."""

    def __init__(self, path: Optional[str], attempt: int, rank: int, host: str) -> None:
        self.path, self.attempt, self.rank = path, attempt, rank
        self.buffer: list = []
        self.error = ""
        self.fd: Optional[int] = None
        self.writer: Optional[BucketWriter] = None
        self.part, self.part_events = 0, []  # in a bucket: the part of the track written now, its events
        if path is None:
            return
        if in_bucket(path):
            self.writer = BucketWriter()
            self._track_events(host)
            return
        try:
            self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            first = rank == 0 and os.fstat(self.fd).st_size == 0  # rank 0 opens it before the others
        except OSError as exc:
            self._fail(exc)
            return
        self._track_events(host, first)
        self.flush()

    def _track_events(self, host: str, first: bool = False) -> None:
        """The track's metadata: its process's name and place (rank 0's), its thread's."""
        attempt, rank = self.attempt, self.rank
        if rank == 0:
            self._event({"name": "process_name", "ph": "M", "pid": attempt, "args": {"name": f"attempt {attempt}"}},
                        first=first)
            self._event({"name": "process_sort_index", "ph": "M", "pid": attempt, "args": {"sort_index": attempt}})
        self._event({"name": "thread_name", "ph": "M", "pid": attempt, "tid": rank,
                     "args": {"name": f"rank {rank} ({host})"}})
        self._event({"name": "thread_sort_index", "ph": "M", "pid": attempt, "tid": rank,
                     "args": {"sort_index": rank}})

    def span(self, name: str, start: float, seconds: float, args: Optional[dict] = None) -> None:
        """A span ("X" event) on this rank's track from Unix time ``start``
        (seconds) lasting ``seconds``; ``args`` shown beside it."""
        event = {"name": name, "ph": "X", "pid": self.attempt, "tid": self.rank, "ts": round(start * 1e6, 1),
                 "dur": round(max(seconds, 0.0) * 1e6, 1)}
        if args:
            event["args"] = args
        self._event(event)

    def marker(self, name: str, at: float, args: Optional[dict] = None) -> None:
        """An instant marker ("i" event, thread-scoped) on this rank's track at Unix time ``at`` (seconds)."""
        event = {"name": name, "ph": "i", "s": "t", "pid": self.attempt, "tid": self.rank, "ts": round(at * 1e6, 1)}
        if args:
            event["args"] = args
        self._event(event)

    def _event(self, event: dict, first: bool = False) -> None:
        if self.writer is not None:
            self.part_events.append(json.dumps(event, separators=(",", ":")))
        elif self.fd is not None:
            self.buffer.append((OPEN if first else SEPARATOR) + json.dumps(event, separators=(",", ":")))

    def flush(self, now: bool = False) -> None:
        """Append the buffered events to the file, in one write. In a bucket:
        hand the part of the track written now to the writer, whole and
        closed by its "]" (PUT within ``PUT_EVERY_S``, or before returning
        when ``now``); one of ``TRACK_PART_BYTES`` or more is the last of its
        part: the next events start the next."""
        if self.writer is not None:
            if not self.part_events:
                return
            text = (OPEN + SEPARATOR.join(self.part_events) + "]").encode()
            try:
                self.writer.put(track_url(self.path, self.attempt, self.rank, self.part), [text], now=now)
            except BucketError as exc:
                self._fail(exc)
                return
            if len(text) >= TRACK_PART_BYTES:
                self.part, self.part_events = self.part + 1, []
            return
        if self.fd is None or not self.buffer:
            return
        data = "".join(self.buffer).encode()
        self.buffer.clear()
        try:
            while data:
                data = data[os.write(self.fd, data):]
        except OSError as exc:
            self._fail(exc)

    def close(self) -> None:
        """Flush, then close the file (the closing bracket stays off: the next
        attempt appends); in a bucket, PUT what is left now and stop the writer."""
        if self.writer is not None:
            self.flush()
            try:
                self.writer.close()
            except BucketError as exc:
                self._fail(exc)
            self.writer = None
            return
        self.flush()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def _fail(self, exc) -> None:
        """``exc`` (an OSError, or a BucketError) turns the timeline off: ``error`` says why."""
        cause = exc.bucket_cause if isinstance(exc, BucketError) else exc.strerror or exc
        self.error = f"cannot write the timeline {self.path} ({cause}); the run goes on without it"
        if self.fd is not None:
            os.close(self.fd)
        self.fd = None
        self.buffer.clear()
        self.part_events = []
        if self.writer is not None:
            self.writer.stop()
            self.writer = None
