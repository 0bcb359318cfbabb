"""``train.py --plan NODESxPROCS [flags]``: the run those flags would make on
NODES nodes of PROCS processes each, checked in this one process before a
big job is submitted, and printed: the strategy and its device mesh, the
global batch and the accumulation, the steps per epoch, the training state
each rank holds (the figure the real run's memory line prints), an estimate
of each rank's peak device memory, the snapshot it would resume and how,
and the lines that launch it.

Nothing runs on the devices and nothing is written: the process group is
torch's fake one (``dist.init_process_group("fake")``: collectives return
at once, as in torchtitan's COMM_MODE=fake_backend), the model is built on
the meta device (``task_with_model_on_meta``: shapes, no memory), and one
training step is replayed on fake tensors (``torch._subclasses.FakeTensorMode``)
under torch's memory trackers to estimate the peak. The configuration comes
from the real run's own resolution (``config.resolve_config``), so a plan
that cannot run fails on the same one line as the run would, exit status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re
import shlex
import sys
import time
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

import common
from recipes import build_optimizer
from .checks import check_loader_holds_a_step
from .cli import output_flags, task_flag_values
from .config import RunConfig, resolve_config
from .distributed import binary_size, build_on_meta, local_state_bytes, shard_model, state_line
from .errors import one_line_errors
from .loop import Progress, checkpoint_activations, fp32, nothing_to_train
from .output import print_line
from .snapshots import Found, ShardedSnapshots, SnapshotFile, held_samples, in_bucket, mesh_name, newest_complete, \
    newest_snapshot_url, position, read_newest, read_snapshot, saved_budget_batch

PLAN_FORMAT = re.compile(r"(\d+)x(\d+)")
# How long a plan's one training step may replay on fake tensors (two iterations of at most two micro-batches).
REPLAYED_MICRO_BATCHES = 2


@dataclasses.dataclass(frozen=True)
class Layout:
    """The job a plan is for: ``nodes`` nodes of ``procs_per_node`` processes
    (one per GPU), ranks numbered node by node as torchrun and srun number them."""

    nodes: int
    procs_per_node: int

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node


def plan_request(argv: Sequence[str]) -> tuple[Optional[Layout], list]:
    """(the ``Layout`` of ``--plan NODESxPROCS`` or ``--plan=NODESxPROCS`` in
    ``argv``, the other arguments), or (None, ``argv``) without --plan.
    A malformed one ends the process with one usage line, exit status 2,
    as argparse does."""
    rest, layout, argv = [], None, list(argv)
    index = 0
    while index < len(argv):
        word = argv[index]
        if word == "--plan" or word.startswith("--plan="):
            value = word.split("=", 1)[1] if "=" in word else (argv[index + 1] if index + 1 < len(argv) else "")
            index += 1 if "=" in word else 2
            match = PLAN_FORMAT.fullmatch(value)
            if not match or 0 in (int(match[1]), int(match[2])):
                sys.stderr.write(f"train.py: error: --plan takes NODESxPROCS, e.g. --plan 8x8 for 8 nodes of 8 "
                                 f"processes, got {value!r}\n")
                sys.exit(2)
            layout = Layout(int(match[1]), int(match[2]))
            continue
        rest.append(word)
        index += 1
    return layout, rest


@contextlib.contextmanager
def parameters_on_meta():
    """Within it, every parameter and buffer a module registers moves to the
    meta device as it is registered (shape and dtype kept, no memory), and
    the module's own initialization then runs on meta tensors, costing
    nothing: a model of any size is built in this process while the task's
    data (made by the same task function) stays on the host, which a plain
    ``with torch.device("meta")`` would move too. A parameter registered
    again (a tied weight: the GPT's output layer and token embedding) stays
    the one object. The pattern of accelerate's ``init_empty_weights``."""
    register_parameter, register_buffer = torch.nn.Module.register_parameter, torch.nn.Module.register_buffer

    def on_meta(tensor):
        return tensor if tensor is None or tensor.device.type == "meta" else tensor.to("meta")

    def parameter(module, name, param):
        if param is not None and param.device.type != "meta":
            param = torch.nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        register_parameter(module, name, param)

    def buffer(module, name, tensor, persistent=True):
        register_buffer(module, name, on_meta(tensor), persistent)

    torch.nn.Module.register_parameter, torch.nn.Module.register_buffer = parameter, buffer
    try:
        yield
    finally:
        torch.nn.Module.register_parameter, torch.nn.Module.register_buffer = register_parameter, register_buffer


def task_with_model_on_meta(args: argparse.Namespace) -> tuple[common.Task, argparse.Namespace]:
    """The task ``args`` names, built by its task function as a run builds it
    (``common.load_task``, nothing downloaded), its model on the meta device
    (``parameters_on_meta``; a task's model factory: ``build_on_meta``, as an
    FSDP run builds it); and the copy of ``args`` the task function
    named its model in. Raises ConfigError as the task function does (data
    missing, bad sizes)."""
    torch.manual_seed(args.seed)
    task_args = argparse.Namespace(**vars(args))
    with parameters_on_meta():
        task = common.load_task(task_args, False)
    if task.model_factory is not None:  # a factory builds at the first read: on meta, as FSDP builds it
        task.model, _ = build_on_meta(task.model_factory)
    return task, task_args


@dataclasses.dataclass
class PeakEstimate:
    """Each rank's peak device memory over a replayed training step, in bytes:
    ``total`` and its parts by kind (torch's memory trackers' names:
    parameters sharded and gathered, gradients, optimizer state, activations,
    temporaries, inputs), or ``error`` (one line) where the replay failed."""

    total: int = 0
    parts: dict = dataclasses.field(default_factory=dict)
    error: str = ""


def replay_step(model: torch.nn.Module, config: RunConfig, task: common.Task, source: torch.Tensor,
                targets: torch.Tensor) -> tuple[dict, PeakEstimate]:
    """Two optimizer steps of ``model`` (meta parameters; sharded under FSDP)
    on fake tensors, each of min(--grad_accum_steps, 2) micro-batches of
    ``source`` and ``targets`` (one batch of --batch_size, from the task's
    own collate), under FSDP gradient sync on the last micro-batch only, as
    the Trainer steps: the optimizer built as the run builds it
    (``recipes.build_optimizer``). Returns (this rank's training state after
    the second step, ``fsdp.local_state_bytes``'s dict, exact: the shapes
    and the optimizer's own state layout), and the peak over both steps (the
    second's, with the optimizer state the first created) as torch's trackers
    count it: ``FSDPMemTracker`` for a sharded model, ``MemTracker`` for
    DDP's whole one (torch.distributed._tools, what torchtitan's memory
    estimation uses). The kernels are the CPU's (scaled_dot_product_attention's
    fused path saves what a GPU's flash attention saves); the CUDA context,
    NCCL's buffers and the allocator's fragmentation are not counted. A
    forward that does not run on fake tensors (a task's own code): the
    peak's ``error`` says why, and the state comes from one optimizer step
    on zero gradients instead."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    accum = min(config.grad_accum_steps, REPLAYED_MICRO_BATCHES)
    loss_fn = lambda output, y: task.loss_fn(fp32(output), y)  # noqa: E731  the Trainer's training_loss, eager
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")  # fake tensors of the meta ones' shapes: still no memory
        optimizer = build_optimizer(model, config)
        if config.sharded:
            tracker = FSDPMemTracker(mod=model, optm=optimizer)
        else:
            tracker = MemTracker()
            tracker.track_external(model, optimizer)
        autocast = torch.autocast("cpu", config.compute_dtype) if config.compute_dtype and not config.sharded \
            else contextlib.nullcontext()
        state: dict = {}
        try:
            with tracker:
                for step in range(2):
                    for micro in range(accum):
                        if config.sharded and config.grad_accum_steps > 1:
                            model.set_requires_gradient_sync(micro == accum - 1)
                        with autocast:
                            loss = loss_fn(model(task.train_transform(source)), targets)
                        (loss / accum).backward()
                        # The per-module figures of this forward cleared (FSDPMemTracker follows one forward
                        # a module at a time); the peak, over every micro-batch, stays.
                        tracker.reset_mod_stats()
                    optimizer.step()
                    if step == 1:
                        state = local_state_bytes(model, optimizer)
                    optimizer.zero_grad(set_to_none=True)
            peak = tracker.get_tracker_snapshot("peak")
        except Exception as exc:  # noqa: BLE001  said in the plan, not fatal: the rest of it stands
            for param in model.parameters():
                param.grad = torch.zeros_like(param)
            optimizer.step()  # the optimizer's state, laid out as its first step lays it out
            state = local_state_bytes(model, optimizer)
            first_line = (str(exc).splitlines() or [""])[0]
            return state, PeakEstimate(error=f"{type(exc).__name__}: {first_line}")
    totals = next(iter(peak.values()), {})
    parts = {str(getattr(kind, "value", kind)): int(n) for kind, n in totals.items() if kind != "Total" and n}
    return state, PeakEstimate(int(totals.get("Total", 0)), parts)


def newest_snapshot(path: str, sharded: bool) -> Optional[str]:
    """The snapshot a run of ``path`` (--snapshot_path) would resume, read only:
    the file itself (DDP), or the newest complete folder (FSDP, HSDP:
    ``newest_complete``, read only), in a bucket its newest complete
    generation (``bucket.newest_snapshot_url``); None where there is none."""
    if in_bucket(path):
        return newest_snapshot_url(path, sharded)
    if sharded:
        return newest_complete(path)
    return path if os.path.isfile(path) else None


def resume_line(config: RunConfig, progress: Progress) -> tuple[str, Found]:
    """The line the real run prints about --snapshot_path (``RunLog.resumed``'s
    ``resuming from snapshot PATH POSITION NOTE``, the note at another world
    size or mesh the format's ``resume_note``; the finished snapshot's line,
    ``nothing_to_train``'s; or "starts afresh"), its snapshot read and checked
    as the run reads it (``read_snapshot``: another run's, or a damaged one,
    raises ConfigError) and ``progress`` moved to it; and the snapshot as
    ``Checkpointer.find`` finds it."""
    found_path = newest_snapshot(config.snapshot_path, config.sharded)
    if found_path is None:
        return f"starts afresh: no snapshot at --snapshot_path {config.snapshot_path}", Found()
    world_size = dist.get_world_size()
    checked = dict(config.as_dict(), world_size=None if config.sharded else world_size)
    if in_bucket(found_path):
        snapshot = read_newest(config.snapshot_path, config.sharded, checked, ShardedSnapshots.META)
    elif config.sharded:
        snapshot = read_snapshot(os.path.join(found_path, ShardedSnapshots.META), checked)
    else:
        snapshot = read_snapshot(found_path, checked)
    found = Found(found_path, snapshot["epochs_run"], position(snapshot["epochs_run"], snapshot["steps_run"]),
                  held_samples(snapshot))
    finished = nothing_to_train(found, config)  # the run's own two checks, before and after loading
    if not finished:
        progress.load_state_dict(snapshot)
        finished = nothing_to_train(found, config, progress.step)
    if finished:
        return finished, found
    store = ShardedSnapshots if config.sharded else SnapshotFile
    note = store.resume_note(snapshot, progress, checked)
    return f"resuming from snapshot {found_path} {progress.position()}{note}", found


def launch_lines(layout: Layout, argv: Sequence[str]) -> list:
    """The commands that start the plan's job with the flags ``argv``: torchrun
    on each node, and the Slurm wrapper's sbatch (slurm/multi_gpu.sh on one
    node, slurm/multi_node.sh on several; each GPU a process)."""
    flags = shlex.join(argv)
    flags = f" {flags}" if flags else ""
    if layout.nodes == 1:
        return [f"torchrun --standalone --nproc_per_node={layout.procs_per_node} train.py{flags}",
                f"sbatch --gres=gpu:{layout.procs_per_node} slurm/multi_gpu.sh{flags}"]
    return [f"torchrun --nnodes={layout.nodes} --nproc_per_node={layout.procs_per_node} --rdzv-backend=c10d "
            f"--rdzv-endpoint=FIRST_NODE_HOST:29500 --rdzv-id=JOB_ID train.py{flags}   # on every node",
            f"sbatch --nodes={layout.nodes} --gres=gpu:{layout.procs_per_node} slurm/multi_node.sh{flags}"]


def join_fake_process_group(world_size: int) -> None:
    """Make this process rank 0 of a fake process group of ``world_size``
    ranks: torch's ``FakeProcessGroup`` (C++), whose collectives return at
    once without data, given the backend name "fake" as torch's own testing
    module registers it (torch/testing/_internal/distributed/fake_pg.py,
    which the kit does not import), so that device meshes and FSDP2 lay out
    every rank's shards as a real job of that size does."""
    from torch._C._distributed_c10d import FakeProcessGroup, FakeStore

    if "FAKE" not in dist.Backend._plugins:  # a name torch knows, its creator registered by the testing module
        def create(common_opts, backend_opts):
            return FakeProcessGroup._create_internal(common_opts.group_rank, common_opts.group_size, backend_opts)

        dist.Backend.register_backend("fake", create, extended_api=True, devices=["cpu", "cuda"])
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)


