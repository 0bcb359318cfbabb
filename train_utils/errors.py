"""The one-line errors: a user's mistake, a finished run, a collective time-out,
a failure that is nobody's input (a full disk), and an unexpected exception.

A script's ``main`` is decorated with ``one_line_errors``; what it catches
ends the process with one line and an exit status, and no traceback but an
unexpected exception's, which shows where it was raised.
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
from .loop import StopDuringStartup, end_startup_stop, note_stop_signals_only, received_stop_signal, \
    report_run_finished
from .output import RunFailed, is_distributed, print_line
from .snapshots import release_claim

class NothingToTrain(Exception):
    """The snapshot already holds every epoch asked for: not an error, one
    line on stdout and exit status 0."""


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
    """Decorator for a script's ``main``: a ConfigError becomes one line on
    stderr (``error: ...``), torchrun's root cause, and exit status 2, without
    a traceback, the process group destroyed; NothingToTrain becomes one line
    on stdout (and ``report_run_finished``) and exit status 0; a collective
    that timed out becomes the line of ``timeout_diagnosis`` (which ranks did
    not arrive), a rank stuck before its first batch that of
    ``check_first_batches``, a start-up store
    that timed out before the process group exists that of
    ``startup_timeout_line``; exit status 1. A stop signal during start-up
    (``catch_stop_signals``) becomes one line from rank 0 and the signal's
    exit status, 128 + its number. A RunFailed (a full disk at a save:
    ``snapshots.save_failure``) becomes its line, exit status 1; any other
    exception its traceback, then one line naming it (``_end_unexpected``),
    exit status 1. Every one of these lines is torchrun's root cause too.
    Each of these exits gives back the snapshot's claim this process took
    (``claims.release_claim``; at exit, or before an ``os._exit``).

    Under a process group only rank 0 prints, since such errors are raised on
    every rank alike (see ``downloaders_first``); the other ranks exit quietly.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except StopDuringStartup as stop:
            release_claim()  # os._exit skips atexit
            end_startup_stop(stop)
        except NothingToTrain as done:
            _end_nothing_to_train(done)
        except ConfigError as exc:
            _end_config_error(exc)
        except RunFailed as exc:
            _end_run_failed(exc)
        except RuntimeError as exc:  # torch's DistBackendError and DistStoreError are
            _end_if_timeout(exc)
            _end_unexpected(exc)
        except (SystemExit, KeyboardInterrupt, GeneratorExit):
            raise
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            _end_unexpected(exc)

    return wrapper


def _end_quietly(signum: int, _frame) -> None:
    """Signal handler: this rank's end, asked for by the launcher: the claim
    given back (``release_claim``), exit status 128 + ``signum``, no line."""
    release_claim()
    sys.stdout.flush()
    os._exit(128 + signum)


def _end_run_failed(exc: RunFailed) -> None:
    """Its line on stderr (rank 0 when raised on every rank, else the rank
    that raised it) and in torchrun's error file; exit 1."""
    note_stop_signals_only()
    if not exc.every_rank or not is_distributed() or dist.get_rank() == 0:
        print_line(f"error: {exc}", sys.stderr)
    report_to_torchrun(f"error: {exc}")
    sys.exit(1)


# How a collective fails when another rank has ended (gloo, NCCL): a consequence, not a cause.
PEER_GONE = ("closed by peer", "reset by peer", "remote worker crashing", "remote process exited",
             "Broken pipe")
PEER_GONE_WAIT_S = 10  # time for torchrun's agent, which saw that rank fail, to end this one


def _end_unexpected(exc: BaseException) -> None:
    """An exception nothing above knows: its traceback (where it came from:
    the kit, or a task's own code), then one line naming it, which is also
    torchrun's root cause; exit 1. A collective that failed because another
    rank ended (``PEER_GONE``) first waits, quietly, for the launcher to end
    this rank (SIGTERM), since that rank's own line says why; then one line.
    Where a stop signal came already (the launcher's, before the collective
    failed), the rank ends at once, quietly, with its exit status."""
    where = f" on rank {dist.get_rank()} (host {socket.gethostname()})" if is_distributed() else ""
    note_stop_signals_only()
    if isinstance(exc, RuntimeError) and any(text in str(exc) for text in PEER_GONE):  # torch's errors
        signal.signal(signal.SIGTERM, _end_quietly)
        # The launcher's SIGTERM may have come already, while this rank still
        # waited in the collective: noted as a stop signal then, it ends the rank now.
        if received_stop_signal():
            _end_quietly(received_stop_signal(), None)
        time.sleep(PEER_GONE_WAIT_S)
        _end_run_failed(RunFailed(f"another rank ended{where and ', seen' + where}: its own error says "
                                  f"why (`{(str(exc).strip().splitlines() or [''])[0][:120]}`)"))
    traceback.print_exc()
    detail = (str(exc).strip().splitlines() or [""])[0][:200]
    line = (f"error: unexpected {type(exc).__name__}{where}: {detail}; the traceback above shows where: "
            f"fix it there if it is your task's code, else report it with this output; a snapshot "
            f"saved before is intact (the same command resumes from it)")
    print_line(line, sys.stderr)
    report_to_torchrun(line)
    sys.exit(1)


def _end_nothing_to_train(done: NothingToTrain) -> None:
    """Rank 0 prints ``done`` and tells a Slurm wrapper the run is finished;
    the claim given back; exit 0 at once, without the interpreter's
    teardown: once FSDP made DTensors the process group outlives
    ``destroy_process_group`` and gloo's threads can abort the teardown, as
    at the end of a finished FSDP run (``fsdp.exit_skipping_teardown``)."""
    note_stop_signals_only()  # a stop signal now must not cut the report short
    if not is_distributed() or dist.get_rank() == 0:
        print_line(str(done))
        report_run_finished()  # for a Slurm wrapper: no requeue
    if is_distributed():
        dist.destroy_process_group()
    release_claim()  # os._exit skips atexit
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _end_config_error(exc: ConfigError) -> None:
    """Rank 0 prints ``error: ...``; every rank gives torchrun the line; exit 2."""
    note_stop_signals_only()
    if not is_distributed() or dist.get_rank() == 0:
        print_line(f"error: {exc}", sys.stderr)
    # Every rank gives torchrun the line: it names the failure with the
    # smallest timestamp (whole seconds) as the root cause, and on a
    # busy machine a quiet rank can get there before rank 0.
    report_to_torchrun(f"error: {exc}")
    if is_distributed():  # else NCCL warns of a leaked process group on every rank
        with contextlib.suppress(RuntimeError):
            dist.destroy_process_group()
    sys.exit(2)


def _end_if_timeout(exc: RuntimeError) -> None:
    """A time-out (or ranks stuck before their first batch): its one line, then
    exit 1 at once; any other RuntimeError returns, for the caller to re-raise."""
    note_stop_signals_only()  # ending anyway: a stop signal must not cut the report short
    if not isinstance(exc, RanksStuck) and not is_timeout(exc):
        return
    if isinstance(exc, RanksStuck):
        line = exc.line
    else:
        line = timeout_diagnosis(exc) if is_distributed() else startup_timeout_line(exc)
    if line:
        print_line(f"error: {line}", sys.stderr)
        report_to_torchrun(f"error: {line}")
    finish_answer(ANSWER_WAIT_S)  # this rank's stack file too, for the report some rank makes
    # The process group is broken now: leave without tearing it down.
    release_claim()  # os._exit skips atexit
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)
