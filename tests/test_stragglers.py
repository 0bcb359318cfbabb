"""A rank slower than its peers is named by rank 0 in one line, with real
faults on this machine: one rank's loader sleeping (a slow disk under it),
one rank's process held by a cgroup v1 CPU quota (a throttled node). Each
fault starts at that rank's 10th batch and is far larger than a step (tens
of milliseconds against a fraction of one), so that its detection never
depends on the machine's speed. That a clean run prints no such line is
checked on every run the suite checks (helpers.check)."""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path

import pytest

from helpers import IN_CI, LINK_LINE, PODS, REPO, STRAGGLER_LINE, run

TASK = REPO / "tests" / "straggler_task.py"
FIRST = 10  # the fault's first batch on rank 1
LAST = 50  # its last: 40 slow steps, then a clean rest of the run
WITHIN = 40  # a fault is named within this many steps of its start
# The synthetic task at 2 ranks, 57 steps an epoch at --batch_size 16: 114 steps.
RUN = [*PODS, "--nproc_per_node=2", REPO / "train.py", "--dataset", "straggler_task:build_task", "--batch_size", "16",
       "--total_epochs", "2", "--snapshot_path", "snapshot.pt"]
CPU_CGROUP = Path("/sys/fs/cgroup/cpu")  # cgroup v1's cpu controller


def straggler_lines(output: str) -> list:
    """The straggler lines of a run's output, as (rank, host, phase, first step, last step, the rest, started)."""
    found = []
    for line in output.splitlines():
        match = STRAGGLER_LINE.match(line)
        if match:
            started = " is slow in " in line
            found.append((int(match["rank"]), match["host"], match["phase"], int(match["first"]),
                          int(match["last"]), match["rest"], started))
    return found


def assert_named(output: str, phase: str, also: tuple = ()) -> list:
    """``output`` names rank 1 on this host as slow in ``phase`` within
    ``WITHIN`` steps of the fault's start, then as no longer slow after its
    end, and names nothing else (but rank 1 in the phases ``also``, in
    either order). Returns the start line's parts."""
    found = straggler_lines(output)
    lines = [line for line in found if line[2] == phase]
    assert [(rank, host, name, started) for rank, host, name, _, _, _, started in lines] == [
        (1, socket.gethostname(), phase, True), (1, socket.gethostname(), phase, False)], output[-3000:]
    assert all(line[:2] == (1, socket.gethostname()) and line[2] in also for line in found if line not in lines), \
        output[-3000:]
    start, end = lines
    assert start[4] <= FIRST + WITHIN, start  # its last step: the step at which the ranks compared
    assert end[4] > LAST, end  # compared after the fault ended
    return start


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_rank_whose_loader_sleeps_is_named_with_the_line_it_sleeps_at(tmp_path, num_workers):
    """Rank 1's dataset sleeps 2 ms a sample (32 ms a batch of 16) from its
    10th batch to its 50th: rank 0 names rank 1, this host, the data phase
    and straggler_task.py's line of the sleep in __getitem__, within 40 steps
    of the start; and once more when it ends; rank 0 is never named. With
    --num_workers 0 the line is sampled from the rank's own stack, with 2
    loader workers (which sleep in turn: 16 ms a step) from theirs."""
    result = run([*RUN, "--num_workers", str(num_workers)], tmp_path, PYTHONPATH=str(TASK.parent),
                 STRAGGLER_FAULT=f"sleep:1:{FIRST}:{LAST}:0.002")
    assert result.returncode == 0, result.stderr[-3000:]
    start = assert_named(result.stdout, "data")
    line = TASK.read_text().splitlines().index(f"            {_sleep_statement()}") + 1
    loader = "its loader workers spend" if num_workers else "its loader spends"
    assert start[5].endswith(f"; {loader} the time at {TASK}:{line} in __getitem__"), start


def _sleep_statement() -> str:
    import straggler_task

    return straggler_task.SLEEP_LINE


