"""Focused tests of the train_utils package: device choice, the start-up and epoch
lines, atomic saves."""

import glob
import json
import re
import warnings

import pytest
import torch

import train_utils
from common import ConfigError
from train_utils.distributed.devices import torch_version, unusable_gpu_reason
from train_utils.distributed.fsdp import GLOO_AVG_REDUCE_SCATTER
from train_utils.distributed.launch import first_host
from train_utils.snapshots.writer import SnapshotClock, SnapshotWriter, cpu_copy
from train_utils.snapshots.file import atomic_save
from train_utils.loop.stop import STOP_SIGNALS, ignore_stop_signal
from helpers import EPOCH_LINE, REPO, TEST_LINE, TORCHRUN, check, error_lines, run


def show_gpus(monkeypatch, count: int, capability: tuple = (9, 0), arches: str = "sm_75 sm_80 sm_86 sm_90"):
    """What torch.cuda answers on a machine with ``count`` GPUs of ``capability``
    and a build with kernels for ``arches``: the only parts replaced."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2-32GB")
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: arches.split())


def test_device_for_refuses_a_local_rank_without_its_own_gpu(monkeypatch):
    """Three processes on a node showing two GPUs: local rank 2 gets one line
    naming what it asked for and what is visible, not a raw CUDA error."""
    monkeypatch.delenv("SLURM_STEP_ID", raising=False)
    show_gpus(monkeypatch, 2)
    assert train_utils.device_for(1) == torch.device("cuda", 1)
    with pytest.raises(ConfigError) as info:
        train_utils.device_for(2)
    message = str(info.value)
    assert "local rank 2 needs GPU 2" in message and "only 2 GPU(s)" in message
    assert "--nproc_per_node=2" in message and "\n" not in message


def test_device_for_under_srun_with_one_gpu_bound_per_task(monkeypatch):
    """srun --ntasks-per-node=4 --gpus-per-task=1: Slurm binds one GPU to each
    task, so every task sees one GPU, its own, whatever its SLURM_LOCALID."""
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    show_gpus(monkeypatch, 1)
    assert [train_utils.device_for(local) for local in range(4)] == [torch.device("cuda", 0)] * 4


def test_device_for_under_srun_where_every_task_sees_the_node(monkeypatch):
    """srun --ntasks-per-node=4 --gres=gpu:4 without binding: each task sees all
    four and takes the one of its SLURM_LOCALID; a fifth task is refused in
    srun's flags, not torchrun's."""
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    show_gpus(monkeypatch, 4)
    assert train_utils.device_for(3) == torch.device("cuda", 3)
    with pytest.raises(ConfigError) as info:
        train_utils.device_for(4)
    message = str(info.value)
    assert message.startswith("srun task with SLURM_LOCALID 4 needs GPU 4, but this node shows only 4 GPU(s)")
    assert "srun --ntasks-per-node=4" in message and "--gpus-per-task=1" in message
    assert "nproc_per_node" not in message and "\n" not in message


def test_torchrun_under_srun_keeps_local_rank_and_torchruns_words(monkeypatch):
    """The Slurm wrappers run torchrun inside an srun step: its workers have
    SLURM_STEP_ID too, but TORCHELASTIC_RUN_ID says torchrun started them."""
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "1234")
    show_gpus(monkeypatch, 1)
    with pytest.raises(ConfigError, match=r"--nproc_per_node=1\)$"):
        train_utils.device_for(1)


def test_a_gpu_the_build_has_no_kernels_for_is_refused_in_one_line(monkeypatch):
    """A V100 (sm_70) under a CUDA 13 wheel (sm_75 and newer): refused before any
    kernel runs, naming the build to install."""
    monkeypatch.delenv("SLURM_STEP_ID", raising=False)
    show_gpus(monkeypatch, 1, capability=(7, 0), arches="sm_75 sm_80 sm_86 sm_90 sm_100 sm_120")
    with pytest.raises(ConfigError) as info:
        train_utils.device_for(0)
    message = str(info.value)
    assert message.startswith("Tesla V100-SXM2-32GB (cuda:0) has compute capability 7.0 (sm_70), but torch ")
    assert "kernels only for sm_75 sm_80 sm_86 sm_90 sm_100 sm_120" in message
    assert "--index-url https://download.pytorch.org/whl/cu126" in message and "\n" not in message


@pytest.mark.parametrize("capability, arches", [
    ((7, 0), "sm_50 sm_60 sm_70 sm_75 sm_80 sm_86 sm_90"),  # the CUDA 12.6 wheel
    ((8, 9), "sm_75 sm_80 sm_86 sm_90"),  # an L40S runs sm_86's cubins (same major)
    ((12, 1), "sm_75 sm_80 sm_90 sm_100 compute_120"),  # PTX of an older one JIT-compiles
    ((7, 0), ""),  # an empty list: unknown, not refused
])
def test_a_gpu_the_build_can_run_is_taken(monkeypatch, capability, arches):
    monkeypatch.delenv("SLURM_STEP_ID", raising=False)
    show_gpus(monkeypatch, 1, capability=capability, arches=arches)
    assert train_utils.device_for(0) == torch.device("cuda", 0)


def test_a_newer_major_without_ptx_is_refused(monkeypatch):
    """sm_90's cubins do not run on sm_100 (another major), and no PTX to compile."""
    monkeypatch.delenv("SLURM_STEP_ID", raising=False)
    show_gpus(monkeypatch, 1, capability=(10, 0), arches="sm_80 sm_90")
    with pytest.raises(ConfigError, match=r"compute capability 10\.0 \(sm_100\)"):
        train_utils.device_for(0)


