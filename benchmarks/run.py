"""Side-by-side performance measurements of the kit (train.py), in one run.

    .venv/bin/python benchmarks/run.py             # everything, about 2 minutes on 2 idle CPU cores
    .venv/bin/python benchmarks/run.py --only 1 2  # some sections

Prints one table per section, with the machine it ran on, and writes all
numbers to benchmarks/results/latest.json (``--out`` to change). Not part of
the test run; needs requirements.txt and requirements-test.txt (it builds its
datasets with support/data.py) and, for sections 3 and 4, the real MNIST
digits in ../shared/data/mnist-t10k (or $MNIST_T10K_DIR).

Sections:
  1  overhead: steps/s of train.py's Trainer.train_step over a bare
     zero_grad/forward/backward/step loop on the same DDP model, batch and
     data, in a 1-process gloo group; repetitions interleaved.
  1c the time-out report's cost: CPU seconds a step of train.py at 2
     processes on a step so small that the loop dominates, with torch's
     flight recorder off and on (train.py's default).
  1d the phase timer and straggler watch's cost: train.py's loop step
     (batch, train_step, stop poll) without and with them, CPU time,
     interleaved pairs, in a 1-process gloo group.
  1b bf16 autocast on this CPU: samples/s with and without, per model (the
     measurement behind --amp's CPU rule).
  2  input pipeline: CIFAR-10-shaped images/s, read from the real on-disk
     format, of the fast path (uint8 batches + augmentation on the device)
     against torchvision per-sample transforms with 2 DataLoader workers.
  2b keyed draws: microseconds per fetch with the data's random draws keyed
     by (seed, epoch, sample), as train.py fetches, against the same fetch
     drawing from torch's generator: an item augmented in __getitem__, a
     batch of GPT windows, a whole batch without draws.
  3  scaling: global samples/s of train.py on real MNIST with 1
     and 2 processes (gloo on CPU, nccl on GPUs), and the share of a training
     step that is gradient all-reduce.
  4  time to 95% validation accuracy on real MNIST (wall seconds from launch,
     2 processes under torchrun), fast path against the per-sample path.
  5  CUDA only: ResNet-18 CIFAR-10 images/s on one GPU for fp32, bf16,
     bf16 + channels_last, + torch.compile, and the share of the GPU's peak
     FLOP/s that is. Without CUDA: "skipped: no CUDA device".
  6  FSDP vs DDP at world size 2 (gloo on CPU, nccl on GPUs): time of a
     training step and bytes of training state per rank (params + grads +
     SGD momentum), MNIST CNN and ResNet-18, as train.py --strategy fsdp
     and --strategy ddp wrap them; on CUDA also each one's peak GPU memory.
  6b bytes between two hosts per optimizer step, DDP, FSDP and HSDP: train.py
     as a job of 2 hosts x 2 ranks (two network namespaces joined by one
     link; needs root), the GPT of --dataset shakespeare_char, each host's
     link counters, beside what the algorithms predict.
  7  snapshot save rate: atomic_save of 64 MiB to 1 GiB, MiB/s, in --save_dir
     (your snapshots' storage), and the model size whose snapshot fits in
     what Slurm's KillWait leaves (docs/slurm.md).
  8  language model: train.py --dataset shakespeare_char (nanoGPT's CPU
     recipe) for --lm_steps steps. 8a, with --nanogpt PATH (a checkout of
     karpathy/nanoGPT; needs numpy): its own train.py on the same recipe,
     model, data and --lm_threads threads, interleaved with the kit's, in
     tokens per CPU second (a run of a fifth of the steps subtracted: start-up
     and evaluation drop out, and a busy machine's other processes count
     against neither) and in wall tokens/s. 8b: tokens/s and model FLOP/s at
     1 and 2 processes, DDP vs FSDP, with and without
     --activation_checkpointing, the training state per rank; on a CPU the
     share of its measured fp32 matmul FLOP/s, on a GPU the MFU. Needs the
     corpus in ../shared/data/tinyshakespeare.
  8c the loop's host time (with --nanogpt): CPU seconds a step of train.py and
     of nanoGPT's train.py on a GPT so small that the loop dominates, and of a
     bare step of each one's model: the difference is the loop around the model.
  8d the compiled step (with --nanogpt): train.py against nanoGPT's own
     train.py on the same token files, eager and compiled, 1 and 2 threads,
     and a GPT so small that the loop dominates; ms a step from their
     progress lines, --versus_pairs alternating pairs per case.
  8e the same windows read three ways: train.py (2 processes, a 2-layer GPT)
     on --dataset shakespeare_char's text, on nanoGPT's token files and on
     llm.c's shards of the same tokens, alternating; tokens per CPU second
     and each against the text (the three end at the same training loss).
  9  snapshots that do not stop training: blocking seconds per snapshot,
     synchronous vs asynchronous (train.py's default), DDP file and FSDP
     shards, ~100 MB of training state, world size 2 (CUDA: one process per
     GPU, at most 2); training throughput with and without a snapshot every
     few seconds, and the cost of one a minute (target <= 2%).
     --snapshot_device cpu|cuda.

Each section is a module of benchmarks/ (overhead.py, amp_cpu.py, hang_watch.py,
input_pipeline.py, scaling.py, time_to_accuracy.py, gpu.py, fsdp_vs_ddp.py,
node_traffic.py, snapshot_save.py, language_model.py, versus_nanogpt.py, snapshot_cost.py; what they share is
harness.py); this file runs the ones asked for.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
# Run as a script, python puts benchmarks/ itself first on sys.path, where the
# section modules (gpu.py, scaling.py, ...) would stand in for any top-level
# module of the same name: they are the package benchmarks.*, imported from the
# repository (which the package puts first on sys.path).
sys.path[:] = [path for path in sys.path if Path(path or ".").resolve() != REPO / "benchmarks"]
sys.path.insert(0, str(REPO))

from benchmarks.amp_cpu import section_amp_cpu  # noqa: E402
from benchmarks.fsdp_vs_ddp import section_fsdp  # noqa: E402
from benchmarks.gpu import section_gpu  # noqa: E402
from benchmarks.hang_watch import section_hang_watch  # noqa: E402
from benchmarks.harness import machine  # noqa: E402
from benchmarks.input_pipeline import section_input  # noqa: E402
from benchmarks.keyed_draws import section_keyed_draws  # noqa: E402
from benchmarks.language_model import section_lm, section_lm_loop, section_token_sources  # noqa: E402
from benchmarks.node_traffic import section_node_traffic  # noqa: E402
from benchmarks.overhead import section_overhead, section_step_phases  # noqa: E402
from benchmarks.scaling import section_scaling  # noqa: E402
from benchmarks.snapshot_cost import section_snapshot_cost  # noqa: E402
from benchmarks.snapshot_save import section_snapshot_save  # noqa: E402
from benchmarks.time_to_accuracy import section_time_to_accuracy  # noqa: E402
from benchmarks.versus_nanogpt import section_versus_nanogpt  # noqa: E402
from support.data import Absent, build_mnist_root  # noqa: E402


def gpus_missing(processes: int) -> str:
    """Why a section of ``processes`` processes, one GPU each, cannot run on this
    machine ('' when it can): on CUDA each process needs a GPU of its own; on a
    CPU any number runs (gloo)."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus and processes > gpus:
        return f"needs {processes} GPUs (one per process), this machine has {gpus}"
    return ""


