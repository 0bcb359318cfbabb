"""The training machinery the scripts share, which you keep as it is.

The scripts show each rung's distributed concept; what is right but not the
lesson lives here, one well-named call each: the command line, device choice,
the epoch's bookkeeping and progress bar, atomic saves, the stop that every
rank takes at the same step, the resumable sampler, RNG capture and restore,
the up-front checks, the metrics line, and a fault-injection hook for the
tests. Your own datasets, model and loss go in common.py, not here.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import glob
import itertools
import json
import math
import os
import re
import signal
import socket
import sys
import tempfile
import time
import warnings
from datetime import timedelta
from typing import Callable, Iterable, Iterator, Optional

import torch
import torch.distributed as dist
# Imported before any process group exists, on purpose: torch.distributed.nn
# binds group.WORLD into its functions' default arguments at import time, and
# DDP imports it lazily. Imported after init_process_group, it would keep the
# process group alive past destroy_process_group, its gloo threads still
# running at interpreter exit, where the process then sometimes aborts
# ("terminate called without an active exception") after a successful run.
import torch.distributed.nn  # noqa: F401
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm


class ConfigError(Exception):
    """A mistake in the user's input or environment (bad flag, missing data,
    incompatible snapshot). The scripts print it as one line and exit 2,
    without a traceback."""


class NothingToTrain(Exception):
    """The snapshot already holds every epoch asked for: not an error, one
    line on stdout and exit status 0."""


def report_to_torchrun(line: str) -> None:
    """Make ``line`` the root cause torchrun prints when this worker fails.

    torchrun gives each worker an error file (TORCHELASTIC_ERROR_FILE); what a
    failed worker wrote there is shown in its "Root Cause" summary instead of
    "To enable traceback see ...". The JSON layout is the one of torch's own
    ``torch.distributed.elastic.multiprocessing.errors.ErrorHandler``. Nothing
    happens outside torchrun.
    """
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    with contextlib.suppress(OSError), open(path, "w") as f:
        json.dump({"message": {"message": line, "extraInfo": {
            "py_callstack": line, "timestamp": str(int(time.time()))}}}, f)


def exit_on_config_error(fn: Callable) -> Callable:
    """Decorator for a script's ``main``: a ConfigError becomes one line on
    stderr (``error: ...``), torchrun's root cause, and exit status 2, without
    a traceback; NothingToTrain becomes one line on stdout and exit status 0.

    Under a process group only rank 0 prints, since such errors are raised on
    every rank alike (see ``downloaders_first``); the other ranks exit quietly.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except NothingToTrain as done:
            if not _is_distributed() or dist.get_rank() == 0:
                say(str(done))
            if _is_distributed():
                dist.destroy_process_group()
            sys.exit(0)
        except ConfigError as exc:
            if not _is_distributed() or dist.get_rank() == 0:
                say(f"error: {exc}", sys.stderr)
            # Every rank gives torchrun the line: it names the failure with the
            # smallest timestamp (whole seconds) as the root cause, and on a
            # busy machine a quiet rank can get there before rank 0.
            report_to_torchrun(f"error: {exc}")
            sys.exit(2)
        except RuntimeError as exc:  # torch's DistBackendError is one
            if not (_is_distributed() and "timed out" in str(exc).lower()):
                raise
            line = timeout_diagnosis(exc)
            if line:
                say(f"error: {line}", sys.stderr)
                report_to_torchrun(f"error: {line}")
            # The process group is broken now: leave without tearing it down.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)

    return wrapper


# Where this process is, for the message of a collective that timed out.
_PHASE = ["start-up (before the first training step)"]
_MONITOR: dict = {}  # "group": a gloo group kept for timeout_diagnosis


def timeout_diagnosis(exc: BaseException) -> str:
    """The one-line error for a collective that timed out on this rank, or ''
    when another rank reports it.

    Rank 0 runs ``dist.monitored_barrier`` (gloo, ``wait_all_ranks``) on a
    side group made at start-up, which names the ranks that do not arrive
    within 10 s: those are stuck or dead. Another rank reports only when rank
    0 itself does not answer.
    """
    rank, group = dist.get_rank(), _MONITOR.get("group")
    detail = str(exc).strip().splitlines()[-1].split("] ")[-1]
    missing = "unknown (no monitor group)"
    if group is not None:
        try:
            dist.monitored_barrier(group=group, timeout=timedelta(seconds=10), wait_all_ranks=True)
            missing = "none (all arrived later: raise --pg_timeout_s)"
        except RuntimeError as barrier:
            found = re.search(r"Ranks? ([\d, ]+) failed to pass", str(barrier))
            if rank != 0:
                return (f"rank {rank} timed out in a collective during {_PHASE[0]} ({detail}), "
                        f"and rank 0 does not answer: look at rank 0's output")
            missing = f"[{found.group(1)}]" if found else str(barrier).splitlines()[0]
    if rank != 0:
        return ""
    return (f"rank 0 timed out waiting for the other ranks in a collective during {_PHASE[0]} "
            f"({detail}); ranks that did not arrive: {missing}. A rank that is stuck or died "
            f"holds up all: look at its output (--pg_timeout_s sets the wait)")


def watch_collectives() -> None:
    """Collective, once before training: make the gloo group that
    ``timeout_diagnosis`` uses (NCCL's own diagnostics are switched on by
    ``device_for``, before the process group exists)."""
    if _is_distributed() and "group" not in _MONITOR:
        _MONITOR["group"] = gloo_group()


def training_timeout(args: argparse.Namespace) -> None:
    """From now on a collective may wait --pg_timeout_s seconds (start-up had
    --startup_timeout_s): called after the first training step, when
    downloads and compilation are done. Sets it on every process group."""
    if not _is_distributed() or getattr(args, "pg_timeout_s", None) is None:
        return
    timeout = timedelta(seconds=args.pg_timeout_s)
    # torch.distributed.set_timeout (in 2.15, not in 2.10) replaced the private _set_pg_timeout.
    # gloo before torch 2.10 ignores both and keeps the start-up timeout (docs/install.md).
    set_timeout = getattr(dist, "set_timeout", None) or dist.distributed_c10d._set_pg_timeout
    set_timeout(timeout)  # the default group
    if "group" in _MONITOR:
        set_timeout(timeout, _MONITOR["group"])


def _is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


# --------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------

def positive(kind: type) -> Callable[[str], object]:
    """argparse type: a ``kind`` (int or float) > 0, else a one-line usage error."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got {text!r}")
        if not value > 0:  # also rejects NaN
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    return parse


def non_negative_int(text: str) -> int:
    """argparse type: an int >= 0, else a one-line usage error."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int, got {text!r}")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


# The flags only some scripts take: name -> (argparse type, default, help).
SCRIPT_FLAGS = {
    "checkpoint_path": (str, "checkpoint.pt", "where to save the model's state_dict"),
    "world_size": (positive(int), None, "processes to start (default: the number of GPUs, "
                                        "or 2 on a machine without GPUs)"),
    "snapshot_path": (str, "snapshot.pt", "snapshot to resume from when it exists, and to save to"),
    "snapshot_every_steps": (non_negative_int, 0, "also snapshot every N steps inside an epoch, "
                                                  "so a restart loses at most N steps (0: only "
                                                  "at epoch ends)"),
    "pg_timeout_s": (positive(float), 600, "once training runs, seconds a collective may wait "
                                           "for the other ranks before the job fails, naming "
                                           "the ranks that did not arrive"),
    "startup_timeout_s": (positive(float), 1800, "the same during start-up and the first training "
                                                 "step (downloads, compilation)"),
}


class _OneRankParser(argparse.ArgumentParser):
    """An ArgumentParser that, under torchrun, prints usage, help and errors
    from rank 0 only (every rank parses the same command line), and makes the
    error torchrun's root cause. Exit status 2 on an error, as argparse's."""

    def _print_message(self, message, file=None) -> None:
        if os.environ.get("RANK", "0") == "0":
            super()._print_message(message, file)

    def error(self, message: str):
        report_to_torchrun(f"error: {message}")  # every rank: see exit_on_config_error
        super().error(message)


