"""Section 8, language_model: train.py --dataset shakespeare_char (nanoGPT's
CPU recipe) in tokens/s and model FLOP/s; with ``--nanogpt PATH``, against
nanoGPT's own train.py. Needs the corpus in ../shared/data/tinyshakespeare.

8a (with a checkout of karpathy/nanoGPT; needs numpy): nanoGPT's train.py on
the same recipe, model, data and ``--lm_threads`` threads, interleaved with
the kit's 1 process, in tokens per CPU second (the CPU seconds of a run of a
fifth of the steps subtracted: start-up and evaluation drop out, and a busy
machine's other processes count against neither) and in wall tokens/s.
Reading it: "kit / nanoGPT" per pair and their median; 1.0 is parity.

8b: tokens/s and model FLOP/s (6N + 12 n_layer n_embd block_size FLOPs per
token, as train.py's epoch line counts them: docs/performance.md) at 1 and 2
processes, DDP and FSDP, with and without --activation_checkpointing, each
``--lm_steps`` steps. Reading it: on a CPU the FLOP/s over what a 1024 x 1024
fp32 matmul reaches on as many processes (``matmul_flops_per_s``), on a GPU
the MFU; the FSDP rows carry the training state per rank that train.py
printed, FSDP's and DDP's.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.harness import NANOGPT_ITER, REPO, interleaved, table, timed
from support.runs import TORCHRUN, script_env

CORPUS = Path(os.environ.get("TINYSHAKESPEARE_FILE", REPO.parent / "shared" / "data" / "tinyshakespeare" / "input.txt"))
# nanoGPT's CPU recipe (its README), which --dataset shakespeare_char trains by default.
NANOGPT_CPU_RECIPE = ["config/train_shakespeare_char.py", "--device=cpu", "--compile=False", "--dtype=float32",
                      "--block_size=64", "--batch_size=12", "--n_layer=4", "--n_head=4", "--n_embd=128",
                      "--lr_decay_iters=2000", "--dropout=0.0", "--log_interval=1", "--eval_iters=20",
                      "--eval_interval=100000", "--always_save_checkpoint=False"]
STATE_LINE = re.compile(r"state per rank: .* \((?P<fsdp>\d+) bytes, rank \d+ of \d+\); DDP would hold .* "
                        r"\((?P<ddp>\d+) bytes\)")


def matmul_flops_per_s(threads: int, n: int = 1024, reps: int = 10) -> float:
    """fp32 FLOP/s of an n x n by n x n matmul (2 n^3 FLOPs) on this CPU with
    ``threads`` threads, the best of ``reps``: what the machine's matrix
    kernels reach, the yardstick of a CPU's FLOP/s where no data sheet says."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b  # warm-up
        best = min(timed(lambda: a @ b, 3) for _ in range(reps))
    finally:
        torch.set_num_threads(before)
    return 2 * n ** 3 / best


def _corpus_dir(root: Path) -> Path:
    """A --data_dir holding the shared corpus as shakespeare_char/input.txt."""
    (root / "shakespeare_char").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(CORPUS, root / "shakespeare_char" / "input.txt")
    return root


