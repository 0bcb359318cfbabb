"""Section 5, gpu: ResNet-18 training on one GPU, CIFAR-10-shaped batches (CUDA
only; without CUDA the table says "skipped: no CUDA device").

Measures images/s of the CIFAR-stem ResNet-18 at batch 256, augmentation on
the device included, for fp32 (TF32 convolutions), bf16 autocast, bf16 +
channels_last, and + torch.compile; the FLOPs of one step from
``torch.utils.flop_counter`` (forward + backward), and the peak GPU memory of
the timed steps.

Reading the table: "achieved TFLOP/s" is the step's FLOPs over its seconds;
"fraction of peak" divides that by the GPU's dense data-sheet peak
(``train_utils.logs.throughput.gpu_peak``: bf16 for the bf16 rows, TF32 for fp32), "unknown"
for a GPU the kit's table does not know or a MIG slice. A variant that raises
shows its error instead of a number.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import fast_images
import train_utils
from train_utils.logs.throughput import gpu_peak
import vision_tasks
from benchmarks.harness import build_model, synchronize, table, timed, train_step

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
    autocast = train_utils.autocast(device, torch.bfloat16 if amp else None)
    step = train_step(train_utils.compile_model(model, compiled), opt, F.cross_entropy, x8, y,
                      autocast, transform)
    for _ in range(5 if not compiled else 10):  # warm-up (and compile)
        step()
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    seconds = timed(step, steps, device)
    # Read now: the FLOP count below runs the plain (uncompiled) model.
    peak_memory = torch.cuda.max_memory_allocated(device) / 2**20
    with FlopCounterMode(display=False) as counter:  # forward + backward of one step (SGD's update: none)
        train_step(model, opt, F.cross_entropy, x8, y, autocast, transform)()
    return {"seconds": seconds, "flops": counter.get_total_flops(), "peak_memory_mib": peak_memory}


def section_gpu(batch_size: int = 256, steps: int = 30) -> dict:
    """Section 5: for each of ``GPU_VARIANTS``, images/s over ``steps`` steps
    of batch ``batch_size`` on GPU 0 (``_gpu_variant``), the achieved FLOP/s
    and their share of the GPU's dense peak; a variant that raises is recorded
    with its error. Without CUDA: {"skipped": "no CUDA device"}."""
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device", "table": "**5. GPU: ResNet-18 CIFAR-10**\n\nskipped: no CUDA device"}
    device = torch.device("cuda", 0)
    name = torch.cuda.get_device_name(device)
    peaks = gpu_peak(name)  # the kit's table: dense FLOP/s per precision
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
        peak = None if peaks is None else peaks["bf16" if amp else "tf32"]
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
