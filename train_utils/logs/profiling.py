"""--profile_dir: torch.profiler over a few training steps on every rank,
one trace per rank, which Perfetto and chrome://tracing open.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from common import ConfigError
from ..output import output_path_error, print_line

# The profiler's schedule, in training steps (micro-batches) of this start:
# the first is skipped (one-time set-up: lazy allocations, DDP's first
# buckets, torch.compile), the second warms the profiler up, the next five
# are recorded (four step boundaries: where a GPU waits between steps shows).
# A start with fewer than 7 steps writes no trace.
WAIT, WARMUP, ACTIVE = 1, 1, 5


class StepProfiler:
    """Records steps WAIT + WARMUP + 1 to WAIT + WARMUP + ACTIVE of this start
    with ``torch.profiler`` when ``folder`` (--profile_dir) is given; with
    None, ``step`` does nothing.

    Activities: the CPU, and CUDA kernels when ``device`` is a GPU; input
    shapes are recorded too. After the last recorded step each rank writes
    ``--profile_dir/rank{R}.{timestamp}.pt.trace.json`` (torch's
    ``tensorboard_trace_handler``, a Chrome trace: open it in
    https://ui.perfetto.dev or chrome://tracing; TensorBoard's deprecated
    torch-tb-profiler plugin reads the folder too), rank 0 prints one line,
    and the profiler is gone: later steps cost nothing. It reads no random
    numbers and changes no computation, so a profiled run trains bitwise as
    an unprofiled one. Raises ConfigError (one line) when --profile_dir
    cannot be made or written, before any training.
    """

    def __init__(self, folder: Optional[str], device: torch.device) -> None:
        self.folder = folder
        self.profiler = None
        if not self.folder:
            return
        error = output_path_error("profile_dir", self.folder, folder=True)  # now, not mid-training
        if error:
            raise ConfigError(error)
        self.rank = dist.get_rank()
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.write = torch.profiler.tensorboard_trace_handler(self.folder, worker_name=f"rank{self.rank}")
        self.profiler = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=WAIT, warmup=WARMUP, active=ACTIVE, repeat=1),
            on_trace_ready=self._trace_ready, record_shapes=True)
        self.profiler.start()

    def _trace_ready(self, profiler: torch.profiler.profile) -> None:
        self.write(profiler)
        if self.rank == 0:
            print_line(f"profiler: steps {WAIT + WARMUP + 1}-{WAIT + WARMUP + ACTIVE} of this start traced on "
                       f"every rank, one file per rank in {self.folder} (rank0.*.pt.trace.json, ...): open "
                       f"one in https://ui.perfetto.dev or chrome://tracing")

    def step(self) -> None:
        """Call after each training step (micro-batch), on every rank."""
        if self.profiler is None:
            return
        self.profiler.step()
        if self.profiler.step_num >= WAIT + WARMUP + ACTIVE:  # traced and written
            self.profiler.stop()
            self.profiler = None
