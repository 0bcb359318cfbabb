"""The one-line errors: a user's mistake, a collective time-out, a stop
signal during start-up, a failure that is nobody's input (a full disk), and
an unexpected exception.

A script's ``main`` is decorated with ``one_line_errors``: whatever ends it
ends the process through ``ending.end_process``, what it raised as one line
and an exit status, with no traceback but an unexpected exception's, which
shows where it was raised.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import socket
import sys
import time
import traceback
from typing import Callable

import torch.distributed as dist

from common import ConfigError  # the task contract's one-line error (exit 2)
from .distributed import ANSWER_WAIT_S, RanksStuck, finish_answer, is_timeout, startup_timeout_line, \
    timeout_diagnosis
from .ending import end_process
from .loop import StopDuringStartup, note_stop_signals_only, received_stop_signal
from .output import RunFailed, is_distributed, print_line, this_rank

# How a process ends: its exit status, and whether it leaves at once, its process group left as it is
# (``end_process``'s ``at_once``).
Ending = tuple[int, bool]


def report_to_torchrun(line: str) -> None:
    """Make ``line`` the root cause torchrun prints when this worker fails.

    torchrun gives each worker an error file (TORCHELASTIC_ERROR_FILE); what a
    failed worker wrote there is shown in its "Root Cause" summary instead of
    "To enable traceback see ...". The JSON layout is the one of torch's own
    ``torch.distributed.elastic.multiprocessing.errors.ErrorHandler``. Nothing
    happens outside torchrun.
    """
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    with contextlib.suppress(OSError), open(path, "w") as f:
        json.dump({"message": {"message": line, "extraInfo": {
            "py_callstack": line, "timestamp": str(int(time.time()))}}}, f)


def one_line_errors(fn: Callable) -> Callable:
    """Decorator for a script's ``main``, which returns its exit status (None:
    0): the process ends through ``ending.end_process`` with that status, or
    with what ``main`` raised as one line and an exit status, that line also
    torchrun's root cause.

    A ConfigError: ``error: ...`` on stderr, without a traceback, exit status
    2. A collective that timed out: the line of ``timeout_diagnosis`` (which
    ranks did not arrive), for a rank stuck before its first batch that of
    ``check_first_batches``, for a start-up store that timed out before the
    process group exists that of ``startup_timeout_line``; exit status 1. A
    stop signal during start-up (``catch_stop_signals``): one line from rank
    0 and the signal's exit status, 128 + its number. A RunFailed (a full
    disk at a save: ``snapshots.save_failure``): its line, exit status 1; a
    SystemExit its own status; any other exception its traceback, then one
    line naming it (``_unexpected``), exit status 1.

    Under a process group only rank 0 prints, since such errors are raised on
    every rank alike (see ``downloaders_first``); the other ranks exit quietly.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs) -> None:
        orderly = False  # the function returned: every rank ends the run alike (finished, or stopped)
        try:
            status, at_once, orderly = fn(*args, **kwargs) or 0, False, True
        except StopDuringStartup as stop:
            status, at_once = _startup_stop(stop)
        except ConfigError as exc:
            status, at_once = _config_error(exc)
        except RunFailed as exc:
            status, at_once = _run_failed(exc)
        except RuntimeError as exc:  # torch's DistBackendError and DistStoreError are
            status, at_once = _timeout(exc) or _unexpected(exc)
        except SystemExit as exc:  # sys.exit in a task's code: its status, through the same door
            status, at_once = _exit_status(exc), False
        except (KeyboardInterrupt, GeneratorExit):
            raise
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            status, at_once = _unexpected(exc)
        end_process(status, at_once=at_once, orderly=orderly)

    return wrapper


def _exit_status(exc: SystemExit) -> int:
    """The exit status ``sys.exit(code)`` asks for: the number, 0 for None,
    else 1 with the code printed on stderr (as the interpreter does)."""
    if exc.code is None or isinstance(exc.code, int):
        return exc.code or 0
    print_line(str(exc.code), sys.stderr)
    return 1


def _startup_stop(stop: StopDuringStartup) -> Ending:
    """Rank 0 prints ``stop.line()``; every rank leaves at once, without
    tearing the process group down (other ranks may be anywhere in start-up),
    with exit status 128 + the signal's number, the status of a process the
    signal ended: so that the launcher (srun --kill-on-bad-exit, torchrun)
    ends a rank still blocked inside C, in a store wait or a collective, that
    takes its own signal only when that call returns. The Slurm wrappers
    requeue by the signal, not by this status."""
    if this_rank() == 0:
        print_line(stop.line())
    return 128 + stop.signum, True


