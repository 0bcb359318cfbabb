"""Slurm jobs driven the way the stop-path tests drive them: a wrapper
submitted to the session's test cluster (slurm_cluster.py), a trigger
(preemption, scontrol requeue, scancel, or Slurm's own time limit, brought
near) once its
log shows a line, requeued runs released as soon as their nodes are clean,
and the checks on each run's log (resumed where the last save was, every
epoch summarised once). tests/test_stop_paths.py and tests/test_container.py
use them."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional

from helpers import REPO, epochs, wrapper_snapshot
from slurm_cluster import NODE_IFACE

SMALL = ["--mem=1G", "--cpus-per-task=1"]
SCENARIO_TIMEOUT_S = 900
TIME_LIMIT_MIN = 15  # a job's time limit unless its scenario sets one
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
HEADER = re.compile(r"^job \d+ .*\| restart (\d+) \|", re.M)
STOP = re.compile(r"^epoch (\d+) step (\d+) \| snapshot saved at (\S+)$", re.M)
SAVED = re.compile(r"^epoch (\d+) (?:step (\d+) )?\| snapshot saved at", re.M)
RESUME = re.compile(r"^resuming from snapshot (\S+) (?:in epoch (\d+) after step (\d+)|after epoch (\d+))$",
                    re.M)


@dataclass
class Scenario:
    """One job and what is done to it. ``trigger(cluster, job_id, nodes)`` stops
    it (None: its time limit does); ``reference`` is the uninterrupted run."""
    name: str
    wrapper: str
    nodes: str
    sbatch: list
    args: list
    trigger: Optional[Callable]
    # (script, processes[, flags added to the scenario's]) of the uninterrupted run it ends equal to
    reference: tuple = ("train.py", 2)
    resubmit: bool = False  # after it ends (scancel), submit the same command again
    # after it ends, submit these arguments instead (the same run, respelt or extended); its snapshot
    # as the first job left it is kept beside it, as <snapshot>.first
    again: tuple = ()
    after: str = ""  # the scenario whose job must have ended before this one is submitted (its nodes)
    user_signal: bool = False  # run alone, with preempt_send_user_signal switched on
    partition: str = "stops"
    # added to the job's environment: DDP_TEST_FAULT, with helpers.FAULTY_TRAIN_JOB_ENV (SCRIPT_NAME)
    env: dict = field(default_factory=dict)
    trigger_when: tuple = ()  # lines that must all be in the log before the trigger; () : epoch 2's
    gate: Optional[threading.Event] = None  # and, when given, set before the trigger (by the test)
    # filled in by the driver
    logs: list = field(default_factory=list)
    infos: list = field(default_factory=list)
    signal_to_exit_s: Optional[float] = None
    error: str = ""


def preempt(cluster, job: int, nodes: str) -> None:
    """A high-priority job that needs the whole of the job's nodes."""
    count = len(subprocess.run(["scontrol", "show", "hostnames", nodes], env=cluster.env, capture_output=True,
                               text=True, check=True).stdout.split())
    cluster.sbatch(["-p", "urgent", "--exclusive", f"--nodelist={nodes}", f"--nodes={count}", *SMALL,
                    "--time=5", "--job-name=urgent", "--output=/dev/null", "--wrap", "sleep 5"], cwd=REPO)


def scontrol_requeue(cluster, job: int, nodes: str) -> None:
    """What an admin or a user types to send a job back to the queue."""
    subprocess.run(["scontrol", "requeue", str(job)], env=cluster.env, check=True)


# The wrappers' #SBATCH --signal=B:USR1@90: the warning comes 90 s before the
# time limit, or up to 60 s earlier ("due to the resolution of event handling
# by Slurm", man sbatch).
WARN_OFFSET_S = 90
EARLIER_S = 60