def _task_name(tasks: tuple) -> Callable[[str], str]:
    """argparse type for --dataset: one of ``tasks``, or a ``module:function``."""

    def parse(text: str) -> str:
        if text in tasks or (":" in text and all(text.split(":", 1))):
            return text
        raise argparse.ArgumentTypeError(
            f"invalid choice: {text!r} (choose from {', '.join(tasks)}, or module:function)")

    return parse


def parse_args(description: Optional[str], tasks: Iterable[str],
               script_flags: Iterable[str] = ()) -> argparse.Namespace:
    """Parse the command line: the flags every script shares, in the same
    order everywhere, then the ``script_flags`` (names of ``SCRIPT_FLAGS``).

    ``tasks`` are the names ``--dataset`` accepts (``common.TASKS``); a
    ``module:function`` (your own task, see docs/custom-task.md) is accepted
    too. Invalid values (zero or negative epochs, batch size, lr, save
    interval; an unknown dataset) end with argparse's usage line and exit 2.
    """
    tasks = tuple(tasks)
    parser = _OneRankParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--total_epochs", type=positive(int), default=10, help="epochs to train (default: 10)")
    add("--save_every", type=positive(int), default=5,
        help="save every N epochs; the last epoch is always saved (default: 5)")
    add("--batch_size", type=positive(int), default=32,
        help="samples per step *per process*; the global batch size is "
             "batch_size x grad_accum_steps x world_size (default: 32)")
    add("--lr", type=positive(float), default=0.05, help="learning rate (default: 0.05)")
    add("--dataset", type=_task_name(tasks), default=tasks[0],
        help=f"task to train: {', '.join(tasks)}, or module:function for your own "
             f"(default: {tasks[0]}, needs no download)")
    add("--model", default=None, help="model for the task (default: the task's first)")
    add("--data_dir", default=os.environ.get("DATA_DIR", "data"),
        help="dataset root, as torchvision expects it (default: $DATA_DIR or ./data)")
    add("--seed", type=int, default=0, help="seed for data split, model init, shuffling (default: 0)")
    add("--num_workers", type=non_negative_int, default=0,
        help="DataLoader worker processes per training process (default: 0)")
    add("--metrics_path", default=None,
        help="also write each epoch's summary as one JSON object per line here")
    add("--tensorboard_dir", default=None,
        help="also write each epoch's figures for TensorBoard here (needs: pip install tensorboard)")
    add("--input_path", choices=("fast", "torchvision"), default="fast",
        help="mnist/cifar10 input: 'fast' holds decoded uint8 images in memory and augments "
             "whole batches on the device; 'torchvision' is the per-sample Dataset + "
             "transforms path (default: fast)")
    add("--amp", action="store_true",
        help="bf16 autocast for the training forward pass (CUDA; on a CPU only where it "
             "was measured to help, see docs/performance.md)")
    add("--compile", action="store_true",
        help="torch.compile the training model (saved weights stay loadable without it)")
    add("--grad_accum_steps", type=positive(int), default=1,
        help="micro-batches of --batch_size per optimizer step (default: 1)")
    _add_script_flags(parser, list(script_flags))
    return parser.parse_args()


def _add_script_flags(parser: argparse.ArgumentParser, names: list) -> None:
    """Add the ``SCRIPT_FLAGS`` called ``names`` (--pg_timeout_s brings --startup_timeout_s)."""
    if "pg_timeout_s" in names:  # the two timeouts go together
        names.append("startup_timeout_s")
    for name in names:
        kind, default, text = SCRIPT_FLAGS[name]
        parser.add_argument(f"--{name}", type=kind, default=default,
                            help=text + (f" (default: {default})" if default is not None else ""))


# --------------------------------------------------------------------------
# Devices and launching
# --------------------------------------------------------------------------

def device_for(local_rank: int) -> torch.device:
    """This process's device: ``cuda:local_rank`` where CUDA works, else the CPU.

    Raises ConfigError when CUDA works but ``local_rank`` has no GPU of its
    own on this node (more processes than visible GPUs). On CUDA it also
    switches on NCCL's diagnostics (``enable_nccl_diagnostics``).
    """
    if not torch.cuda.is_available():
        return torch.device("cpu")
    enable_nccl_diagnostics()
    visible = torch.cuda.device_count()
    if local_rank >= visible:
        raise ConfigError(
            f"local rank {local_rank} needs GPU {local_rank}, but this node shows only {visible} "
            f"GPU(s) (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); "
            f"start at most {visible} processes per node (--nproc_per_node={visible})")
    return torch.device("cuda", local_rank)


# NCCL's own diagnosis of a stuck collective, on unless the environment says
# otherwise (torch's names, documented in docs/fault-tolerance.md): the
# watchdog aborts a timed-out collective instead of hanging, the flight
# recorder keeps the last collectives of each rank, and a timeout dumps them
# (to /tmp/nccl_trace_rank_<rank>, TORCH_NCCL_DEBUG_INFO_TEMP_FILE).
NCCL_DIAGNOSTICS = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_FR_BUFFER_SIZE": "2000",
                    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}


def enable_nccl_diagnostics() -> None:
    """Set ``NCCL_DIAGNOSTICS`` where the environment does not: before
    ``init_process_group``, which reads them."""
    for name, value in NCCL_DIAGNOSTICS.items():
        os.environ.setdefault(name, value)


def unusable_gpu_reason() -> Optional[str]:
    """Why this machine's NVIDIA GPUs go unused, or None.

    Where GPU device files exist (/dev/nvidia0, ...) but this torch build cannot
    use them (a CPU-only build, or a driver older than the build needs), the
    scripts would silently train on the CPU; this returns torch's own reason.
    """
    if not glob.glob("/dev/nvidia[0-9]*"):
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if torch.cuda.is_available():
            return None
    reasons = [str(w.message).strip().splitlines()[0] for w in caught]
    if torch.version.cuda is None:
        reasons.append(f"torch {torch.__version__} is a CPU-only build")
    return "; ".join(reasons) or "torch.cuda.is_available() is False"


# The oldest torch the scripts are tested on (requirements-oldest.txt). Older ones
# can hang at the exit of a finished run (gloo teardown, fixed in 2.8); see docs/install.md.
OLDEST_TORCH = (2, 8)
# The first torch whose gloo averages in reduce_scatter(ReduceOp.AVG); older ones sum.
GLOO_AVG_REDUCE_SCATTER = (2, 10)


def torch_version() -> tuple[int, int]:
    """(major, minor) of the installed torch, e.g. (2, 8) for "2.8.0+cu128"."""
    major, minor = re.match(r"(\d+)\.(\d+)", torch.__version__).groups()
    return int(major), int(minor)


def check_fsdp_backend() -> None:
    """FSDP2 averages gradients with reduce_scatter(ReduceOp.AVG), which gloo
    before torch 2.10 sums (measured by tests/test_train_utils.py): on the CPU
    the gradients would come out world_size times too large. Refused there."""
    if dist.get_backend() == "gloo" and torch_version() < GLOO_AVG_REDUCE_SCATTER:
        raise ConfigError(f"FSDP on the CPU (gloo) needs torch 2.10 or newer: torch {torch.__version__}'s "
                          f"gloo sums where FSDP averages gradients; pip install 'torch>=2.10', or train on GPUs")


def run_line(device: torch.device, args: argparse.Namespace) -> str:
    """The start-up line: what runs where, and the global batch size.

    E.g. ``device cpu | backend gloo | world_size 2 | global batch size 64 =
    batch_size 32 x grad_accum_steps 1 x world_size 2``; preceded by a
    ``note:`` line when GPUs are present but unusable (``unusable_gpu_reason``),
    and one when torch is older than ``OLDEST_TORCH``.
    """
    world_size = dist.get_world_size() if _is_distributed() else 1
    backend = dist.get_backend() if _is_distributed() else "none"
    name = f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""
    line = (f"device {device}{name} | backend {backend} | world_size {world_size} | global batch "
            f"size {args.batch_size * args.grad_accum_steps * world_size} = batch_size "
            f"{args.batch_size} x grad_accum_steps {args.grad_accum_steps} x world_size {world_size}")
    reason = unusable_gpu_reason() if device.type == "cpu" else None
    if reason:
        line = (f"note: this machine has NVIDIA GPUs, but torch cannot use them ({reason}); "
                f"training on the CPU. Install the torch build that matches your driver\n" + line)
    if torch_version() < OLDEST_TORCH:
        line = (f"note: torch {torch.__version__} is untested here (oldest tested: torch "
                f"{'.'.join(map(str, OLDEST_TORCH))}); older ones can hang at exit, see docs/install.md\n" + line)
    return line


