"""Meeting the other processes: the store under torchrun or srun, the side
gloo groups, a barrier that names its GPU, and rank 0's buffers on every rank.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import sys
import time
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist
# Imported before any process group exists, on purpose: torch.distributed.nn
# binds group.WORLD into its functions' default arguments at import time, and
# DDP imports it lazily. Imported after init_process_group, it would keep the
# process group alive past destroy_process_group, its gloo threads still
# running at interpreter exit, where the process can abort after a successful
# run ("terminate called without an active exception"; docs/pitfalls.md).
import torch.distributed.nn  # noqa: F401

from common import ConfigError
from ..output import print_line
from .rendezvous import slurm_port


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
    SLURM_STEP_NUM_TASKS: they become RANK, LOCAL_RANK and WORLD_SIZE here (and
    this node's share of SLURM_STEP_TASKS_PER_NODE LOCAL_WORLD_SIZE), and
    the rendezvous is the job's first host at ``rendezvous.slurm_port``
    (what the Slurm wrappers derive too) unless MASTER_ADDR/MASTER_PORT are
    set. Rank 0 then hosts the store. A launcher that starts each process
    itself with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT alone (a
    Kubernetes PyTorchJob or JobSet) sets no LOCAL_RANK: ``set_local_ranks``
    derives it; rank 0 hosts the store there too.

    The keys go under ``store_prefix()``: one per attempt where the store
    outlives the workers, so a restarted rank never reads what its failed
    predecessor left there. Raises ConfigError when started by none of them, or with RANK set but
    not WORLD_SIZE, MASTER_ADDR or MASTER_PORT.
    """
    if "RANK" not in os.environ and "SLURM_STEP_ID" in os.environ:  # a task of an srun step
        env = os.environ
        env.update(RANK=env["SLURM_PROCID"], LOCAL_RANK=env["SLURM_LOCALID"],
                   WORLD_SIZE=env.get("SLURM_STEP_NUM_TASKS") or env["SLURM_NTASKS"])
        tasks = tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", ""))
        if int(env.get("SLURM_NODEID", -1)) in range(len(tasks)):
            env["LOCAL_WORLD_SIZE"] = str(tasks[int(env["SLURM_NODEID"])])
        if "MASTER_ADDR" not in env:
            env["MASTER_ADDR"] = first_host(env.get("SLURM_STEP_NODELIST") or env["SLURM_JOB_NODELIST"])
        if "MASTER_PORT" not in env:
            env["MASTER_PORT"] = str(slurm_port(int(env["SLURM_JOB_ID"])))
    if "RANK" not in os.environ:
        script = os.path.basename(sys.argv[0])
        raise ConfigError(f"start this script with torchrun (torchrun --standalone "
                          f"--nproc_per_node=gpu {script}; --nproc_per_node=2 on a CPU) or with "
                          f"srun, one task per GPU (srun --ntasks-per-node=GPUS python {script})")
    missing = [name for name in ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        raise ConfigError(f"RANK is set but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not: a "
                          f"launcher that starts each process itself (a Kubernetes PyTorchJob or JobSet) sets "
                          f"RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; set them, or start with torchrun")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # Rank 0 of pods waits for the others in set_local_ranks, where it says which are late.
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=rank == 0 and not agent_hosts_store(), timeout=timeout,
                          wait_for_workers="LOCAL_RANK" in os.environ)
    store = dist.PrefixStore(store_prefix(), store)
    if "LOCAL_RANK" not in os.environ:  # each process started by the launcher itself: a pod's
        set_local_ranks(store, rank, world_size)
    return store


def set_local_ranks(store: dist.Store, rank: int, world_size: int) -> None:
    """Collective (every rank, through ``store``): set LOCAL_RANK and
    LOCAL_WORLD_SIZE for a launcher that starts each process itself and sets
    RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT alone (a Kubernetes
    PyTorchJob's or JobSet's pods; the variables torch's env:// reads). Each
    rank notes its host's name; its local rank is the number of lower ranks
    on the same host (0 for one process per pod, whose host name is the
    pod's), LOCAL_WORLD_SIZE the ranks there. Waits for every rank's note
    up to the store's time-out (--startup_timeout_s)."""
    store.set(f"host/{rank}", socket.gethostname())
    keys = [f"host/{other}" for other in range(world_size)]
    if rank == 0:
        wait_noting_late_ranks(store, keys)
    hosts = [store.get(key).decode() for key in keys]
    mine = [other for other, host in enumerate(hosts) if host == hosts[rank]]
    os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"] = str(mine.index(rank)), str(len(mine))