def warn_soon(cluster, job: int, nodes: str) -> None:
    """Bring the job's time limit near, so that Slurm's own timer sends the
    wrapper's time-limit warning within about a minute instead of at the
    limit the job was submitted with. The new limit (whole minutes, as Slurm
    keeps them) leaves between WARN_OFFSET_S and WARN_OFFSET_S + EARLIER_S
    at the call: the warning is due at once, and the run still has its
    WARN_OFFSET_S to stop at a step, save and requeue. A requeued run gets
    the limit back (``release_when_requeued``)."""
    elapsed = _seconds(cluster.job(job)["RunTime"])
    minutes = -(-(elapsed + WARN_OFFSET_S) // 60)
    subprocess.run(["scontrol", "update", f"JobId={job}", f"TimeLimit={minutes}"], env=cluster.env, check=True)


def _seconds(run_time: str) -> int:
    """Slurm's [days-][hours:]minutes:seconds as seconds."""
    days, _, clock = run_time.rpartition("-")
    parts = [int(part) for part in clock.split(":")]
    while len(parts) < 3:
        parts.insert(0, 0)
    return int(days or 0) * 86400 + parts[0] * 3600 + parts[1] * 60 + parts[2]


def scancel(cluster, job: int, nodes: str) -> None:
    """The user ends the job for good."""
    subprocess.run(["scancel", str(job)], env=cluster.env, check=True)


def submit(cluster, scenario: Scenario, folder: Path) -> int:
    """sbatch the scenario's wrapper from the project folder, with ``folder``
    as the job's working folder, on its nodes and partition (15 minutes unless
    its sbatch flags set a time); the job's environment: the tests' Python as
    VENV_DIR, gloo's interface, then ``scenario.env``. A wrapper that is a
    Python launcher (launchers/submitit_train.py) is run as a user runs it,
    from ``folder``, its own flags in ``scenario.sbatch``. Returns the job id."""
    if scenario.wrapper.endswith(".py"):
        result = subprocess.run(
            [sys.executable, str(REPO / scenario.wrapper), "--partition", scenario.partition, "--job_name",
             scenario.name, "--folder", str(folder / "submitit"), "--cpus_per_task", "1", "--mem_gb", "1",
             "--time_min", str(TIME_LIMIT_MIN), "--slurm", f"nodelist={scenario.nodes}", *scenario.sbatch,
             "--", *map(str, scenario.args)],
            cwd=folder, env=dict(cluster.env, GLOO_SOCKET_IFNAME=NODE_IFACE, **scenario.env), capture_output=True,
            text=True, timeout=120)
        submitted = re.search(r"^job (\d+) submitted", result.stdout, re.M)
        if result.returncode or not submitted:
            raise RuntimeError(f"{scenario.wrapper} failed: {result.stdout}{result.stderr}")
        return int(submitted.group(1))
    time_limit = [] if any(a.startswith("--time") for a in scenario.sbatch) else [f"--time={TIME_LIMIT_MIN}"]
    return cluster.sbatch([f"--chdir={folder}", "-p", scenario.partition, f"--nodelist={scenario.nodes}", *SMALL,
                           *time_limit, f"--job-name={scenario.name}", *scenario.sbatch,
                           f"slurm/{scenario.wrapper}", *scenario.args], cwd=REPO,
                          env={"VENV_DIR": sys.prefix, "GLOO_SOCKET_IFNAME": NODE_IFACE, **scenario.env})


def job_log(folder: Path, scenario: Scenario, job: int) -> str:
    """The job's log so far ('' before it exists); a submitit job's: each task's, in task order."""
    if scenario.wrapper.endswith(".py"):
        return "".join(path.read_text() for path in sorted((folder / "submitit").glob(f"{job}_*_log.out")))
    path = folder / f"{scenario.name}-{job}.out"  # %x-%j.out; an array task's %j is its own job id
    return path.read_text() if path.exists() else ""


def release_when_requeued(cluster, job: int, info: dict, nodes: str, released: set) -> None:
    """Slurm holds a requeued job for about 2 minutes (Reason=BeginTime) while
    its nodes clean up; a test need not wait that long, only until the job's
    nodes no longer complete the last run, plus 2 s: slurmd refuses a launch
    credential issued in the same second as the revocation of the previous one.
    The run it releases has TIME_LIMIT_MIN again (``warn_soon`` shortened it),
    as has a run Slurm started itself meanwhile."""
    restarts = int(info.get("Restarts", 0))
    if info.get("Reason") != "BeginTime" or restarts in released:
        return
    states = subprocess.run(["sinfo", "-h", "-N", "-n", nodes, "-o", "%t"], env=cluster.env,
                            capture_output=True, text=True).stdout
    if "comp" in states:
        return
    time.sleep(2)
    update = subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now", f"TimeLimit={TIME_LIMIT_MIN}"],
                            env=cluster.env, capture_output=True, text=True)
    if update.returncode != 0:
        # Slurm's own BeginTime came first (the nodes took that long to clean
        # up): the job runs already, and StartTime is refused for a job no
        # longer pending. Only the time limit is given back then.
        if cluster.job(job)["JobState"] == "PENDING":
            raise RuntimeError(f"scontrol update of pending job {job} failed: {update.stderr.strip()}")
        subprocess.run(["scontrol", "update", f"JobId={job}", f"TimeLimit={TIME_LIMIT_MIN}"],
                       env=cluster.env, check=True)
    released.add(restarts)


