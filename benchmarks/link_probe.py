"""Section 1e, link_probe: what the straggler watch's link probe costs a
run on several hosts (train_utils/loop/links.py).

Two processes on this machine, each taken for a host of its own (the
probe's ``hosts``: ``["a", "b"]``), so that both links between them are
probed as on two hosts, one rank each: ``--calls`` calls of
``LinkProbe.measure`` (both links, in their turns), on the CPU over gloo
and, where there are 2 GPUs, on them over NCCL. The transfer runs over this
machine's loopback, so the figure is the probe's own cost (its messages, its
turns, the waits between them), not a real link's: add 256 KiB at the
link's speed, per link, for a network (0.2 ms at 10 Gb/s).

Reading the table: "ms per probe" is the median wall time of one
``measure`` call on rank 0 (it receives one probe and sends one), "ms per
step" that over ``stragglers.WINDOW_STEPS``, since the watch probes once a
window.

    python -m benchmarks.link_probe [--calls 400]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.harness import CPU, machine, process_group, table  # noqa: E402
from support.runs import free_port  # noqa: E402
from train_utils.loop.links import PROBE_BYTES, LinkProbe  # noqa: E402
from train_utils.loop.stragglers import WINDOW_STEPS  # noqa: E402


def _worker(rank: int, port: int, device_type: str, calls: int, out: dict) -> None:
    """One "host": ``calls`` probes, rank 0's seconds of each into ``out``."""
    device = torch.device(device_type, rank) if device_type == "cuda" else CPU
    with process_group(rank, 2, port, device):
        probe = LinkProbe(["a", "b"], rank, device)
        seconds = []
        for _ in range(calls):
            started = time.perf_counter()
            probe.measure()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds.append(time.perf_counter() - started)
        if rank == 0:
            out[device_type] = seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=400)
    args = parser.parse_args()
    print(machine())
    devices = ["cpu"] + (["cuda"] if torch.cuda.device_count() >= 2 else [])
    rows = []
    with mp.Manager() as manager:
        out = manager.dict()
        for device_type in devices:
            mp.spawn(_worker, args=(free_port(), device_type, args.calls, out), nprocs=2)
            seconds = out[device_type][args.calls // 10:]  # the first tenth: connections made, warm-up
            median = statistics.median(seconds)
            rows.append([device_type, f"{PROBE_BYTES // 1024} KiB", len(seconds), round(1000 * median, 3),
                         round(1000 * median / WINDOW_STEPS, 4)])
    print(table("link probe on loopback, 2 processes as 2 hosts",
                ["device", "probe", "calls timed", "ms per probe", "ms per step"], rows))


if __name__ == "__main__":
    main()
