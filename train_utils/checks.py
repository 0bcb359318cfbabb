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
from .output import is_distributed
from .speed import check_amp


def first_error(error: str) -> str:
    """The first non-empty error of any rank ('' if none); a collective
    (an all-gather) under a process group, a no-op without one."""
    if is_distributed():
        errors: list = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        error = next((e for e in errors if e), "")
    return error


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
PER_PROCESS_FLAGS = ("data_dir", "num_workers", "metrics_path", "tensorboard_dir", "snapshot_path",
                     "checkpoint_path")


def check_same_settings(args: argparse.Namespace) -> None:
    """Collective: raise ConfigError (one line, on every rank) when the ranks
    were started with different values of a flag outside ``PER_PROCESS_FLAGS``,
    naming the flag and who has which value. Without it, a different
    --batch_size on one node fails later with a collective mismatch (gloo) or
    a hang (NCCL)."""
    if not is_distributed():
        return
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


def _folder_error(path: str) -> str:
    """'' when ``path``'s folder exists (made if missing) and takes new files,
    else why not. ``path`` itself is never touched."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        return f"folder {folder} is not writable ({exc.strerror or type(exc).__name__})"
    return ""


def check_before_training(args: argparse.Namespace, device: torch.device,
                          train_data: DataLoader, save_path: str, saves: bool) -> None:
    """Everything that would fail later, checked before any training.

    Every rank got the same settings (``check_same_settings``); --amp where
    it would slow training down (``check_amp``); a training loader with fewer
    batches than one optimizer step needs; --snapshot_every_steps not a
    multiple of --grad_accum_steps; and, on the processes that ``saves``,
    the folders of ``save_path``, --metrics_path and --tensorboard_dir take
    files (missing ones are created), and tensorboard imports where asked for.
    Collective under a process group. Raises ConfigError (one line).
    """
    check_same_settings(args)
    check_amp(args.amp, device, args.model)
    if len(train_data) < args.grad_accum_steps:
        raise ConfigError(f"the training split gives each process {len(train_data.sampler)} "
                          f"samples, {len(train_data)} batches of --batch_size "
                          f"{train_data.batch_size}, fewer than one optimizer step of "
                          f"--grad_accum_steps {args.grad_accum_steps}; lower --batch_size")
    if getattr(args, "snapshot_every_steps", 0) % args.grad_accum_steps:
        raise ConfigError(f"--snapshot_every_steps {args.snapshot_every_steps} is not a multiple "
                          f"of --grad_accum_steps {args.grad_accum_steps}; a snapshot must fall "
                          f"between optimizer steps")
    error = ""
    tensorboard_dir = getattr(args, "tensorboard_dir", None)
    if saves:
        for what, path, probe in (("save to", save_path, save_path),
                                  ("write --metrics_path", args.metrics_path, args.metrics_path),
                                  ("write --tensorboard_dir", tensorboard_dir,
                                   tensorboard_dir and os.path.join(tensorboard_dir, "events"))):
            why = _folder_error(probe) if probe else ""
            if why and not error:
                error = f"cannot {what} {path}: {why}; choose another path"
        if tensorboard_dir and not error:
            error = tensorboard_missing()
    error = first_error(error)
    if error:
        raise ConfigError(error)
