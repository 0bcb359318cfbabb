"""A rank that hangs: the job ends at the time-out (--pg_timeout_s), no rank
left for torchrun's SIGKILL 30 s after its SIGTERM (the seconds are
printed, never asserted: they follow the machine's load), with one line
naming the stuck rank, its host and where it is (file:line, or that it is
stopped), the collective the others waited in,
and a stack file per live rank beside the snapshot.

Three hangs, each driven as a user meets it, train.py under torchrun on 2
CPU ranks: a task whose loss never returns on rank 1 (user code; also under
HSDP on 4 ranks, where the others wait in the device mesh's groups), a rank
frozen by SIGSTOP mid-step, and a rank that skips one collective (the stop
signal's all-reduce), so that the ranks end up in different collectives.
The last two are injected from the test side (tests/train_with_fault.py),
as is what must not be called a hang: a snapshot's write slower than the
time-out."""

import re
import socket
import subprocess
import sys
import time
from pathlib import Path

from helpers import FAULTY_TRAIN, REPO, TORCHRUN, error_lines, free_port, script_env

TIMEOUT_S = 10  # --pg_timeout_s
HOST = socket.gethostname()
# The synthetic task at 2 ranks, with the fault DDP_TEST_FAULT names; one epoch.
FAULTY = TORCHRUN + ["--standalone", "--nproc_per_node=2", FAULTY_TRAIN]
FAULTY_RUN = FAULTY + ["--total_epochs", "1", "--pg_timeout_s", str(TIMEOUT_S)]

# A user's task whose loss sleeps for an hour on rank 1 at its 5th training step.
STUCK_TASK = '''"""stuck_task.py: the synthetic task, its loss stuck on rank 1 at the 5th step."""
import os
import sys
import time

import torch.nn.functional as F

import common

calls = 0


def loss(output, targets, reduction="mean"):
    global calls
    calls += 1
    if calls == 5 and os.environ["RANK"] == "1":
        print("stuck_task: rank 1 stuck", file=sys.stderr, flush=True)
        time.sleep(3600)  # the hang
    return F.mse_loss(output, targets, reduction=reduction)


def build_task(args, download):
    task = common.synthetic_task(args, download)
    task.loss_fn = loss
    return task
'''


def run_timed(cmd: list, cwd: Path, stuck_line: str, **env: str) -> tuple:
    """Run ``cmd`` in ``cwd`` (stdout and stderr to cwd/log.txt); return (exit
    status, the log, the seconds from ``stuck_line`` appearing in the log to
    the job's end, and to the first ``error:`` line)."""
    log = cwd / "log.txt"
    with open(log, "w") as out:
        job = subprocess.Popen([str(part) for part in cmd], cwd=cwd, env=script_env(**env), stdout=out,
                               stderr=subprocess.STDOUT, text=True)
        stuck = error = None
        deadline = time.monotonic() + 300
        while job.poll() is None and time.monotonic() < deadline:
            text = log.read_text()
            now = time.monotonic()
            if stuck is None and stuck_line in text:
                stuck = now
            if error is None and "\nerror: " in text:
                error = now
            time.sleep(0.1)
        if job.poll() is None:
            job.kill()
        job.wait()
    end = time.monotonic()
    assert stuck is not None, log.read_text()[-3000:]
    return job.returncode, log.read_text(), end - stuck, (error or end) - stuck


def assert_no_rank_killed(log: str) -> None:
    """torchrun's failure report is in ``log`` and none of its exit codes is
    a SIGKILL (-9), which a rank still alive at the end of torchrun's 30 s
    grace after its SIGTERM gets: every rank ended by itself or at the
    SIGTERM (143). The job's end is then bounded by the time-out, whatever
    the machine's speed."""
    killed = [code for code in re.findall(r"exitcode\s*:\s*(-?\d+)", log) if code == "-9"]
    assert re.search(r"exitcode\s*:", log) and killed == [], log[-4000:]


def the_line(log: str) -> str:
    """The one line the job ends with (each rank's error lines, deduplicated:
    torchrun repeats the root cause)."""
    lines = {line for line in error_lines(log) if "timed out" in line}
    assert len(lines) == 1, log[-4000:]
    return lines.pop()


