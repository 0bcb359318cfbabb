"""The GPU check's timed runs of whole programs, in milliseconds a step from
their progress lines: train.py against nanoGPT's own train.py on the GPU
recipe, eager and compiled (``compiled``, ``eager``: compiled, one untimed
run of each side first so that inductor's caches are warm and every timed
pair finds its kernels there); train.py's batches as they were cut before
(strided, ``benchmarks/strided_batches.py``) against today's dense ones
(``ab``); FSDP with --compile and fp32 with and without TF32
(``kit_runs``); and GPT-2 small on a token file against nanoGPT
(``gpt2_tokens``, asked for on its own)."""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.gpu_runs import (REPO, SPENT, Budget, Setting, Sizes, amp_flags, kit_command, kit_gpt_flags,
                                 records, run_stamped)
from benchmarks.harness import KIT_STEP, NANOGPT_ITER, ms_per_step, tail, text_of

GPT2_VOCAB = 50257  # GPT-2's BPE tokens: the random ids of the token-file part are below it
STRIDED = REPO / "benchmarks" / "strided_batches.py"  # train.py with the batches cut as two strided views
BATCH_WARNING = "warning: the training batch's"  # train_utils.HostToDevice's line (CUDA: a batch not dense)


def timed_kit_run(flags: list, work: Path, label: str, budget: Budget, limit: float, tokens_per_step: int,
                  warmup: int, launcher: Path = None) -> dict:
    """One run of ``train.py FLAGS`` (through ``launcher`` where given) in a
    folder of its own under ``work``: ms a step (from step ``warmup`` on),
    tokens/s, and the last metrics record's MFU and its precision; or the
    output's tail as ``error``."""
    folder = Path(tempfile.mkdtemp(prefix=label.replace(" ", "_").replace(",", "") + "-", dir=work))
    status, lines, seconds = run_stamped(kit_command(launcher=launcher) + [*flags, "--metrics_path", "m.jsonl"],
                                         folder, budget, limit)
    ms, intervals = ms_per_step(lines, KIT_STEP, warmup)
    warning = next((line for _, line in lines if BATCH_WARNING in line), None)
    if status != 0 or ms is None:
        return {"label": label, "error": tail(lines), "seconds": seconds}
    last = (records(folder / "m.jsonl") or [{}])[-1]
    return {"label": label, "ms_per_step": ms, "intervals": intervals, "tokens_per_s": tokens_per_step / ms * 1e3,
            "mfu": last.get("mfu"), "mfu_precision": last.get("mfu_precision"),
            "epoch_tokens_per_s": last.get("tokens_per_s"), "seconds": seconds,
            **({"batch_warning": warning} if warning else {}),
            **({"launcher_line": "strided_batches:" in text_of(lines)} if launcher else {})}


def timed_nanogpt_run(args: list, folder: Path, budget: Budget, limit: float, tokens_per_step: int,
                      warmup: int) -> dict:
    """One run of nanoGPT's ``train.py ARGS`` in ``folder`` (its checkout): ms a
    step (from iteration ``warmup`` on) and tokens/s; or the output's tail as ``error``."""
    status, lines, seconds = run_stamped([sys.executable, "train.py", *args], folder, budget, limit)
    ms, intervals = ms_per_step(lines, NANOGPT_ITER, warmup)
    if status != 0 or ms is None:
        return {"error": tail(lines), "seconds": seconds}
    return {"ms_per_step": ms, "intervals": intervals, "tokens_per_s": tokens_per_step / ms * 1e3,
            "seconds": seconds}


def kit_speed(setting: Setting, label: str, extra: list, budget: Budget, steps: int = None,
              launcher: Path = None, warmup: int = None) -> dict:
    """One run of train.py's GPT recipe (``timed_kit_run``), ``steps`` steps
    (default ``sizes.pair_steps``), ms a step from step ``warmup`` (default
    ``sizes.warmup``) on."""
    sizes = setting.sizes
    return timed_kit_run(kit_gpt_flags(sizes, setting.data, steps or sizes.pair_steps, *extra), setting.work,
                         label, budget, sizes.run_limit, sizes.tokens_per_step,
                         sizes.warmup if warmup is None else warmup, launcher)


def nanogpt_speed(sizes: Sizes, folder: Path, compiled: bool, budget: Budget, steps: int = None,
                  warmup: int = None) -> dict:
    """One run of nanoGPT's ``train.py config/train_shakespeare_char.py`` (the
    config file as it is; ``--max_iters`` shortens the run to ``steps``,
    default ``sizes.pair_steps``; ``--compile`` chooses; on a CPU the dry
    run's sizes): ``timed_nanogpt_run``, from iteration ``warmup`` (default
    ``sizes.warmup``) on."""
    args = ["config/train_shakespeare_char.py", f"--max_iters={steps or sizes.pair_steps}", f"--compile={compiled}"]
    if sizes.dry_run:  # nanoGPT's own CPU switches, and the dry run's sizes
        args += ["--device=cpu", "--dtype=float32", "--eval_iters=2", "--log_interval=10",
                 *(f"--{key}={value}" for key, value in sizes.gpt.items())]
    shutil.rmtree(folder / "out-shakespeare-char", ignore_errors=True)
    return timed_nanogpt_run(args, folder, budget, sizes.run_limit, sizes.tokens_per_step,
                             sizes.warmup if warmup is None else warmup)


