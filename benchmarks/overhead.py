"""Section 1, overhead: what train.py's training step costs over a bare loop.

Measures steps/s of train.py's ``Trainer.train_step`` (built by
support/trainer.py's ``kit_trainer``) against a bare zero_grad / forward /
backward / step loop on a copy of the same DDP model, with the same batch and
data, in a 1-process gloo group: only the kit's own code differs. Blocks of
steps (~0.2 s or more each) are timed in CPU seconds of this process, in
adjacent (bare, train.py) pairs, ABBA-interleaved.

Reading the table: "median of pair ratios" is bare-loop time over train.py's
time (1.0: no overhead; the target is >= 0.97); the "band", the spread of the
pair ratios' quartiles, is the noise to read it against: read the ratio only
where the band is well under 3%. The steps/s columns are each side's best
block.

Section 1d, the straggler watch's cost: train.py's loop step (the next
batch, ``train_step``, the stop signal's poll) without and with the phase
timer, the gradient-wait hooks and the ``StragglerWatch``'s windows, timed
the same way (``section_step_phases``); its ratio is the step time without
over the step time with (target >= 0.99, under 1% of a step).
"""

from __future__ import annotations

import copy
import functools
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F

from benchmarks.harness import CPU, build_model, ddp, interleaved, process_group, table, timed, train_step
from support.runs import free_port
from support.trainer import kit_trainer

# Blocks of ~0.2 s or more: much shorter ones measure the clock's and the
# scheduler's noise (3 CNN steps per block gave pair ratios of 0.85-1.05).
OVERHEAD_CASES = [("mnist cnn", "mnist", "cnn", (64, 1, 28, 28), 8),
                  ("synthetic mlp", "synthetic", "mlp", (32, 20), 1500)]
# train.py's Trainer and its bare loop on the same DDP model: only the kit's code differs.
OVERHEAD_SCRIPTS = [("train.py", "bare DDP")]


def _model_and_batch(dataset: str, model_name: str, shape: tuple) -> tuple:
    """(model, x, y, loss_fn): the model seeded 0 and one batch of ``shape``
    (float32) with its targets, regression for the synthetic task, 10
    classes otherwise: what each compared step trains on."""
    torch.manual_seed(0)
    base = build_model(dataset, model_name)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g)
    if dataset == "synthetic":
        y, loss_fn = torch.randn(shape[0], 1, generator=g), F.mse_loss
    else:
        y, loss_fn = torch.randint(0, 10, (shape[0],), generator=g), F.cross_entropy
    return base, x, y, loss_fn


def _overhead_steps(dataset: str, model_name: str, shape: tuple, out_dir: str) -> dict:
    """{name: step()} of the bare DDP loop and train.py's Trainer.train_step,
    each on its own copy of one model, on the same batch."""
    base, x, y, loss_fn = _model_and_batch(dataset, model_name, shape)
    steps = {}
    for name in ("bare DDP", "train.py"):
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        if name == "bare DDP":
            steps[name] = train_step(ddp(model, CPU), opt, loss_fn, x, y)
        else:  # with --grad_accum_steps 1, every micro-batch a whole step
            steps[name] = functools.partial(kit_trainer(model, opt, loss_fn, out_dir).train_step, x, y)
    return steps


def _overhead_pairs(bare, script, steps: int, reps: int) -> dict:
    """``reps`` adjacent pairs of blocks of ``steps`` steps, ABBA, timed in CPU
    seconds of this process, not wall time: time the scheduler gives other
    processes on a busy machine is not counted against either side."""
    times = interleaved({side: functools.partial(timed, fn, steps, clock=time.process_time)
                         for side, fn in (("bare", bare), ("script", script))}, reps)
    ratios = [t_ref / t_script for t_ref, t_script in zip(times["bare"], times["script"])]
    # Headline: best block of each, as timeit does (the least disturbed by other
    # processes); the pairs' median ratio and quartiles show the spread.
    return {"script_steps_per_s": 1 / min(times["script"]), "bare_steps_per_s": 1 / min(times["bare"]),
            "ratio": min(times["bare"]) / min(times["script"]),
            "ratio_median_of_pairs": statistics.median(ratios),
            "ratio_quartiles": statistics.quantiles(ratios, n=4)[::2]}