def run_section(key: str, name: str, fn, processes: int = 1) -> dict:
    """Run one section, ``fn() -> dict`` with a "table"; return its result with
    "section_seconds". A section this machine cannot run (``gpus_missing``) is
    not started: {"skipped": reason}. One that raises is recorded, not
    re-raised: {"error": "<type>: <first line>"}, so the sections after it run."""
    start = time.perf_counter()
    missing = gpus_missing(processes)
    if missing:
        result = {"skipped": missing}
    else:
        try:
            result = fn()
        except Exception as exc:  # recorded; the other sections still run
            first = (str(exc).strip().splitlines() or [""])[0]
            result = {"error": f"{type(exc).__name__}: {first}"[:500]}
    result["section_seconds"] = time.perf_counter() - start
    if "table" not in result:
        why = f"skipped: {result['skipped']}" if "skipped" in result else f"failed: {result.get('error')}"
        result["table"] = f"**{key}. {name}**\n\n{why}"
    return result


def run_sections(sections: list, report: dict, out: str) -> None:
    """Run ``sections`` ((key, name, fn, processes) each) in order with
    ``run_section``, printing each table and rewriting ``out`` (JSON) after
    each: a later section that dies loses only its own numbers."""
    for key, name, fn, processes in sections:
        result = run_section(key, name, fn, processes)
        result["load_avg_1min_after"] = round(os.getloadavg()[0], 2)
        report["sections"][name] = result
        print("\n" + result["table"], flush=True)
        print(f"\n({result['section_seconds']:.0f} s; load average after: "
              f"{result['load_avg_1min_after']} on {os.cpu_count()} cores)", flush=True)
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(report, f, indent=1)