def _child_cpu_seconds() -> float:
    """User + system CPU seconds of this process's finished (waited-for) descendants."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _timed_run(cmd: list, cwd: Path, threads: int, **env: str) -> tuple[str, float]:
    """``cmd``'s stdout and the CPU seconds it and its descendants used, with OMP_NUM_THREADS=``threads``
    and ``env`` added to the environment."""
    before = _child_cpu_seconds()
    out = subprocess.run([str(c) for c in cmd], cwd=cwd, check=True, capture_output=True, text=True,
                         env=script_env(OMP_NUM_THREADS=str(threads), **env))
    return out.stdout, _child_cpu_seconds() - before


def _per_step_cpu(run_for, steps: int) -> tuple:
    """(what ``run_for(steps)`` returned, CPU seconds per training step): ``run_for(n)``
    runs a whole program for n steps and returns (result, CPU seconds); the CPU
    seconds of a run of ``steps // 5`` steps are subtracted, so start-up and
    evaluation (the same in both) drop out. CPU time, not wall time: on a shared
    machine the time the scheduler gives other processes counts against neither."""
    short_steps = max(1, steps // 5)
    _, short = run_for(short_steps)
    result, full = run_for(steps)
    return result, (full - short) / (steps - short_steps)


def _kit_lm_run(data: Path, nproc: int, strategy: str, checkpointing: bool, steps: int, threads: int) -> dict:
    """train.py --dataset shakespeare_char (the task's recipe: nanoGPT's CPU one) for
    ``steps`` optimizer steps on ``nproc`` processes of ``threads`` threads each
    (OMP_NUM_THREADS): its epoch record (tokens_per_s, flops_per_s, mfu on a GPU),
    CPU seconds per step of all processes together (``_per_step_cpu``) and, under
    FSDP, the training state per rank it printed, FSDP's and DDP's."""
    def run_for(n: int) -> tuple:
        cwd = Path(tempfile.mkdtemp())
        cmd = TORCHRUN + ["--standalone", f"--nproc_per_node={nproc}", REPO / "train.py",
                          "--dataset", "shakespeare_char", "--data_dir", data, "--max_steps", str(n),
                          "--strategy", strategy, "--metrics_path", "m.jsonl"]
        stdout, cpu = _timed_run(cmd + (["--activation_checkpointing"] if checkpointing else []), cwd, threads)
        records = [json.loads(line) for line in (cwd / "m.jsonl").read_text().splitlines()]
        shutil.rmtree(cwd, ignore_errors=True)
        return ([r for r in records if "epoch" in r][-1], STATE_LINE.search(stdout)), cpu

    (record, state), cpu_per_step = _per_step_cpu(run_for, steps)
    return {**{key: record.get(key) for key in ("tokens_per_s", "flops_per_s", "mfu", "train_loss",
                                                "peak_gpu_memory_mib")},
            "tokens_per_cpu_s": nproc * 12 * 64 / cpu_per_step,
            "fsdp_state_bytes": int(state["fsdp"]) if state else None,
            "ddp_state_bytes": int(state["ddp"]) if state else None}


def _nanogpt_folder(nanogpt: Path, corpus: Path = CORPUS) -> Path:
    """A temporary copy of nanoGPT's train.py, model.py, configurator.py and its
    shakespeare_char config, with ``corpus`` (the shared one by default) in its
    data format (what its data/shakespeare_char/prepare.py writes: the sorted
    characters as ids, uint16, the first 90% train.bin, the rest val.bin, meta.pkl)."""
    import pickle

    import numpy as np

    folder = Path(tempfile.mkdtemp(prefix="nanogpt-"))
    for name in ("train.py", "model.py", "configurator.py", "config/train_shakespeare_char.py"):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(nanogpt / name, folder / name)
    text = Path(corpus).read_text(encoding="utf-8")
    chars = sorted(set(text))
    ids = {char: i for i, char in enumerate(chars)}
    data = folder / "data" / "shakespeare_char"
    data.mkdir(parents=True)
    split = int(len(text) * 0.9)
    for name, part in (("train.bin", text[:split]), ("val.bin", text[split:])):
        np.array([ids[c] for c in part], dtype=np.uint16).tofile(data / name)
    with open(data / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": ids}, f)
    return folder


def _nanogpt_run(folder: Path, steps: int, threads: int) -> dict:
    """nanoGPT's train.py on its CPU recipe for ``steps`` iterations, ``threads``
    threads: tokens/s over its iterations 1..steps from the times it prints
    (iteration 0, which holds its first evaluation, left out), and tokens per
    CPU second (``_per_step_cpu``)."""
    def run_for(n: int) -> tuple:
        stdout, cpu = _timed_run([sys.executable, "train.py", *NANOGPT_CPU_RECIPE, f"--max_iters={n}"], folder,
                                 threads)
        return [float(ms) / 1e3 for iteration, ms in NANOGPT_ITER.findall(stdout) if int(iteration) >= 1], cpu

    times, cpu_per_step = _per_step_cpu(run_for, steps)
    return {"tokens_per_s": len(times) * 12 * 64 / sum(times), "tokens_per_cpu_s": 12 * 64 / cpu_per_step}


LM_CASES = [(1, "ddp", False), (1, "ddp", True), (1, "fsdp", False), (2, "ddp", False), (2, "ddp", True),
            (2, "fsdp", False), (2, "fsdp", True)]


def _lm_versus_nanogpt(data: Path, nanogpt: str, steps: int, reps: int, threads: int) -> dict:
    """The kit's 1 process against nanoGPT's own train.py (a temporary copy of
    the checkout ``nanogpt``) on the same recipe, model, data and ``threads``,
    ``reps`` interleaved pairs: their tokens per CPU second and tokens/s."""
    folder = _nanogpt_folder(Path(nanogpt))
    pairs = interleaved({"kit": lambda: _kit_lm_run(data, 1, "ddp", False, steps, threads),
                         "nanoGPT": lambda: _nanogpt_run(folder, steps, threads)}, reps)
    shutil.rmtree(folder, ignore_errors=True)
    ratios = {key: statistics.median(k[key] / n[key] for k, n in zip(pairs["kit"], pairs["nanoGPT"]))
              for key in ("tokens_per_cpu_s", "tokens_per_s")}
    text = table(
        f"8a. train.py vs nanoGPT's own train.py: the same recipe, model, data, 1 process of {threads} "
        f"thread(s), {steps} steps each, {reps} interleaved pairs",
        ["pair", "kit tokens per CPU s", "nanoGPT tokens per CPU s", "kit / nanoGPT (CPU time)",
         "kit tokens/s (wall)", "nanoGPT tokens/s (wall)", "kit / nanoGPT (wall)"],
        [[i + 1, k["tokens_per_cpu_s"], n["tokens_per_cpu_s"], k["tokens_per_cpu_s"] / n["tokens_per_cpu_s"],
          k["tokens_per_s"], n["tokens_per_s"], k["tokens_per_s"] / n["tokens_per_s"]]
         for i, (k, n) in enumerate(zip(pairs["kit"], pairs["nanoGPT"]))]
        + [["median", "", "", ratios["tokens_per_cpu_s"], "", "", ratios["tokens_per_s"]]])
    return {"nanogpt_pairs": pairs, "kit_over_nanogpt": ratios, "table": text}


def section_lm(nanogpt: str = None, steps: int = 200, reps: int = 2, threads: int = 1) -> dict:
    """The kit on --dataset shakespeare_char: with a nanoGPT checkout first its
    own train.py against the kit's 1 process (``_lm_versus_nanogpt``, ``threads``
    threads each: 1 makes CPU time compute time, no thread waiting for another);
    then tokens/s and FLOP/s for each of ``LM_CASES`` (processes, strategy,
    activation checkpointing; ``threads`` threads per process), on a CPU their
    share of as many processes' matmul FLOP/s, the training state per rank."""
    if not CORPUS.exists():
        return {"skipped": f"no corpus at {CORPUS}"}
    data = _corpus_dir(Path(tempfile.mkdtemp()))
    report = {"steps": steps}
    versus = ("nanoGPT comparison: skipped (pass --nanogpt PATH, a checkout of karpathy/nanoGPT)" if not nanogpt
              else None)
    if nanogpt:
        report.update(_lm_versus_nanogpt(data, nanogpt, steps, reps, threads))
        versus = report.pop("table")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    matmul = None if gpus else matmul_flops_per_s(threads)  # what ``threads`` threads of one process reach
    results = []
    for nproc, strategy, checkpointing in LM_CASES:
        if gpus and nproc > gpus:
            continue
        run = _kit_lm_run(data, nproc, strategy, checkpointing, steps, threads)
        results.append({"processes": nproc, "strategy": strategy, "activation_checkpointing": checkpointing,
                        **run, "of_matmul": run["flops_per_s"] / (nproc * matmul) if matmul else None})
    rows = [[r["processes"], r["strategy"], "yes" if r["activation_checkpointing"] else "no", r["tokens_per_s"],
             r["flops_per_s"] / 1e9, f"{r['of_matmul']:.1%}" if r["of_matmul"] else
             (f"MFU {r['mfu']:.1%}" if r.get("mfu") else "-"), r["tokens_per_cpu_s"],
             f"{r['fsdp_state_bytes']:,}" if r["fsdp_state_bytes"] else "-",
             f"{r['ddp_state_bytes']:,}" if r["ddp_state_bytes"] else "-"] for r in results]
    yardstick = (f"{threads} thread(s) per process; the yardstick: {matmul / 1e9:.1f} GFLOP/s of a 1024x1024 "
                 f"fp32 matmul per process" if matmul else "GPU")
    text = table(f"8b. Language model: train.py --dataset shakespeare_char (nanoGPT's CPU recipe: 4 layers, "
                 f"4 heads, 128 wide, context 64, batch 12 per process), {steps} steps; {yardstick}",
                 ["processes", "strategy", "activation checkpointing", "tokens/s (the kit's line)",
                  "model GFLOP/s", "of matmul FLOP/s (CPU) / MFU (GPU)", "tokens per CPU second",
                  "FSDP state bytes per rank", "DDP state bytes per rank"], rows)
    report.update(results=results, matmul_flops_per_s=matmul, table=versus + "\n\n" + text)
    return report


