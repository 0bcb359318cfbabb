"""The stop that every rank takes at the same step, on SIGUSR1 (Slurm's
time-limit warning), SIGTERM (preemption, requeue, scancel, torchrun) or Ctrl-C;
before training, the same signals end start-up at once.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from ..distributed import barrier, gloo_group, hang_requested, making_report
from ..ending import end_process
from ..output import print_line, this_rank, write_from_signal_handler


# The signals that ask for a stop: Slurm's time-limit warning (the wrappers'
# --signal=B:USR1@90, relayed), SIGTERM (preemption, `scontrol requeue`,
# `scancel`, torchrun stopping its workers) and Ctrl-C. Windows has no SIGUSR1.
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGUSR1", "SIGTERM", "SIGINT") if hasattr(signal, name))


class StopDuringStartup(BaseException):
    """A stop signal came before the first training step: nothing was trained
    in this run, so nothing needs saving. A BaseException, as KeyboardInterrupt
    is, so that no ``except Exception`` in start-up code (downloads, torch's
    own) swallows it; ``one_line_errors`` turns it into one line and the
    signal's exit status."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    def line(self) -> str:
        """What rank 0 prints: which signal, and that no snapshot was written."""
        return (f"stopped by {signal.Signals(self.signum).name} during start-up, before the first training "
                f"step: nothing was trained in this run and no snapshot was written; run the same command "
                f"again to resume")