# Rank 0 of processes that their launcher starts one by one (pods) names the ranks not started
# yet: after LATE_NOTE_AFTER_S seconds of waiting, then every LATE_NOTE_EVERY_S.
LATE_NOTE_AFTER_S, LATE_NOTE_EVERY_S = 10.0, 60.0


def wait_noting_late_ranks(store: dist.Store, keys: list) -> None:
    """Rank 0's wait for every rank's key in ``keys`` (key i set by rank i as
    it starts), up to the store's time-out (--startup_timeout_s), as
    ``store.wait(keys)`` waits; on the way it prints, after
    ``LATE_NOTE_AFTER_S`` seconds and every ``LATE_NOTE_EVERY_S`` after,
    which ranks have not started, so that a job whose pods start late is
    not silent. Raises DistStoreError, as the store's wait does, at the time-out."""
    limit = store.timeout.total_seconds()
    started = time.monotonic()
    note_at = started + LATE_NOTE_AFTER_S
    while not store.check(keys):  # a look, not a wait: a store's wait that times out logs C++ warnings
        now = time.monotonic()
        if now - started < limit and now < note_at:
            time.sleep(0.2)
            continue
        late = [rank for rank, key in enumerate(keys) if not store.check([key])]
        if now - started >= limit:  # the store's own error, as its wait would raise it
            raise dist.DistStoreError(f"wait timeout after {limit * 1000:.0f}ms, keys: "
                                      f"{', '.join(keys[rank] for rank in late)}")
        if late:
            named = ", ".join(str(rank) for rank in late[:8]) + (", ..." if len(late) > 8 else "")
            print_line(f"rank 0 has waited {now - started:.0f} s for rank{'s' if len(late) > 1 else ''} {named} "
                       f"to start ({len(keys) - len(late)} of {len(keys)} started; --startup_timeout_s "
                       f"{limit:g} ends the wait)")
        note_at = now + LATE_NOTE_EVERY_S


def tasks_per_node(text: str) -> list[int]:
    """Slurm's tasks-per-node list, expanded: "2(x3),1" (SLURM_STEP_TASKS_PER_NODE's
    form, sbatch(1)) gives [2, 2, 2, 1]; [] for an empty or unreadable one."""
    counts = []
    for part in text.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part)
        if match is None:
            return []
        counts += [int(match[1])] * int(match[2] or 1)
    return counts