@pytest.mark.parametrize("capability, arches, advice", [
    ((7, 0), "sm_75 sm_80 sm_86 sm_90 sm_100 sm_120", "whl/cu126"),  # a V100 under CUDA 13: an older line
    ((6, 0), "sm_70 sm_75 sm_80 sm_86 sm_90 sm_100 sm_120", "whl/cu126"),  # a P100 under cu128
    ((10, 0), "sm_50 sm_60 sm_70 sm_75 sm_80 sm_86 sm_90", "whl/cu128"),  # a B200 under cu126: a newer line
    ((12, 0), "sm_50 sm_60 sm_70 sm_75 sm_80 sm_86 sm_90", "whl/cu128"),  # an RTX 5090 under cu126
    ((11, 0), "sm_75 sm_80 sm_86 sm_90 sm_100 sm_120", "TORCH_CUDA_ARCH_LIST=11.0"),  # no wheel has sm_11x
])
def test_the_advice_names_the_build_that_fits_the_gpu(monkeypatch, capability, arches, advice):
    """The build to install follows from the GPU's compute capability: an older
    CUDA line for a GPU older than the build, a newer one for a newer GPU."""
    monkeypatch.delenv("SLURM_STEP_ID", raising=False)
    show_gpus(monkeypatch, 1, capability=capability, arches=arches)
    with pytest.raises(ConfigError) as info:
        train_utils.device_for(0)
    assert advice in str(info.value) and "\n" not in str(info.value)


class _RocmGpu:
    """torch.cuda.get_device_properties of an MI250X, a ROCm GPU (gfx90a)."""
    gcnArchName = "gfx90a:sramecc+:xnack-"


@pytest.mark.parametrize("arches, taken", [
    ("gfx900 gfx906 gfx908 gfx90a gfx942 gfx1030 gfx1100", True),  # a ROCm 6 wheel's list
    ("gfx942 gfx1100", False),  # a build without gfx90a
])
def test_rocm_gpus_are_checked_by_their_gfx_name(monkeypatch, arches, taken):
    """ROCm builds list gfx names, no sm_XY: a GPU whose gfx name is in the list
    is taken (it was refused, with the advice to install CUDA 12.6); one whose
    is not is refused naming its gfx, not a CUDA build."""
    monkeypatch.delenv("SLURM_STEP_ID", raising=False)
    monkeypatch.delenv("HSA_OVERRIDE_GFX_VERSION", raising=False)
    show_gpus(monkeypatch, 1, capability=(9, 0), arches=arches)  # ROCm answers 9.0 for gfx90a
    monkeypatch.setattr(torch.version, "hip", "6.4.43482")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: _RocmGpu())
    if taken:
        assert train_utils.device_for(0) == torch.device("cuda", 0)
        return
    with pytest.raises(ConfigError) as info:
        train_utils.device_for(0)
    message = str(info.value)
    assert "is a gfx90a" in message and "ROCm build with kernels for gfx90a" in message
    assert "cu126" not in message and "\n" not in message
    monkeypatch.setenv("HSA_OVERRIDE_GFX_VERSION", "9.4.2")  # runs gfx942's kernels: the user's call
    assert train_utils.device_for(0) == torch.device("cuda", 0)


def test_device_for_is_the_cpu_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert train_utils.device_for(5) == torch.device("cpu")


