"""The kit's benchmark: ``python benchmarks/run.py [--only N ...]`` (run.py).

One module per section (the section's key in ``--only``, and its name in
results/latest.json):

    1  overhead.py          train.py's training step against a bare loop
    1b amp_cpu.py           bf16 autocast on this CPU
    2  input_pipeline.py    the fast input path against torchvision's per-sample one
    3  scaling.py           1 and 2 processes, and the all-reduce share of a step
    4  time_to_accuracy.py  wall seconds to 95% validation accuracy on real MNIST
    5  gpu.py               ResNet-18 on one GPU: fp32, bf16, channels_last, compile
    6  fsdp_vs_ddp.py       FSDP against DDP: step time and state per rank
    7  snapshot_save.py     the rate a snapshot reaches the disk
    8  language_model.py    shakespeare_char: tokens/s, FLOP/s, nanoGPT's own train.py
    8d versus_nanogpt.py    the compiled and the eager step against nanoGPT's, same token files
    9  snapshot_cost.py     what a snapshot costs the training, sync against async

What the sections share (the machine, the table, the process group, a bare
training step, the timing) is harness.py.

The GPU check (``benchmarks/gpu_check.sh``, docs/performance.md's "The GPU
check") is gpu_check.py, its runner (the command line, the time budget, the
order of the parts, the report), and one module per kind of part:

    gpu_probe.py    probe: does a strided pinned batch's copy make the host wait for the GPU?
    gpu_pairs.py    compiled, eager: train.py against nanoGPT's train.py (a warm compile first);
                    ab: strided batches against dense ones (strided_batches.py runs train.py so);
                    kit_runs: FSDP compiled, fp32 with and without TF32; gpt2_tokens
    gpu_trace.py    trace: 5 compiled steps under --profile_dir, the GPU's busy time and idle gaps
    gpu_yes_no.py   rungs, fp16, resume, tests: the yes-or-no checks, side by side
    gpu_costs.py    snapshot: a snapshot's cost to the loop; resnet: train.py's step against a bare loop
    gpu_report.py   the JSON and the tables
    gpu_runs.py     what they share: the sizes, the time budget, running train.py and nanoGPT

Importing the package puts the repository (train.py, common.py, train_utils,
and the support package the tests use too: launching the scripts, their
datasets, train.py's Trainer in process) first on ``sys.path``, so the
section modules import them as the scripts and the tests do; and the
processes that sections 3, 6 and 9 spawn, which start with the parent's
``sys.path``, import their workers as ``benchmarks.<module>``.
"""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO)]
