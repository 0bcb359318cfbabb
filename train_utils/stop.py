"""The stop that every rank takes at the same step, on SIGUSR1 (Slurm's
time-limit warning), SIGTERM (preemption, requeue, scancel, torchrun) or Ctrl-C.
"""

from __future__ import annotations

import os
import signal

import torch
import torch.distributed as dist

from .launch import gloo_group
from .output import print_line, write_from_signal_handler


# The signals that ask for a stop: Slurm's time-limit warning (the wrappers'
# --signal=B:USR1@90, relayed), SIGTERM (preemption, `scontrol requeue`,
# `scancel`, torchrun stopping its workers) and Ctrl-C. Windows has no SIGUSR1.
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGUSR1", "SIGTERM", "SIGINT") if hasattr(signal, name))


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
    and by the next step it has long finished, so a step costs no extra wait.

    Repeats of a stop signal count as one stop (one process may get the same
    SIGTERM from Slurm, srun and torchrun), except that a Ctrl-C after any stop
    signal, or a SIGTERM after a Ctrl-C (what torchrun sends its workers on a
    second Ctrl-C), quits at once, without a snapshot: a user pressing Ctrl-C
    twice wants out. Only the process that made the StopSignal acts: a
    DataLoader worker forked a moment ago still has this handler until its
    ``worker_init_fn`` (``ignore_stop_signal``) runs.

    Create it on every rank (``new_group`` is collective); ``poll`` too must be
    called by every rank, equally often. Raises ConfigError when gloo cannot
    reach the other ranks' hosts (the message names GLOO_SOCKET_IFNAME).
    """

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.rank = dist.get_rank()
        self.received = 0  # number of the first stop signal this process got; 0: none
        self.stopped_by = 0  # after a stop: the signal some rank got (the highest number)
        self.group = gloo_group()
        self.flag = torch.zeros(1)
        self.work = None
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._handler)

    def _handler(self, signum, frame) -> None:
        if os.getpid() != self.pid:
            return  # a loader worker before its worker_init_fn ran: the rank decides
        if self.received:
            if signal.SIGINT in (signum, self.received):  # Ctrl-C twice, or after a stop signal
                if self.rank == 0:
                    write_from_signal_handler("second stop request: quitting at once, without a snapshot\n")
                os._exit(128 + signum)
            return  # the same stop, asked again
        self.received = signum
        if signum == signal.SIGINT and self.rank == 0:
            write_from_signal_handler("Ctrl-C: every rank stops after the current step and rank 0 saves a "
                                      "snapshot; press Ctrl-C again to quit at once without one\n")

    def poll(self) -> bool:
        """Collective. True on every rank at the same call, one call after
        the first rank got a stop signal; False otherwise."""
        if self.work is not None:
            self.work.wait()
            self.stopped_by = int(self.flag.item())
        self.flag.fill_(float(self.received))
        self.work = dist.all_reduce(self.flag, op=dist.ReduceOp.MAX, group=self.group,
                                    async_op=True)
        if self.stopped_by and self.rank == 0:
            name = signal.Signals(self.stopped_by).name
            where = "" if self.received else " (received by another rank)"
            print_line(f"stopped by {name}{where} after this step on every rank: the snapshot below "
                       f"holds every step trained; run the same command again to resume")
        return bool(self.stopped_by)

    def close(self) -> None:
        """Collective, before the process group goes away: wait for the last
        all-reduce, then for every rank. Nobody exits before rank 0 has saved:
        under ``srun --kill-on-bad-exit`` an early exit elsewhere could get
        rank 0 killed mid-save."""
        if self.work is not None:
            self.work.wait()
            self.work = None
        dist.barrier()


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
