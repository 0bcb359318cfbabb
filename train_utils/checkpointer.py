"""The Checkpointer: a snapshot's whole life, from the claim on its path to
the last write, behind five calls (``claim``, ``load``, ``save``, ``wait``,
``close``) and the clock that says when the next one is due.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from common import ConfigError
from .checks import output_path_error
from .claims import claim_snapshot, release_claim
from .output import first_error
from .resume import position
from .save_errors import save_failure
from .sharded_snapshots import ShardedSnapshots
from .snapshot_writer import SnapshotClock, SnapshotWriter
from .snapshots import SnapshotFile, remove_stale_temporary_files


class Checkpointer:
    """The run's snapshot at ``path`` (--snapshot_path): claimed for this run,
    the one to resume from found and loaded, new ones written one at a time
    (in the background unless ``asynchronous`` is False), and the one line
    that names the intact snapshot when the system refuses a write.

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
    --snapshot_every_steps; ``timeout_s``: --pg_timeout_s for the background
    saves' own groups (FSDP). The run's flags come with ``load``: they are
    compared with a snapshot's before it is loaded, and saved in every one.

    Collective: every rank makes one (FSDP's background saves make two gloo
    groups) and calls ``claim``, ``load``, ``save`` and ``due`` alike. Make
    and ``claim`` it as soon as the process group exists: a second run of
    the same command is refused before it builds its task (a download, say).
    """

    def __init__(self, path: str, sharded: bool, *, asynchronous: bool = True,
                 every_s: float = 0, every_steps: int = 0, timeout_s: float = 600) -> None:
        self.path, self.sharded, self.every_steps = path, sharded, every_steps
        self.rank = dist.get_rank()
        self.config: dict = {}  # the run's flags, from ``load``
        self.store = ShardedSnapshots(path, asynchronous, timeout_s) if sharded else SnapshotFile(path)
        self.writer = SnapshotWriter(asynchronous)
        self.clock = SnapshotClock(every_s)
        self.found: Optional[str] = None  # the snapshot loaded (or found finished), for the resume line
        self.saved_at = ""  # the intact snapshot and its position, for a failed write's line; '' for none

    def claim(self) -> None:
        """Collective, before training: --snapshot_path can be written (every
        rank checks a sharded one, rank 0 a file: ``checks.output_path_error``),
        this run takes its claim (``claims.claim_snapshot``: one live run per
        snapshot), and rank 0 removes the temporary files a killed writer left
        beside it. Raises ConfigError (one line, on every rank) when the path
        cannot be written or another live run holds it."""
        writes = self.sharded or self.rank == 0
        error = first_error(output_path_error("snapshot_path", self.path, folder=self.sharded) if writes else "")
        if error:
            raise ConfigError(error)
        claim_snapshot(self.path)
        if self.rank == 0:  # claimed: a temporary file beside the snapshot is a killed writer's, on any host
            remove_stale_temporary_files(self.path)

    def load(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: dict) -> Optional[dict]:
        """Collective: load the snapshot to resume from, if there is one, into
        ``model`` and ``optimizer`` (in place; under FSDP each rank its own
        shards); return the rest of it: ``epochs_run``, ``steps_run``,
        ``epoch_samples``, ``epoch_totals``, ``rng_states``, ``lr_schedule``,
        ``loss_scaler``, ``wandb_run_id``, ``config`` (and ``world_size`` of a
        sharded one); None when there is none (a fresh start). ``config``:
        this run's flags (``vars(args)``), compared with the snapshot's
        (``snapshots.read_snapshot``: another run's is refused) and saved in
        every snapshot from now on.

        Raises ConfigError (one line, the snapshot kept) for a damaged
        snapshot or another run's, or one seen on some nodes only;
        NothingToTrain when it already holds every epoch (``load_model``
        then loads its weights alone)."""
        # The world size goes in a file's config (a resumed run compares it with its own);
        # a sharded snapshot's meta file holds it beside the config.
        self.config = dict(config, world_size=None if self.sharded else dist.get_world_size())
        self.found = self.store.latest()
        if self.found is None:
            return None
        state = self.store.load(self.found, model, optimizer, self.config)
        self.saved_at = f"{self.found} ({position(state['epochs_run'], state['steps_run'])})"
        return state

    def load_model(self, model: torch.nn.Module) -> None:
        """Collective under FSDP: the weights alone of the snapshot ``load``
        found (a finished run's, to sample from), checked as ``load`` checks
        them, into ``model``."""
        self.store.load_model(self.found, model)

    def request(self) -> bool:
        """Rank 0's clock: whether to ask for a snapshot at this optimizer step
        (--snapshot_every_s), for ``StopSignal.poll``'s ``request``, whose
        all-reduce brings every rank the same answer one step later
        (``SnapshotClock``). False on every other rank."""
        return self.rank == 0 and self.clock.ask()

    def due(self, steps_run: int, requested: bool) -> bool:
        """Collective in effect: whether a snapshot is due after this optimizer
        step, the same answer on every rank: ``requested`` (the poll's answer
        to rank 0's ``request``) unless a snapshot was taken since it was sent,
        or every --snapshot_every_steps micro-batches (``steps_run``, this
        epoch's). Call it on every rank after every poll."""
        due = self.clock.due(requested)
        return due or bool(self.every_steps) and steps_run % self.every_steps == 0

    def save(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        """Collective: a snapshot of ``model``, ``optimizer`` and ``state`` (the
        position, RNG states, recipe and W&B run: what ``load`` returns, less
        the config, which is added here). The write in flight, if any, is
        waited for first (``wait``: at most one at a time; a failed one ends
        the run here). In the background unless synchronous: the state is
        copied (to CPU memory) before this returns, so training may go on
        changing it. Raises RunFailed (one line) when the system refuses the
        write (a full disk): the previous snapshot is the intact one."""
        self.wait()
        self.clock.saved()  # --snapshot_every_s counts from here
        state = dict(state, config=self.config)
        try:
            write, where = self.store.save(model, optimizer, state, self.writer.asynchronous)
            if write is not None:  # a file: rank 0's alone
                self.writer.start(write, f"{where} ({position(state['epochs_run'], state['steps_run'])})")
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            self._fail(exc)
        if not self.writer.asynchronous:
            self.wait()

    def wait(self) -> None:
        """Wait for the write in flight, if any: the snapshot it wrote is the
        intact one from now on. Raises what it raised: RunFailed (one line)
        for a write the system refused, naming the snapshot that stays intact."""
        done = None
        try:
            done = self.writer.wait()
        except BaseException as exc:
            self._fail(exc)
        if done:
            self.saved_at = done

    def close(self) -> None:
        """The run's end: the last write waited for (``wait``), then the claim
        given back (``claims.release_claim``; outside Slurm the next run may
        take the snapshot, on any host), and what the format kept between
        saves freed."""
        self.wait()
        self.store.close()
        release_claim()

    def _fail(self, exc: BaseException) -> None:
        """Raise ``exc``, as the one line of ``save_failure`` when the system refused the write."""
        failure = save_failure(exc, self.path, self.saved_at)
        if failure:
            raise failure from exc
        raise exc
