"""Snapshot files: reading one with the "is it this run's?" checks, seeing
one from every node, and writing one so that a crash never tears it.
"""

from __future__ import annotations

import glob
import os
import tempfile

import torch
import torch.distributed as dist

from common import ConfigError
from .errors import NothingToTrain
from .testing import fault_point


# A snapshot made with other values of these trained something else, or on
# other data (the seed also draws the validation split): refuse it. Not
# compared: what may change between runs of the same training, like paths
# (a node-local --data_dir), the schedule (--total_epochs, --lr lowered after
# a divergence: see Recipe.resume), --num_workers, --compile and --amp.
# Another --optimizer is refused: its state holds other buffers.
SNAPSHOT_MUST_MATCH = ("dataset", "model", "seed", "input_path", "world_size", "batch_size",
                       "grad_accum_steps", "optimizer")
START_AFRESH = "delete it or pass another --snapshot_path to start afresh"
# What snapshots written before --optimizer existed trained with.
BEFORE_RECIPES = {"optimizer": "sgd"}


def read_snapshot(path: str, config: dict) -> dict:
    """Load a snapshot on the CPU for the run described by ``config``.

    ``weights_only=True`` unpickles tensors and plain containers only, never
    arbitrary objects, so a crafted file cannot run code here. Raises
    ConfigError (one line, the file left as it is) when the file cannot be
    read, when it comes from a run whose ``SNAPSHOT_MUST_MATCH`` settings
    differ from ``config``'s, or when it holds more epochs than
    ``config["total_epochs"]``; NothingToTrain when it holds exactly those.
    """
    try:
        snapshot = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        detail = str(exc).strip()
        raise ConfigError(
            f"cannot read snapshot {path} ({type(exc).__name__}: "
            f"{detail.splitlines()[0] if detail else 'no detail'}); "
            f"move it away to start afresh, or pass another --snapshot_path") from None
    saved = {**BEFORE_RECIPES, **snapshot["config"]}
    changed = [f"{key} {saved.get(key)} -> {config[key]}"
               for key in SNAPSHOT_MUST_MATCH if saved.get(key) != config[key]]
    if changed:
        raise ConfigError(f"snapshot {path} comes from a different run ({', '.join(changed)}); "
                          f"resume with its settings, or {START_AFRESH}")
    trained, wanted = snapshot["epochs_run"], config["total_epochs"]
    if trained > wanted or (trained == wanted and snapshot["steps_run"]):
        raise ConfigError(f"--total_epochs {wanted} is below the {trained} epochs snapshot {path} "
                          f"already holds; raise --total_epochs, or {START_AFRESH}")
    if trained == wanted:
        raise NothingToTrain(f"snapshot {path} already holds all {wanted} epochs: nothing to train "
                             f"(raise --total_epochs to train on, or {START_AFRESH})")
    return snapshot


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
    torn file (POSIX rename is atomic within a filesystem). After a successful
    save, temporary files left beside ``path`` by killed writers are removed;
    only one process may save to a given ``path``.
    """
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=os.path.basename(path) + ".", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; torch.save's files follow the umask
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        fault_point("save")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    # Temporary files of writers killed before their rename are garbage now.
    for stale in glob.glob(os.path.join(folder, glob.escape(os.path.basename(path)) + ".*.tmp")):
        os.remove(stale)
