"""Weights & Biases (--wandb_project): one W&B run per training run, logged
by global rank 0, whose id snapshots keep so that a resumed run continues it.

wandb itself reads the rest of its settings from the environment
(WANDB_MODE=offline, WANDB_DIR, WANDB_ENTITY, WANDB_NAME, WANDB_TAGS, ...).
"""

from __future__ import annotations

import os
import secrets
import string
from typing import Optional

import torch.distributed as dist

from common import ConfigError
from ..output import first_error


def wandb_missing() -> str:
    """'' when wandb can be imported, else the one-line error for --wandb_project."""
    try:
        import wandb  # noqa: F401  (optional: pip install wandb)
    except ImportError as exc:
        return f"--wandb_project needs the wandb package ({exc}); pip install wandb, or leave the flag out"
    return ""


def _start_error(project: str, exc: Exception) -> str:
    """The one-line error for a ``wandb.init`` that raised ``exc``."""
    detail = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return (f"--wandb_project {project}: wandb could not start its run ({detail}); "
            f"run `wandb login` or set WANDB_API_KEY, or set WANDB_MODE=offline to log "
            f"locally and `wandb sync` later, or leave the flag out")


class WandbRun:
    """This training's W&B run: its id, and on rank 0 once started the run.

    The id is fresh per process: WANDB_RUN_ID when set, else 8 random
    characters as wandb makes them, drawn without touching any RNG that
    training uses. A resume replaces it with the snapshot's
    (``load_state_dict``), so the resumed training logs to the same W&B run.
    Without --wandb_project (``project`` None) nothing is logged, but the id
    is still kept in snapshots (a part of every snapshot: ``KEYS``).
    """

    KEYS = ("wandb_run_id",)

    def __init__(self, project: Optional[str]) -> None:
        self.project = project
        self.id = os.environ.get("WANDB_RUN_ID") or "".join(
            secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
        self.run = None  # wandb's Run, on rank 0 between start() and finish()

    def state_dict(self) -> dict:
        """{"wandb_run_id": the id (a str)}: what a snapshot keeps."""
        return {"wandb_run_id": self.id}

    def load_state_dict(self, state: dict) -> None:
        """Continue the W&B run a snapshot names; a snapshot from before the
        id was kept (no "wandb_run_id") keeps the fresh id."""
        if state.get("wandb_run_id"):
            self.id = state["wandb_run_id"]

    def start(self, config: dict) -> None:
        """Collective under a process group; nothing without --wandb_project.

        On global rank 0, ``wandb.init`` with this id and ``resume="allow"``
        (a resumed run continues the W&B run of its snapshot; a fresh id makes
        a new one), the flags and the world size as its config. Call it after
        the snapshot is loaded and before training. Raises ConfigError (one
        line, on every rank) when wandb is not installed or cannot start the
        run (not logged in, say). ``config``: the run's (``RunConfig.as_dict``)."""
        if not self.project:
            return
        error = ""
        if dist.get_rank() == 0:
            error = wandb_missing()
            if not error:
                import wandb

                try:
                    self.run = wandb.init(project=self.project, id=self.id, resume="allow",
                                          config=dict(config, world_size=dist.get_world_size()))
                except Exception as exc:  # wandb's UsageError, CommError, ...: one line, not a traceback
                    error = _start_error(self.project, exc)
        error = first_error(error)
        if error:
            raise ConfigError(error)

    def log(self, record: dict) -> None:
        """Send a metrics record to the run, if one was started here.

        An epoch record becomes one history row at W&B step = its epoch (an
        evaluation's record under --eval_every_steps: its optimizer step),
        committed at once (wandb otherwise holds a row back until the next
        step, which a stopped run never logs). A resumed run starts after its
        snapshot, so it logs no epoch twice, except after a crash past the last
        snapshot: it then repeats the epochs since, bitwise the same training,
        and wandb, whose resumed run continues after its last step, ignores a
        step below that (with a warning). The test record goes to the run's
        summary. None values are left out.
        """
        if self.run is None:
            return
        figures = {key: value for key, value in record.items() if value is not None}
        if "epoch" in record:  # an evaluation by steps (--eval_every_steps): at its optimizer step
            self.run.log(figures, step=record.get("step", record["epoch"]), commit=True)
        else:
            self.run.summary.update(figures)

    def finish(self, failed: bool = False) -> None:
        """End the W&B run started here, if any, as failed where ``failed``
        (an exception ended the training: exit code 1): wandb writes what it
        still holds (its run file is flushed every 15 s otherwise). wandb
        would do this at a normal interpreter exit, but not where the process
        ends at once (``ending.end_process``: FSDP, a broken process group),
        so the training's end (``Trainer.close``) calls it."""
        if self.run is not None:
            self.run.finish(exit_code=1 if failed else 0)
            self.run = None