# A GPT so small that a step's time is the loop's and the framework's, not arithmetic.
TINY_GPT = {"n_layer": 1, "n_head": 1, "n_embd": 16, "block_size": 16, "batch_size": 4, "dropout": 0.0}


# A bare step of TINY_GPT, in a fresh process of its own as the programs run: forward, loss,
# backward, clipping at 1.0, AdamW, zero_grad; prints the CPU seconds a step (the median of 5
# blocks of 500 steps, after 50). argv: "kit" or "nanoGPT", the nanoGPT folder, the sizes (JSON).
BARE_STEP = """
import importlib.util, json, statistics, sys, time
import torch
which, folder, sizes = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
torch.manual_seed(0)
x = torch.randint(0, 65, (sizes.pop("batch_size"), sizes["block_size"]))
y = torch.randint(0, 65, x.shape)
if which == "kit":
    from gpt import GPT, GPTConfig
    from text_tasks import lm_loss
    model = GPT(GPTConfig(vocab_size=65, **sizes))
    loss_of = lambda: lm_loss(model(x), y)
else:
    spec = importlib.util.spec_from_file_location("nanogpt_model", folder + "/model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.GPT(module.GPTConfig(vocab_size=65, bias=False, **sizes))
    loss_of = lambda: model(x, y)[1]
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
def step():
    loss_of().backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
for _ in range(50):
    step()
blocks = []
for _ in range(5):
    start = time.process_time()
    for _ in range(500):
        step()
    blocks.append((time.process_time() - start) / 500)
print(statistics.median(blocks))
"""


