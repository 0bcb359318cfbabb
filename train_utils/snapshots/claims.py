"""One live run per snapshot: the claim file beside it, and whether a
process still lives.

The claim is the Slurm wrappers' (slurm/stop_and_requeue.sh): a file
``<snapshot>.job`` of one line, read and written under ``flock``. The
wrappers write the job id alone; a run writes ``job=<id> host=<name>
pid=<pid> start=<ticks>``, the pid being that of the process that lasts the
whole run: torchrun's agent, which restarts the workers (--max-restarts),
else the script's own process; ``job`` only inside a Slurm job; ``pidns``
the pid namespace those pids belong to (a container's own).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
from typing import Optional

try:
    import fcntl
except ImportError:  # Windows: no flock; claims are then read and written unlocked
    fcntl = None

import torch.distributed as dist

from common import ConfigError
from ..output import first_error

CLAIM_SUFFIX = ".job"
# squeue's states of a job that may still write (docs: squeue, JOB STATE CODES).
LIVE_JOB_STATES = ("PENDING", "RUNNING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED",
                   "RESIZING", "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT", "RESV_DEL_HOLD")
_HELD: dict = {}  # the claim this process took: {"path": ..., "holder": ...}, or a lease's {"release": ...}


def claim_path(snapshot_path: str) -> str:
    """The claim file of ``snapshot_path`` (a file, or a sharded snapshot's folder)."""
    return os.path.normpath(snapshot_path) + CLAIM_SUFFIX


def start_ticks(pid: int) -> str:
    """When process ``pid`` started, in clock ticks after boot (/proc/<pid>/stat,
    field 22), as text; '' where that cannot be read (no such process, no /proc).
    Tells a live process from a later one that got the same pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def this_run() -> dict:
    """This process's run as a claim names it: ``job`` (the Slurm job, an array
    task as <array job id>_<index>; absent outside Slurm), ``host``, ``pid`` and
    ``start`` of the process that lasts the whole run (torchrun's agent, the
    parent, when TORCHELASTIC_RUN_ID says torchrun started this worker), and
    ``pidns``, the pid namespace they are in."""
    env = os.environ
    array = env.get("SLURM_ARRAY_JOB_ID") and f"{env['SLURM_ARRAY_JOB_ID']}_{env.get('SLURM_ARRAY_TASK_ID')}"
    pid = os.getppid() if "TORCHELASTIC_RUN_ID" in env else os.getpid()
    run = {"job": array or env.get("SLURM_JOB_ID", ""), "host": socket.gethostname(),
           "pid": str(pid), "start": start_ticks(pid), "pidns": _pid_namespace()}
    return {key: value for key, value in run.items() if value}


def _pid_namespace() -> str:
    """This process's pid namespace (its inode number), '' where there is none
    to read: containers that share a host name (host network) but not pids
    (podman, docker) must not judge each other's pids."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return ""


def parse_claim(text: str) -> dict:
    """A claim file's text as a dict; a lone word (what the Slurm wrappers
    write) is a job id; '' gives {} (nobody holds it)."""
    words = text.split()
    if len(words) == 1 and "=" not in words[0]:
        return {"job": words[0]}
    return dict(word.split("=", 1) for word in words if "=" in word)


def process_lives(pid: str, start: str = "") -> bool:
    """True when process ``pid`` of this host exists and, if ``start`` is
    given and readable, started then (``start_ticks``), i.e. is no later
    process that reuses the pid. A process of another user counts as alive,
    and any process on Windows, where ``os.kill`` would end it."""
    if os.name == "nt":
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    now = start_ticks(int(pid))
    return not (start and now and now != start)


def job_state(job: str) -> Optional[str]:
    """Slurm's state of ``job`` (squeue): the state while it may still write
    (one of ``LIVE_JOB_STATES``), '' when it has ended or Slurm no longer knows
    it, None when squeue cannot tell (not installed, no answer)."""
    try:
        answer = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True,
                                text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if answer.returncode:
        return "" if "Invalid job id" in answer.stderr else None
    state = answer.stdout.strip().splitlines()
    return state[0] if state and state[0] in LIVE_JOB_STATES else ""