def _cpu_cgroup_folder() -> Path:
    """This process's folder in cgroup v1's cpu controller (/proc/self/cgroup's ``cpu`` line)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(","):
            return CPU_CGROUP / path.lstrip("/")
    return CPU_CGROUP


def test_a_rank_held_by_a_cpu_quota_is_named_in_compute(tmp_path):
    """Rank 1 moves itself into a cgroup v1 CPU folder with a quota of 1 ms
    of CPU per 50 ms at its 10th batch and back out after its 50th: rank 0
    names rank 1, this host and the compute phase (its forward, backward and
    optimizer step, less the gradient all-reduce's wait, in which rank 0
    waits for it) within 40 steps, and once more when it ends (its loader,
    in its thread under the same quota, may be named in data too)."""
    quota = CPU_CGROUP / "cpu.cfs_quota_us"
    if not quota.exists() or not os.access(CPU_CGROUP, os.W_OK):
        reason = "no writable cgroup v1 cpu controller at /sys/fs/cgroup/cpu (cgroup v2 only, or not root)"
        assert not IN_CI, reason  # CI's machine has one: the test must run there
        pytest.skip(reason)
    folder = _cpu_cgroup_folder() / f"straggler_test_{os.getpid()}"
    folder.mkdir()
    try:
        # 2% of a core, in slices of 1 ms every 50 ms: far below what a process gets on a loaded machine
        # (with 10%, a CI run of 4 test processes on 2 cores gave rank 0 too little more than rank 1:
        # not 3 times its speed, and nothing was named).
        (folder / "cpu.cfs_period_us").write_text("50000")
        (folder / "cpu.cfs_quota_us").write_text("1000")
        result = run(RUN, tmp_path, PYTHONPATH=str(TASK.parent), STRAGGLER_FAULT=f"cgroup:1:{FIRST}:{LAST}:{folder}")
    finally:
        for pid in (folder / "cgroup.procs").read_text().split():  # a rank that did not move back (a failure)
            (folder.parent / "cgroup.procs").write_text(pid)
        folder.rmdir()
    assert result.returncode == 0, result.stderr[-3000:]
    # Its loader runs in the rank's thread, under the same quota: it may be named in data as well.
    assert_named(result.stdout, "compute", also=("data",))


def test_straggler_lines_read_back():
    """STRAGGLER_LINE reads the line rank 0 prints (stragglers.straggler_line), both kinds."""
    from train_utils.loop.stragglers import straggler_line

    started = straggler_line(3, "data", (0.0523, 0.0011, 17, 40), True, {"host": "node7", "where": "its loader x"})
    ended = straggler_line(3, "data", (0.0012, 0.0011, 81, 104), False, {"host": "node7"})
    assert straggler_lines(f"{started}\n{ended}\n") == [(3, "node7", "data", 17, 40, "; its loader x", True),
                                                        (3, "node7", "data", 81, 104, "", False)]
    assert re.fullmatch(r"straggler: rank 3 \(host node7\) is slow in data: 52\.3 ms a step against 1\.1 ms on "
                        r"the other ranks \(median\), over steps 17-40; its loader x", started)


def test_a_slow_link_between_hosts_is_named_by_its_two_ends_and_again_once_it_is_not(capsys):
    """The link verdict, in process: 4 ranks on 2 hosts (a, a, b, b) have two
    links between hosts, 1 -> 2 and 3 -> 0 (each probed by its receiver).
    The probe from rank 1 to rank 2 takes 40 ms against 0.3 ms for 3 windows:
    rank 0 names that link once, by both ends, read back by LINK_LINE; 3
    windows at 0.3 ms, and it says once that it is no longer slow. The data
    and compute columns stay even: no rank is named. One host: no probe.
    (The probe itself, over a link tc tbf slows: test_slurm.py's
    test_a_slow_link_between_two_hosts_is_named_by_its_two_ends.)"""
    import torch

    from train_utils.loop.links import link_turns
    from train_utils.loop.phases import StepPhases
    from train_utils.loop.stragglers import WINDOW_STEPS, WINDOWS, StragglerWatch

    watch = StragglerWatch(StepPhases(), 0, 4, lambda: 0, hosts=["a", "a", "b", "b"])
    assert watch.links is not None and watch.links.links == [0, 2]
    # The links take turns, so that no host sends and receives a probe at once: link i (into host i)
    # and link i + 1 (out of host i) never share a turn, around the ring of hosts.
    assert link_turns([0, 2]) == {0: 0, 2: 1}
    for hosts in range(2, 8):
        turns = [link_turns(list(range(hosts)))[host] for host in range(hosts)]
        assert all(turns[host] != turns[(host + 1) % hosts] for host in range(hosts)), turns
    assert StragglerWatch(StepPhases(), 0, 4, lambda: 0, hosts=["a"] * 4).links is None

    def window(number: int, slow_link_s: float) -> None:
        first = number * WINDOW_STEPS + 1
        watch.sent = (first, first + WINDOW_STEPS - 1, WINDOW_STEPS)
        table = torch.zeros(4, 3)
        table[:, :2] = 0.01 * WINDOW_STEPS  # every rank: 10 ms a step of data and of compute
        table[0, 2], table[2, 2] = 0.0003, slow_link_s
        watch.compare(table.flatten())

    for number in range(WINDOWS):
        window(number, 0.040)
    named = capsys.readouterr().out
    for number in range(WINDOWS, 2 * WINDOWS + 2):
        window(number, 0.0003)
    ended = capsys.readouterr().out
    lines = [match.groupdict() for match in LINK_LINE.finditer(named + ended)]
    assert [(line["sender"], line["sender_host"], line["receiver"], line["receiver_host"], line["state"])
            for line in lines] == [("1", "a", "2", "b", "slow"), ("1", "a", "2", "b", "no longer slow")], named + ended
    assert (lines[0]["first"], lines[0]["last"]) == ("1", str(WINDOWS * WINDOW_STEPS))
    assert "256 KiB in 40.0 ms (6.6 MB/s) against 0.3 ms on the other links between hosts (median)" in named
    assert not STRAGGLER_LINE.search(named + ended)


def test_step_phases_time_each_phase_apart():
    """StepPhases on the CPU: the data phase is each ``next`` of the loader;
    compute less the wait from its own backward's end to backward's return
    counts as compute, that wait as collective; totals add up the steps,
    last_step is the last one closed; listeners hear each host phase."""
    import time

    from train_utils.loop.phases import StepPhases

    phases = StepPhases()
    heard = []
    phases.listeners.append(lambda phase, start, seconds: heard.append(phase))

    def slow_batches():
        for batch in range(2):
            time.sleep(0.02)  # the loader's wait
            yield batch

    for _ in phases.data(slow_batches()):
        with phases.phase("compute"):
            time.sleep(0.03)  # own work
            phases.note_own_backward_end()
            time.sleep(0.2)  # waiting in the gradient all-reduce
            phases.note_backward_end()
        with phases.phase("snapshot"):
            pass
        last = phases.end_step()
    totals = phases.totals()
    assert phases.steps == 2 and last == phases.last_step()
    # Lower bounds, and the wait kept out of compute (a sleep may overrun on a busy machine, by far less than 0.2 s).
    assert last["data"] >= 0.02 and 0.03 <= last["compute"] < 0.2 and last["collective"] >= 0.2, last
    assert totals["data"] >= 0.04 and 0.06 <= totals["compute"] < 0.4 and totals["collective"] >= 0.4, totals
    assert heard == ["data", "compute", "snapshot"] * 2  # the loader's end is no data phase


def test_a_worker_killed_while_it_waits_for_the_sampling_flag_leaves_it_working():
    """The flag that turns the loader workers' stack sampling on
    (stragglers.PipeFlag) is shared with processes that the DataLoader ends
    at any moment (after every epoch): one killed (SIGKILL) while it waits
    on it leaves nothing held. set() returns, a process started after sees
    the flag set, clear() unsets it. (A multiprocessing Event's set() hangs
    here: its Condition waits for the dead waiter to wake.) Forked: the
    flag's pipe is inherited, as a fork server passes it to a worker."""
    import multiprocessing
    import signal
    import threading
    import time

    from train_utils.loop.stragglers import PipeFlag

    context = multiprocessing.get_context("fork")
    flag = PipeFlag()
    waiter = context.Process(target=flag.wait)
    waiter.start()
    time.sleep(0.3)  # into its select
    os.kill(waiter.pid, signal.SIGKILL)
    waiter.join()
    setting = threading.Thread(target=flag.set, daemon=True)
    setting.start()
    setting.join(10)
    assert not setting.is_alive(), "set() hangs after a waiter was killed"
    reader = context.Process(target=_exit_1_unless_set, args=(flag,))
    reader.start()
    reader.join(30)
    assert reader.exitcode == 0 and flag.is_set()
    flag.clear()
    assert not flag.is_set()


def _exit_1_unless_set(flag) -> None:
    os._exit(0 if flag.wait(10) else 1)
