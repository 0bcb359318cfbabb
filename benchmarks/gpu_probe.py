"""The GPU check's host-to-device probe (``probe``): does copying a pinned
but strided batch to the GPU make the host wait for the GPU?

A language-model batch cut as two views of one (B, T+1) gather
(``rows[:, :-1]``, ``rows[:, 1:]``) is not dense; pinning keeps its strides,
and ``.to(cuda, non_blocking=True)`` of a tensor that is not dense goes
through a contiguous temporary in pageable memory, whose copy may wait for
the work queued on the GPU. The probe queues a sleep on the GPU
(``torch.cuda._sleep``, its cycles calibrated with CUDA events), then times
on the host the call that copies (a) the strided view ``rows[:, 1:]`` of a
pinned (B, T+1) int64 tensor and (b) a dense pinned tensor of the same
shape. A copy that waits takes most of the sleep; one that does not, next
to nothing."""

from __future__ import annotations

import statistics
import time

import torch

from benchmarks.gpu_runs import Budget, Setting

REPEATS = 3  # timings of each copy (their median), each behind a sleep of its own


def cycles_per_second(device: torch.device) -> float:
    """How many ``torch.cuda._sleep`` cycles the GPU runs a second (CUDA events
    around a sleep of 50M cycles, after one to start the clocks)."""
    torch.cuda._sleep(10_000_000)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 50_000_000
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / (start.elapsed_time(end) / 1e3)


def host_seconds(batch: torch.Tensor, device: torch.device, cycles: int) -> float:
    """Seconds the host spends in ``batch.to(device, non_blocking=True)``
    issued behind a GPU sleep of ``cycles``; the GPU's queue empty before and after."""
    torch.cuda.synchronize(device)
    torch.cuda._sleep(cycles)
    start = time.perf_counter()
    batch.to(device, non_blocking=True)
    seconds = time.perf_counter() - start
    torch.cuda.synchronize(device)
    return seconds


def probe(setting: Setting, budget: Budget) -> dict:
    """The probe on the check's GPU, with the GPU recipe's batch shape:
    the sleep's seconds, each copy's host seconds (the median of
    ``REPEATS``), and whether each waits (took over half the sleep).
    Skipped without CUDA."""
    if not setting.cuda:
        return {"skipped": "no CUDA device: the probe times copies to a GPU behind a sleep queued on it"}
    device, sizes = setting.device, setting.sizes
    shape = (sizes.gpt["batch_size"], sizes.gpt["block_size"])
    rows = torch.randint(0, 65, (shape[0], shape[1] + 1), dtype=torch.int64).pin_memory()
    strided = rows[:, 1:]
    dense = torch.empty(shape, dtype=torch.int64).pin_memory()
    dense.copy_(strided)
    rate = cycles_per_second(device)
    cycles = int(rate * sizes.probe_sleep_s)
    for batch in (strided, dense):  # first copies: the allocator, the copy kernels
        batch.to(device, non_blocking=True)
    torch.cuda.synchronize(device)
    times = {"strided": [], "dense": []}
    for _ in range(REPEATS):
        times["strided"].append(host_seconds(strided, device, cycles))
        times["dense"].append(host_seconds(dense, device, cycles))
    strided_s, dense_s = statistics.median(times["strided"]), statistics.median(times["dense"])
    return {"shape": list(shape), "sleep_s": cycles / rate, "sleep_cycles": cycles, "cycles_per_s": rate,
            "strided_s": strided_s, "dense_s": dense_s, "times": times,
            "strided_pinned": strided.is_pinned(), "strided_contiguous": strided.is_contiguous(),
            "strided_copy_waits": strided_s > 0.5 * sizes.probe_sleep_s,
            "dense_copy_waits": dense_s > 0.5 * sizes.probe_sleep_s}