def live_holder(claim: dict, me: dict, ours: set) -> str:
    """Who else holds a claim and may still write ('' when this run may take
    it), for the refusal: "job 12 (RUNNING)", "pid 7 on host a". ``me`` is
    ``this_run()``; ``ours`` the (host, pid, pidns) of every rank's ``this_run``:
    a claim of one of them is this run's (restarted by torchrun). A claim of
    another host that names no job Slurm can judge cannot be told dead:
    it counts as live."""
    host, pid = claim.get("host"), claim.get("pid")
    if not claim or (host, pid, claim.get("pidns", "")) in ours:
        return ""
    here = (host == me["host"] and pid and os.name != "nt"  # Windows: no safe check (process_lives)
            and claim.get("pidns", me.get("pidns")) == me.get("pidns"))  # a container's pids are its own
    if claim.get("job") and claim["job"] == me.get("job"):  # this job, requeued or restarted
        alive = here and process_lives(pid, claim.get("start", ""))
        return f"pid {pid} on host {host}, another run in this job {claim['job']}" if alive else ""
    state = job_state(claim["job"]) if claim.get("job") else None
    if state is not None:
        return f"job {claim['job']} ({state})" if state else ""
    if here:
        return f"pid {pid} on host {host}" if process_lives(pid, claim.get("start", "")) else ""
    where = f"pid {pid} on host {host}" if host else f"job {claim.get('job')}"
    return f"{where}, which cannot be checked from here"


def _lock(file) -> None:
    """Lock ``file`` (flock, exclusive; released when it is closed), where the
    system can: some network file systems and Windows have no flock."""
    if fcntl is not None:
        with contextlib.suppress(OSError):
            fcntl.flock(file, fcntl.LOCK_EX)


def take_claim(path: str, me: dict, ours: set) -> str:
    """Take the claim file ``path`` for ``me`` unless ``live_holder`` names
    someone; read and written under ``flock`` (the Slurm wrappers' lock).
    Returns '' when taken, else the one-line refusal; a claim file this
    call created and could not write (a full disk) is removed again."""
    existed = os.path.exists(path)
    try:
        claim = open(path, "a+")
    except OSError as exc:
        return (f"cannot write {path} (the snapshot's claim: {exc.strerror}); pass a --snapshot_path "
                f"in a folder you can write")
    try:
        with claim:
            return _judge_and_write(claim, path, me, ours)
    except OSError as exc:  # a full disk, say
        if not existed:  # no empty claim left behind
            with contextlib.suppress(OSError):
                os.remove(path)
        return (f"cannot write {path} (the snapshot's claim: {exc.strerror}); free space there, or pass "
                f"another --snapshot_path")


def _judge_and_write(claim, path: str, me: dict, ours: set) -> str:
    """``take_claim``'s work on the open claim file: '' when written for ``me``."""
    _lock(claim)
    claim.seek(0)
    holder = live_holder(parse_claim(claim.read()), me, ours)
    if holder:
        snapshot = path[:-len(CLAIM_SUFFIX)]
        unsure = f"; if it has ended, delete {path}" if "cannot be checked" in holder else ""
        return (f"snapshot {snapshot} is in use by {holder}: two live runs must not write one "
                f"snapshot; wait for that run to end (or stop it), or pass another "
                f"--snapshot_path{unsure}")
    claim.seek(0)
    claim.truncate()
    claim.write(" ".join(f"{key}={value}" for key, value in me.items()) + "\n")
    claim.flush()  # a full disk fails here, inside take_claim's OSError net
    return ""


def this_jobs_processes() -> tuple[dict, set]:
    """Collective: (this process's ``this_run()``, the (host, pid, pidns) of
    every rank's): a claim held by any of them is this run's own."""
    me = this_run()
    runs: list = [None] * dist.get_world_size()
    dist.all_gather_object(runs, me)
    return me, {(run["host"], run["pid"], run.get("pidns", "")) for run in runs}


def claim_snapshot(snapshot_path: str) -> None:
    """Collective: rank 0 claims ``snapshot_path`` for this run (``take_claim``).
    Raises ConfigError on every rank, before training, when another live run
    holds it, naming that run (host and pid, or Slurm job). Outside Slurm the
    claim is given back when the process ends (``release_claim``, called by
    ``ending.end_process``); inside a job it stays, as the wrappers' does,
    until another job takes it over."""
    me, ours = this_jobs_processes()
    error = ""
    if dist.get_rank() == 0:
        path = claim_path(snapshot_path)
        error = take_claim(path, me, ours)
        if not error and "job" not in me:
            _HELD.update(path=path, holder=me)
    error = first_error(error)
    if error:
        raise ConfigError(error)


def release_claim() -> None:
    """Remove the claim this process took (``claim_snapshot``) if it still
    names this run; a no-op otherwise, and when called again."""
    release = _HELD.pop("release", None)
    if release is not None:  # a lease in a bucket (bucket.Lease)
        release()
    path, me = _HELD.pop("path", None), _HELD.pop("holder", None)
    if not path:
        return
    with contextlib.suppress(OSError), open(path, "r+") as claim:
        _lock(claim)
        if parse_claim(claim.read()) == me:
            os.remove(path)
