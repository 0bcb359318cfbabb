"""Collective time-outs: a long one for start-up, a shorter one once training
runs, and the one line that names the ranks that did not arrive.

The module's state (where this process is, the side gloo group of the
report, whether the training time-out is in force) is set only by the calls
below, each made by a script at the place it names.
"""

from __future__ import annotations

import os
import re
import time
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from . import hang_report
from .launch import FOLLOWING_RUN_TIMEOUT, barrier, gloo_group
from ..output import is_distributed


class _Watch:
    """This process's state for the time-out report."""

    phase = "start-up (before the first training step)"  # where it is, for the report
    group: Optional[dist.ProcessGroup] = None  # gloo group of monitored_barrier (watch_collectives)
    training = False  # use_training_timeout has set --pg_timeout_s
    timeout: Optional[timedelta] = None  # the run's time-out in force: start-up's, then --pg_timeout_s
    snapshot: Optional[str] = None  # the newest complete snapshot this process knows of: what a restart resumes


# Module-level on purpose: like torch.distributed's own default group, one per
# process; the error path (errors.one_line_errors) reads it after train.py's
# objects are gone.
_WATCH = _Watch()


def watch_collectives(timeout_s: float) -> None:
    """Collective, right after ``init_process_group``: make the side gloo
    group that ``timeout_diagnosis`` uses to find the ranks that did not
    arrive (NCCL's own diagnostics: ``enable_nccl_diagnostics``, before the
    process group exists).

    Making it waits for every rank, at most ``timeout_s`` seconds
    (--startup_timeout_s). Under NCCL, whose ``init_process_group`` returns
    without waiting for the others, this is the first wait for them: a rank
    that never arrives raises RanksStuck with ``startup_timeout_line``.
    """
    if _WATCH.group is not None:
        return
    _WATCH.timeout = timedelta(seconds=timeout_s)
    try:
        _WATCH.group = gloo_group(_WATCH.timeout, "time-out watch")
    except RuntimeError as exc:
        if is_timeout(exc):
            raise RanksStuck(startup_timeout_line(exc)) from None
        raise


def watch_again(timeout_s: float) -> None:
    """Collective, right after the process group was destroyed and made
    again in the same process (tools/check_resume.py's fresh group): forget the
    old group's side groups, make the side group of ``watch_collectives``
    anew (``timeout_s``, --startup_timeout_s), and let the training time-out
    take over again at the new run's second step."""
    _WATCH.group, _WATCH.training, _WATCH.timeout = None, False, None
    FOLLOWING_RUN_TIMEOUT.clear()
    watch_collectives(timeout_s)


def note_phase(phase: str) -> None:
    """Name where this process is (e.g. "epoch 2, training step 5 of this
    start"), for the time-out report."""
    _WATCH.phase = phase


def note_snapshot(path: str, tag: str) -> None:
    """Name the newest complete snapshot, which a restart resumes: ``path``
    and its position ``tag`` ("epoch 2", "epoch 3 step 40"), for the
    time-out report's last words (``restart_note``). Called where this
    process resumed from one and where rank 0 completed one."""
    _WATCH.snapshot = f"{path} ({tag})"


def restart_note() -> str:
    """What a restart of the job after this time-out resumes, as this process
    knows it: "a restart resumes from snapshot PATH (epoch 2)", or on rank 0
    (which completes every snapshot) that none is written yet; '' on another
    rank that knows of none."""
    if _WATCH.snapshot is not None:
        return f"a restart resumes from snapshot {_WATCH.snapshot}"
    if dist.get_rank() == 0:
        return "no snapshot is written yet, so a restart trains from the beginning"
    return ""


def _with_restart_note(line: str) -> str:
    """``line`` with ``restart_note`` after it, where there is one."""
    note = restart_note()
    return f"{line}; {note}" if note else line


