"""What a user meets around a run: reruns in a folder that already holds a
snapshot, settings that differ between ranks, errors under torchrun that stay
one line, file permissions. All through train.py, the kit."""

import os
import re
import shutil
import stat
import subprocess
import sys

import pytest

from helpers import (REPO, TORCHRUN, check, epochs, error_lines, free_port, one_process, run, run_together,
                     script_env, snapshot_tensors, stdout_lines)

TORCHRUN_SCRIPT = TORCHRUN + ["--standalone", "--nproc_per_node=2", REPO / "train.py"]


# --------------------------------------------------------------------------
# Reruns that do what they say
# --------------------------------------------------------------------------

def test_rerunning_a_finished_run_says_nothing_to_train(finished_run, tmp_path):
    finished_run(tmp_path, total_epochs=2)
    before = (tmp_path / "snapshot_train.pt").read_bytes()
    again = check(one_process(["--total_epochs", "2", "--lr", "0.01"], tmp_path))
    assert stdout_lines(again.stdout.strip())[-1] == (
        "snapshot snapshot_train.pt already holds all 2 epochs: nothing to train (raise --total_epochs "
        "to train on, or delete it or pass another --snapshot_path to start afresh)")
    assert not epochs(again.stdout) and "test | loss" not in again.stdout  # no look of a run
    assert (tmp_path / "snapshot_train.pt").read_bytes() == before


def test_fewer_epochs_than_the_snapshot_holds_is_refused(finished_run, tmp_path):
    finished_run(tmp_path, total_epochs=2)
    before = (tmp_path / "snapshot_train.pt").read_bytes()
    result = one_process(["--total_epochs", "1"], tmp_path)
    assert result.returncode != 0
    assert error_lines(result.stderr) == [
        "error: --total_epochs 1 is below the 2 epochs snapshot snapshot_train.pt already holds; raise "
        "--total_epochs, or delete it or pass another --snapshot_path to start afresh"]
    assert (tmp_path / "snapshot_train.pt").read_bytes() == before


@pytest.mark.parametrize("flags, line", [
    (["--seed", "1"],  # the seed also draws the validation split
     "error: snapshot snapshot_train.pt comes from a different run (seed 0 -> 1); resume with its settings, or "
     "delete it or pass another --snapshot_path to start afresh"),
    (["--input_path", "torchvision"],  # a flag of the image tasks, which the synthetic task does not read
     "error: --input_path is a flag of vision_tasks.py's tasks, which --dataset synthetic does not read; leave it "
     "out, or train one of mnist, cifar10"),
])
def test_a_snapshot_of_other_data_or_seed_is_refused_naming_the_fix(flags, line, finished_run, tmp_path):
    finished_run(tmp_path)
    before = (tmp_path / "snapshot_train.pt").read_bytes()
    result = one_process(["--total_epochs", "2", *flags], tmp_path)
    assert result.returncode != 0
    assert error_lines(result.stderr) == [line]
    assert (tmp_path / "snapshot_train.pt").read_bytes() == before


def test_ranks_started_with_different_settings_stop_in_one_line(tmp_path):
    """Two nodes given different --batch_size: one line naming the flag and
    who has which value, before any training (not a gloo enforce error)."""
    port = free_port()
    cmds = [TORCHRUN + ["--nnodes=2", "--nproc_per_node=1", "--rdzv-backend=c10d",
                        f"--rdzv-endpoint=localhost:{port}", f"--rdzv-id=settings{port}",
                        f"--rdzv-conf=is_host={int(node == 0)}", REPO / "train.py",
                        "--total_epochs", "2", "--batch_size", str(32 * (node + 1))]
            for node in range(2)]
    outputs = run_together(cmds, [tmp_path, tmp_path], script_env(), timeout=120)
    assert all(code != 0 for code, _, _ in outputs)
    errors = [line for _, _, err in outputs for line in error_lines(err)]
    assert errors == ["error: ranks disagree on --batch_size: 32 on ranks [0], 64 on ranks [1]; "
                      "start every process with the same arguments"]
    assert not any(epochs(out) for _, out, _ in outputs)
    assert not (tmp_path / "snapshot_train.pt").exists()


# --------------------------------------------------------------------------
# Errors that stay one line under torchrun
# --------------------------------------------------------------------------

def torchruns_own(line: str) -> bool:
    """A line torchrun's agent logs itself (W1125 12:00:00.000000 123 torch/...),
    or of its banner about OMP_NUM_THREADS (which comes without that prefix
    when started as python -m torch.distributed.run)."""
    return bool(re.match(r"[WEI]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ ", line)) or not line.strip("* ") or \
        line.startswith("Setting OMP_NUM_THREADS environment variable")


