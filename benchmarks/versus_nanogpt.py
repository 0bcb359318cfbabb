"""Section 8d, versus_nanogpt: train.py's step against nanoGPT's own train.py
on the same token files, eager and compiled, at 1 and 2 CPU threads, and on a
GPT so small that the loop around the model is most of a step.

Both programs train the same GPT (nanoGPT's CPU recipe: 4 layers, 4 heads, 128
wide, a context of 64, batch 12; no dropout) on the same files: Tiny
Shakespeare as nanoGPT's ``data/shakespeare_char/prepare.py`` writes it
(train.bin, val.bin, meta.pkl), which train.py reads as ``--dataset tokens``.
nanoGPT runs from a temporary copy of its checkout, its code as it is, shortened
by its own flags (``--max_iters``, ``--eval_interval``, ``--log_interval=10``);
train.py prints a progress line every 10 steps (``--log_every_steps 10``).

Each program's milliseconds a step are the median of the intervals between its
progress lines, stamped as they arrive (``harness.run_stamped``), from the
first fifth of its steps on (compilation and the first evaluation left out):
one clock for both. ``--versus_pairs`` alternating pairs per case (the kit
first, then nanoGPT first, ...). Reading it: "kit speed / nanoGPT's" is
nanoGPT's ms a step over the kit's, per pair; 1.0 is parity, above 1 the kit
is faster. The median over the pairs is the case's figure.
"""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks.harness import KIT_STEP, NANOGPT_ITER, REPO, interleaved, ms_per_step, run_stamped, table, tail
from benchmarks.language_model import CORPUS, _nanogpt_folder
from support.runs import TORCHRUN, script_env

# nanoGPT's CPU recipe (its README), the GPT both programs train, and one so small that the loop dominates.
CPU_GPT = {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 64, "batch_size": 12, "dropout": 0.0}
TINY_GPT = {"n_layer": 1, "n_head": 1, "n_embd": 16, "block_size": 16, "batch_size": 4, "dropout": 0.0}
# (label, sizes, compiled, threads, steps)
CASES = [("compiled, 2 threads", CPU_GPT, True, 2, 400), ("compiled, 1 thread", CPU_GPT, True, 1, 300),
         ("eager, 1 thread", CPU_GPT, False, 1, 300), ("eager, 2 threads", CPU_GPT, False, 2, 400),
         ("tiny GPT, compiled, 1 thread", TINY_GPT, True, 1, 3000)]


def _flags(sizes: dict) -> list:
    """The GPT's sizes as both programs' flags take them (--name=value)."""
    return [f"--{name}={value}" for name, value in sizes.items()]


def kit_run(data: Path, sizes: dict, compiled: bool, threads: int, steps: int, timeout: float) -> dict:
    """train.py --dataset tokens on ``data`` for ``steps`` steps, one process of
    ``threads`` threads: ms a step (``ms_per_step``), or the output's tail."""
    work = Path(tempfile.mkdtemp(prefix="kit-"))
    cmd = TORCHRUN + ["--standalone", "--nproc_per_node=1", REPO / "train.py", "--dataset", "tokens",
                      "--data_dir", data, f"--max_steps={steps}", "--log_every_steps=10",
                      "--eval_every_steps=1000000", "--eval_windows=24", "--lr=1e-3", *_flags(sizes)]
    status, lines, seconds = run_stamped(cmd + (["--compile"] if compiled else []), work, timeout,
                                         script_env(OMP_NUM_THREADS=str(threads)))
    shutil.rmtree(work, ignore_errors=True)
    ms, intervals = ms_per_step(lines, KIT_STEP, steps // 5)
    return {"ms_per_step": ms, "intervals": intervals, "seconds": seconds} if status == 0 and ms else \
        {"error": tail(lines), "seconds": seconds}


def nanogpt_run(folder: Path, sizes: dict, compiled: bool, threads: int, steps: int, timeout: float) -> dict:
    """nanoGPT's own train.py in ``folder`` (``_nanogpt_folder``: its code and the
    token files) on its shakespeare_char config, on the CPU in fp32, ``steps``
    iterations: ms a step (``ms_per_step``), or the output's tail."""
    cmd = [sys.executable, "train.py", "config/train_shakespeare_char.py", "--device=cpu", f"--compile={compiled}",
           "--dtype=float32", f"--max_iters={steps}", "--log_interval=10", "--eval_interval=1000000",
           "--eval_iters=2", "--always_save_checkpoint=False", *_flags(sizes)]
    status, lines, seconds = run_stamped(cmd, folder, timeout, script_env(OMP_NUM_THREADS=str(threads)))
    ms, intervals = ms_per_step(lines, NANOGPT_ITER, steps // 5)
    return {"ms_per_step": ms, "intervals": intervals, "seconds": seconds} if status == 0 and ms else \
        {"error": tail(lines), "seconds": seconds}


def section_versus_nanogpt(nanogpt: str = None, pairs: int = 3, timeout: float = 900) -> dict:
    """Each of ``CASES`` (sizes, compiled or eager, threads, steps): ``pairs``
    alternating pairs of ``kit_run`` and ``nanogpt_run`` on the same token
    files; per pair nanoGPT's ms a step over the kit's, and their median."""
    if not CORPUS.exists():
        return {"skipped": f"no corpus at {CORPUS}"}
    if not nanogpt:
        return {"skipped": "pass --nanogpt PATH, a checkout of karpathy/nanoGPT"}
    folder = _nanogpt_folder(Path(nanogpt))
    data = folder / "data" / "shakespeare_char"  # nanoGPT's token files, which train.py reads as --dataset tokens
    results, rows = [], []
    for label, sizes, compiled, threads, steps in CASES:
        runs = interleaved({"kit": lambda: kit_run(data, sizes, compiled, threads, steps, timeout),
                            "nanoGPT": lambda: nanogpt_run(folder, sizes, compiled, threads, steps, timeout)}, pairs)
        ratios = [n["ms_per_step"] / k["ms_per_step"] for k, n in zip(runs["kit"], runs["nanoGPT"])
                  if k.get("ms_per_step") and n.get("ms_per_step")]
        median = statistics.median(ratios) if ratios else None
        results.append({"case": label, "sizes": sizes, "compiled": compiled, "threads": threads, "steps": steps,
                        "runs": runs, "kit_speed_over_nanogpt": ratios, "median": median})
        errors = [run["error"] for side in runs.values() for run in side if "error" in run]
        rows.append([label, ", ".join(f"{k.get('ms_per_step') or 0:.2f}" for k in runs["kit"]),
                     ", ".join(f"{n.get('ms_per_step') or 0:.2f}" for n in runs["nanoGPT"]),
                     ", ".join(f"{r:.3f}" for r in ratios), f"{median:.3f}" if median else "-",
                     errors[0][:200] if errors else ""])
    shutil.rmtree(folder, ignore_errors=True)
    text = table(f"8d. train.py vs nanoGPT's own train.py on the same token files (Tiny Shakespeare as nanoGPT's "
                 f"prepare.py writes it), ms a step from their progress lines, {pairs} alternating pairs per case; "
                 f"the GPT: 4 layers, 4 heads, 128 wide, context 64, batch 12 (tiny: 1 block, 16 wide, context "
                 f"16, batch 4)",
                 ["case", "kit ms a step (each pair)", "nanoGPT ms a step (each pair)",
                  "kit speed / nanoGPT's (each pair)", "median", "error"], rows)
    return {"pairs": pairs, "cases": results, "table": text}
