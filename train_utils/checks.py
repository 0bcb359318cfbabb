"""Before training: data first on the downloading ranks, then every check
that would otherwise fail later (flags that differ across ranks, --amp where
it would slow down, a loader too short, unwritable output paths).
"""

from __future__ import annotations

import argparse
from typing import Callable

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from common import ConfigError
from .config import RunConfig, per_process
from .logs import tensorboard_missing
from .loop import check_amp
from .output import first_error, output_path_error


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


def check_same_settings(config: RunConfig) -> None:
    """Collective: raise ConfigError (one line, on every rank) when the ranks
    run with different values of a setting that may not differ between
    processes (every flag but ``config.per_process``'s; the task's flags and
    identity too), naming it and who has which value. Without it, a
    different --batch_size on one node fails later with a collective
    mismatch (gloo) or a hang (NCCL). --amp is already the job's dtype
    (``resolve_amp``), so "auto" on ranks that would pick different dtypes
    never reaches this comparison as the same string."""
    mine = {key: value for key, value in config.as_dict().items() if key not in per_process()}
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


def check_loader_holds_a_step(config: RunConfig, train_data: DataLoader) -> None:
    """Raises ConfigError (one line) where the training loader ``train_data``
    gives each process fewer batches than one optimizer step of
    --grad_accum_steps needs (a plan's check too: ``plan.check_plan``)."""
    if len(train_data) < config.grad_accum_steps:
        raise ConfigError(f"the training split gives each process {len(train_data.sampler)} "
                          f"samples, {len(train_data)} batches of --batch_size "
                          f"{train_data.batch_size}, fewer than one optimizer step of "
                          f"--grad_accum_steps {config.grad_accum_steps}; lower --batch_size")


def check_before_training(config: RunConfig, device: torch.device, train_data: DataLoader) -> None:
    """Everything that would fail later, checked before any training.

    Every rank got the same settings (``check_same_settings``); --amp where
    it would slow training down (``check_amp``); a training loader with fewer
    batches than one optimizer step needs; and, on rank 0, which writes
    them, --metrics_path and --tensorboard_dir can be written
    (``output_path_error``; missing folders are created) and tensorboard
    imports where asked for. (--snapshot_path was checked when it was
    claimed: ``snapshots.claim_snapshot_path``.) Collective. Raises
    ConfigError (one line).
    """
    check_same_settings(config)
    check_amp(config.amp, device, config.model)
    check_loader_holds_a_step(config, train_data)
    error = ""
    if dist.get_rank() == 0:
        for flag, folder in (("metrics_path", False), ("tensorboard_dir", True)):
            path = getattr(config, flag)
            error = error or (output_path_error(flag, path, folder) if path else "")
        if config.tensorboard_dir and not error:
            error = tensorboard_missing()
    error = first_error(error)
    if error:
        raise ConfigError(error)
