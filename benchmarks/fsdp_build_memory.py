"""What building the model costs each FSDP rank in resident memory: train.py
--strategy fsdp on 8 ranks started as pods (support/pods.py), --dataset
shakespeare_char, SGD, 1 optimizer step, once with a GPT of n_layer 8 x
n_embd 1024 (100.7 million parameters, 384 MiB in fp32) and once with one of
n_layer 1 x n_embd 64; each rank's peak resident memory (VmHWM) in the large
run minus the same rank's in the small one: what the model costs the rank,
the start-up of torch, the process group and the data being the same in both.

A rank that builds the whole model before sharding it holds all 384 MiB at
its peak (and more while ``fully_shard`` copies its shard out of it); one
that builds it on the meta device (a task that gives a model factory,
``common.Task.model_factory``) holds its shards (parameters, gradients and
SGD's momentum, 48 MiB each) and, while training, the gathered parameters of
the blocks in flight. Run as a program:

    .venv/bin/python -m benchmarks.fsdp_build_memory [--repo CHECKOUT]

(--repo: the checkout whose train.py runs, e.g. an older one to compare;
default this one. Needs the corpus in ../shared/data/tinyshakespeare, or
TINYSHAKESPEARE_FILE.)
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CORPUS = Path(os.environ.get("TINYSHAKESPEARE_FILE", REPO.parent / "shared" / "data" / "tinyshakespeare" / "input.txt"))
RANKS = 8
LARGE = ["--n_layer", "8", "--n_head", "8", "--n_embd", "1024"]
SMALL = ["--n_layer", "1", "--n_head", "1", "--n_embd", "64"]

# train.py's main under a wrapper that prints the rank's peak resident memory (VmHWM) when build_model
# returns and as the rank ends, whichever way: an FSDP rank ends by os._exit (train_utils.ending.end_process),
# which skips atexit. The wrapper's last line is train.py's own main line.
PEAK = """import atexit, os, sys
def report(stage):
    with open("/proc/self/status") as f:
        peak = next(line for line in f if line.startswith("VmHWM:")).split()[1]
    os.write(1, f"peak_rss_kib {stage} rank {os.environ['RANK']} {peak}\\n".encode())
exit_now = os._exit
def exit_reporting(status):
    report("end")
    exit_now(status)
os._exit = exit_reporting
atexit.register(report, "end")
sys.path[0] = CHECKOUT
sys.argv[0] = os.path.join(CHECKOUT, "train.py")
import train
build_model = train.build_model
def build_model_reporting(*args, **kwargs):
    optimizer = build_model(*args, **kwargs)
    report("built")
    return optimizer
train.build_model = build_model_reporting
train.main(train.train_utils.parse_args(train.__doc__, train.common.TASKS, models=train.train_utils.task_models,
                                        snapshot_paths=train.SNAPSHOT_PATHS))
"""


def peak_per_rank(checkout: Path, sizes: list, work: Path, mmap_threshold: int) -> dict:
    """Each rank's peak resident memory in MiB, rank 0 first, of train.py in
    ``checkout`` on ``RANKS`` ranks under --strategy fsdp with the GPT sizes
    ``sizes`` (flags), 1 SGD step, run in ``work``: {"built": when
    ``build_model`` returned, "end": at the rank's end}. ``mmap_threshold``:
    glibc's MALLOC_MMAP_THRESHOLD_ for the ranks, bytes (0: unset, glibc's
    adaptive threshold)."""
    wrapper = work / "peak.py"
    wrapper.write_text(PEAK.replace("CHECKOUT", repr(str(checkout))))
    data = work / "data" / "shakespeare_char"
    data.mkdir(parents=True, exist_ok=True)
    if not (data / "input.txt").exists():
        (data / "input.txt").symlink_to(CORPUS)
    snapshot = work / f"snapshot-{'x'.join(sizes[1::2])}"  # one per run: another model's is refused
    cmd = [sys.executable, str(REPO / "support" / "pods.py"), f"--nproc_per_node={RANKS}", str(wrapper),
           "--strategy", "fsdp", "--dataset", "shakespeare_char", "--data_dir", str(work / "data"), *sizes,
           "--block_size", "64", "--batch_size", "2", "--optimizer", "sgd", "--max_steps", "1",
           "--eval_windows", "8", "--snapshot_path", str(snapshot)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    env.pop("FORKSERVER_SOCKET", None)  # ranks forked from pods.py itself: the same start for both runs
    if mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
    job = subprocess.run(cmd, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peaks = {(stage, int(rank)): int(kib) / 1024 for stage, rank, kib in
             re.findall(r"^peak_rss_kib (built|end) rank (\d+) (\d+)$", job.stdout, re.M)}
    if job.returncode or len(peaks) != 2 * RANKS:
        raise RuntimeError(f"train.py exited {job.returncode}:\n{job.stdout[-3000:]}")
    return {stage: [peaks[stage, rank] for rank in range(RANKS)] for stage in ("built", "end")}


def main(argv: list) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", type=Path, default=REPO, help="the checkout whose train.py runs (default: this one)")
    parser.add_argument("--mmap_threshold", type=int, default=0,
                        help="glibc's MALLOC_MMAP_THRESHOLD_ for the ranks, bytes (default: unset)")
    options = parser.parse_args(argv)
    checkout = options.repo.resolve()
    import torch

    with tempfile.TemporaryDirectory(prefix="fsdp-build-memory-") as work:
        small = peak_per_rank(checkout, SMALL, Path(work), options.mmap_threshold)
        large = peak_per_rank(checkout, LARGE, Path(work), options.mmap_threshold)
    sys.path.insert(0, str(REPO))
    from gpt import GPT, GPTConfig

    sizes = {flag[2:]: int(value) for flag, value in zip(LARGE[::2], LARGE[1::2])}
    with torch.device("meta"):  # the GPT's parameter count, without its memory
        gpt = GPT(GPTConfig(block_size=64, vocab_size=65, **sizes))
    param_mib = sum(p.numel() * p.element_size() for p in gpt.parameters()) / 2**20
    print(f"torch {torch.__version__}, {os.cpu_count()} CPU cores; train.py of {checkout}; "
          f"MALLOC_MMAP_THRESHOLD_ {options.mmap_threshold or 'unset'}; the 8 x 1024 GPT's fp32 parameters: "
          f"{param_mib:.0f} MiB")
    for stage, when in (("built", "when build_model returns"), ("end", "over the whole run")):
        above = [big - little for big, little in zip(large[stage], small[stage])]
        print(f"peak resident memory per rank {when}, MiB: 1 x 64 GPT {min(small[stage]):.0f}-"
              f"{max(small[stage]):.0f}; 8 x 1024 GPT {min(large[stage]):.0f}-{max(large[stage]):.0f}; above "
              f"the 1 x 64 run's: {min(above):.0f}-{max(above):.0f} (rank by rank: "
              f"{', '.join(f'{a:.0f}' for a in above)})")


if __name__ == "__main__":
    main(sys.argv[1:])
