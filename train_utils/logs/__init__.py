"""The logs wing: what a run tells its user. Other wings and the top of
train_utils import it through this face only.

  module        concern
  startup       the start-up line: what runs where, the global batch size, the notes before it; the placement line
  metrics       the epoch line, JSON lines, TensorBoard, W&B: one RunLog per run; rank 0's progress line
  wandb_run     Weights & Biases: one run per training, its id kept in snapshots (reached through RunLog only)
  profiling     torch.profiler over a few steps, one trace per rank
  throughput    tokens/s, achieved FLOP/s (the model's FLOPs per sample, counted at start), MFU
  text_out      what a task's trained model writes (a language model's sample)
  goodput       where a run's wall time goes across its attempts: the ledger, the goodput line
  timeline      the run's Chrome-trace timeline, a track per rank per attempt
"""

from .goodput import Goodput
from .metrics import RunLog, StepLog, tensorboard_missing
from .profiling import StepProfiler
from .startup import describe_placement, describe_run, describe_task, gather_placement
from .text_out import print_sample
from .throughput import flops_per_sample, throughput_figures

__all__ = ["Goodput", "RunLog", "StepLog", "tensorboard_missing", "StepProfiler", "describe_placement", "describe_run", "describe_task", "gather_placement", "print_sample",
           "flops_per_sample", "throughput_figures"]
