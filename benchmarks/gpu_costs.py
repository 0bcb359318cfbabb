"""The GPU check's in-process costs: what a snapshot of GPT-2 small costs the
training loop (``snapshot``), and ResNet-18's step in train.py against a bare
loop of the same steps, eager (``resnet``)."""

from __future__ import annotations

import contextlib
import copy
import statistics
import time

import torch
import torch.distributed as dist

from benchmarks.gpu_runs import Budget, Setting
from support.runs import free_port


@contextlib.contextmanager
def one_process_group():
    """A gloo group of this process alone for a with block, where there is none yet."""
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        if own_group:
            dist.destroy_process_group()


def snapshot_cost(setting: Setting, budget: Budget, reps: int = 2) -> dict:
    """What a snapshot of an 85M-parameter GPT (GPT-2 small: 124M with its
    embeddings; AdamW's moments after one step: 1.5 GB of state) costs the
    training loop: the seconds ``Checkpointer.save`` holds it (the kit's
    staging: on CUDA pinned buffers made at the first snapshot and reused,
    the copies queued behind the step), until the copy is in CPU memory, and
    the write; against a copy of each tensor (the staging before: ``.to("cpu")``
    per tensor, blocking, the tied weight twice). Bytes of the file."""
    import train_utils
    from gpt import GPT, GPTConfig
    from benchmarks.harness import Position
    from train_utils.snapshots.writer import CpuStaging

    device = setting.device
    with one_process_group():
        torch.manual_seed(0)
        model = GPT(GPTConfig(**setting.sizes.snapshot_gpt)).to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
        model(torch.randint(0, 100, (1, 8), device=device)).float().mean().backward()
        optimizer.step()
        path = setting.work / "snapshot_cost" / "snapshot.pt"
        path.parent.mkdir()
        position = Position()
        checkpointer = train_utils.Checkpointer(str(path), False, model, optimizer, {}, {"position": position})
        staging = checkpointer.store.staging
        rows = []
        for rep in range(reps):
            _sync(device)
            start = time.perf_counter()
            position.steps_run += 1
            checkpointer.save()
            blocking = time.perf_counter() - start
            copied_at = _wait_copied(staging, start)
            checkpointer.wait()
            rows.append({"snapshot": rep + 1, "blocking_s": blocking, "copied_s": copied_at,
                         "written_s": time.perf_counter() - start})
        old = []
        for _ in range(reps):  # the copy before: each tensor on its own, blocking
            _sync(device)
            start = time.perf_counter()
            copied = _per_tensor_copy({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
            old.append(time.perf_counter() - start)
            del copied
        unique = sum(p.numel() * p.element_size() for p in model.parameters()) * 3
        return {"parameters_without_embeddings": model.num_parameters(embeddings=False),
                "parameters": model.num_parameters(), "state_bytes_unique": unique,
                "file_bytes": path.stat().st_size, "snapshots": rows,
                "per_tensor_copy_s": old, "device": str(device), "staging": type(staging).__name__,
                "pinned": bool(staging._buffers) and all(b.is_pinned() for b in staging._buffers.values())
                if device.type == "cuda" else False, "buffers": len(staging._buffers),
                "cpu_staging": CpuStaging.__name__}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _wait_copied(staging, start: float) -> float:
    """Seconds from ``start`` until the staging's copies are in CPU memory
    (the background writer waits for the same; on a CPU they already are)."""
    for event in list(staging._copied):
        event.synchronize()
    return time.perf_counter() - start


def _per_tensor_copy(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {key: _per_tensor_copy(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_per_tensor_copy(value) for value in obj)
    return obj


def resnet_steps(base: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, amp, setting: Setting) -> dict:
    """{"bare": a bare zero_grad / forward / backward / step on a copy of
    ``base``, "train.py": train.py's ``Trainer.train_step`` on another copy
    (tests/helpers.py's ``kit_trainer``)}, each a function of no arguments
    on the batch (``x``, ``y``), eager, SGD with momentum."""
    import torch.nn.functional as F

    from benchmarks.harness import train_step
    from support.trainer import kit_trainer
    from train_utils import RunConfig, autocast

    steps = {}
    for side in ("bare", "train.py"):
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        if side == "bare":
            dtype = RunConfig(amp=amp).compute_dtype
            steps[side] = train_step(model, opt, F.cross_entropy, x, y, autocast(setting.device, dtype))
        else:
            trainer = kit_trainer(model, opt, F.cross_entropy, str(setting.work), device=setting.device, amp=amp)
            steps[side] = lambda trainer=trainer: trainer.train_step(x, y)
    return steps


def resnet_versus_bare(setting: Setting, budget: Budget) -> dict:
    """ResNet-18 (CIFAR stem), CIFAR-10-shaped batches of ``sizes.resnet_batch``
    on the device, eager (not compiled): train.py's step against a bare loop
    (``resnet_steps``; bf16 autocast and channels-last on CUDA, as train.py
    runs it there), in alternating blocks of ``resnet_steps`` steps, wall
    time with the GPU's queue finished around each block. Also the model
    FLOPs per image counted as train.py counts them, and what they make per
    second."""
    import torch.nn.functional as F

    import common
    import vision_tasks
    from benchmarks.harness import interleaved, timed
    from train_utils.logs.throughput import counted_flops_per_sample, gpu_peak

    sizes, device, cuda = setting.sizes, setting.device, setting.cuda
    with one_process_group():
        torch.manual_seed(0)
        base = vision_tasks.build_model("cifar10", "resnet18").to(device)
        base = base.to(memory_format=torch.channels_last) if cuda else base
        x = torch.randn(sizes.resnet_batch, 3, 32, 32, device=device)
        x = x.to(memory_format=torch.channels_last) if cuda else x
        y = torch.randint(0, 10, (sizes.resnet_batch,), device=device)
        amp = "bf16" if cuda else None
        task = common.Task(torch.utils.data.TensorDataset(x.cpu(), y.cpu()), None, None, base, F.cross_entropy, True)
        flops = counted_flops_per_sample(task, device)
        steps = resnet_steps(base, x, y, amp, setting)
        for step in steps.values():
            for _ in range(3):
                step()
        times = interleaved({side: (lambda fn=fn: timed(fn, sizes.resnet_steps, device)) for side, fn in steps.items()},
                            sizes.resnet_reps)
        best = {side: min(values) for side, values in times.items()}
        ratios = [b / k for b, k in zip(times["bare"], times["train.py"])]
        peaks = gpu_peak(torch.cuda.get_device_name(device)) if cuda else None
        images = {side: sizes.resnet_batch / seconds for side, seconds in best.items()}
        return {"batch": sizes.resnet_batch, "amp": amp, "compiled": False, "images_per_s": images,
                "bare_over_kit_median": statistics.median(ratios), "pair_ratios": ratios,
                "flops_per_image": flops, "kit_flops_per_s": images["train.py"] * flops,
                "kit_mfu": images["train.py"] * flops / peaks["bf16"] if peaks else None}