def usable_cpus() -> int:
    """CPU cores this process may run on: its affinity mask (what Slurm, a
    cgroup cpuset or taskset grant), not the machine's count."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def spawn_world_size(requested: Optional[int]) -> int:
    """How many processes multigpu_spawn.py starts: ``requested``, or one per
    GPU, or 2 on a machine without GPUs. More processes than GPUs exits with
    one line and status 2, like the other input errors; more processes than
    usable CPU cores on a CPU-only machine runs, with a one-line warning."""
    gpus = torch.cuda.device_count()
    world_size = requested or gpus or 2
    if gpus and world_size > gpus:  # one process per GPU
        say(f"error: --world_size {world_size} is more than the {gpus} GPUs of this machine",
            sys.stderr)
        sys.exit(2)
    cpus = usable_cpus()
    if not gpus and world_size > cpus:
        say(f"warning: {world_size} processes share {cpus} usable CPU cores; each runs slower, "
            f"the results are the same", sys.stderr)
    return world_size


def share_cpu_cores(device: torch.device, world_size: int) -> None:
    """On a CPU ``device``, give each of ``world_size`` processes its share of
    the usable cores' intra-op threads (unless OMP_NUM_THREADS says
    otherwise), instead of each process using all of them. Nothing on a GPU."""
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, usable_cpus() // world_size))


def check_port_free(port: int) -> None:
    """Exit with one line when something on this machine already listens on
    TCP ``port`` (any address): the process group could not start there."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the store does
        try:
            probe.bind(("", port))
            return
        except OSError:
            pass
    sys.exit(f"error: MASTER_PORT {port} is already in use on this machine (another job?); "
             f"set the MASTER_PORT environment variable to a free port, "
             f"e.g. MASTER_PORT={port + 1} python multigpu_spawn.py")


def first_host(nodelist: str) -> str:
    """The first host of a Slurm hostlist expression (``SLURM_JOB_NODELIST``):
    ``gpu[07-09,12],cpu1`` gives ``gpu07``, what ``scontrol show hostnames``
    prints first (syntax: Slurm's hostlist, man scontrol)."""
    first = re.match(r"[^,\[]*(?:\[[^\]]*\][^,\[]*)*", nodelist).group(0)
    return re.sub(r"\[([^\]\-,]*)[^\]]*\]", r"\1", first)