@one_line_errors
def check_plan(args: argparse.Namespace, layout: Layout, argv: Sequence[str],
               prepare_dataloader: Callable) -> int:
    """Print the plan of the run ``args`` (parsed from ``argv``, --plan taken
    out) would make as ``layout``'s job, from this one process (see the
    module's docstring), and return 0; a plan the run would refuse raises
    ConfigError, which ends the process with its one line, exit status 2
    (``one_line_errors``). ``prepare_dataloader``: train.py's, which makes
    the run's loaders (the training one gives the steps per epoch). --amp
    without a dtype is taken as bf16, what it means on GPUs that have it."""
    started = time.perf_counter()
    world_size = layout.world_size
    join_fake_process_group(world_size)
    amp = None if not args.amp else ("fp16" if args.amp == "fp16" else "bf16")
    task, task_args = task_with_model_on_meta(args)
    config = resolve_config(args, task, world_size, amp, task_flag_values(args), layout.procs_per_node,
                            model=task_args.model, output_flags=output_flags(args.dataset),
                            budget_batch=saved_budget_batch(args.snapshot_path))
    train_data = prepare_dataloader(task.train_set, config.batch_size, 0, True, config.seed, task.collate_fn)
    check_loader_holds_a_step(config, train_data)
    progress = Progress(torch.device("cpu"), train_data, 0, config.grad_accum_steps)
    resumes, _ = resume_line(config, progress)

    model = task.model
    if config.activation_checkpointing:
        checkpoint_activations(model)
    if config.sharded:  # on the meta device: FSDP2 shards the shapes, its mesh from the fake process group
        model = shard_model(model, torch.device("cpu"), config.compute_dtype, config.shard_size)
    source, targets = task.collate_fn([task.train_set[0]] * config.batch_size)
    state, peak = replay_step(model, config, task, source, targets)

    mesh = mesh_name(config.as_dict(), world_size) if config.sharded else "DDP: every rank the whole model"
    global_batch = config.batch_size * config.grad_accum_steps * world_size
    length = (f"--max_steps {config.max_steps} ({config.total_epochs} epochs)" if config.max_steps
              else f"--total_epochs {config.total_epochs}")
    lines = [
        f"plan: {layout.nodes} node{'s' if layout.nodes > 1 else ''} x {layout.procs_per_node} processes = world_size {world_size} | strategy "
        f"{config.strategy} | mesh {mesh} | amp {config.amp or 'off'}",
        f"global batch size {global_batch} = batch_size {config.batch_size} x grad_accum_steps "
        f"{config.grad_accum_steps} x world_size {world_size} | steps per epoch {progress.steps_per_epoch} | "
        f"{length}",
        f"model: {sum(p.numel() for p in task.model.parameters()):,} parameters",
    ]
    lines.append(state_line(state, world_size))
    if peak.error:
        lines.append(f"peak memory per rank: not estimated (the step does not replay on fake tensors: {peak.error})")
    else:
        parts = " + ".join(f"{kind} {binary_size(n)}" for kind, n in peak.parts.items())
        lines.append(f"peak memory per rank (estimate): {binary_size(peak.total)} = {parts}")
    lines += [resumes, "launch:", *(f"  {line}" for line in launch_lines(layout, argv)),
              f"plan checked in {time.perf_counter() - started:.1f} s; nothing written"]
    for line in lines:
        print_line(line)
    return 0
