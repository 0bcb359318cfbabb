"""One live run per snapshot: the claim beside it (train_utils.snapshots.claims), judged
against real processes of this host, a stand-in squeue for Slurm's answers;
atomic_save's temporary files, each removed by its own writer only; and the
one line an unexpected failure ends with (train_utils.one_line_errors)."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import train_utils
from common import ConfigError
from train_utils.snapshots.claims import claim_snapshot, release_claim, start_ticks
from train_utils.snapshots.file import atomic_save, remove_stale_temporary_files
from helpers import REPO, error_lines, free_port, run

HOST = socket.gethostname()
REFUSED = ": two live runs must not write one snapshot; wait for that run to end (or stop it), or pass another --snapshot_path"


@pytest.fixture
def outside_slurm(monkeypatch):
    """A run started by hand: no Slurm job, no torchrun agent."""
    for name in ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    yield
    release_claim()


@pytest.fixture
def other_run():
    """A live process of this host that is not this run (another training)."""
    process = subprocess.Popen(["sleep", "120"])
    yield process
    process.kill()
    process.wait()


PIDNS = os.stat("/proc/self/ns/pid").st_ino


def claimed_by(pid: int) -> str:
    return f"host={HOST} pid={pid} start={start_ticks(pid)} pidns={PIDNS}\n"


def squeue_says(tmp_path: Path, monkeypatch, state: str) -> None:
    """squeue, first on PATH, reporting every job in ``state``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "squeue").write_text(f"#!/bin/sh\necho {state}\n")
    (bin_dir / "squeue").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")


def test_a_live_runs_claim_is_refused_naming_it_and_a_dead_ones_is_taken_over(tmp_path, outside_slurm,
                                                                             other_run, one_process_group):
    snapshot, claim = tmp_path / "two.pt", tmp_path / "two.pt.job"
    claim.write_text(claimed_by(other_run.pid))
    with pytest.raises(ConfigError) as refusal:
        claim_snapshot(str(snapshot))
    assert str(refusal.value) == f"snapshot {snapshot} is in use by pid {other_run.pid} on host {HOST}{REFUSED}"
    assert claim.read_text() == claimed_by(other_run.pid)  # left as it was
    # The same pid, now another process (started later): the claim's run has ended.
    claim.write_text(f"host={HOST} pid={other_run.pid} start=1\n")
    claim_snapshot(str(snapshot))
    assert claim.read_text() == claimed_by(os.getpid())
    release_claim()  # the run's end gives it back
    assert not claim.exists()
    other_run.kill()
    other_run.wait()  # its pid is gone
    claim.write_text(claimed_by(other_run.pid))
    claim_snapshot(str(snapshot))
    assert claim.read_text() == claimed_by(os.getpid())


def test_train_py_is_refused_before_training_while_another_run_holds_its_snapshot(tmp_path, other_run):
    """train.py itself (one process, as a launcher starts it): the same line,
    exit status 2, nothing trained, the other run's claim left as it was."""
    claim = tmp_path / "snapshot_train.pt.job"
    claim.write_text(claimed_by(other_run.pid))
    result = run([sys.executable, REPO / "train.py", "--total_epochs", "1"], tmp_path, RANK="0", LOCAL_RANK="0",
                 WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    assert result.returncode == 2
    assert error_lines(result.stderr) == [
        f"error: snapshot snapshot_train.pt is in use by pid {other_run.pid} on host {HOST}{REFUSED}"]
    assert "epoch 1/" not in result.stdout and not (tmp_path / "snapshot_train.pt").exists()
    assert claim.read_text() == claimed_by(other_run.pid)


def test_a_torchrun_restart_keeps_its_own_claim(tmp_path, outside_slurm, monkeypatch, one_process_group):
    """A worker torchrun restarted finds the claim its agent's run wrote (the
    agent, its parent, lives on): taken. The same claim seen by a process that
    is not that agent's worker names a live run: refused."""
    snapshot, claim = tmp_path / "snapshot.pt", tmp_path / "snapshot.pt.job"
    claim.write_text(claimed_by(os.getppid()))
    with pytest.raises(ConfigError, match=f"in use by pid {os.getppid()} on host"):
        claim_snapshot(str(snapshot))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "any")
    claim_snapshot(str(snapshot))
    assert claim.read_text() == claimed_by(os.getppid())


