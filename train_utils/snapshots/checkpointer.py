"""The Checkpointer: a snapshot's whole life, from the claim on its path to
the last write, behind a few calls (``claim_snapshot_path``; ``find``, ``load``,
``save``, ``wait``, ``close``) and the clock that says when the next one is due.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Mapping, Optional, Protocol

import torch
import torch.distributed as dist

from common import ConfigError
from ..distributed import gloo_group, note_snapshot
from ..output import first_error, output_path_error
from . import bucket
from .bucket import SnapshotBucket, claim_bucket_snapshot, in_bucket
from .claims import claim_snapshot
from .file import START_AFRESH, SnapshotFile, read_snapshot, remove_stale_temporary_files
from .position import position, position_tag
from .save_errors import save_failure
from .sharded import ShardedSnapshots, newest_complete
from .weights import load_initial_weights
from .writer import SnapshotClock, SnapshotWriter

# What a snapshot holds besides its parts' keys: the weights, the optimizer's state, the run's
# configuration and (a sharded snapshot's meta file) the world size that saved it.
OWN_KEYS = ("model", "optimizer", "config", "world_size")


class Part(Protocol):
    """A stateful part of the run that every snapshot holds: ``KEYS``, the
    snapshot keys it writes and reads; ``state_dict()`` (collective) gives
    them; ``load_state_dict(snapshot)`` takes them back from the whole
    snapshot (a part may read others' keys, never change them)."""

    KEYS: tuple

    def state_dict(self) -> dict: ...

    def load_state_dict(self, snapshot: dict) -> None: ...


@dataclass(frozen=True)
class Found:
    """The snapshot a run resumes from, as ``Checkpointer.find`` found it:
    ``path`` (None: none, a fresh start), ``epochs_run`` (the epochs it
    holds whole) and ``position``, where it stands ("after epoch 2", "in
    epoch 3 after step 40"). Once loaded (``Checkpointer.load``),
    ``position`` is in this run's steps and ``note`` the resume line's end
    (another world size: what changes). The Trainer's answer for a snapshot
    that holds every epoch or step asked for: ``finished``, and ``line``
    saying so. ``samples``: the samples the run it holds trained over all
    its starts (``held_samples``; None for a snapshot that does not count
    them). ``mismatch``: for a snapshot of the other strategy's format
    (``other_format``), which this run can find finished but not resume,
    the line that says so (``format_mismatch``); '' otherwise."""

    path: Optional[str] = None
    epochs_run: int = 0
    position: str = ""
    samples: Optional[int] = None
    mismatch: str = ""
    note: str = ""
    finished: bool = False
    line: str = ""


def claim_snapshot_path(path: str, sharded: bool) -> None:
    """Collective, as soon as the process group exists, before the task is
    built: --snapshot_path can be written (every rank checks a sharded one,
    rank 0 a file: ``output.output_path_error``), this run takes its claim
    (``claims.claim_snapshot``: one live run per snapshot, so a second run
    of the same command is refused before a download, say), and rank 0
    removes the temporary files a killed writer left beside it. Raises
    ConfigError (one line, on every rank) when the path cannot be written
    or another live run holds it. ``ending.end_process`` gives the claim back.
    A path in a bucket (``s3://``) is checked, claimed and cleaned there
    (``bucket.claim_bucket_snapshot``)."""
    if in_bucket(path):
        claim_bucket_snapshot(path)
        return
    rank = dist.get_rank()
    writes = (sharded or rank == 0) and not other_format(path, sharded)  # that one: ``Checkpointer.find``
    error = first_error(output_path_error("snapshot_path", path, folder=sharded) if writes else "")
    if error:
        raise ConfigError(error)
    claim_snapshot(path)
    if rank == 0:  # claimed: a temporary file beside the snapshot is a killed writer's, on any host
        remove_stale_temporary_files(path)


def other_format(path: str, sharded: bool) -> bool:
    """Whether ``path`` holds the other strategy's snapshot: a file (DDP's)
    where a sharded run keeps a folder, or a folder with a complete sharded
    save (FSDP's, HSDP's) where a DDP run keeps a file. (In a bucket, the
    store's ``latest`` refuses the other format.)"""
    if in_bucket(path):
        return False
    return os.path.isfile(path) if sharded else newest_complete(path) is not None


def format_mismatch(path: str, sharded: bool) -> str:
    """The one line for a snapshot of the other format (``other_format``) that
    this run would have to train on: what it is, and the two ways on."""
    held, wanted = (("a DDP snapshot (one file)", "--strategy fsdp and hsdp keep a folder of sharded saves")
                    if sharded else ("FSDP/HSDP snapshots (a folder of sharded saves)", "--strategy ddp keeps one file"))
    resume = "--strategy ddp" if sharded else "--strategy fsdp (or hsdp)"
    return (f"--snapshot_path {path} holds {held}, where {wanted}: resume it with {resume}, or start a new run "
            f"from its weights with --init_from {path} and another --snapshot_path")


def held_samples(snapshot: Mapping) -> Optional[int]:
    """The samples the run that saved ``snapshot`` trained over all its
    starts, every rank's: the evaluations part's "samples_run" (up to its
    last evaluation) plus the samples of the interval since, its global
    totals' second entry ("interval_totals" by steps, "epoch_totals" by
    epochs: float64 (2,) tensors, None for none). None for a snapshot
    without "samples_run" (an older kit's)."""
    if "samples_run" not in snapshot:
        return None
    totals = snapshot.get("interval_totals")
    if totals is None:
        totals = snapshot.get("epoch_totals")
    return int(snapshot["samples_run"]) + (0 if totals is None else round(float(totals[1])))


def saved_budget_batch(path: str) -> Optional[int]:
    """Collective, before the run's configuration is resolved: the global
    batch size the run at ``path`` (--snapshot_path: a folder of FSDP or
    HSDP saves, or a DDP file, whatever this run's strategy) started with, which --max_steps and
    --warmup_steps count in (``RunConfig.budget_batch``): its snapshot
    config's "budget_batch", or for a snapshot without it its --batch_size x
    --grad_accum_steps x the world size that saved it. None where there is
    no snapshot, or rank 0 cannot read its configuration (``find`` then
    says why, in one line). Rank 0 reads only the configuration (a file is
    memory-mapped, its tensors not read) and tells the others."""
    answer = [None]
    if dist.get_rank() == 0:
        with contextlib.suppress(Exception):  # a damaged or foreign snapshot: find() refuses it
            if in_bucket(path):  # its manifest records it
                answer[0] = bucket.saved_budget_batch(path)
                meta = None
            elif os.path.isdir(path):  # sharded saves (this run's format, or the other strategy's: other_format)
                folder = newest_complete(path)
                meta = torch.load(os.path.join(folder, ShardedSnapshots.META), map_location="cpu",
                                  weights_only=True) if folder else None
            else:
                meta = torch.load(path, map_location="cpu", weights_only=True, mmap=True) \
                    if os.path.isfile(path) else None
            if meta is not None:
                config = meta["config"]
                world_size = meta.get("world_size") or config["world_size"]
                answer[0] = int(config.get("budget_batch") or
                                config["batch_size"] * config["grad_accum_steps"] * world_size)
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(answer, src=0)
    return answer[0]


class Checkpointer:
    """The run's snapshot at ``path`` (--snapshot_path, claimed already:
    ``claim_snapshot_path``) of ``model`` (DDP's ``.module``; under FSDP the
    sharded model), ``optimizer`` and the run's stateful ``parts`` ({name:
    ``Part``}), given here and loaded in their order; train.py's are
    "progress" (the position, the random streams: ``loop.Progress``, whose
    world size the resume line's note reads), "recipe" (the schedule, the
    loss scale), "evaluations" (the interval's loss, the best so far) and
    "trackers" (the W&B run). ``config``: the run's (``RunConfig.as_dict``), compared with a
    snapshot's before it is loaded and saved in every one. The one to resume
    from is found (``find``) and loaded (``load``; whether anything is left
    to train is the Trainer's decision), new ones are written one at a time
    (in the background unless ``asynchronous`` is False), and the system's
    refusal of a write is one line that names the intact snapshot.

    Two formats, one choice made here, ``sharded``:

    * ``SnapshotFile`` (DDP): one file; rank 0, which holds the whole model
      like every rank, writes it with ``torch.save`` (a temporary file, then
      a rename). One self-contained file that ``torch.load`` opens; its zip
      archive's CRC-32 of every entry is checked before it is loaded.
    * ``ShardedSnapshots`` (FSDP): a folder per save, each rank writing its
      own shards with torch.distributed.checkpoint (DCP), complete once rank
      0 wrote its meta file; no rank ever holds the whole state.

    DCP for both would serve DDP too (it reshards for any world size), but
    a DDP process would pay DCP's import (0.5 s of every start, with DTensor
    and sympy) to write what one rank holds whole anyway, and the snapshot
    would become a folder of shards where a plain file is what a DDP user
    opens, copies and loads elsewhere. Both formats keep every guarantee:
    bitwise resume, another world size mid-epoch, damaged and foreign
    snapshots refused in one line.

    ``every_s``: --snapshot_every_s, rank 0's clock; ``every_steps``:
    --snapshot_every_steps, in optimizer steps; ``timeout_s``: --pg_timeout_s for the background
    saves' own groups (FSDP); ``write_timeout_s``: --startup_timeout_s, how
    long the ranks wait for a snapshot's write together (``wait``).
    Collective: every rank makes one (a gloo group for that wait; FSDP's
    background saves make two more) and calls ``find``, ``load``, ``save``
    and ``due`` alike.
    """

    def __init__(self, path: str, sharded: bool, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 config: dict, parts: Mapping[str, Part], *, asynchronous: bool = True, every_s: float = 0,
                 every_steps: int = 0, timeout_s: float = 600, write_timeout_s: float = 1800) -> None:
        self.path, self.sharded, self.every_steps = path, sharded, every_steps
        self.model, self.optimizer = model, optimizer
        self.rank = dist.get_rank()
        self.parts = dict(parts)
        # The world size goes in a file's config (a resumed run compares it with its own);
        # a sharded snapshot's meta file holds it beside the config.
        self.config = dict(config, world_size=None if sharded else dist.get_world_size())
        self.store = ShardedSnapshots(path, asynchronous, timeout_s) if sharded else \
            SnapshotBucket(path) if in_bucket(path) else SnapshotFile(path)
        self.writer = SnapshotWriter(asynchronous)
        # The ranks leave a snapshot's write together, under the write's own time-out: else those
        # that do not write (DDP: all but rank 0) or finish first would wait for the writer in their
        # next collective, whose --pg_timeout_s would call a slow disk a hang.
        self.together = gloo_group(timedelta(seconds=write_timeout_s), "snapshot write") \
            if dist.get_world_size() > 1 else None
        self.clock = SnapshotClock(every_s)
        self.found: Optional[str] = None  # the snapshot found by ``find``
        self._snapshot: Optional[dict] = None  # what ``find`` read of it, for ``load``
        self.saved_at = ""  # the intact snapshot and its position, for a failed write's line; '' for none

    def find(self) -> Found:
        """Collective: the snapshot to resume from, read and checked, not yet
        loaded (``load``): ``Found`` with its path, the epochs it holds and
        where it stands; ``Found()`` where there is none. Raises ConfigError
        (one line, the snapshot kept) for a damaged snapshot or another
        run's (``file.check_same_run``), or one seen on some nodes only."""
        if other_format(self.path, self.sharded):  # the other strategy's: finished, or refused by the Trainer
            return self._find_other_format()
        self.found = self.store.latest()
        if self.found is None:
            return Found()
        self._snapshot = self.store.read(self.found, self.config)
        epochs_run = self._snapshot["epochs_run"]
        return Found(self.found, epochs_run, position(epochs_run, self._snapshot["steps_run"]),
                     samples=held_samples(self._snapshot))

    def _find_other_format(self) -> Found:
        """``find`` where ``path`` holds the other format's snapshot: it read
        and checked as that format's store reads it (a folder's newest
        complete save), for the Trainer to see whether it is finished;
        ``Found.mismatch`` set. Raises ConfigError as ``read_snapshot`` does."""
        mismatch = format_mismatch(self.path, self.sharded)
        if self.sharded:
            self.found = self.path
            snapshot = read_snapshot(self.path, dict(self.config, world_size=dist.get_world_size()))
        else:
            self.found = newest_complete(self.path)
            snapshot = read_snapshot(os.path.join(self.found, ShardedSnapshots.META), dict(self.config, world_size=None))
        return Found(self.found, snapshot["epochs_run"], position(snapshot["epochs_run"], snapshot["steps_run"]),
                     held_samples(snapshot), mismatch=mismatch)

    def load(self) -> Found:
        """Collective: load the snapshot ``find`` found: the weights and the
        optimizer's state (in place; under FSDP each rank its own shards),
        then each part in order. Returns it as found, its position now in
        this run's steps (the "progress" part's) and the resume line's note
        (``resume_note`` of the format: another world size).

        Raises ConfigError (one line, the snapshot kept) for a snapshot
        holding keys that no part of this run reads, or one a part refuses
        (a finished --max_steps run asked to go on to another:
        ``Recipe.load_state_dict``)."""
        snapshot = self._snapshot
        where = position(snapshot["epochs_run"], snapshot["steps_run"])
        known = set(OWN_KEYS).union(*(part.KEYS for part in self.parts.values()))
        unknown = sorted(set(snapshot) - known)
        if unknown:
            raise ConfigError(f"snapshot {self.found} holds {', '.join(unknown)}, which this train.py does not "
                              f"read: a snapshot of another program or version; {START_AFRESH}")
        self.store.load(self.found, snapshot, self.model, self.optimizer)
        for part in self.parts.values():
            part.load_state_dict(snapshot)
        self.saved_at = f"{self.found} ({where})"
        note_snapshot(self.found, position_tag(snapshot["epochs_run"], snapshot["steps_run"]))
        progress = self.parts.get("progress")
        if progress is None:
            return Found(self.found, snapshot["epochs_run"], where, held_samples(snapshot))
        # Where this run goes on, in its own steps (another world size counts others), and what changed.
        return Found(self.found, snapshot["epochs_run"], progress.position(), held_samples(snapshot),
                     note=self.store.resume_note(snapshot, progress, self.config))

    def load_model(self) -> None:
        """Collective under FSDP: the weights alone of the snapshot ``find``
        found (a finished run's, to sample from), checked as ``load`` checks
        them, into the model; one of the other format as --init_from reads
        it (``weights.load_initial_weights``)."""
        if other_format(self.path, self.sharded):
            load_initial_weights(self.model, self.path, self.sharded)
        else:
            self.store.load_model(self.found, self.model)

    def request(self) -> bool:
        """Rank 0's clock: whether to ask for a snapshot at this optimizer step
        (--snapshot_every_s), for ``StopSignal.poll``'s ``request``, whose
        all-reduce brings every rank the same answer one step later
        (``SnapshotClock``). False on every other rank."""
        return self.rank == 0 and self.clock.ask()

    def due(self, step: int, requested: bool) -> bool:
        """Collective in effect: whether a snapshot is due after optimizer step
        ``step`` of this epoch (``Progress.epoch_step``, 1-based), the same
        answer on every rank: ``requested`` (the poll's answer to rank 0's
        ``request``) unless a snapshot was taken since it was sent, or every
        --snapshot_every_steps optimizer steps of the epoch. Call it on every
        rank after every poll."""
        due = self.clock.due(requested)
        return due or bool(self.every_steps) and step % self.every_steps == 0

    def save(self) -> None:
        """Collective: a snapshot of the model, the optimizer and every part
        (their ``state_dict``s, each its own keys), with the run's config.
        The write in flight, if any, is waited for first (``wait``: at most
        one at a time; a failed one ends the run here). In the background
        unless synchronous: the state is copied (to CPU memory) before this
        returns, so training may go on changing it. Raises RunFailed (one
        line) when the system refuses the write (a full disk): the previous
        snapshot is the intact one."""
        self.wait(together=True)
        self.clock.saved()  # --snapshot_every_s counts from here
        state = {"config": self.config}
        for name, part in self.parts.items():
            piece = part.state_dict()
            if set(piece) - set(part.KEYS) or set(piece) & set(state):
                raise RuntimeError(f"the {name} part's state {sorted(piece)} is not its KEYS {part.KEYS}, or "
                                   f"holds a key another part gave")
            state.update(piece)
        try:
            write, where = self.store.save(self.model, self.optimizer, state, self.writer.asynchronous)
            if write is not None:  # a file: rank 0's alone
                self.writer.start(write, f"{where} ({position(state['epochs_run'], state['steps_run'])})")
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            self._fail(exc)
        if not self.writer.asynchronous:
            self.wait(together=True)

    def wait(self, together: bool = False) -> None:
        """Wait for the write in flight, if any: the snapshot it wrote is the
        intact one from now on. ``together``: collective, every rank then
        waits for the others too (a barrier of up to ``write_timeout_s``), so
        that no rank goes on to a collective the writers are late for; not on
        an error path, where a rank may be anywhere. Raises what the write
        raised: RunFailed (one line) for a write the system refused, naming
        the snapshot that stays intact."""
        done = None
        try:
            done = self.writer.wait()
        except BaseException as exc:
            self._fail(exc)
        if done:
            self.saved_at = done
        if together and self.together is not None:
            dist.barrier(group=self.together)

    def close(self) -> None:
        """The run's end: the last write waited for (``wait``), then what the
        format kept between saves freed. (The claim on the path is the
        process's: ``ending.end_process`` gives it back.)"""
        self.wait()
        self.store.close()

    def _fail(self, exc: BaseException) -> None:
        """Raise ``exc``, as the one line of ``save_failure`` when the system refused the write."""
        failure = save_failure(exc, self.path, self.saved_at)
        if failure:
            raise failure from exc
        raise exc