def main() -> None:
    """The command line: run the sections asked for (``--only``; all by default),
    print each one's table and write every number to ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", default=None, help="sections to run: 1 1b 1c 1d 2 2b 3 4 5 6 6b 7 8 8c 8d 8e 9")
    parser.add_argument("--save_dir", default=None,
                        help="section 7: the folder whose storage to time (where your snapshots go); "
                             "default: a temporary folder")
    parser.add_argument("--nanogpt", default=None,
                        help="section 8: a checkout of github.com/karpathy/nanoGPT, whose train.py runs on the "
                             "same recipe as the kit's for the comparison (copied to a temporary folder)")
    parser.add_argument("--lm_steps", type=int, default=200, help="section 8: optimizer steps per run")
    parser.add_argument("--lm_threads", type=int, default=1,
                        help="section 8: threads per process (the kit's and nanoGPT's)")
    parser.add_argument("--versus_pairs", type=int, default=3,
                        help="section 8d: alternating pairs of the kit and nanoGPT per case")
    parser.add_argument("--token_processes", type=int, default=2,
                        help="section 8e: processes per run (1: no all-reduce in the CPU time)")
    parser.add_argument("--snapshot_device", choices=("cpu", "cuda"), default=None,
                        help="section 9: where the model trains (default: cuda where there is a GPU, else cpu); "
                             "its snapshots go to $SNAPSHOT_BENCH_DIR (default: a temporary folder)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "latest.json"),
                        help="where to write the JSON results")
    args = parser.parse_args()
    wanted = set(args.only) if args.only else {"1", "1b", "1c", "1d", "2", "2b", "3", "4", "5", "6", "6b", "7", "8", "8c", "8d", "8e", "9"}
    report = {"machine": machine(), "sections": {}}
    m = report["machine"]
    print(f"machine: {m['cpu']}, {m['cpu_cores']} cores; torch {m['torch']}; "
          f"CUDA device: {m['cuda_device'] or 'none'}; load avg at start: {m.get('load_avg_1min_at_start')}",
          flush=True)
    mnist = None
    if wanted & {"3", "4"}:
        try:
            mnist = build_mnist_root(Path(tempfile.mkdtemp()) / "mnist")
        except Absent as exc:  # the real MNIST digits are not there
            print(f"sections 3 and 4 skipped: real MNIST digits not found ({exc})", flush=True)
    sections = [("1", "overhead", section_overhead, 1), ("1b", "amp_cpu", section_amp_cpu, 1),
                ("1c", "hang_watch", section_hang_watch, 2), ("1d", "step_phases", section_step_phases, 1),
                ("2", "input_pipeline", section_input, 1), ("2b", "keyed_draws", section_keyed_draws, 1),
                ("3", "scaling", lambda: section_scaling(mnist) if mnist else {"skipped": "no MNIST"}, 1),
                ("4", "time_to_accuracy",
                 lambda: section_time_to_accuracy(mnist) if mnist else {"skipped": "no MNIST"}, 2),
                ("5", "gpu", section_gpu, 1), ("6", "fsdp_vs_ddp", section_fsdp, 2),
                ("6b", "node_traffic", section_node_traffic, 2),
                ("7", "snapshot_save", lambda: section_snapshot_save(args.save_dir), 1),
                ("8", "language_model", lambda: section_lm(args.nanogpt, args.lm_steps, threads=args.lm_threads), 1),
                ("8c", "lm_loop", lambda: section_lm_loop(args.nanogpt, threads=args.lm_threads), 1),
                ("8d", "versus_nanogpt", lambda: section_versus_nanogpt(args.nanogpt, args.versus_pairs), 1),
                ("8e", "token_sources", lambda: section_token_sources(nproc=args.token_processes), 2),
                ("9", "snapshot_cost", lambda: section_snapshot_cost(args.snapshot_device), 1)]
    run_sections([s for s in sections if s[0] in wanted], report, args.out)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
