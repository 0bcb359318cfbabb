"""Does this run resume exactly? Two short runs in one command, compared
bitwise:

    torchrun --standalone --nproc_per_node=2 tools/check_resume.py --dataset my_task.py:build_task

takes train.py's flags (a run as train.py would train it) and answers with
its exit status: 0 bitwise, 1 not (what differs is printed).

Exact resume holds for what a snapshot holds (weights, optimizer state,
schedule, loss scaler, loader position, each rank's torch CPU and CUDA
random states). A task of the user's can break it without a sign: a
transform drawing from a ``torch.Generator`` of its own, Python's global
``random`` or NumPy's global generator, a model keeping a counter outside
its ``state_dict``. The check trains the run twice, on side snapshots
beside --snapshot_path (whose content it never reads or writes):

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
bitwise`` and what differs, then the cost of each run. It watches the runs
through the Trainer's step hook (``train.StepHook``).
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
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Optional

# Run as a file (and again by each DataLoader worker, as __mp_main__): the project folder on the path.
PROJECT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if PROJECT not in sys.path:
    sys.path.insert(0, PROJECT)
if __name__ == "__main__":
    # Ctrl-C in the seconds torch takes to import ends this process quietly, as train.py's does.
    signal.signal(signal.SIGINT, signal.SIG_DFL)

import torch  # noqa: E402 - after the path above
import torch.distributed as dist  # noqa: E402

import common  # noqa: E402
import train  # noqa: E402
import train_utils  # noqa: E402
from common import ConfigError  # noqa: E402
from train_utils.distributed import barrier, watch_again  # noqa: E402
from train_utils.errors import report_to_torchrun  # noqa: E402
from train_utils.loop import Stopped, forget_stop_signal, received_stop_signal  # noqa: E402
from train_utils.output import print_line  # noqa: E402

# The check's length where --max_steps is not given: long enough for a few
# steps on either side of the stop, short enough to cost seconds.
DEFAULT_STEPS = 20
SIDE_SUFFIX = ".check_resume"  # the side folder beside --snapshot_path holding the check's two snapshots
SHOWN_KEYS = 3  # differing keys named per kind

# train.py's run of a command line, built afresh with a step hook (collective): ``train.build_run``'s Trainer.
BuildRun = Callable[[argparse.Namespace, "Recorder"], "train.Trainer"]


@dataclass
class Runs:
    """What the check's runs recorded: run A (``straight``) and run B before
    (``stopped``) and after (``resumed``) its stop, each end state
    (``end_state``) and each run's seconds; ``total`` optimizer steps,
    stopped after ``stop_step``."""

    total: int
    stop_step: int
    straight: Optional["Recorder"] = None
    stopped: Optional["Recorder"] = None
    resumed: Optional["Recorder"] = None
    a_state: Optional[dict] = None
    b_state: Optional[dict] = None
    straight_s: float = 0.0
    stopped_s: float = 0.0


def check_resume(args: argparse.Namespace, build_run: BuildRun) -> int:
    """Collective: run the check of ``args`` (train.py's parsed command
    line); return the exit status: 0 when the run stopped and resumed is
    bitwise the run straight through, 1 when not (rank 0 prints what
    differs; torchrun's root cause says so too). ``build_run(run_args,
    hook)``: train.py's task, model, optimizer, loaders and Trainer for
    ``run_args``, freshly built, its ``StepHook`` ``hook`` (collective).

    Length: --max_steps optimizer steps when the command line gives it (0:
    --total_epochs' steps), else ``DEFAULT_STEPS``; the stop falls after the
    middle step. The runs write no --metrics_path, TensorBoard, W&B or
    profile, and do not evaluate on the test split. Their snapshots go to the
    side folder ``<--snapshot_path>.check_resume`` (claimed as a snapshot
    path is; removed at the end). Raises ConfigError (one line) for a run
    too short to stop in the middle, or when a stop signal from outside
    the check ends one of its runs (no verdict then)."""
    steps = DEFAULT_STEPS if args.max_steps is None else args.max_steps
    # A stop signal is taken at the step after the one it came in, once ranks must agree on it
    # (StopSignal.poll): the signal goes out one step early, and the stop needs a step after it.
    lag = 1 if dist.get_world_size() > 1 else 0
    if steps:
        _check_length(steps, lag)
    side = os.path.normpath(args.snapshot_path) + SIDE_SUFFIX
    paths = _side_snapshots(side, train_utils.is_sharded(args.strategy))
    start_streams = _global_streams()  # Python's and NumPy's, as this process started: A and B start from them
    runs = _run_straight(lambda recorder: build_run(_run_args(args, paths["straight"], steps), recorder),
                         start_streams, lag)
    _run_stopped_and_resumed(lambda recorder: build_run(_run_args(args, paths["stopped"], steps), recorder),
                             start_streams, lag, args.startup_timeout_s, runs)
    bitwise = _verdict(runs)
    if dist.get_rank() == 0:  # every rank is done with it: each run's end waited for every rank
        shutil.rmtree(side, ignore_errors=True)
    return 0 if bitwise else 1


def _side_snapshots(side: str, sharded: bool) -> dict:
    """Collective: claim the side folder ``side`` (one check per side folder;
    it can be written), empty it of what an earlier check, killed, left
    there, and return the paths of the two runs' snapshots in it (a folder
    each under a sharded strategy, a file each under DDP)."""
    train_utils.claim_snapshot_path(side, sharded=True)
    if dist.get_rank() == 0:
        shutil.rmtree(side, ignore_errors=True)
        os.makedirs(side)
    barrier()
    return {name: os.path.join(side, name if sharded else f"{name}.pt") for name in ("straight", "stopped")}


def _run_straight(build: Callable[["Recorder"], "train.Trainer"], start_streams: dict, lag: int) -> Runs:
    """Collective: run A, straight through, from ``start_streams`` (Python's
    and NumPy's global generators); returns the ``Runs`` it begins: its
    length, the step B stops after, its recording, end state and seconds."""
    started = time.perf_counter()
    _set_global_streams(start_streams)
    recorder = Recorder()
    trainer = build(recorder)
    total = trainer.config.max_steps_now or trainer.config.total_epochs * trainer.progress.steps_per_epoch
    _check_length(total, lag)
    runs = Runs(total, stop_step=max(total // 2, lag + 1), straight=recorder)
    recorder.follow(trainer, watch_steps=(1, runs.stop_step + 1))
    _train(trainer, "A, straight through")
    recorder.at_end = {**_global_streams(), **task_generators(trainer.task)}
    runs.a_state = _end_state(trainer)
    trainer.close()
    runs.straight_s = time.perf_counter() - started
    return runs


def _run_stopped_and_resumed(build: Callable[["Recorder"], "train.Trainer"], start_streams: dict, lag: int,
                             timeout_s: float, runs: Runs) -> None:
    """Collective: run B into ``runs``: from ``start_streams``, stopped by the
    kit's own stop path after ``runs.stop_step`` (this process's SIGTERM,
    sent ``lag`` steps before), then resumed as a fresh process resumes it:
    in a new process group (``timeout_s``: --startup_timeout_s), the stop
    signal forgotten, the global generators seeded afresh, built anew.
    Raises ConfigError (one line, no verdict) when a stop signal from
    outside the check stopped it."""
    started = time.perf_counter()
    _set_global_streams(start_streams)
    runs.stopped = Recorder(signal_step=runs.stop_step - lag)
    trainer = build(runs.stopped)
    runs.stopped.follow(trainer)
    try:
        _train(trainer, f"B, stopped by SIGTERM after step {runs.stop_step}", stop_expected=True)
        raise RuntimeError(f"the check sent SIGTERM at step {runs.stop_step - lag} and run B did not stop")
    except Stopped:
        if not runs.stopped.sent or trainer.progress.step != runs.stop_step:
            raise ConfigError(f"a stop signal from outside the check stopped run B after step "
                              f"{trainer.progress.step}: no verdict; run the check again") from None
    trainer.close()
    del trainer
    _fresh_process_group(timeout_s)
    forget_stop_signal()  # the check's own SIGTERM was this "process's"; a fresh one has none
    _fresh_global_streams()
    runs.resumed = Recorder(watch_steps=(runs.stop_step + 1,))
    trainer = build(runs.resumed)
    runs.resumed.follow(trainer)
    _train(trainer, "B, resumed in a fresh process group")
    runs.b_state = _end_state(trainer)
    trainer.close()
    runs.stopped_s = time.perf_counter() - started


def _verdict(runs: Runs) -> bool:
    """Collective: every rank's findings (``_compare``) gathered; rank 0
    prints the verdict and what differs, then the cost of each run;
    torchrun's root cause names a run that is not bitwise. Returns whether
    the runs are bitwise equal."""
    findings = _compare(runs.straight, runs.stopped, runs.resumed, runs.stop_step, runs.a_state, runs.b_state)
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, findings)
    bitwise, lines = _report(every, runs.total, runs.stop_step)
    if dist.get_rank() == 0:
        for line in lines:
            print_line(line)
        # The straight run is the plain run of these steps, what a process pays once (caches, the FLOP
        # count) included: the check's cost is both runs over it.
        print_line(f"check_resume: straight {runs.straight_s:.1f} s, stopped and resumed {runs.stopped_s:.1f} s: "
                   f"the check cost {(runs.straight_s + runs.stopped_s) / runs.straight_s:.2f}x the plain run of "
                   f"these steps")
    if not bitwise:
        report_to_torchrun(lines[0])
    return bitwise


def _check_length(steps: int, lag: int) -> None:
    """Raise ConfigError (one line) for a run of ``steps`` optimizer steps too
    short to stop in the middle: the stop needs ``lag`` steps before it (the
    step the signal comes in, where ranks must agree on it) and one after it."""
    least = lag + 2
    if steps < least:
        raise ConfigError(f"tools/check_resume.py stops the run after a middle step and resumes it: it needs a run "
                          f"of at least {least} optimizer steps{' at this world size' if lag else ''}, and this one "
                          f"has {steps}; pass --max_steps {least} or more")


def _run_args(args: argparse.Namespace, snapshot_path: str, steps: int) -> argparse.Namespace:
    """``args`` for one of the check's runs: its side snapshot, ``steps``
    optimizer steps, and nothing written elsewhere (no metrics file,
    TensorBoard, W&B or profile)."""
    return argparse.Namespace(**dict(vars(args), snapshot_path=snapshot_path, max_steps=steps, metrics_path=None,
                                     tensorboard_dir=None, wandb_project=None, profile_dir=None))


def _train(trainer: "train.Trainer", phase: str, stop_expected: bool = False) -> None:
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

class Recorder:
    """The check's ``train.StepHook``: records each optimizer step's
    micro-batch losses (``losses``: {step: [loss, ...]}, 1-based steps), the
    global random streams and the task's generators right before the steps
    of ``watch_steps`` (``streams``: {step: ``_global_streams``}), and at
    step ``signal_step`` sends this process SIGTERM before the step runs
    (``sent``), as a scheduler's stop would. ``at_end``: the streams after
    the run (set by the check)."""

    def __init__(self, watch_steps: tuple = (), signal_step: int = 0) -> None:
        self.watch_steps, self.signal_step = watch_steps, signal_step
        self.losses: dict = {}
        self.streams: dict = {}
        self.at_end: Optional[dict] = None
        self.sent = False
        self.device: Optional[torch.device] = None
        self.task: Optional[common.Task] = None

    def follow(self, trainer: "train.Trainer", watch_steps: Optional[tuple] = None) -> None:
        """The run recorded, once built: ``trainer``, whose device's CUDA
        stream and whose task's generators are read with the global ones;
        ``watch_steps`` where they are known only now (the run's length)."""
        self.device, self.task = trainer.device, trainer.task
        if watch_steps is not None:
            self.watch_steps = watch_steps

    def before(self, step: int) -> None:
        """Before optimizer step ``step``'s first micro-batch."""
        if step in self.watch_steps:
            self.streams[step] = {**_global_streams(self.device), **task_generators(self.task)}
        if step == self.signal_step and not received_stop_signal():
            os.kill(os.getpid(), signal.SIGTERM)  # the handler notes it, as any SIGTERM
            self.sent = True

    def after(self, step: int, loss: torch.Tensor) -> None:
        """After each micro-batch of optimizer step ``step``: its loss kept."""
        self.losses.setdefault(step, []).append(loss.detach().clone())


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


def _compare(straight: Recorder, stopped: Recorder, resumed: Recorder, stop_step: int,
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


@train_utils.one_line_errors
def main(args: argparse.Namespace) -> int:
    """Collective: start as train.py starts (``train.start``: the process
    group, the device, --amp for the whole job), then check the run of
    ``args`` (``check_resume``); return its exit status, with which
    ``one_line_errors`` ends the process (bad input: one line, exit status 2)."""
    local_rank, device, amp = train.start(args)

    def build_run(run_args: argparse.Namespace, hook: Recorder) -> train.Trainer:
        return train.build_run(run_args, train_utils.RunLog(), local_rank, device, amp, hook)[0]

    return check_resume(args, build_run)


if __name__ == "__main__":
    # train.py's command line, its default --snapshot_path by --strategy: the side folder goes beside it.
    main(train_utils.parse_args(__doc__, common.TASKS, models=train_utils.task_models,
                                snapshot_paths=train.SNAPSHOT_PATHS))