def section_overhead(reps: int = 30) -> dict:
    """Section 1: for each of ``OVERHEAD_CASES``, ``reps`` interleaved pairs of
    blocks of the bare DDP loop and train.py's ``train_step`` (``_overhead_pairs``),
    in a 1-process gloo group. Returns {"results", "pairs", "table", "note"}."""
    results = []
    with process_group(0, 1, free_port(), CPU):  # train.py's Trainer (DDP) needs one
        for label, dataset, model_name, shape, steps in OVERHEAD_CASES:
            runners = _overhead_steps(dataset, model_name, shape, tempfile.mkdtemp())
            for step in runners.values():  # warm-up
                for _ in range(3):
                    step()
            for name, reference in OVERHEAD_SCRIPTS:
                results.append({"case": label, "batch": shape[0], "script": name, "reference": reference,
                                **_overhead_pairs(runners[reference], runners[name], steps, reps)})
    rows = [[r["case"], r["batch"], r["script"], r["reference"], r["bare_steps_per_s"],
             r["script_steps_per_s"], r["ratio_median_of_pairs"],
             "{:.3f}-{:.3f}".format(*r["ratio_quartiles"]),
             f"{r['ratio_quartiles'][1] - r['ratio_quartiles'][0]:.1%}"] for r in results]
    text = table(f"1. Overhead: train.py's train_step vs a bare loop, CPU time, {reps} interleaved "
                 f"pairs of blocks (target ratio >= 0.97; read it only where the band is well "
                 f"under 3%)",
                 ["model", "batch", "script", "bare loop on", "bare steps/s (best)",
                  "script steps/s (best)", "median of pair ratios", "pair ratio quartiles",
                  "band (quartile spread)"], rows)
    return {"results": results, "pairs": reps, "table": text,
            "note": "median over adjacent (bare, train.py) pairs of blocks; in a "
                    "1-process gloo group"}


def _phase_steps(dataset: str, model_name: str, shape: tuple, out_dir: str, world_size: int = 8) -> dict:
    """{"without": step(), "with": step()}: train.py's loop step (the next
    batch, ``Trainer.train_step``, the stop signal's poll) on two copies of
    one DDP model, the second with what the straggler watch adds: the phase
    timer (``StepPhases``: the data, compute and collective phases timed,
    ``end_step``), the gradient all-reduce's timing hook
    (``time_gradient_wait``'s gradient hooks, registered by the Trainer; the
    first copy's Trainer is built with them left out) and the ``StragglerWatch``'s
    window figures and verdict as at ``world_size`` ranks (its payload,
    compared at once, every rank's figures made equal: no line is printed;
    its loader sampler thread runs)."""
    import itertools

    import train_utils
    from train_utils.loop.stragglers import StragglerWatch

    base, x, y, loss_fn = _model_and_batch(dataset, model_name, shape)
    steps = {}
    for name in ("without", "with"):
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        hook = train_utils.time_gradient_wait
        if name == "without":
            train_utils.time_gradient_wait = lambda model, phases: []  # this Trainer without the hooks
        try:
            trainer = kit_trainer(model, opt, loss_fn, out_dir)
        finally:
            train_utils.time_gradient_wait = hook
        batches = itertools.repeat((x, y))
        if name == "without":
            def step(trainer=trainer, batches=batches) -> None:
                source, targets = next(batches)
                trainer.train_step(source, targets)
                trainer.stop.poll()
        else:
            phases = trainer.phases
            watch = StragglerWatch(phases, 0, world_size, lambda: phases.steps, num_workers=0)
            timed_batches = phases.data(batches)

            def step(trainer=trainer, phases=phases, watch=watch, timed_batches=timed_batches) -> None:
                source, targets = next(timed_batches)
                with phases.phase("compute"):
                    trainer.train_step(source, targets)
                with phases.phase("collective"):
                    trainer.stop.poll()
                    figures = watch.payload()
                    if figures is not None:  # every rank's figures alike: compared, nobody named
                        rows = figures.view(world_size, -1)
                        rows[:] = rows[0]
                        watch.compare(figures)
                phases.end_step()
        steps[name] = step
    return steps


def section_step_phases(reps: int = 30) -> dict:
    """Section 1d: for each of ``OVERHEAD_CASES``, ``reps`` interleaved pairs
    of blocks of train.py's loop step without and with the phase timer and
    the straggler watch (``_phase_steps``), CPU time, in a 1-process gloo
    group. Returns {"results", "pairs", "table", "note"}; the ratio is the
    step time without over the step time with (target >= 0.99: under 1% of
    a step)."""
    results = []
    with process_group(0, 1, free_port(), CPU):
        for label, dataset, model_name, shape, steps in OVERHEAD_CASES:
            runners = _phase_steps(dataset, model_name, shape, tempfile.mkdtemp())
            for step in runners.values():  # warm-up
                for _ in range(3):
                    step()
            pairs = _overhead_pairs(runners["without"], runners["with"], steps, reps)
            results.append({"case": label, "batch": shape[0], **pairs,
                            "step_ms_without": 1000 / pairs["bare_steps_per_s"],
                            "step_ms_with": 1000 / pairs["script_steps_per_s"]})
    rows = [[r["case"], r["batch"], f"{r['step_ms_without']:.3f}", f"{r['step_ms_with']:.3f}",
             r["ratio_median_of_pairs"], "{:.3f}-{:.3f}".format(*r["ratio_quartiles"])] for r in results]
    text = table(f"1d. The phase timer and straggler watch: train.py's loop step without / with, CPU time, "
                 f"{reps} interleaved pairs of blocks (target ratio >= 0.99)",
                 ["model", "batch", "ms/step without (best)", "ms/step with (best)", "median of pair ratios",
                  "pair ratio quartiles"], rows)
    return {"results": results, "pairs": reps, "table": text,
            "note": "median over adjacent (without, with) pairs of blocks; in a 1-process gloo group, the "
                    "watch's verdict as at 8 ranks"}