def test_a_rank_stuck_in_its_tasks_code_is_named_with_its_file_and_line(tmp_path):
    """The stuck rank answers from a thread while its main thread sleeps in the
    task's loss: the line names rank 1, its host and stuck_task.py's line of
    the sleep; both ranks wrote their stacks beside the snapshot, rank 1's
    showing the sleep; no rank is SIGKILLed (the stuck rank ends at
    torchrun's SIGTERM, the job being over)."""
    (tmp_path / "stuck_task.py").write_text(STUCK_TASK)
    sleep_line = STUCK_TASK.splitlines().index("        time.sleep(3600)  # the hang") + 1
    cmd = TORCHRUN + ["--standalone", "--nproc_per_node=2", REPO / "train.py", "--dataset",
                      "stuck_task:build_task", "--total_epochs", "2", "--pg_timeout_s", str(TIMEOUT_S)]
    status, log, ended, _ = run_timed(cmd, tmp_path, "stuck_task: rank 1 stuck", PYTHONPATH=str(tmp_path))
    assert status == 1
    line = the_line(log)
    assert line.startswith("error: rank 0 timed out waiting for the other ranks in a collective (the last "
                           "it started: #"), line
    assert re.search(r"#\d+ gloo:all_reduce Float\[\d+\] \(default group\)\) during epoch 1, training step 5 "
                     r"of this start", line), line
    assert (f"ranks that did not arrive: rank 1 (host {HOST}) is at stuck_task.py:{sleep_line} in loss, not in "
            f"collective #") in line, line
    assert f"every live rank's stack: {tmp_path}/stacks_rank*_*.txt" in line
    assert line.endswith("; no snapshot is written yet, so a restart trains from the beginning"), line
    stacks = {path.name: path.read_text() for path in tmp_path.glob("stacks_*.txt")}
    assert sorted(stacks) == [f"stacks_rank0_{HOST}.txt", f"stacks_rank1_{HOST}.txt"]
    assert "time.sleep(3600)  # the hang" in stacks[f"stacks_rank1_{HOST}.txt"]
    assert f"main thread at: stuck_task.py:{sleep_line} in loss" in stacks[f"stacks_rank1_{HOST}.txt"]
    assert "(where its collective timed out)" in stacks[f"stacks_rank0_{HOST}.txt"]
    print(f"stuck rank: the job ended {ended:.1f} s after it stuck (time-out {TIMEOUT_S} s)")
    assert_no_rank_killed(log)


def test_a_rank_stuck_under_hsdp_is_named_as_under_ddp(tmp_path):
    """The same stuck task under HSDP, 4 ranks as 2 replicas of 2 shards: the
    others wait in the device mesh's groups (rank 0 with rank 1 in the shard
    group's all-gather, ranks 2 and 3 with rank 0 in the replicate group's
    all-reduce), which torch makes with its own time-out (30 minutes on
    gloo); they follow --pg_timeout_s as the run's other groups do, so the
    job ends by itself, rank 0's line naming rank 1, its host, the line of
    the sleep, the shard group's collective and the snapshot a restart
    resumes (step 4's, written before the hang); no rank is SIGKILLed."""
    (tmp_path / "stuck_task.py").write_text(STUCK_TASK)
    sleep_line = STUCK_TASK.splitlines().index("        time.sleep(3600)  # the hang") + 1
    cmd = TORCHRUN + ["--standalone", "--nproc_per_node=4", REPO / "train.py", "--dataset", "stuck_task:build_task",
                      "--strategy", "hsdp", "--shard_size", "2", "--total_epochs", "2",
                      "--pg_timeout_s", str(TIMEOUT_S), "--snapshot_every_steps", "4", "--snapshot_sync"]
    status, log, ended, _ = run_timed(cmd, tmp_path, "stuck_task: rank 1 stuck", PYTHONPATH=str(tmp_path))
    assert status == 1, log[-4000:]
    lines = [line for line in error_lines(log) if line.startswith("error: rank 0 timed out")]
    assert len(set(lines)) == 1, log[-4000:]
    assert re.search(r"in a collective \(the last it started: #\d+ gloo:\w+ Float\[\d+\] \(mesh_shard group\)\) "
                     r"during epoch 1, training step 5 of this start", lines[0]), lines[0]
    assert (f"ranks that did not arrive: rank 1 (host {HOST}) is at stuck_task.py:{sleep_line} in loss, not in "
            f"collective #") in lines[0], lines[0]
    assert lines[0].endswith("; a restart resumes from snapshot snapshot_train_fsdp/epoch-1-step-4 (epoch 1 step 4)"), \
        lines[0]
    print(f"stuck rank under HSDP: the job ended {ended:.1f} s after it stuck (time-out {TIMEOUT_S} s)")
    assert_no_rank_killed(log)


def test_a_rank_frozen_by_sigstop_is_named_as_stopped(tmp_path):
    """A frozen rank cannot answer: rank 0 finds it stopped (SIGSTOP) on its
    host and continues it, as Slurm continues a task before it signals it;
    the line names it, its host, pid and where it froze, and the collective
    rank 0 waited in; both stacks are written; the job ends within the
    time-out, no rank SIGKILLed (else torchrun would SIGKILL the stopped rank
    only after its 30 s grace)."""
    status, log, ended, reported = run_timed(FAULTY_RUN, tmp_path, "DDP_TEST_FAULT: sigstop at step 5 on rank 1",
                                             DDP_TEST_FAULT="step:1:5:sigstop")
    assert status == 1
    line = the_line(log)
    assert re.search(r"in a collective \(the last it started: #\d+ gloo:all_reduce Float\[\d+\] \(default "
                     r"group\)\) during epoch 1, training step 5 of this start", line), line
    assert re.search(rf"ranks that did not arrive: rank 1 \(host {re.escape(HOST)}, pid \d+\) was stopped "
                     r"\(SIGSTOP\), at \S+:\d+ in \w+; continued now so that it can end\.", line), line
    assert sorted(path.name for path in tmp_path.glob("stacks_*.txt")) == [f"stacks_rank0_{HOST}.txt",
                                                                          f"stacks_rank1_{HOST}.txt"]
    print(f"frozen rank: reported {reported:.1f} s after it froze, the job ended after {ended:.1f} s "
          f"(time-out {TIMEOUT_S} s)")
    assert_no_rank_killed(log)


