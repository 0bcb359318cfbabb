"""Snapshot files (DDP): reading one with the "is it this run's?" checks,
seeing one from every node, and writing one so that a crash never tears it;
``SnapshotFile``, the Checkpointer's file format.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pickle
import re
import socket
import tempfile
import zipfile
from types import MappingProxyType
from typing import Callable, Optional

import torch
import torch.distributed as dist

from common import ConfigError
from ..config import must_match
from ..distributed import note_snapshot
from ..output import print_line
from .claims import process_lives
from .position import position_tag
from .writer import CpuStaging


START_AFRESH = "delete it or pass another --snapshot_path to start afresh"
# What snapshots written before --optimizer and --decay_params existed trained with.
BEFORE_RECIPES = MappingProxyType({"optimizer": "sgd", "decay_params": "all"})


def archive_damage(path) -> str:
    """'' when ``path`` (a file name, or a binary file object) is a whole zip
    archive, the format ``torch.save`` writes, whose every entry matches the
    CRC-32 stored for it; else what is wrong, in a few words.

    The CRCs cover every byte of a snapshot's entries, its tensors' data
    included: a file damaged on disk or in a copy is caught here, where
    ``torch.load`` would load the damaged tensors without a word. Reads the
    whole file once; never writes it.
    """
    if not zipfile.is_zipfile(path):
        return "not a zip archive as torch.save writes: truncated, or another kind of file"
    try:
        with zipfile.ZipFile(path) as archive:
            damaged = archive.testzip()  # the first entry whose data fails its CRC-32
    except Exception as exc:  # a damaged local header: BadZipFile, or zlib/EOF/OS errors
        return f"a damaged zip archive: {type(exc).__name__}: {_first_line(str(exc))}"
    if damaged:
        return f"damaged: its entry {damaged} fails its CRC-32 check"
    return ""


def _first_line(text: str) -> str:
    """The first non-empty line of ``text`` that is not torch's advice about
    ``weights_only`` (retrying with weights_only=False would run whatever a
    crafted file holds), cut to 160 characters; 'no detail' if none."""
    for line in text.splitlines():
        line = line.strip()
        if line and "weights_only" not in line and "Weights only" not in line and \
                not line.startswith(("Please file an issue", "Check the documentation")):
            return line[:160]
    return "no detail"


def read_snapshot(path: str, config: dict) -> dict:
    """Load a snapshot on the CPU for the run described by ``config``.

    First its integrity (``archive_damage``: the zip archive's CRC-32 of each
    entry), then ``torch.load`` with ``weights_only=True``, which unpickles
    tensors and plain containers only, never arbitrary objects, so a crafted
    file cannot run code here. Raises ConfigError (one line, the file left as
    it is) when the file is damaged or cannot be read, when it comes from
    another run (``check_same_run``), or when it holds more epochs than
    ``config["total_epochs"]``.

    Another world size (``config["world_size"]``) resumes it: model and
    optimizer state are the same on every rank, and the rest of the epoch's
    permutation is split over the new ranks (``Progress.load_state_dict``;
    ``resize_note`` says what changes). The same world size resumes exactly.
    """
    snapshot = _load(path)
    check_same_run(snapshot, path, config)
    return snapshot


def _load(path: str) -> dict:
    """The snapshot file ``path``, read with torch's weights-only unpickler;
    ConfigError (one line) when it is damaged or holds more than tensors and
    plain values (``load_snapshot``)."""
    return load_snapshot(path, path)


def load_snapshot(source, path: str) -> dict:
    """The snapshot in ``source`` (a file name, or a seekable binary file
    object: a bucket's object read into memory) named ``path`` in messages:
    its zip archive's CRC-32s checked (``archive_damage``), then read with
    torch's weights-only unpickler. Raises ConfigError (one line) when it is
    damaged or holds more than tensors and plain values."""
    unreadable = ("; move it away to start afresh (or put back a good copy), or pass another "
                  "--snapshot_path")
    damage = archive_damage(source)
    if damage:
        raise ConfigError(f"cannot read snapshot {path} ({damage}){unreadable}")
    if hasattr(source, "seek"):
        source.seek(0)
    try:
        snapshot = torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:  # weights_only refused an object, or not a pickle
        raise ConfigError(f"cannot read snapshot {path} (torch's weights-only unpickler, which "
                          f"runs no code, refused it: {_first_line(str(exc))}){unreadable}") from None
    except Exception as exc:
        raise ConfigError(f"cannot read snapshot {path} ({type(exc).__name__}: "
                          f"{_first_line(str(exc))}){unreadable}") from None
    return snapshot


def check_same_run(snapshot: dict, path: str, config: dict) -> None:
    """ConfigError unless ``snapshot`` (the snapshot at ``path``) continues
    the run of ``config`` (``RunConfig.as_dict``): the flags that must match
    (``config.must_match``; the global batch instead of --grad_accum_steps
    under --global_batch_size) and the task's identity, whole, are the
    snapshot's, and it holds at most --total_epochs epochs. A snapshot saved
    before the task identity was stored kept its sizes among its flags:
    those the identity names are compared. Not compared: what may change
    between runs of the same training, like paths (a node-local --data_dir),
    the schedule (--total_epochs, --lr lowered after a divergence:
    ``Recipe.load_state_dict``), --num_workers, --compile and --amp. The world size
    may change, mid-epoch too (``loop.Progress.resize_note``)."""
    saved, config = {**BEFORE_RECIPES, **snapshot["config"]}, {**BEFORE_RECIPES, **config}
    # --global_batch_size sets the accumulation per world size: the global batch must match instead.
    keys = [key for key in must_match() if key != "grad_accum_steps" or not config.get("global_batch_size")]
    changed = [f"{key} {saved.get(key)} -> {config.get(key)}"
               for key in keys + ["global_batch_size"] if saved.get(key) != config.get(key)]
    identity = config.get("task_identity", {})
    if "task_identity" in saved:
        saved_identity, keys = saved["task_identity"], dict.fromkeys([*saved["task_identity"], *identity])
    else:  # an older snapshot: the sizes it kept among its flags
        saved_identity, keys = saved, [key for key in identity if key in saved]
    changed += [f"{key} {saved_identity.get(key)} -> {identity.get(key)}"
                for key in keys if saved_identity.get(key) != identity.get(key)]
    if changed:
        raise ConfigError(f"snapshot {path} comes from a different run ({', '.join(changed)}); "
                          f"resume with its settings, or {START_AFRESH}")
    trained, wanted = snapshot["epochs_run"], config["total_epochs"]
    if config.get("max_steps"):
        return  # the run's length is --max_steps' samples, which may fall into other epochs at another size
    if trained > wanted or (trained == wanted and snapshot["steps_run"]):
        raise ConfigError(f"--total_epochs {wanted} is below the {trained} epochs snapshot {path} "
                          f"already holds; raise --total_epochs, or {START_AFRESH}")


def _umask() -> int:
    """This process's file mode creation mask (reading it means setting it)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def snapshot_on_every_node(path: str) -> bool:
    """Collective: True when every rank sees ``path``, False when none does.

    Each rank loads the snapshot itself, so all must see the same file: one
    visible on some nodes only would resume those and restart the rest.
    Raises ConfigError in that case, naming the ranks that miss it.
    """
    exists: list = [None] * dist.get_world_size()
    dist.all_gather_object(exists, os.path.exists(path))
    if any(exists) and not all(exists):
        missing = [rank for rank, found in enumerate(exists) if not found]
        raise ConfigError(f"snapshot {path} is missing on ranks {missing} but present on others; "
                          f"--snapshot_path must be on storage that every node shares")
    return all(exists)


def atomic_save(obj: object, path: str) -> None:
    """``torch.save`` to a temporary file beside ``path``, fsync, then rename.

    A crash at any moment leaves either the old file or the new one, never a
    torn file (POSIX rename is atomic within a filesystem). The temporary
    file's name holds its writer (``<path>.<pid>@<host>.<random>.tmp``): a
    failed save removes its own file only, and after a successful one the
    files of writers on this host that no longer live are removed, never a
    live writer's. Raises what writing raises (OSError: a full disk, say),
    the file at ``path`` left as it was.
    """
    folder = os.path.dirname(os.path.abspath(path))
    writer = f"{os.getpid()}@{socket.gethostname()}"
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f"{os.path.basename(path)}.{writer}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; torch.save's files follow the umask
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    _remove_dead_writers_files(path)


def _remove_dead_writers_files(path: str) -> None:
    """Remove the temporary files beside ``path`` (``atomic_save``'s) whose
    writer was a process of this host that no longer lives (killed before
    its rename); a live writer's, or another host's, stay."""
    folder, name = os.path.split(os.path.abspath(path))
    pattern = re.compile(re.escape(name) + r"\.(\d+)@(.+)\.[^.]+\.tmp$")
    for stale in glob.glob(os.path.join(glob.escape(folder), glob.escape(name) + ".*.tmp")):
        writer = pattern.match(os.path.basename(stale))
        if writer and writer.group(2) == socket.gethostname() and not process_lives(writer.group(1)):
            with contextlib.suppress(OSError):
                os.remove(stale)


def remove_stale_temporary_files(path: str) -> list:
    """Remove every temporary file ``atomic_save`` leaves beside ``path`` when
    its writer is killed before the rename, whichever host that writer was on;
    return their names. Only for the holder of ``path``'s claim
    (``claim_snapshot``): no other live run writes ``path`` then, so none of
    them is a live writer's (a requeued job on another host finds those of its
    killed incarnation)."""
    folder, name = os.path.split(os.path.abspath(path))
    removed = []
    for stale in glob.glob(os.path.join(glob.escape(folder), glob.escape(name) + ".*.tmp")):
        with contextlib.suppress(OSError):
            os.remove(stale)
            removed.append(os.path.basename(stale))
    return removed


class SnapshotFile:
    """The Checkpointer's file format (DDP): the whole state in one file at
    ``path``, written by rank 0 (every rank holds the same weights), read by
    every rank. ``latest``, ``read``, ``load``, ``load_model``,
    ``resume_note``, ``save`` and ``close`` are the calls
    ``checkpointer.Checkpointer`` makes of either format."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.staging = CpuStaging()  # the background write's CPU buffers, reused by every snapshot

    def latest(self) -> Optional[str]:
        """Collective: ``path`` when every rank sees it, None when none does
        (start afresh); ConfigError when only some do (``snapshot_on_every_node``)."""
        return self.path if snapshot_on_every_node(self.path) else None

    def read(self, path: str, config: dict) -> dict:
        """The snapshot file ``path`` (``read_snapshot``: integrity, then "same
        run?" against ``config``), its weights and optimizer state included."""
        return read_snapshot(path, config)

    def load(self, path: str, snapshot: dict, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Load ``snapshot``'s (``read``'s) model and optimizer state into
        ``model`` and ``optimizer``, taking them out of it."""
        model.load_state_dict(snapshot.pop("model"))
        optimizer.load_state_dict(snapshot.pop("optimizer"))

    @staticmethod
    def resume_note(snapshot: dict, progress, config: dict) -> str:
        """The resume line's end: what changes at another world size (``Progress.resize_note``)."""
        return progress.resize_note(config)

    def load_model(self, path: str, model: torch.nn.Module) -> None:
        """The model weights alone of the snapshot file ``path`` (integrity checked, ``_load``)."""
        model.load_state_dict(_load(path)["model"])

    def save(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict,
             asynchronous: bool) -> tuple[Optional[Callable[[], None]], str]:
        """(the write, ``path``): on rank 0 a function that writes ``state``
        with the model's and the optimizer's state dicts to ``path``
        (``atomic_save``) and prints the save line; None on the other ranks.
        ``asynchronous``: the write runs in another thread while training
        changes the originals, so it writes a CPU copy taken now (``CpuStaging``:
        from GPUs into pinned buffers, queued behind the step; the write waits
        for it). A tied weight is written once either way."""
        if dist.get_rank() != 0:
            return None, self.path
        state = dict(state, model=model.state_dict(), optimizer=optimizer.state_dict())
        state = self.staging.copy(state) if asynchronous else state
        tag = position_tag(state['epochs_run'], state['steps_run'])

        def write() -> None:
            self.staging.wait()  # the copies from GPUs are in CPU memory
            atomic_save(state, self.path)
            note_snapshot(self.path, tag)
            print_line(f"{tag} | snapshot saved at {self.path}")

        return write, self.path

    def close(self) -> None:
        """The run's end, its last save written: the staging buffers freed."""
        self.staging = CpuStaging()
