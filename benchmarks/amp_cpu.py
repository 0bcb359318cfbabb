"""Section 1b, amp_cpu: bf16 autocast on this CPU, the measurement behind
``--amp``'s CPU rule (train_utils.loop.speed.AMP_HELPS_ON_CPU).

Measures training samples/s of a bare training step with and without bf16
autocast for the synthetic MLP, the MNIST CNN and torchvision's ResNet-18
(ImageNet stem) on random batches, in interleaved repetitions (median).

Reading the table: "speedup" is bf16 samples/s over fp32 samples/s; above 1,
autocast pays on this CPU for that model. The title says whether the CPU has
native bf16 instructions (without them bf16 is emulated and slower) and the
models ``--amp`` is allowed for on a CPU.
"""

from __future__ import annotations

import functools
import statistics

import torch
import torch.nn.functional as F

import train_utils
from train_utils.loop.speed import AMP_HELPS_ON_CPU
from benchmarks.harness import CPU, build_model, interleaved, table, timed, train_step

AMP_CASES = [("synthetic", "mlp", (32, 20), 300), ("mnist", "cnn", (64, 1, 28, 28), 10),
             ("cifar10", "resnet18_imagenet", (64, 3, 32, 32), 2)]


def section_amp_cpu(reps: int = 3) -> dict:
    """Section 1b: samples/s of a bare training step of each of ``AMP_CASES``
    (dataset, model, batch shape, steps per block) in fp32 and under bf16
    autocast, the median of ``reps`` interleaved blocks; whether this CPU has
    native bf16. Returns {"results", "native_bf16", "table"}."""
    results = []
    for dataset, model_name, shape, steps in AMP_CASES:
        torch.manual_seed(0)
        model = build_model(dataset, model_name)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        x = torch.randn(shape)
        y = torch.randn(shape[0], 1) if dataset == "synthetic" else torch.randint(0, 10, (shape[0],))
        loss_fn = F.mse_loss if dataset == "synthetic" else F.cross_entropy
        step = {amp: train_step(model, opt, loss_fn, x, y,
                                train_utils.autocast(CPU, torch.bfloat16 if amp else None))
                for amp in (False, True)}
        for amp in (False, True, False, True):  # warm-up
            step[amp]()
        times = interleaved({amp: functools.partial(timed, step[amp], steps) for amp in step}, reps)
        fp32, bf16 = (shape[0] / statistics.median(times[a]) for a in (False, True))
        results.append({"model": model_name, "batch": shape[0], "fp32_samples_per_s": fp32,
                        "bf16_autocast_samples_per_s": bf16, "speedup": bf16 / fp32})
    native = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    text = table(f"1b. bf16 autocast on this CPU (native bf16: {native}); --amp allowed on a CPU "
                 f"for: {', '.join(AMP_HELPS_ON_CPU)}",
                 ["model", "batch", "fp32 samples/s", "bf16 autocast samples/s", "speedup"],
                 [[r["model"], r["batch"], r["fp32_samples_per_s"], r["bf16_autocast_samples_per_s"],
                   r["speedup"]] for r in results])
    return {"results": results, "native_bf16": native, "table": text}
