"""Before training: data first on the downloading ranks, then every check
that would otherwise fail later (flags that differ across ranks, --amp where
it would slow down, a loader too short, unwritable output paths).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Callable

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from common import ConfigError
from .metrics import tensorboard_missing
from .output import first_error
from .speed import check_amp


def downloaders_first(load: Callable[..., object], args: argparse.Namespace, download: bool):
    """``load(args, download=True)`` on the processes with ``download``, then,
    once they are done, ``load(args, download=False)`` on the others; returns
    the result.

    Collective under a process group: the all-gather of errors is the barrier
    at which the others wait, and a ConfigError on any rank (a failed
    download, say) is raised on every rank, instead of leaving them hanging
    at the next collective.
    """
    result, error = None, ""
    for turn in (True, False):
        if download == turn and not error:
            try:
                result = load(args, download=download)
            except ConfigError as exc:
                error = str(exc)
        error = first_error(error)
    if error:
        raise ConfigError(error)
    return result


# Flags that may differ between processes of one job (node-local paths, CPU
# counts, what rank 0 alone writes); every other flag must be the same everywhere.
PER_PROCESS_FLAGS = ("data_dir", "num_workers", "metrics_path", "tensorboard_dir", "snapshot_path")


def check_same_settings(args: argparse.Namespace) -> None:
    """Collective: raise ConfigError (one line, on every rank) when the ranks
    were started with different values of a flag outside ``PER_PROCESS_FLAGS``,
    naming the flag and who has which value. Without it, a different
    --batch_size on one node fails later with a collective mismatch (gloo) or
    a hang (NCCL). Compares ``args`` as given: train.py's --amp is already the
    job's dtype (``resolve_amp``), so "auto" on ranks that would pick
    different dtypes never reaches this comparison as the same string."""
    mine = {key: value for key, value in vars(args).items() if key not in PER_PROCESS_FLAGS}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    for key in mine:
        values: dict = {}
        for rank, settings in enumerate(everyone):
            values.setdefault(repr(settings.get(key)), []).append(rank)
        if len(values) > 1:
            who = ", ".join(f"{value} on ranks {ranks}" for value, ranks in values.items())
            raise ConfigError(f"ranks disagree on --{key}: {who}; start every process with the "
                              f"same arguments")


def _folder_takes_files(folder: str) -> str:
    """'' when ``folder`` exists (made if missing) and takes new files, else
    why not, truthfully: the part of it that is a file, the folder that could
    not be made, or what creating a file there raised."""
    existing = folder
    while existing and not os.path.exists(existing):  # the nearest part that exists
        existing = os.path.dirname(existing)
    if existing and not os.path.isdir(existing):
        return f"{existing} is a file, not a folder"
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        return f"cannot create folder {folder} ({exc.strerror or type(exc).__name__})"
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        return (f"folder {folder} takes no new files (creating one fails: "
                f"{exc.strerror or type(exc).__name__})")
    return ""


def output_path_error(flag: str, path: str, folder: bool = False) -> str:
    """'' when the run can write ``path`` (the value of --``flag``), else the
    one-line error: ``cannot write --flag path: why; what to do``.

    ``folder``: ``path`` is a folder the run fills (--tensorboard_dir,
    --profile_dir, a sharded --snapshot_path), else a file. Refused: a folder
    where a file is expected and a file where a folder is; a parent that is
    a file, cannot be created, or takes no new files; an existing
    --metrics_path that is not writable (it is appended to). Missing folders
    are created; no file is written or changed.
    """
    fix = f"pass another --{flag}"
    snapshot = "snapshot " if flag == "snapshot_path" else ""
    if folder:
        why = (f"it is a file, where a {snapshot}folder is expected" if os.path.isfile(path)
               else _folder_takes_files(path))
    elif os.path.isdir(path):
        why = f"it is a folder, where a {snapshot}file is expected"
    else:
        why = _folder_takes_files(os.path.dirname(path) or ".")
        if not why and flag == "metrics_path" and os.path.isfile(path) and not os.access(path, os.W_OK):
            why = "the file is not writable (Permission denied)"
    return f"cannot write --{flag} {path}: {why}; {fix}" if why else ""


def check_before_training(args: argparse.Namespace, device: torch.device, train_data: DataLoader) -> None:
    """Everything that would fail later, checked before any training.

    Every rank got the same settings (``check_same_settings``); --amp where
    it would slow training down (``check_amp``); a training loader with fewer
    batches than one optimizer step needs; --snapshot_every_steps not a
    multiple of --grad_accum_steps; and, on rank 0, which writes them,
    --metrics_path and --tensorboard_dir can be written
    (``output_path_error``; missing folders are created) and tensorboard
    imports where asked for. (--snapshot_path is the Checkpointer's:
    ``Checkpointer.claim``.) Collective. Raises ConfigError (one line).
    """
    check_same_settings(args)
    check_amp(args.amp, device, args.model)
    if len(train_data) < args.grad_accum_steps:
        raise ConfigError(f"the training split gives each process {len(train_data.sampler)} "
                          f"samples, {len(train_data)} batches of --batch_size "
                          f"{train_data.batch_size}, fewer than one optimizer step of "
                          f"--grad_accum_steps {args.grad_accum_steps}; lower --batch_size")
    if args.snapshot_every_steps % args.grad_accum_steps:
        raise ConfigError(f"--snapshot_every_steps {args.snapshot_every_steps} is not a multiple "
                          f"of --grad_accum_steps {args.grad_accum_steps}; a snapshot must fall "
                          f"between optimizer steps")
    error = ""
    if dist.get_rank() == 0:
        for flag, folder in (("metrics_path", False), ("tensorboard_dir", True)):
            path = getattr(args, flag)
            error = error or (output_path_error(flag, path, folder) if path else "")
        if args.tensorboard_dir and not error:
            error = tensorboard_missing()
    error = first_error(error)
    if error:
        raise ConfigError(error)