def launcher_store(timeout: timedelta) -> dist.Store:
    """The key-value store for ``init_process_group`` under either launcher.

    torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT.
    srun with one task per GPU (no torchrun; the launch of Mila's, Lightning's
    and submitit's cluster docs) sets SLURM_PROCID, SLURM_LOCALID and
    SLURM_STEP_NUM_TASKS: they become RANK, LOCAL_RANK and WORLD_SIZE here, and
    the rendezvous is the job's first host at port 15000 + job id % 15000
    (what slurm/multi_node.sh derives too) unless MASTER_ADDR/MASTER_PORT are
    set. Rank 0 then hosts the store.

    torchrun's agent keeps one store at MASTER_ADDR:MASTER_PORT across
    restarts. Each attempt gets its own key prefix
    (``attempt_<TORCHELASTIC_RESTART_COUNT>``): without it a restarted rank can
    read the addresses its failed predecessor left there, then fail or hang
    connecting (seen with torch 2.15); ``init_method="env://"`` does not do this.
    Raises ConfigError when started by neither launcher.
    """
    if "RANK" not in os.environ and "SLURM_STEP_ID" in os.environ:  # a task of an srun step
        env = os.environ
        env.update(RANK=env["SLURM_PROCID"], LOCAL_RANK=env["SLURM_LOCALID"],
                   WORLD_SIZE=env.get("SLURM_STEP_NUM_TASKS") or env["SLURM_NTASKS"])
        if "MASTER_ADDR" not in env:
            env["MASTER_ADDR"] = first_host(env.get("SLURM_STEP_NODELIST") or env["SLURM_JOB_NODELIST"])
        if "MASTER_PORT" not in env:
            env["MASTER_PORT"] = str(15000 + int(env["SLURM_JOB_ID"]) % 15000)
    if "RANK" not in os.environ:
        script = os.path.basename(sys.argv[0])
        raise ConfigError(f"start this script with torchrun (torchrun --standalone "
                          f"--nproc_per_node=gpu {script}; --nproc_per_node=2 on a CPU) or with "
                          f"srun, one task per GPU (srun --ntasks-per-node=GPUS python {script})")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=rank == 0 and not agent_hosts_store, timeout=timeout)
    return dist.PrefixStore(f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


# --------------------------------------------------------------------------
# Before training: data first on the downloading ranks, then checks
# --------------------------------------------------------------------------

def first_error(error: str) -> str:
    """The first non-empty error of any rank ('' if none); a collective
    (an all-gather) under a process group, a no-op without one."""
    if _is_distributed():
        errors: list = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        error = next((e for e in errors if e), "")
    return error


def downloaders_first(load: Callable[..., object], args: argparse.Namespace, download: bool):
    """``load(args, download=True)`` on the processes with ``download``, then,
    once they are done, ``load(args, download=False)`` on the others; returns
    the result.

    Collective under a process group: the all-gather of errors is the barrier
    at which the others wait, and a ConfigError on any rank (a failed
    download, say) is raised on every rank, instead of leaving them hanging
    at the next collective.
    """
    result, error = None, ""
    for turn in (True, False):
        if download == turn and not error:
            try:
                result = load(args, download=download)
            except ConfigError as exc:
                error = str(exc)
        error = first_error(error)
    if error:
        raise ConfigError(error)
    return result


# Flags that may differ between processes of one job (node-local paths, CPU
# counts, what rank 0 alone writes); every other flag must be the same everywhere.
PER_PROCESS_FLAGS = ("data_dir", "num_workers", "metrics_path", "tensorboard_dir", "snapshot_path",
                     "checkpoint_path")


def check_same_settings(args: argparse.Namespace) -> None:
    """Collective: raise ConfigError (one line, on every rank) when the ranks
    were started with different values of a flag outside ``PER_PROCESS_FLAGS``,
    naming the flag and who has which value. Without it, a different
    --batch_size on one node fails later with a collective mismatch (gloo) or
    a hang (NCCL)."""
    if not _is_distributed():
        return
    mine = {key: value for key, value in vars(args).items() if key not in PER_PROCESS_FLAGS}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    for key in mine:
        values: dict = {}
        for rank, settings in enumerate(everyone):
            values.setdefault(repr(settings.get(key)), []).append(rank)
        if len(values) > 1:
            who = ", ".join(f"{value} on ranks {ranks}" for value, ranks in values.items())
            raise ConfigError(f"ranks disagree on --{key}: {who}; start every process with the "
                              f"same arguments")


def _folder_error(path: str) -> str:
    """'' when ``path``'s folder exists (made if missing) and takes new files,
    else why not. ``path`` itself is never touched."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        return f"folder {folder} is not writable ({exc.strerror or type(exc).__name__})"
    return ""


def check_run(args: argparse.Namespace, device: torch.device, train_data: DataLoader,
              save_path: str, saves: bool) -> None:
    """Everything that would fail later, checked before any training.

    Every rank got the same settings (``check_same_settings``); --amp where
    it would slow training down (``check_amp``); a training loader with fewer
    batches than one optimizer step needs; --snapshot_every_steps not a
    multiple of --grad_accum_steps; and, on the processes that ``saves``,
    the folders of ``save_path``, --metrics_path and --tensorboard_dir take
    files (missing ones are created), and tensorboard imports where asked for.
    Collective under a process group. Raises ConfigError (one line).
    """
    check_same_settings(args)
    watch_collectives()
    check_amp(args.amp, device, args.model)
    if len(train_data) < args.grad_accum_steps:
        raise ConfigError(f"the training split gives each process {len(train_data.sampler)} "
                          f"samples, {len(train_data)} batches of --batch_size "
                          f"{train_data.batch_size}, fewer than one optimizer step of "
                          f"--grad_accum_steps {args.grad_accum_steps}; lower --batch_size")
    if getattr(args, "snapshot_every_steps", 0) % args.grad_accum_steps:
        raise ConfigError(f"--snapshot_every_steps {args.snapshot_every_steps} is not a multiple "
                          f"of --grad_accum_steps {args.grad_accum_steps}; a snapshot must fall "
                          f"between optimizer steps")
    error = ""
    tensorboard_dir = getattr(args, "tensorboard_dir", None)
    if saves:
        for what, path, probe in (("save to", save_path, save_path),
                                  ("write --metrics_path", args.metrics_path, args.metrics_path),
                                  ("write --tensorboard_dir", tensorboard_dir,
                                   tensorboard_dir and os.path.join(tensorboard_dir, "events"))):
            why = _folder_error(probe) if probe else ""
            if why and not error:
                error = f"cannot {what} {path}: {why}; choose another path"
        if tensorboard_dir and not error:
            error = _tensorboard_missing()
    error = first_error(error)
    if error:
        raise ConfigError(error)


# --------------------------------------------------------------------------
# Speed: autocast, compile, peak memory
# --------------------------------------------------------------------------

# Models for which bf16 autocast was measured to speed up training on a CPU
# with native bf16 instructions (AVX512-BF16/AMX). Here (2-core AMD EPYC,
# torch 2.15), samples/s with --amp over without: cnn x1.35-1.7, mlp x0.57,
# resnet18 x0.9-1.2 (noise around no gain); see docs/performance.md.
AMP_HELPS_ON_CPU = ("cnn",)


def check_amp(amp: bool, device: torch.device, model: str) -> None:
    """Raise ConfigError for --amp on a CPU where bf16 autocast makes training slower.

    On CUDA, --amp is bf16 autocast (no loss scaling needed, unlike fp16),
    refused on GPUs without native bf16 (before Ampere: T4, V100). On a CPU
    it only helps with native bf16 instructions, and only for some models
    (``AMP_HELPS_ON_CPU``, measured); elsewhere it would silently cost speed
    and precision, so it is refused in one line.
    """
    if not amp:
        return
    if device.type == "cuda":
        if not torch.cuda.is_bf16_supported(including_emulation=False):
            major, minor = torch.cuda.get_device_capability(device)
            raise ConfigError(f"--amp: {torch.cuda.get_device_name(device)} (compute capability "
                              f"{major}.{minor}) has no native bf16, which needs 8.0 (Ampere) or "
                              f"newer; bf16 autocast would be emulated and slower. Run without --amp")
        return
    if model not in AMP_HELPS_ON_CPU:
        raise ConfigError(f"--amp on a CPU: bf16 autocast does not speed up --model {model} "
                          f"on a CPU (measured, see docs/performance.md); "
                          f"--amp is for CUDA GPUs. Run without --amp")
    if not torch.backends.mkldnn.is_available() or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        raise ConfigError("--amp on a CPU: this CPU has no native bf16 instructions "
                          "(AVX512-BF16 or AMX), so bf16 autocast would be slower; "
                          "--amp is for CUDA GPUs. Run without --amp")


def autocast(device: torch.device, enabled: bool):
    """bf16 autocast on ``device`` when ``enabled`` (the forward pass and the
    loss; backward follows the forward's dtypes), else a context that does nothing.

    Reusable, one ``with`` after another (not nested): make it once, not per step.
    """
    if not enabled:
        return contextlib.nullcontext()  # cheaper than an autocast(enabled=False) per step
    return torch.autocast(device.type, dtype=torch.bfloat16)


def compile_model(model: torch.nn.Module, enabled: bool) -> torch.nn.Module:
    """``torch.compile(model)`` when ``enabled``, else ``model`` itself.

    The compiled module shares ``model``'s parameters; the scripts call it for
    the training forward only, and keep saving ``model`` (or its DDP
    ``.module``), so saved state_dicts have no ``_orig_mod.`` prefix and load
    without compile. For DDP, pass the DDP-wrapped model: compiling after
    wrapping lets TorchDynamo's DDP optimizer split the graph at the gradient
    buckets, so all-reduce still overlaps with backward.
    """
    if not enabled:
        return model
    # torchrun signals a rank's whole process group, and Slurm every process of
    # a job step: inductor's compile workers would die of a stop signal meant
    # for the rank ("SubprocPool unclean exit"). They start with the stop
    # signals blocked, a mask they inherit; the rank's own mask is restored.
    # Some releases (2.8) start the pool when torch.compile imports inductor,
    # later ones on first use: it is started here, under the mask, either way.
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        compiled = torch.compile(model)
        from torch._inductor.async_compile import AsyncCompile
        AsyncCompile.warm_pool()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    return compiled


def peak_memory_mib(device: torch.device) -> dict:
    """{"peak_gpu_memory_mib": MiB} on CUDA, {} on a CPU.

    The most memory tensors held on ``device`` since the last
    ``torch.cuda.reset_peak_memory_stats`` (``torch.cuda.max_memory_allocated``,
    MiB = 2**20 bytes), the maximum over all ranks under a process group: a
    collective on CUDA, so every rank must call it.
    """
    if device.type != "cuda":
        return {}
    peak = torch.tensor(torch.cuda.max_memory_allocated(device) / 2**20, device=device)
    if _is_distributed():
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return {"peak_gpu_memory_mib": peak.item()}


# --------------------------------------------------------------------------
# One epoch's bookkeeping
# --------------------------------------------------------------------------

class EpochMeter:
    """The running loss sum and sample count of one training epoch, its time
    and its peak GPU memory.

    ``totals`` is a float64 (2,) tensor on the device, (loss sum, samples) of
    this rank: it stays there, since a ``.item()`` per step would make the CPU
    wait for the GPU at every step. A script all-reduces it before
    ``summary`` to get the global figures. ``carried`` is the global totals of
    the steps trained before a mid-epoch resume (None: none), so a resumed
    epoch's summary still covers the whole epoch.
    """

    def __init__(self, epoch: int, max_epochs: int, device: torch.device,
                 carried: Optional[torch.Tensor] = None) -> None:
        self.epoch, self.max_epochs, self.device = epoch, max_epochs, device
        self.totals = torch.zeros(2, dtype=torch.float64, device=device)
        self.carried = carried
        self.steps_left = 0
        self.lr = None
        self.start = time.perf_counter()

    def batches(self, loader: DataLoader, args: argparse.Namespace, rank: int = 0) -> Iterator:
        """The epoch's batches: whole optimizer steps only (a last group of fewer
        than --grad_accum_steps micro-batches is dropped, as ``drop_last`` drops
        a short batch), with a progress bar on rank 0 when stderr is a
        terminal (not in logs). ``steps_left`` counts the batches still to
        come. Calls the test hook ``fault_point("step")`` before each batch."""
        steps = len(loader) - len(loader) % args.grad_accum_steps
        self.lr = args.lr
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.steps_left = steps
        self.start = time.perf_counter()
        for batch in tqdm(itertools.islice(loader, steps), total=steps, leave=False,
                          desc=f"epoch {self.epoch + 1}/{self.max_epochs}",
                          disable=None if rank == 0 else True):
            fault_point("step")
            self.steps_left -= 1
            _PHASE[0] = f"epoch {self.epoch + 1}, training step {steps - self.steps_left} of this start"
            yield batch
            if not _MONITOR.get("training"):  # the first step is done: downloads, compilation too
                _MONITOR["training"] = True
                training_timeout(args)
        _PHASE[0] = f"epoch {self.epoch + 1} after its training steps (evaluation or saving)"

    def add(self, loss: torch.Tensor, samples: int) -> None:
        """Count one batch: its mean ``loss`` (0-dim tensor) over ``samples``."""
        self.totals[0] += loss * samples
        self.totals[1] += samples

    def global_totals(self) -> torch.Tensor:
        """Collective: (loss sum, samples) over all ranks so far, carried part
        included, float64 (2,) on the CPU (what a mid-epoch snapshot holds).
        Raises ConfigError when the loss is not finite."""
        totals = self.totals.clone()
        if _is_distributed():
            dist.all_reduce(totals)
        totals = totals.cpu() + (self.carried.cpu() if self.carried is not None else 0)
        check_finite(totals[0].item() / totals[1].item(), self.epoch)
        return totals

    def summary(self) -> dict:
        """The epoch's record: epoch, total_epochs, train_loss (mean over every
        sample of the epoch), samples_per_s (samples trained since the epoch
        (re)started / seconds), epoch_seconds, lr (--lr: no schedule), and
        peak_gpu_memory_mib on CUDA.
        ``totals`` must already be the global sums. Raises ConfigError when the
        loss is not finite, before anything is saved."""
        new_samples = self.totals[1].item()  # waits for the device, so the time is honest
        seconds = time.perf_counter() - self.start
        loss_sum, samples = (self.totals.cpu() + (self.carried.cpu() if self.carried is not None
                                                  else 0)).tolist()
        check_finite(loss_sum / samples, self.epoch)
        return {"epoch": self.epoch + 1, "total_epochs": self.max_epochs,
                "train_loss": loss_sum / samples, "samples_per_s": new_samples / seconds,
                "epoch_seconds": seconds, "lr": self.lr, **peak_memory_mib(self.device)}


def check_finite(loss: float, epoch: int) -> None:
    """Raise ConfigError when the training loss is NaN or infinite.

    Called before anything is saved, so a diverged run never overwrites the
    last good checkpoint or snapshot.
    """
    if not math.isfinite(loss):
        raise ConfigError(f"training loss became {loss} in epoch {epoch + 1}; stopping without "
                          f"saving (the last saved state is kept). Lower --lr and resume")


# --------------------------------------------------------------------------
# Snapshots: resumable sampler, RNG states, reading, atomic writing
# --------------------------------------------------------------------------

class ResumableDistributedSampler(DistributedSampler):
    """A DistributedSampler that can start an epoch part-way.

    Setting ``start`` skips the first ``start`` indices of this rank's share
    of the epoch, so a run resumed from a mid-epoch snapshot continues the
    same permutation at the next batch: no sample repeated, none skipped.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.start = 0

    def __iter__(self):
        return itertools.islice(super().__iter__(), self.start, None)

    def __len__(self) -> int:
        return self.num_samples - self.start


