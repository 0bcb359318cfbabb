"""Run a training script with language-model batches cut as two strided views
of one gather, not made dense before the loader pins them.

Benchmark only (the GPU check's A/B, benchmarks/gpu_pairs.py): the kit cuts
a window batch as two dense tensors (``text_tasks.TokenWindows.__getitems__``)
and makes every batch tensor dense (``train_utils.DenseBatches``, which
train.py wraps around the task's collate_fn). Here ``__getitems__`` returns
the views ``rows[:, :-1]`` and ``rows[:, 1:]`` of its (B, T+1) gather, and
``DenseBatches`` passes the task's collate_fn through as it is; everything
else is train.py's own code. Batches cut in this process only: with
``--num_workers`` above 0 the workers import text_tasks afresh.

    torchrun ... benchmarks/strided_batches.py train.py [ARGS...]
"""

import os
import runpy
import sys

script = sys.argv[1]
sys.argv = sys.argv[1:]
# The script's folder first, as python puts it; then the repository, whose modules are patched here.
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(os.path.abspath(script)), REPO]

import text_tasks  # noqa: E402
import train_utils  # noqa: E402
from common import Batch  # noqa: E402


def strided_getitems(self, indices: list) -> Batch:
    """``TokenWindows.__getitems__`` with the batch as two views of its windows."""
    rows = self.windows(indices)  # (B, block_size + 1)
    return Batch((rows[:, :-1], rows[:, 1:]))


def pass_through(collate_fn):
    """``train_utils.DenseBatches`` that leaves the batch as ``collate_fn`` makes it."""
    return collate_fn


text_tasks.TokenWindows.__getitems__ = strided_getitems
train_utils.DenseBatches = pass_through
if os.environ.get("RANK", "0") == "0":
    print("strided_batches: language-model batches as strided views, DenseBatches passing them through",
          flush=True)
runpy.run_path(script, run_name="__main__")
