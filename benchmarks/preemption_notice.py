"""How long a cloud's preemption notice leaves unused: train.py, 2 processes
started as pods (DDP, --preemption_notice aws), a GPT on random GPT-2 token
ids, a metadata service on loopback (support/metadata_service.py). Once
the run has printed its 5th progress line the notice is posted; printed per
model: its parameters and snapshot bytes, the seconds from the notice's
posting to the line that says the stop's snapshot is committed (what the
cloud's 30 s to 2 minutes must hold: the watcher's poll, the step, the
save), and the kit's own figure, counted from the watcher's SIGTERM.

    .venv/bin/python -m benchmarks.preemption_notice 2x64 6x384

(each N_LAYERxN_EMBD one run: a GPT of that depth and width, vocabulary
50,304, --block_size 64, --batch_size 4, AdamW.)
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from support.metadata_service import MetadataService  # noqa: E402
from support.runs import PODS, script_env  # noqa: E402

COMMITTED = re.compile(r"stop: snapshot committed (\S+) s after the AWS spot interruption notice")


def run(n_layer: int, n_embd: int, folder: Path) -> dict:
    """One run of a GPT of ``n_layer`` x ``n_embd`` in ``folder``; the figures."""
    data = folder / "tokens"
    data.mkdir()
    ids = np.random.default_rng(0).integers(0, 50257, 200_000, dtype=np.uint16)
    ids.tofile(data / "train.bin")
    ids[:20_000].tofile(data / "val.bin")
    service = MetadataService()
    flags = ["--dataset", "tokens", "--data_dir", str(data), "--n_layer", str(n_layer), "--n_head", "4",
             "--n_embd", str(n_embd), "--block_size", "64", "--batch_size", "4", "--max_steps", "1000",
             "--log_every_steps", "1", "--eval_every_steps", "0", "--preemption_notice", "aws"]
    log = folder / "log.txt"
    with open(log, "w") as out:
        job = subprocess.Popen([*map(str, PODS), "--nproc_per_node=2", str(REPO / "train.py"), *flags], cwd=folder,
                               env=script_env(PREEMPTION_NOTICE_URL=service.url), stdout=out,
                               stderr=subprocess.STDOUT)
        while not re.search(r"^step 5 ", log.read_text(), re.M):
            if job.poll() is not None:
                raise SystemExit(log.read_text()[-3000:])
            time.sleep(0.05)
        posted = time.monotonic()
        service.post()
        while not COMMITTED.search(log.read_text()):
            if job.poll() is not None:
                raise SystemExit(log.read_text()[-3000:])
            time.sleep(0.05)
        seen = time.monotonic() - posted
        job.wait(timeout=300)
    service.shutdown()
    text = log.read_text()
    parameters = int(re.search(r"model GPT, ([\d,]+) parameters", text).group(1).replace(",", ""))
    return {"model": f"{n_layer} x {n_embd}", "parameters": parameters,
            "snapshot_mb": os.path.getsize(folder / "snapshot_train.pt") / 1e6,
            "notice_to_committed_s": seen, "kit_s": float(COMMITTED.search(text).group(1)),
            "exit": job.returncode}


def main(sizes: list) -> None:
    import torch

    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs")
    for size in sizes:
        n_layer, n_embd = map(int, size.split("x"))
        with tempfile.TemporaryDirectory() as folder:
            result = run(n_layer, n_embd, Path(folder))
        print(" | ".join(f"{key} {value:.2f}" if isinstance(value, float) else f"{key} {value}"
                         for key, value in result.items()))


if __name__ == "__main__":
    main(sys.argv[1:] or ["2x64", "6x384"])