def rebuild_ddp_buckets(model: torch.nn.Module, data: DataLoader, loss_fn: Callable,
                        eval_transform: Callable, device: torch.device) -> None:
    """Collective, after resuming from a snapshot: lay out DDP's gradient
    buckets as an uninterrupted run has them by now, so that the resumed run
    stays bitwise equal to it at any world size.

    DDP all-reduces its first backward in buckets of parameters in reverse
    registration order, records the order in which gradients became ready,
    and from the second step on uses buckets rebuilt in that order
    (``Reducer::rebuild_buckets`` in torch/csrc/distributed/c10d/reducer.cpp).
    A ring all-reduce of 3 or more ranks sums each element in an order that
    depends on where it lies in the bucket, so without this the first step
    after a resume rounds differently (~1e-7) from the uninterrupted run's
    (with 2 ranks the sum of two numbers is the same either way).

    One forward and backward of ``data``'s first batch (shape (B, ...) of
    ``data.dataset``, each rank the same samples) in eval mode records the
    order; the RNG states are forked, BatchNorm statistics untouched
    (eval), and the gradients dropped. ``model`` is the DDP-wrapped model.
    """
    first = DataLoader(data.dataset, batch_size=data.batch_size, collate_fn=data.collate_fn)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        source, targets = next(iter(first))
        model.eval()
        output = model(eval_transform(source.to(device)))
        loss_fn(output, targets.to(device)).backward()
        model.train()
    for parameter in model.parameters():
        parameter.grad = None


def gather_rng_states(device: torch.device, loader_generator: torch.Generator) -> list:
    """Collective: every rank's random states (CPU, the device's CUDA
    generator, the DataLoader's shuffling generator), gathered on every rank
    as a list indexed by rank; rank 0 saves it in the snapshot."""
    state = {"cpu": torch.get_rng_state(),
             "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
             "loader": loader_generator.get_state()}
    states: list = [None] * dist.get_world_size()
    dist.all_gather_object(states, state)
    return states


def set_rng_state(state: dict, device: torch.device, loader_generator: torch.Generator) -> None:
    """Restore one rank's states from ``gather_rng_states``: the resumed run
    draws the same dropout masks, augmentations and shuffles as the original."""
    torch.set_rng_state(state["cpu"])
    if state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"], device)
    loader_generator.set_state(state["loader"])


def position(epochs_run: int, steps_run: int, short: bool = False) -> str:
    """Where a snapshot stands, for the resume and save lines: "after epoch 2",
    "in epoch 3 after step 40"; ``short``: "epoch 2", "epoch 3 step 40"."""
    if short:
        return f"epoch {epochs_run + 1} step {steps_run}" if steps_run else f"epoch {epochs_run}"
    return f"in epoch {epochs_run + 1} after step {steps_run}" if steps_run else f"after epoch {epochs_run}"


# A snapshot made with other values of these trained something else, or on
# other data (the seed also draws the validation split): refuse it. Not
# compared: what may change between runs of the same training, like paths
# (a node-local --data_dir), --total_epochs, --lr (lowered after a
# divergence), --num_workers, --compile and --amp.
SNAPSHOT_MUST_MATCH = ("dataset", "model", "seed", "input_path", "world_size", "batch_size",
                       "grad_accum_steps")
START_AFRESH = "delete it or pass another --snapshot_path to start afresh"


def read_snapshot(path: str, config: dict) -> dict:
    """Load a snapshot on the CPU for the run described by ``config``.

    ``weights_only=True`` unpickles tensors and plain containers only, never
    arbitrary objects, so a crafted file cannot run code here. Raises
    ConfigError (one line, the file left as it is) when the file cannot be
    read, when it comes from a run whose ``SNAPSHOT_MUST_MATCH`` settings
    differ from ``config``'s, or when it holds more epochs than
    ``config["total_epochs"]``; NothingToTrain when it holds exactly those.
    """
    try:
        snapshot = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        detail = str(exc).strip()
        raise ConfigError(
            f"cannot read snapshot {path} ({type(exc).__name__}: "
            f"{detail.splitlines()[0] if detail else 'no detail'}); "
            f"move it away to start afresh, or pass another --snapshot_path") from None
    changed = [f"{key} {snapshot['config'].get(key)} -> {config[key]}"
               for key in SNAPSHOT_MUST_MATCH if snapshot["config"].get(key) != config[key]]
    if changed:
        raise ConfigError(f"snapshot {path} comes from a different run ({', '.join(changed)}); "
                          f"resume with its settings, or {START_AFRESH}")
    trained, wanted = snapshot["epochs_run"], config["total_epochs"]
    if trained > wanted or (trained == wanted and snapshot["steps_run"]):
        raise ConfigError(f"--total_epochs {wanted} is below the {trained} epochs snapshot {path} "
                          f"already holds; raise --total_epochs, or {START_AFRESH}")
    RUN["resumed_from"] = position(trained, snapshot["steps_run"])
    if trained == wanted:
        raise NothingToTrain(f"snapshot {path} already holds all {wanted} epochs: nothing to train "
                             f"(raise --total_epochs to train on, or {START_AFRESH})")
    return snapshot


