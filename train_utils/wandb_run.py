"""Weights & Biases (--wandb_project): one W&B run per training run, logged
by global rank 0, whose id snapshots keep so that a resumed run continues it.

wandb itself reads the rest of its settings from the environment
(WANDB_MODE=offline, WANDB_DIR, WANDB_ENTITY, WANDB_NAME, WANDB_TAGS, ...).
"""

from __future__ import annotations

import argparse
import os
import secrets
import string
from typing import Optional

import torch.distributed as dist

from common import ConfigError
from .output import is_distributed

# This training's W&B run: its id (fresh per process: WANDB_RUN_ID when set,
# else 8 random characters as wandb makes them, drawn without touching any
# RNG that training uses; a resume replaces it with the snapshot's) and, on
# rank 0 once started, the run itself.
WANDB = {"id": os.environ.get("WANDB_RUN_ID")
         or "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8)),
         "run": None}


def wandb_missing() -> str:
    """'' when wandb can be imported, else the one-line error for --wandb_project."""
    try:
        import wandb  # noqa: F401  (optional: pip install wandb)
    except ImportError as exc:
        return f"--wandb_project needs the wandb package ({exc}); pip install wandb, or leave the flag out"
    return ""


def wandb_run_id() -> str:
    """The id of this training's W&B run, which snapshots keep (``Progress.state_dict``)."""
    return WANDB["id"]


def continue_wandb_run(run_id: Optional[str]) -> None:
    """Log to the W&B run ``run_id`` (a snapshot's) instead of a fresh one;
    None (a snapshot from before W&B ids were kept) keeps the fresh id."""
    if run_id:
        WANDB["id"] = run_id


def start_wandb_run(args: argparse.Namespace) -> None:
    """Collective under a process group; nothing without --wandb_project.

    On global rank 0, ``wandb.init`` of project --wandb_project with this
    training's id and ``resume="allow"`` (a resumed run continues the W&B
    run its snapshot names; a fresh id makes a new one), with the flags and
    the world size as its config. Call it after the snapshot is loaded and
    before training. Raises ConfigError (one line, on every rank) when wandb
    is not installed or cannot start the run (not logged in, say).
    """
    project = getattr(args, "wandb_project", None)
    if not project:
        return
    from .checks import first_error  # here: checks imports metrics, which imports this module

    distributed = is_distributed()
    error = ""
    if not distributed or dist.get_rank() == 0:
        error = wandb_missing()
        if not error:
            import wandb

            config = dict(vars(args), world_size=dist.get_world_size() if distributed else 1)
            try:
                WANDB["run"] = wandb.init(project=project, id=WANDB["id"], resume="allow", config=config)
            except Exception as exc:  # wandb's UsageError, CommError, ...: one line, not a traceback
                detail = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                error = (f"--wandb_project {project}: wandb could not start its run ({detail}); "
                         f"run `wandb login` or set WANDB_API_KEY, or set WANDB_MODE=offline to log "
                         f"locally and `wandb sync` later, or leave the flag out")
    error = first_error(error)
    if error:
        raise ConfigError(error)


def log_to_wandb(record: dict) -> None:
    """Send a ``log_metrics`` record to the W&B run, if one was started here.

    An epoch record becomes one history row at W&B step = its epoch,
    committed at once (wandb otherwise holds a row back until the next
    step, which a stopped run never logs). A resumed run starts after its
    snapshot, so it logs no epoch twice, except after a crash past the last
    snapshot: it then repeats the epochs since, bitwise the same training,
    and wandb, whose resumed run continues after its last step, ignores a
    step below that (with a warning). The test record goes to the run's
    summary and ends the run (``finish_wandb_run``). None values are left out.
    """
    run = WANDB["run"]
    if run is None:
        return
    figures = {key: value for key, value in record.items() if value is not None}
    if "epoch" in record:
        run.log(figures, step=record["epoch"], commit=True)
    else:
        run.summary.update(figures)
        finish_wandb_run()


def finish_wandb_run() -> None:
    """End the W&B run started here, if any: wandb writes what it still
    holds (its run file is flushed every 15 s otherwise). wandb does this
    itself at a normal interpreter exit; call it before an ``os._exit``."""
    if WANDB["run"] is not None:
        WANDB["run"].finish()
        WANDB["run"] = None
