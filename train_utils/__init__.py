"""train.py's library: what a real training run needs besides the training
loop, one module per concern, each behind a few well-named calls. train.py
calls everything as ``train_utils.NAME``; the names below are all it and the
tests use. The ladder's rungs never import this package.

  module             concern
  cli                train.py's flags; one error line under torchrun
  errors             a user error, a finished run, a time-out, a full disk, the unexpected: one line, exit status
  output             one-write lines from several processes; the first error of any rank
  devices            device choice, CPU threads, the start-up line
  kernels            does this torch build run this GPU (CUDA arch list, ROCm gfx); what to install
  speed              --amp, --compile, peak GPU memory
  epoch              the epoch's loss sums, time, progress bars (no collectives inside)
  loaders            DataLoader workers from a fork server, not forked
  checks             downloads first, checks before training
  metrics            the epoch line, JSON lines, TensorBoard, W&B: one RunLog per run
  wandb_run          Weights & Biases: one run per training, its id kept in snapshots
  profiling          torch.profiler over a few steps, one trace per rank
  recipe             fp16's loss scaler, gradient clipping, the lr schedule's state in snapshots,
                     the run's length in steps (--max_steps)
  claims             one live run per snapshot: its claim file, whether a holder lives
  save_errors        a save the system refused: one line naming the intact snapshot
  snapshots          atomic save; reading a snapshot, "same run?" checks
  snapshot_writer    snapshots written in the background, one at a time; --snapshot_every_s's clock
  sharded_snapshots  a folder of DCP shards per save, complete when meta.pt is
  launch             the store under torchrun or srun, side gloo groups
  rendezvous         a Slurm job's rendezvous port (also run by the Slurm wrappers)
  timeouts           start-up vs training time-out, which ranks did not arrive
  evaluation         rank 0's BatchNorm statistics everywhere; even forwards under FSDP
  stop               SIGUSR1/SIGTERM/Ctrl-C: every rank stops after one step
  resume             Progress (position, samples trained, RNG states), DDP's buckets
  sampler            the training sampler: an epoch part-way, at any world size
  fsdp               activation checkpointing, backend check, state per rank, the exit
  throughput         tokens/s, achieved FLOP/s (the model's FLOPs per token), MFU
  text_out           what a language model writes (--sample_chars)
  testing            the tests' fault hook (DDP_TEST_FAULT), called by train.py only;
                     not exported here

Your task (datasets, model, loss) goes in its own file: see common.py and
docs/custom-task.md.
"""

from common import ConfigError
from recipes import build_optimizer, lr_factor  # the recipe's meaning, which the rungs share
from .claims import claim_snapshot, release_claim
from .checks import check_before_training, downloaders_first
from .cli import parse_args
from .devices import backend_for, describe_run, device_for, enable_nccl_diagnostics, share_cpu_cores, \
    torch_version, unusable_gpu_reason
from .epoch import EpochMeter, evaluating
from .errors import NothingToTrain, one_line_errors
from .evaluation import batches_for_every_rank, broadcast_buffers
from .fsdp import GLOO_AVG_REDUCE_SCATTER, check_fsdp_backend, checkpoint_activations, contiguous_parameters, \
    exit_skipping_teardown, print_sharded_memory, training_state_bytes
from .launch import first_host, gloo_group, launcher_store
from .loaders import loader_workers
from .metrics import RunLog
from .output import print_line
from .profiling import StepProfiler
from .recipe import Recipe, accumulate_for_global_batch, batches_left, run_length
from .resume import Progress, rebuild_ddp_buckets
from .sampler import ResumableDistributedSampler
from .sharded_snapshots import ShardedSnapshots, dcp_async_save, dcp_result, resharding_note
from .save_errors import save_failure
from .snapshot_writer import SnapshotClock, SnapshotWriter, cpu_copy
from .snapshots import atomic_save, read_snapshot, remove_stale_temporary_files, snapshot_on_every_node
from .speed import AMP_HELPS_ON_CPU, amp_dtype, autocast, check_amp, compile_model, peak_memory_mib, \
    resolve_amp
from .stop import STOP_SIGNALS, StopSignal, catch_stop_signals, ignore_stop_signal, report_run_finished
from .throughput import GPU_PEAKS, gpu_peak, model_flops_per_token, throughput_figures
from .text_out import check_sampling, generate, print_sample
from .timeouts import check_first_batches, note_phase, use_training_timeout, watch_collectives

SHARDED_SNAPSHOT_META = ShardedSnapshots.META

__all__ = [
    # train.py's start-up: flags, errors, devices, the process group, the data
    "parse_args", "one_line_errors", "ConfigError", "catch_stop_signals", "launcher_store", "device_for",
    "backend_for", "enable_nccl_diagnostics", "share_cpu_cores", "watch_collectives", "describe_run",
    "downloaders_first", "check_before_training", "loader_workers", "ResumableDistributedSampler",
    # the model and the recipe
    "build_optimizer", "lr_factor", "Recipe", "run_length", "accumulate_for_global_batch", "batches_left", "resolve_amp", "amp_dtype", "autocast", "check_amp", "compile_model",
    "check_fsdp_backend", "checkpoint_activations", "contiguous_parameters",
    # the loop: steps, time-outs, stops, evaluation
    "EpochMeter", "evaluating", "note_phase", "check_first_batches", "use_training_timeout", "StopSignal",
    "StepProfiler", "batches_for_every_rank", "broadcast_buffers", "print_sharded_memory",
    # snapshots and resume
    "Progress", "rebuild_ddp_buckets", "claim_snapshot", "release_claim", "atomic_save", "save_failure",
    "remove_stale_temporary_files", "read_snapshot", "snapshot_on_every_node",
    "ShardedSnapshots", "resharding_note", "SnapshotWriter", "SnapshotClock", "cpu_copy", "dcp_async_save",
    "dcp_result", "gloo_group",
    # output and the end of a run
    "RunLog", "print_line", "report_run_finished", "exit_skipping_teardown",
    "model_flops_per_token", "throughput_figures", "check_sampling", "print_sample", "NothingToTrain",
    # for the tests and benchmarks
    "AMP_HELPS_ON_CPU", "GLOO_AVG_REDUCE_SCATTER", "GPU_PEAKS", "gpu_peak",
    "generate", "SHARDED_SNAPSHOT_META", "STOP_SIGNALS", "first_host",
    "ignore_stop_signal", "peak_memory_mib", "torch_version", "training_state_bytes", "unusable_gpu_reason",
]