def agent_hosts_store() -> bool:
    """Whether torchrun's agent, not rank 0, hosts the store at
    MASTER_ADDR:MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE is ``True``): then it
    outlives the workers, across restarts."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def store_prefix() -> str:
    """The key prefix of this attempt's store: the same on every rank of one
    rendezvous round, with no key of an earlier round under it.

    Where the agent hosts the store (torchrun's static rendezvous, as with
    ``--standalone``; its dynamic one unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)
    it outlives the workers: ``attempt_<TORCHELASTIC_RESTART_COUNT>``, so a
    restarted rank cannot read the addresses its failed predecessor left
    there, then fail or hang connecting (docs/pitfalls.md;
    ``init_method="env://"`` does not do this). Every agent there restarts its
    workers only on a failure, so the counts agree.

    Where rank 0 hosts it (srun; torchrun's dynamic rendezvous with
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, the elastic setting), each round's
    rank 0 is a new process serving a new, empty store at a port its agent
    picks afresh (torch.distributed.elastic.rendezvous.api.RendezvousStoreInfo):
    nothing stale to read, so one fixed prefix, ``run``. The restart count
    would split such a round: it counts one agent's failures, so an agent that
    joins an elastic job (0) and one that outlived a lost node (1) disagree,
    and their ranks wait for each other's keys until the store's time-out.
    """
    if agent_hosts_store():
        return f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return "run"


# The side groups made without a time-out of their own: they follow the run's
# (timeouts.use_training_timeout sets it on each). Per process, as torch's own
# table of groups is.
FOLLOWING_RUN_TIMEOUT: list = []


def gloo_group(timeout: Optional[timedelta] = None, description: Optional[str] = None) -> dist.ProcessGroup:
    """Collective: a new gloo (CPU) group of all ranks, also in NCCL jobs;
    its collectives, and the wait for every rank to make it, time out after
    ``timeout`` (None: torch's default for gloo, 30 minutes, until the
    training time-out takes over: ``FOLLOWING_RUN_TIMEOUT``).
    ``description`` names it in torch's flight recorder and the time-out
    report (e.g. "stop signal").

    gloo finds its own address from this host's name, or from the interface
    GLOO_SOCKET_IFNAME names; on nodes where that name resolves to an address
    the others cannot reach, it fails. Raises ConfigError then, naming the
    variable and what it is set to. A rank that never arrives is no network
    fault: the store's time-out (DistStoreError) is raised as it is.
    """
    try:
        group = dist.new_group(backend="gloo", timeout=timeout, group_desc=description)
        if timeout is None:
            FOLLOWING_RUN_TIMEOUT.append(group)
        return group
    except dist.DistStoreError:
        raise
    except RuntimeError as exc:
        if "Too many open files" in str(exc):  # EMFILE: a limit, not the network
            raise ConfigError(f"rank {dist.get_rank()} ran out of open files making a gloo group (its "
                              f"limit is {open_file_limit()}; a gloo group holds a connection to every "
                              f"other rank): raise the limit (ulimit -n, up to ulimit -Hn; your cluster "
                              f"may set it), or start fewer processes") from None
        value = os.environ.get("GLOO_SOCKET_IFNAME")
        setting = f"GLOO_SOCKET_IFNAME is {value!r}" if value else "GLOO_SOCKET_IFNAME is not set"
        raise ConfigError(
            f"gloo cannot set up its network on host {socket.gethostname()} "
            f"({(str(exc).strip().splitlines() or [type(exc).__name__])[0]}); "
            f"{setting}: set it to the network interface the nodes reach each other on "
            f"(`ip -brief addr` lists them), e.g. GLOO_SOCKET_IFNAME=eth0; NCCL jobs need it "
            f"too, for the CPU groups of the stop signal and the timeout report") from None


def barrier() -> None:
    """Collective: ``dist.barrier()`` on the default group. Under NCCL it names
    this process's GPU (the one ``torch.cuda.set_device`` chose), which
    ``barrier`` would otherwise guess, with a UserWarning on every rank."""
    nccl = dist.get_backend() == "nccl"
    dist.barrier(device_ids=[torch.cuda.current_device()] if nccl else None)


def open_file_limit() -> str:
    """This process's limit of open files (its soft limit, ``ulimit -n``), as text; '?' where unknown."""
    try:
        import resource
    except ImportError:  # Windows
        return "?"
    return str(resource.getrlimit(resource.RLIMIT_NOFILE)[0])


def raise_open_file_limit() -> None:
    """Raise this process's soft limit of open files to its hard limit
    (``ulimit -n`` to ``ulimit -Hn``, which needs no privilege).

    Every gloo group holds a socket to each other rank: the kit's side groups
    (the time-out watch, the stop poll, FSDP's two background-save groups),
    and on CPUs the training's own group, make up to five full meshes, about
    5 x world_size descriptors a rank: past the common soft limit of 1,024
    from about 200 ranks on, while hard limits are usually far higher. A
    limit still too low is named when a group cannot be made (``gloo_group``).
    Nothing on a system without the ``resource`` module (Windows)."""
    try:
        import resource
    except ImportError:
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def broadcast_buffers(model: torch.nn.Module) -> None:
    """Collective: every rank takes rank 0's buffers (BatchNorm running
    statistics), the ones rank 0 saves. Each rank's drift apart in training
    (DDP broadcasts them only at a forward, FSDP never): scoring with rank 0's
    makes the evaluation that of the saved model."""
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)