def _bare_step(which: str, nanogpt_folder: Path, threads: int) -> float:
    """CPU seconds of a bare step of ``TINY_GPT`` (``BARE_STEP``, in a process
    of its own with ``threads`` threads): ``which`` "kit" is gpt.GPT with the
    loss as text_tasks.lm_loss computes it, "nanoGPT" nanoGPT's model.GPT,
    whose forward computes the loss."""
    sizes = json.dumps({key: TINY_GPT[key] for key in ("n_layer", "n_head", "n_embd", "block_size", "batch_size",
                                                       "dropout")})
    stdout, _ = _timed_run([sys.executable, "-c", BARE_STEP, which, nanogpt_folder, sizes], REPO, threads)
    return float(stdout.split()[-1])


def section_lm_loop(nanogpt: str = None, steps: int = 12000, reps: int = 3, threads: int = 1) -> dict:
    """Section 8c: the host time of the training loop around the model,
    train.py against nanoGPT's own train.py, on ``TINY_GPT`` (1 block, 16
    wide, a context of 16, batch 4), so small that a step's time is the
    loop's and the framework's. Each program's CPU seconds a step
    (``_per_step_cpu``: a run of ``steps`` steps minus one of a fifth of them;
    both print a progress line every 10 steps), ``reps`` interleaved pairs,
    ``threads`` threads; right after each program, a bare step of its model
    in a process of its own (``_bare_step``), whose difference from the
    program's step is the loop around the model: the batch, the bookkeeping,
    the stop poll, the snapshot clock, the schedule, the progress line. On a
    GPU that host time is what keeps the GPU's queue fed; a CPU measures it
    without a GPU."""
    if not CORPUS.exists():
        return {"skipped": f"no corpus at {CORPUS}"}
    if not nanogpt:
        return {"skipped": "pass --nanogpt PATH, a checkout of karpathy/nanoGPT"}
    data = _corpus_dir(Path(tempfile.mkdtemp()))
    folder = _nanogpt_folder(Path(nanogpt))
    tiny_kit = [f"--{key}={value}" for key, value in TINY_GPT.items()]  # both programs' flags take --name=value

    def kit_for(n: int) -> tuple:
        cwd = Path(tempfile.mkdtemp())
        cmd = TORCHRUN + ["--standalone", "--nproc_per_node=1", REPO / "train.py", "--dataset", "shakespeare_char",
                          "--data_dir", data, "--max_steps", str(n), "--log_every_steps", "10", *tiny_kit]
        stdout, cpu = _timed_run(cmd, cwd, threads)
        shutil.rmtree(cwd, ignore_errors=True)
        return stdout, cpu

    def nanogpt_for(n: int) -> tuple:
        return _timed_run([sys.executable, "train.py", "config/train_shakespeare_char.py", "--device=cpu",
                           "--compile=False", "--dtype=float32", "--eval_interval=100000", "--eval_iters=1",
                           "--log_interval=10", f"--max_iters={n}", *tiny_kit], folder, threads)

    def measured(side: str, run_for) -> dict:
        return {"program": _per_step_cpu(run_for, steps)[1], "bare": _bare_step(side, folder, threads)}

    pairs = interleaved({"kit": lambda: measured("kit", kit_for), "nanoGPT": lambda: measured("nanoGPT", nanogpt_for)},
                        reps)
    shutil.rmtree(folder, ignore_errors=True)
    program = {side: statistics.median(m["program"] for m in runs) for side, runs in pairs.items()}
    bare = {side: statistics.median(m["bare"] for m in runs) for side, runs in pairs.items()}
    # The loop around the model: each repetition's program step less its bare step, measured one after the other.
    around = {side: statistics.median(m["program"] - m["bare"] for m in runs) for side, runs in pairs.items()}
    rows = [[side, 1e3 * program[side], 1e3 * bare[side], 1e3 * around[side],
             ", ".join(f"{1e3 * (m['program'] - m['bare']):.3f}" for m in pairs[side])] for side in ("kit", "nanoGPT")]
    text = table(f"8c. The loop's host time: train.py vs nanoGPT's train.py on a GPT of 1 block, 16 wide, context 16, "
                 f"batch 4 ({steps} steps, {reps} interleaved pairs, {threads} thread(s), CPU ms a step)",
                 ["program", "the program's step (median)", "a bare step of its model (median)",
                  "the loop around the model (median)", "the loop around the model, each repetition"], rows)
    return {"steps": steps, "reps": reps, "pairs_cpu_s_per_step": pairs, "bare_cpu_s_per_step": bare,
            "around_model_cpu_s_per_step": around, "program_cpu_s_per_step": program,
            "kit_over_nanogpt_program": program["kit"] / program["nanoGPT"], "table": text}


