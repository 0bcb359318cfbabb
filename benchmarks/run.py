"""Side-by-side performance measurements of the kit (train.py), in one run.

    .venv/bin/python benchmarks/run.py             # everything, about 2 minutes on 2 idle CPU cores
    .venv/bin/python benchmarks/run.py --only 1 2  # some sections

Prints one table per section, with the machine it ran on, and writes all
numbers to benchmarks/results/latest.json (``--out`` to change). Not part of
the test run; needs requirements.txt and requirements-test.txt (it builds its
datasets with tests/dataset_files.py) and, for sections 3 and 4, the real MNIST
digits in ../shared/data/mnist-t10k (or $MNIST_T10K_DIR).

Sections:
  1  overhead: steps/s of train.py's Trainer._run_batch over a bare
     zero_grad/forward/backward/step loop on the same DDP model, batch and
     data, in a 1-process gloo group; repetitions interleaved.
  1b bf16 autocast on this CPU: samples/s with and without, per model (the
     measurement behind --amp's CPU rule).
  2  input pipeline: CIFAR-10-shaped images/s, read from the real on-disk
     format, of the fast path (uint8 batches + augmentation on the device)
     against torchvision per-sample transforms with 2 DataLoader workers.
  3  scaling: global samples/s of train.py on real MNIST with 1
     and 2 processes (gloo on CPU, nccl on GPUs), and the share of a training
     step that is gradient all-reduce.
  4  time to 95% validation accuracy on real MNIST (wall seconds from launch,
     2 processes under torchrun), fast path against the per-sample path.
  5  CUDA only: ResNet-18 CIFAR-10 images/s on one GPU for fp32, bf16,
     bf16 + channels_last, + torch.compile, and the share of the GPU's peak
     FLOP/s that is. Without CUDA: "skipped: no CUDA device".
  6  FSDP vs DDP at world size 2 (gloo on CPU, nccl on GPUs): time of a
     training step and bytes of training state per rank (params + grads +
     SGD momentum), MNIST CNN and ResNet-18, as train.py --strategy fsdp
     and --strategy ddp wrap them; on CUDA also each one's peak GPU memory.
  7  snapshot save rate: atomic_save of 64 MiB to 1 GiB, MiB/s, in --save_dir
     (your snapshots' storage), and the model size whose snapshot fits in
     what Slurm's KillWait leaves (docs/slurm.md).
  8  language model: train.py --dataset shakespeare_char (nanoGPT's CPU
     recipe) for --lm_steps steps. 8a, with --nanogpt PATH (a checkout of
     karpathy/nanoGPT; needs numpy): its own train.py on the same recipe,
     model, data and --lm_threads threads, interleaved with the kit's, in
     tokens per CPU second (a run of a fifth of the steps subtracted: start-up
     and evaluation drop out, and a busy machine's other processes count
     against neither) and in wall tokens/s. 8b: tokens/s and model FLOP/s at
     1 and 2 processes, DDP vs FSDP, with and without
     --activation_checkpointing, the training state per rank; on a CPU the
     share of its measured fp32 matmul FLOP/s, on a GPU the MFU. Needs the
     corpus in ../shared/data/tinyshakespeare.
  9  snapshots that do not stop training: blocking seconds per snapshot,
     synchronous vs asynchronous (train.py's default), DDP file and FSDP
     shards, ~100 MB of training state, world size 2 (CUDA: one process per
     GPU, at most 2); training throughput with and without a snapshot every
     few seconds, and the cost of one a minute (target <= 2%).
     --snapshot_device cpu|cuda.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import itertools
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
# The repository (the scripts) and tests/ for its two plain helper modules,
# helpers.py and dataset_files.py (not conftest.py: no pytest fixtures or hooks here).
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import common  # noqa: E402
import fast_images  # noqa: E402
import train_utils  # noqa: E402
import vision_tasks  # noqa: E402
import train  # noqa: E402
from dataset_files import build_cifar10_root, build_mnist_root  # noqa: E402
from helpers import EPOCH_LINE, TORCHRUN, free_port, kit_trainer, load_task, script_env  # noqa: E402

CPU = torch.device("cpu")


def build_model(dataset: str, model_name: str) -> torch.nn.Module:
    """A fresh model of a built-in task (synthetic, mnist, cifar10), from the global RNG."""
    if dataset == "synthetic":
        return common.synthetic_model(model_name)
    return vision_tasks.build_model(dataset, model_name)


def machine() -> dict:
    """What the numbers were measured on."""
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    info = {"cpu": cpu, "cpu_cores": os.cpu_count(), "torch": torch.__version__,
            "python": platform.python_version(), "os": platform.platform(),
            "cuda_device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "date_utc": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M")}
    try:
        load = os.getloadavg()[0]
        info["load_avg_1min_at_start"] = round(load, 2)
    except OSError:
        pass
    return info


def table(title: str, header: list[str], rows: list[list]) -> str:
    """A markdown table (also readable as plain text)."""
    def cell(v):
        return f"{v:,.3f}" if isinstance(v, float) and abs(v) < 10 else (
            f"{v:,.0f}" if isinstance(v, float) else str(v))
    lines = [f"**{title}**", "", "| " + " | ".join(header) + " |",
             "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


# --------------------------------------------------------------------------
# What the sections share: the process group, a training step, the timing
# --------------------------------------------------------------------------

def backend_for(device: torch.device = None) -> str:
    """The process-group backend the scripts use on ``device`` (default: this
    machine's first GPU where CUDA works, else its CPU): nccl on a GPU, gloo on a CPU."""
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return "nccl" if device.type == "cuda" else "gloo"


@contextlib.contextmanager
def process_group(rank: int, world_size: int, port: int, device: torch.device):
    """Be ``rank`` of a ``world_size``-process group on this machine for a with
    block, set up as the scripts' ``ddp_setup`` does: this rank's GPU selected
    first, the CPU cores shared between the processes
    (``train_utils.share_cpu_cores``: the usable cores over the world size,
    unless OMP_NUM_THREADS is set), the device's backend. After the block the
    group is gone and torch's thread count is what it was."""
    threads = torch.get_num_threads()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    train_utils.share_cpu_cores(device, world_size)
    dist.init_process_group(backend_for(device), init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)


def ddp(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """``model`` (on ``device``) in DistributedDataParallel, as the DDP scripts wrap it."""
    return torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None)


def train_step(model, optimizer, loss_fn, x, y, autocast=contextlib.nullcontext(), transform=None):
    """One bare training step on the batch (``x``, ``y``), as a function of no
    arguments: zero_grad, forward and loss under ``autocast`` (made once, as in
    the scripts), backward, optimizer step. ``transform`` runs on ``x`` each step."""
    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with autocast:
            loss = loss_fn(model(x if transform is None else transform(x)), y)
        loss.backward()
        optimizer.step()
    return step


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(step, steps: int, device: torch.device = CPU, clock=time.perf_counter,
          barrier: bool = False) -> float:
    """Seconds per call of ``step()`` over ``steps`` calls, by ``clock``, with the
    GPU's queued work finished before and after; with ``barrier``, every rank
    of the process group starts together."""
    _synchronize(device)
    if barrier:
        dist.barrier()
    start = clock()
    for _ in range(steps):
        step()
    _synchronize(device)
    return (clock() - start) / steps


def interleaved(blocks: dict, reps: int) -> dict:
    """{name: [what ``blocks[name]()`` returned, per repetition]}: each block once
    per repetition, in ABBA order (reversed every other repetition): on a shared
    machine the load drifts over seconds, and every block sees the same drift."""
    results = {name: [] for name in blocks}
    for rep in range(reps):
        for name in (list(blocks) if rep % 2 == 0 else list(reversed(blocks))):
            results[name].append(blocks[name]())
    return results


# --------------------------------------------------------------------------
# 1. Overhead of train.py's training step over a bare loop
# --------------------------------------------------------------------------

# Blocks of ~0.2 s or more: much shorter ones measure the clock's and the
# scheduler's noise (3 CNN steps per block gave pair ratios of 0.85-1.05).
OVERHEAD_CASES = [("mnist cnn", "mnist", "cnn", (64, 1, 28, 28), 8),
                  ("synthetic mlp", "synthetic", "mlp", (32, 20), 1500)]
# train.py's Trainer and its bare loop on the same DDP model: only the kit's code differs.
OVERHEAD_SCRIPTS = [("train.py", "bare DDP")]


def _overhead_steps(dataset: str, model_name: str, shape: tuple, out_dir: str) -> dict:
    """{name: step()} of the bare DDP loop and train.py's Trainer._run_batch,
    each on its own copy of one model, on the same batch."""
    torch.manual_seed(0)
    base = build_model(dataset, model_name)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g)
    if dataset == "synthetic":
        y, loss_fn = torch.randn(shape[0], 1, generator=g), F.mse_loss
    else:
        y, loss_fn = torch.randint(0, 10, (shape[0],), generator=g), F.cross_entropy
    steps = {}
    for name in ("bare DDP", "train.py"):
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        if name == "bare DDP":
            steps[name] = train_step(ddp(model, CPU), opt, loss_fn, x, y)
        else:  # micro-batch 0 of an epoch: with --grad_accum_steps 1, every one a whole step
            steps[name] = functools.partial(kit_trainer(model, opt, loss_fn, out_dir)._run_batch, x, y, 0)
    return steps