def drive(cluster, scenario: Scenario, folder: Path) -> None:
    """Submit the scenario's job, trigger its stop once the log shows
    ``trigger_when`` (default: epoch 2's line) and its ``gate`` is open,
    release each requeued run,
    wait until the job has ended (and, with ``resubmit``, the same command
    again); the states and logs go to ``scenario.infos`` and ``.logs``."""
    deadline = time.monotonic() + SCENARIO_TIMEOUT_S
    job = submit(cluster, scenario, folder)
    total = scenario.args[scenario.args.index("--total_epochs") + 1]
    if scenario.trigger:
        wanted = scenario.trigger_when or (f"epoch 2/{total}",)
        while not all(line in job_log(folder, scenario, job) for line in wanted):
            assert time.monotonic() < deadline, f"never saw {wanted}:\n{job_log(folder, scenario, job)}"
            time.sleep(0.2)
        while scenario.gate is not None and not scenario.gate.wait(0.5):
            assert time.monotonic() < deadline, f"the gate was never opened:\n{job_log(folder, scenario, job)}"
        signalled = time.monotonic()
        scenario.trigger(cluster, job, scenario.nodes)
    released: set = set()
    while True:
        info = cluster.job(job)
        if scenario.trigger and scenario.signal_to_exit_s is None and info["JobState"] != "RUNNING":
            scenario.signal_to_exit_s = time.monotonic() - signalled
        if info["JobState"] in ENDED:
            break
        assert time.monotonic() < deadline, f"{info}\n{job_log(folder, scenario, job)}"
        if info["JobState"] == "PENDING":
            release_when_requeued(cluster, job, info, scenario.nodes, released)
        time.sleep(0.5)
    scenario.infos.append(info)
    scenario.logs.append(job_log(folder, scenario, job))
    print(f"{scenario.name}: ended {time.monotonic() - deadline + SCENARIO_TIMEOUT_S:.0f} s after its submission")
    # The same sbatch command again, or ``again``'s arguments: it resumes (the tests' hold was for the
    # first job; without DDP_TEST_FAULT, tests/train_with_fault.py runs train.py as it is).
    if scenario.resubmit or scenario.again:
        if scenario.again:
            snapshot = folder / wrapper_snapshot(scenario.name, scenario.args)
            snapshot = snapshot if snapshot.exists() else snapshot.with_suffix("")
            (shutil.copytree if snapshot.is_dir() else shutil.copy2)(snapshot, f"{snapshot}.first")
        job = submit(cluster, replace(scenario, args=list(scenario.again or scenario.args),
                                      env={name: value for name, value in scenario.env.items()
                                           if name != "DDP_TEST_FAULT"}), folder)
        scenario.infos.append(cluster.wait(job, max(deadline - time.monotonic(), 1)))
        scenario.logs.append(job_log(folder, scenario, job))


def runs(log: str) -> list:
    """The log of each run of a job (a requeued job appends to its log)."""
    starts = [m.start() for m in HEADER.finditer(log)]
    return [log[a:b] for a, b in zip(starts, starts[1:] + [len(log)])]


def ended_before_main(text: str) -> bool:
    """A run whose ranks a stop signal ended while their interpreter still
    started (importing torch, before ``main`` installs the handler): the
    batch shell got the signal, and no rank said a word, not even the process
    group's line (``device ... | backend ...``), let alone resumed or trained."""
    return ("batch shell got SIG" in text and not re.search(r"^device \S+ \| backend ", text, re.M)
            and not RESUME.search(text) and not epochs(text))


def check_resumes_exactly(texts: list, total: int, first: int = 1) -> list:
    """Each run resumes at the last position any run before it saved (a run
    stopped during start-up, or before its ranks reached ``main``, trains and
    saves nothing); every epoch from ``first`` on is summarised once over all
    runs, in order (a ``first`` above 1: ``texts`` begin with a resumed run).
    Returns the mid-epoch stops [(epoch, step)]."""
    saved, stops, summarised = None, [], []
    for index, text in enumerate(texts):
        assert "nothing to train" not in text, f"run {index} was requeued after the last epoch:\n{text}"
        if "during start-up, before the first training step" in text or ended_before_main(text):
            assert not epochs(text) and not SAVED.search(text), text  # stopped before it trained:
            continue  # nothing to resume, nothing saved
        resumed = RESUME.search(text)
        if saved is None and first > 1:
            pass  # the first of these runs resumed from a save before them: the caller checks it
        elif saved is None:
            assert not resumed, text
        else:
            assert resumed, f"run {index} did not resume:\n{text}"
            position = (resumed.group(2), resumed.group(3)) if resumed.group(2) else (resumed.group(4), None)
            assert position == saved, f"run {index} resumed at {position}, the last save was {saved}"
        summarised += [e["epoch"] for e in epochs(text)]
        for match in SAVED.finditer(text):
            saved = (match.group(1), match.group(2))
        stops += [(int(e), int(s)) for e, s, _ in STOP.findall(text)]
    assert summarised == list(range(first, total + 1)), summarised
    return stops


def show(scenario: Scenario) -> str:
    """Everything about a scenario, for an assertion's message."""
    return f"{scenario.error}\n{scenario.infos}\n" + "\n=====\n".join(scenario.logs)
