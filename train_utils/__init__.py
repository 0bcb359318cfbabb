"""The training machinery the scripts share, which you keep as it is.

The scripts show each rung's distributed concept; what is right but not the
lesson lives here, one module per concern, each behind a few well-named
calls. The scripts call everything as ``train_utils.NAME``.

The map: module, concern, and the first rung that needs it (a later rung
needs what an earlier one does). singlegpu.py reaches no process group, time-out
or stop signal through its calls.

  module             concern                                                    first rung
  cli                the shared flags, one usage line under torchrun            singlegpu
  errors             a user error, a finished run, a time-out: one line, exit   singlegpu
  output             one-write lines from several processes                     singlegpu
  devices            device choice, CPU threads, the start-up line              singlegpu
  speed              --amp, --compile, peak GPU memory                          singlegpu
  epoch              the epoch's loss sums, time, progress bars                 singlegpu
  loaders            DataLoader workers from a fork server, not forked          singlegpu
  checks             downloads first, checks before training                    singlegpu
  metrics            the epoch line, JSON lines, TensorBoard, the resume line   singlegpu
  wandb_run          Weights & Biases: one run per training, from rank 0; its   singlegpu (log),
                     id in snapshots, so a resumed run continues it             torchrun (resume)
  profiling          torch.profiler over a few steps, one trace per rank        singlegpu
  recipe             optimizer, weight decay, lr schedule and warm-up, fp16's   singlegpu
                     loss scaler, gradient clipping; their state in snapshots
  snapshots          atomic save; reading a snapshot, "same run?" checks        singlegpu (save),
                                                                                torchrun (read)
  launch             mp.spawn's world size and port, the store under torchrun   spawn
                     or srun, side gloo groups
  timeouts           start-up vs training time-out, which ranks did not arrive  spawn
  evaluation         rank 0's BatchNorm statistics everywhere; even forwards    spawn (buffers),
                                                                                FSDP (forwards)
  stop               SIGUSR1/SIGTERM/Ctrl-C: every rank stops after one step    torchrun
  resume             Progress (position, RNG states), resumable sampler,        torchrun
                     DDP's buckets after a resume
  fsdp               FSDP units, backend check, state per rank, the exit        FSDP
  sharded_snapshots  a folder of DCP shards per save, complete when meta.pt is  FSDP
  testing            the tests' fault hook (DDP_TEST_FAULT); a no-op otherwise  tests only

Your task (datasets, model, loss) goes in its own file: see common.py and
docs/custom-task.md.
"""

from .checks import PER_PROCESS_FLAGS, check_before_training, check_same_settings, \
    downloaders_first, first_error
from .cli import SCRIPT_FLAGS, non_negative_int, parse_args, positive
from .devices import NCCL_DIAGNOSTICS, OLDEST_TORCH, backend_for, check_gpu_has_kernels, cuda_available, \
    describe_run, device_for, enable_nccl_diagnostics, gpus_hidden_on_purpose, nccl_trace_prefix, \
    other_accelerator, share_cpu_cores, started_by_srun, torch_version, unusable_gpu_reason, usable_cpus
from .epoch import EpochMeter, check_finite, evaluating, progress_bar
from .errors import ConfigError, NothingToTrain, one_line_errors, report_to_torchrun
from .evaluation import batches_for_every_rank, broadcast_buffers, most_batches
from .fsdp import GLOO_AVG_REDUCE_SCATTER, check_fsdp_backend, contiguous_parameters, \
    exit_skipping_teardown, fsdp_blocks, print_sharded_memory, training_state_bytes
from .launch import check_port_free, first_host, gloo_group, launcher_store, spawn_world_size
from .loaders import loader_workers
from .metrics import RUN, log_metrics, log_resume
from .output import is_distributed, print_line
from .profiling import StepProfiler
from .recipe import LR_SCHEDULES, OPTIMIZERS, RECIPE_FLAGS, Recipe, build_optimizer, clip_grad_norm, \
    lr_factor
from .resume import Progress, ResumableDistributedSampler, gather_rng_states, position, \
    position_tag, rebuild_ddp_buckets, set_rng_state
from .sharded_snapshots import ShardedSnapshots, resharding_note
from .snapshots import SNAPSHOT_MUST_MATCH, START_AFRESH, atomic_save, read_snapshot, \
    snapshot_on_every_node
from .speed import AMP_HELPS_ON_CPU, amp_dtype, autocast, check_amp, compile_model, peak_memory_mib
from .stop import STOP_SIGNALS, StopDuringStartup, StopSignal, catch_stop_signals, ignore_stop_signal, \
    received_stop_signal, report_run_finished
from .timeouts import use_training_timeout, watch_collectives
from .wandb_run import start_wandb_run

SHARDED_SNAPSHOT_META = ShardedSnapshots.META