def alternating_pairs(count: int, sides: dict, budget: Budget) -> list:
    """Up to ``count`` alternating pairs of ``sides`` ({name: run(budget) ->
    dict with ``ms_per_step`` or ``error``}, two of them): the first side
    first, then the second first, and so on. The first pair always starts,
    however little of ``budget`` is left before its soft end (each run is
    still bounded by the check's end, ``Budget.timeout``, and one that cannot
    start says so): a check that comes back without one timed pair has
    measured nothing, and a cold compile before it (the warm runs') says
    little of a pair's time. A later pair starts only where its time,
    guessed as the last one's, fits in ``budget``."""
    pairs, last_s, names = [], 0.0, list(sides)
    for index in range(count):
        if pairs and not budget.fits(last_s):
            break
        started = time.monotonic()
        pairs.append({name: sides[name](budget) for name in (names if index % 2 == 0 else names[::-1])})
        last_s = time.monotonic() - started
    return pairs


def ratios_of(pairs: list, slow: str, fast: str) -> list:
    """``slow``'s ms a step over ``fast``'s (``fast``'s speed over ``slow``'s), each pair where both ran."""
    return [p[slow]["ms_per_step"] / p[fast]["ms_per_step"] for p in pairs
            if p[fast].get("ms_per_step") and p[slow].get("ms_per_step")]


def pair_summary(pairs: list) -> dict:
    """nanoGPT's ms a step over the kit's, for each pair where both ran, and their median."""
    ratios = ratios_of(pairs, "nanoGPT", "kit")
    return {"pairs": pairs, "kit_speed_over_nanogpt": ratios, "median": statistics.median(ratios) if ratios else None}


def warm_compile(sides: dict, budget: Budget) -> dict:
    """One untimed run of each of ``sides`` ({name: run(budget)}, a short run
    timed from its first step), its seconds (or its error): inductor's
    caches warm for the pairs."""
    warm = {}
    for name, run in sides.items():
        result = run(budget)
        warm[name] = {"seconds": result.get("seconds"), **({"error": result["error"]} if "error" in result else {})}
    return warm


def versus_nanogpt(setting: Setting, compiled: bool, budget: Budget) -> dict:
    """The GPU recipe, eager or compiled: train.py against nanoGPT's
    ``config/train_shakespeare_char.py`` in ``alternating_pairs``; compiled,
    after a ``warm_compile`` of ``sizes.warm_steps`` steps each."""
    from benchmarks.language_model import _nanogpt_folder

    sizes = setting.sizes
    folder = _nanogpt_folder(setting.nanogpt, setting.corpus)
    label = f"kit {'compiled' if compiled else 'eager'}"
    extra = [*amp_flags(sizes), *(["--compile"] if compiled else [])]
    try:
        warm = warm_compile({
            "kit": lambda left: kit_speed(setting, label + " warm", extra, left, sizes.warm_steps, warmup=0),
            "nanoGPT": lambda left: nanogpt_speed(sizes, folder, compiled, left, sizes.warm_steps, warmup=0)},
            budget) if compiled else None
        pairs = alternating_pairs(sizes.pairs, {"kit": lambda left: kit_speed(setting, label, extra, left),
                                                "nanoGPT": lambda left: nanogpt_speed(sizes, folder, compiled, left)},
                                  budget)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return {"compiled": compiled, **({"warm_compile": warm} if compiled else {}), "pairs_planned": sizes.pairs,
            **pair_summary(pairs)}


def strided_ab(setting: Setting, budget: Budget) -> dict:
    """train.py on the GPU recipe, compiled (the compiled pairs' flags, so its
    kernels are in inductor's cache): batches cut as two strided views and
    pinned as they are (``benchmarks/strided_batches.py``) against today's
    dense ones, ``sizes.ab_pairs`` alternating pairs; the strided runs' ms a
    step over the dense ones' (the fix's speed-up), and whether train.py
    warned of the strided batch (it looks on CUDA)."""
    sizes = setting.sizes
    extra = [*amp_flags(sizes), "--compile"]
    pairs = alternating_pairs(sizes.ab_pairs, {
        "strided": lambda left: kit_speed(setting, "strided batches", extra, left, launcher=STRIDED),
        "dense": lambda left: kit_speed(setting, "dense batches", extra, left)}, budget)
    ratios = ratios_of(pairs, "strided", "dense")
    return {"compiled": True, "pairs_planned": sizes.ab_pairs, "pairs": pairs, "dense_speed_over_strided": ratios,
            "median": statistics.median(ratios) if ratios else None,
            "strided_warned": any("batch_warning" in p["strided"] for p in pairs),
            "dense_warned": any("batch_warning" in p["dense"] for p in pairs)}


