"""The GPU check: every figure that needs a GPU, on one H100 or H200, in one
command of at most 8 minutes (``benchmarks/gpu_check.sh``, which runs this).

    benchmarks/gpu_check.sh --prepare PATH    # once: nanoGPT (a checkout, or a git dir) and the corpus into .gpu_check/
    benchmarks/gpu_check.sh                   # on the GPU machine: writes benchmarks/results/gpu_check.json
    benchmarks/gpu_check.sh --dry_run         # every part shrunk, on a CPU in a few minutes

Phase 1 runs the checks whose outcome is a yes or a no side by side (their
timings are not read): the ladder's five rungs at one GPU on the synthetic
task, the three that resume resumed once; ``--amp fp16`` with its loss scaler;
a run stopped by SIGTERM and resumed, with and without ``--deterministic``,
its last snapshot compared bitwise with an uninterrupted run's; and
tests/test_gpu_speed.py, whose CUDA test fails at any host-device
synchronisation in the steady-state step. Phase 2 times, one at a time: the
GPU recipe of docs/language-model.md, train.py against nanoGPT's own
``train.py config/train_shakespeare_char.py`` (its config file as it is, the
run shortened by ``--max_iters``), eager and compiled, 3 alternating pairs
each; train.py under FSDP with ``--compile``; fp32 with TF32 and with
``--no_tf32``; what a snapshot of an 85M-parameter GPT (GPT-2 small) costs
the training loop; and ResNet-18 on CIFAR-10-shaped batches, train.py's
step against a bare loop of the same steps.

Each program's milliseconds a step are the median, over its steps after the
first ``WARMUP_STEPS`` (compilation, the first evaluation), of the intervals
between the progress lines it prints every 10 steps (train.py's
``--log_every_steps 10``, nanoGPT's ``log_interval``), stamped as they
arrive: the same clock for both, evaluations and snapshots falling in a few
intervals, which the median leaves out.

Writes one JSON (``--out``; the GPU, its driver, torch, the date and every
figure) and prints a table per part. A part that cannot run says why
(``skipped``): nanoGPT absent, no CUDA device, the time budget spent. Needs
nanoGPT's ``train.py``, ``model.py``, ``configurator.py`` and ``config/``
(``--nanogpt``, $NANOGPT_DIR, default ``.gpu_check/nanoGPT``: fetched code
is never committed, so it travels as an ignored folder) and the Tiny
Shakespeare corpus (``--corpus``, $TINYSHAKESPEARE_FILE, default
``../shared/data/tinyshakespeare/input.txt``, else
``.gpu_check/tinyshakespeare/input.txt``); numpy for nanoGPT.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import copy
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:] = [path for path in sys.path if Path(path or ".").resolve() != REPO / "benchmarks"]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from benchmarks import harness  # noqa: E402  (puts tests/ on sys.path too)
from benchmarks.harness import KIT_STEP, NANOGPT_ITER, machine, table, tail, text_of  # noqa: E402
from helpers import TORCHRUN, free_port, script_env, snapshot_tensors  # noqa: E402

CHECK_FOLDER = REPO / ".gpu_check"  # ignored (.gitignore): what the check needs that is not the project's
NANOGPT_FILES = ("train.py", "model.py", "configurator.py", "config/train_shakespeare_char.py")
GPT2_VOCAB = 50257  # GPT-2's BPE tokens: the random ids of the token-file part are below it
WARMUP_STEPS = 50  # steps left out of a program's ms a step: compilation, the first evaluation
RUNGS = ("singlegpu.py", "multigpu_spawn.py", "multigpu_torchrun.py", "multinode.py", "multinode_fsdp.py")
RESUMING_RUNGS = ("multigpu_torchrun.py", "multinode.py", "multinode_fsdp.py")


class Sizes:
    """How big each part runs: on the GPU the recipes themselves; ``--dry_run``
    shrinks every part to seconds on a CPU."""

    def __init__(self, dry_run: bool) -> None:
        self.dry_run = dry_run
        if dry_run:
            self.gpt = dict(n_layer=2, n_head=2, n_embd=32, block_size=32, batch_size=8, dropout=0.0)
            self.pair_steps, self.pairs, self.short_steps, self.resume_steps, self.stop_at = 100, 1, 40, 40, 20
            self.warmup, self.rung_epochs = 30, 1
            self.snapshot_gpt = dict(n_layer=2, n_head=2, n_embd=64, block_size=64, vocab_size=512)
            self.resnet_batch, self.resnet_steps, self.resnet_reps = 8, 2, 2
            self.gpt2 = dict(n_layer=2, n_head=2, n_embd=32, block_size=64, batch_size=4)
            self.gpt2_steps, self.gpt2_tokens = 60, 200_000
        else:  # docs/language-model.md's GPU recipe: nanoGPT's config/train_shakespeare_char.py
            self.gpt = dict(n_layer=6, n_head=6, n_embd=384, block_size=256, batch_size=64, dropout=0.2)
            self.pair_steps, self.pairs, self.short_steps, self.resume_steps, self.stop_at = 300, 3, 200, 150, 70
            self.warmup, self.rung_epochs = WARMUP_STEPS, 2
            self.snapshot_gpt = dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304)
            self.resnet_batch, self.resnet_steps, self.resnet_reps = 256, 20, 6
            # GPT-2 small on nanoGPT's train.py defaults (a batch of 12 windows of 1,024 tokens),
            # one micro-batch a step
            self.gpt2 = dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, batch_size=12)
            self.gpt2_steps, self.gpt2_tokens = 150, 50_000_000

    @property
    def tokens_per_step(self) -> int:
        return self.gpt["batch_size"] * self.gpt["block_size"]


# --------------------------------------------------------------------------
# Running programs
# --------------------------------------------------------------------------

def _env(**extra: str) -> dict:
    """The scripts' environment (helpers.script_env: output unbuffered), plus ``extra``."""
    return script_env(**extra)


