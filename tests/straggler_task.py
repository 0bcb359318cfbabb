"""straggler_task.py: the synthetic task with one rank made slow for a span
of its training batches, for tests/test_stragglers.py. Run it as train.py's
``--dataset straggler_task:build_task`` with tests/ on PYTHONPATH and
STRAGGLER_FAULT="KIND:RANK:FIRST:LAST[:ARG]" in the environment: on rank RANK,
from its FIRST-th training batch to its LAST-th (1-based, counted as the
loader fetches them, in the rank or in its loader workers together), the
fault KIND acts:

  sleep    each sample's fetch sleeps ARG seconds (a slow disk under that
           rank's loader)
  cgroup   at batch FIRST the rank's process moves into the cgroup v1 CPU
           folder ARG (which the test made, with a CPU quota), after batch
           LAST back into its parent's: a throttled node (the task's MLP is
           wider then, 20-512-512-1, on every rank: most of a step's CPU
           time is its compute)
  tbf      ARG is IFACE:RATE: at batch FIRST the rank limits what its host
           sends through the network interface IFACE to RATE (``tc qdisc
           replace dev IFACE root tbf rate RATE ...``: a degraded link; run
           it on a host of its own, a network namespace), after batch LAST
           it removes the limit (``tc qdisc del``)

Each fault prints ``straggler_task: KIND from batch FIRST on rank RANK`` to
stderr when it starts and ``... ends at batch LAST ...`` when it ends.
"""

import os
import subprocess
import sys
import time

import torch

import common

SLEEP_LINE = "time.sleep(self.seconds)  # the slow disk"


class SlowFetches(torch.utils.data.Dataset):
    """``dataset`` whose fetches are slow (see the module) between batch
    ``first`` and ``last`` of ``batch_size`` samples. The fetches are
    counted in a shared-memory tensor, which the rank's loader workers
    share (each epoch's new workers too): with ``--num_workers`` the
    batches count across the workers and epochs as without. Not atomic:
    two workers' fetches in the same microsecond may count once, a shift
    of a sample."""

    def __init__(self, dataset, kind: str, first: int, last: int, arg: str, batch_size: int) -> None:
        self.dataset, self.kind, self.first, self.last, self.arg = dataset, kind, first, last, arg
        self.batch_size, self.fetches = batch_size, torch.zeros((), dtype=torch.int64).share_memory_()
        self.seconds = float(arg) if kind == "sleep" else 0.0

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        self.fetches += 1
        fetches = int(self.fetches)
        batch = (fetches - 1) // self.batch_size + 1
        start = (fetches - 1) % self.batch_size == 0
        if self.kind == "sleep" and self.first <= batch <= self.last:
            if start and batch in (self.first, self.last):
                self._say(batch)
            time.sleep(self.seconds)  # the slow disk
        elif self.kind == "cgroup" and start and batch in (self.first, self.last + 1):
            folder = self.arg if batch == self.first else os.path.dirname(self.arg)
            with open(os.path.join(folder, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
            self._say(batch)
        elif self.kind == "tbf" and start and batch in (self.first, self.last + 1):
            interface, rate = self.arg.split(":")
            limit = ["replace", "dev", interface, "root", "tbf", "rate", rate, "burst", "32kb", "latency", "400ms"]
            subprocess.run(["tc", "qdisc", *(limit if batch == self.first else ["del", "dev", interface, "root"])],
                           check=True)
            self._say(batch)
        return self.dataset[index]

    def _say(self, batch: int) -> None:
        word = "from" if batch == self.first else "ends at"
        print(f"straggler_task: {self.kind} {word} batch {batch} on rank {os.environ['RANK']}",
              file=sys.stderr, flush=True)


def build_task(args, download):
    task = common.synthetic_task(args, download)
    kind, rank, first, last, *arg = os.environ["STRAGGLER_FAULT"].split(":", 4)
    if kind == "cgroup":  # a wider MLP: the step's CPU time is then mostly its compute, where the quota bites
        task.model = torch.nn.Sequential(torch.nn.Linear(common.SYNTHETIC_FEATURES, 512), torch.nn.ReLU(),
                                         torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 1))
    if os.environ["RANK"] == rank:
        task.train_set = SlowFetches(task.train_set, kind, int(first), int(last), ":".join(arg), args.batch_size)
    return task