def _overhead_pairs(bare, script, steps: int, reps: int) -> dict:
    """``reps`` adjacent pairs of blocks of ``steps`` steps, ABBA, timed in CPU
    seconds of this process, not wall time: time the scheduler gives other
    processes on a busy machine is not counted against either side."""
    times = interleaved({side: functools.partial(timed, fn, steps, clock=time.process_time)
                         for side, fn in (("bare", bare), ("script", script))}, reps)
    ratios = [t_ref / t_script for t_ref, t_script in zip(times["bare"], times["script"])]
    # Headline: best block of each, as timeit does (the least disturbed by other
    # processes); the pairs' median ratio and quartiles show the spread.
    return {"script_steps_per_s": 1 / min(times["script"]), "bare_steps_per_s": 1 / min(times["bare"]),
            "ratio": min(times["bare"]) / min(times["script"]),
            "ratio_median_of_pairs": statistics.median(ratios),
            "ratio_quartiles": statistics.quantiles(ratios, n=4)[::2]}


def section_overhead(reps: int = 30) -> dict:
    results = []
    with process_group(0, 1, free_port(), CPU):  # train.py's Trainer (DDP) needs one
        for label, dataset, model_name, shape, steps in OVERHEAD_CASES:
            runners = _overhead_steps(dataset, model_name, shape, tempfile.mkdtemp())
            for step in runners.values():  # warm-up
                for _ in range(3):
                    step()
            for name, reference in OVERHEAD_SCRIPTS:
                results.append({"case": label, "batch": shape[0], "script": name, "reference": reference,
                                **_overhead_pairs(runners[reference], runners[name], steps, reps)})
    rows = [[r["case"], r["batch"], r["script"], r["reference"], r["bare_steps_per_s"],
             r["script_steps_per_s"], r["ratio_median_of_pairs"],
             "{:.3f}-{:.3f}".format(*r["ratio_quartiles"]),
             f"{r['ratio_quartiles'][1] - r['ratio_quartiles'][0]:.1%}"] for r in results]
    text = table(f"1. Overhead: train.py's _run_batch vs a bare loop, CPU time, {reps} interleaved "
                 f"pairs of blocks (target ratio >= 0.97; read it only where the band is well "
                 f"under 3%)",
                 ["model", "batch", "script", "bare loop on", "bare steps/s (best)",
                  "script steps/s (best)", "median of pair ratios", "pair ratio quartiles",
                  "band (quartile spread)"], rows)
    return {"results": results, "pairs": reps, "table": text,
            "note": "median over adjacent (bare, train.py) pairs of blocks; in a "
                    "1-process gloo group"}


# --------------------------------------------------------------------------
# 1b. bf16 autocast on this CPU
# --------------------------------------------------------------------------

AMP_CASES = [("synthetic", "mlp", (32, 20), 300), ("mnist", "cnn", (64, 1, 28, 28), 10),
             ("cifar10", "resnet18_imagenet", (64, 3, 32, 32), 2)]


def section_amp_cpu(reps: int = 3) -> dict:
    results = []
    for dataset, model_name, shape, steps in AMP_CASES:
        torch.manual_seed(0)
        model = build_model(dataset, model_name)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        x = torch.randn(shape)
        y = torch.randn(shape[0], 1) if dataset == "synthetic" else torch.randint(0, 10, (shape[0],))
        loss_fn = F.mse_loss if dataset == "synthetic" else F.cross_entropy
        step = {amp: train_step(model, opt, loss_fn, x, y, train_utils.autocast(CPU, "bf16" if amp else None))
                for amp in (False, True)}
        for amp in (False, True, False, True):  # warm-up
            step[amp]()
        times = interleaved({amp: functools.partial(timed, step[amp], steps) for amp in step}, reps)
        fp32, bf16 = (shape[0] / statistics.median(times[a]) for a in (False, True))
        results.append({"model": model_name, "batch": shape[0], "fp32_samples_per_s": fp32,
                        "bf16_autocast_samples_per_s": bf16, "speedup": bf16 / fp32})
    native = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    text = table(f"1b. bf16 autocast on this CPU (native bf16: {native}); --amp allowed on a CPU "
                 f"for: {', '.join(train_utils.AMP_HELPS_ON_CPU)}",
                 ["model", "batch", "fp32 samples/s", "bf16 autocast samples/s", "speedup"],
                 [[r["model"], r["batch"], r["fp32_samples_per_s"], r["bf16_autocast_samples_per_s"],
                   r["speedup"]] for r in results])
    return {"results": results, "native_bf16": native, "table": text}


# --------------------------------------------------------------------------
# 2. Input pipeline: fast path vs torchvision per-sample transforms
# --------------------------------------------------------------------------

def _pipeline_images_per_s(task, num_workers: int, batch_size: int, epochs: int) -> float:
    """Training images/s through the DataLoader (1-replica DistributedSampler,
    as the DDP scripts use) and the task's device transform, ``epochs`` full
    epochs (DataLoader workers start anew each epoch, as in the scripts)."""
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    sampler = DistributedSampler(task.train_set, num_replicas=1, rank=0, seed=0)
    loader = DataLoader(task.train_set, batch_size=batch_size, sampler=sampler, drop_last=True,
                        num_workers=num_workers, collate_fn=common.collate,
                        pin_memory=torch.cuda.is_available())
    device = train_utils.device_for(0)
    images = 0
    start = time.perf_counter()
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for source, targets in loader:
            source = task.train_transform(source.to(device, non_blocking=True))
            targets = targets.to(device, non_blocking=True)
            images += len(source)
        if device.type == "cuda":
            torch.cuda.synchronize()
    return images / (time.perf_counter() - start)


