"""Sharded snapshots (FSDP): a folder per save under --snapshot_path, each
holding every rank's shards (torch.distributed.checkpoint, DCP) and a small
file written last, whose presence means the folder is complete;
``ShardedSnapshots``, the Checkpointer's sharded format.
"""

from __future__ import annotations

import io
import os
import shutil
import warnings
from concurrent.futures import Future
from datetime import timedelta
from typing import Callable, Optional

import torch
import torch.distributed as dist

from common import ConfigError
from ..distributed import broadcast_buffers, gloo_group, note_snapshot
from ..output import first_error, print_line
from .position import position_tag, tag_position as _position
from . import bucket
from .file import archive_damage, atomic_save, check_same_run, load_snapshot, read_snapshot, snapshot_on_every_node


class ShardedSnapshots:
    """The snapshot folders under ``root`` (--snapshot_path): finding the
    newest complete one, loading it, saving a new one and completing it.

    A folder is named by its position (``position_tag``): ``epoch-2`` after
    epoch 2, ``epoch-3-step-40`` after step 40 of epoch 3. It is complete once
    it holds ``META`` (epochs_run, steps_run, epoch_totals, rng_states,
    config, world_size), which rank 0 writes after every rank wrote its
    shards. One job per ``root``, as ``atomic_save`` assumes one writer per path.

    ``asynchronous``: saves are written in the background (DCP's
    ``async_save``), their collectives on two CPU (gloo) groups of their own
    (model, optimizer), made here (collective), not the training's: a rank
    gone mid-save fails them after ``timeout_s`` seconds (--pg_timeout_s),
    not gloo's 30 minutes; the shards are staged in CPU buffers kept from
    one save to the next (``DcpStaging``). ``latest``, ``read``, ``load``,
    ``load_model``, ``resume_note``, ``save`` and ``close`` are the calls
    ``checkpointer.Checkpointer`` makes of either format.
    """

    META = "meta.pt"

    def __init__(self, root: str, asynchronous: bool = False, timeout_s: float = 600) -> None:
        self.root = root
        timeout = timedelta(seconds=timeout_s)
        self.groups = (gloo_group(timeout, "snapshot save"), gloo_group(timeout, "snapshot save")) \
            if asynchronous else (None, None)
        self.staging: Optional[DcpStaging] = None  # made at the first background save, by the state's device
        if bucket.in_bucket(root):  # DCP writes through fsspec (s3fs), whose files have no fsync: the manifest,
            # written once every object is stored, is what commits a save there
            warnings.filterwarnings("ignore", message="fsync not supported for this stream")
            bucket.configure_fsspec()

    def folder(self, tag: str) -> str:
        """The folder of a new snapshot at position ``tag`` ("epoch 3 step 40")."""
        return os.path.join(self.root, tag.replace(" ", "-"))

    def latest(self) -> Optional[str]:
        """Collective: the newest complete folder as rank 0 sees it, returned on
        every rank; None when there is none (start afresh).

        Newest: the furthest position of the folder names. Rank 0 also
        deletes incomplete folders, what a save killed midway leaves; other
        entries of ``root`` are left alone. Raises ConfigError on every rank
        when ``root`` is a file (another script's snapshot?), or when the
        folder is missing on some nodes (``snapshot_on_every_node``).
        """
        if bucket.in_bucket(self.root):
            return self._latest_in_bucket()
        found, error = None, ""
        if dist.get_rank() == 0:
            if os.path.isfile(self.root):
                error = (f"cannot write --snapshot_path {self.root}: it is a file, where a "
                         f"snapshot folder is expected; pass another --snapshot_path")
            elif os.path.isdir(self.root):
                for _name, folder, _where in self._folders():
                    if not os.path.isfile(os.path.join(folder, self.META)):
                        shutil.rmtree(folder, ignore_errors=True)
                found = newest_complete(self.root)
        message = [found, error]
        dist.broadcast_object_list(message, src=0)
        if message[1]:
            raise ConfigError(message[1])
        if message[0] and snapshot_on_every_node(os.path.join(message[0], self.META)):
            return message[0]
        return None

    def _latest_in_bucket(self) -> Optional[str]:
        """Collective ``latest`` for a ``root`` in a bucket: the newest
        committed save (``bucket.newest_generation``: its manifest written,
        its objects all there at the sizes it gives) as rank 0 lists it, its
        s3:// folder on every rank; None for none. What torn saves left, the
        claim holder removed (``bucket.remove_uncommitted``). Raises
        ConfigError (one line, on every rank) when the store cannot be read,
        or it holds a DDP snapshot."""
        message: list = [None, ""]
        if dist.get_rank() == 0:
            try:
                generation = bucket.newest_generation(self.root)
            except bucket.BucketError as exc:
                message[1] = f"cannot read snapshot {self.root}: {exc.bucket_cause}"
            else:
                if generation is not None and generation.manifest.get("format") != "sharded":
                    message[1] = (f"--snapshot_path {self.root} holds a DDP snapshot (one object), where --strategy "
                                  f"fsdp and hsdp keep sharded saves: resume it with --strategy ddp, or pass "
                                  f"another --snapshot_path")
                elif generation is not None:
                    message[0] = f"{bucket.SCHEME}{bucket.split_path(self.root)[0]}/{generation.prefix}"
        dist.broadcast_object_list(message, src=0)
        if message[1]:
            raise ConfigError(message[1])
        return message[0]

    def read(self, folder: str, config: dict) -> dict:
        """Collective: ``read_snapshot`` of ``folder``'s META (the weights are
        in its DCP shards), then every rank checks its share of the shards
        (``shard_damage``). ``config["world_size"]`` is None for a sharded
        snapshot, so any world size matches: DCP reshards, and inside an epoch
        the rest of its permutation is split over this run's ranks
        (``Progress.load_state_dict``). Raises ConfigError as ``read_snapshot``
        does, and for damaged shards."""
        if bucket.in_bucket(folder):  # read into memory, checked as a file is
            snapshot = load_snapshot(bucket.read_object(self.root, f"{folder}/{self.META}"), folder)
            check_same_run(snapshot, folder, config)
        else:
            snapshot = read_snapshot(os.path.join(folder, self.META), config)
        _check_shards(folder)
        return snapshot

    def load(self, folder: str, snapshot: dict, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Collective: DCP loads the shards of snapshot ``folder`` (``snapshot``:
        its META, ``read``'s) into this model's and optimizer's own sharded
        state dicts, in place: each rank reads its shards' pieces from
        whichever files hold them."""
        import torch.distributed.checkpoint as dcp  # imported where FSDP uses it: see distributed.shard_model
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_state, optimizer_state = get_state_dict(model, optimizer)
        dcp.load(model_state, checkpoint_id=os.path.join(folder, "model"))
        dcp.load(optimizer_state, checkpoint_id=os.path.join(folder, "optimizer"))
        set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)

    @staticmethod
    def resume_note(snapshot: dict, progress, config: dict) -> str:
        """The resume line's end: '' at the world size and mesh that saved
        ``snapshot``; else that DCP resharded it exactly, from that mesh to
        this run's (``config``; ``mesh_name``), and at another world size what
        changes with it (``Progress.resize_note``)."""
        world_size = dist.get_world_size()
        saved_world_size = progress.saved_world_size or world_size
        meshes = (mesh_name(snapshot.get("config", {}), saved_world_size), mesh_name(config, world_size))
        if saved_world_size != world_size:
            return progress.resize_note(config, meshes)
        if meshes[0] != meshes[1]:
            return f" (saved as {meshes[0]}, resharded as {meshes[1]}: weights and optimizer state exact)"
        return ""

    def load_model(self, folder: str, model: torch.nn.Module) -> None:
        """Collective: the model weights alone of the snapshot ``folder``, its
        shards checked first (``shard_damage``)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

        _check_shards(folder)
        state = get_model_state_dict(model)
        dcp.load(state, checkpoint_id=os.path.join(folder, "model"))
        set_model_state_dict(model, state)

    def save(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict,
             asynchronous: bool) -> tuple[Callable[[], None], str]:
        """Collective: a new folder of every rank's shards of ``model`` and
        ``optimizer``; returns (the function that completes it, the folder).

        Each rank writes its own shards, DCP's rank 0 the index (.metadata); no
        rank ever holds the full state. A new folder each time: DCP overwrites
        files in place. ``asynchronous``: DCP's ``async_save`` copies the shards
        to CPU memory here and writes them from a thread of its own, on this
        object's CPU groups; else they are written here. The returned function
        waits for the shards (or raises DCP's CheckpointException, on every
        rank), then on rank 0 writes ``state`` with the world size as the META
        file (``commit``) and prints the save line: the Checkpointer runs it in
        its writer's thread."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        broadcast_buffers(model)  # FSDP never syncs BatchNorm statistics: save rank 0's
        tag = position_tag(state["epochs_run"], state["steps_run"])
        folder = self.folder(tag)
        parts = zip(get_state_dict(model, optimizer), ("model", "optimizer"), self.groups)
        if asynchronous:
            if self.staging is None:
                self.staging = DcpStaging(next(model.parameters()).device)
            pending = [self.staging.save(part, os.path.join(folder, name), group) for part, name, group in parts]
        else:  # plain state_dict keys
            pending = [dcp.save(part, checkpoint_id=os.path.join(folder, name)) for part, name, _ in parts]
        meta = dict(state, world_size=dist.get_world_size())
        rank = dist.get_rank()

        def complete() -> None:
            for save in pending:
                dcp_result(save)  # every rank's shards are written (or it raises)
            if rank == 0:
                self.commit(meta, folder)  # complete now
                note_snapshot(folder, tag)
                print_line(f"{tag} | snapshot saved at {folder}")

        return complete, folder

    def close(self) -> None:
        """The run's end, its last save written: the staging buffers freed."""
        if self.staging is not None:
            self.staging.close()
            self.staging = None

    def commit(self, meta: dict, folder: str) -> None:
        """On rank 0, once every rank's shards are in ``folder``: write ``meta``
        there last (temp file + rename), which completes the snapshot; then
        delete every other snapshot folder, the previous one included (until
        now, it was the one a restart resumed from). In a bucket: the same,
        the manifest written last (``bucket.commit_sharded``)."""
        if bucket.in_bucket(folder):
            bucket.commit_sharded(self.root, folder, meta, position_tag(meta["epochs_run"], meta["steps_run"]),
                                  self.META)
            return
        atomic_save(meta, os.path.join(folder, self.META))
        for _name, other, _where in self._folders():
            if os.path.abspath(other) != os.path.abspath(folder):
                shutil.rmtree(other, ignore_errors=True)

    def _folders(self):
        """(name, path, (epochs_run, steps_run)) of each snapshot folder under ``root``."""
        return snapshot_folders(self.root)


def snapshot_folders(root: str):
    """(name, path, (epochs_run, steps_run)) of each snapshot folder under ``root``
    (named by ``position_tag``), complete or not."""
    for name in os.listdir(root):
        folder, position = os.path.join(root, name), _position(name)
        if position is not None and os.path.isdir(folder):
            yield name, folder, position


def newest_complete(root: str) -> Optional[str]:
    """The furthest complete snapshot folder under ``root`` (one holding
    ``ShardedSnapshots.META``), None when there is none or ``root`` is no
    folder. Reads only."""
    if not os.path.isdir(root):
        return None
    complete = [(position, folder) for _name, folder, position in snapshot_folders(root)
                if os.path.isfile(os.path.join(folder, ShardedSnapshots.META))]
    return max(complete)[1] if complete else None


class DcpStaging:
    """Background saves of sharded state (DCP's ``async_save``) staged in CPU
    buffers kept from one save to the next, for shards on ``device``.

    DCP copies every tensor to CPU memory before ``async_save`` returns, so
    that training may go on changing the originals. By default it makes new
    CPU tensors each time, pageable, each GPU copy waiting for the GPU. Here
    one stager serves every save of the run (DCP's ``DefaultStager``, torch
    2.9 and newer): its buffers are made at the first save and reused (each
    kept per storage of the original tensors, which FSDP keeps from step to
    step), on a GPU page-locked (pinned), the copies queued ``non_blocking``
    and waited for once, together, before ``save`` returns; on a CPU the
    same buffers, plain. An older torch keeps them in the file writer
    instead (``FileSystemWriter(cache_staged_state_dict=True)``: pinned, one
    writer per part, pointed at each save's folder in turn), on a GPU only
    (it pins unconditionally). The kit's own file snapshots stage the same
    way (``snapshot_writer.CpuStaging``).

    At most one save may use the buffers at a time: the Checkpointer waits
    for the previous write before it stages the next. ``close`` frees them.
    """

    def __init__(self, device: torch.device) -> None:
        try:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        except ImportError:  # torch before 2.9
            DefaultStager = None
        gpu = device.type == "cuda"
        self.stager = DefaultStager(StagingOptions(use_pinned_memory=gpu, use_shared_memory=False,
                                                   use_async_staging=False, use_non_blocking_copy=gpu)) \
            if DefaultStager is not None else None
        self.writers: Optional[dict] = {} if DefaultStager is None and gpu else None

    def save(self, state: dict, folder: str, group: dist.ProcessGroup) -> Future:
        """Collective: ``torch.distributed.checkpoint.async_save`` of ``state`` (a
        state dict, DTensor shards included) into ``folder``, staged (see the
        class) before it returns; the files are then written by a thread of
        DCP's, whose collectives run on ``group``, a CPU (gloo) group that
        nothing else uses while the save is in flight. Returns the write's
        future (``dcp_result`` waits for it; it raises DCP's
        CheckpointException on every rank when one rank's write failed)."""
        import torch.distributed.checkpoint as dcp  # only FSDP needs DCP

        if self.stager is not None:
            response = dcp.async_save(state, checkpoint_id=folder, process_group=group, async_stager=self.stager)
        elif self.writers is not None:  # torch before 2.9 on a GPU: the writer's own kept buffers
            part = os.path.basename(folder)
            if part not in self.writers:
                self.writers[part] = dcp.FileSystemWriter(folder, cache_staged_state_dict=True)
            response = dcp.async_save(state, checkpoint_id=folder, process_group=group,
                                      storage_writer=self.writers[part])
        else:
            response = dcp.async_save(state, checkpoint_id=folder, process_group=group)
        return getattr(response, "upload_completion", response)  # an AsyncSaveResponse when staging is async

    def close(self) -> None:
        """Free the buffers (after the last save's write)."""
        if self.stager is not None:
            self.stager.close()
        self.stager, self.writers = None, None


def dcp_result(save: object) -> object:
    """What a DCP save gave: ``DcpStaging.save``'s future, waited for (its
    exception raised), or ``dcp.save``'s result as it is."""
    return save.result() if isinstance(save, Future) else save


def _check_shards(folder: str) -> None:
    """Collective: every rank checks its share of the shards of snapshot
    ``folder`` (``shard_damage``); raises ConfigError (one line, on every
    rank) naming the first damage any rank found."""
    damage = first_error(shard_damage(folder, dist.get_rank(), dist.get_world_size()))
    if damage:
        raise ConfigError(f"cannot read snapshot {folder} (a damaged shard: {damage}); move it away "
                          f"to start afresh (or put back a good copy), or pass another --snapshot_path")


def shard_damage(folder: str, rank: int = 0, ranks: int = 1) -> str:
    """'' when the DCP shard files of snapshot ``folder`` pass their integrity
    check, else which file and item fails, in a few words.

    DCP keeps no checksum of its own; but its file writer stores each tensor
    as a ``torch.save`` zip archive at the offset and length that the
    ``.metadata`` index records, and each holds the CRC-32 of its data. Each
    such item (every ``ranks``-th, from the ``rank``-th, so that ranks share
    the reading) is checked with ``archive_damage``; items in another form
    (none in torch 2.8-2.15) are not checked. A damaged ``.metadata`` is
    reported too. Reads the files; never writes them.
    """
    if bucket.in_bucket(folder):  # read through fsspec (s3fs), as DCP reads a save in a bucket
        import fsspec
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader as Reader
        opener = fsspec.open
    else:
        from torch.distributed.checkpoint import FileSystemReader as Reader  # only FSDP needs DCP
        opener = open
    for part in ("model", "optimizer"):
        path = os.path.join(folder, part)
        try:
            items = sorted(Reader(path).read_metadata().storage_data.items(), key=str)
        except Exception as exc:
            return f"{part}/.metadata cannot be read: {type(exc).__name__}"
        for index, info in items[rank::ranks]:
            name = f"{part}/{getattr(info, 'relative_path', '?')} item {getattr(index, 'fqn', index)}"
            if getattr(info, "transform_descriptors", None):
                continue  # stored transformed (compressed, say): no zip archive to check
            try:
                with opener(os.path.join(path, info.relative_path), "rb") as f:
                    f.seek(info.offset)
                    data = f.read(info.length)
            except (OSError, AttributeError) as exc:
                return f"{name} cannot be read: {type(exc).__name__}"
            if len(data) < info.length:
                return f"{name} is truncated"
            if data.startswith(b"PK\x03\x04"):  # a zip archive's first local header
                damage = archive_damage(io.BytesIO(data))
                if damage:
                    return f"{name}: {damage.removeprefix('damaged: ')}"
    return ""


def mesh_name(config: dict, world_size: int) -> str:
    """How a run of ``config`` on ``world_size`` ranks shards its model:
    "FSDP", or "HSDP replicate R x shard S" (--strategy hsdp, ``distributed.fsdp.hsdp_mesh``)."""
    shard_size = config.get("shard_size") or 0
    if config.get("strategy") != "hsdp" or not shard_size:
        return "FSDP"
    return f"HSDP replicate {world_size // shard_size} x shard {shard_size}"
