"""train.py's library: what a real training run needs besides the training
loop, one module per concern, each behind a few well-named calls. train.py
calls everything as ``train_utils.NAME``; ``__all__`` below is exactly what
it uses. Everything else (the tests', the benchmarks') is imported from its
module: ``from train_utils.snapshots.file import read_snapshot``.

The kit runs under a process group always, from ``train.setup`` on (one
process is a group of one): the library's collectives need no "is there a
group?" guard. Only what runs before the group exists checks for it: the
launcher's store, the stop signals during start-up, and the one-line errors.

  module             concern
  config             the run's configuration: every flag a field of one frozen RunConfig, resolved once
  cli                train.py's command line (RunConfig's flags, the task modules'); one error line under torchrun
  errors             a user error, a finished run, a time-out, a full disk, the unexpected: one line, exit status
  output             one-write lines from several processes; the first error of any rank; output paths
  devices            device choice, CPU threads, the start-up line
  kernels            does this torch build run this GPU (CUDA arch list, ROCm gfx); what to install
  speed              --amp, --compile, peak GPU memory
  numerics           TF32 for fp32 matmuls on GPUs (--no_tf32), --deterministic, the precision MFU divides by
  epoch              the epoch's batches, progress bars (no collectives inside)
  loaders            DataLoader workers from a fork server, not forked
  checks             downloads first, checks before training
  metrics            the epoch line, JSON lines, TensorBoard, W&B: one RunLog per run
  wandb_run          Weights & Biases: one run per training, its id kept in snapshots
  profiling          torch.profiler over a few steps, one trace per rank
  recipe             fp16's loss scaler, gradient clipping, the lr schedule's state in snapshots,
                     the run's length in steps (--max_steps)
  snapshots/         the Checkpointer, given the run's parts: a snapshot's whole life (claim, load, save,
                     wait, close), its two formats, the background writer, the claims (its own table)
  launch             the store under torchrun or srun, side gloo groups
  rendezvous         a Slurm job's rendezvous port (also run by the Slurm wrappers)
  timeouts           start-up vs training time-out, which ranks did not arrive; the loop's Watch
  hang_report        on a time-out every live rank's stack on disk, its host, file:line and collectives
  evaluation         rank 0's BatchNorm statistics everywhere; even forwards under FSDP; --eval_windows
  evaluations        when the run evaluates (by epochs or steps), the interval's loss, its records
  stop               SIGUSR1/SIGTERM/Ctrl-C: every rank stops after one step
  resume             Progress (position, samples trained, RNG states), DDP's buckets
  resume_check       --check_resume: a run straight through and one stopped and resumed, compared bitwise
  sampler            the training sampler: an epoch part-way, at any world size
  fsdp               activation checkpointing, backend check, state per rank, the exit
  throughput         tokens/s, achieved FLOP/s (the model's FLOPs per sample, counted at start), MFU
  text_out           what a task's trained model writes (a language model's sample)

Your task (datasets, model, loss) goes in its own file: see common.py and
docs/custom-task.md.
"""

from recipes import build_optimizer  # the recipe's meaning, which the rungs share
from .checks import check_before_training, downloaders_first
from .cli import parse_args, task_flag_values, task_models
from .config import RunConfig, resolve_config
from .devices import backend_for, describe_run, device_for, enable_flight_recorder, share_cpu_cores
from .epoch import EpochBatches, evaluating
from .errors import NothingToTrain, one_line_errors
from .evaluation import batches_for_every_rank, broadcast_buffers, eval_subset, fewest_batches
from .evaluations import Evaluations
from .hang_report import answer_stack_requests, stack_folder, stop_answering
from .fsdp import check_fsdp_backend, checkpoint_activations, contiguous_parameters, exit_skipping_teardown, \
    print_sharded_memory
from .launch import launcher_store, raise_open_file_limit
from .loaders import DenseBatches, HostToDevice, SeededFetches, loader_workers
from .metrics import RunLog, StepLog
from .output import print_line
from .profiling import StepProfiler
from .recipe import Recipe, batches_left
from .resume import Progress, rebuild_ddp_buckets
from .resume_check import check_resume
from .sampler import ResumableDistributedSampler
from .snapshots import Checkpointer, Found, claim_snapshot_path
from .speed import amp_dtype, autocast, compile_blocks, compile_model, fp32, resolve_amp, training_loss
from .stop import StopSignal, Stopped, catch_stop_signals, report_run_finished
from .text_out import print_sample
from .numerics import compute_precision, set_deterministic, set_fp32_precision
from .throughput import flops_per_sample, throughput_figures
from .timeouts import Watch, watch_collectives

__all__ = [
    # start-up: flags, errors, devices, the process group, the data
    "parse_args",
    "task_flag_values",
    "task_models",
    "one_line_errors",
    "catch_stop_signals",
    "launcher_store",
    "raise_open_file_limit",
    "device_for",
    "backend_for",
    "enable_flight_recorder",
    "share_cpu_cores",
    "watch_collectives",
    "stack_folder",
    "answer_stack_requests",
    "describe_run",
    "downloaders_first",
    "claim_snapshot_path",
    "resolve_config",
    "RunConfig",
    "check_before_training",
    "loader_workers",
    "DenseBatches",
    "SeededFetches",
    "HostToDevice",
    "ResumableDistributedSampler",
    # the model and the recipe
    "build_optimizer",
    "Recipe",
    "batches_left",
    "resolve_amp",
    "amp_dtype",
    "autocast",
    "compile_model",
    "compile_blocks",
    "training_loss",
    "fp32",
    "set_deterministic",
    "set_fp32_precision",
    "compute_precision",
    "flops_per_sample",
    "check_fsdp_backend",
    "checkpoint_activations",
    "contiguous_parameters",
    # the loop: steps, time-outs, stops, evaluation, snapshots
    "EpochBatches",
    "evaluating",
    "Watch",
    "StopSignal",
    "Stopped",
    "StepProfiler",
    "batches_for_every_rank",
    "broadcast_buffers",
    "fewest_batches",
    "eval_subset",
    "Evaluations",
    "print_sharded_memory",
    "Progress",
    "rebuild_ddp_buckets",
    "check_resume",
    "Checkpointer",
    "Found",
    # output and the end of a run
    "RunLog",
    "StepLog",
    "print_line",
    "report_run_finished",
    "stop_answering",
    "exit_skipping_teardown",
    "throughput_figures",
    "print_sample",
    "NothingToTrain",
]