def _end_quietly(signum: int, _frame) -> None:
    """Signal handler: this rank's end, asked for by the launcher: exit
    status 128 + ``signum``, at once, no line."""
    end_process(128 + signum, at_once=True)


def _run_failed(exc: RunFailed) -> Ending:
    """Its line on stderr (rank 0 when raised on every rank, else the rank
    that raised it) and in torchrun's error file; exit 1."""
    note_stop_signals_only()
    if not exc.every_rank or not is_distributed() or dist.get_rank() == 0:
        print_line(f"error: {exc}", sys.stderr)
    report_to_torchrun(f"error: {exc}")
    return 1, False


# How a collective fails when another rank has ended (gloo, NCCL): a consequence, not a cause.
PEER_GONE = ("closed by peer", "reset by peer", "remote worker crashing", "remote process exited",
             "Broken pipe")
PEER_GONE_WAIT_S = 10  # time for torchrun's agent, which saw that rank fail, to end this one


def _unexpected(exc: BaseException) -> Ending:
    """An exception nothing above knows: its traceback (where it came from:
    the kit, or a task's own code), then one line naming it, which is also
    torchrun's root cause; exit 1. A collective that failed because another
    rank ended (``PEER_GONE``) first waits, quietly, for the launcher to end
    this rank (SIGTERM), since that rank's own line says why; then one line,
    and the rank leaves at once, its process group broken. Where a stop
    signal came already (the launcher's, before the collective failed), the
    rank ends at once, quietly, with its exit status."""
    where = f" on rank {dist.get_rank()} (host {socket.gethostname()})" if is_distributed() else ""
    note_stop_signals_only()
    if isinstance(exc, RuntimeError) and any(text in str(exc) for text in PEER_GONE):  # torch's errors
        signal.signal(signal.SIGTERM, _end_quietly)
        # The launcher's SIGTERM may have come already, while this rank still
        # waited in the collective: noted as a stop signal then, it ends the rank now.
        if received_stop_signal():
            _end_quietly(received_stop_signal(), None)
        time.sleep(PEER_GONE_WAIT_S)
        status, _ = _run_failed(RunFailed(f"another rank ended{where and ', seen' + where}: its own error says "
                                          f"why (`{(str(exc).strip().splitlines() or [''])[0][:120]}`)"))
        return status, True
    traceback.print_exc()
    detail = (str(exc).strip().splitlines() or [""])[0][:200]
    line = (f"error: unexpected {type(exc).__name__}{where}: {detail}; the traceback above shows where: "
            f"fix it there if it is your task's code, else report it with this output; a snapshot "
            f"saved before is intact (the same command resumes from it)")
    print_line(line, sys.stderr)
    report_to_torchrun(line)
    return 1, False


def _config_error(exc: ConfigError) -> Ending:
    """Rank 0 prints ``error: ...``; every rank gives torchrun the line; exit 2."""
    note_stop_signals_only()
    if not is_distributed() or dist.get_rank() == 0:
        print_line(f"error: {exc}", sys.stderr)
    # Every rank gives torchrun the line: it names the failure with the
    # smallest timestamp (whole seconds) as the root cause, and on a
    # busy machine a quiet rank can get there before rank 0.
    report_to_torchrun(f"error: {exc}")
    return 2, False


def _timeout(exc: RuntimeError) -> Ending | None:
    """A time-out (or ranks stuck before their first batch): its one line,
    this rank's answer to the hang report given its time, then exit 1 at once,
    the process group broken; None for any other RuntimeError."""
    note_stop_signals_only()  # ending anyway: a stop signal must not cut the report short
    if not isinstance(exc, RanksStuck) and not is_timeout(exc):
        return None
    if isinstance(exc, RanksStuck):
        line = exc.line
    else:
        line = timeout_diagnosis(exc) if is_distributed() else startup_timeout_line(exc)
    if line:
        print_line(f"error: {line}", sys.stderr)
        report_to_torchrun(f"error: {line}")
    finish_answer(ANSWER_WAIT_S)  # this rank's stack file too, for the report some rank makes
    return 1, True
