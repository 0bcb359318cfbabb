"""The distributed wing: how this process meets the others and what runs on
its device. Other wings and the top of train_utils import it through this
face only.

  module        concern
  launch        the store under torchrun or srun, side gloo groups, a barrier, rank 0's buffers everywhere
  rendezvous    a Slurm job's rendezvous port (run as a file by the Slurm wrappers: no import)
  devices       device choice, CPU threads, the flight recorder, peak GPU memory, torch's version
  kernels       does this torch build run this GPU (CUDA arch list, ROCm gfx); what to install
  timeouts      start-up vs training time-out, which ranks did not arrive, what a restart resumes; the loop's Watch
  hang_report   on a time-out every live rank's stack on disk, its host, file:line and collectives
  fsdp          FSDP2 and HSDP sharding, the backend check, the state each rank holds
  meta_build    a model built on the meta device, each rank's shards then materialised with their initial values
"""

from .devices import OLDEST_TORCH, backend_for, device_for, enable_flight_recorder, peak_memory_mib, \
    rejoin_note, share_cpu_cores, torch_version, unusable_gpu_reason
from .fsdp import binary_size, check_fsdp_backend, contiguous_parameters, local_state_bytes, model_sharded, \
    print_sharded_memory, shard_model, state_line
from .meta_build import InitRecord, build_on_meta, materialize_shards
from .hang_report import ANSWER_WAIT_S, answer_stack_requests, finish_answer, frame_in_code, hang_requested, \
    making_report, run_store, stack_folder, stop_answering
from .launch import barrier, broadcast_buffers, gloo_group, launcher_store, raise_open_file_limit
from .timeouts import RanksStuck, Watch, is_timeout, note_snapshot, startup_timeout_line, timeout_diagnosis, \
    watch_again, watch_collectives

__all__ = [
    "OLDEST_TORCH", "backend_for", "device_for", "enable_flight_recorder", "peak_memory_mib", "rejoin_note",
    "share_cpu_cores", "torch_version", "unusable_gpu_reason",
    "binary_size", "check_fsdp_backend", "contiguous_parameters", "local_state_bytes", "model_sharded",
    "print_sharded_memory", "shard_model", "state_line",
    "InitRecord", "build_on_meta", "materialize_shards",
    "ANSWER_WAIT_S", "answer_stack_requests", "finish_answer", "frame_in_code", "hang_requested", "making_report",
    "run_store", "stack_folder", "stop_answering",
    "barrier", "broadcast_buffers", "gloo_group", "launcher_store", "raise_open_file_limit",
    "RanksStuck", "Watch", "is_timeout", "note_snapshot", "startup_timeout_line", "timeout_diagnosis", "watch_again",
    "watch_collectives",
]
