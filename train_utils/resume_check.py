"""--check_resume: does this run resume exactly? Two short runs in one
command, compared bitwise.

Exact resume holds for what a snapshot holds (weights, optimizer state,
schedule, loss scaler, loader position, each rank's torch CPU and CUDA
random states). A task of the user's can break it without a sign: a
transform drawing from a ``torch.Generator`` of its own, Python's global
``random`` or NumPy's global generator, a model keeping a counter outside
its ``state_dict``. ``check_resume`` trains the run twice, on side
snapshots beside --snapshot_path (whose content it never reads or writes):

  A. straight through, --max_steps optimizer steps (default ``DEFAULT_STEPS``);
  B. the same, stopped after the middle step by the kit's own stop path
     (every rank sends itself SIGTERM: ``StopSignal`` takes it at one step on
     every rank and the snapshot is saved), then, as a fresh process would
     resume it, in a new process group (destroyed and made again), the task
     and model built anew and Python's and NumPy's global generators seeded
     afresh, resumed from that snapshot to the end;

and compares every step's loss, the random streams it can see right before
the first step after the resume (the global ones, and the torch.Generators
the task holds of its own: ``task_generators``), and at the end the model's parameters and
buffers, the optimizer state, the loader position, the schedule and the loss
scaler. Rank 0 prints ``check_resume: bitwise`` or ``check_resume: not
bitwise`` and what differs, then the cost of each run.
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import shutil
import signal
import sys
import time
import types
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from common import ConfigError
from .distributed import barrier, watch_again
from .errors import report_to_torchrun
from .logs import RunLog
from .loop import Stopped, forget_stop_signal, received_stop_signal
from .output import print_line
from .snapshots import claim_snapshot_path

# The check's length where --max_steps is not given: long enough for a few
# steps on either side of the stop, short enough to cost seconds.
DEFAULT_STEPS = 20
SIDE_SUFFIX = ".check_resume"  # the side folder beside --snapshot_path holding the check's two snapshots
SHOWN_KEYS = 3  # differing keys named per kind


def check_resume(args: argparse.Namespace, build_run: Callable[[argparse.Namespace, RunLog], Any]) -> int:
    """Collective: run the check of ``args`` (train.py's parsed command line
    with --check_resume); return the exit status: 0 when the run stopped and
    resumed is bitwise the run straight through, 1 when not (rank 0 prints
    what differs; torchrun's root cause says so too).

    ``build_run(run_args, log)``: train.py's task, model, optimizer,
    loaders and Trainer for ``run_args``, freshly built (collective).

    Length: --max_steps optimizer steps when the command line gives it (0:
    --total_epochs' steps), else ``DEFAULT_STEPS``; the stop falls after the
    middle step. The runs write no --metrics_path, TensorBoard, W&B or
    profile, and do not evaluate on the test split. Their snapshots go to the
    side folder ``<--snapshot_path>.check_resume`` (claimed as a snapshot
    path is; removed at the end). Raises ConfigError (one line) for a run
    too short to stop in the middle, or when a stop signal from outside
    the check ends one of its runs (no verdict then)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    sharded = args.strategy != "ddp"
    steps = DEFAULT_STEPS if args.max_steps is None else args.max_steps
    # A stop signal is taken at the step after the one it came in, once ranks must agree on it
    # (StopSignal.poll): the signal goes out one step early, and the stop needs a step after it.
    lag = 1 if world_size > 1 else 0
    if steps:
        _check_length(steps, lag)
    side = os.path.normpath(args.snapshot_path) + SIDE_SUFFIX
    claim_snapshot_path(side, sharded=True)  # one check per side folder; it can be written
    if rank == 0:  # what an earlier check, killed, left there
        shutil.rmtree(side, ignore_errors=True)
        os.makedirs(side)
    barrier()
    paths = {name: os.path.join(side, name if sharded else f"{name}.pt") for name in ("straight", "stopped")}
    start_streams = _global_streams()  # Python's and NumPy's, as this process started: A and B start from them

    # A: straight through.
    started = time.perf_counter()
    _set_global_streams(start_streams)
    trainer = build_run(_run_args(args, paths["straight"], steps), RunLog())
    total = trainer.config.max_steps or trainer.config.total_epochs * trainer.progress.steps_per_epoch
    _check_length(total, lag)
    stop_step = max(total // 2, lag + 1)
    straight = _Recorder(trainer, watch_steps=(1, stop_step + 1))
    _train(trainer, "A, straight through")
    straight.at_end = {**_global_streams(), **task_generators(trainer.task)}
    a_state = _end_state(trainer)
    trainer.close()
    del trainer
    straight_s = time.perf_counter() - started

    # B: the same run, stopped after stop_step as a SIGTERM stops it...
    started = time.perf_counter()
    _set_global_streams(start_streams)
    trainer = build_run(_run_args(args, paths["stopped"], steps), RunLog())
    stopped = _Recorder(trainer, signal_step=stop_step - lag)
    try:
        _train(trainer, f"B, stopped by SIGTERM after step {stop_step}", stop_expected=True)
        raise RuntimeError(f"--check_resume sent SIGTERM at step {stop_step - lag} and run B did not stop")
    except Stopped:
        if not stopped.sent or trainer.progress.step != stop_step:
            raise ConfigError(f"a stop signal from outside the check stopped run B after step "
                              f"{trainer.progress.step}: no verdict; run the check again") from None
    trainer.close()
    del trainer

    # ... then resumed as a fresh process resumes it.
    _fresh_process_group(args.startup_timeout_s)
    forget_stop_signal()  # the check's own SIGTERM was this "process's"; a fresh one has none
    _fresh_global_streams()
    trainer = build_run(_run_args(args, paths["stopped"], steps), RunLog())
    resumed = _Recorder(trainer, watch_steps=(stop_step + 1,))
    _train(trainer, "B, resumed in a fresh process group")
    b_state = _end_state(trainer)
    stopped_s = time.perf_counter() - started

    findings = _compare(straight, stopped, resumed, stop_step, a_state, b_state)
    every: list = [None] * world_size
    dist.all_gather_object(every, findings)
    bitwise, lines = _report(every, total, stop_step)
    if rank == 0:
        for line in lines:
            print_line(line)
        # The straight run is the plain run of these steps, what a process pays once (caches, the FLOP
        # count) included: the check's cost is both runs over it.
        print_line(f"check_resume: straight {straight_s:.1f} s, stopped and resumed {stopped_s:.1f} s: the "
                   f"check cost {(straight_s + stopped_s) / straight_s:.2f}x the plain run of these steps")
    if not bitwise:
        report_to_torchrun(lines[0])
    trainer.close()
    if rank == 0:  # every rank is done with it: the run's end waited for every rank (StopSignal.close)
        shutil.rmtree(side, ignore_errors=True)
    return 0 if bitwise else 1


def _check_length(steps: int, lag: int) -> None:
    """Raise ConfigError (one line) for a run of ``steps`` optimizer steps too
    short to stop in the middle: the stop needs ``lag`` steps before it (the
    step the signal comes in, where ranks must agree on it) and one after it."""
    least = lag + 2
    if steps < least:
        raise ConfigError(f"--check_resume stops the run after a middle step and resumes it: it needs a run of "
                          f"at least {least} optimizer steps{' at this world size' if lag else ''}, and this one "
                          f"has {steps}; pass --max_steps {least} or more")


def _run_args(args: argparse.Namespace, snapshot_path: str, steps: int) -> argparse.Namespace:
    """``args`` for one of the check's runs: its side snapshot, ``steps``
    optimizer steps, and nothing written elsewhere (no metrics file,
    TensorBoard, W&B or profile)."""
    return argparse.Namespace(**dict(vars(args), snapshot_path=snapshot_path, max_steps=steps, metrics_path=None,
                                     tensorboard_dir=None, wandb_project=None, profile_dir=None))


def _train(trainer, phase: str, stop_expected: bool = False) -> None:
    """Collective: ``trainer.train()`` after rank 0's line naming the run.
    Raises ConfigError (one line, no verdict) when a stop signal from outside
    the check stopped it; Stopped when ``stop_expected``."""
    if trainer.rank == 0:
        print_line(f"check_resume: run {phase}")
    try:
        trainer.train()
    except Stopped:
        if stop_expected:
            raise
        raise ConfigError(f"a stop signal from outside the check stopped run {phase.split(',')[0]} after step "
                          f"{trainer.progress.step}: no verdict; run the check again") from None


def _fresh_process_group(timeout_s: float) -> None:
    """Collective: destroy the process group and make a new one of the same
    ranks and backend, as a fresh process would join one (its collectives'
    time-out ``timeout_s``, --startup_timeout_s). The new group's keys go
    under their own prefix in the launcher's store, so that none of the old
    group's is read."""
    backend, rank, world_size = dist.get_backend(), dist.get_rank(), dist.get_world_size()
    # The store the launcher gave (train.setup); torch has no public getter for it.
    store = dist.PrefixStore("check_resume", dist.distributed_c10d._get_default_store())
    dist.destroy_process_group()
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    watch_again(timeout_s)  # the time-out report's side group, of the new group


# --------------------------------------------------------------------------
# What the runs record: losses, random streams
# --------------------------------------------------------------------------

class _Recorder:
    """Wraps ``trainer.train_step`` (what the Trainer's loop calls for each
    micro-batch) to record each optimizer step's micro-batch losses
    (``losses``: {step: [loss, ...]}, 1-based steps), the global random
    streams right before the steps of ``watch_steps`` (``streams``: {step:
    ``_global_streams``}), and at step ``signal_step`` to send this process
    SIGTERM before the step runs (``sent``)."""

    def __init__(self, trainer, watch_steps: tuple = (), signal_step: int = 0) -> None:
        self.losses: dict = {}
        self.streams: dict = {}
        self.at_end: Optional[dict] = None
        self.sent = False
        train_step, progress, accum = trainer.train_step, trainer.progress, trainer.config.grad_accum_steps
        device, task = trainer.device, trainer.task

        def recording_step(source: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            step = progress.step + 1  # the optimizer step this micro-batch belongs to
            if progress.steps_run % accum == 0:  # the step's first micro-batch
                if step in watch_steps:
                    self.streams[step] = {**_global_streams(device), **task_generators(task)}
                if step == signal_step and not received_stop_signal():
                    os.kill(os.getpid(), signal.SIGTERM)  # the handler notes it, as any SIGTERM
                    self.sent = True
            loss = train_step(source, targets)
            self.losses.setdefault(step, []).append(loss.detach().clone())
            return loss

        trainer.train_step = recording_step


def _global_streams(device: Optional[torch.device] = None) -> dict:
    """The states of the global random streams this process has, by name:
    torch's CPU generator and ``device``'s CUDA one (with a device given),
    Python's ``random`` and, where a task imported NumPy, its global generator."""
    streams: dict = {}
    if device is not None:
        streams["torch CPU"] = torch.get_rng_state()
        if device.type == "cuda":
            streams["CUDA"] = torch.cuda.get_rng_state(device)
    streams["Python's global random"] = random.getstate()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        streams["NumPy's global generator"] = numpy.random.get_state()
    return streams


def task_generators(task) -> dict:
    """The states of the ``torch.Generator``s a task holds of its own, by
    where they are ("the task's torch.Generator task.train_transform.generator"):
    found in its training set, transforms, model, loss and batching, through
    attributes, containers, bound methods, ``functools.partial`` and closures,
    a few levels deep (a few hundred objects at most). No snapshot holds
    them: a resumed run's start over from where the task made them."""
    found: dict = {}
    seen: set = set()

    def walk(obj: Any, path: str, depth: int) -> None:
        if id(obj) in seen or depth > 6 or len(seen) > 5000 or \
                isinstance(obj, (torch.Tensor, str, bytes, int, float, bool, type, types.ModuleType)) or obj is None:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Generator):
            found[f"the task's torch.Generator {path}"] = obj.get_state()
            return
        if isinstance(obj, functools.partial):
            children = [("func", obj.func), *((f"args[{i}]", a) for i, a in enumerate(obj.args)),
                        *obj.keywords.items()]
        elif isinstance(obj, types.MethodType):
            children = [("__self__", obj.__self__)]
        elif isinstance(obj, types.FunctionType):  # a closure's cells
            children = list(zip(obj.__code__.co_freevars, (cell.cell_contents for cell in obj.__closure__ or ())))
        elif isinstance(obj, (list, tuple)):
            children = [(f"[{i}]", item) for i, item in enumerate(obj[:100])]
        elif isinstance(obj, dict):
            children = [(f"[{key!r}]", item) for key, item in list(obj.items())[:100]]
        else:
            children = list(getattr(obj, "__dict__", {}).items())[:100]
        for name, child in children:
            joined = f"{path}{name}" if name.startswith("[") else f"{path}.{name}"
            walk(child, joined, depth + 1)

    for part in ("train_set", "train_transform", "model", "loss_fn", "collate_fn"):
        walk(getattr(task, part, None), f"task.{part}", 0)
    return found


def _set_global_streams(streams: dict) -> None:
    """Put Python's and NumPy's global generators back to ``streams`` (``_global_streams()``)."""
    random.setstate(streams["Python's global random"])
    numpy = sys.modules.get("numpy")
    if numpy is not None and "NumPy's global generator" in streams:
        numpy.random.set_state(streams["NumPy's global generator"])


def _fresh_global_streams() -> None:
    """Seed Python's and NumPy's global generators from the system's entropy,
    as a new process starts them. (torch's are the kit's: build_task seeds
    them, a snapshot restores them.)"""
    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


# --------------------------------------------------------------------------
# The end state, compared
# --------------------------------------------------------------------------

# What a key of ``_end_state`` belongs to, by its first word, as the report names it.
KINDS = {"model": "model parameters and buffers", "optimizer": "optimizer state",
         "progress": "loader position and random streams", "recipe": "schedule and loss scaler",
         "evaluations": "evaluation totals"}


def _end_state(trainer) -> dict:
    """Collective: this rank's view of what a snapshot of ``trainer``
    holds at the run's end, flat ({"model fc.weight": tensor, "optimizer
    fc.weight exp_avg": tensor, "recipe lr_schedule last_epoch": 20, ...}),
    tensors copied to CPU memory; under FSDP each rank's own shards."""
    state: dict = {}
    model, optimizer = trainer.plain_model, trainer.optimizer
    _flatten("model", model.state_dict(), state)
    names = {parameter: name for name, parameter in model.named_parameters()}
    for parameter, values in optimizer.state.items():  # by parameter name, not by index
        _flatten(f"optimizer {names.get(parameter, '?')}", values, state)
    for index, group in enumerate(optimizer.param_groups):
        _flatten(f"optimizer group {index}", {k: v for k, v in group.items() if k != "params"}, state)
    for name in ("progress", "recipe", "evaluations"):  # the snapshot's parts (trackers: W&B's id, random)
        _flatten(name, getattr(trainer, name).state_dict(), state)
    # The loader's generator gives each epoch's iterator one draw (its workers' base seed), and a
    # resumed run makes one iterator more; nothing trained depends on it: the sampler shuffles by
    # (--seed, epoch) and the task's draws while loading are keyed by (--seed, epoch, sample).
    for key in [key for key in state if key.startswith("progress rng_states ") and key.endswith(" loader")]:
        del state[key]
    state["progress step"] = trainer.progress.step
    return state


def _flatten(prefix: str, value: Any, out: dict) -> None:
    """``value`` into ``out`` under ``prefix``-led keys: dicts, lists and
    tuples opened, tensors as CPU copies (a DTensor's local shard)."""
    if isinstance(value, dict):
        for key, item in value.items():
            _flatten(f"{prefix} {key}", item, out)
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _flatten(f"{prefix} {index}", item, out)
    elif isinstance(value, torch.Tensor):
        local = value.to_local() if hasattr(value, "to_local") else value
        out[prefix] = local.detach().to("cpu", copy=True)
    else:
        out[prefix] = value


def _same(a: Any, b: Any) -> bool:
    """Bitwise equal: tensors by ``torch.equal`` (and dtype, shape), NumPy
    arrays element by element, containers item by item, else ``==``."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if hasattr(a, "shape") and hasattr(b, "shape"):  # NumPy arrays (NumPy's generator state)
        return a.shape == b.shape and bool((a == b).all())
    return type(a) is type(b) and a == b


def _compare(straight: _Recorder, stopped: _Recorder, resumed: _Recorder, stop_step: int,
             a_state: dict, b_state: dict) -> dict:
    """This rank's findings: the first step whose loss differs (None: none),
    the global streams not restored at the resume that the run draws from,
    and the differing end-state keys by kind."""
    b_losses = {**stopped.losses, **resumed.losses}
    first = next((step for step in sorted(set(straight.losses) | set(b_losses))
                  if not _same(straight.losses.get(step), b_losses.get(step))), None)
    streams = []
    before_a, before_b = straight.streams.get(stop_step + 1, {}), resumed.streams.get(stop_step + 1, {})
    for name, state in before_a.items():
        # A stream the run never draws from may differ harmlessly (Python's, seeded afresh): named
        # only when it moved during run A and the resumed run does not stand where A stood.
        drawn = not _same(straight.streams[1].get(name), (straight.at_end or {}).get(name, state)) or \
            name in ("torch CPU", "CUDA")
        if drawn and not _same(state, before_b.get(name)):
            streams.append(name)
    differing: dict = {}
    for key in list(a_state) + [k for k in b_state if k not in a_state]:
        if not _same(a_state.get(key), b_state.get(key)):
            differing.setdefault(KINDS[key.split()[0]], []).append(_key_name(key))
    return {"first_step": first, "streams": streams, "differing": differing}


def _key_name(key: str) -> str:
    """An end-state key as the report names it: the model's own key
    ("fc.weight"), the rest as flattened ("optimizer fc.weight exp_avg")."""
    return key.split(" ", 1)[1] if key.startswith("model ") else key


def _report(every: list, total: int, stop_step: int) -> tuple[bool, list]:
    """(bitwise?, rank 0's lines) from every rank's ``_compare``."""
    steps = [found["first_step"] for found in every if found["first_step"] is not None]
    streams = list(dict.fromkeys(name for found in every for name in found["streams"]))
    differing: dict = {}
    for found in every:
        for kind, keys in found["differing"].items():
            differing.setdefault(kind, [])
            differing[kind] += [key for key in keys if key not in differing[kind]]
    bitwise = not (steps or streams or differing)
    runs = (f"{total} steps straight through vs stopped by SIGTERM after step {stop_step} and resumed in a "
            f"fresh process group")
    if bitwise:
        return True, [f"check_resume: bitwise ({runs}: every step's loss, the model's parameters and buffers, "
                      f"the optimizer state, the loader position and random streams, the schedule and the loss "
                      f"scaler are equal)"]
    lines = [f"check_resume: not bitwise ({runs})"]
    if steps:
        step = min(steps)
        where = ("the first after the resume" if step == stop_step + 1 else
                 "before the stop: the run does not repeat itself" if step <= stop_step else
                 f"{step - stop_step} after the resume")
        lines.append(f"check_resume: the first step whose loss differs: step {step} ({where})")
    else:
        lines.append("check_resume: every step's loss is equal")
    for name in streams:
        advice = STREAM_ADVICE.get(name, TASK_GENERATOR_ADVICE)
        lines.append(f"check_resume: random stream not restored at the resume: {name} ({advice})")
    if steps and not streams:
        lines.append("check_resume: no random stream the check sees was left unrestored: look for state the "
                     "snapshot does not hold (a torch.Generator of the task's own the check did not find, a counter "
                     "or tensor of the model's outside its state_dict: docs/custom-task.md)")
    same = [kind for kind in KINDS.values() if kind not in differing]
    for kind, keys in differing.items():
        shown = ", ".join(keys[:SHOWN_KEYS]) + (f" (+{len(keys) - SHOWN_KEYS} more)" if len(keys) > SHOWN_KEYS else "")
        lines.append(f"check_resume: at the end, {kind} differ: {shown}")
    if same:
        lines.append(f"check_resume: at the end, equal: {', '.join(same)}")
    return False, lines


TASK_GENERATOR_ADVICE = ("no snapshot holds a generator of the task's own; draw from torch's default generator, "
                        "which the kit keys and restores")
# What to do about a stream the resume did not restore (docs/custom-task.md says more).
STREAM_ADVICE = {
    "torch CPU": "the kit restores it: something drew from it between the snapshot and the first step",
    "CUDA": "the kit restores it: something drew from it between the snapshot and the first step",
    "Python's global random": "a fresh process seeds it anew; draw from torch's default generator, which the "
                              "kit keys and restores",
    "NumPy's global generator": "a fresh process seeds it anew; draw from torch's default generator, which the "
                                "kit keys and restores",
}
