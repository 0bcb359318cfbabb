"""Printing from several processes that share one terminal or log file; the
one error that every rank raises alike (``first_error``); whether an output
path can be written (``output_path_error``); a run's failure known well
enough to say what to do (``RunFailed``)."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile

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


def this_rank() -> int:
    """This process's rank: the process group's, or before one exists the
    launcher's (RANK; 0 without a launcher)."""
    return dist.get_rank() if is_distributed() else int(os.environ.get("RANK", "0"))


def first_error(error: str) -> str:
    """Collective (an all-gather): the first non-empty error of any rank ('' if none)."""
    errors: list = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return next((e for e in errors if e), "")


class RunFailed(Exception):
    """A failure that is not the user's input, known well enough to say what
    to do (a full disk at a save): its one line (the message), torchrun's root
    cause, exit status 1 (``errors.one_line_errors``). ``every_rank``: raised
    on every rank alike (rank 0 prints it), else only where it happened (that
    rank prints it)."""

    def __init__(self, line: str, every_rank: bool = False) -> None:
        super().__init__(line)
        self.every_rank = every_rank


def _folder_takes_files(folder: str) -> str:
    """'' when ``folder`` exists (made if missing) and takes new files, else
    why not, truthfully: the part of it that is a file, the folder that could
    not be made, or what creating a file there raised."""
    existing = folder
    while existing and not os.path.exists(existing):  # the nearest part that exists
        existing = os.path.dirname(existing)
    if existing and not os.path.isdir(existing):
        return f"{existing} is a file, not a folder"
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        return f"cannot create folder {folder} ({exc.strerror or type(exc).__name__})"
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        return (f"folder {folder} takes no new files (creating one fails: "
                f"{exc.strerror or type(exc).__name__})")
    return ""


def output_path_error(flag: str, path: str, folder: bool = False) -> str:
    """'' when the run can write ``path`` (the value of --``flag``), else the
    one-line error: ``cannot write --flag path: why; what to do``.

    ``folder``: ``path`` is a folder the run fills (--tensorboard_dir,
    --profile_dir, a sharded --snapshot_path), else a file. Refused: a folder
    where a file is expected and a file where a folder is; a parent that is
    a file, cannot be created, or takes no new files; an existing
    --metrics_path that is not writable (it is appended to). Missing folders
    are created; no file is written or changed.
    """
    fix = f"pass another --{flag}"
    snapshot = "snapshot " if flag == "snapshot_path" else ""
    if folder:
        why = (f"it is a file, where a {snapshot}folder is expected" if os.path.isfile(path)
               else _folder_takes_files(path))
    elif os.path.isdir(path):
        why = f"it is a folder, where a {snapshot}file is expected"
    else:
        why = _folder_takes_files(os.path.dirname(path) or ".")
        if not why and flag == "metrics_path" and os.path.isfile(path) and not os.access(path, os.W_OK):
            why = "the file is not writable (Permission denied)"
    return f"cannot write --{flag} {path}: {why}; {fix}" if why else ""