def test_gpus_torch_cannot_use_are_reported_with_torchs_reason(monkeypatch, one_process_group):
    """GPU device files present, but this torch build cannot use them (here: the
    warning torch gives for a driver too old for its CUDA build)."""
    def unavailable():
        warnings.warn("CUDA initialization: The NVIDIA driver on your system is too old "
                      "(found version 11040).\nPlease update your GPU driver.")
        return False

    for name in ("CUDA_VISIBLE_DEVICES", "SLURM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(glob, "glob", lambda pattern: ["/dev/nvidia0"])
    monkeypatch.setattr(torch.cuda, "is_available", unavailable)
    reason = unusable_gpu_reason()
    assert reason.startswith("CUDA initialization: The NVIDIA driver on your system is too old")
    line = train_utils.describe_run(torch.device("cpu"), train_utils.RunConfig(batch_size=32))
    note, start = line.split("\n")
    assert note.startswith("note: this machine has NVIDIA GPUs, but torch cannot use them (CUDA")
    assert "training on the CPU" in note
    assert start.startswith("device cpu | backend gloo | world_size 1 | global batch size 32")


def test_placement_line_groups_ranks_by_host_and_reads_back():
    """describe_placement: one part per host, in the order of its first rank,
    its ranks, local ranks and devices as ranges in the ranks' order; the
    tests' reader (helpers.placements, which the Slurm and container tests
    use) gives back every (rank, local_rank, host)."""
    from helpers import placements
    from train_utils.logs.startup import number_ranges

    assert number_ranges([0, 1, 2, 3, 8, 10, 11]) == "0-3,8,10-11" and number_ranges([0, 0]) == "0,0"
    eight = [(rank, rank % 4, f"gpu{rank // 4 + 1}", f"cuda:{rank % 4}") for rank in range(8)]
    line = train_utils.describe_placement(list(reversed(eight)))  # any order in: by rank out
    assert line == ("placement: host gpu1: ranks 0-3 (local_rank 0-3, cuda:0-3) | "
                    "host gpu2: ranks 4-7 (local_rank 0-3, cuda:0-3)")
    # srun's cyclic distribution; two containers that share a host name; one rank alone
    cyclic = [(rank, rank // 2, f"n{rank % 2}", "cpu") for rank in range(4)]
    assert train_utils.describe_placement(cyclic) == ("placement: host n0: ranks 0,2 (local_rank 0-1, cpu) | "
                                                      "host n1: ranks 1,3 (local_rank 0-1, cpu)")
    shared = [(0, 0, "box", "cpu"), (1, 0, "box", "cpu"), (2, 0, "solo", "cpu")]
    assert train_utils.describe_placement(shared) == ("placement: host box: ranks 0-1 (local_rank 0,0, cpu) | "
                                                      "host solo: rank 2 (local_rank 0, cpu)")
    for where in (eight, cyclic, shared):
        text = "device cpu | ...\n" + train_utils.describe_placement(where) + "\ntask ...\n"
        assert placements(text) == [{(rank, local, host) for rank, local, host, _ in where}]


def test_torchs_reason_survives_its_warning_being_given_once(monkeypatch):
    """torch warns about an unusable driver once per process, at the first
    is_available() call, which the scripts make in device_for, before the start-up
    line: the note still names torch's reason, not "is_available() is False"."""
    from train_utils.distributed import devices

    calls = []

    def warns_once():
        if not calls:
            warnings.warn("CUDA initialization: The NVIDIA driver on your system is too old "
                          "(found version 11040).\nPlease update your GPU driver.")
        calls.append(1)
        return False

    for name in ("CUDA_VISIBLE_DEVICES", "SLURM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(devices, "_CUDA_WARNINGS", [], raising=False)
    monkeypatch.setattr(glob, "glob", lambda pattern: ["/dev/nvidia0"])
    monkeypatch.setattr(torch.cuda, "is_available", warns_once)
    assert train_utils.device_for(0) == torch.device("cpu")
    assert unusable_gpu_reason() == ("CUDA initialization: The NVIDIA driver on your system is "
                                     "too old (found version 11040).")
    assert len(calls) == 2


@pytest.mark.parametrize("env, noted", [
    ({"CUDA_VISIBLE_DEVICES": ""}, False),  # hidden by the user
    ({"CUDA_VISIBLE_DEVICES": "-1"}, False),
    ({"SLURM_JOB_ID": "7"}, False),  # a Slurm job without GPUs on a GPU node
    ({"SLURM_JOB_ID": "7", "SLURM_JOB_GPUS": "0,1", "CUDA_VISIBLE_DEVICES": "0,1"}, True),
    ({}, True),
])
def test_gpus_hidden_on_purpose_get_no_note(monkeypatch, env, noted):
    from train_utils.distributed import devices

    for name in ("CUDA_VISIBLE_DEVICES", "SLURM_JOB_ID", "SLURM_JOB_GPUS", "SLURM_STEP_GPUS", "SLURM_GPUS_ON_NODE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(devices, "_CUDA_WARNINGS", [], raising=False)
    monkeypatch.setattr(glob, "glob", lambda pattern: ["/dev/nvidia0"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert (unusable_gpu_reason() is not None) == noted


def test_no_gpu_files_means_nothing_to_report(monkeypatch, one_process_group):
    monkeypatch.setattr(glob, "glob", lambda pattern: [])
    assert unusable_gpu_reason() is None
    line = train_utils.describe_run(torch.device("cpu"), train_utils.RunConfig(batch_size=8, grad_accum_steps=4))
    assert line == ("device cpu | backend gloo | world_size 1 | global batch size 32 = "
                    f"batch_size 8 x grad_accum_steps 4 x world_size 1 | cpu threads {torch.get_num_threads()} "
                    "per process")


def test_the_flight_recorder_keeps_torchs_error_handling_and_dumps_beside_the_snapshot(monkeypatch, tmp_path):
    """torch's default TORCH_NCCL_ASYNC_ERROR_HANDLING (3, skip the communicator's
    clean-up) is left alone; the flight recorder records gloo's collectives too
    (NCCL's variables set only for NCCL), and NCCL's dumps go into the
    snapshot's folder, named by the job under Slurm, in the variable torch reads first
    (TORCH_FR_DUMP_TEMP_FILE; TORCH_NCCL_DEBUG_INFO_TEMP_FILE is its deprecated
    name); what the user set, under either name, is kept."""
    import os

    for name in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_FR_DUMP_TEMP_FILE",
                 "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT",
                 "SLURM_JOB_ID"):
        monkeypatch.setenv(name, "")  # so that monkeypatch also undoes what the call sets
        monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    train_utils.enable_flight_recorder(str(tmp_path), nccl=False)
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == "2000"
    assert "TORCH_NCCL_DUMP_ON_TIMEOUT" not in os.environ and "TORCH_FR_DUMP_TEMP_FILE" not in os.environ
    monkeypatch.delenv("TORCH_FR_BUFFER_SIZE")
    train_utils.enable_flight_recorder(str(tmp_path), nccl=True)
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in os.environ
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "nccl_trace_rank_")
    assert "TORCH_NCCL_DEBUG_INFO_TEMP_FILE" not in os.environ  # deprecated: torch would warn
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and os.environ["TORCH_FR_BUFFER_SIZE"] == "2000"
    for name in ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_FR_BUFFER_SIZE"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "0")
    train_utils.enable_flight_recorder(str(tmp_path / "snapshots"), nccl=True)
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "snapshots" / "nccl_trace_4242_rank_")
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0"
    # A user's setting under the deprecated names stays in force: torch prefers the
    # current name where both are set, so setting it would override the user's.
    for name in ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_FR_BUFFER_SIZE"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", str(tmp_path / "mine_"))
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "0")
    train_utils.enable_flight_recorder(str(tmp_path), nccl=True)
    assert "TORCH_FR_DUMP_TEMP_FILE" not in os.environ and "TORCH_FR_BUFFER_SIZE" not in os.environ


def test_a_rank_that_never_joins_at_start_up_gives_one_timeout_line(tmp_path):
    """srun's path (no torchrun rendezvous): rank 1 reaches the start-up store but
    never init_process_group; rank 0 waits there --startup_timeout_s and the store
    raises "wait timeout after 3000ms, keys: ...": one line, exit 1, no traceback."""
    import subprocess
    import sys

    from helpers import free_port

    port = free_port()
    stuck = subprocess.Popen([sys.executable, "-c", (
        "import datetime, time, torch.distributed as d\n"
        f"s = d.TCPStore('127.0.0.1', {port}, 2, is_master=False, timeout=datetime.timedelta(seconds=60))\n"
        "time.sleep(60)")])
    try:
        result = run([sys.executable, REPO / "train.py", "--startup_timeout_s", "3"], tmp_path,
                     timeout=120, SLURM_STEP_ID="0", SLURM_PROCID="0", SLURM_LOCALID="0",
                     SLURM_STEP_NUM_TASKS="2", SLURM_JOB_ID="1", SLURM_JOB_NODELIST="localhost",
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    finally:
        stuck.kill()
        stuck.wait()
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    [line] = error_lines(result.stderr)
    assert re.fullmatch(r"error: rank 0 timed out during start-up waiting for the other ranks to join the "
                        r"process group \(wait timeout after 3000ms, keys: \S+\)\. A rank that did not "
                        r"start, or failed before joining, holds up all: look at its output "
                        r"\(--startup_timeout_s sets the wait\)", line), line


def _side_group_worker(rank, port, out_dir):
    """Rank 1 joins the process group but never makes the side group, as an
    NCCL rank does that never arrives (NCCL's init_process_group waits for no
    one); rank 0 writes what its wait for the side group ended in."""
    import os
    import time

    import torch.distributed as dist

    from train_utils.distributed import timeouts

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    if rank == 1:
        os._exit(0)  # gone; the process group is left broken: no teardown
    start = time.monotonic()
    try:
        timeouts.watch_collectives(2)
        outcome = "made"
    except Exception as exc:  # noqa: BLE001 - what it is, is the finding
        outcome = f"{type(exc).__name__}: {exc}"
    with open(os.path.join(out_dir, "rank0.json"), "w") as f:
        json.dump({"outcome": outcome, "seconds": time.monotonic() - start}, f)
    os._exit(0)


def test_a_rank_that_never_makes_the_side_group_ends_in_the_start_up_timeout_line(tmp_path):
    """The side gloo group's wait is bounded by --startup_timeout_s (not gloo's
    30-minute default) and ends in the start-up time-out line of docs/runs.md,
    not in "gloo cannot set up its network" (GLOO_SOCKET_IFNAME)."""
    import torch.multiprocessing as mp

    from helpers import free_port

    mp.spawn(_side_group_worker, args=(free_port(), str(tmp_path)), nprocs=2)
    result = json.loads((tmp_path / "rank0.json").read_text())
    assert result["seconds"] < 10, result
    assert re.fullmatch(r"RanksStuck: rank 0 timed out during start-up waiting for the other ranks to join "
                        r"the process group \(wait timeout after 2000ms, keys: \S+\)\. A rank that did not "
                        r"start, or failed before joining, holds up all: look at its output "
                        r"\(--startup_timeout_s sets the wait\)", result["outcome"]), result


@pytest.mark.parametrize("text, timeout", [
    ("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 10000ms for recv "
     "operation to complete", True),
    ("wait timeout after 1800000ms, keys: /default_pg/0//cuda//0", True),
    ("[1] is setting up NCCL communicator and retrieving ncclUniqueId from [0] via c10d key-value store by key "
     "'0', but store->get('0') got error: wait timeout after 10000ms, keys: //worker/attempt_0/default_pg/0", True),
    ("The client socket has timed out after 3000ms while trying to connect to (10.0.0.1, 29500).", True),
    ("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE, NumelIn=1, "
     "NumelOut=1, Timeout(ms)=600000) ran for 600004 milliseconds before timing out.", True),
    ("[Rank 1] Work WorkNCCL(SeqNum=5, OpType=ALLREDUCE) timed out in blocking wait.", True),
    # NCCL's network errors: "timed out" in the text, but no time-out
    ("NCCL error in: ProcessGroupNCCL.cpp:2043, remote process exited or there was a network error, NCCL "
     "version 2.27.5\nncclRemoteError: A call failed possibly due to a network error or a remote process "
     "exiting prematurely.\nLast error:\nNET/Socket : Connect to 10.0.0.2<45013> failed : Connection timed out",
     False),
    ("Some NCCL operations have failed or timed out. Due to the asynchronous nature of CUDA kernels, subsequent "
     "GPU operations might run on corrupted/incomplete data.", False),
    ("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:4567", False),
])
def test_is_timeout_matches_time_outs_only(text, timeout):
    """A time-out gets the time-out diagnosis (which ranks did not arrive); an
    NCCL network error, whose text says "failed or timed out", does not."""
    import torch.distributed as dist

    from train_utils.distributed.timeouts import is_timeout

    for kind in (dist.DistBackendError, dist.DistStoreError, dist.DistNetworkError):
        assert is_timeout(kind(text)) == timeout, (kind, text)


CONFIG_ERROR_IN_A_GROUP = """
import atexit, sys
sys.path.insert(0, sys.argv[1])
import torch.distributed as dist
import train_utils
from common import ConfigError

atexit.register(lambda: print(f"group left at exit: {dist.is_initialized()}", flush=True))


@train_utils.one_line_errors
def main():
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=0, world_size=1)
    raise ConfigError("a bad flag, found after start-up")


main()
"""


def test_a_config_error_after_start_up_destroys_the_process_group(tmp_path):
    """Exit 2 with one line, and no process group left at exit (with NCCL one
    left over makes torch warn of a leak on every rank; gloo shows the mechanism)."""
    import sys

    from helpers import free_port

    (tmp_path / "bad.py").write_text(CONFIG_ERROR_IN_A_GROUP)
    result = run([sys.executable, "bad.py", REPO, free_port()], tmp_path, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert error_lines(result.stderr) == ["error: a bad flag, found after start-up"]
    assert "group left at exit: False" in result.stdout, result.stdout


PEER_GONE_AFTER_SIGTERM = """
import os, signal, sys
sys.path.insert(0, sys.argv[1])
import train_utils
from train_utils.loop.stop import note_stop_signals_only

@train_utils.one_line_errors
def main():
    train_utils.catch_stop_signals()
    note_stop_signals_only()  # training: a stop signal is noted, taken at a step
    os.kill(os.getpid(), signal.SIGTERM)  # the launcher's, while the rank waits in a collective
    raise RuntimeError("[pair.cc:545] Read error [127.0.0.1]:45487: Connection reset by peer")

main()
"""


def test_a_rank_whose_peer_died_ends_at_the_launchers_sigterm_even_if_it_came_first(tmp_path):
    """torchrun, seeing one rank die, sends SIGTERM to the others, which may
    reach a rank still blocked in the collective the dead rank left: noted as
    a stop signal. When that collective then fails (the peer gone), the rank
    ends at once, quietly, with SIGTERM's status, instead of waiting
    PEER_GONE_WAIT_S (10 s) for a SIGTERM that already came, which held up
    every restart by as long."""
    import sys

    (tmp_path / "peer_gone.py").write_text(PEER_GONE_AFTER_SIGTERM)
    result = run([sys.executable, "peer_gone.py", REPO], tmp_path, timeout=120)
    assert result.returncode == 128 + 15, (result.returncode, result.stderr[-2000:])
    assert error_lines(result.stderr) == [], result.stderr


ONE_PROCESS_STOP = """
import os, signal, sys
sys.path.insert(0, sys.argv[1])
import torch.distributed as dist
import train_utils

dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=0, world_size=1)
stop = train_utils.StopSignal()
before = stop.poll()
os.kill(os.getpid(), signal.SIGUSR1)
print(f"polls: {before} {stop.poll()}", flush=True)
stop.close()
dist.destroy_process_group()
"""


def test_one_process_stops_at_the_first_poll_after_its_signal(tmp_path):
    """With one process there is no one to agree with: the poll after the
    signal says stop, without the all-reduce that makes ranks learn of it one
    call late (a millisecond a step, docs/performance.md)."""
    import sys

    from helpers import free_port

    (tmp_path / "stop.py").write_text(ONE_PROCESS_STOP)
    result = check(run([sys.executable, "stop.py", REPO, free_port()], tmp_path, timeout=120))
    assert "polls: False True" in result.stdout, result.stdout
    assert "stopped by SIGUSR1 after this step on every rank" in result.stdout


def test_a_slow_runs_speed_is_printed_in_significant_digits_not_as_zero():
    """A GPT-2 step on a CPU takes minutes: its samples/s is a few
    thousandths, which one decimal printed as 0.0. Below 1 the speed keeps
    three significant digits, in the epoch line and the evaluation's alike."""
    from train_utils.logs.metrics import metrics_line

    slow = {"train_loss": 9.5, "val_loss": 9.4, "samples_per_s": 0.0041666, "tokens_per_s": 4.2666, "lr": 6e-4}
    epoch = metrics_line({"epoch": 1, "total_epochs": 1, **slow, "epoch_seconds": 2880.0})
    step = metrics_line({"epoch": 1, "total_epochs": 1, "step": 20, "total_steps": 100, **slow,
                         "interval_seconds": 2880.0})
    for line in (epoch, step):
        assert "| samples/s 0.00417 | tokens/s 4.3 |" in line, line
    assert EPOCH_LINE.match(epoch), epoch


def test_a_run_log_prints_the_parsable_line_and_writes_json(tmp_path, capsys, one_process_group):
    path = tmp_path / "m.jsonl"
    record = {"epoch": 3, "total_epochs": 10, "train_loss": 0.5, "samples_per_s": 1234.5,
              "epoch_seconds": 2.25, "val_loss": 0.25, "val_accuracy": 0.875}
    log = train_utils.RunLog(metrics_path=str(path))
    log.start(train_utils.RunConfig(metrics_path=str(path)).as_dict())
    log.log(record)
    log.log({"test_loss": 0.3, "test_accuracy": None})
    out = capsys.readouterr().out.splitlines()
    assert out[0] == ("epoch 3/10 | train_loss 0.500000 | val_loss 0.250000 | val_acc 0.8750 | "
                      "samples/s 1234.5 | epoch_s 2.25")
    assert EPOCH_LINE.match(out[0]) and TEST_LINE.match(out[1]) and out[1] == "test | loss 0.300000"
    start, *records = [json.loads(line) for line in path.read_text().splitlines()]
    # The run opens with its settings; every record says which run and when.
    assert start["event"] == "start" and start["config"]["dataset"] == "synthetic"
    stamp = {key: start[key] for key in ("run", "time", "resumed_from")}
    assert records == [{**record, **stamp, "time": records[0]["time"]},
                       {"test_loss": 0.3, "test_accuracy": None, **stamp, "time": records[1]["time"]}]
    assert start["time"] <= records[0]["time"] <= records[1]["time"] and stamp["resumed_from"] is None


def test_atomic_save_replaces_whole_files_and_leaves_no_temp(tmp_path):
    path = tmp_path / "snap.pt"
    atomic_save({"a": torch.arange(3)}, str(path))
    atomic_save({"a": torch.arange(5)}, str(path))
    assert torch.equal(torch.load(path, weights_only=True)["a"], torch.arange(5))
    assert [p.name for p in tmp_path.iterdir()] == ["snap.pt"]


def test_atomic_save_failure_keeps_the_old_file(tmp_path):
    path = tmp_path / "snap.pt"
    atomic_save({"a": torch.arange(3)}, str(path))

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        atomic_save({"a": Unpicklable()}, str(path))
    assert torch.equal(torch.load(path, weights_only=True)["a"], torch.arange(3))
    assert [p.name for p in tmp_path.iterdir()] == ["snap.pt"]




COMPILE_WORKERS_PROBE = r"""
import os, signal, sys, torch
sys.path.insert(0, sys.argv[1])
import train_utils
before = signal.pthread_sigmask(signal.SIG_BLOCK, [])
train_utils.compile_model(torch.nn.Linear(2, 2), True)
children = [int(pid) for pid in open(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read().split()]
masks = []
for pid in children:
    status = dict(line.split(":\t", 1) for line in open(f"/proc/{pid}/status").read().splitlines())
    masks.append(int(status["SigBlk"], 16))
print(len(children), all(mask >> (s - 1) & 1 for mask in masks for s in (10, 15, 2)),
      signal.pthread_sigmask(signal.SIG_BLOCK, []) == before)
os._exit(0)
"""


def test_compile_workers_start_with_the_stop_signals_blocked(tmp_path):
    """torchrun signals a rank's whole process group: inductor's compile
    workers must not die of a stop signal meant for the rank. compile_model
    starts them with SIGUSR1, SIGTERM and SIGINT blocked (a mask its workers
    inherit), and leaves the rank's own mask as it was."""
    import subprocess
    import sys

    from helpers import REPO, script_env

    result = subprocess.run([sys.executable, "-c", COMPILE_WORKERS_PROBE, str(REPO)], capture_output=True,
                            text=True, timeout=300, cwd=tmp_path,
                            env=script_env(TORCHINDUCTOR_COMPILE_THREADS="2"))
    assert result.returncode == 0, result.stderr[-3000:]
    children, all_blocked, own_mask_kept = result.stdout.split()[-3:]
    assert int(children) >= 1 and all_blocked == "True" and own_mask_kept == "True", result.stdout


def test_first_host_of_a_slurm_hostlist():
    assert first_host("ddp-node[1-2]") == "ddp-node1"
    assert first_host("gpu[07-09,12],cpu1") == "gpu07"
    assert first_host("a,b") == "a"
    assert first_host("rack[2-3]-n[4,6]") == "rack2-n4"


@pytest.mark.parametrize("backend, device_ids", [("nccl", [3]), ("gloo", None)])
def test_the_kits_barrier_names_its_gpu_under_nccl(monkeypatch, backend, device_ids):
    # Without device_ids, an NCCL barrier guesses the GPU and warns on every rank.
    from train_utils.distributed import launch
    calls = []
    monkeypatch.setattr(launch.dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(launch.torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(launch.dist, "barrier", lambda **kwargs: calls.append(kwargs))
    launch.barrier()
    assert calls == [{"device_ids": device_ids}]


GLOO_AVG_SCRIPT = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
out = torch.zeros(1)
dist.reduce_scatter_tensor(out, torch.full((2,), 1.0 + dist.get_rank()), op=dist.ReduceOp.AVG)
if dist.get_rank() == 0:
    print(f"result {out.item()}")
dist.destroy_process_group()
"""


def test_gloo_averages_in_reduce_scatter_exactly_from_the_release_the_fsdp_refusal_names(tmp_path):
    # FSDP2 averages gradients with reduce_scatter_tensor(op=AVG); ranks give 1 and 2:
    # the average is 1.5, a sum 3. train_utils.check_fsdp_backend refuses gloo below
    # GLOO_AVG_REDUCE_SCATTER: that must be exactly where this torch's gloo sums.
    (tmp_path / "avg.py").write_text(GLOO_AVG_SCRIPT)
    result = check(run(TORCHRUN + ["--standalone", "--nproc_per_node=2", "avg.py"], tmp_path, timeout=120))
    measured = float(re.search(r"^result (\S+)$", result.stdout, re.M).group(1))
    averages = torch_version() >= GLOO_AVG_REDUCE_SCATTER
    assert measured == (1.5 if averages else 3.0), (torch.__version__, measured)


def test_fsdp_on_gloo_is_refused_in_one_line_where_gloo_sums(tmp_path):
    if torch_version() >= GLOO_AVG_REDUCE_SCATTER:
        pytest.skip(f"torch {torch.__version__}'s gloo averages: FSDP trains on the CPU (tests/test_fsdp.py)")
    result = run(TORCHRUN + ["--standalone", "--nproc_per_node=2", REPO / "train.py", "--strategy", "fsdp"], tmp_path,
                 timeout=120)
    assert result.returncode != 0
    assert error_lines(result.stderr) == [
        f"error: FSDP on the CPU (gloo) needs torch 2.10 or newer: torch {torch.__version__}'s gloo sums "
        f"where FSDP averages gradients; pip install 'torch>=2.10', or train on GPUs"]
    assert "Root Cause" in result.stderr and "FSDP on the CPU (gloo) needs torch 2.10" in result.stderr
    assert not list(tmp_path.iterdir())  # refused before anything was written


def test_older_torch_than_tested_gets_a_one_line_note(monkeypatch, one_process_group):
    config = train_utils.RunConfig(batch_size=32)
    plain = train_utils.describe_run(torch.device("cpu"), config)
    monkeypatch.setattr(torch, "__version__", "2.7.1+cpu")
    assert train_utils.describe_run(torch.device("cpu"), config).splitlines() == [
        "note: torch 2.7.1+cpu is untested here (oldest tested: torch 2.8); older ones can hang at exit, "
        "see docs/install.md", *plain.splitlines()]


def test_loader_workers_ignore_the_stop_signals():
    """torchrun signals a rank's whole process group, Slurm every process of a
    step: a DataLoader worker started with ignore_stop_signal ignores SIGUSR1,
    SIGTERM and SIGINT (the rank decides when to stop), read from the kernel's
    record of the worker's ignored signals."""
    import os

    class Pids(torch.utils.data.Dataset):
        def __len__(self):
            return 1

        def __getitem__(self, index):
            return os.getpid()

    loader = torch.utils.data.DataLoader(Pids(), num_workers=1, worker_init_fn=ignore_stop_signal,
                                         persistent_workers=True)
    iterator = iter(loader)
    worker = int(next(iterator))
    status = dict(line.split(":\t", 1) for line in open(f"/proc/{worker}/status").read().splitlines())
    ignored = int(status["SigIgn"], 16)
    del iterator
    assert worker != os.getpid()
    assert [signum for signum in STOP_SIGNALS if not ignored >> (signum - 1) & 1] == []


def test_the_epoch_record_counts_the_samples_trained(one_process_group):
    """``samples`` is what the epoch trained on, the part carried over a
    mid-epoch resume included: full batches only, so a training split that
    batches do not divide trains fewer samples than it holds. (One rank: the
    totals summed over every rank are its own.)"""
    evaluations = train_utils.Evaluations(0, 10, 1, torch.device("cpu"))
    for _ in range(3):
        evaluations.add(torch.tensor(0.5), 32)
    assert evaluations.summary()["samples"] == 96
    resumed = train_utils.Evaluations(0, 10, 1, torch.device("cpu"))
    resumed.load_state_dict({"epoch_totals": torch.tensor([10.0, 64.0], dtype=torch.float64)})
    resumed.add(torch.tensor(0.5), 32)
    summary = resumed.summary()
    assert summary["samples"] == 96 and isinstance(summary["samples"], int)
    assert summary["train_loss"] == pytest.approx((10 + 16) / 96)
    assert summary["samples_per_s"] > 0 and "epoch_seconds" in summary


# --------------------------------------------------------------------------
# Snapshots written in the background: the copy, the writer, the clock
# --------------------------------------------------------------------------

def test_the_cpu_copy_is_the_state_as_it_was_when_copied():
    """Training goes on changing the weights and optimizer buffers while the
    copy is written: the copy keeps their values (and a state dict's
    _metadata, which load_state_dict reads)."""
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "steps": [1, (2, "x")]}
    copy = cpu_copy(state)
    before = {key: value.clone() for key, value in model.state_dict().items()}
    momentum = optimizer.state_dict()["state"][0]["momentum_buffer"].clone()
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()  # changes the weights and the momentum in place
    assert all(torch.equal(copy["model"][key], value) for key, value in before.items())
    assert torch.equal(copy["optimizer"]["state"][0]["momentum_buffer"], momentum)
    assert not torch.equal(model.weight, copy["model"]["weight"])
    assert copy["model"]._metadata == model.state_dict()._metadata and copy["steps"] == [1, (2, "x")]
    torch.nn.Linear(3, 2).load_state_dict(copy["model"])


def test_the_background_writer_runs_one_write_at_a_time_and_raises_its_error_at_the_next_wait():
    """A write runs while the caller goes on; the next start waits for it
    (never two at once); its exception comes back in the caller's thread at
    the next wait, and only once."""
    import threading

    release, events = threading.Event(), []

    def slow() -> None:
        release.wait(60)
        events.append("slow done")

    writer = SnapshotWriter(asynchronous=True)
    assert writer.start(slow, "first") is None
    assert writer.in_flight and events == []  # start returned while the write is held
    events.append("caller went on")
    threading.Timer(0.2, release.set).start()
    assert writer.start(lambda: events.append("second"), "second") == "first"  # waited for the first
    assert writer.wait() == "second" and events == ["caller went on", "slow done", "second"]

    def full_disk() -> None:
        raise OSError(28, "No space left on device")

    writer.start(full_disk, "third")
    with pytest.raises(OSError, match="No space left"):
        writer.wait()
    assert writer.wait() is None and not writer.in_flight
    synchronous = SnapshotWriter(asynchronous=False)
    synchronous.start(lambda: events.append("inline"), "fourth")
    assert events[-1] == "inline" and synchronous.wait() == "fourth"


def test_the_snapshot_clock_asks_once_per_interval_and_once_per_request():
    """--snapshot_every_s: rank 0's answer reaches every rank one poll later;
    one request makes one snapshot even when the interval is shorter than a
    step (a very short one snapshots every other step), the interval counts
    from the last snapshot, and a request that a snapshot overtook (at an
    epoch's end) is dropped."""
    now = [0.0]
    clock = SnapshotClock(60, clock=lambda: now[0])
    asks = []
    for second in (10, 59, 60, 61, 62):
        now[0] = second
        asks.append(clock.ask())
    assert asks == [False, False, True, False, True]  # 61: the answer to 60's request is being read
    assert clock.due(True)  # the answer to 60's request: every rank snapshots
    clock.saved()  # the snapshot came at 62
    now[0] = 121
    assert not clock.ask() and not clock.ask()
    now[0] = 122
    assert clock.ask()
    clock.saved()  # an epoch's end snapshot after the request was sent, before its answer came
    assert not clock.due(True) and not clock.ask()  # dropped; the interval counts from 122
    assert clock.due(True)  # a request answered with no snapshot between: taken
    ticks = iter(range(100))  # each reading of the clock a step later
    tiny = SnapshotClock(1e-9, clock=lambda: next(ticks))
    asks = [tiny.ask() for _ in range(6)]
    assert asks == [True, False, True, False, True, False]
    assert not any(SnapshotClock(0, clock=lambda: 1e9).ask() for _ in range(3))


@pytest.mark.parametrize("kind, zero, text, message", [
    (int, False, "x", "expected an int, got 'x'"),
    (int, True, "x", "expected an int, got 'x'"),
    (float, False, "x", "expected a float, got 'x'"),
    (int, False, "0", "must be > 0, got 0"),
    (float, False, "nan", "must be > 0, got nan"),
    (int, True, "-1", "must be >= 0, got -1"),
    (float, True, "inf", "must be >= 0 and finite, got inf"),
    (float, True, "nan", "must be >= 0 and finite, got nan"),
])
def test_a_flags_bad_number_is_named_in_plain_words(kind, zero, text, message):
    """train.py's number flags (train_utils.cli.positive): the usage error says
    what was expected and what came; good values pass through."""
    import argparse

    from train_utils.config import positive

    with pytest.raises(argparse.ArgumentTypeError) as info:
        positive(kind, zero)(text)
    assert str(info.value) == message
    assert positive(kind, zero)("3") == 3 and positive(kind, True)("0") == 0


def test_hsdp_shard_size_defaults_to_a_node_and_must_divide_the_world():
    """--strategy hsdp shards over a node's ranks unless --shard_size says
    otherwise; a size that does not divide world_size, or --shard_size
    without hsdp, is one line naming the fix. srun's tasks per node give a
    node's ranks where torchrun's LOCAL_WORLD_SIZE is absent."""
    from train_utils.config import hsdp_shard_size
    from train_utils.distributed.launch import tasks_per_node

    assert hsdp_shard_size("hsdp", 0, 8, 4) == 4 and hsdp_shard_size("hsdp", 2, 8, 4) == 2
    assert hsdp_shard_size("fsdp", 0, 8, 4) == 0 and hsdp_shard_size("ddp", 0, 8, 4) == 0
    with pytest.raises(ConfigError, match=r"^--shard_size 3 does not divide world_size 8; pass a --shard_size "
                                          r"that divides it \(e\.g\. 1\)$"):
        hsdp_shard_size("hsdp", 3, 8, 4)
    with pytest.raises(ConfigError, match=r"^--shard_size's default, the 4 ranks of one node, does not "
                                          r"divide world_size 6; "):
        hsdp_shard_size("hsdp", 0, 6, 4)
    with pytest.raises(ConfigError, match=r"^--shard_size 2 applies to --strategy hsdp only; "):
        hsdp_shard_size("fsdp", 2, 8, 4)
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1] and tasks_per_node("4") == [4]
    assert tasks_per_node("") == [] and tasks_per_node("2(x") == []