class Stopped(Exception):
    """A stop signal (``signum``, the one the ranks agreed on:
    ``StopSignal.stopped_by``) ended training on every rank at the same step,
    after the snapshot of that step was written: raised there, once, and
    caught once by the script, which then ends as a finished run does (the
    test figures aside) but with exit status ``status``, 128 + the signal's
    number (143 for SIGTERM, 138 for SIGUSR1, 130 for Ctrl-C): what a process
    that signal ended shows, so that a launcher counts the run as stopped,
    not done (a Kubernetes Job restarts the pod; Kubeflow's ``restartPolicy:
    ExitCode`` counts 130, 138 and 143 as retryable), and the same command
    resumes."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    @property
    def status(self) -> int:
        """The exit status of a run this stop ended: 128 + ``signum``."""
        return 128 + self.signum


class _StopState:
    """This process's stop signals: who installed the handler, what came, and
    whether a stop signal still ends start-up at once."""

    pid = 0  # the process that installed the handler; 0: none yet
    received = 0  # number of the first stop signal this process got; 0: none
    received_at = 0.0  # when it came (time.monotonic())
    cause = ""  # what sent it, where this process asked for the stop itself (request_stop)
    raise_at_once = True  # start-up: the first stop signal raises StopDuringStartup; after: only noted


# Module-level on purpose: a signal handler belongs to the process (signal.signal),
# and so does what it notes; a handler cannot be handed an object made by train.py.
_STATE = _StopState()


def _handler(signum, frame) -> None:
    if os.getpid() != _STATE.pid:
        return  # a loader worker before its worker_init_fn ran: the rank decides
    if hang_requested():  # a collective timed out and the job is ending: no snapshot can be saved now
        if making_report():  # this rank writes the job's one line, then exits on its own
            _STATE.received = _STATE.received or signum
            return
        end_process(128 + signum, at_once=True)
    if _STATE.received:
        if signal.SIGINT in (signum, _STATE.received):  # Ctrl-C twice, or after a stop signal
            if this_rank() == 0:
                write_from_signal_handler("second stop request: quitting at once, without a snapshot\n")
            end_process(128 + signum, at_once=True)
        return  # the same stop, asked again
    _STATE.received, _STATE.received_at = signum, time.monotonic()
    if _STATE.raise_at_once:
        raise StopDuringStartup(signum)
    if signum == signal.SIGINT and this_rank() == 0:
        write_from_signal_handler("Ctrl-C: every rank stops after the current step and rank 0 saves a "
                                  "snapshot; press Ctrl-C again to quit at once without one\n")


def catch_stop_signals() -> None:
    """Install the stop-signal handler in this process: first thing in a
    script's ``main``, before the slow part of start-up (process group,
    downloads, model, snapshot).

    Until a ``StopSignal`` exists (or ``note_stop_signals_only`` is called),
    the first stop signal raises ``StopDuringStartup`` where the process is
    (a call blocked inside C, such as a store wait, takes it when it returns):
    nothing is trained yet, so the run ends at once and the last snapshot
    stays as it was. Without this, a signal before the handler existed killed
    the rank outright (SIGUSR1's and SIGTERM's default action). Calling it
    again does nothing.
    """
    if _STATE.pid == os.getpid():
        return
    _STATE.pid = os.getpid()
    for signum in STOP_SIGNALS:
        signal.signal(signum, _handler)


def note_stop_signals_only() -> None:
    """From now on a stop signal is only noted (``received_stop_signal``),
    never raised: for code that must run to its end, such as the report of an
    error that is ending the run anyway. A StopSignal does this too."""
    _STATE.raise_at_once = False


def request_stop(cause: str) -> None:
    """Stop as at SIGTERM, for ``cause`` (a cloud's preemption notice: "the
    AWS spot interruption notice"), from any thread: the process sends
    itself SIGTERM, whose handler takes it as any stop signal (during
    start-up it ends start-up; after, every rank stops after the same
    step and the snapshot is saved), and the stop's line names ``cause``."""
    _STATE.cause = _STATE.cause or cause
    os.kill(os.getpid(), signal.SIGTERM)


def stop_origin() -> tuple[str, float]:
    """What started this process's stop, in words ("SIGTERM", "the AWS spot
    interruption notice"), and when (time.monotonic()); ("", 0.0) before
    any stop signal."""
    if not _STATE.received:
        return "", 0.0
    return _STATE.cause or signal.Signals(_STATE.received).name, _STATE.received_at


def received_stop_signal() -> int:
    """The number of the first stop signal this process got since
    ``catch_stop_signals``; 0: none."""
    return _STATE.received


def forget_stop_signal() -> None:
    """Forget the stop signal noted: ``received_stop_signal`` is 0 again, as
    in a process just started. For a check that stops a run with its own
    SIGTERM and then starts the next in this process
    (tools/check_resume.py)."""
    _STATE.received = 0


def report_run_finished() -> None:
    """Tell the Slurm wrapper's batch shell that this run holds every epoch:
    create the file that TRAINING_FINISHED_FILE names (slurm/stop_and_requeue.sh
    sets it; nothing happens where it is unset). A time-limit warning or a
    preemption that came after the last epoch then ends the job instead of
    requeueing it for a run with nothing to train. Call it on rank 0 only.
    A file that cannot be created costs one warning line, not the run: the
    job is then requeued once more, as before this report existed.
    """
    path = os.environ.get("TRAINING_FINISHED_FILE")
    if path:
        try:
            with open(path, "w") as f:
                f.write(f"finished {time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n")
        except OSError as exc:
            print_line(f"warning: cannot write TRAINING_FINISHED_FILE {path} ({exc.strerror or exc}): a "
                       f"stop signal that came after the last epoch may requeue this finished job", sys.stderr)


class StopSignal:
    """Turns SIGUSR1, SIGTERM or SIGINT into a stop that every rank takes at
    the same step.

    A scheduler's warning or a preemption reaches the ranks at slightly
    different moments, possibly mid-step (Slurm's proctrack signals every
    process of a step, torchrun relays to each worker as well). The handler
    only notes the signal. Once per step each rank adds the number of the
    signal it got (0 for none) to an all-reduce (MAX) and reads the previous
    step's result, so all ranks learn "some rank was signalled, and by what" at
    the same step, one step after the earliest signal. The all-reduce runs
    asynchronously on a separate CPU (gloo) group: it never waits for the GPU,
    and by the next step it has long finished. One process skips it and stops
    at the step its signal came in.

    Before a StopSignal exists, ``catch_stop_signals`` ends start-up at
    once on the same signals; one made after such a handler adopts it.

    Repeats of a stop signal count as one stop (one process may get the same
    SIGTERM from Slurm, srun and torchrun), except that a Ctrl-C after any stop
    signal, or a SIGTERM after a Ctrl-C (what torchrun sends its workers on a
    second Ctrl-C), quits at once, without a snapshot: a user pressing Ctrl-C
    twice wants out. Only the process that called ``catch_stop_signals``
    acts: a DataLoader worker forked a moment ago still has this handler
    until its ``worker_init_fn`` (``ignore_stop_signal``) runs.

    Create it on every rank (``new_group`` is collective); ``poll`` too must be
    called by every rank, equally often. Raises ConfigError when gloo cannot
    reach the other ranks' hosts (the message names GLOO_SOCKET_IFNAME).
    """

    def __init__(self) -> None:
        catch_stop_signals()  # installed already, unless the script did not call it
        self.rank = dist.get_rank()
        self.stopped_by = 0  # after a stop: the signal some rank got (the highest number)
        self.group = gloo_group(description="stop signal")
        self.flag = torch.zeros(2)  # (the stop signal's number, rank 0's snapshot request)
        self.requested = False  # the last poll's answer: rank 0 asked for a snapshot
        self.known_at = 0.0  # when this rank learned of the stop (time.monotonic())
        self.work = None
        # A StragglerWatch (stragglers.py) whose window figures ride along every few polls; None: none.
        self.watch = None
        self._flag = self.flag  # the all-reduce's tensor between the watch's windows
        note_stop_signals_only()  # from here on a stop signal is noted and taken at a step

    @property
    def received(self) -> int:
        """The number of the first stop signal this process got; 0: none."""
        return _STATE.received

    def poll(self, request: bool = False) -> bool:
        """Collective. True on every rank at the same call, one call after
        the first rank got a stop signal; False otherwise. ``request``
        rides along: ``requested`` is True on every rank at the next call
        when some rank passed True (rank 0's ``SnapshotClock``). One process
        has no one to agree with: it answers at the same call, without the
        all-reduce (a millisecond a step, 10% of a small GPT's GPU step).
        Every ``stragglers.WINDOW_STEPS``-th call the all-reduce also
        carries ``watch``'s window figures (``StragglerWatch.payload``),
        compared at the next call: the ranks compare their step phases
        without a collective of their own."""
        if self.group.size() == 1:
            self.stopped_by, self.requested = self.received, request
            self._say_stopped()
            return bool(self.stopped_by)
        if self.work is not None:
            self.work.wait()
            self.stopped_by, self.requested = int(self.flag[0].item()), bool(self.flag[1].item())
            if self.flag.numel() > 2:  # a window's figures of every rank (a MAX of each rank's own)
                self.watch.compare(self.flag[2:])
        figures = self.watch.payload() if self.watch is not None else None
        self.flag = self._flag if figures is None else torch.cat([self._flag, figures])
        self.flag[0], self.flag[1] = float(self.received), float(request)
        self.work = dist.all_reduce(self.flag, op=dist.ReduceOp.MAX, group=self.group,
                                    async_op=True)
        self._say_stopped()
        return bool(self.stopped_by)

    def _say_stopped(self) -> None:
        """Rank 0's line once the ranks know of a stop (``stopped_by`` set)."""
        if self.stopped_by and not self.known_at:
            self.known_at = time.monotonic()
        if self.stopped_by and self.rank == 0:
            name = signal.Signals(self.stopped_by).name
            where = "" if self.received else " (received by another rank)"
            print_line(f"stopped by {name}{where} after this step on every rank: the snapshot below "
                       f"holds every step trained; run the same command again to resume")

    def since_stop(self) -> tuple[str, float]:
        """After a stop: what started it and the seconds since (this rank's
        stop signal, or the notice that sent it, ``stop_origin``; for a rank
        that got none, the step at which it learned of the stop), for the
        line that times the stop's snapshot."""
        origin, at = stop_origin()
        if not origin:
            origin, at = "this rank learned of the stop", self.known_at
        return origin, time.monotonic() - at

    def close(self) -> None:
        """Collective, before the process group goes away: wait for the last
        all-reduce, then for every rank. Nobody exits before rank 0 has saved:
        under ``srun --kill-on-bad-exit`` an early exit elsewhere could get
        rank 0 killed mid-save."""
        if self.work is not None:
            self.work.wait()
            self.work = None
        barrier()


def ignore_stop_signal(worker_id: int) -> None:
    """DataLoader ``worker_init_fn``: loader workers ignore the stop signals.

    torchrun signals a rank's whole process group, and Slurm every process of
    a job step, loader workers included. The rank decides when to stop; a
    worker that died of SIGINT or SIGTERM (or, under forkserver or spawn,
    Python 3.14's default on Linux, of SIGUSR1) would take the rank down with
    it before it could save.
    """
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
