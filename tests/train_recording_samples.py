"""train.py, recording which training samples each rank trains: for the
tests of a resume at another world size or worker count (each sample of an
epoch trained once across the runs, none skipped). The kit holds no hook for
it; this launcher wraps two of its classes, then runs train.py as
``__main__``, wherever ``train.py ARGS`` runs (``torchrun ...
tests/train_recording_samples.py ARGS``).

The training sampler (``train_utils.ResumableDistributedSampler``) yields,
in the rank's own process, the sample indices the loader batches in order
(its workers, if any, fetch them: the order is the sampler's); each batch
the epoch loop (``train_utils.EpochBatches``) hands the training step takes
the next len(batch) of them. Each such batch's (epoch, index) pairs are
appended, one ``epoch index`` line each, to ``$RECORD_SAMPLES_DIR/rank<R>.txt``
before it is trained (a batch given to the loop is trained: the loop stops
only after a step). With DDP_TEST_FAULT set, the fault it names is injected
too (tests/train_with_fault.py).
"""

from __future__ import annotations

import collections
import os
import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[0] = str(REPO)  # the project's modules, as when train.py runs itself

import train_utils  # noqa: E402

yielded: collections.deque = collections.deque()  # (epoch, index) the sampler gave, not yet trained
sampler_iter = train_utils.ResumableDistributedSampler.__iter__
batches_iter = train_utils.EpochBatches.__iter__


def recorded_sampler_iter(self):
    for index in sampler_iter(self):
        yielded.append((self.epoch, index))
        yield index


def recorded_batches_iter(self):
    path = Path(os.environ["RECORD_SAMPLES_DIR"]) / f"rank{os.environ['RANK']}.txt"
    for batch in batches_iter(self):
        taken = [yielded.popleft() for _ in range(len(batch[1]))]
        with open(path, "a") as f:
            f.write("".join(f"{epoch} {index}\n" for epoch, index in taken))
        yield batch


train_utils.ResumableDistributedSampler.__iter__ = recorded_sampler_iter
train_utils.EpochBatches.__iter__ = recorded_batches_iter
sampler_set_epoch = train_utils.ResumableDistributedSampler.set_epoch


def reset_on_new_epoch(self, epoch: int, start: int = 0, order=None) -> None:
    yielded.clear()  # a new epoch's iterator: what the last one gave ahead (prefetched) was never trained
    sampler_set_epoch(self, epoch, start, order)


train_utils.ResumableDistributedSampler.set_epoch = reset_on_new_epoch
if os.environ.get("DDP_TEST_FAULT"):  # a fault as tests/train_with_fault.py injects it, too
    sys.path.insert(1, str(REPO / "tests"))
    from train_with_fault import install

    install(os.environ["DDP_TEST_FAULT"])
sys.argv[0] = str(REPO / "train.py")
runpy.run_path(sys.argv[0], run_name="__main__")
