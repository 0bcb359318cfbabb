"""The training recipe: optimizer and weight decay (--optimizer, --weight_decay),
the learning-rate schedule with warm-up (--lr_schedule, --warmup_epochs), the
loss scaler for fp16 (--amp fp16) and gradient clipping (--clip_grad_norm).

The kit makes one ``Recipe`` and calls ``backward`` and ``step`` where a
plain loop calls ``loss.backward()`` and ``optimizer.step()``; it is a part
of every snapshot (``state_dict``), so a resumed run continues the schedule
and the loss scale exactly where the stopped one left them.
"""

from __future__ import annotations

import re
import sys
import warnings
from typing import Callable, Optional

import torch
import torch.distributed as dist

from common import ConfigError
from recipes import lr_factor

from ..config import RunConfig, changeable_at_resume
from ..output import print_line
from ..snapshots import START_AFRESH, Found


def clip_grad_norm(parameters: list, max_norm: float) -> torch.Tensor:
    """Scale the gradients of ``parameters`` so that their total L2 norm, over
    all ranks, is at most ``max_norm``; return that norm before clipping
    (0-dim float32 tensor).

    Under DDP every rank holds the same all-reduced gradients, so the local
    norm is the global one. Under FSDP each rank holds a shard of each gradient
    (a DTensor): the norm of DTensors is reduced over the mesh (``full_tensor``)
    before any gradient is scaled: a collective then, which every rank calls.
    The same arithmetic as ``torch.nn.utils.clip_grad_norm_``, which it calls
    in two halves, as torchtitan's ``clip_grad_norm_`` does; an inf/NaN norm
    (an fp16 overflow, whose step GradScaler then skips) makes the gradients NaN.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads)
    # DTensor's module is loaded by FSDP: where it is not, no norm is a DTensor (a DDP
    # process never imports it, 0.5 s of start-up with sympy).
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is not None and isinstance(norm, dtensor.DTensor):
        norm = norm.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm)
    return norm


def batches_left(config: RunConfig, steps_per_epoch: int, epoch: int, batches_run: int) -> Optional[int]:
    """The micro-batches epoch ``epoch`` (0-based) may still train after its first
    ``batches_run``, for --max_steps optimizer steps (in this start's global
    batch: ``RunConfig.max_steps_now``) of ``steps_per_epoch`` per epoch
    (--grad_accum_steps micro-batches each); None without --max_steps."""
    if not config.max_steps:
        return None
    return (config.max_steps_now - epoch * steps_per_epoch) * config.grad_accum_steps - batches_run


def nothing_to_train(found: Found, config: RunConfig, step: Optional[int] = None) -> str:
    """'' when the run ``config`` asks for has something left to train after
    the snapshot ``found`` (``Checkpointer.find``); else the line saying that
    the snapshot holds every epoch of --total_epochs, or every sample of
    --max_steps, and what to do.

    Under --max_steps the run's budget is samples (``RunConfig.budget_samples``:
    its steps of the first start's global batch), so a finished run is
    finished at any world size: the snapshot's ``found.samples`` reach it.
    ``step``: once the snapshot is loaded, this start's optimizer step
    (``Progress.step``, counted in this start's steps per epoch), which
    decides for a snapshot that does not count its samples, and where the
    epochs' rounding at another world size puts it at the end already."""
    if not found.path:
        return ""
    if not config.max_steps:
        if found.epochs_run >= config.total_epochs:
            return (f"snapshot {found.path} already holds all {config.total_epochs} epochs: nothing to train "
                    f"(raise --total_epochs to train on, or {START_AFRESH})")
        return ""
    done = found.samples is not None and found.samples >= config.budget_samples
    if done or (step is not None and step >= config.max_steps_now):
        budget = config.budget_batch or config.global_batch
        held = f"{found.samples:,} samples" if found.samples is not None else f"{step} optimizer steps"
        size = "" if budget == config.global_batch else \
            f", {config.max_steps_now} steps of this start's global batch {config.global_batch}"
        return (f"snapshot {found.path} already holds {held} of --max_steps {config.max_steps} (steps of "
                f"global batch {budget}: {config.budget_samples:,} samples{size}): nothing to train (raise "
                f"--max_steps to train on, or {START_AFRESH})")
    return ""


def check_max_steps(saved_config: dict, config: RunConfig, steps_at_epoch_start: int) -> None:
    """Raise ConfigError (one line) when a snapshot that counts the epoch a
    --max_steps run cut short as whole (its ``saved_config``; the epochs it holds
    make ``steps_at_epoch_start`` steps, more than its max_steps: a snapshot
    of an earlier train.py) is resumed with another --max_steps: a longer run
    would miscount its steps and skip that epoch's rest. train.py's own
    snapshots of such a run stand inside the epoch (``Trainer.run_epoch``)
    and go on to any --max_steps (``config``'s)."""
    saved = saved_config.get("max_steps") or 0
    if saved and steps_at_epoch_start > saved and config.max_steps != saved:
        raise ConfigError(f"the snapshot holds a finished run of --max_steps {saved}, which ended inside an "
                          f"epoch; it cannot go on to --max_steps {config.max_steps}: start afresh (another "
                          f"--snapshot_path) with --max_steps {config.max_steps}")


class Recipe:
    """One optimizer step's arithmetic: the loss scaler (fp16), gradient
    clipping, the optimizer and its learning-rate schedule.

    ``optimizer`` from ``build_optimizer``; ``config`` the run's (--lr,
    --total_epochs, --lr_schedule, --warmup_epochs, --lr_step_epochs,
    --lr_gamma, --clip_grad_norm, --amp); ``steps_per_epoch`` optimizer steps
    in one epoch (micro-batches // --grad_accum_steps, >= 1); ``position``:
    () -> the run's optimizer steps so far (``Progress.step``), where a
    resumed schedule goes on; ``device`` where the model runs. The schedule
    is torch's LambdaLR over ``lr_factor``, stepped after every optimizer
    step; the loss scaler is torch's GradScaler, on for fp16 autocast only
    (bf16 has fp32's range and needs none). Making it sets every group's
    learning rate to --lr x the schedule's first factor (and LambdaLR's
    ``initial_lr``). As a snapshot's part: ``KEYS``, ``state_dict``,
    ``load_state_dict``.
    """

    KEYS = ("lr_schedule", "loss_scaler")

    def __init__(self, optimizer: torch.optim.Optimizer, config: RunConfig, steps_per_epoch: int,
                 position: Callable[[], int], device: torch.device) -> None:
        self.optimizer, self.config, self.steps_per_epoch, self.position = optimizer, config, steps_per_epoch, position
        # --max_steps and --warmup_steps in this start's steps (another world size: another global batch).
        self.schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lr_factor(config, steps_per_epoch, config.max_steps_now, config.warmup_steps_now))
        self.scaler = torch.amp.GradScaler(device.type, enabled=config.compute_dtype == torch.float16)
        # This epoch's steps the scaler skipped (inf/nan gradients): an int, or a tensor on the device
        # counting them there (read at the epoch's end and in snapshots, not at every step).
        self._skipped = 0
        self.last_lr = self.lr  # the learning rate of the last optimizer step

    @property
    def skipped_steps(self) -> int:
        """This epoch's optimizer steps the fp16 loss scaler skipped so far (a
        read from the device, where they are counted)."""
        return int(self._skipped)

    @property
    def lr(self) -> float:
        """The learning rate the next optimizer step uses (the first group's)."""
        return self.optimizer.param_groups[0]["lr"]

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, of the loss times the loss scale under fp16."""
        self.scaler.scale(loss).backward()

    def step(self) -> None:
        """One optimizer step on the accumulated gradients: unscale them (fp16),
        clip their total norm (--clip_grad_norm), step the optimizer (skipped
        when a gradient is inf/nan under fp16, the scale then halved, as
        GradScaler does), then move the schedule to the next step.
        Collective under FSDP (the norm and the inf/nan check span the shards):
        every rank calls it."""
        if self.scaler.is_enabled():
            self.scaler.unscale_(self.optimizer)  # before clipping: clip the true gradients
            # The scale as a device tensor: get_scale() would read it to the host, a wait for the
            # GPU at every step (torch has no public call for the tensor; GradScaler.step uses this one).
            scale = self.scaler._get_scale_async().clone()
        if self.config.clip_grad_norm:
            clip_grad_norm([p for group in self.optimizer.param_groups for p in group["params"]],
                           self.config.clip_grad_norm)
        self.last_lr = self.lr
        self.scaler.step(self.optimizer)  # without fp16: optimizer.step()
        if not self.scaler.is_enabled():
            self.schedule.step()
            return
        self.scaler.update()  # in place
        self._skipped = self._skipped + (self.scaler._get_scale_async() < scale)  # it drops only on a skip
        with warnings.catch_warnings():  # a skipped step is still a step of the schedule
            warnings.filterwarnings("ignore", re.escape("Detected call of `lr_scheduler.step()` before"))
            self.schedule.step()

    def epoch_figures(self) -> dict:
        """For the epoch's record: {"lr": the learning rate of the epoch's last
        optimizer step}, plus "skipped_steps" (the epoch's steps skipped on
        inf/nan gradients) under fp16, whose count then starts again at zero."""
        figures = {"lr": self.last_lr}
        if self.scaler.is_enabled():
            figures["skipped_steps"], self._skipped = self.skipped_steps, 0
        return figures

    def state_dict(self) -> dict:
        """{"lr_schedule": LambdaLR's state (its step count and base lr),
        "loss_scaler": GradScaler's (scale, growth tracker) and the epoch's
        skipped steps so far, None without fp16}: plain numbers, which
        snapshots save beside the optimizer's state."""
        scaler = dict(self.scaler.state_dict(), skipped_steps=self.skipped_steps) if self.scaler.is_enabled() else None
        return {"lr_schedule": self.schedule.state_dict(), "loss_scaler": scaler}

    def load_state_dict(self, snapshot: dict) -> None:
        """After the optimizer's state and the position (``Progress``) are
        loaded: continue the snapshot's schedule and loss scale (its
        "lr_schedule" and "loss_scaler").

        The schedule goes on at the run's step (``position()``), counted in
        this run's steps per epoch. Every group's learning rate becomes --lr
        x the schedule's factor there (the very number LambdaLR gives an
        unstopped run), its weight decay --weight_decay (a group that does
        not decay stays at 0) and AdamW's betas --beta1 --beta2, so flags
        that may change at a resume (``config.changeable_at_resume``) and
        differ from the snapshot's config take over from the next step (a new
        --lr, a longer --total_epochs, another schedule); rank 0 then prints
        one line saying what changed and the learning rate the next step uses.

        A snapshot from another world size has other steps per epoch than
        this run's ``steps_per_epoch``: ``Progress`` counts the epochs run in
        this run's steps, and ``lr_factor`` sets warm-up, cosine and step decay
        in epochs, so the learning rate is the one this schedule has after
        that many epochs, and the cosine still reaches its end at
        --total_epochs. Going on from the saved step count instead would put
        the cosine's end early (more steps per epoch after the change) or
        never reach it (fewer). Raises ConfigError (``check_max_steps``) for a
        finished --max_steps run asked to go on to another --max_steps.
        """
        config = snapshot["config"]
        check_max_steps(config, self.config, snapshot["epochs_run"] * self.steps_per_epoch)
        if snapshot.get("lr_schedule"):
            self.schedule.load_state_dict(snapshot["lr_schedule"])
        self.schedule.last_epoch = self.position()  # in this run's steps per epoch (see the docstring)
        if snapshot.get("loss_scaler") and self.scaler.is_enabled():
            scaler = dict(snapshot["loss_scaler"])
            self._skipped = scaler.pop("skipped_steps")
            self.scaler.load_state_dict(scaler)
        self.schedule.base_lrs = [self.config.lr for _ in self.optimizer.param_groups]
        factor, step = self.schedule.lr_lambdas[0], self.schedule.last_epoch
        if step:  # the learning rate the last step took, as an unstopped run reports it
            self.last_lr = self.config.lr * factor(step - 1)
        for group in self.optimizer.param_groups:  # loading the optimizer set the saved values
            group["lr"] = self.config.lr * factor(step)
            if group.get("decays", True):  # --decay_params matrices: biases and norms stay at 0
                group["weight_decay"] = self.config.weight_decay
            if "betas" in group:
                group["betas"] = (self.config.beta1, self.config.beta2)
        changed = [f"{name} {config.get(name)} -> {getattr(self.config, name)}" for name in changeable_at_resume()
                   if config.get(name) != getattr(self.config, name)]
        # The task's flags outside its identity (a changed identity was refused): --dropout, say; not those
        # that only say what the trained model writes (--sample_chars: no recipe).
        changed += [f"{name} {config.get(name)} -> {value}" for name, value in self.config.task_flags.items()
                    if name in config and config[name] != value and name not in self.config.task_identity
                    and name not in self.config.task_output_flags]
        if changed and dist.get_rank() == 0:
            print_line(f"recipe changed at resume ({', '.join(changed)}): the {self.config.lr_schedule} "
                       f"schedule now runs to epoch {self.config.total_epochs}; the next step's "
                       f"learning rate is {self.lr:.6g}")