# Section 8e: the same windows from the text, from nanoGPT's token files and from llm.c's shards.
SAME_WINDOWS = ["--n_layer", "2", "--n_head", "4", "--n_embd", "128", "--block_size", "64", "--batch_size", "12",
                "--lr", "1e-3", "--beta2", "0.99", "--min_lr", "1e-4", "--warmup_steps", "100", "--dropout", "0",
                "--eval_every_steps", "0", "--eval_windows", "0", "--log_every_steps", "100", "--num_workers", "0"]


def section_token_sources(steps: int = 300, reps: int = 5, nproc: int = 2) -> dict:
    """train.py on ``nproc`` processes of one thread, a GPT of 2 layers on the
    same windows of Tiny Shakespeare read three ways: ``--dataset
    shakespeare_char`` (the text, a tensor in memory), ``--dataset tokens`` on
    nanoGPT's ``train.bin``/``val.bin`` (memory-mapped), and on the same
    training tokens as 3 shards in llm.c's format; every flag given
    (``SAME_WINDOWS``), so the text and the files train bitwise the same (the
    shards' windows stop at each shard's end). ``reps`` rounds, each
    starting with another source; each run's CPU seconds per step (``_per_step_cpu``:
    a run of ``steps // 5`` subtracted) as tokens per CPU second, and each
    source's median against the text's."""
    from support.data import build_token_files, write_token_shard

    root = Path(tempfile.mkdtemp(prefix="token-sources-"))
    text = _corpus_dir(root / "text")
    files = build_token_files(root / "files")
    shards = root / "shards"
    shards.mkdir()
    ids = (torch.frombuffer(bytearray((files / "train.bin").read_bytes()), dtype=torch.int16).long() & 0xFFFF).tolist()
    size = -(-len(ids) // 3)
    for k in range(3):
        write_token_shard(shards / f"shakespeare_train_{k + 1:06d}.bin", ids[k * size:(k + 1) * size])
    shutil.copyfile(files / "val.bin", shards / "shakespeare_val_000000.bin")
    shutil.copyfile(files / "meta.pkl", shards / "meta.pkl")
    sources = {"text (shakespeare_char)": ["--dataset", "shakespeare_char", "--data_dir", text],
               "nanoGPT's train.bin (tokens)": ["--dataset", "tokens", "--data_dir", files],
               "llm.c shards x 3 (tokens)": ["--dataset", "tokens", "--data_dir", shards]}

    def runner(source: list):
        def run_for(n: int) -> tuple:
            cwd = Path(tempfile.mkdtemp(dir=root))
            cmd = TORCHRUN + ["--standalone", f"--nproc_per_node={nproc}", REPO / "train.py", *source,
                              *SAME_WINDOWS, "--max_steps", str(n), "--metrics_path", "m.jsonl"]
            _, cpu = _timed_run(cmd, cwd, 1)
            records = [json.loads(line) for line in (cwd / "m.jsonl").read_text().splitlines()]
            return [r for r in records if "epoch" in r][-1]["train_loss"], cpu
        return run_for

    per_cpu_s = {name: [] for name in sources}
    losses = {}
    names = list(sources)
    try:
        fetch_us = {name: _fetch_us(source) for name, source in sources.items()}
        for round_ in range(reps):  # each round in another order: no source always runs first
            for name in names[round_ % len(names):] + names[:round_ % len(names)]:
                losses[name], cpu_per_step = _per_step_cpu(runner(sources[name]), steps)
                per_cpu_s[name].append(nproc * 12 * 64 / cpu_per_step)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    text_median = statistics.median(per_cpu_s["text (shakespeare_char)"])
    step_us = 12 * 64 / text_median * 1e6  # one process's CPU microseconds a step, on the text
    rows = [[name, ", ".join(f"{v:,.0f}" for v in values), f"{statistics.median(values):,.0f}",
             f"{statistics.median(values) / text_median:.3f}", f"{fetch_us[name]:,.0f}",
             f"{1 - (fetch_us[name] - fetch_us['text (shakespeare_char)']) / step_us:.3f}", f"{losses[name]:.6f}"]
            for name, values in per_cpu_s.items()]
    return {"tokens_per_cpu_s": per_cpu_s, "fetch_us_per_batch": fetch_us, "train_loss": losses,
            "table": table(f"8e. the same windows from the text, token files and shards: train.py, {nproc} "
                           f"process{'es' if nproc > 1 else ''} x 1 thread, a 2-layer GPT, {steps} steps less {steps // 5}, {reps} "
                           f"rounds, each in another order; a batch's fetch timed alone, in this process",
                           ["source", "tokens per CPU s, each round", "median", "vs the text",
                            "fetch us per batch", "vs the text, by the fetch", "train loss at the end"], rows)}


def _fetch_us(source: list, batches: int = 2000) -> float:
    """Microseconds to fetch one training batch of 12 windows (``SAME_WINDOWS``)
    of ``source`` (its --dataset and --data_dir flags) as train.py fetches it:
    the task's training set wrapped in ``train_utils.SeededFetches``, epoch 0,
    a seeded random batch of indices at a time; the median of 5 rounds of
    ``batches`` fetches, in this process. What a source changes in a step is
    this fetch: the model's step is the same for all."""
    import common
    import train_utils
    from support.trainer import task_args

    flags = dict(zip(source[::2], source[1::2]))
    args = task_args(flags["--dataset"], flags["--data_dir"], n_layer=2, n_head=4, n_embd=128, block_size=64,
                     dropout=0.0, train_files=None, val_files=None)
    data = train_utils.SeededFetches(common.load_task(args, download=False).train_set, 0)
    data.set_epoch(0)
    picks = torch.randint(len(data), (batches, 12), generator=torch.Generator().manual_seed(0)).tolist()
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for indices in picks:
            data.__getitems__(indices)
        rounds.append((time.perf_counter() - start) / batches * 1e6)
    return statistics.median(rounds)