def run_stamped(cmd: list, cwd: Path, timeout: float, **env: str) -> tuple[int, list, float]:
    """``harness.run_stamped`` in the scripts' environment, plus ``env``."""
    return harness.run_stamped(cmd, cwd, timeout, _env(**env))


def ms_per_step(lines: list, pattern, warmup: int = WARMUP_STEPS) -> tuple:
    """``harness.ms_per_step``, from step ``warmup`` (default ``WARMUP_STEPS``) on."""
    return harness.ms_per_step(lines, pattern, warmup)


def kit_command(nproc: int = 1) -> list:
    return TORCHRUN + ["--standalone", f"--nproc_per_node={nproc}", REPO / "train.py"]


def kit_gpt_flags(sizes: Sizes, data: Path, steps: int, *extra: str) -> list:
    """train.py on the GPU recipe (``sizes.gpt``) for ``steps`` steps, a progress line every 10."""
    flags = ["--dataset", "shakespeare_char", "--data_dir", data, "--max_steps", steps, "--log_every_steps", 10]
    for name, value in sizes.gpt.items():
        flags += [f"--{name}", value]
    return flags + list(extra)


def amp_flags(sizes: Sizes) -> list:
    """bf16 autocast on the GPU (the recipe's); none on a CPU (slower there)."""
    return [] if sizes.dry_run else ["--amp", "bf16"]


# --------------------------------------------------------------------------
# Phase 1: yes-or-no checks, side by side
# --------------------------------------------------------------------------

def check_rung(script: str, work: Path, epochs: int, timeout: float) -> dict:
    """``script`` at one process (one GPU) on the synthetic task, ``epochs``
    epochs; a rung that resumes is then asked for one more and must resume
    after them."""
    folder = work / script.replace(".py", "")
    folder.mkdir()
    if script == "singlegpu.py":
        cmd = [sys.executable, REPO / script]
    elif script == "multigpu_spawn.py":
        cmd = [sys.executable, REPO / script, "--world_size", "1"]
    else:
        cmd = TORCHRUN + ["--standalone", "--nproc_per_node=1", REPO / script]
    env = {"MASTER_PORT": str(free_port())} if script == "multigpu_spawn.py" else {}
    status, lines, seconds = run_stamped(cmd + ["--total_epochs", str(epochs)], folder, timeout, **env)
    result = {"rung": script, "ok": status == 0 and f"epoch {epochs}/{epochs}" in text_of(lines), "seconds": seconds}
    if not result["ok"]:
        return dict(result, error=tail(lines))
    if script in RESUMING_RUNGS:
        more = epochs + 1
        status, lines, seconds = run_stamped(cmd + ["--total_epochs", str(more)], folder, timeout, **env)
        resumed = (status == 0 and "resuming from snapshot" in text_of(lines)
                   and f"epoch {more}/{more}" in text_of(lines))
        result.update(resumed=resumed, ok=resumed, seconds=result["seconds"] + seconds)
        if not resumed:
            result["error"] = tail(lines)
    return result


def check_fp16(sizes: Sizes, data: Path, work: Path, timeout: float) -> dict:
    """train.py's GPT recipe under --amp fp16 (the loss scaler on): it trains,
    the loss is finite, and how many steps the scaler skipped."""
    folder = work / "fp16"
    folder.mkdir()
    status, lines, seconds = run_stamped(kit_command() + kit_gpt_flags(sizes, data, sizes.short_steps, "--amp", "fp16",
                                                                       "--metrics_path", "m.jsonl"), folder, timeout)
    records = _records(folder / "m.jsonl")
    return {"ok": status == 0 and bool(records), "seconds": seconds,
            "skipped_steps": sum(r.get("skipped_steps", 0) for r in records),
            "train_loss": records[-1]["train_loss"] if records else None,
            **({} if status == 0 else {"error": tail(lines)})}


def _records(path: Path) -> list:
    """The epoch records of a --metrics_path file ([] where there is none)."""
    if not path.exists():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if "epoch" in r]