class Watch:
    """The training loop's time-outs: where this process is, for the report
    of a collective that times out, and which time-out is in force.

    ``step`` before each training micro-batch: it notes the step; until the
    first optimizer step is done (``grad_accum_steps`` micro-batches) it
    checks that every rank has its batch (``check_first_batches``, within
    ``timeout_s`` seconds, --pg_timeout_s); at the micro-batch after it, the
    training time-out takes over from start-up's (``use_training_timeout``).
    ``after_steps`` once an epoch's training steps are done (evaluation and
    saving follow). Every rank calls both, equally often.
    """

    def __init__(self, timeout_s: float, grad_accum_steps: int) -> None:
        self.timeout_s, self.accum = timeout_s, grad_accum_steps
        self.batches = 0  # micro-batches this start has begun

    def step(self, epoch: int, step: int) -> None:
        """Before micro-batch ``step`` (1-based, of this start) of epoch
        ``epoch`` (0-based). Collective until the training time-out is in
        force (a monitored barrier each micro-batch, then one barrier); a
        no-op collective-wise after. Raises RanksStuck (``check_first_batches``)."""
        note_phase(f"epoch {epoch + 1}, training step {step} of this start")
        self.batches += 1
        if self.batches > self.accum:  # an optimizer step is done on every rank
            use_training_timeout(self.timeout_s)
        else:
            check_first_batches(self.timeout_s)

    def after_steps(self, epoch: int) -> None:
        """Epoch ``epoch``'s (0-based) training steps are done."""
        note_phase(f"epoch {epoch + 1} after its training steps (evaluation or saving)")


def use_training_timeout(timeout_s: Optional[float]) -> None:
    """Collective the first time: once every rank has finished the first
    optimizer step (a barrier), a collective may wait ``timeout_s`` seconds
    (--pg_timeout_s) instead of start-up's --startup_timeout_s, which covers
    downloads and compilation. Sets it on every process group of the run;
    later calls return at once. Without the barrier, a rank that lowered its
    time-out could give up on one still compiling its first step (the race
    torchtitan's ``set_pg_timeouts`` documents). ``timeout_s`` None: nothing.

    gloo before torch 2.10 ignores a changed time-out (docs/install.md).
    """
    if _WATCH.training or timeout_s is None:
        return
    _WATCH.training = True
    barrier()
    _WATCH.timeout = timeout = timedelta(seconds=timeout_s)
    _set_timeout(timeout)  # the default group
    # The side groups (the stop signal's) and HSDP's mesh groups (follow_run_timeout).
    for group in (_WATCH.group, *FOLLOWING_RUN_TIMEOUT):
        if group is not None:
            _set_timeout(timeout, group)


def follow_run_timeout(*groups: dist.ProcessGroup) -> None:
    """Make ``groups``, which torch made with its own default time-out (30
    minutes on gloo, 10 on NCCL; ``init_device_mesh`` takes no time-out for
    the groups of a DeviceMesh's dimensions), wait as long as the run's
    other groups: start-up's --startup_timeout_s now, and --pg_timeout_s
    once ``use_training_timeout`` sets it on every group of the run. A rank
    stuck while the others wait in one of them is then reported as in any
    other collective (``timeout_diagnosis``), not waited for until torch's
    time-out. Not collective. gloo before torch 2.10 ignores a changed
    time-out (docs/install.md)."""
    for group in groups:
        if _WATCH.timeout is not None:
            _set_timeout(_WATCH.timeout, group)
        FOLLOWING_RUN_TIMEOUT.append(group)


def _set_timeout(timeout: timedelta, group: Optional[dist.ProcessGroup] = None) -> None:
    """Set the time-out of ``group``'s collectives (None: the default group's)."""
    # torch.distributed.set_timeout (newer releases) replaced the private _set_pg_timeout.
    (getattr(dist, "set_timeout", None) or dist.distributed_c10d._set_pg_timeout)(timeout, group)


class RanksStuck(RuntimeError):
    """A bounded wait found ranks that did not arrive: ``line`` is the one-line
    error this rank prints ('' where another rank reports)."""

    def __init__(self, line: str) -> None:
        super().__init__(line)
        self.line = line


