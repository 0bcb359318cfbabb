"""What a corpus's size costs a rank before it trains: train.py, one process
(a pod's environment: RANK=0, WORLD_SIZE=1, no torchrun), --dataset tokens
on llm.c shards of GiBs made as sparse files (a header, zeros, nothing
written between), a GPT of 1 layer, 2 steps: the process's peak resident
memory and the seconds from its start to its first step line.

What grows with the corpus is what is kept per window: the epoch's order of
the windows (``train_utils.loop.sampler``) and the windows' index (one int64
a shard, ``token_tasks.TokenFileWindows``). Run as a program:

    .venv/bin/python -m benchmarks.corpus_scale 20:32 200:256

(GiB of shards : --block_size, each pair one run; the shards are made in a
temporary folder, sparse, and removed.)
"""

from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHARD_BYTES = 2 << 30  # 2 GiB a shard, llm.c's FineWeb shards' order of size

# train.py under a wrapper that prints the process's peak resident memory (VmHWM) at its end.
PEAK = """import atexit, os, runpy, sys
def report():
    with open("/proc/self/status") as f:
        peak = next(line for line in f if line.startswith("VmHWM:")).split()[1]
    os.write(1, f"peak_rss_kib {peak}\\n".encode())
atexit.register(report)
sys.path[0] = REPO
sys.argv[0] = os.path.join(REPO, "train.py")
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def sparse_shards(folder: Path, gib: int) -> int:
    """``gib`` GiB of llm.c training shards of ``SHARD_BYTES`` in ``folder``
    (sparse: each a header and zeros) and a small validation shard; returns
    the training tokens."""
    from support.data import write_token_shard

    folder.mkdir(parents=True)
    shards = max(1, gib * (1 << 30) // SHARD_BYTES)
    for k in range(shards):
        path = folder / f"fineweb_train_{k + 1:06d}.bin"
        write_token_shard(path, [], True, count=(SHARD_BYTES - 1024) // 2)
        with open(path, "r+b") as f:
            f.truncate(SHARD_BYTES)
    write_token_shard(folder / "fineweb_val_000000.bin", [1, 2, 3] * 4096, True)
    with open(folder / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": 65}, f)
    return shards * (SHARD_BYTES - 1024) // 2


def measure(gib: int, block_size: int) -> dict:
    """One run on ``gib`` GiB of shards at ``block_size``: {"tokens",
    "windows", "peak_rss_mib", "first_step_s"} (seconds from the process's
    start to its first step line)."""
    with tempfile.TemporaryDirectory(prefix="corpus-scale-") as work:
        work = Path(work)
        tokens = sparse_shards(work / "shards", gib)
        (work / "peak.py").write_text(PEAK.replace("REPO", repr(str(REPO))))
        env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": "29533", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, str(work / "peak.py"), "--dataset", "tokens", "--data_dir", str(work / "shards"),
               "--n_layer", "1", "--n_head", "2", "--n_embd", "32", "--block_size", str(block_size),
               "--batch_size", "4", "--max_steps", "2", "--log_every_steps", "1", "--eval_windows", "4",
               "--snapshot_path", str(work / "snapshot.pt")]
        started = time.monotonic()
        job = subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        first_step, lines = None, []
        for line in job.stdout:
            lines.append(line)
            if first_step is None and re.match(r"^step 1 \| ", line):
                first_step = time.monotonic() - started
        job.wait()
        text = "".join(lines)
        peak = re.search(r"^peak_rss_kib (\d+)$", text, re.M)
        if job.returncode or not peak:
            raise RuntimeError(f"train.py exited {job.returncode}:\n{text[-3000:]}")
        return {"gib": gib, "block_size": block_size, "tokens": tokens,
                "windows": tokens // block_size, "peak_rss_mib": int(peak.group(1)) / 1024,
                "first_step_s": first_step}


def main(pairs: list[str]) -> None:
    for pair in pairs or ["20:32"]:
        gib, block = (int(part) for part in pair.split(":"))
        r = measure(gib, block)
        print(f"{r['gib']} GiB at --block_size {r['block_size']}: {r['tokens']:,} tokens, about "
              f"{r['windows']:,} windows; peak resident memory {r['peak_rss_mib']:,.0f} MiB; first step line "
              f"after {r['first_step_s']:.1f} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