def check_resume(sizes: Sizes, data: Path, work: Path, deterministic: bool, timeout: float) -> dict:
    """Three runs of train.py's GPT recipe (dropout and all) to ``resume_steps``
    steps, crossing an epoch's end: one uninterrupted; one stopped by SIGTERM
    (to torchrun, which passes it on) once step ``stop_at`` is logged, then
    resumed by the same command. Their last snapshots compared: bitwise equal
    tensors (weights, AdamW's moments, schedule, RNG states), or how many
    differ and by how much."""
    name = "deterministic" if deterministic else "default"
    flags = kit_gpt_flags(sizes, data, sizes.resume_steps, *amp_flags(sizes),
                          *(["--deterministic"] if deterministic else []))
    whole, stopped = work / f"{name}-whole", work / f"{name}-stopped"
    whole.mkdir()
    stopped.mkdir()
    status, lines, seconds = run_stamped(kit_command() + flags, whole, timeout)
    if status != 0:
        return {"ok": False, "error": tail(lines), "seconds": seconds}
    log = _signal_at(kit_command() + flags, stopped, f"step {sizes.stop_at} |", signal.SIGTERM, timeout)
    if "stopped by SIGTERM" not in log:
        return {"ok": False, "error": "the run did not stop on SIGTERM: " + log[-400:]}
    status, lines, more = run_stamped(kit_command() + flags, stopped, timeout)
    if status != 0 or "resuming from snapshot" not in text_of(lines):
        return {"ok": False, "error": tail(lines)}
    _, a = snapshot_tensors(whole / "snapshot_train.pt", rng=True)
    _, b = snapshot_tensors(stopped / "snapshot_train.pt", rng=True)
    differ = [key for key in a if not torch.equal(a[key], b[key])]
    largest = max((float((a[k].double() - b[k].double()).abs().max()) for k in differ
                   if a[k].is_floating_point()), default=0.0)
    stop_line = next((line for line in log.splitlines() if "stopped by SIGTERM" in line), "")
    return {"ok": True, "bitwise_equal": not differ, "tensors": len(a), "tensors_differing": len(differ),
            "largest_difference": largest, "differing_examples": differ[:5], "stop_line": stop_line[:200],
            "seconds": seconds + more}


