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
    the originals while the copy is written: ``CpuStaging().copy(obj)``, its
    copies complete when this returns (a copy of a GPU tensor waits for the
    GPU's queued work on it). Tensors that share memory (a tied weight's two
    state_dict keys) share it in the copy too."""
    staging = CpuStaging()
    copied = staging.copy(obj)
    staging.wait()
    return copied


class CpuStaging:
    """Copies a snapshot's state to CPU memory for the background write, into
    buffers kept from one snapshot to the next.

    ``copy`` replaces every tensor of a state (dicts, an ``OrderedDict`` with
    its ``_metadata``, lists and tuples, copied level by level; anything
    else shared) by a CPU tensor that training no longer changes. It copies
    memory, not tensors: tensors that share a storage (a tied weight's two
    state_dict keys, ``gpt.GPT``'s ``wte.weight`` and ``lm_head.weight``)
    get one copy of it and stay views of one storage, which ``torch.save``
    then writes once, as it does for the originals; a load assigns that one
    tensor to both keys, and ``load_state_dict`` copies it into the model's
    one tied parameter. (A copy per tensor would write such a weight twice.)

    Each storage is copied into a buffer of this object's, made at the first
    snapshot and reused by every later one (a new one only where a size
    changed): the allocation, and for GPU tensors the pinning, is paid once.
    For a GPU tensor the buffer is page-locked (pinned) host memory and the
    copy ``non_blocking``: the copies are queued on the current CUDA stream,
    behind the step that made the values and before any later step that
    changes them, and ``copy`` returns without waiting for them; ``wait``
    (the background writer calls it before ``torch.save``) waits for them.
    This is the staging of torch.distributed.checkpoint's async save
    (``StagingOptions(use_pinned_memory=True, use_non_blocking_copy=True)``),
    for the kit's one-file snapshots. CPU tensors are copied at once.

    At most one snapshot may use the buffers at a time: the Checkpointer
    waits for the previous write before it copies the next (``SnapshotWriter``).
    """

    def __init__(self) -> None:
        self._buffers: dict = {}  # the path of a storage's first tensor -> its CPU buffer (an UntypedStorage)
        self._streams: list = []  # the CUDA streams the last copy queued copies on
        self._copied: list = []  # a CUDA event after the last copy's copies, one per stream

    def copy(self, obj: object) -> object:
        """``obj`` with its tensors copied to CPU memory (see the class); GPU
        copies may still be in flight: call ``wait`` before reading them."""
        self._streams, self._copied = [], []
        copied = self._copy(obj, (), {})
        for stream in self._streams:  # marks the copies' end: a wait is for them, not for later steps
            event = torch.cuda.Event()
            event.record(stream)
            self._copied.append(event)
        return copied

    def wait(self) -> None:
        """Block until the copies of the last ``copy`` are in CPU memory."""
        for event in self._copied:
            event.synchronize()
        self._streams, self._copied = [], []

    def _copy(self, obj: object, path: tuple, memo: dict) -> object:
        if isinstance(obj, torch.Tensor):
            return self._copy_tensor(obj.detach(), path, memo)
        if isinstance(obj, dict):
            copied = type(obj)((key, self._copy(value, path + (key,), memo)) for key, value in obj.items())
            if hasattr(obj, "_metadata"):  # a module's state_dict: versions load_state_dict reads
                copied._metadata = obj._metadata
            return copied
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._copy(value, path + (index,), memo) for index, value in enumerate(obj))
        return obj

    def _copy_tensor(self, tensor: torch.Tensor, path: tuple, memo: dict) -> torch.Tensor:
        """``tensor`` as a view of the CPU copy of its storage (one copy per
        storage: ``memo``, by device and address)."""
        if type(tensor) is not torch.Tensor or tensor.layout != torch.strided or tensor.is_quantized:
            return tensor.to("cpu", copy=True)  # no plain storage to share: a copy of its own
        storage = tensor.untyped_storage()
        key = (tensor.device, storage.data_ptr(), storage.nbytes())
        copied = memo.get(key)
        if copied is None:
            copied = memo[key] = self._copy_storage(storage, tensor.device, path)
        return torch.empty(0, dtype=tensor.dtype).set_(copied, tensor.storage_offset(), tensor.shape,
                                                       tensor.stride())

    def _copy_storage(self, storage: torch.UntypedStorage, device: torch.device,
                      path: tuple) -> torch.UntypedStorage:
        """``storage``'s bytes in this object's CPU buffer for ``path``
        (pinned for a GPU storage; made, or remade at another size, here)."""
        buffer = self._buffers.get(path)
        cuda = device.type == "cuda"
        if buffer is None or buffer.nbytes() != storage.nbytes() or buffer.is_pinned() != cuda:
            buffer = torch.UntypedStorage(storage.nbytes())
            buffer = self._buffers[path] = buffer.pin_memory() if cuda else buffer
        buffer.copy_(storage, non_blocking=cuda)
        if cuda:
            stream = torch.cuda.current_stream(device)
            if stream not in self._streams:
                self._streams.append(stream)
        return buffer


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
