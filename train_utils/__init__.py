"""train.py's library: what a real training run needs besides the training
loop, one module per concern, each behind a few well-named calls. train.py
calls everything as ``train_utils.NAME``; ``__all__`` below is exactly what
it uses. Everything else (the tests', the benchmarks') is imported from its
module: ``from train_utils.snapshots.file import read_snapshot``.

The kit runs under a process group always, from ``train.setup`` on (one
process is a group of one): the library's collectives need no "is there a
group?" guard. Only what runs before the group exists checks for it: the
launcher's store, the stop signals during start-up, and the one-line errors.

The package is filed by role, as torchtitan files its components: three
wings and the snapshots, each a folder behind its face (its ``__init__.py``,
through which every module outside the folder imports it), and at the top
the run's configuration and command line, the checks before training, the
errors and the one way a process ends. Each room imports only rooms below
it (A -> B: A imports B; none runs back up; tests/test_package_map.py):

  plan         -> errors, cli, checks, loop, snapshots, distributed, config, output
  cli          -> errors, config
  checks       -> logs, loop, config, output
  errors       -> loop, ending, distributed, output
  logs/        -> loop, snapshots, distributed, config, output
  loop/        -> ending, snapshots, distributed, config, output
  ending       -> snapshots, distributed, output
  snapshots/   -> distributed, config, output
  distributed/ -> output
  config, output: the ground, importing no other module of the package

  module / wing      concern
  config             the run's configuration: every flag a field of one frozen RunConfig, resolved once
  cli                train.py's command line (RunConfig's flags, the task modules'); one error line under torchrun
  plan               --plan NODESxPROCS: a job's run checked in one process (fake process group, meta model)
  checks             downloads first, checks before training
  errors             a user error, a time-out, a full disk, the unexpected: one line, exit status
  ending             how a process ends, whatever ended it: one door (end_process)
  output             one-write lines from several processes; the first error of any rank; output paths
  distributed/       launch, rendezvous, devices, kernels, timeouts, hang report, FSDP (distributed/__init__.py)
  loop/              progress, sampler, epoch, loaders, evaluation(s), recipe, speed, numerics, stop (loop/__init__.py)
  logs/              the start-up line, metrics, W&B, profiler, throughput, a model's text, the goodput
                     ledger and timeline (logs/__init__.py)
  snapshots/         the Checkpointer, given the run's parts: a snapshot's whole life (claim, load, save,
                     wait, close), its two formats, the background writer, the claims (snapshots/__init__.py)

The programs that use the kit stand beside train.py, not in it: tools/
(the resume check, the run's identity and a submission's snapshot name,
the export of a GPT snapshot as a Hugging Face folder).
Your task (datasets, model, loss) goes in its own file: see common.py and
docs/custom-task.md.
"""

from recipes import build_optimizer  # the recipe's meaning, which the rungs share
from .checks import check_before_training, downloaders_first
from .cli import output_flags, parse_args, task_flag_values, task_models
from .config import RunConfig, is_sharded, resolve_config
from .distributed import Watch, answer_stack_requests, backend_for, broadcast_buffers, build_on_meta, \
    check_fsdp_backend, device_for, enable_flight_recorder, launcher_store, materialize_shards, \
    print_sharded_memory, raise_open_file_limit, shard_model, share_cpu_cores, stack_folder, watch_collectives
from .errors import one_line_errors
from .logs import Goodput, RunLog, StepLog, StepProfiler, describe_placement, describe_run, describe_task, flops_per_sample, \
    gather_placement, print_sample, throughput_figures
from .loop import DenseBatches, EpochBatches, Evaluations, HostToDevice, Progress, Recipe, \
    ResumableDistributedSampler, SeededFetches, StepPhases, StopSignal, Stopped, StragglerWatch, autocast, \
    batches_for_every_rank, batches_left, catch_stop_signals, checkpoint_activations, compile_blocks, \
    compile_model, compute_precision, eval_subset, evaluating, fewest_batches, fp32, loader_workers, \
    nothing_to_train, rebuild_ddp_buckets, report_run_finished, resolve_amp, set_deterministic, \
    set_fp32_precision, time_gradient_wait, training_loss, watch_preemption_notice, worker_stacks
from .output import print_line
from .plan import check_plan, plan_request
from .snapshots import START_AFRESH, Checkpointer, Found, claim_snapshot_path, load_initial_weights, position, \
    saved_budget_batch, take_initial_sizes

__all__ = [
    # start-up: flags, errors, devices, the process group, the data
    "parse_args",
    "plan_request",
    "check_plan",
    "task_flag_values",
    "output_flags",
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
    "gather_placement",
    "describe_placement",
    "describe_task",
    "downloaders_first",
    "claim_snapshot_path",
    "resolve_config",
    "RunConfig",
    "is_sharded",
    "check_before_training",
    "loader_workers",
    "worker_stacks",
    "DenseBatches",
    "SeededFetches",
    "HostToDevice",
    "ResumableDistributedSampler",
    # the model and the recipe
    "build_optimizer",
    "Recipe",
    "batches_left",
    "nothing_to_train",
    "resolve_amp",
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
    "shard_model",
    "build_on_meta",
    "materialize_shards",
    # the loop: steps, time-outs, stops, evaluation, snapshots
    "EpochBatches",
    "StepPhases",
    "StragglerWatch",
    "time_gradient_wait",
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
    "Checkpointer",
    "Found",
    "position",
    "saved_budget_batch",
    "take_initial_sizes",
    "START_AFRESH",
    "load_initial_weights",
    # output and the end of a run
    "RunLog",
    "StepLog",
    "Goodput",
    "print_line",
    "report_run_finished",
    "watch_preemption_notice",
    "throughput_figures",
    "print_sample",
]
