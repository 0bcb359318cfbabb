"""Section 9b, snapshot_bucket: a DDP snapshot in a bucket against one on
the local disk, as train.py saves them (the kit's Checkpointer, asynchronous).

Measures, in one process (a gloo group of one), the 12.6 M-parameter MLP of
section 9 with SGD momentum (about 100 MB of training state) saved to a local
file in a temporary folder and to ``s3://bench/snap.pt`` on moto's S3 server
on 127.0.0.1 (support/s3_server.py; another store with ``--endpoint``, its
bucket "bench" made first), ``--saves`` times each, in turns, each write
waited for before the next save.

Reading the table: "blocking s" is the median seconds ``Checkpointer.save``
holds the training loop (the CPU copy of the state; the write is the writer
thread's), "to commit s" the median seconds from that call to the snapshot
being the one a restart resumes (a local file renamed into place; in the
bucket the manifest written: serialization in memory, the upload, the
commit, the previous generation removed). The ratio line compares the
blocking times (the target: at most 1.2).

    python -m benchmarks.snapshot_bucket [--saves 7] [--endpoint URL]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.harness import CPU, Position, machine, process_group, table  # noqa: E402
from benchmarks.snapshot_cost import SNAPSHOT_LAYERS, SNAPSHOT_WIDTH  # noqa: E402
from support.runs import free_port  # noqa: E402
from train_utils import Checkpointer  # noqa: E402


def _model() -> tuple:
    """The section's MLP and its SGD optimizer with momentum, its state made (one step)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(SNAPSHOT_WIDTH, SNAPSHOT_WIDTH) for _ in range(SNAPSHOT_LAYERS)])
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    model(torch.randn(8, SNAPSHOT_WIDTH)).square().mean().backward()
    optimizer.step()
    return model, optimizer


def measure(paths: dict, saves: int) -> dict:
    """``saves`` asynchronous saves of the section's model to each of
    ``paths`` ({name: --snapshot_path}) by a Checkpointer each, taken in
    turns (so that both see the same machine load): per name, the median
    seconds a ``save`` call blocked, and from the call to the write's end
    (``wait``), the first save (buffers made) left out."""
    model, optimizer = _model()
    position = Position()
    checkpointers = {name: Checkpointer(path, False, model, optimizer, {}, {"position": position}, asynchronous=True)
                     for name, path in paths.items()}
    blocked, committed = ({name: [] for name in paths} for _ in range(2))
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):  # no "snapshot saved" lines
        for _ in range(saves):
            position.steps_run += 1
            for name, checkpointer in checkpointers.items():
                start = time.perf_counter()
                checkpointer.save()
                blocked[name].append(time.perf_counter() - start)
                checkpointer.wait()
                committed[name].append(time.perf_counter() - start)
        for checkpointer in checkpointers.values():
            checkpointer.close()
    return {name: {"blocking_s": statistics.median(blocked[name][1:]),
                   "commit_s": statistics.median(committed[name][1:])} for name in paths}


def section_snapshot_bucket(saves: int = 7, endpoint: str = "") -> dict:
    """The figures of the module's docstring, and their table."""
    from support.s3_server import S3Server

    server = None if endpoint else S3Server()
    os.environ.update(server.env() if server else {"AWS_ENDPOINT_URL": endpoint})
    if server:
        server.create_bucket("bench")
    folder = tempfile.mkdtemp(prefix="bucket-bench-")
    try:
        with process_group(0, 1, free_port(), CPU):
            figures = measure({"local": os.path.join(folder, "snap.pt"), "bucket": "s3://bench/snap.pt"}, saves)
            local, in_bucket = figures["local"], figures["bucket"]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        if server:
            server.stop()
    state_mb = sum(p.numel() * 4 * 2 for p in _model()[0].parameters()) / 1e6
    rows = [["local file", f"{local['blocking_s']:.3f}", f"{local['commit_s']:.2f}"],
            [f"s3:// ({'moto on 127.0.0.1' if server else endpoint})", f"{in_bucket['blocking_s']:.3f}",
             f"{in_bucket['commit_s']:.2f}"]]
    ratio = in_bucket["blocking_s"] / local["blocking_s"]
    return {"local": local, "bucket": in_bucket, "ratio": ratio,
            "table": table(f"9b. DDP snapshot in a bucket vs a local file ({state_mb:.0f} MB of state, "
                           f"median of {saves - 1})", ["snapshot", "blocking s", "to commit s"], rows)
            + f"\n\nblocking time, bucket / local: {ratio:.2f}"}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--saves", type=int, default=7)
    parser.add_argument("--endpoint", default="", help="an S3 endpoint whose bucket 'bench' exists (default: moto)")
    args = parser.parse_args()
    print(machine())
    print(section_snapshot_bucket(args.saves, args.endpoint)["table"])