def test_a_typo_under_torchrun_is_one_line_and_the_root_cause(tmp_path):
    """The scripts' part of a usage error under torchrun is one line (no usage
    block, not once per rank); the rest is torchrun's own failure report."""
    result = run(TORCHRUN_SCRIPT + ["--total_epochs", "0"], tmp_path)
    assert result.returncode != 0
    line = "error: argument --total_epochs: must be > 0, got 0"
    ours = [text for text in result.stderr.split("Traceback (most recent call last)")[0].splitlines()
            if not torchruns_own(text)]
    assert ours == [f"train.py: {line} (train.py --help lists every flag)"], result.stderr
    root_cause = result.stderr.split("Root Cause")[1]
    assert line in root_cause and "To enable traceback" not in root_cause


def test_flags_spelled_as_in_pytorch_examples_or_nanogpt_get_the_flag_meant(tmp_path):
    """pytorch/examples (and tutorial 004) spell --batch-size and --epochs,
    nanoGPT --learning_rate and --eval_interval: the error names the flags
    these scripts take; an unknown flag gets no guess."""
    result = run([sys.executable, REPO / "train.py", "--batch-size", "64", "--epochs", "2", "--learning_rate",
                  "6e-4", "--eval_interval=250"], tmp_path)
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1] == (
        "train.py: error: unrecognized arguments: --batch-size 64 --epochs 2 --learning_rate 6e-4 "
        "--eval_interval=250 (did you mean: --batch-size -> --batch_size, --epochs -> --total_epochs, "
        "--learning_rate -> --lr, --eval_interval -> --eval_every_steps?)")
    result = run([sys.executable, REPO / "train.py", "--bogus"], tmp_path)
    assert result.stderr.splitlines()[-1] == "train.py: error: unrecognized arguments: --bogus"


def test_the_scripts_import_and_train_without_posix_only_signals(tmp_path):
    """Windows has no SIGUSR1 or signal masks: with them taken out of the
    signal module, the kit imports and train.py trains, as one rank of a
    launcher's group (the closest check of a Windows start-up these Linux
    machines allow; SIGKILL stays: torch's own elastic module names it at import here)."""
    code = ("import runpy, signal, sys\n"
            "for name in ('SIGUSR1', 'SIGUSR2', 'pthread_sigmask'):\n"
            "    delattr(signal, name)\n"
            f"sys.path.insert(0, {str(REPO)!r})\n"
            "import train_utils.loop.stop, train\n"
            "assert train_utils.loop.stop.STOP_SIGNALS == (signal.SIGTERM, signal.SIGINT)\n"
            "sys.argv = ['train.py', '--total_epochs', '1']\n"
            f"runpy.run_path({str(REPO / 'train.py')!r}, run_name='__main__')\n")
    result = check(run([sys.executable, "-c", code], tmp_path, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())))
    assert len(epochs(result.stdout)) == 1 and "test | loss" in result.stdout


def test_a_config_error_is_torchruns_root_cause(finished_run, tmp_path):
    finished_run(tmp_path)
    result = run(TORCHRUN_SCRIPT + ["--total_epochs", "2", "--batch_size", "16"], tmp_path)
    assert result.returncode != 0
    root_cause = result.stderr.split("Root Cause")[1]
    assert ("error: snapshot snapshot_train.pt comes from a different run (batch_size 32 -> 16)"
            in root_cause)
    assert "To enable traceback" not in root_cause


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600)])
def test_saved_files_honour_the_umask(umask, mode, tmp_path):
    """As torch.save's own files do: a group that shares a project folder can read them."""
    cmd = [sys.executable, str(REPO / "train.py"), "--total_epochs", "1"]
    env = script_env(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                            preexec_fn=lambda: os.umask(umask))
    check(result)
    assert stat.S_IMODE((tmp_path / "snapshot_train.pt").stat().st_mode) == mode


def _tmpfs_works(folder) -> bool:
    """Whether this machine lets a test mount a tmpfs in a mount namespace of its own."""
    return shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "-rm", "sh", "-c", 'mount -t tmpfs -o size=64k tmpfs "$0"', str(folder)],
        capture_output=True).returncode == 0