def check_first_batches(timeout_s: Optional[float]) -> None:
    """Collective, with each training batch in hand until the training
    time-out is in force (``use_training_timeout``): a monitored barrier on
    the side gloo group, ``timeout_s`` seconds (--pg_timeout_s) for every rank
    to have its batch too; then returns at once.

    Until the first optimizer step the collectives wait --startup_timeout_s,
    which covers downloads and compilation, not a rank stuck in its data
    loader (a loader worker that never started, a dataset's ``__getitem__``
    that never returns), which is in no collective itself. Raises RanksStuck:
    on rank 0 naming the ranks that did not arrive within ``timeout_s`` of its
    own batch; on another rank ('' line) when rank 0 gave up on someone, or
    naming rank 0 when rank 0 did not answer within twice ``timeout_s`` (by
    then rank 0 would have reported anyone else).
    """
    if _WATCH.training or _WATCH.group is None or timeout_s is None:
        return
    rank = dist.get_rank()
    wait = timedelta(seconds=timeout_s if rank == 0 else 2 * timeout_s)
    try:
        dist.monitored_barrier(group=_WATCH.group, timeout=wait, wait_all_ranks=True)
    except RuntimeError as barrier:
        if rank != 0:
            if not is_timeout(barrier):
                raise RanksStuck("") from None  # rank 0 gave up on someone and left: it reports
            raise RanksStuck(f"rank {rank} waited {2 * timeout_s:g} s during {_WATCH.phase} for rank 0 "
                             f"to have its batch too, and rank 0 does not answer: it is stuck in its data "
                             f"loader or died; look at its output (--pg_timeout_s sets the wait)") from None
        found = re.search(r"Ranks? ([\d, ]+) failed to pass", str(barrier))
        if not found:
            missing = f"{str(barrier).splitlines()[0]} to have their batch too"
        else:
            stuck = [int(r) for r in found.group(1).split(",")]
            store = hang_report.request_stacks(f"rank 0 waited {timeout_s:g} s during {_WATCH.phase} for ranks "
                                               f"{stuck} to have their batch too")
            answers = hang_report.collect_answers(store, dist.get_world_size(),
                                                  time.monotonic() + hang_report.ANSWER_WAIT_S)
            missing = f"{stuck} to have their batch too ({hang_report.describe_ranks(answers, None, stuck)})"
        raise RanksStuck(_with_restart_note(
            f"rank 0 waited {timeout_s:g} s during {_WATCH.phase} for ranks {missing}: a rank stuck in its "
            f"data loader (a loader worker that never started, a dataset's __getitem__ that does not return) "
            f"holds up all; every live rank's stack: {hang_report.stacks_glob()} (--pg_timeout_s sets the "
            f"wait)")) from None


# How torch words a time-out, and only a time-out: a gloo collective's ("Timed
# out waiting 10000ms for recv operation to complete"); the store's ("wait
# timeout after 1800000ms, keys: ...", a DistStoreError when a rank waits there
# for the others at start-up, also while NCCL fetches its unique id; "barrier
# timeout after ..."); a store client's that found no server in time ("The
# client socket has timed out after 3000ms while trying to connect"); NCCL's
# watchdog ("... ran for 600000 milliseconds before timing out") and blocking
# wait ("... timed out in blocking wait"). Not any text with "timed out" in it:
# NCCL ends every failure, a network error too, with "Some NCCL operations have
# failed or timed out", and a refused socket can say "Connection timed out".
TIMEOUT_PATTERNS = (r"Timed out waiting \d+ms for \w+ operation", r"\b(?:wait|barrier) timeout after \d+ms",
                    r"socket has timed out after .* while trying to connect",
                    r"ran for \d+ milliseconds before timing out", r"timed out in blocking wait")
_TIMEOUT = re.compile("|".join(TIMEOUT_PATTERNS))


def is_timeout(exc: BaseException) -> bool:
    """Whether ``exc`` is torch.distributed's time-out: a RuntimeError whose
    text matches one of ``TIMEOUT_PATTERNS``, raised in a process group, or a
    DistError (the store's) before one exists. An NCCL network error whose
    text says "failed or timed out" is not one."""
    if not isinstance(exc, RuntimeError) or not _TIMEOUT.search(str(exc)):
        return False
    return is_distributed() or isinstance(exc, dist.DistError)


