"""The run's timeline: one Chrome-trace JSON file beside the snapshot, a track
per rank per attempt, written as it goes so that a killed attempt keeps its part.
"""

from __future__ import annotations

import json
import os
from typing import Optional

# The trace event format (Google's "Trace Event Format" document, the JSON
# Array Format): a JSON array of events whose closing "]" may be missing, which
# chrome://tracing and Perfetto's JSON importer both accept. Each event here is
# written as ",\n{...}" after the first, so the file always ends in a whole
# event: a killed writer leaves a prefix that "]" closes.
OPEN = "["
SEPARATOR = ",\n"


def read_trace(path: str) -> list:
    """The events of the trace at ``path`` as Perfetto reads a JSON-array trace
    without its closing bracket: "]" added where it is missing, a trailing
    comma dropped. Raises ValueError (json.JSONDecodeError) for a file that
    is not such an array."""
    with open(path) as f:
        text = f.read().rstrip()
    if not text.endswith("]"):
        text = text.rstrip(",") + "]"
    return json.loads(text)


class Timeline:
    """This rank's track of attempt ``attempt`` (pid = the attempt, tid = the
    rank: Perfetto shows one process per attempt, one thread per rank in
    it) in the trace file at ``path``, which every rank of every attempt
    appends to. Events are buffered and each ``flush`` appends them in one
    ``write`` (O_APPEND: the ranks' writes do not interleave on a local or
    cluster file system that honours it). Timestamps are Unix times in
    microseconds, so the attempts line up on one axis. ``path`` None: a
    timeline that writes nothing. A file that cannot be written turns the
    timeline off (``error`` says why), never the run."""

    def __init__(self, path: Optional[str], attempt: int, rank: int, host: str) -> None:
        self.path, self.attempt, self.rank = path, attempt, rank
        self.buffer: list = []
        self.error = ""
        self.fd: Optional[int] = None
        if path is None:
            return
        try:
            self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            first = rank == 0 and os.fstat(self.fd).st_size == 0  # rank 0 opens it before the others
        except OSError as exc:
            self._fail(exc)
            return
        if rank == 0:
            self._event({"name": "process_name", "ph": "M", "pid": attempt, "args": {"name": f"attempt {attempt}"}},
                        first=first)
            self._event({"name": "process_sort_index", "ph": "M", "pid": attempt, "args": {"sort_index": attempt}})
        self._event({"name": "thread_name", "ph": "M", "pid": attempt, "tid": rank,
                     "args": {"name": f"rank {rank} ({host})"}})
        self._event({"name": "thread_sort_index", "ph": "M", "pid": attempt, "tid": rank,
                     "args": {"sort_index": rank}})
        self.flush()

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
        if self.fd is not None:
            self.buffer.append((OPEN if first else SEPARATOR) + json.dumps(event, separators=(",", ":")))

    def flush(self) -> None:
        """Append the buffered events to the file, in one write."""
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
        """Flush, then close the file (the closing bracket stays off: the next attempt appends)."""
        self.flush()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def _fail(self, exc: OSError) -> None:
        self.error = f"cannot write the timeline {self.path} ({exc.strerror or exc}); the run goes on without it"
        if self.fd is not None:
            os.close(self.fd)
        self.fd = None
        self.buffer.clear()
