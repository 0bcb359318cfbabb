"""The GPU check: every figure that needs a GPU, on one H100 or H200, in one
command of at most 8 minutes (``benchmarks/gpu_check.sh``, which runs this).

    benchmarks/gpu_check.sh --prepare PATH    # once: nanoGPT (a checkout, or a git dir) and the corpus into .gpu_check/
    benchmarks/gpu_check.sh --out $OUT/gpu_check.json   # on a lent GPU: the JSON, the trace beside it
    benchmarks/gpu_check.sh --dry_run         # every part shrunk, on a CPU in a few minutes

It diagnoses first, in this order: the host-to-device probe (``probe``,
gpu_probe.py: a strided and a dense pinned batch copied behind a sleep
queued on the GPU: does the strided copy wait?); the GPU recipe of
docs/language-model.md compiled, train.py against nanoGPT's own ``train.py
config/train_shakespeare_char.py`` (its config file as it is, the run
shortened by ``--max_iters``), one untimed run of each first to warm
inductor's caches, then 3 alternating pairs (``compiled``, gpu_pairs.py);
where the probe finds a wait (or could not look: the dry run), train.py
compiled with its batches cut as strided views and pinned as they are
(benchmarks/strided_batches.py) against today's dense ones (``ab``); and
a trace of 5 compiled steps (``trace``, gpu_trace.py: train.py's
``--profile_dir``, the file kept beside the JSON, the GPU's busy time and
idle gaps summarised). Then the rest: side by side, the checks whose
outcome is a yes or a no (gpu_yes_no.py: the ladder's five rungs, ``--amp
fp16``, a run stopped by SIGTERM and resumed, tests/test_gpu_speed.py);
one at a time, the eager pairs (``eager``), FSDP with ``--compile`` and fp32
with and without TF32 (``kit_runs``), what a snapshot of GPT-2 small costs
the loop (``snapshot``, gpu_costs.py) and ResNet-18 eager, train.py's step
against a bare loop (``resnet``).

The time budget (``--budget_s``, 450 s by default on a GPU; none in the
dry run): every run is killed at the earlier of its own limit and the
budget's end, so none ends past it; a part starts only where what it
needs (``Sizes.needs``) fits before the end, less what the diagnosis
parts after it need, and otherwise says "the time budget is spent".

Each program's milliseconds a step are the median, over its steps after the
first ``WARMUP_STEPS`` (compilation, the first evaluation), of the intervals
between the progress lines it prints every 10 steps (train.py's
``--log_every_steps 10``, nanoGPT's ``log_interval``), stamped as they
arrive: the same clock for both, evaluations and snapshots falling in a few
intervals, which the median leaves out.

Writes one JSON (``--out``; the GPU, its driver, torch, the date and every
figure; gpu_report.py) and prints a table per part. A part that cannot run
says why (``skipped``): nanoGPT absent, no CUDA device, the time budget
spent. Needs nanoGPT's ``train.py``, ``model.py``, ``configurator.py`` and
``config/`` (``--nanogpt``, $NANOGPT_DIR, default ``.gpu_check/nanoGPT``:
fetched code is never committed, so it travels as an ignored folder) and
the Tiny Shakespeare corpus (``--corpus``, $TINYSHAKESPEARE_FILE, default
``../shared/data/tinyshakespeare/input.txt``, else
``.gpu_check/tinyshakespeare/input.txt``); numpy for nanoGPT.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:] = [path for path in sys.path if Path(path or ".").resolve() != REPO / "benchmarks"]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from benchmarks import gpu_yes_no  # noqa: E402  (the package puts tests/ on sys.path too)
from benchmarks.gpu_costs import resnet_versus_bare, snapshot_cost  # noqa: E402
from benchmarks.gpu_pairs import gpt2_on_token_files, kit_runs, strided_ab, versus_nanogpt  # noqa: E402
from benchmarks.gpu_probe import probe  # noqa: E402
from benchmarks.gpu_report import Report, tables  # noqa: E402
from benchmarks.gpu_runs import CHECK_FOLDER, SPENT, Budget, Setting, Sizes, error_of  # noqa: E402
from benchmarks.gpu_trace import traced_run  # noqa: E402

NANOGPT_FILES = ("train.py", "model.py", "configurator.py", "config/train_shakespeare_char.py")
# The order the check runs in; "yes_no" stands for gpu_yes_no.PARTS, run side by side.
ORDER = ("probe", "compiled", "ab", "trace", "yes_no", "eager", "kit_runs", "gpt2_tokens", "snapshot", "resnet")
DIAGNOSIS = ("probe", "compiled", "ab", "trace")  # first; each keeps the time of those after it
DEFAULT = ("probe", "compiled", "ab", "trace", *gpu_yes_no.PARTS, "eager", "kit_runs", "snapshot", "resnet")
PARTS = {  # name: (function(setting, budget) -> its JSON, what it needs: "corpus", "nanogpt")
    "probe": (probe, ()),
    "compiled": (lambda setting, budget: versus_nanogpt(setting, True, budget), ("corpus", "nanogpt")),
    "ab": (strided_ab, ("corpus",)),
    "trace": (traced_run, ("corpus",)),
    "eager": (lambda setting, budget: versus_nanogpt(setting, False, budget), ("corpus", "nanogpt")),
    "kit_runs": (kit_runs, ("corpus",)),
    "gpt2_tokens": (gpt2_on_token_files, ("nanogpt",)),
    "snapshot": (snapshot_cost, ()),
    "resnet": (resnet_versus_bare, ()),
}


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


def make_setting(args: argparse.Namespace, sizes: Sizes, device: torch.device, out: Path) -> Setting:
    """The parts' setting: a scratch folder, the corpus copied where train.py
    reads it (``data``/shakespeare_char/input.txt), nanoGPT found."""
    corpus = find_corpus(args.corpus)
    nanogpt, nanogpt_missing = find_nanogpt(args.nanogpt)
    work = Path(tempfile.mkdtemp(prefix="gpu_check-"))
    data = None
    if corpus:
        data = work / "data"
        (data / "shakespeare_char").mkdir(parents=True)
        shutil.copyfile(corpus, data / "shakespeare_char" / "input.txt")
    return Setting(sizes, device, work, out, corpus, data, nanogpt, nanogpt_missing)


def run_part(name: str, setting: Setting, budget: Budget) -> dict:
    """Part ``name``'s JSON: skipped where its input is missing or its need
    does not fit ``budget``; {"error": ...} where it raised."""
    fn, inputs = PARTS[name]
    why = setting.missing(inputs)
    if why:
        return {"skipped": why}
    if not budget.fits(setting.sizes.needs[name]):
        return {"skipped": SPENT}
    try:
        return fn(setting, budget)
    except Exception as exc:  # recorded: the other parts still run
        return {"error": error_of(exc)}


def kept_for_later(name: str, planned: list, sizes: Sizes) -> float:
    """Seconds a diagnosis part leaves for the planned diagnosis parts after it."""
    if name not in DIAGNOSIS:
        return 0.0
    return sum(sizes.needs[later] for later in DIAGNOSIS[DIAGNOSIS.index(name) + 1:] if later in planned)


def no_ab(probe_result: dict) -> str:
    """Why the A/B is not run ('' where it is): the probe looked and found no wait."""
    if probe_result.get("strided_copy_waits") is False:
        return "the probe finds no wait: a strided pinned batch copies to this GPU without waiting for it"
    return ""


def run_check(setting: Setting, report: Report, wanted: set, budget: Budget) -> None:
    """The ``wanted`` parts in ``ORDER``, each added to ``report`` as it ends."""
    planned = [name for name in ORDER if name in wanted or (name == "yes_no" and wanted & set(gpu_yes_no.PARTS))]
    skipped = {}
    for name in ORDER:
        if name in skipped:
            report.add(name, {"skipped": skipped[name]})
        if name not in planned:
            continue
        part_budget = budget.keeping(kept_for_later(name, planned, setting.sizes))
        if name == "yes_no":
            names = [part for part in gpu_yes_no.PARTS if part in wanted]
            results = (gpu_yes_no.yes_no_checks(setting, part_budget, names)
                       if part_budget.fits(setting.sizes.needs["yes_no"]) else {part: {"skipped": SPENT}
                                                                                for part in names})
            for part, result in results.items():
                report.add(part, result)
        else:
            report.add(name, run_part(name, setting, part_budget))
        if name == "probe" and "ab" in planned and no_ab(report.data["parts"]["probe"]):
            skipped["ab"] = no_ab(report.data["parts"]["probe"])
            planned.remove("ab")
        print(f"{name} done at {report.data['elapsed_s']:.0f} s", flush=True)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry_run", action="store_true", help="every part shrunk to seconds, GPU-only parts skipped")
    parser.add_argument("--nanogpt", default=None, help="nanoGPT's folder (default: $NANOGPT_DIR, .gpu_check/nanoGPT)")
    parser.add_argument("--corpus", default=None, help="Tiny Shakespeare's input.txt")
    parser.add_argument("--budget_s", type=float, default=None,
                        help="seconds for the whole check: no run ends past them, a part that would not fit is "
                             "skipped (default: 450; with --dry_run none: every part runs)")
    parser.add_argument("--only", nargs="*", default=None, choices=[*DEFAULT, "gpt2_tokens"], metavar="PART",
                        help=f"parts to run, in the check's order: {' '.join(DEFAULT)} (the default), gpt2_tokens "
                             "(GPT-2 small on a token file against nanoGPT: its own command, --only gpt2_tokens, "
                             "minutes of compilation)")
    parser.add_argument("--out", default=None,
                        help="the JSON, the trace in gpu_check_trace/ beside it (default: "
                             "benchmarks/results/gpu_check.json, gpu_check_dry_run.json with --dry_run; on a lent "
                             "device $OUT/gpu_check.json, so that both come back)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    sizes = Sizes(args.dry_run)
    cuda = torch.cuda.is_available()
    if not cuda and not args.dry_run:
        sys.exit("error: no CUDA device: the GPU check runs on a GPU; --dry_run runs it shrunk on a CPU")
    budget_s = args.budget_s or (None if args.dry_run else 450)
    budget = Budget(time.monotonic() + (budget_s or 1e6))
    out = Path(args.out or REPO / "benchmarks" / "results" / ("gpu_check_dry_run.json" if args.dry_run
                                                               else "gpu_check.json")).resolve()
    setting = make_setting(args, sizes, torch.device("cuda", 0) if cuda else torch.device("cpu"), out)
    report = Report(out, args.dry_run, budget_s)
    print(f"GPU check{' (dry run)' if args.dry_run else ''}: {report.data['gpu'] or 'no CUDA device'}, torch "
          f"{torch.__version__}; budget {f'{budget_s:.0f} s' if budget_s else 'none'}; nanoGPT: "
          f"{setting.nanogpt or setting.nanogpt_missing}", flush=True)
    try:
        run_check(setting, report, set(args.only or DEFAULT), budget)
    finally:
        shutil.rmtree(setting.work, ignore_errors=True)
    report.write()
    print("\n" + tables(report.data), flush=True)
    print(f"\n{report.data['elapsed_s']:.0f} s in all; wrote {out}", flush=True)


if __name__ == "__main__":
    main()