def startup_timeout_line(exc: BaseException) -> str:
    """The one-line error for a time-out before the process group exists: this
    rank (RANK, or '?') waited in the start-up store for ranks that never came."""
    detail = str(exc).strip().splitlines()[-1].split("] ")[-1]
    return (f"rank {os.environ.get('RANK', '?')} timed out during start-up waiting for the other ranks "
            f"to join the process group ({detail}). A rank that did not start, or failed before "
            f"joining, holds up all: look at its output (--startup_timeout_s sets the wait)")


def timeout_diagnosis(exc: BaseException) -> str:
    """The one-line error for a collective that timed out on this rank, or ''
    when another rank reports it.

    First every rank is asked for its stack (``hang_report.request_stacks``:
    each live rank writes its stack file and answers with its host, the
    file:line it is at and the collectives it ran). Then rank 0 runs
    ``dist.monitored_barrier`` (gloo, ``wait_all_ranks``) on the side group of
    ``watch_collectives``, which names the ranks that do not arrive within
    10 s: those are stuck or dead. The line names them with their answers
    (``hang_report.describe_ranks``), and the collective this rank waited in
    (the flight recorder's newest). Another rank reports only when rank 0
    itself does not answer, and then one of them (the first to claim it).
    """
    rank, group = dist.get_rank(), _WATCH.group
    detail = str(exc).strip().splitlines()[-1].split("] ")[-1]
    recent = hang_report.recent_collectives()
    waiting = recent[-1] if recent else None  # what this rank was in: the one it started last
    inside = "in a collective" + (f" (the last it started: {hang_report.describe_collective(waiting)})"
                                  if waiting else "")
    hang_report.note_timed_out(exc)
    store = hang_report.request_stacks(f"rank {rank} timed out {inside} during {_WATCH.phase}")
    deadline = time.monotonic() + hang_report.ANSWER_WAIT_S
    stuck: Optional[list] = None  # ranks that did not arrive; None: unknown
    rank0_answers = True
    if group is not None:
        try:
            dist.monitored_barrier(group=group, timeout=timedelta(seconds=10), wait_all_ranks=True)
            stuck = []
        except RuntimeError as barrier:
            if rank != 0:
                rank0_answers = False
            else:
                found = re.search(r"Ranks? ([\d, ]+) failed to pass", str(barrier))
                stuck = [int(r) for r in found.group(1).split(",")] if found else None
    if rank != 0 and (rank0_answers or not _claim_report(store, rank)):
        return ""  # rank 0 reports, or another rank claimed the report of rank 0's silence
    answers = hang_report.gather_answers(store, dist.get_world_size(), deadline)
    stacks = hang_report.stacks_glob()
    if rank != 0:
        where = hang_report.describe_ranks(answers, waiting, [0]) if answers else "rank 0 does not answer"
        return _with_restart_note(
            f"rank {rank} timed out {inside} during {_WATCH.phase} ({detail}), and rank 0 did not arrive to "
            f"report it: {where}. Every live rank's stack: {stacks} (--pg_timeout_s sets the wait)")
    if stuck is None:
        missing = "unknown (no monitor group)"
    elif stuck:
        missing = hang_report.describe_ranks(answers, waiting, stuck)
    else:
        mismatch = hang_report.describe_mismatch(answers)
        missing = f"none; {mismatch}" if mismatch else "none (all arrived later: raise --pg_timeout_s)"
    return _with_restart_note(
        f"rank 0 timed out waiting for the other ranks {inside} during {_WATCH.phase} ({detail}); ranks that "
        f"did not arrive: {missing}. A rank that is stuck or died holds up all; every live rank's stack: "
        f"{stacks} (--pg_timeout_s sets the wait)")


def _claim_report(store: Optional[dist.Store], rank: int) -> bool:
    """Whether this rank (not rank 0) reports that rank 0 did not arrive: the
    first to claim it in the store; every such rank without a store."""
    if store is None:
        return True
    try:
        return store.compare_set("reporter", "", str(rank)).decode() == str(rank)
    except Exception:  # noqa: BLE001 - no store to agree through: each reports
        return True