def test_a_rank_that_skips_a_collective_is_named_as_a_mismatch(tmp_path):
    """Rank 1 skips one of the stop signal's all-reduces: the ranks' later
    collectives pair up wrongly until they wait in different ones. Both time
    out; the line says so, naming each rank's collective and file:line; both
    stacks are written; no rank is SIGKILLed (the rest of the epoch, 20
    steps of a small model, takes a second)."""
    status, log, ended, _ = run_timed(FAULTY_RUN, tmp_path, "DDP_TEST_FAULT: skip at poll 3 on rank 1",
                                      DDP_TEST_FAULT="poll:1:3:skip")
    assert status == 1
    line = the_line(log)
    assert "ranks that did not arrive: none; the ranks timed out in different collectives (a mismatch: a rank " \
           "skipped or added one): rank 0 in #" in line, line
    assert re.search(r"rank 0 in #\d+ gloo:\w+.* at \S+:\d+ in \w+; rank 1 in #\d+ gloo:\w+.* at \S+:\d+ in \w+\.",
                     line), line
    assert sorted(path.name for path in tmp_path.glob("stacks_*.txt")) == [f"stacks_rank0_{HOST}.txt",
                                                                          f"stacks_rank1_{HOST}.txt"]
    print(f"skipped collective: the job ended {ended:.1f} s after the skip (time-out {TIMEOUT_S} s)")
    assert_no_rank_killed(log)


def test_a_snapshot_write_slower_than_the_timeout_is_no_hang(tmp_path):
    """Rank 0's first snapshot write (in the background, after epoch 1) takes
    three time-outs; the next save waits for it on rank 0 while rank 1 has
    nothing to write. The ranks wait for the write together, under
    --startup_timeout_s, not in their next collective under --pg_timeout_s:
    the run finishes, both epochs trained, no time-out line."""
    result = subprocess.run([str(part) for part in FAULTY + ["--total_epochs", "2", "--pg_timeout_s", "5"]],
                            cwd=tmp_path, env=script_env(DDP_TEST_FAULT="save:0:1:sleep15"), capture_output=True,
                            text=True, timeout=300)
    assert "DDP_TEST_FAULT: sleep15 at save 1 on rank 0" in result.stderr
    assert result.returncode == 0, result.stderr[-3000:]
    assert "epoch 2/2 |" in result.stdout
    assert not [line for line in error_lines(result.stderr) if "timed out" in line]


# One rank that makes the hang report, as rank 0 does when it found a rank
# stuck: it asks for the stacks, reads the answers, and is sent torchrun's
# SIGTERM before its line is out (torchrun sends it to every rank as soon as a
# rank that left the report to rank 0 has exited).
REPORTER = '''
import os, signal, sys, time
import torch.distributed as dist
from train_utils.distributed import hang_report
from train_utils.loop.stop import catch_stop_signals, note_stop_signals_only, received_stop_signal

catch_stop_signals()
dist.init_process_group("gloo", rank=0, world_size=1)
note_stop_signals_only()
hang_report.answer_stack_requests(sys.argv[1])
store = hang_report.request_stacks("a rank did not arrive")
answers = hang_report.collect_answers(store, 1, time.monotonic() + 30)
assert hang_report.hang_requested() and 0 in answers
os.kill(os.getpid(), signal.SIGTERM)
print("error: the report, after", signal.Signals(received_stop_signal()).name, flush=True)
os._exit(1)
'''


def test_the_rank_writing_the_report_finishes_its_line_through_a_sigterm(tmp_path):
    """The rank that asked for every rank's stack ends only once its line is
    out: a SIGTERM meanwhile is noted, not the end of it (a stuck rank, which
    makes no report, still ends at once on it: the tests above)."""
    (tmp_path / "reporter.py").write_text(REPORTER)
    result = subprocess.run([sys.executable, "reporter.py", str(tmp_path)], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120,
                            env=script_env(PYTHONPATH=str(REPO), MASTER_ADDR="127.0.0.1",
                                           MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1"))
    assert (result.returncode, result.stdout) == (1, "error: the report, after SIGTERM\n"), result.stderr[-3000:]
    assert [path.name for path in tmp_path.glob("stacks_*.txt")] == [f"stacks_rank0_{HOST}.txt"]
