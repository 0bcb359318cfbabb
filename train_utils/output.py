"""Printing from several processes that share one terminal or log file, and
the one error that every rank raises alike (``first_error``)."""

from __future__ import annotations

import contextlib
import os
import sys

import torch.distributed as dist


def print_line(line: str, stream=None) -> None:
    """Print ``line`` and its newline in one write to ``stream`` (stdout by
    default), then flush.

    Several ranks often share one terminal or log file; a plain ``print``
    writes the text and the newline separately, so lines of different ranks
    can run into each other. One write of under 4 KiB to a pipe is atomic.
    """
    stream = stream or sys.stdout
    stream.write(line + "\n")
    stream.flush()


def write_from_signal_handler(text: str) -> None:
    """Write ``text`` to stderr from a signal handler: one unbuffered write, so
    that it cannot collide with a print the handler interrupted."""
    with contextlib.suppress(OSError):
        os.write(2, text.encode())


def is_distributed() -> bool:
    """True inside an initialized process group (``dist.init_process_group``)."""
    return dist.is_available() and dist.is_initialized()


def first_error(error: str) -> str:
    """Collective (an all-gather): the first non-empty error of any rank ('' if none)."""
    errors: list = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return next((e for e in errors if e), "")