def kit_runs(setting: Setting, budget: Budget) -> dict:
    """train.py's GPT recipe, ``sizes.short_steps`` steps: FSDP with --compile;
    on CUDA fp32 on TF32 and with --no_tf32. A run that no longer fits says so."""
    sizes = setting.sizes
    plans = [(f"FSDP, {'bf16' if amp_flags(sizes) else 'fp32'}, --compile",
              ["--strategy", "fsdp", *amp_flags(sizes), "--compile"])]
    if setting.cuda:
        plans += [("fp32 on TF32 (the default)", []), ("fp32, --no_tf32", ["--no_tf32"])]
    runs = []
    for label, extra in plans:
        if not budget.fits(20):
            runs.append({"label": label, "error": f"skipped: {SPENT}"})
            continue
        runs.append(kit_speed(setting, label, extra, budget, steps=sizes.short_steps))
    if not setting.cuda:
        runs.append({"label": "fp32 with and without TF32", "error": "skipped: TF32 is a CUDA GPU's"})
    return {"results": runs}


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


def gpt2_flags(sizes: Sizes, data: Path, steps: int, compiled: bool) -> tuple[list, list]:
    """(train.py's flags, nanoGPT's) for GPT-2 small (``sizes.gpt2``) on the
    token files in ``data``, ``steps`` steps, one micro-batch a step."""
    kit = ["--dataset", "tokens", "--data_dir", data, "--max_steps", steps, "--log_every_steps", 10,
           "--eval_windows", 24, "--dropout", 0, *amp_flags(sizes), *(["--compile"] if compiled else [])]
    for name, value in sizes.gpt2.items():
        kit += [f"--{name}", value]
    nano = ["--dataset=gpt2rand", "--gradient_accumulation_steps=1", f"--max_iters={steps}", "--eval_iters=2",
            "--log_interval=10", f"--compile={compiled}", "--dropout=0.0",
            *(f"--{key}={value}" for key, value in sizes.gpt2.items())]
    return kit, nano + (["--device=cpu", "--dtype=float32"] if sizes.dry_run else [])


def gpt2_on_token_files(setting: Setting, budget: Budget) -> dict:
    """GPT-2 small (``sizes.gpt2``) on a token file of random ids, bf16 and
    compiled on a GPU (fp32, eager in the dry run): train.py's ``--dataset
    tokens`` against nanoGPT's own train.py (its defaults, which are this
    model and batch, on ``data/gpt2rand/``), compiled after a warm compile of
    each, in ``alternating_pairs``. The kit's MFU is its epoch record's (the
    GPU's bf16 peak); nanoGPT's is its ``estimate_mfu`` (an A100's bf16 peak,
    312 TFLOP/s), so the table gives both tokens/s and the kit's MFU only."""
    sizes, work = setting.sizes, setting.work
    folder = Path(tempfile.mkdtemp(prefix="nanogpt-gpt2-", dir=work))
    for name in ("train.py", "model.py", "configurator.py"):
        shutil.copyfile(setting.nanogpt / name, folder / name)
    data = folder / "data" / "gpt2rand"
    write_random_tokens(data, sizes.gpt2_tokens)
    compiled = not sizes.dry_run
    tokens_per_step = sizes.gpt2["batch_size"] * sizes.gpt2["block_size"]
    warmup = sizes.warmup if not sizes.dry_run else sizes.gpt2_steps // 3

    def sides(steps: int, warmup: int) -> dict:
        kit_flags, nano_flags = gpt2_flags(sizes, data, steps, compiled)

        def nanogpt_run(left: Budget) -> dict:
            shutil.rmtree(folder / "out", ignore_errors=True)
            return timed_nanogpt_run(nano_flags, folder, left, sizes.run_limit * 2, tokens_per_step, warmup)
        return {"kit": lambda left: timed_kit_run(kit_flags, work, "kit gpt2", left, sizes.run_limit * 2,
                                                  tokens_per_step, warmup),
                "nanoGPT": nanogpt_run}

    try:
        warm = warm_compile(sides(sizes.warm_steps, 0), budget) if compiled else None
        pairs = alternating_pairs(sizes.pairs, sides(sizes.gpt2_steps, warmup), budget)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return {"compiled": compiled, "sizes": sizes.gpt2, "train_tokens": sizes.gpt2_tokens,
            **({"warm_compile": warm} if compiled else {}), "pairs_planned": sizes.pairs, **pair_summary(pairs)}
