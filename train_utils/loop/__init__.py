"""The loop wing: what the training loop steps through. Other wings and the
top of train_utils import it through this face only.

  module        concern
  progress      Progress: the position, samples trained, RNG states; DDP's buckets after a resume
  sampler       the training sampler: an epoch part-way, at any world size
  epoch         the epoch's batches, progress bars (no collectives inside)
  loaders       DataLoader workers from a fork server, not forked; dense batches, their copy to the device
  evaluation    even forwards under FSDP; --eval_windows
  evaluations   when the run evaluates (by epochs or steps), the interval's loss, its records
  recipe        fp16's loss scaler, gradient clipping, the lr schedule's state in snapshots,
                the run's length in steps (--max_steps)
  speed         --amp, --compile, --activation_checkpointing
  numerics      TF32 for fp32 matmuls on GPUs (--no_tf32), --deterministic, the precision MFU divides by
  phases        each step's time by phase (data, compute, collective, snapshot) on this rank
  stragglers    a rank slower than its peers in a phase, named by rank, host, phase, loader line
  links         a link between hosts slower than the others, timed by a point-to-point probe
  stop          SIGUSR1/SIGTERM/Ctrl-C: every rank stops after one step; start-up ends at once
  notice        a cloud's preemption notice (AWS, GCE metadata) taken as SIGTERM (--preemption_notice)
"""

from .epoch import EpochBatches, evaluating
from .evaluation import batches_for_every_rank, eval_subset, fewest_batches
from .evaluations import Evaluations
from .loaders import DenseBatches, HostToDevice, SeededFetches, loader_workers, worker_stacks
from .notice import PreemptionNotice, watch_preemption_notice
from .numerics import compute_precision, numerics_description, set_deterministic, set_fp32_precision
from .phases import PHASES, StepPhases, time_gradient_wait
from .progress import Progress, rebuild_ddp_buckets
from .recipe import Recipe, batches_left, nothing_to_train
from .sampler import ResumableDistributedSampler
from .speed import autocast, check_amp, checkpoint_activations, compile_blocks, compile_model, fp32, \
    resolve_amp, training_loss
from .stragglers import StragglerWatch
from .stop import StopDuringStartup, StopSignal, Stopped, catch_stop_signals, forget_stop_signal, \
    note_stop_signals_only, received_stop_signal, report_run_finished, request_stop

__all__ = [
    "EpochBatches", "evaluating", "batches_for_every_rank", "eval_subset", "fewest_batches", "Evaluations",
    "DenseBatches", "HostToDevice", "SeededFetches", "loader_workers", "worker_stacks",
    "compute_precision", "numerics_description", "set_deterministic", "set_fp32_precision",
    "PHASES", "StepPhases", "time_gradient_wait", "StragglerWatch",
    "Progress", "rebuild_ddp_buckets", "Recipe", "batches_left", "nothing_to_train", "ResumableDistributedSampler",
    "autocast", "check_amp", "checkpoint_activations", "compile_blocks", "compile_model", "fp32",
    "resolve_amp", "training_loss",
    "StopDuringStartup", "StopSignal", "Stopped", "catch_stop_signals", "forget_stop_signal",
    "note_stop_signals_only", "received_stop_signal", "report_run_finished", "request_stop",
    "PreemptionNotice", "watch_preemption_notice",
]