def section_input(n_train: int = 10000, batch_size: int = 256, reps: int = 5) -> dict:
    import torchvision.datasets.cifar as cifar

    cifar.check_integrity = lambda path, md5=None: os.path.isfile(path)  # our files, not the official
    root = build_cifar10_root(Path(tempfile.mkdtemp()) / "cifar", per_batch=n_train // 5, n_test=100)
    start = time.perf_counter()
    fast = load_task("cifar10", root, "fast")
    decode_s = time.perf_counter() - start
    slow = load_task("cifar10", root, "torchvision")
    torch.manual_seed(0)
    paths = {"fast (uint8 batches, device augmentation), 0 workers": (fast, 0),
             "torchvision per-sample, 2 workers": (slow, 2),
             "torchvision per-sample, 0 workers": (slow, 0)}
    for task, workers in paths.values():  # warm-up: allocator, caches, worker start-up code
        _pipeline_images_per_s(task, workers, batch_size, epochs=1)
    runs = interleaved({name: functools.partial(_pipeline_images_per_s, task, workers, batch_size, epochs=1)
                        for name, (task, workers) in paths.items()}, reps)  # one epoch each
    best = {name: max(v) for name, v in runs.items()}
    med = {name: statistics.median(v) for name, v in runs.items()}
    fast_name, slow_name = list(runs)[:2]
    rows = [[name, best[name], best[name] / best[slow_name], med[name], med[name] / med[slow_name]]
            for name in runs]
    text = table(f"2. Input pipeline, CIFAR-10-shaped, {len(fast.train_set):,} training images, "
                 f"batch {batch_size}, crop(pad 4) + flip + normalize, {reps} interleaved epochs "
                 f"per path (target fast / torchvision 2 workers >= 5x)",
                 ["path", "images/s (best epoch)", "vs torchvision 2 workers", "images/s (median)",
                  "vs torchvision 2 workers (median)"], rows)
    text += f"\n\nfast path one-off decode into uint8 tensors: {decode_s:.2f} s"
    return {"images_per_s_best": best, "images_per_s_median": med, "runs": runs,
            "ratio_fast_vs_torchvision_2_workers": best[fast_name] / best[slow_name],
            "ratio_fast_vs_torchvision_2_workers_median": med[fast_name] / med[slow_name],
            "fast_decode_seconds": decode_s, "train_images": len(fast.train_set),
            "batch_size": batch_size, "table": text}


# --------------------------------------------------------------------------
# 3. Scaling with processes, and the all-reduce share of a step
# --------------------------------------------------------------------------

def _allreduce_worker(rank: int, world_size: int, port: int, steps: int, reps: int, out: str):
    device = train_utils.device_for(rank)
    with process_group(rank, world_size, port, device):
        torch.manual_seed(0)
        model = ddp(build_model("mnist", "cnn").to(device), device)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        x = torch.randn(32, 1, 28, 28, device=device)
        y = torch.randint(0, 10, (32,), device=device)
        step = train_step(model, opt, F.cross_entropy, x, y)

        def step_without_allreduce():
            with model.no_sync():  # the same step without the gradient all-reduce
                step()

        for _ in range(3):
            step()
        times = interleaved({variant: functools.partial(timed, fn, steps, device, barrier=True)
                             for variant, fn in (("with", step), ("without", step_without_allreduce))},
                            reps)
        # The all-reduce alone: one flat tensor the size of all gradients.
        flat = torch.zeros(sum(p.numel() for p in model.parameters()), device=device)
        alone = timed(lambda: dist.all_reduce(flat), steps, device, barrier=True)
        if rank == 0:
            torch.save({"with": statistics.median(times["with"]),
                        "without": statistics.median(times["without"]),
                        "allreduce_alone": alone, "grad_mb": flat.numel() * 4 / 1e6}, out)


def _metrics_run(cmd: list, cwd: Path, **env: str) -> list[dict]:
    subprocess.run([str(c) for c in cmd], cwd=cwd, check=True, capture_output=True, text=True,
                   env=script_env(**env))
    records = [json.loads(line) for line in (cwd / "m.jsonl").read_text().splitlines()]
    return [record for record in records if "event" not in record]  # not the run's start record


def section_scaling(mnist: Path, epochs: int = 2) -> dict:
    results = []
    cores = os.cpu_count() or 1
    # torchrun leaves OMP_NUM_THREADS alone for 1 process (it uses every core)
    # and sets 1 per process for several; 1 process x 1 thread is the per-core baseline.
    gpus = torch.cuda.device_count()
    for nproc, threads in ((1, None), (1, 1), (2, None)):
        if gpus and nproc > gpus:  # one process per GPU: a second would ask for cuda:1
            results.append({"processes": nproc, "threads_per_process": threads or 1,
                            "skipped": f"needs {nproc} GPUs, this machine has {gpus}"})
            continue
        cwd = Path(tempfile.mkdtemp())
        env = {"OMP_NUM_THREADS": str(threads)} if threads else {}
        records = _metrics_run(TORCHRUN + ["--standalone", f"--nproc_per_node={nproc}",
                                           REPO / "train.py", "--dataset", "mnist",
                                           "--data_dir", mnist, "--total_epochs", str(epochs),
                                           "--metrics_path", "m.jsonl"], cwd, **env)
        last = [r for r in records if "epoch" in r][-1]
        results.append({"processes": nproc, "threads_per_process": threads or (cores if nproc == 1 else 1),
                        "samples_per_s": last["samples_per_s"], "epoch_seconds": last["epoch_seconds"]})
    backend = backend_for()
    rows = [[r["processes"], r["threads_per_process"], backend, r.get("samples_per_s", r.get("skipped")),
             r["samples_per_s"] / results[1]["samples_per_s"] if "samples_per_s" in r else "-",
             r.get("epoch_seconds", "-")] for r in results]
    text = table(f"3. Scaling: train.py, real MNIST (7,200 training digits), batch 32 "
                 f"per process, epoch {epochs}",
                 ["processes", "threads each", "backend", "global samples/s",
                  "vs 1 process x 1 thread", "epoch s"], rows)
    if gpus == 1:
        text += "\n\nall-reduce share: skipped (needs 2 processes, one GPU each; this machine has 1)"
        return {"results": results, "backend": backend, "table": text}
    out = os.path.join(tempfile.mkdtemp(), "ar.pt")
    mp.spawn(_allreduce_worker, args=(2, free_port(), 20, 5, out), nprocs=2)
    ar = torch.load(out)
    share = 1 - ar["without"] / ar["with"]
    text += (f"\n\nall-reduce share of a 2-process step (CNN, batch 32, {ar['grad_mb']:.1f} MB of "
             f"gradients): step {ar['with'] * 1e3:.1f} ms with DDP's all-reduce, "
             f"{ar['without'] * 1e3:.1f} ms under no_sync() -> {share:.0%} of the step; "
             f"a bare all_reduce of that size takes {ar['allreduce_alone'] * 1e3:.1f} ms")
    return {"results": results, "allreduce": ar, "allreduce_share": share, "backend": backend,
            "table": text}


# --------------------------------------------------------------------------
# 4. Time to 95% validation accuracy on real MNIST
# --------------------------------------------------------------------------

def _time_to_accuracy(mnist: Path, input_path: str, target: float, max_epochs: int) -> dict:
    cwd = Path(tempfile.mkdtemp())
    cmd = TORCHRUN + ["--standalone", "--nproc_per_node=2", REPO / "train.py",
                      "--dataset", "mnist", "--data_dir", mnist, "--total_epochs", str(max_epochs),
                      "--input_path", input_path]
    start = time.perf_counter()
    proc = subprocess.Popen([str(c) for c in cmd], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, start_new_session=True,
                            env=script_env())
    result = {"input_path": input_path, "seconds": None, "epoch": None, "train_seconds": 0.0}
    for line in proc.stdout:
        m = EPOCH_LINE.match(line)
        if not m:
            continue
        result["train_seconds"] += float(m["epoch_s"])
        if m["val_acc"] is not None and float(m["val_acc"]) >= target:
            result.update(seconds=time.perf_counter() - start, epoch=int(m["epoch"]),
                          val_acc=float(m["val_acc"]))
            os.killpg(proc.pid, signal.SIGTERM)  # reached: the rest of the run is not needed
            break
    proc.wait()
    return result


def section_time_to_accuracy(mnist: Path, target: float = 0.95, reps: int = 2) -> dict:
    runs = []
    for rep in range(reps):
        for input_path in (("fast", "torchvision") if rep % 2 == 0 else ("torchvision", "fast")):
            runs.append(_time_to_accuracy(mnist, input_path, target, max_epochs=5))
    rows = []
    summary = {}
    for input_path in ("fast", "torchvision"):
        mine = [r for r in runs if r["input_path"] == input_path]
        reached = [r for r in mine if r["seconds"] is not None]
        seconds = statistics.median(r["seconds"] for r in reached) if reached else None
        summary[input_path] = seconds
        rows.append([input_path, seconds if seconds is not None else "not reached",
                     ", ".join(str(r["epoch"]) for r in mine),
                     ", ".join(f"{r['seconds']:.1f}" if r["seconds"] else "-" for r in mine)])
    text = table(f"4. Time to {target:.0%} validation accuracy, real MNIST (7,200 training digits, "
                 f"800 validation), train.py, 2 processes, batch 32 each, "
                 f"{'GPU' if torch.cuda.is_available() else 'CPU'}",
                 ["input path", "median wall s from launch", "epoch reached (per run)",
                  "wall s (per run)"], rows)
    return {"runs": runs, "median_seconds": summary, "target": target, "table": text}


# --------------------------------------------------------------------------
# 5. One GPU: ResNet-18 on CIFAR-10-shaped batches
# --------------------------------------------------------------------------

GPU_VARIANTS = [("fp32 (TF32 convs)", False, False, False), ("bf16 autocast", True, False, False),
                ("bf16 + channels_last", True, True, False),
                ("bf16 + channels_last + compile", True, True, True)]


def _gpu_variant(amp: bool, channels_last: bool, compiled: bool, x8, y, steps: int) -> dict:
    """Seconds per training step of ResNet-18 on the uint8 batch ``x8`` (on its
    GPU), the step's FLOPs and the peak memory the timed steps took."""
    from torch.utils.flop_counter import FlopCounterMode

    device = x8.device
    torch.manual_seed(0)
    model = build_model("cifar10", "resnet18").to(device)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    transform = fast_images.DeviceTransform((vision_tasks.CIFAR10_MEAN, vision_tasks.CIFAR10_STD), 4,
                                            channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    autocast = train_utils.autocast(device, "bf16" if amp else None)
    step = train_step(train_utils.compile_model(model, compiled), opt, F.cross_entropy, x8, y,
                      autocast, transform)
    for _ in range(5 if not compiled else 10):  # warm-up (and compile)
        step()
    _synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    seconds = timed(step, steps, device)
    # Read now: the FLOP count below runs the plain (uncompiled) model.
    peak_memory = torch.cuda.max_memory_allocated(device) / 2**20
    with FlopCounterMode(display=False) as counter:  # forward + backward of one step (SGD's update: none)
        train_step(model, opt, F.cross_entropy, x8, y, autocast, transform)()
    return {"seconds": seconds, "flops": counter.get_total_flops(), "peak_memory_mib": peak_memory}


def section_gpu(batch_size: int = 256, steps: int = 30) -> dict:
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device", "table": "**5. GPU: ResNet-18 CIFAR-10**\n\nskipped: no CUDA device"}
    device = torch.device("cuda", 0)
    name = torch.cuda.get_device_name(device)
    peaks = train_utils.gpu_peak(name)  # the kit's table: (bf16, tf32) dense FLOP/s
    x8 = torch.randint(0, 256, (batch_size, 3, 32, 32), dtype=torch.uint8, device=device)
    y = torch.randint(0, 10, (batch_size,), device=device)
    results = []
    for label, amp, channels_last, compiled in GPU_VARIANTS:
        try:
            run = _gpu_variant(amp, channels_last, compiled, x8, y, steps)
        except Exception as exc:  # record, do not invent a number
            results.append({"variant": label, "error": f"{type(exc).__name__}: {exc}"[:300]})
            continue
        achieved = run["flops"] / run["seconds"]
        peak = None if peaks is None else (peaks[0] if amp else peaks[1])
        results.append({"variant": label, "images_per_s": batch_size / run["seconds"],
                        "flops_per_step": run["flops"], "achieved_tflops": achieved / 1e12,
                        "peak_tflops": peak / 1e12 if peak else None,
                        "fraction_of_peak": achieved / peak if peak else None,
                        "peak_memory_mib": run["peak_memory_mib"]})
    rows = [[r["variant"], r.get("images_per_s", r.get("error")), r.get("achieved_tflops", "-"),
             r.get("peak_tflops") or "unknown",
             f"{r['fraction_of_peak']:.1%}" if r.get("fraction_of_peak") else "-",
             r.get("peak_memory_mib", "-")] for r in results]
    text = table(f"5. GPU: ResNet-18, CIFAR-10-shaped batches of {batch_size} on {name} "
                 f"(augmentation on the device included)",
                 ["variant", "images/s", "achieved TFLOP/s", "peak TFLOP/s (dense)", "fraction of peak",
                  "peak memory MiB"], rows)
    return {"device": name, "batch_size": batch_size, "results": results, "table": text}


# --------------------------------------------------------------------------
# 6. FSDP vs DDP: step time and memory per rank, world size 2
# --------------------------------------------------------------------------

FSDP_CASES = [("mnist cnn", "mnist", "cnn", (32, 1, 28, 28)),
              ("cifar10 resnet18", "cifar10", "resnet18", (16, 3, 32, 32))]


def _fsdp_vs_ddp_case(dataset: str, model_name: str, shape: tuple, device: torch.device, rank: int,
                      steps: int, reps: int) -> dict:
    """One model's median step time and training state per rank, DDP and FSDP;
    on CUDA also each one's peak GPU memory (collectives: every rank calls this)."""
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(shape, generator=g).to(device)
    y = torch.randint(0, 10, (shape[0],), generator=g).to(device)
    step, state = {}, {}
    for kind in ("DDP", "FSDP"):
        torch.manual_seed(0)
        model = build_model(dataset, model_name).to(device)
        model = ddp(model, device) if kind == "DDP" else train.shard_model(model, device, dtype=None)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        step[kind] = train_step(model, opt, F.cross_entropy, x, y)
        step[kind]()  # gradients and momentum buffers exist from here on
        state[kind] = train_utils.training_state_bytes(model, opt)

    def block(kind: str) -> float:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        seconds = timed(step[kind], steps, device, barrier=True)
        state[kind].update(train_utils.peak_memory_mib(device))  # {} on a CPU
        return seconds

    times = interleaved({kind: functools.partial(block, kind) for kind in step}, reps)
    return {**{f"{kind}_step_ms": statistics.median(t) * 1e3 for kind, t in times.items()},
            **{f"{kind}_state_bytes": state[kind]["total"] for kind in state},
            **{f"{kind}_peak_gpu_memory_mib": state[kind].get("peak_gpu_memory_mib") for kind in state}}


def _fsdp_vs_ddp_worker(rank: int, world_size: int, port: int, steps: int, reps: int, out: str):
    device = train_utils.device_for(rank)
    with process_group(rank, world_size, port, device):
        results = [{"case": label, "batch_per_rank": shape[0],
                    **_fsdp_vs_ddp_case(dataset, model_name, shape, device, rank, steps, reps)}
                   for label, dataset, model_name, shape in FSDP_CASES]
        if rank == 0:
            torch.save(results, out)


def section_fsdp(steps: int = 10, reps: int = 5) -> dict:
    out = os.path.join(tempfile.mkdtemp(), "fsdp.pt")
    mp.spawn(_fsdp_vs_ddp_worker, args=(2, free_port(), steps, reps, out), nprocs=2)
    results = torch.load(out)
    backend = backend_for()
    cuda = torch.cuda.is_available()
    rows = [[r["case"], r["batch_per_rank"], r["DDP_step_ms"], r["FSDP_step_ms"],
             r["FSDP_step_ms"] / r["DDP_step_ms"], r["DDP_state_bytes"] / 2**20,
             r["FSDP_state_bytes"] / 2**20, r["DDP_state_bytes"] / r["FSDP_state_bytes"]]
            + ([r["DDP_peak_gpu_memory_mib"], r["FSDP_peak_gpu_memory_mib"]] if cuda else [])
            for r in results]
    text = table(f"6. FSDP (train.shard_model) vs DDP, world size 2, {backend}: median "
                 f"step time over {reps} blocks of {steps} steps; training state per rank "
                 f"(params + grads + SGD momentum, the largest rank)",
                 ["model", "batch per rank", "DDP step ms", "FSDP step ms", "FSDP / DDP time",
                  "DDP state MiB", "FSDP state MiB", "DDP / FSDP state"]
                 + (["DDP peak GPU MiB", "FSDP peak GPU MiB"] if cuda else []), rows)
    return {"results": results, "backend": backend, "table": text}


# --------------------------------------------------------------------------
# 8. A language model: the kit's tokens/s and FLOP/s; nanoGPT's own train.py
# --------------------------------------------------------------------------

CORPUS = REPO.parent / "shared" / "data" / "tinyshakespeare" / "input.txt"
# nanoGPT's CPU recipe (its README), which --dataset shakespeare_char trains by default.
NANOGPT_CPU_RECIPE = ["config/train_shakespeare_char.py", "--device=cpu", "--compile=False", "--dtype=float32",
                      "--block_size=64", "--batch_size=12", "--n_layer=4", "--n_head=4", "--n_embd=128",
                      "--lr_decay_iters=2000", "--dropout=0.0", "--log_interval=1", "--eval_iters=20",
                      "--eval_interval=100000", "--always_save_checkpoint=False"]
NANOGPT_ITER = re.compile(r"^iter (\d+): loss \S+, time (\S+)ms", re.M)
STATE_LINE = re.compile(r"state per rank: .* \((?P<fsdp>\d+) bytes, rank \d+ of \d+\); DDP would hold .* "
                        r"\((?P<ddp>\d+) bytes\)")


def matmul_flops_per_s(threads: int, n: int = 1024, reps: int = 10) -> float:
    """fp32 FLOP/s of an n x n by n x n matmul (2 n^3 FLOPs) on this CPU with
    ``threads`` threads, the best of ``reps``: what the machine's matrix
    kernels reach, the yardstick of a CPU's FLOP/s where no data sheet says."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b  # warm-up
        best = min(timed(lambda: a @ b, 3) for _ in range(reps))
    finally:
        torch.set_num_threads(before)
    return 2 * n ** 3 / best


def _corpus_dir(root: Path) -> Path:
    """A --data_dir holding the shared corpus as shakespeare_char/input.txt."""
    (root / "shakespeare_char").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(CORPUS, root / "shakespeare_char" / "input.txt")
    return root


def _child_cpu_seconds() -> float:
    """User + system CPU seconds of this process's finished (waited-for) descendants."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _timed_run(cmd: list, cwd: Path, threads: int) -> tuple[str, float]:
    """``cmd``'s stdout and the CPU seconds it and its descendants used, with OMP_NUM_THREADS=``threads``."""
    before = _child_cpu_seconds()
    out = subprocess.run([str(c) for c in cmd], cwd=cwd, check=True, capture_output=True, text=True,
                         env=script_env(OMP_NUM_THREADS=str(threads)))
    return out.stdout, _child_cpu_seconds() - before


def _per_step_cpu(run_for, steps: int) -> tuple:
    """(what ``run_for(steps)`` returned, CPU seconds per training step): ``run_for(n)``
    runs a whole program for n steps and returns (result, CPU seconds); the CPU
    seconds of a run of ``steps // 5`` steps are subtracted, so start-up and
    evaluation (the same in both) drop out. CPU time, not wall time: on a shared
    machine the time the scheduler gives other processes counts against neither."""
    short_steps = max(1, steps // 5)
    _, short = run_for(short_steps)
    result, full = run_for(steps)
    return result, (full - short) / (steps - short_steps)


def _kit_lm_run(data: Path, nproc: int, strategy: str, checkpointing: bool, steps: int, threads: int) -> dict:
    """train.py --dataset shakespeare_char (the task's recipe: nanoGPT's CPU one) for
    ``steps`` optimizer steps on ``nproc`` processes of ``threads`` threads each
    (OMP_NUM_THREADS): its epoch record (tokens_per_s, flops_per_s, mfu on a GPU),
    CPU seconds per step of all processes together (``_per_step_cpu``) and, under
    FSDP, the training state per rank it printed, FSDP's and DDP's."""
    def run_for(n: int) -> tuple:
        cwd = Path(tempfile.mkdtemp())
        cmd = TORCHRUN + ["--standalone", f"--nproc_per_node={nproc}", REPO / "train.py",
                          "--dataset", "shakespeare_char", "--data_dir", data, "--max_steps", str(n),
                          "--strategy", strategy, "--metrics_path", "m.jsonl"]
        stdout, cpu = _timed_run(cmd + (["--activation_checkpointing"] if checkpointing else []), cwd, threads)
        records = [json.loads(line) for line in (cwd / "m.jsonl").read_text().splitlines()]
        shutil.rmtree(cwd, ignore_errors=True)
        return ([r for r in records if "epoch" in r][-1], STATE_LINE.search(stdout)), cpu

    (record, state), cpu_per_step = _per_step_cpu(run_for, steps)
    return {**{key: record.get(key) for key in ("tokens_per_s", "flops_per_s", "mfu", "train_loss",
                                                "peak_gpu_memory_mib")},
            "tokens_per_cpu_s": nproc * 12 * 64 / cpu_per_step,
            "fsdp_state_bytes": int(state["fsdp"]) if state else None,
            "ddp_state_bytes": int(state["ddp"]) if state else None}


def _nanogpt_folder(nanogpt: Path) -> Path:
    """A temporary copy of nanoGPT's train.py, model.py, configurator.py and its
    shakespeare_char config, with the shared corpus in its data format (what its
    data/shakespeare_char/prepare.py writes: the sorted characters as ids, uint16,
    the first 90% train.bin, the rest val.bin, meta.pkl)."""
    import pickle

    import numpy as np

    folder = Path(tempfile.mkdtemp(prefix="nanogpt-"))
    for name in ("train.py", "model.py", "configurator.py", "config/train_shakespeare_char.py"):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(nanogpt / name, folder / name)
    text = CORPUS.read_text(encoding="utf-8")
    chars = sorted(set(text))
    ids = {char: i for i, char in enumerate(chars)}
    data = folder / "data" / "shakespeare_char"
    data.mkdir(parents=True)
    split = int(len(text) * 0.9)
    for name, part in (("train.bin", text[:split]), ("val.bin", text[split:])):
        np.array([ids[c] for c in part], dtype=np.uint16).tofile(data / name)
    with open(data / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": ids}, f)
    return folder


def _nanogpt_run(folder: Path, steps: int, threads: int) -> dict:
    """nanoGPT's train.py on its CPU recipe for ``steps`` iterations, ``threads``
    threads: tokens/s over its iterations 1..steps from the times it prints
    (iteration 0, which holds its first evaluation, left out), and tokens per
    CPU second (``_per_step_cpu``)."""
    def run_for(n: int) -> tuple:
        stdout, cpu = _timed_run([sys.executable, "train.py", *NANOGPT_CPU_RECIPE, f"--max_iters={n}"], folder,
                                 threads)
        return [float(ms) / 1e3 for iteration, ms in NANOGPT_ITER.findall(stdout) if int(iteration) >= 1], cpu

    times, cpu_per_step = _per_step_cpu(run_for, steps)
    return {"tokens_per_s": len(times) * 12 * 64 / sum(times), "tokens_per_cpu_s": 12 * 64 / cpu_per_step}


LM_CASES = [(1, "ddp", False), (1, "ddp", True), (1, "fsdp", False), (2, "ddp", False), (2, "ddp", True),
            (2, "fsdp", False), (2, "fsdp", True)]


def _lm_versus_nanogpt(data: Path, nanogpt: str, steps: int, reps: int, threads: int) -> dict:
    """The kit's 1 process against nanoGPT's own train.py (a temporary copy of
    the checkout ``nanogpt``) on the same recipe, model, data and ``threads``,
    ``reps`` interleaved pairs: their tokens per CPU second and tokens/s."""
    folder = _nanogpt_folder(Path(nanogpt))
    pairs = interleaved({"kit": lambda: _kit_lm_run(data, 1, "ddp", False, steps, threads),
                         "nanoGPT": lambda: _nanogpt_run(folder, steps, threads)}, reps)
    shutil.rmtree(folder, ignore_errors=True)
    ratios = {key: statistics.median(k[key] / n[key] for k, n in zip(pairs["kit"], pairs["nanoGPT"]))
              for key in ("tokens_per_cpu_s", "tokens_per_s")}
    text = table(
        f"8a. train.py vs nanoGPT's own train.py: the same recipe, model, data, 1 process of {threads} "
        f"thread(s), {steps} steps each, {reps} interleaved pairs",
        ["pair", "kit tokens per CPU s", "nanoGPT tokens per CPU s", "kit / nanoGPT (CPU time)",
         "kit tokens/s (wall)", "nanoGPT tokens/s (wall)", "kit / nanoGPT (wall)"],
        [[i + 1, k["tokens_per_cpu_s"], n["tokens_per_cpu_s"], k["tokens_per_cpu_s"] / n["tokens_per_cpu_s"],
          k["tokens_per_s"], n["tokens_per_s"], k["tokens_per_s"] / n["tokens_per_s"]]
         for i, (k, n) in enumerate(zip(pairs["kit"], pairs["nanoGPT"]))]
        + [["median", "", "", ratios["tokens_per_cpu_s"], "", "", ratios["tokens_per_s"]]])
    return {"nanogpt_pairs": pairs, "kit_over_nanogpt": ratios, "table": text}


def section_lm(nanogpt: str = None, steps: int = 200, reps: int = 2, threads: int = 1) -> dict:
    """The kit on --dataset shakespeare_char: with a nanoGPT checkout first its
    own train.py against the kit's 1 process (``_lm_versus_nanogpt``, ``threads``
    threads each: 1 makes CPU time compute time, no thread waiting for another);
    then tokens/s and FLOP/s for each of ``LM_CASES`` (processes, strategy,
    activation checkpointing; ``threads`` threads per process), on a CPU their
    share of as many processes' matmul FLOP/s, the training state per rank."""
    if not CORPUS.exists():
        return {"skipped": f"no corpus at {CORPUS}"}
    data = _corpus_dir(Path(tempfile.mkdtemp()))
    report = {"steps": steps}
    versus = ("nanoGPT comparison: skipped (pass --nanogpt PATH, a checkout of karpathy/nanoGPT)" if not nanogpt
              else None)
    if nanogpt:
        report.update(_lm_versus_nanogpt(data, nanogpt, steps, reps, threads))
        versus = report.pop("table")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    matmul = None if gpus else matmul_flops_per_s(threads)  # what ``threads`` threads of one process reach
    results = []
    for nproc, strategy, checkpointing in LM_CASES:
        if gpus and nproc > gpus:
            continue
        run = _kit_lm_run(data, nproc, strategy, checkpointing, steps, threads)
        results.append({"processes": nproc, "strategy": strategy, "activation_checkpointing": checkpointing,
                        **run, "of_matmul": run["flops_per_s"] / (nproc * matmul) if matmul else None})
    rows = [[r["processes"], r["strategy"], "yes" if r["activation_checkpointing"] else "no", r["tokens_per_s"],
             r["flops_per_s"] / 1e9, f"{r['of_matmul']:.1%}" if r["of_matmul"] else
             (f"MFU {r['mfu']:.1%}" if r.get("mfu") else "-"), r["tokens_per_cpu_s"],
             f"{r['fsdp_state_bytes']:,}" if r["fsdp_state_bytes"] else "-",
             f"{r['ddp_state_bytes']:,}" if r["ddp_state_bytes"] else "-"] for r in results]
    yardstick = (f"{threads} thread(s) per process; the yardstick: {matmul / 1e9:.1f} GFLOP/s of a 1024x1024 "
                 f"fp32 matmul per process" if matmul else "GPU")
    text = table(f"8b. Language model: train.py --dataset shakespeare_char (nanoGPT's CPU recipe: 4 layers, "
                 f"4 heads, 128 wide, context 64, batch 12 per process), {steps} steps; {yardstick}",
                 ["processes", "strategy", "activation checkpointing", "tokens/s (the kit's line)",
                  "model GFLOP/s", "of matmul FLOP/s (CPU) / MFU (GPU)", "tokens per CPU second",
                  "FSDP state bytes per rank", "DDP state bytes per rank"], rows)
    report.update(results=results, matmul_flops_per_s=matmul, table=versus + "\n\n" + text)
    return report

# --------------------------------------------------------------------------

def section_snapshot_save(save_dir: str = None, sizes_mib=(64, 256, 1024), reps: int = 3) -> dict:
    """How fast a snapshot reaches the disk: ``train_utils.atomic_save`` (torch.save
    to a temporary file, fsync, rename) of fp32 tensors of each size, in
    ``save_dir`` (the storage snapshots go to; default a temporary folder),
    median of ``reps``. And what that rate means for a stop: the largest model
    whose snapshot (weights + optimizer state, 4 bytes each per parameter and
    state) is written within 25 s, which is what is left of Slurm's default
    KillWait (30 s) after ~5 s for the step under way and the one after it
    (docs/slurm.md)."""
    folder = tempfile.mkdtemp(dir=save_dir, prefix="save-bench-")
    rows, rates = [], []
    try:
        for mib in sizes_mib:
            state = {"weights": torch.ones(mib * 2**20 // 4)}  # fp32: 4 bytes each
            path = os.path.join(folder, "snapshot.pt")
            times = []
            for _ in range(reps):
                start = time.perf_counter()
                train_utils.atomic_save(state, path)
                times.append(time.perf_counter() - start)
            seconds = statistics.median(times)
            rates.append(mib / seconds)
            rows.append([f"{mib} MiB", f"{seconds:.2f}", f"{mib / seconds:.0f}"])
            os.remove(path)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    rate = min(rates)  # MiB/s: the slowest of the sizes, the safe figure
    budget_s = 25.0
    fits = {name: rate * 2**20 * budget_s / per_param / 1e6
            for name, per_param in (("SGD with momentum", 8), ("AdamW", 12))}
    note = (f"Within {budget_s:.0f} s at {rate:.0f} MiB/s: " +
            "; ".join(f"{name}: {millions:,.0f} M parameters" for name, millions in fits.items()))
    return {"rate_mib_per_s": rate, "fits_millions_of_parameters": fits,
            "table": table("7. snapshot save rate (atomic_save: write, fsync, rename; "
                           f"{save_dir or 'a temporary folder'})",
                           ["snapshot", "s", "MiB/s"], rows) + "\n\n" + note}


# --------------------------------------------------------------------------
# 9. Snapshots that do not stop training: blocking seconds and throughput
# --------------------------------------------------------------------------

# An MLP of 12.6 M parameters: with SGD momentum about 100 MB of training
# state (weights 50 MB + momentum 50 MB), the size the target is set for.
SNAPSHOT_WIDTH, SNAPSHOT_LAYERS, SNAPSHOT_BATCH = 2048, 3, 64


def _snapshot_model(device: torch.device, strategy: str) -> tuple:
    """The section's model (DDP-wrapped, or sharded as train.py --strategy fsdp
    does), its SGD optimizer with momentum, and one training step of it."""
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(SNAPSHOT_WIDTH, SNAPSHOT_WIDTH), torch.nn.ReLU())
              for _ in range(SNAPSHOT_LAYERS)]
    model = torch.nn.Sequential(*layers).to(device)
    model = ddp(model, device) if strategy == "ddp" else train.shard_model(model, device, dtype=None)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    x = torch.randn(SNAPSHOT_BATCH, SNAPSHOT_WIDTH, device=device)
    return model, optimizer, train_step(model, optimizer, F.mse_loss, x, torch.zeros_like(x))


def _snapshot_saver(model, optimizer, strategy: str, asynchronous: bool, folder: str, groups: tuple):
    """save(n): the n-th snapshot of ``model`` and ``optimizer`` into ``folder``,
    as train.py's Trainer._save writes it (rank 0 a file for DDP; every rank its
    shards, then rank 0 the meta file, for FSDP); asynchronous: the CPU copy or
    DCP's staging here, the write in a background thread. Returns the saver and
    its ``SnapshotWriter``."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    import torch.distributed.checkpoint as dcp

    writer, rank, numbers = train_utils.SnapshotWriter(asynchronous), dist.get_rank(), itertools.count()

    def save(_index: int) -> None:
        writer.wait()
        n = next(numbers)  # a new folder each time, as train.py's
        if strategy == "ddp":
            if rank == 0:
                state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict()}
                state = train_utils.cpu_copy(state) if asynchronous else state
                writer.start(lambda: train_utils.atomic_save(state, os.path.join(folder, "snapshot.pt")), str(n))
            return
        target = os.path.join(folder, f"save-{n}")
        parts = list(zip(get_state_dict(model, optimizer), ("model", "optimizer"), groups))
        pending = ([train_utils.dcp_async_save(part, os.path.join(target, name), group) for part, name, group in parts]
                   if asynchronous else [dcp.save(part, checkpoint_id=os.path.join(target, name))
                                         for part, name, _ in parts])

        def complete() -> None:
            for one in pending:
                train_utils.dcp_result(one)
            if rank == 0:
                train_utils.atomic_save({"n": n}, os.path.join(target, "meta.pt"))
                if n:
                    shutil.rmtree(os.path.join(folder, f"save-{n - 1}"), ignore_errors=True)

        writer.start(complete, str(n))

    return save, writer


def _snapshot_block(step, save, writer, steps: int, every: int, device: torch.device) -> dict:
    """``steps`` training steps, a snapshot before every ``every``-th (none when
    0), the last write waited for: wall seconds, CPU seconds of this process
    (its threads together: the background writer's too), and the seconds each
    snapshot held the training thread (the call, and the wait for the one
    before)."""
    blocked = []
    _synchronize(device)
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    for index in range(steps):
        if every and index % every == 0:
            began = time.perf_counter()
            _synchronize(device)  # the state as of the step before
            save(index // every)
            blocked.append(time.perf_counter() - began)
        step()
    began = time.perf_counter()
    writer.wait()
    if blocked:
        blocked[-1] += time.perf_counter() - began
    _synchronize(device)
    return {"seconds": time.perf_counter() - start, "cpu_seconds": time.process_time() - cpu, "blocked": blocked}


def _snapshot_cost_worker(rank: int, world_size: int, port: int, device_type: str, reps: int,
                          snapshots: int, out: str):
    device = torch.device(device_type, rank) if device_type == "cuda" else CPU
    with process_group(rank, world_size, port, device):
        groups = (train_utils.gloo_group(), train_utils.gloo_group())  # the async saves' own CPU groups
        folder = os.path.join(os.path.dirname(out), "saves")  # one for every rank, as --snapshot_path is
        results = []
        for strategy in ("ddp", "fsdp"):
            os.makedirs(folder, exist_ok=True)
            dist.barrier()
            model, optimizer, step = _snapshot_model(device, strategy)
            savers = {mode: _snapshot_saver(model, optimizer, strategy, mode == "async", folder, groups)
                      for mode in ("sync", "async")}
            step_s = timed(step, 3, device, barrier=True)  # warm-up, then a step's time
            step_s = timed(step, 5, device, barrier=True)
            write = _snapshot_block(step, *savers["sync"], 1, 1, device)["seconds"]  # one synchronous save
            # The interval between snapshots: long enough for a write to end before the next is due.
            every = torch.tensor(max(5, round(max(3.0, 3 * write) / step_s)), device=device)
            dist.all_reduce(every, op=dist.ReduceOp.MAX)  # rank 0's write is the DDP save: all agree on it
            every = int(every)
            steps = every * snapshots
            blocks = {"none": functools.partial(_snapshot_block, step, *savers["sync"], steps, 0, device),
                      **{mode: functools.partial(_snapshot_block, step, *savers[mode], steps, every, device)
                         for mode in ("sync", "async")}}
            times = interleaved(blocks, reps)
            dist.barrier()
            if rank == 0:
                shutil.rmtree(folder, ignore_errors=True)
            results.append({"strategy": strategy, "step_s": step_s, "every_steps": every, "steps": steps,
                            "times": times})
        if rank == 0:
            torch.save(results, out)
        else:  # rank 0 keeps its own blocking figures; the slowest rank's hold everyone
            torch.save(results, out + f".{rank}")


def _snapshot_row(result: dict, others: list, state_mib: float) -> dict:
    """One strategy's figures, from every rank's blocks: blocking seconds per
    snapshot (median over snapshots of the slowest rank's); the throughput
    cost with a snapshot every interval (median block time over none's, wall
    time of rank 0 and CPU time of all ranks together: on a busy machine the
    CPU time counts none of the other processes' time), and that cost scaled
    to one snapshot a minute (times the interval in seconds, over 60)."""
    row = {"strategy": result["strategy"], "step_s": result["step_s"], "every_steps": result["every_steps"],
           "state_mib": state_mib}
    every_rank = [result] + others

    def median_of(mode: str, key: str) -> float:
        return sum(statistics.median(block[key] for block in r["times"][mode])
                   for r in (every_rank if key == "cpu_seconds" else [result]))

    base = median_of("none", "seconds")
    row["interval_s"] = base / result["steps"] * result["every_steps"]
    for mode in ("sync", "async"):
        per_rank = [r["times"][mode] for r in every_rank]
        blocked = [max(values) for values in zip(*(sum((b["blocked"] for b in blocks), []) for blocks in per_rank))]
        cost, cpu_cost = (median_of(mode, key) / median_of("none", key) - 1 for key in ("seconds", "cpu_seconds"))
        row.update({f"{mode}_blocked_s": statistics.median(blocked), f"{mode}_cost": cost,
                    f"{mode}_cpu_cost": cpu_cost, f"{mode}_cost_per_minute": cost * row["interval_s"] / 60,
                    f"{mode}_cpu_cost_per_minute": cpu_cost * row["interval_s"] / 60})
    return row


def section_snapshot_cost(device_type: str = None, reps: int = 3, snapshots: int = 3) -> dict:
    """Blocking seconds per snapshot, synchronous vs asynchronous (train.py's
    default), DDP file and FSDP shards, of about 100 MB of training state at
    world size 2 (on CUDA: one process per GPU, at most 2); and the training
    throughput with a snapshot every interval (at least 3 s and 3 writes long,
    so that a write ends before the next is due) against none, ``reps``
    interleaved blocks of ``snapshots`` intervals each. The cost of one
    snapshot a minute: the extra seconds per snapshot over 60 s."""
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    world_size = 2 if device_type == "cpu" else min(2, torch.cuda.device_count())
    out = os.path.join(tempfile.mkdtemp(dir=os.environ.get("SNAPSHOT_BENCH_DIR")), "snapshot_cost.pt")
    try:
        mp.spawn(_snapshot_cost_worker, args=(world_size, free_port(), device_type, reps, snapshots, out),
                 nprocs=world_size)
        results = torch.load(out)
        others = [torch.load(out + f".{rank}") for rank in range(1, world_size)]
    finally:
        shutil.rmtree(os.path.dirname(out), ignore_errors=True)
    params = SNAPSHOT_LAYERS * (SNAPSHOT_WIDTH + 1) * SNAPSHOT_WIDTH
    rows = [_snapshot_row(result, [other[i] for other in others], params * 8 / 2**20)
            for i, result in enumerate(results)]
    text = table(f"9. Snapshot cost: {params / 1e6:.1f} M-parameter MLP, SGD momentum (training state "
                 f"{params * 8 / 1e6:.0f} MB), world size {world_size}, {device_type}; blocking: seconds a "
                 f"snapshot holds the training loop (median); cost: throughput lost with a snapshot every "
                 f"interval, and at one a minute (target <= 2%)",
                 ["strategy", "step s", "interval s", "sync blocking s", "async blocking s",
                  "sync cost at interval (wall; CPU)", "async cost at interval (wall; CPU)",
                  "sync cost, 1/min (wall; CPU)", "async cost, 1/min (wall; CPU)"],
                 [[r["strategy"], r["step_s"], r["interval_s"], r["sync_blocked_s"], r["async_blocked_s"]]
                  + [f"{r[mode + '_cost' + scale]:.1%}; {r[mode + '_cpu_cost' + scale]:.1%}"
                     for scale in ("", "_per_minute") for mode in ("sync", "async")] for r in rows])
    return {"results": rows, "world_size": world_size, "device": device_type, "table": text}


def gpus_missing(processes: int) -> str:
    """Why a section of ``processes`` processes, one GPU each, cannot run on this
    machine ('' when it can): on CUDA each process needs a GPU of its own; on a
    CPU any number runs (gloo)."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus and processes > gpus:
        return f"needs {processes} GPUs (one per process), this machine has {gpus}"
    return ""


def run_section(key: str, name: str, fn, processes: int = 1) -> dict:
    """Run one section, ``fn() -> dict`` with a "table"; return its result with
    "section_seconds". A section this machine cannot run (``gpus_missing``) is
    not started: {"skipped": reason}. One that raises is recorded, not
    re-raised: {"error": "<type>: <first line>"}, so the sections after it run."""
    start = time.perf_counter()
    missing = gpus_missing(processes)
    if missing:
        result = {"skipped": missing}
    else:
        try:
            result = fn()
        except Exception as exc:  # recorded; the other sections still run
            first = (str(exc).strip().splitlines() or [""])[0]
            result = {"error": f"{type(exc).__name__}: {first}"[:500]}
    result["section_seconds"] = time.perf_counter() - start
    if "table" not in result:
        why = f"skipped: {result['skipped']}" if "skipped" in result else f"failed: {result.get('error')}"
        result["table"] = f"**{key}. {name}**\n\n{why}"
    return result


def run_sections(sections: list, report: dict, out: str) -> None:
    """Run ``sections`` ((key, name, fn, processes) each) in order with
    ``run_section``, printing each table and rewriting ``out`` (JSON) after
    each: a later section that dies loses only its own numbers."""
    for key, name, fn, processes in sections:
        result = run_section(key, name, fn, processes)
        result["load_avg_1min_after"] = round(os.getloadavg()[0], 2)
        report["sections"][name] = result
        print("\n" + result["table"], flush=True)
        print(f"\n({result['section_seconds']:.0f} s; load average after: "
              f"{result['load_avg_1min_after']} on {os.cpu_count()} cores)", flush=True)
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(report, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", default=None, help="sections to run: 1 1b 2 3 4 5 6 7 8 9")
    parser.add_argument("--save_dir", default=None,
                        help="section 7: the folder whose storage to time (where your snapshots go); "
                             "default: a temporary folder")
    parser.add_argument("--nanogpt", default=None,
                        help="section 8: a checkout of github.com/karpathy/nanoGPT, whose train.py runs on the "
                             "same recipe as the kit's for the comparison (copied to a temporary folder)")
    parser.add_argument("--lm_steps", type=int, default=200, help="section 8: optimizer steps per run")
    parser.add_argument("--lm_threads", type=int, default=1,
                        help="section 8: threads per process (the kit's and nanoGPT's)")
    parser.add_argument("--snapshot_device", choices=("cpu", "cuda"), default=None,
                        help="section 9: where the model trains (default: cuda where there is a GPU, else cpu); "
                             "its snapshots go to $SNAPSHOT_BENCH_DIR (default: a temporary folder)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "latest.json"),
                        help="where to write the JSON results")
    args = parser.parse_args()
    wanted = set(args.only) if args.only else {"1", "1b", "2", "3", "4", "5", "6", "7", "8", "9"}
    report = {"machine": machine(), "sections": {}}
    m = report["machine"]
    print(f"machine: {m['cpu']}, {m['cpu_cores']} cores; torch {m['torch']}; "
          f"CUDA device: {m['cuda_device'] or 'none'}; load avg at start: {m.get('load_avg_1min_at_start')}",
          flush=True)
    mnist = None
    if wanted & {"3", "4"}:
        try:
            mnist = build_mnist_root(Path(tempfile.mkdtemp()) / "mnist")
        except BaseException as exc:  # build_mnist_root skips (pytest.skip) without the files
            print(f"sections 3 and 4 skipped: real MNIST digits not found ({exc})", flush=True)
    sections = [("1", "overhead", section_overhead, 1), ("1b", "amp_cpu", section_amp_cpu, 1),
                ("2", "input_pipeline", section_input, 1),
                ("3", "scaling", lambda: section_scaling(mnist) if mnist else {"skipped": "no MNIST"}, 1),
                ("4", "time_to_accuracy",
                 lambda: section_time_to_accuracy(mnist) if mnist else {"skipped": "no MNIST"}, 2),
                ("5", "gpu", section_gpu, 1), ("6", "fsdp_vs_ddp", section_fsdp, 2),
                ("7", "snapshot_save", lambda: section_snapshot_save(args.save_dir), 1),
                ("8", "language_model", lambda: section_lm(args.nanogpt, args.lm_steps, threads=args.lm_threads), 1),
                ("9", "snapshot_cost", lambda: section_snapshot_cost(args.snapshot_device), 1)]
    run_sections([s for s in sections if s[0] in wanted], report, args.out)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
