"""Text out: what a task's trained model writes (``common.Task.sample_text``,
a language model's sample as its task's flags ask), printed after training
and on a rerun of a finished run.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..output import print_line


def print_sample(model: torch.nn.Module, task, device: torch.device, fsdp: bool) -> None:
    """Print what ``model`` writes (``task.sample_text(model, device)``: a
    header line and the text), from rank 0; nothing for a task that writes
    nothing (``sample_text`` None). ``fsdp``: collective, every rank runs
    the sampling (each forward all-gathers); else rank 0 alone runs it
    (pass the plain model, not DDP's wrapper)."""
    if task.sample_text is None:
        return
    rank = dist.get_rank()
    if rank != 0 and not fsdp:
        return
    text = task.sample_text(model, device)
    if fsdp:
        model.reshard()  # the root stays gathered after a forward without backward: free it
    if rank == 0:
        print_line(text)