def test_a_claim_of_another_host_is_refused_saying_how_to_free_it(tmp_path, outside_slurm, one_process_group):
    snapshot, claim = tmp_path / "snapshot.pt", tmp_path / "snapshot.pt.job"
    claim.write_text("host=elsewhere pid=4242 start=77\n")
    with pytest.raises(ConfigError) as refusal:
        claim_snapshot(str(snapshot))
    assert str(refusal.value) == (f"snapshot {snapshot} is in use by pid 4242 on host elsewhere, which cannot "
                                  f"be checked from here{REFUSED}; if it has ended, delete {claim}")
    # This host's name, another pid namespace (a container on the host network): pid 4242 here says nothing.
    claim.write_text(f"host={HOST} pid=4242 start=77 pidns=1\n")
    with pytest.raises(ConfigError, match=f"pid 4242 on host {HOST}, which cannot be checked from here"):
        claim_snapshot(str(snapshot))


def test_slurm_jobs_claims_follow_squeue_and_a_requeued_job_keeps_its_own(tmp_path, outside_slurm,
                                                                           monkeypatch, other_run,
                                                                           one_process_group):
    snapshot, claim = tmp_path / "snapshot.pt", tmp_path / "snapshot.pt.job"
    monkeypatch.setenv("SLURM_JOB_ID", "8")
    squeue_says(tmp_path, monkeypatch, "RUNNING")
    claim.write_text("7\n")  # as the wrappers write it
    with pytest.raises(ConfigError, match=f"^snapshot {snapshot} is in use by job 7 \\(RUNNING\\)"):
        claim_snapshot(str(snapshot))
    # The job's own claim: taken by its run wherever the requeued job landed, and kept at the end.
    claim.write_text("job=8 host=elsewhere pid=4242\n")
    claim_snapshot(str(snapshot))
    assert claim.read_text() == f"job=8 {claimed_by(os.getpid())}"
    release_claim()
    assert claim.exists()
    # ... but not by a second run started inside the same job while the first lives.
    claim.write_text(f"job=8 {claimed_by(other_run.pid)}")
    with pytest.raises(ConfigError, match=f"in use by pid {other_run.pid} on host {HOST}, another "
                                          f"run in this job 8"):
        claim_snapshot(str(snapshot))
    squeue_says(tmp_path, monkeypatch, "COMPLETED")
    claim.write_text(f"job=7 {claimed_by(other_run.pid)}")  # squeue decides for a job, not the pid
    claim_snapshot(str(snapshot))
    assert claim.read_text() == f"job=8 {claimed_by(os.getpid())}"


def test_atomic_save_removes_only_its_own_temporary_file(tmp_path, other_run):
    """A live writer's temporary file (the same command started twice) and
    another host's stay; a writer's killed before its rename goes."""
    path = tmp_path / "two.pt"
    dead = subprocess.Popen(["true"])
    dead.wait()
    live = tmp_path / f"two.pt.{other_run.pid}@{HOST}.abcd1234.tmp"
    remote = tmp_path / f"two.pt.{dead.pid}@elsewhere.abcd1234.tmp"
    stale = tmp_path / f"two.pt.{dead.pid}@{HOST}.abcd1234.tmp"
    for temporary in (live, remote, stale):
        temporary.write_bytes(b"half a snapshot")

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        atomic_save({"a": Unpicklable()}, str(path))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, remote.name, stale.name])
    atomic_save({"a": torch.arange(3)}, str(path))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, remote.name, path.name])
    assert live.read_bytes() == b"half a snapshot"


def test_an_unexpected_exception_ends_with_one_line_that_is_torchruns_root_cause(tmp_path, monkeypatch, capsys):
    """Its traceback (where it came from), then one line naming it: the last
    line on stderr and the message of torchrun's error file; exit status 1."""
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))

    @train_utils.one_line_errors
    def main():
        raise KeyError("label")

    with pytest.raises(SystemExit) as ended:
        main()
    assert ended.value.code == 1
    stderr = capsys.readouterr().err
    line = ("error: unexpected KeyError: 'label'; the traceback above shows where: fix it there if it is your "
            "task's code, else report it with this output; a snapshot saved before is intact (the same "
            "command resumes from it)")
    assert "Traceback (most recent call last)" in stderr and stderr.splitlines()[-1] == line
    assert json.loads(error_file.read_text())["message"]["message"] == line


def test_the_claims_holder_removes_the_temporary_files_of_killed_writers_on_any_host(tmp_path):
    """A requeued job on another node finds its killed incarnation's temporary
    file (another host's name in it): the claim's holder removes it, and
    nothing else (the snapshot, a rung's own <path>.tmp, other files)."""
    path = tmp_path / "two.pt"
    keep = [path, tmp_path / "two.pt.tmp", tmp_path / "two.pt.job", tmp_path / "other.pt.1@node7.ab.tmp"]
    stale = [tmp_path / "two.pt.4242@node7.abcd1234.tmp", tmp_path / "two.pt.x1y2z3.tmp"]  # the latter: older name
    for file in keep + stale:
        file.write_bytes(b"x")
    assert sorted(remove_stale_temporary_files(str(path))) == sorted(p.name for p in stale)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in keep)