def _signal_at(cmd: list, cwd: Path, wanted: str, signum: int, timeout: float) -> str:
    """Run ``cmd`` in ``cwd``, send it ``signum`` once ``wanted`` is in its output,
    wait for it to end; return its output."""
    log = cwd / "stop-log.txt"
    with open(log, "w") as out:
        process = subprocess.Popen([str(c) for c in cmd], cwd=cwd, env=_env(), stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        try:
            while wanted not in log.read_text() and process.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            process.send_signal(signum)
            process.wait(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    return log.read_text()


def check_tests(corpus: Path, timeout: float) -> dict:
    """tests/test_gpu_speed.py: on CUDA its sync-debug test fails at any host-device
    synchronisation in the steady-state step; the rest are its CPU tests."""
    status, lines, seconds = run_stamped([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                          "tests/test_gpu_speed.py", "-rs"], REPO, timeout,
                                         TINYSHAKESPEARE_FILE=str(corpus))
    summary = next((line for _, line in reversed(lines) if " passed" in line or " failed" in line
                    or " error" in line), tail(lines, 2))
    return {"ok": status == 0, "summary": summary, "seconds": seconds,
            **({} if status == 0 else {"error": tail(lines, 15)})}


# --------------------------------------------------------------------------
# Phase 2: timed, one at a time
# --------------------------------------------------------------------------

def timed_kit_run(flags: list, work: Path, label: str, timeout: float, tokens_per_step: int,
                  warmup: int) -> dict:
    """One run of ``train.py FLAGS`` in a folder of its own under ``work``: ms
    a step (``ms_per_step`` from step ``warmup`` on), tokens/s, and the last
    metrics record's MFU and its precision; or the output's tail as
    ``error``."""
    folder = Path(tempfile.mkdtemp(prefix=label.replace(" ", "_") + "-", dir=work))
    status, lines, seconds = run_stamped(kit_command() + [*flags, "--metrics_path", "m.jsonl"], folder, timeout)
    ms, intervals = ms_per_step(lines, KIT_STEP, warmup)
    if status != 0 or ms is None:
        return {"label": label, "error": tail(lines), "seconds": seconds}
    last = (_records(folder / "m.jsonl") or [{}])[-1]
    return {"label": label, "ms_per_step": ms, "intervals": intervals, "tokens_per_s": tokens_per_step / ms * 1e3,
            "mfu": last.get("mfu"), "mfu_precision": last.get("mfu_precision"),
            "epoch_tokens_per_s": last.get("tokens_per_s"), "seconds": seconds}


def timed_nanogpt_run(args: list, folder: Path, timeout: float, tokens_per_step: int, warmup: int) -> dict:
    """One run of nanoGPT's ``train.py ARGS`` in ``folder`` (its checkout): ms a
    step (``ms_per_step`` from iteration ``warmup`` on) and tokens/s; or the
    output's tail as ``error``."""
    status, lines, seconds = run_stamped([sys.executable, "train.py", *args], folder, timeout)
    ms, intervals = ms_per_step(lines, NANOGPT_ITER, warmup)
    if status != 0 or ms is None:
        return {"error": tail(lines), "seconds": seconds}
    return {"ms_per_step": ms, "intervals": intervals, "tokens_per_s": tokens_per_step / ms * 1e3,
            "seconds": seconds}


def kit_speed(sizes: Sizes, data: Path, work: Path, label: str, extra: list, timeout: float,
              steps: int = None) -> dict:
    """One run of train.py's GPT recipe (``timed_kit_run``), ``steps`` steps
    (default ``sizes.pair_steps``)."""
    return timed_kit_run(kit_gpt_flags(sizes, data, steps or sizes.pair_steps, *extra), work, label, timeout,
                         sizes.tokens_per_step, sizes.warmup)


def nanogpt_speed(sizes: Sizes, folder: Path, compiled: bool, timeout: float) -> dict:
    """One run of nanoGPT's ``train.py config/train_shakespeare_char.py`` (the
    config file as it is; ``--max_iters`` shortens the run, ``--compile``
    chooses; on a CPU the dry run's sizes): ``timed_nanogpt_run``."""
    args = ["config/train_shakespeare_char.py", f"--max_iters={sizes.pair_steps}", f"--compile={compiled}"]
    if sizes.dry_run:  # nanoGPT's own CPU switches, and the dry run's sizes
        args += ["--device=cpu", "--dtype=float32", "--eval_iters=2", "--log_interval=10",
                 *(f"--{key}={value}" for key, value in sizes.gpt.items())]
    shutil.rmtree(folder / "out-shakespeare-char", ignore_errors=True)
    return timed_nanogpt_run(args, folder, timeout, sizes.tokens_per_step, sizes.warmup)


def alternating_pairs(sizes: Sizes, kit_run, nanogpt_run, compiled: bool, deadline: float) -> list:
    """``sizes.pairs`` alternating pairs (the kit first, then nanoGPT, then
    nanoGPT first...): ``kit_run(timeout)`` and ``nanogpt_run(timeout)``, each
    a dict with ``ms_per_step`` or ``error``. A pair starts only where the last
    one's time still fits before ``deadline`` (the first always runs)."""
    pairs, last_s = [], 0.0
    for index in range(sizes.pairs):
        # The next pair's time, guessed from the last one's; compiled, the first pair compiles,
        # and later ones find its kernels in inductor's cache: about half of it.
        if pairs and time.monotonic() + last_s * (0.5 if compiled and index == 1 else 1.0) > deadline:
            break
        started = time.monotonic()
        order = ("kit", "nanoGPT") if index % 2 == 0 else ("nanoGPT", "kit")
        pair = {}
        for side in order:
            left = max(30, deadline - time.monotonic() + 60)
            pair[side] = kit_run(left) if side == "kit" else nanogpt_run(left)
        pairs.append(pair)
        last_s = time.monotonic() - started
    return pairs


def pair_summary(pairs: list) -> dict:
    """nanoGPT's ms a step over the kit's, for each pair where both ran, and their median."""
    ratios = [p["nanoGPT"]["ms_per_step"] / p["kit"]["ms_per_step"] for p in pairs
              if p["kit"].get("ms_per_step") and p["nanoGPT"].get("ms_per_step")]
    return {"pairs": pairs, "kit_speed_over_nanogpt": ratios, "median": statistics.median(ratios) if ratios else None}


def versus_nanogpt(sizes: Sizes, data: Path, nanogpt: Path, corpus: Path, work: Path, compiled: bool,
                   deadline: float) -> dict:
    """The GPU recipe, eager or compiled: train.py against nanoGPT's
    ``config/train_shakespeare_char.py`` in ``alternating_pairs``."""
    from benchmarks.language_model import _nanogpt_folder

    folder = _nanogpt_folder(nanogpt, corpus)
    extra = [*amp_flags(sizes), *(["--compile"] if compiled else [])]
    pairs = alternating_pairs(
        sizes, lambda left: kit_speed(sizes, data, work, f"kit {'compiled' if compiled else 'eager'}", extra, left),
        lambda left: nanogpt_speed(sizes, folder, compiled, left), compiled, deadline)
    shutil.rmtree(folder, ignore_errors=True)
    return {"compiled": compiled, **pair_summary(pairs)}


def write_random_tokens(folder: Path, tokens: int, seed: int = 0) -> None:
    """``folder``/train.bin (``tokens`` ids) and val.bin (a tenth of it):
    uint16 ids drawn uniformly below GPT-2's vocabulary, nanoGPT's format
    (``data/openwebtext/prepare.py`` writes such files; no meta.pkl: GPT-2's
    vocabulary, padded to 50,304)."""
    import numpy as np

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for name, count in (("train.bin", tokens), ("val.bin", max(tokens // 10, 50_000))):
        rng.integers(0, GPT2_VOCAB, size=count, dtype=np.uint16).tofile(folder / name)


def gpt2_on_token_files(sizes: Sizes, nanogpt: Path, work: Path, deadline: float) -> dict:
    """GPT-2 small (``sizes.gpt2``) on a token file of random ids, bf16 and
    compiled on a GPU (fp32, eager in the dry run): train.py's ``--dataset
    tokens`` against nanoGPT's own train.py (its defaults, which are this
    model and batch, on ``data/gpt2rand/``; one micro-batch a step,
    ``--gradient_accumulation_steps=1``), in ``alternating_pairs``. The
    kit's MFU is its epoch record's (the GPU's bf16 peak); nanoGPT's is its
    ``estimate_mfu`` (an A100's bf16 peak, 312 TFLOP/s), so the table gives
    both the kit's and nanoGPT's tokens/s and the kit's MFU only."""
    folder = Path(tempfile.mkdtemp(prefix="nanogpt-gpt2-", dir=work))
    for name in ("train.py", "model.py", "configurator.py"):
        shutil.copyfile(nanogpt / name, folder / name)
    data = folder / "data" / "gpt2rand"
    write_random_tokens(data, sizes.gpt2_tokens)
    compiled = not sizes.dry_run
    steps, tokens_per_step = sizes.gpt2_steps, sizes.gpt2["batch_size"] * sizes.gpt2["block_size"]
    warmup = sizes.warmup if not sizes.dry_run else steps // 3
    kit_flags = ["--dataset", "tokens", "--data_dir", data, "--max_steps", steps, "--log_every_steps", 10,
                 "--eval_windows", 24, "--dropout", 0, *amp_flags(sizes), *(["--compile"] if compiled else [])]
    for name, value in sizes.gpt2.items():
        kit_flags += [f"--{name}", value]
    nano_flags = ["--dataset=gpt2rand", "--gradient_accumulation_steps=1", f"--max_iters={steps}",
                  "--eval_iters=2", "--log_interval=10", f"--compile={compiled}", "--dropout=0.0",
                  *(f"--{key}={value}" for key, value in sizes.gpt2.items())]
    if sizes.dry_run:
        nano_flags += ["--device=cpu", "--dtype=float32"]

    def nanogpt_run(timeout: float) -> dict:
        shutil.rmtree(folder / "out", ignore_errors=True)
        return timed_nanogpt_run(nano_flags, folder, timeout, tokens_per_step, warmup)

    pairs = alternating_pairs(sizes, lambda timeout: timed_kit_run(kit_flags, work, "kit gpt2", timeout,
                                                                   tokens_per_step, warmup),
                              nanogpt_run, compiled, deadline)
    shutil.rmtree(folder, ignore_errors=True)
    return {"compiled": compiled, "sizes": sizes.gpt2, "train_tokens": sizes.gpt2_tokens, **pair_summary(pairs)}


def snapshot_cost(sizes: Sizes, work: Path, device: torch.device, reps: int = 2) -> dict:
    """What a snapshot of an 85M-parameter GPT (GPT-2 small: 124M with its
    embeddings; AdamW's moments after one step: 1.5 GB of state) costs the
    training loop: the seconds ``Checkpointer.save`` holds it (the kit's
    staging: on CUDA pinned buffers made at the first snapshot and reused,
    the copies queued behind the step), until the copy is in CPU memory, and
    the write; against a copy of each tensor (the staging before: ``.to("cpu")``
    per tensor, blocking, the tied weight twice). Bytes of the file."""
    import torch.distributed as dist

    import train_utils
    from gpt import GPT, GPTConfig
    from train_utils.snapshot_writer import CpuStaging

    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = GPT(GPTConfig(**sizes.snapshot_gpt)).to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
        model(torch.randint(0, 100, (1, 8), device=device)).float().mean().backward()
        optimizer.step()
        parameters = model.num_parameters(embeddings=False)
        path = work / "snapshot_cost" / "snapshot.pt"
        path.parent.mkdir()
        checkpointer = train_utils.Checkpointer(str(path), False, asynchronous=True)
        staging = checkpointer.store.staging
        rows = []
        for rep in range(reps):
            _sync(device)
            start = time.perf_counter()
            checkpointer.save(model, optimizer, {"epochs_run": rep, "steps_run": 0})
            blocking = time.perf_counter() - start
            copied_at = _wait_copied(staging, start)
            checkpointer.wait()
            rows.append({"snapshot": rep + 1, "blocking_s": blocking, "copied_s": copied_at,
                         "written_s": time.perf_counter() - start})
        file_bytes = path.stat().st_size
        old = []
        for _ in range(reps):  # the copy before: each tensor on its own, blocking
            _sync(device)
            start = time.perf_counter()
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
            copied = _per_tensor_copy(state)
            old.append(time.perf_counter() - start)
            del copied
        unique = sum(p.numel() * p.element_size() for p in model.parameters()) * 3
        return {"parameters_without_embeddings": parameters, "parameters": model.num_parameters(),
                "state_bytes_unique": unique, "file_bytes": file_bytes, "snapshots": rows,
                "per_tensor_copy_s": old, "device": str(device), "staging": type(staging).__name__,
                "pinned": bool(staging._buffers) and all(b.is_pinned() for b in staging._buffers.values())
                if device.type == "cuda" else False, "buffers": len(staging._buffers),
                "cpu_staging": CpuStaging.__name__}
    finally:
        if own_group:
            dist.destroy_process_group()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _wait_copied(staging, start: float) -> float:
    """Seconds from ``start`` until the staging's copies are in CPU memory
    (the background writer waits for the same; on a CPU they already are)."""
    for event in list(staging._copied):
        event.synchronize()
    return time.perf_counter() - start


def _per_tensor_copy(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {key: _per_tensor_copy(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_per_tensor_copy(value) for value in obj)
    return obj


def resnet_versus_bare(sizes: Sizes, work: Path, device: torch.device) -> dict:
    """ResNet-18 (CIFAR stem), CIFAR-10-shaped batches of ``sizes.resnet_batch``
    on the device: train.py's ``Trainer._run_batch`` (built by
    tests/helpers.py's ``kit_trainer``; bf16 autocast and channels-last on
    CUDA, as train.py runs it there) against a bare zero_grad / forward /
    backward / step loop on a copy of the same model and batch, in
    alternating blocks of ``resnet_steps`` steps, wall time with the GPU's
    queue finished around each block. Also the model FLOPs per image counted
    as train.py counts them, and what they make per second."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from benchmarks.harness import interleaved, timed, train_step
    from helpers import kit_trainer
    from train_utils import autocast
    from train_utils.throughput import counted_flops_per_sample, gpu_peak
    import common
    import vision_tasks

    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        base = vision_tasks.build_model("cifar10", "resnet18").to(device)
        cuda = device.type == "cuda"
        if cuda:
            base = base.to(memory_format=torch.channels_last)
        x = torch.randn(sizes.resnet_batch, 3, 32, 32, device=device)
        x = x.to(memory_format=torch.channels_last) if cuda else x
        y = torch.randint(0, 10, (sizes.resnet_batch,), device=device)
        amp = "bf16" if cuda else None
        task = common.Task(torch.utils.data.TensorDataset(x.cpu(), y.cpu()), None, None, base, F.cross_entropy, True)
        flops = counted_flops_per_sample(task, device)
        steps = {}
        for side in ("bare", "train.py"):
            model = copy.deepcopy(base)
            opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
            if side == "bare":
                steps[side] = train_step(model, opt, F.cross_entropy, x, y, autocast(device, amp))
            else:
                trainer = kit_trainer(model, opt, F.cross_entropy, str(work), device=device, amp=amp)
                steps[side] = lambda trainer=trainer: trainer._run_batch(x, y, 0)
        for step in steps.values():
            for _ in range(3):
                step()
        times = interleaved({side: (lambda fn=fn: timed(fn, sizes.resnet_steps, device)) for side, fn in steps.items()},
                            sizes.resnet_reps)
        best = {side: min(values) for side, values in times.items()}
        ratios = [b / k for b, k in zip(times["bare"], times["train.py"])]
        peaks = gpu_peak(torch.cuda.get_device_name(device)) if cuda else None
        images = {side: sizes.resnet_batch / seconds for side, seconds in best.items()}
        return {"batch": sizes.resnet_batch, "amp": amp, "images_per_s": images,
                "bare_over_kit_median": statistics.median(ratios), "pair_ratios": ratios,
                "flops_per_image": flops, "kit_flops_per_s": images["train.py"] * flops,
                "kit_mfu": images["train.py"] * flops / peaks["bf16"] if peaks else None}
    finally:
        if own_group:
            dist.destroy_process_group()


# --------------------------------------------------------------------------
# The whole check
# --------------------------------------------------------------------------

def _outcome(future) -> dict:
    """A part's result, or {"ok": False, "error": ...} where it raised."""
    try:
        return future.result()
    except Exception as exc:  # recorded: the other parts still run
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:500]}


def _part(fn, *args) -> dict:
    """``fn(*args)``, or {"error": ...} where it raised."""
    try:
        return fn(*args)
    except Exception as exc:  # recorded: the other parts still run
        return {"error": f"{type(exc).__name__}: {exc}"[:500]}


def gpu_facts() -> dict:
    """The GPU, its driver and CUDA as nvidia-smi and torch give them (CPU: none)."""
    facts = {"cuda": torch.version.cuda, "gpu": None, "driver": None}
    if torch.cuda.is_available():
        facts["gpu"] = torch.cuda.get_device_name(0)
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            facts["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                             capture_output=True, text=True, timeout=30).stdout.strip() or None
    return facts


def find_corpus(given) -> Path:
    for candidate in (given, os.environ.get("TINYSHAKESPEARE_FILE"),
                      REPO.parent / "shared" / "data" / "tinyshakespeare" / "input.txt",
                      CHECK_FOLDER / "tinyshakespeare" / "input.txt"):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


def find_nanogpt(given) -> tuple:
    """(nanoGPT's folder, '') or (None, why not)."""
    candidate = given or os.environ.get("NANOGPT_DIR") or CHECK_FOLDER / "nanoGPT"
    missing = [name for name in NANOGPT_FILES if not (Path(candidate) / name).is_file()]
    if missing:
        return None, (f"no nanoGPT at {candidate} (missing {', '.join(missing)}): pass --nanogpt, set NANOGPT_DIR, "
                      f"or run benchmarks/gpu_check.sh --prepare PATH")
    try:
        import numpy  # noqa: F401
    except ImportError:
        return None, "nanoGPT needs numpy, which this Python lacks"
    return Path(candidate), ""


class Report:
    """The JSON file and the tables, rewritten after each part."""

    def __init__(self, out: Path, sizes: Sizes) -> None:
        self.out, self.started = out, time.monotonic()
        self.data = {"machine": machine(), **gpu_facts(), "dry_run": sizes.dry_run, "parts": {}}

    def add(self, name: str, result: dict) -> None:
        self.data["parts"][name] = result
        self.data["elapsed_s"] = time.monotonic() - self.started
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(self.data, indent=1, default=str))


def _fmt(value, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def _pair_table(title: str, part: dict) -> str:
    """The table of ``alternating_pairs``' results (``pair_summary``): each
    pair's ms a step and tokens/s, the kit's speed over nanoGPT's, its MFU."""
    rows = []
    for index, pair in enumerate(part["pairs"]):
        kit, nano = pair["kit"], pair["nanoGPT"]
        rows.append([index + 1, _fmt(kit.get("ms_per_step"), 2), _fmt(nano.get("ms_per_step"), 2),
                     _fmt(kit.get("tokens_per_s"), 0), _fmt(nano.get("tokens_per_s"), 0),
                     _fmt(nano["ms_per_step"] / kit["ms_per_step"], 3)
                     if kit.get("ms_per_step") and nano.get("ms_per_step") else
                     (kit.get("error") or nano.get("error") or "")[:200],
                     _fmt(kit.get("mfu"), 3)])
    rows.append(["median", "", "", "", "", _fmt(part["median"], 3), ""])
    return table(title, ["pair", "kit ms a step", "nanoGPT ms a step", "kit tokens/s", "nanoGPT tokens/s",
                         "kit speed / nanoGPT's", "kit MFU"], rows)


def tables(data: dict) -> str:
    """Every part's table, from the report's data."""
    parts, out = data["parts"], []
    gpu = data.get("gpu") or "no CUDA device (dry run)" if data.get("dry_run") else data.get("gpu")
    out.append(f"**GPU check: {gpu}, driver {data.get('driver')}, torch {data['machine']['torch']}, "
               f"{data['machine']['date_utc']} UTC{' (dry run: every part shrunk)' if data.get('dry_run') else ''}**")
    for name, part in parts.items():
        if "skipped" in part:
            out.append(f"\n**{name}**: skipped: {part['skipped']}")
            continue
        if set(part) == {"error"}:  # the part raised (``_part``)
            out.append(f"\n**{name}**: failed: {part['error']}")
            continue
        if name == "rungs":
            out.append(table("rungs 1-5 at one GPU, synthetic task (rungs 3-5 resumed once)",
                             ["rung", "ok", "resumed", "seconds", "error"],
                             [[r["rung"], r["ok"], r.get("resumed", "-"), r["seconds"], r.get("error", "")]
                              for r in part["results"]]))
        elif name in ("eager", "compiled"):
            out.append(_pair_table(f"GPU recipe, {name}: train.py vs nanoGPT's train.py, alternating pairs", part))
        elif name == "gpt2_tokens":
            sizes = part["sizes"]
            out.append(_pair_table(f"GPT-2 sizes ({sizes['n_layer']} layers, n_embd {sizes['n_embd']}, block "
                                   f"{sizes['block_size']}, batch {sizes['batch_size']}) on a token file of random "
                                   f"ids, {'compiled' if part['compiled'] else 'eager'}: train.py --dataset tokens "
                                   f"vs nanoGPT's train.py, alternating pairs", part))
        elif name == "kit_runs":
            out.append(table("train.py, the GPU recipe: FSDP with --compile; fp32 with and without TF32",
                             ["run", "ms a step", "tokens/s", "MFU", "MFU's precision", "error"],
                             [[r["label"], _fmt(r.get("ms_per_step"), 2), _fmt(r.get("tokens_per_s"), 0),
                               _fmt(r.get("mfu"), 3), r.get("mfu_precision") or "-", r.get("error", "")[:200]]
                              for r in part["results"]]))
        elif name == "fp16":
            out.append(table("--amp fp16 with the loss scaler", ["ok", "skipped steps", "last train_loss", "error"],
                             [[part["ok"], part.get("skipped_steps"), _fmt(part.get("train_loss"), 4),
                               part.get("error", "")[:200]]]))
        elif name == "resume":
            out.append(table("stopped by SIGTERM and resumed, against an uninterrupted run: the last snapshots",
                             ["run", "ok", "bitwise equal", "tensors differing", "largest difference", "error"],
                             [[label, r["ok"], r.get("bitwise_equal", "-"),
                               f"{r.get('tensors_differing', '-')} of {r.get('tensors', '-')}",
                               _fmt(r.get("largest_difference"), 9), r.get("error", "")[:200]]
                              for label, r in part.items() if isinstance(r, dict)]))
        elif name == "tests":
            out.append(table("tests/test_gpu_speed.py (its CUDA test: no host-device sync in the steady-state step)",
                             ["ok", "summary", "error"], [[part["ok"], part["summary"], part.get("error", "")[:300]]]))
        elif name == "snapshot":
            rows = [[r["snapshot"], _fmt(r["blocking_s"], 3), _fmt(r["copied_s"], 3), _fmt(r["written_s"], 2)]
                    for r in part["snapshots"]]
            rows.append(["a copy of each tensor, blocking (before)", _fmt(min(part["per_tensor_copy_s"]), 3), "", ""])
            out.append(table(f"a snapshot of a GPT of {part['parameters_without_embeddings'] / 1e6:.1f}M parameters "
                             f"({part['parameters'] / 1e6:.1f}M with embeddings), AdamW, on {part['device']}: "
                             f"{part['file_bytes'] / 2**20:,.1f} MiB file, {part['state_bytes_unique'] / 2**20:,.1f} "
                             f"MiB of distinct state; pinned buffers: {part['pinned']}",
                             ["snapshot", "training held (s)", "copy in CPU memory (s)", "written (s)"], rows))
        elif name == "resnet":
            out.append(table(f"ResNet-18, CIFAR-10-shaped batches of {part['batch']} ({part['amp'] or 'fp32'}): "
                             f"train.py's step vs a bare loop",
                             ["bare images/s", "train.py images/s", "bare / train.py time (median)",
                              "GFLOPs per image", "train.py TFLOP/s", "MFU"],
                             [[_fmt(part["images_per_s"]["bare"], 0), _fmt(part["images_per_s"]["train.py"], 0),
                               _fmt(part["bare_over_kit_median"], 3), _fmt(part["flops_per_image"] / 1e9, 3),
                               _fmt(part["kit_flops_per_s"] / 1e12, 2), _fmt(part.get("kit_mfu"), 3)]]))
        else:
            out.append(f"\n**{name}**: {json.dumps(part, default=str)[:500]}")
    return "\n\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry_run", action="store_true", help="every part shrunk to seconds, GPU-only parts skipped")
    parser.add_argument("--nanogpt", default=None, help="nanoGPT's folder (default: $NANOGPT_DIR, .gpu_check/nanoGPT)")
    parser.add_argument("--corpus", default=None, help="Tiny Shakespeare's input.txt")
    parser.add_argument("--budget_s", type=float, default=None,
                        help="seconds for the whole check; a part that would end past it is skipped (default: 450; "
                             "with --dry_run none: every part runs)")
    parser.add_argument("--only", nargs="*", default=None,
                        help="parts to run: rungs fp16 resume tests eager compiled kit_runs snapshot resnet "
                             "(the default), gpt2_tokens (GPT-2 small on a token file against nanoGPT: its own "
                             "command, --only gpt2_tokens, minutes of compilation)")
    parser.add_argument("--out", default=None, help="the JSON (default: benchmarks/results/gpu_check.json, "
                                                    "gpu_check_dry_run.json with --dry_run)")
    args = parser.parse_args()
    sizes = Sizes(args.dry_run)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    out = Path(args.out or REPO / "benchmarks" / "results" / ("gpu_check_dry_run.json" if args.dry_run
                                                               else "gpu_check.json"))
    if not cuda and not args.dry_run:
        sys.exit("error: no CUDA device: the GPU check runs on a GPU; --dry_run runs it shrunk on a CPU")
    start = time.monotonic()
    budget = args.budget_s or (1e6 if args.dry_run else 450)
    deadline = start + budget
    wanted = set(args.only or ["rungs", "fp16", "resume", "tests", "eager", "compiled", "kit_runs", "snapshot",
                               "resnet"])
    report = Report(out, sizes)
    corpus = find_corpus(args.corpus)
    nanogpt, nanogpt_missing = find_nanogpt(args.nanogpt)
    work = Path(tempfile.mkdtemp(prefix="gpu_check-"))
    data = None
    if corpus:
        data = work / "data"
        (data / "shakespeare_char").mkdir(parents=True)
        shutil.copyfile(corpus, data / "shakespeare_char" / "input.txt")
    no_corpus = "no Tiny Shakespeare corpus: pass --corpus, set TINYSHAKESPEARE_FILE, or --prepare"
    print(f"GPU check{' (dry run)' if args.dry_run else ''}: {report.data['gpu'] or 'no CUDA device'}, torch "
          f"{torch.__version__}; budget {budget:.0f} s; nanoGPT: {nanogpt or nanogpt_missing}", flush=True)

    # Phase 1: side by side.
    phase1 = {}
    timeout = 150 if not args.dry_run else 400  # a run's limit: one that hangs is recorded, the check goes on
    with concurrent.futures.ThreadPoolExecutor(max_workers=4 if cuda else 2) as pool:
        if "rungs" in wanted:
            phase1["rungs"] = [pool.submit(check_rung, script, work, sizes.rung_epochs, timeout) for script in RUNGS]
        if data is not None:
            if "fp16" in wanted:
                phase1["fp16"] = pool.submit(check_fp16, sizes, data, work, timeout)
            if "resume" in wanted:
                phase1["resume"] = {label: pool.submit(check_resume, sizes, data, work, deterministic, timeout)
                                    for label, deterministic in (("--deterministic", True), ("default", False))}
        if "tests" in wanted and corpus:
            phase1["tests"] = pool.submit(check_tests, corpus, timeout)
        for name, futures in phase1.items():
            if isinstance(futures, list):
                result = {"results": [_outcome(f) for f in futures]}
            elif isinstance(futures, dict):
                result = {label: _outcome(f) for label, f in futures.items()}
            else:
                result = _outcome(futures)
            report.add(name, result)
    for name in ("fp16", "resume"):
        if name in wanted and data is None:
            report.add(name, {"skipped": no_corpus})
    print(f"phase 1 done in {time.monotonic() - start:.0f} s", flush=True)

    # Phase 2: one at a time.
    for compiled in (False, True):
        name = "compiled" if compiled else "eager"
        if name not in wanted:
            continue
        if data is None or nanogpt is None:
            report.add(name, {"skipped": no_corpus if data is None else nanogpt_missing})
        elif time.monotonic() > deadline - 60:
            report.add(name, {"skipped": "the time budget is spent"})
        else:
            # What the parts after these pairs need: the compiled pairs (their compilation), then the rest.
            report.add(name, versus_nanogpt(sizes, data, nanogpt, corpus, work, compiled,
                                            deadline - (240 if not compiled else 90)))
        print(f"{name} pairs done at {time.monotonic() - start:.0f} s", flush=True)
    if "kit_runs" in wanted:
        runs = []
        if data is None:
            report.add("kit_runs", {"skipped": no_corpus})
        else:
            plans = [(f"FSDP, {'bf16' if amp_flags(sizes) else 'fp32'}, --compile",
                      ["--strategy", "fsdp", *amp_flags(sizes), "--compile"])]
            if cuda:
                plans += [("fp32 on TF32 (the default)", []), ("fp32, --no_tf32", ["--no_tf32"])]
            for label, extra in plans:
                if time.monotonic() > deadline - 20:
                    runs.append({"label": label, "error": "skipped: the time budget is spent"})
                    continue
                runs.append(kit_speed(sizes, data, work, label, extra, max(30, deadline - time.monotonic() + 60),
                                      steps=sizes.short_steps))
            if not cuda:
                runs.append({"label": "fp32 with and without TF32", "error": "skipped: TF32 is a CUDA GPU's"})
            report.add("kit_runs", {"results": runs})
    if "gpt2_tokens" in wanted:  # not in the default set: its compilations alone take minutes
        if nanogpt is None:
            report.add("gpt2_tokens", {"skipped": nanogpt_missing})
        else:
            report.add("gpt2_tokens", _part(gpt2_on_token_files, sizes, nanogpt, work, deadline - 30))
    for name, fn, needs_s in (("snapshot", snapshot_cost, 25), ("resnet", resnet_versus_bare, 15)):
        if name in wanted:
            report.add(name, _part(fn, sizes, work, device) if time.monotonic() < deadline - needs_s
                       else {"skipped": "the time budget is spent"})
    report.data["elapsed_s"] = time.monotonic() - start
    report.add("_", {})
    report.data["parts"].pop("_")
    report.out.write_text(json.dumps(report.data, indent=1, default=str))
    print("\n" + tables(report.data), flush=True)
    print(f"\n{time.monotonic() - start:.0f} s in all; wrote {out}", flush=True)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