def _umask() -> int:
    """This process's file mode creation mask (reading it means setting it)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def snapshot_on_every_node(path: str) -> bool:
    """Collective: True when every rank sees ``path``, False when none does.

    Each rank loads the snapshot itself, so all must see the same file: one
    visible on some nodes only would resume those and restart the rest.
    Raises ConfigError in that case, naming the ranks that miss it.
    """
    exists: list = [None] * dist.get_world_size()
    dist.all_gather_object(exists, os.path.exists(path))
    if any(exists) and not all(exists):
        missing = [rank for rank, found in enumerate(exists) if not found]
        raise ConfigError(f"snapshot {path} is missing on ranks {missing} but present on others; "
                          f"--snapshot_path must be on storage that every node shares")
    return all(exists)


def atomic_save(obj: object, path: str) -> None:
    """``torch.save`` to a temporary file beside ``path``, fsync, then rename.

    A crash at any moment leaves either the old file or the new one, never a
    torn file (POSIX rename is atomic within a filesystem). After a successful
    save, temporary files left beside ``path`` by killed writers are removed;
    only one process may save to a given ``path``.
    """
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=os.path.basename(path) + ".", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; torch.save's files follow the umask
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        fault_point("save")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    # Temporary files of writers killed before their rename are garbage now.
    for stale in glob.glob(os.path.join(folder, glob.escape(os.path.basename(path)) + ".*.tmp")):
        os.remove(stale)


# --------------------------------------------------------------------------
# The stop every rank takes at the same step
# --------------------------------------------------------------------------

# The signals that ask for a stop: Slurm's time-limit warning (the wrappers'
# --signal=B:USR1@90, relayed), SIGTERM (preemption, `scontrol requeue`,
# `scancel`, torchrun stopping its workers) and Ctrl-C.
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)


class StopSignal:
    """Turns SIGUSR1, SIGTERM or SIGINT into a stop that every rank takes at
    the same step.

    A scheduler's warning or a preemption reaches the ranks at slightly
    different moments, possibly mid-step (Slurm's proctrack signals every
    process of a step, torchrun relays to each worker as well). The handler
    only notes the signal. Once per step each rank adds the number of the
    signal it got (0 for none) to an all-reduce (MAX) and reads the previous
    step's result, so all ranks learn "some rank was signalled, and by what" at
    the same step, one step after the earliest signal. The all-reduce runs
    asynchronously on a separate CPU (gloo) group: it never waits for the GPU,
    and by the next step it has long finished, so a step costs no extra wait.

    Repeats of a stop signal count as one stop (one process may get the same
    SIGTERM from Slurm, srun and torchrun), except that a Ctrl-C after any stop
    signal, or a SIGTERM after a Ctrl-C (what torchrun sends its workers on a
    second Ctrl-C), quits at once, without a snapshot: a user pressing Ctrl-C
    twice wants out. Only the process that made the StopSignal acts: a
    DataLoader worker forked a moment ago still has this handler until its
    ``worker_init_fn`` (``ignore_stop_signal``) runs.

    Create it on every rank (``new_group`` is collective); ``poll`` too must be
    called by every rank, equally often. Raises ConfigError when gloo cannot
    reach the other ranks' hosts (the message names GLOO_SOCKET_IFNAME).
    """

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.rank = dist.get_rank()
        self.received = 0  # number of the first stop signal this process got; 0: none
        self.stopped_by = 0  # after a stop: the signal some rank got (the highest number)
        self.group = gloo_group()
        self.flag = torch.zeros(1)
        self.work = None
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._handler)

    def _handler(self, signum, frame) -> None:
        if os.getpid() != self.pid:
            return  # a loader worker before its worker_init_fn ran: the rank decides
        if self.received:
            if signal.SIGINT in (signum, self.received):  # Ctrl-C twice, or after a stop signal
                if self.rank == 0:
                    _write_now("second stop request: quitting at once, without a snapshot\n")
                os._exit(128 + signum)
            return  # the same stop, asked again
        self.received = signum
        if signum == signal.SIGINT and self.rank == 0:
            _write_now("Ctrl-C: every rank stops after the current step and rank 0 saves a "
                       "snapshot; press Ctrl-C again to quit at once without one\n")

    def poll(self) -> bool:
        """Collective. True on every rank at the same call, one call after
        the first rank got a stop signal; False otherwise."""
        if self.work is not None:
            self.work.wait()
            self.stopped_by = int(self.flag.item())
        self.flag.fill_(float(self.received))
        self.work = dist.all_reduce(self.flag, op=dist.ReduceOp.MAX, group=self.group,
                                    async_op=True)
        if self.stopped_by and self.rank == 0:
            name = signal.Signals(self.stopped_by).name
            where = "" if self.received else " (received by another rank)"
            say(f"stopped by {name}{where} after this step on every rank: the snapshot below "
                f"holds every step trained; run the same command again to resume")
        return bool(self.stopped_by)

    def close(self) -> None:
        """Collective, before the process group goes away: wait for the last
        all-reduce, then for every rank. Nobody exits before rank 0 has saved:
        under ``srun --kill-on-bad-exit`` an early exit elsewhere could get
        rank 0 killed mid-save."""
        if self.work is not None:
            self.work.wait()
            self.work = None
        dist.barrier()


def _write_now(text: str) -> None:
    """Write to stderr from a signal handler: one unbuffered write, so that it
    cannot collide with a print the handler interrupted."""
    with contextlib.suppress(OSError):
        os.write(2, text.encode())


def gloo_group() -> dist.ProcessGroup:
    """Collective: a new gloo (CPU) group of all ranks, also in NCCL jobs.

    gloo finds its own address from this host's name, or from the interface
    GLOO_SOCKET_IFNAME names; on nodes where that name resolves to an address
    the others cannot reach, it fails. Raises ConfigError then, naming the
    variable and what it is set to.
    """
    try:
        return dist.new_group(backend="gloo")
    except RuntimeError as exc:
        value = os.environ.get("GLOO_SOCKET_IFNAME")
        setting = f"GLOO_SOCKET_IFNAME is {value!r}" if value else "GLOO_SOCKET_IFNAME is not set"
        raise ConfigError(
            f"gloo cannot set up its network on host {socket.gethostname()} "
            f"({(str(exc).strip().splitlines() or [type(exc).__name__])[0]}); "
            f"{setting}: set it to the network interface the nodes reach each other on "
            f"(`ip -brief addr` lists them), e.g. GLOO_SOCKET_IFNAME=eth0; NCCL jobs need it "
            f"too, for the CPU groups of the stop signal and the timeout report") from None


def ignore_stop_signal(worker_id: int) -> None:
    """DataLoader ``worker_init_fn``: loader workers ignore the stop signals.

    torchrun signals a rank's whole process group, and Slurm every process of
    a job step, loader workers included. The rank decides when to stop; a
    worker that died of SIGINT or SIGTERM (or, under forkserver or spawn,
    Python 3.14's default on Linux, of SIGUSR1) would take the rank down with
    it before it could save.
    """
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


# --------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------

def say(line: str, stream=None) -> None:
    """Print ``line`` and its newline in one write, then flush.

    Several ranks often share one terminal or log file; a plain ``print``
    writes the text and the newline separately, so lines of different ranks
    can run into each other. One write of under 4 KiB to a pipe is atomic.
    """
    stream = stream or sys.stdout
    stream.write(line + "\n")
    stream.flush()


# This run, as its metrics records name it: an id (start time and process id),
# and where it resumed from (set by read_snapshot; None for a fresh start).
RUN = {"run": f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{os.getpid()}",
       "resumed_from": None,
       "started": False,  # its start record is written
       "last_epoch": 0}  # the last epoch it logged (TensorBoard's step for the test figures)
_writers: dict = {}  # tensorboard_dir -> SummaryWriter of this process


def _tensorboard_missing() -> str:
    """'' when tensorboard can be imported, else the one-line error for --tensorboard_dir."""
    try:
        import torch.utils.tensorboard  # noqa: F401  (needs the tensorboard package)
    except ImportError as exc:
        return (f"--tensorboard_dir needs the tensorboard package ({exc}); "
                f"pip install tensorboard, or leave the flag out")
    return ""


def _tensorboard(record: dict, log_dir: str) -> None:
    """Write ``record``'s figures as TensorBoard scalars, step = epoch.

    The writer is made at this process's first record, with ``purge_step`` =
    that record's epoch: TensorBoard then hides points an earlier run wrote
    at that epoch or later (a run killed after its last snapshot, resumed
    from there), so a resumed run continues its curves with no duplicated or
    missing points, and a fresh run in the same folder replaces them.
    """
    from torch.utils.tensorboard import SummaryWriter

    step = record["epoch"] if "epoch" in record else RUN["last_epoch"]  # test: at the end
    if "epoch" in record:
        RUN["last_epoch"] = record["epoch"]
    if log_dir not in _writers:
        _writers[log_dir] = SummaryWriter(log_dir, purge_step=step)
    writer = _writers[log_dir]
    names = {"train_loss": "loss/train", "val_loss": "loss/val", "val_accuracy": "accuracy/val",
             "test_loss": "loss/test", "test_accuracy": "accuracy/test", "lr": "lr",
             "samples_per_s": "speed/samples_per_s", "epoch_seconds": "speed/epoch_seconds",
             "peak_gpu_memory_mib": "memory/peak_gpu_mib"}
    for key, tag in names.items():
        if record.get(key) is not None:
            writer.add_scalar(tag, record[key], step)
    writer.flush()


def log_metrics(record: dict, args: argparse.Namespace) -> None:
    """Print one fixed-format line; append ``record`` as JSON to
    --metrics_path and write it to TensorBoard under --tensorboard_dir.

    Epoch records print as
      ``epoch 3/10 | train_loss 0.012345 | val_loss 0.012345 | val_acc 0.9512 |
      samples/s 12345.6 | epoch_s 0.52 | peak_mem_mib 1234.5``  (val_acc only for
    classification, peak_mem_mib only on CUDA); the final test record as
    ``test | loss 0.012345 | acc 0.9600``.
    Units: samples/s is global training samples per second over the training
    part of the epoch; epoch_s is that part's wall-clock seconds; peak_mem_mib
    the epoch's peak GPU memory held by tensors, MiB, the maximum over ranks.
    Each JSON line also carries ``run`` (this run's id), ``time`` (Unix
    seconds) and ``resumed_from`` (the snapshot position a resumed run
    started at, else null); a run's first line is ``{"event": "start", ...,
    "config": {the flags}}``. A resumed run repeats the epochs after its
    snapshot: for a curve keep the last record of each epoch.
    """
    if "epoch" in record:
        parts = [f"epoch {record['epoch']}/{record['total_epochs']}",
                 f"train_loss {record['train_loss']:.6f}", f"val_loss {record['val_loss']:.6f}"]
        if record.get("val_accuracy") is not None:
            parts.append(f"val_acc {record['val_accuracy']:.4f}")
        parts += [f"samples/s {record['samples_per_s']:.1f}", f"epoch_s {record['epoch_seconds']:.2f}"]
        if record.get("peak_gpu_memory_mib") is not None:
            parts.append(f"peak_mem_mib {record['peak_gpu_memory_mib']:.1f}")
    else:
        parts = ["test", f"loss {record['test_loss']:.6f}"]
        if record.get("test_accuracy") is not None:
            parts.append(f"acc {record['test_accuracy']:.4f}")
    say(" | ".join(parts))
    if args.metrics_path:
        stamp = {"run": RUN["run"], "time": time.time(), "resumed_from": RUN["resumed_from"]}
        with open(args.metrics_path, "a") as f:
            if not RUN["started"]:  # each run opens with its settings
                f.write(json.dumps({"event": "start", **stamp, "config": vars(args)}) + "\n")
            f.write(json.dumps({**record, **stamp}) + "\n")
    RUN["started"] = True
    if getattr(args, "tensorboard_dir", None):
        _tensorboard(record, args.tensorboard_dir)


# --------------------------------------------------------------------------
# FSDP: sharded checkpoints and memory (multinode_fsdp.py)
# --------------------------------------------------------------------------

# The file a sharded snapshot folder gets last: present = the folder is complete.
SHARDED_SNAPSHOT_META = "meta.pt"


def fsdp_blocks(model: torch.nn.Module) -> list:
    """The modules multinode_fsdp.py shards one by one, each an FSDP unit whose
    parameters are all-gathered just before it runs and freed after.

    They are the root's children that hold parameters, except that a container
    child (``nn.Sequential``, ``nn.ModuleList``: ResNet's ``layer1``..``layer4``)
    gives its children instead (ResNet's residual blocks). MNIST CNN: conv1, conv2,
    fc1, fc2; the synthetic MLP (itself a Sequential): its two Linear layers. The
    root, sharded after them, takes the parameters left over. The usual rule
    (PyTorch's FSDP2 examples, torchtitan: one unit per transformer block) with
    nothing model-specific; pass your own list for finer or coarser units.
    """
    blocks = []
    for child in model.children():
        containers = (torch.nn.Sequential, torch.nn.ModuleList)
        parts = list(child.children()) if isinstance(child, containers) else [child]
        blocks += [part for part in parts if next(part.parameters(), None) is not None]
    return blocks


def sharded_snapshot_folder(root: str, epochs_run: int, steps_run: int) -> str:
    """The folder of one sharded snapshot, named as the save line names the
    position (``position(short=True)``): ``<root>/epoch-2`` after epoch 2,
    ``<root>/epoch-3-step-40`` after step 40 of epoch 3."""
    return os.path.join(root, position(epochs_run, steps_run, short=True).replace(" ", "-"))


def _sharded_position(name: str) -> Optional[tuple]:
    """(epochs_run, steps_run) of a folder named by ``sharded_snapshot_folder``, else None."""
    parts = name.split("-")
    if len(parts) == 2 and parts[0] == "epoch" and parts[1].isdigit():
        return int(parts[1]), 0
    if len(parts) == 4 and parts[0] == "epoch" and parts[2] == "step" and \
            parts[1].isdigit() and parts[3].isdigit() and int(parts[1]) > 0:
        return int(parts[1]) - 1, int(parts[3])
    return None


def latest_sharded_snapshot(root: str) -> Optional[str]:
    """Collective: the newest complete snapshot folder under ``root`` as rank 0
    sees it, returned on every rank (None: there is none; start afresh).

    Newest: the furthest position (epochs_run, steps_run) of the folder names. Complete:
    it holds ``SHARDED_SNAPSHOT_META``, which rank 0 writes last. Rank 0 also
    deletes the incomplete ones, what a save killed midway leaves (one job
    per ``root``, as ``atomic_save`` assumes one writer per path); other
    entries of ``root`` are left alone. Raises ConfigError on every rank when
    ``root`` is a file (a snapshot of another script?).
    """
    import shutil

    found, error = None, ""
    if dist.get_rank() == 0:
        if os.path.isfile(root):
            error = (f"--snapshot_path {root} is a file; multinode_fsdp.py keeps its snapshots "
                     f"in a folder there: pass another --snapshot_path")
        elif os.path.isdir(root):
            complete = []
            for name in os.listdir(root):
                folder, position = os.path.join(root, name), _sharded_position(name)
                if position is None or not os.path.isdir(folder):
                    continue
                if os.path.isfile(os.path.join(folder, SHARDED_SNAPSHOT_META)):
                    complete.append((position, folder))
                else:
                    shutil.rmtree(folder, ignore_errors=True)
            found = max(complete)[1] if complete else None
    message = [found, error]
    dist.broadcast_object_list(message, src=0)
    if message[1]:
        raise ConfigError(message[1])
    return message[0]


def read_sharded_snapshot(folder: str, config: dict, world_size: int) -> dict:
    """``read_snapshot`` of a sharded snapshot folder's ``SHARDED_SNAPSHOT_META``
    (epochs_run, steps_run, epoch_totals, rng_states, config, world_size; the
    weights are in the folder's DCP shards). ``config["world_size"]`` is None
    in multinode_fsdp.py, so any world size matches: DCP reshards. Raises
    ConfigError as ``read_snapshot`` does, and for a snapshot taken inside an
    epoch by another world size than ``world_size``: each rank's share of that
    epoch depends on the world size, so the rest of the epoch cannot be
    split anew without repeating or skipping samples.
    """
    snapshot = read_snapshot(os.path.join(folder, SHARDED_SNAPSHOT_META), config)
    saved = snapshot["world_size"]
    if snapshot["steps_run"] and saved != world_size:
        raise ConfigError(f"snapshot {folder} was taken inside an epoch by world_size {saved}; "
                          f"resume it with {saved} processes (a snapshot taken at an epoch's end "
                          f"resumes with any number)")
    return snapshot


def resharding_note(saved_world_size: int) -> str:
    """'' when this run's world size is ``saved_world_size``, else the note the
    resume line of multinode_fsdp.py ends with: weights and optimizer state are
    resharded exactly; only ranks that the saving run also had get their RNG
    states back (the others start from their seeds), so dropout and
    augmentation draws differ from those of an uninterrupted run."""
    world_size = dist.get_world_size() if _is_distributed() else 1
    if saved_world_size == world_size:
        return ""
    return (f" (saved by world_size {saved_world_size}, resharded to {world_size}: weights and "
            f"optimizer state exact; random streams restored on ranks < "
            f"{min(saved_world_size, world_size)} only)")


def most_batches(loader: DataLoader, device: torch.device) -> int:
    """Collective: the most batches any rank's ``loader`` gives (evaluation
    shards differ by up to one sample, so by up to one batch).

    Raises ConfigError on every rank when some rank has no batch at all while
    another has (fewer samples than processes): FSDP's evaluation forward is
    a collective, and such a rank would have no input to run it with.
    """
    counts = torch.tensor([len(loader), -len(loader)], device=device)
    if _is_distributed():
        dist.all_reduce(counts, op=dist.ReduceOp.MAX)  # (most, -fewest) over ranks
    most, fewest = counts[0].item(), -counts[1].item()
    if fewest == 0 < most:
        world_size = dist.get_world_size() if _is_distributed() else 1
        raise ConfigError(f"an evaluation split has fewer samples than the {world_size} "
                          f"processes; start fewer processes")
    return most


def remove_other_sharded_snapshots(root: str, keep: str) -> None:
    """Delete every snapshot folder under ``root`` but ``keep``. Call it (on one
    rank) only once ``keep`` is complete: until then the previous snapshot is
    the one a restart resumes from."""
    import shutil

    for name in os.listdir(root):
        folder = os.path.join(root, name)
        if _sharded_position(name) is not None and os.path.isdir(folder) and \
                os.path.abspath(folder) != os.path.abspath(keep):
            shutil.rmtree(folder, ignore_errors=True)


def _local_and_full_bytes(tensor: torch.Tensor) -> tuple[int, int]:
    """(bytes this rank stores, bytes of the whole tensor) of a DTensor (FSDP's
    sharded parameters, gradients, optimizer state) or a plain tensor (both the same)."""
    from torch.distributed.tensor import DTensor

    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size(), tensor.numel() * tensor.element_size()


def training_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Collective: the bytes of training state a rank holds, and what DDP would hold.

    Counts parameters, their gradients (``.grad``; None counts 0) and every
    tensor of the optimizer's state (SGD: one momentum buffer per parameter;
    created at the first step, so call this after one), each as this rank's
    local shard. Returns the rank holding the most (shards of a dimension that
    does not divide by the world size are uneven): {"params", "grads",
    "optimizer", "total", "rank"} in bytes, plus "ddp_total", the bytes of
    the same tensors at full size, which every DDP rank holds (DDP's gradient
    buckets, a second copy of the gradients by default, not included).
    """
    local = {"params": 0, "grads": 0, "optimizer": 0}
    full = 0
    for param in model.parameters():
        for kind, tensor in (("params", param), ("grads", param.grad)):
            if tensor is not None:
                mine, whole = _local_and_full_bytes(tensor)
                local[kind] += mine
                full += whole
    for state in optimizer.state.values():
        for tensor in state.values():
            if isinstance(tensor, torch.Tensor):
                mine, whole = _local_and_full_bytes(tensor)
                local["optimizer"] += mine
                full += whole
    local.update(total=sum(local.values()), rank=dist.get_rank() if _is_distributed() else 0,
                 ddp_total=full)
    ranks: list = [local]
    if _is_distributed():
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, local)
    return max(ranks, key=lambda entry: entry["total"])


def _size(n_bytes: float) -> str:
    """Bytes in binary units: 512 B, 16.5 KiB, 4.62 MiB, 1.20 GiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n_bytes >= scale:
            return f"{n_bytes / scale:.{1 if unit == 'KiB' else 2}f} {unit}"
    return f"{n_bytes:.0f} B"


def say_sharded_memory(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                       device: torch.device) -> None:
    """Collective: rank 0 prints the line multinode_fsdp.py shows after its first
    optimizer step (when gradients and optimizer state first exist), e.g.
    ``state per rank: 8.6 KiB = params 2.9 KiB + grads 2.9 KiB + optimizer 2.9 KiB (8844
    bytes, rank 0 of 2); DDP would hold 16.5 KiB (16908 bytes), 1.91x``, from
    ``training_state_bytes``; on CUDA followed by ``| peak GPU memory 123.4 MiB``
    (``torch.cuda.max_memory_allocated``, the maximum over ranks, this epoch so far)."""
    state = training_state_bytes(model, optimizer)
    world_size = dist.get_world_size() if _is_distributed() else 1
    line = (f"state per rank: {_size(state['total'])} = params {_size(state['params'])} + grads "
            f"{_size(state['grads'])} + optimizer {_size(state['optimizer'])} ({state['total']} "
            f"bytes, rank {state['rank']} of {world_size}); DDP would hold "
            f"{_size(state['ddp_total'])} ({state['ddp_total']} bytes), "
            f"{state['ddp_total'] / state['total']:.2f}x")
    peak = peak_memory_mib(device)
    if peak:
        line += f" | peak GPU memory {peak['peak_gpu_memory_mib']:.1f} MiB"
    if not _is_distributed() or dist.get_rank() == 0:
        say(line)


def exit_skipping_teardown() -> None:
    """Flush stdout and stderr, then end the process with status 0 at once
    (``os._exit``), skipping the interpreter's teardown. For the end of a
    successful FSDP run, after ``destroy_process_group``.

    Once a DTensor exists (``fully_shard`` makes them), torch 2.15 keeps the
    default process group alive past ``destroy_process_group`` from outside
    Python (measured here: a weak reference to it survives ``gc.collect()``
    after ``fully_shard`` or ``DTensor.from_local``, not after
    ``init_device_mesh`` alone), so gloo's threads are still running while the
    interpreter tears down: the condition in which docs/pitfalls.md saw
    finished DDP runs abort with ``terminate called without an active
    exception``. One finished multinode_fsdp.py run here did (1 of about 140).
    Everything the scripts write is closed and fsynced before this point.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# --------------------------------------------------------------------------
# Test hook
# --------------------------------------------------------------------------

_fault_counts: dict = {}
_fault_spec: Optional[str] = None  # DDP_TEST_FAULT as read at the first call ("" when off)


def fault_point(point: str) -> None:
    """Test hook: a no-op unless the environment variable DDP_TEST_FAULT is set.

    DDP_TEST_FAULT="POINT:RANK:N:ACTION" makes rank RANK, on the N-th call
    (1-based) of ``fault_point(POINT)`` in this process, do ACTION: ``kill``
    (SIGKILL itself), ``raise`` (RuntimeError) or ``hang`` (sleep an hour).
    Points: ``step`` (before each training step) and ``save`` (inside
    atomic_save, after the temporary file is written, before the rename). It
    fires only in a job's first attempt (TORCHELASTIC_RESTART_COUNT unset or
    0), so a torchrun restart runs clean. The environment is read once per
    process: two os.environ lookups per step cost a small model ~3%.
    """
    global _fault_spec
    if _fault_spec is None:
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        _fault_spec = os.environ.get("DDP_TEST_FAULT", "") if first_attempt else ""
    if not _fault_spec:
        return
    _fault_counts[point] = count = _fault_counts.get(point, 0) + 1
    want_point, want_rank, want_count, action = _fault_spec.split(":")
    rank = dist.get_rank() if _is_distributed() else 0
    if (point, rank, count) != (want_point, int(want_rank), int(want_count)):
        return
    say(f"DDP_TEST_FAULT: {action} at {point} {count} on rank {rank}", sys.stderr)
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "raise":
        raise RuntimeError(f"DDP_TEST_FAULT: injected failure at {point} {count} on rank {rank}")
    elif action == "hang":
        time.sleep(3600)