def run_on_a_tmpfs(tmp_path, size: str, before: str, after: str, flags: list):
    """train.py at 2 ranks (``flags``) in ``tmp_path``, its folder ``full`` a
    tmpfs of ``size`` in a mount namespace of the run's own: ``before`` (shell)
    runs once it is mounted, ``after`` once the run ended, then ``ls -A full``
    goes to left.txt. Skips where no such namespace can be made."""
    (tmp_path / "full").mkdir()
    if not _tmpfs_works(tmp_path / "full"):
        pytest.skip("no mount namespace for a tmpfs here (unshare -rm refused)")
    script = (f'mount -t tmpfs -o size={size} tmpfs full && {before}{{ "$@"; status=$?; {after}'
              f'ls -A full > left.txt; exit $status; }}')
    return run(["unshare", "-rm", "sh", "-c", script, "sh", *TORCHRUN_SCRIPT, *flags], tmp_path)


def test_a_full_disk_at_a_save_is_one_line_naming_the_intact_snapshot(tmp_path):
    """--snapshot_path on a 64 KiB tmpfs (a real ENOSPC): the first snapshot
    (about 37 KB: 10 pages of 4 KiB, the claim file one more) fits, the
    second's temporary file beside it does not. One line on rank 0,
    also torchrun's root cause; the first snapshot stays whole, nothing else is
    left there. The tmpfs lives in a mount namespace of the run's own."""
    result = run_on_a_tmpfs(tmp_path, "64k", "", "cp full/two.pt kept.pt; ",
                            ["--total_epochs", "2", "--save_every", "1", "--snapshot_path", "full/two.pt"])
    assert result.returncode == 1, result.stderr
    line = (f"error: cannot save snapshot full/two.pt: No space left on device (writing in {tmp_path}/full); "
            "snapshot full/two.pt (after epoch 1) is intact: free space on that disk, or pass a "
            "--snapshot_path on another disk after moving it there; then run the same command to resume from it")
    assert error_lines(result.stderr) == [line]
    assert result.stderr.count("Traceback (most recent call last)") == 1  # torchrun's own; none of a worker
    assert line in result.stderr.split("Root Cause")[1]
    assert snapshot_tensors(tmp_path / "kept.pt")[0] == 1
    # No temporary file, the claim given back; the goodput ledger and timeline beside the snapshot stay.
    assert (tmp_path / "left.txt").read_text().split() == ["two.pt", "two.pt.goodput.jsonl", "two.pt.timeline.json"]


def test_a_claim_that_cannot_be_written_on_a_full_disk_leaves_nothing(tmp_path):
    """--snapshot_path on a one-page tmpfs already full: the claim file is
    created but its line cannot be written; one line, exit 2, and no empty
    claim left behind (it would hold the next run's claim check up)."""
    result = run_on_a_tmpfs(tmp_path, "4k", "head -c 4096 /dev/zero > full/filler && ", "",
                            ["--total_epochs", "1", "--snapshot_path", "full/one.pt"])
    assert result.returncode != 0, result.stderr
    assert error_lines(result.stderr) == [
        "error: cannot write full/one.pt.job (the snapshot's claim: No space left on device); free space "
        "there, or pass another --snapshot_path"]
    assert (tmp_path / "left.txt").read_text() == "filler\n"


# --------------------------------------------------------------------------
# One prefix for every error line the project prints
# --------------------------------------------------------------------------

# A message the project writes that starts with another spelling of "error:".
OTHER_PREFIX = re.compile(r"""(?:print\(f?|exit\(f?|echo |Error\(f?)["'](?:Error|ERROR|Fatal|FATAL|fatal)\b[:!]?""")


def test_every_error_line_the_project_prints_starts_with_error_colon():
    """The scripts, train_utils, the task modules, the benchmark and the Slurm
    wrappers all say `error: ...` (and `warning: ...`), as argparse does."""
    sources = [*REPO.glob("*.py"), *REPO.glob("train_utils/**/*.py"), *REPO.glob("benchmarks/*.py"),
               *REPO.glob("slurm/*.sh")]
    found = [f"{path.relative_to(REPO)}:{number}: {line.strip()}" for path in sources
             for number, line in enumerate(path.read_text().splitlines(), start=1) if OTHER_PREFIX.search(line)]
    assert not found, "\n".join(found)


def test_the_prefix_check_can_fail():
    assert OTHER_PREFIX.search('print(f"Error: no such file", file=sys.stderr)')
    assert OTHER_PREFIX.search('echo "ERROR: not found" >&2')
    assert not OTHER_PREFIX.search('print(f"error: {exc}", file=sys.stderr)')
