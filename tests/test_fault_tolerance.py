"""Real faults in the kit, train.py under torchrun: killed workers, torn and
corrupt snapshots, crafted files, failing and hanging ranks, uneven data, bad
input, stop signals. (The rungs' own resume is tested with the rungs.)

Faults are injected from the test side: FAULTY_TRAIN (tests/train_with_fault.py)
runs train.py with the fault the DDP_TEST_FAULT environment variable names
("POINT:RANK:N:ACTION"); or they are made by hand (truncated files, crafted
pickles, busy paths)."""

import json
import os
import re
import signal
import subprocess
import time

import pytest
import torch

from dataset_files import build_mnist_root
from helpers import (FAULTY_TRAIN, PODS, REPO, load_task, signal_when, TORCHRUN, assert_goodput, assert_same_snapshot,
                     check, epochs, error_lines, held_at_step, one_process, parse_test, run, script_env, stdout_lines)

import train_utils
from common import ConfigError
from train_utils.distributed.devices import torch_version
from train_utils.snapshots.file import read_snapshot
from train_utils.loop.speed import check_amp

TORCHRUN_SCRIPT = TORCHRUN + ["--standalone", "--nproc_per_node=2", REPO / "train.py"]
# Where torchrun is not what a run tests (an uninterrupted reference, a resume): its ranks as pods.
PODS_SCRIPT = PODS + ["--nproc_per_node=2", REPO / "train.py"]
# The same with a fault injected: FAULTY_TRAIN, for the runs given DDP_TEST_FAULT.
FAULTY_SCRIPT = TORCHRUN + ["--standalone", "--nproc_per_node=2", FAULTY_TRAIN]
SNAPSHOT = "snapshot_train.pt"  # its default --snapshot_path


@pytest.fixture(scope="module")
def small_mnist(tmp_path_factory):
    """600 real digits: 540 to train (180 per rank of 3, 5 steps of 32), 60 to validate."""
    return build_mnist_root(tmp_path_factory.mktemp("small_mnist"), n_train=600, n_test=100)


# --------------------------------------------------------------------------
# 1. A worker SIGKILLed mid-epoch; torchrun restarts; the result is unchanged
# --------------------------------------------------------------------------

def test_killed_worker_is_restarted_and_the_result_is_bitwise_unchanged(small_mnist, tmp_path):
    """The final weights, optimizer and schedule state are bitwise those of an
    uninterrupted run, and each epoch's summary (a sum over every sample of
    the epoch, the resumed one's carried over the restart) is exactly the
    uninterrupted one's: no batch was trained twice or skipped. The MNIST
    CNN's dropout needs every rank's RNG state restored mid-epoch; 3 ranks,
    because with 3 or more a resume must also lay out DDP's gradient buckets
    as the run before did (a different layout sums in another order); and
    --amp where this CPU allows it (bf16), whose cast nodes change that
    layout (test_a_resume_under_amp_lays_out_ddps_buckets_as_the_autocast_run).
    The goodput ledger counts two attempts, the first's step after the
    snapshot as redone, and the timeline a track per rank of each."""
    # A recipe with state of its own: the cosine schedule's step, AdamW's moments.
    flags = ["--total_epochs", "2", "--snapshot_every_steps", "3", "--dataset", "mnist", "--data_dir", small_mnist,
             "--optimizer", "adamw", "--lr", "0.003", "--lr_schedule", "cosine", "--warmup_epochs", "0.5",
             "--clip_grad_norm", "1", "--metrics_path", "m.jsonl"]
    try:
        check_amp("auto", torch.device("cpu"), "cnn")
        flags.append("--amp")
    except ConfigError as refused:
        print(f"--amp refused on this CPU, trained without: {refused}")
    # 5 steps an epoch a rank (540 digits, 3 ranks, batches of 32); killed before
    # the 10th step (epoch 2's 5th), the 9th trained after the epoch's step-3
    # snapshot (the run's step 8): one step redone.
    kill_at = 10
    (tmp_path / "clean").mkdir()
    (tmp_path / "killed").mkdir()
    check(run(PODS + ["--nproc_per_node=3", REPO / "train.py"] + flags, tmp_path / "clean"))
    launched = time.time()
    killed = check(run(TORCHRUN + ["--standalone", "--nproc_per_node=3", "--max-restarts=3", FAULTY_TRAIN] + flags,
                       tmp_path / "killed", DDP_TEST_FAULT=f"step:1:{kill_at}:kill_once_saved"))
    assert f"DDP_TEST_FAULT: kill_once_saved at step {kill_at} on rank 1" in killed.stderr
    # The restart is announced once, before the start-up line (rank 0 prints).
    assert killed.stdout.count("note: torchrun started these workers again (restart 1 of at most 3, "
                               "--max-restarts) after a worker failed; the run goes on from its last "
                               "snapshot\ndevice cpu | backend gloo | world_size 3") == 1, killed.stdout
    # It resumed inside an epoch, from the last mid-epoch snapshot.
    assert "resuming from snapshot snapshot_train.pt in epoch 2 after step 3" in killed.stdout
    assert "epoch 2/2" in killed.stdout
    assert_same_snapshot(tmp_path / "clean" / SNAPSHOT, tmp_path / "killed" / SNAPSHOT)
    assert_goodput(tmp_path / "killed" / SNAPSHOT, [3, 3], [kill_at - 1 - 8], killed.stdout, since=launched)

    def losses(path):
        return [(r["epoch"], r["train_loss"], r["val_loss"], r["samples"])
                for r in map(json.loads, path.read_text().splitlines()) if "epoch" in r]

    assert losses(tmp_path / "killed" / "m.jsonl") == losses(tmp_path / "clean" / "m.jsonl")
    assert [epoch for epoch, *_ in losses(tmp_path / "killed" / "m.jsonl")] == [1, 2]  # each once


# --------------------------------------------------------------------------
# 2. Killed while writing a snapshot: the previous one is intact and used
# --------------------------------------------------------------------------

def test_kill_while_writing_a_snapshot_keeps_the_previous_one(kit_run, tmp_path):
    """Saves: epoch 1 steps 10 and 20, then epoch 2 step 10 (the 3rd), killed
    after its temporary file is written, before the rename. torchrun's
    restart resumes from the one before, and the run ends bitwise as one
    never killed (the same flags but the snapshot cadence, which changes no
    tensor)."""
    killed = check(run(TORCHRUN + ["--standalone", "--nproc_per_node=2", "--max-restarts=1", FAULTY_TRAIN,
                                   "--total_epochs", "2", "--snapshot_every_steps", "10"],
                       tmp_path, DDP_TEST_FAULT="save:0:3:kill"))
    assert "DDP_TEST_FAULT: kill at save 3 on rank 0" in killed.stderr
    assert "resuming from snapshot snapshot_train.pt in epoch 1 after step 20" in killed.stdout
    clean, _ = kit_run("ddp", "--total_epochs", 2)
    assert_same_snapshot(clean / SNAPSHOT, tmp_path / SNAPSHOT)
    assert sorted(p.name for p in tmp_path.iterdir()) == [  # no stale temp; the goodput ledger and timeline
        "snapshot_train.pt", "snapshot_train.pt.goodput.jsonl", "snapshot_train.pt.timeline.json"]


def test_a_snapshot_is_written_while_training_goes_on(tmp_path):
    """The first snapshot (epoch 1 step 20) is held in its write, after the
    temporary file, before the rename (the injected fault, until a stop signal
    comes): the rest of epoch 1 trains and is summarised meanwhile; the next
    snapshot, the epoch's end (--save_every 1), waits for it, so the signal
    comes while rank 0 waits there, however fast the machine trains. On
    SIGTERM the held write completes, then the stop's snapshot is written
    before the ranks exit, and the same command resumes from it and finishes."""
    flags = ["--total_epochs", "2", "--snapshot_every_steps", "20", "--save_every", "1"]
    held = "DDP_TEST_FAULT: wait_signal at save 1 on rank 0"
    text = signal_when(FAULTY_SCRIPT + flags, tmp_path, (held, "epoch 1/2 | train_loss"), signal.SIGTERM,
                       DDP_TEST_FAULT="save:0:1:wait_signal")
    # Epoch 1 was summarised before the held write completed, and the epoch's own
    # snapshot came after it. (Where the fault's line falls among them depends on
    # when the writer thread reaches the fault: not asserted.)
    assert held in text and text.index("epoch 1/2 | train_loss") < \
        text.index("epoch 1 step 20 | snapshot saved at snapshot_train.pt") < \
        text.index("epoch 1 | snapshot saved at snapshot_train.pt"), text
    # The stop's snapshot is the last one written (a write in flight prints its line first).
    after_stop = text.split("stopped by SIGTERM")[1]
    step = re.findall(r"^epoch 2 step (\d+) \| snapshot saved at snapshot_train.pt$", after_stop, re.M)[-1]
    resumed = check(run(PODS_SCRIPT + flags, tmp_path))
    assert f"resuming from snapshot snapshot_train.pt in epoch 2 after step {step}" in resumed.stdout
    assert [e["epoch"] for e in epochs(resumed.stdout)] == [2]


def test_snapshot_every_s_takes_them_on_every_rank_after_the_same_step(tmp_path):
    """--snapshot_every_s shorter than a step: rank 0's clock asks at every
    step, its request reaches every rank at the next one, so every other step
    snapshots whatever the machine's speed (28 steps: 2, 4, ... 26, then the
    epoch's end); --snapshot_sync writes them before training goes on."""
    result = check(run(PODS_SCRIPT + ["--total_epochs", "1", "--snapshot_every_s", "0.000001",
                                          "--snapshot_sync"], tmp_path))
    saved = re.findall(r"^epoch 1(?: step (\d+))? \| snapshot saved at snapshot_train.pt$", result.stdout, re.M)
    assert saved == [str(step) for step in range(2, 28, 2)] + [""], result.stdout


# --------------------------------------------------------------------------
# 3-5. Snapshots that must not be used
# --------------------------------------------------------------------------

def test_truncated_snapshot_stops_with_one_line_and_is_kept(finished_run, tmp_path):
    path = finished_run(tmp_path)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    torn = path.read_bytes()
    result = one_process(["--total_epochs", "2"], tmp_path)
    assert result.returncode != 0
    errors = error_lines(result.stderr)
    assert len(errors) == 1 and errors[0].startswith("error: cannot read snapshot snapshot_train.pt (")
    assert "move it away to start afresh" in errors[0]
    assert path.read_bytes() == torn  # never silently replaced by a fresh start
    assert "epoch 1/2" not in result.stdout


class _Payload:
    """What a hostile snapshot holds: an object whose unpickling runs a command."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def test_crafted_snapshot_is_refused_and_its_code_never_runs(tmp_path, monkeypatch):
    """read_snapshot, as train.py resumes (a damaged snapshot's refusal end to
    end: the truncated one above): one short line that names what was refused,
    without torch's advice to retry with weights_only=False, which would run
    the file's code; and the code never ran."""
    marker = tmp_path / "payload_ran"
    torch.save({"model": _Payload(f"touch {marker}")}, tmp_path / SNAPSHOT)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as info:
        read_snapshot(SNAPSHOT, {})
    message = str(info.value)
    assert message.startswith(f"cannot read snapshot {SNAPSHOT}")
    assert "weights_only" not in message and "\n" not in message and len(message) < 300
    assert "refused it: Trying to load unsupported GLOBAL posix.system" in message
    assert not marker.exists()
    # Control: the same file loaded the unsafe way does run the payload.
    torch.load(tmp_path / SNAPSHOT, weights_only=False)
    assert marker.exists()


def test_a_mid_epoch_snapshot_resumes_at_another_world_size(tmp_path):
    """--global_batch_size 64 of --batch_size 32: 1 micro-batch per step on 2
    ranks, 2 on 1. Killed after the snapshot at step 4 of 2 ranks (256 of the
    epoch's 1,844 samples trained), resumed by 1 rank: the rest of the epoch's
    permutation goes on at step 8 of that size (4 optimizer steps of 64), the
    global batch and the steps per epoch stay, the resume line says so, and
    the epoch's record counts each sample trained once: the 256, then the
    1,588 left in whole optimizer steps of 2 x 32 (the rest dropped, as a
    partial batch is)."""
    flags = ["--total_epochs", "1", "--global_batch_size", "64", "--metrics_path", "metrics.jsonl"]
    stopped = run(PODS + ["--nproc_per_node=2", FAULTY_TRAIN] + flags + ["--snapshot_every_steps", "4"], tmp_path,
                  DDP_TEST_FAULT="step:0:6:raise")  # after the snapshot at step 4
    assert stopped.returncode != 0
    result = check(one_process(flags, tmp_path))
    assert ("resuming from snapshot snapshot_train.pt in epoch 1 after step 8 (saved by world_size 2, resumed "
            "by 1: global batch size 64 -> 64 at the same --lr, steps per epoch 28 -> 28; epoch 1 goes on "
            "after 256 of its 1844 samples (step 4 by world_size 2) at step 8, the rest split over 1 rank; "
            "random streams restored on rank 0, those of rank 1 dropped)") in stdout_lines(result.stdout)
    assert "global batch size 64 = batch_size 32 x grad_accum_steps 2 x world_size 1" in result.stdout
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["samples"] for r in records if "epoch" in r] == [256 + (1844 - 256) // 64 * 64]


# --------------------------------------------------------------------------
# 6. No hangs: one rank fails or hangs, the whole job exits non-zero
# --------------------------------------------------------------------------

def test_one_failing_rank_ends_the_whole_job(tmp_path):
    """rank 1 raises at its 5th step while rank 0 waits in the next all-reduce:
    the job must end, non-zero, inside the first epoch, not after the
    start-up time-out (30 min). (A rank that hangs: tests/test_hangs.py.)"""
    result = run(FAULTY_SCRIPT + ["--total_epochs", "3", "--pg_timeout_s", "10"], tmp_path, timeout=300,
                 DDP_TEST_FAULT="step:1:5:raise")
    assert result.returncode != 0
    assert "DDP_TEST_FAULT: raise at step 5 on rank 1" in result.stderr
    assert "epoch 1/3 |" not in result.stdout  # it stopped inside the first epoch


# --------------------------------------------------------------------------
# 7. Uneven data: sizes that divide by neither world size nor batch size
# --------------------------------------------------------------------------

def test_uneven_data_trains_and_evaluates_exactly(tmp_path):
    """901 training digits, 100 for validation, 199 for test; 3 ranks; batch 7."""
    root = build_mnist_root(tmp_path / "data", n_train=1001, n_test=199)
    result = check(run(PODS + ["--nproc_per_node=3", REPO / "train.py",
                                   "--dataset", "mnist", "--data_dir", root, "--batch_size", "7",
                                   "--total_epochs", "1", "--metrics_path", "m.jsonl"], tmp_path))
    assert len(epochs(result.stdout)) == 1
    reported = json.loads((tmp_path / "m.jsonl").read_text().splitlines()[-1])

    # The reference: one process scores every test sample of the saved model.
    task = load_task("mnist", root)
    model = task.model.eval()
    model.load_state_dict(torch.load(tmp_path / "snapshot_train.pt", weights_only=True)["model"])
    loss_sum, correct, samples = 0.0, 0, 0
    with torch.no_grad():
        for source, targets in torch.utils.data.DataLoader(task.test_set, batch_size=64):
            output = model(task.eval_transform(source))
            loss_sum += task.loss_fn(output, targets, reduction="sum").item()
            correct += (output.argmax(dim=1) == targets).sum().item()
            samples += len(targets)
    loss, accuracy = loss_sum / samples, correct / samples
    assert abs(reported["test_loss"] - loss) <= 1e-6
    assert abs(reported["test_accuracy"] - accuracy) <= 1e-6
    assert parse_test(result.stdout)["acc"] == pytest.approx(accuracy, abs=1e-4)


# --------------------------------------------------------------------------
# A diverging run: one line, non-zero exit, nothing saved overwritten (output
# paths that cannot be written: tests/test_output_paths.py)
# --------------------------------------------------------------------------

@pytest.mark.parametrize("snapshot_every_steps", ["0", "10"])
def test_diverging_loss_stops_and_keeps_the_last_snapshot(snapshot_every_steps, finished_run, tmp_path):
    finished_run(tmp_path)
    before = (tmp_path / "snapshot_train.pt").read_bytes()
    result = one_process(["--total_epochs", "3", "--lr", "1e6", "--snapshot_every_steps", snapshot_every_steps],
                         tmp_path)
    assert result.returncode != 0
    errors = error_lines(result.stderr)
    assert len(errors) == 1 and errors[0].startswith("error: training loss became ")
    assert "in epoch 2" in errors[0] and "Lower --lr" in errors[0]
    assert (tmp_path / "snapshot_train.pt").read_bytes() == before


# --------------------------------------------------------------------------
# Stop signals relayed by torchrun: SIGUSR1 (a scheduler's warning), SIGTERM
# (preemption, scontrol requeue, scancel), SIGINT (Ctrl-C): stop, snapshot, resume
# --------------------------------------------------------------------------

@pytest.mark.parametrize("signum,accum,nproc,hold,stop,amp", [
    # SIGUSR1 (a scheduler's warning, relayed when asked) with accumulation:
    # the stop waits for the end of an optimizer step. Forced fp16 on the CPU:
    # GradScaler scales the loss, unscales before clipping, skips the steps
    # whose gradients overflow (the epoch line counts them); the resume goes
    # on with the loss scale.
    # 115 micro-batches an epoch a rank; rank 0 held before the 131st (epoch
    # 2's 16th, in mid-accumulation) until the signal: the ranks share it at
    # the next optimizer step (the 18th) and stop after the one after (the
    # 21st; StopSignals.poll learns of it one call late, not to wait for it).
    (signal.SIGUSR1, 3, 2, 131, "2 21", "fp16"),
    # Ctrl-C with 3 ranks: a resume must also lay out DDP's buckets as before
    # (with 2 ranks a sum is the same in any order). Loader workers, which
    # torchrun signals too, are checked in test_train_utils and test_loaders.
    # SIGTERM runs under Slurm in tests/test_stop_paths.py (preemption,
    # scontrol requeue, scancel), which signals every process itself; torchrun
    # relays SIGTERM as it relays SIGINT (the Ctrl-C case) and, during
    # start-up, test_sigterm_during_start_up_... sends it to torchrun.
    # 76 steps an epoch a rank; rank 0 held before the 100th (epoch 2's 24th): stop after the 25th.
    (signal.SIGINT, 1, 3, 100, "2 25", None),
], ids=["SIGUSR1-accum3", "Ctrl-C-3ranks"])
def test_stop_signal_stops_every_rank_after_one_step_and_the_run_resumes_exactly(
        tmp_path, signum, accum, nproc, hold, stop, amp):
    """What slurm/multi_gpu.sh does on a warning or a preemption, without Slurm
    (tests/test_stop_paths.py runs the real thing): torchrun relays the signal to
    the workers, which stop after the same step and snapshot it; the same command
    then finishes the run, with the weights, optimizer state, learning-rate
    schedule of a run never interrupted. With gradient accumulation the stop
    waits for the end of an optimizer step (no half-accumulated gradients lost).
    The goodput ledger counts both attempts, none of the steps redone (the
    stop's snapshot holds the last one), and the resumed run's goodput line
    sums to 100%; the timeline has a track per rank of each."""
    relay = []  # torchrun relays SIGTERM and SIGINT by default; SIGUSR1 only when asked (torch 2.10+)
    if signum == signal.SIGUSR1:
        if torch_version() < (2, 10):
            pytest.skip(f"torch {torch.__version__}'s torchrun has no --signals-to-handle (2.10)")
        relay = ["--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"]
    args = ["--total_epochs", "2", "--batch_size", "8", "--grad_accum_steps", str(accum),
            # and a recipe whose state must resume too:
            "--lr_schedule", "cosine", "--warmup_epochs", "1", "--weight_decay", "1e-4", "--clip_grad_norm", "1"]
    args += ["--amp", amp] if amp else []
    interrupted, reference = tmp_path / "interrupted", tmp_path / "reference"
    interrupted.mkdir()
    reference.mkdir()
    nprocs = f"--nproc_per_node={nproc}"
    launch = TORCHRUN + ["--standalone", nprocs, *relay, str(FAULTY_TRAIN), *args]  # held by DDP_TEST_FAULT
    launched = time.time()
    text = signal_when(launch, interrupted, held_at_step(hold)[1], signum, **held_at_step(hold)[0])
    name = signal.Signals(signum).name
    stops = re.findall(r"^epoch (\d+) step (\d+) \| snapshot saved at snapshot_train\.pt$", text, re.M)
    assert len(stops) == 1 and text.count(f"stopped by {name}") == 1, text
    assert "test | loss" not in text  # stopped, not finished
    if signum == signal.SIGINT:  # one line says what happens, no worker traceback
        assert text.count("Ctrl-C: every rank stops after the current step") == 1, text
        assert "KeyboardInterrupt" not in text, text
    epoch, step = stops[0]
    assert f"{epoch} {step}" == stop and int(step) % accum == 0
    assert epochs(text)[-1]["epoch"] == int(epoch) - 1

    resumed = check(run(PODS + [nprocs, REPO / "train.py", *args], interrupted))
    assert f"resuming from snapshot snapshot_train.pt in epoch {epoch} after step {step}" in resumed.stdout
    assert [e["epoch"] for e in epochs(resumed.stdout)] == [2]
    assert_goodput(interrupted / "snapshot_train.pt", [nproc, nproc], [0], resumed.stdout, since=launched)
    straight = check(run(PODS + [nprocs, REPO / "train.py", *args], reference))
    assert_same_snapshot(interrupted / "snapshot_train.pt", reference / "snapshot_train.pt")
    assert parse_test(resumed.stdout) == parse_test(straight.stdout)
    if amp == "fp16":
        assert "| amp fp16 with a loss scaler" in straight.stdout.splitlines()[0]  # the start-up line
        lines = epochs(straight.stdout)
        assert lines[0]["skipped_steps"] >= 1  # GradScaler's first scale, 65536, overflows fp16
        assert sum(e["skipped_steps"] for e in lines[1:]) < lines[0]["skipped_steps"] + 5
        assert torch.load(interrupted / "snapshot_train.pt", weights_only=True)["loss_scaler"]["scale"] < 65536.0


def test_sigterm_during_start_up_ends_every_rank_cleanly_and_keeps_the_snapshot(finished_run, tmp_path):
    """SIGTERM to torchrun while the ranks start (FAULTY_TRAIN holds every
    rank in start-up, after the process group exists, before the task loads:
    where a download or a large dataset takes its time): each rank ends at
    once with exit status 0 and rank 0 says so in one line, no traceback; the
    snapshot on disk is untouched, and the same command resumes from it. Before
    the handler was installed at the top of main, SIGTERM's default action
    killed each rank there."""
    launch = PODS_SCRIPT + ["--batch_size", "32"]
    held = TORCHRUN + ["--standalone", "--nproc_per_node=2", str(FAULTY_TRAIN), "--batch_size", "32"]
    snapshot = finished_run(tmp_path, total_epochs=2)  # train.py --total_epochs 2 (--batch_size 32 is the default)
    before = snapshot.read_bytes()
    text = signal_when([*held, "--total_epochs", "3"], tmp_path,
                       ("DDP_TEST_FAULT: hang at startup 1 on rank 0", "DDP_TEST_FAULT: hang at startup 1 on rank 1"),
                       signal.SIGTERM, DDP_TEST_FAULT="startup:*:1:hang")
    assert text.count("stopped by SIGTERM during start-up, before the first training step") == 1, text
    # torchrun's own SignalException traceback follows (docs/pitfalls.md); none from a rank:
    assert "train.py\", line" not in text and "train_with_fault.py\", line" not in text, text
    assert "epoch 3/3" not in text, text
    assert "exitcode" not in text, text  # torchrun saw no worker fail
    assert snapshot.read_bytes() == before
    assert not (tmp_path / "snapshot_train.pt.job").exists()  # the claim, taken at start, given back
    resumed = check(run([*launch, "--total_epochs", "3"], tmp_path))
    assert "resuming from snapshot snapshot_train.pt after epoch 2" in resumed.stdout, resumed.stdout
    assert [e["epoch"] for e in epochs(resumed.stdout)] == [3]


def test_a_second_ctrl_c_quits_at_once_without_a_snapshot(tmp_path):
    """Ctrl-C twice: torchrun sends its workers SIGINT, then SIGTERM; they quit
    at once instead of finishing what the first one asked for. The first stop's
    save is held up (FAULTY_TRAIN hangs rank 0 inside it), as a slow save on a
    busy file system would; the second Ctrl-C ends the run without a snapshot."""
    launch = TORCHRUN + ["--standalone", "--nproc_per_node=2", str(FAULTY_TRAIN),
                         "--total_epochs", "200", "--save_every", "1000"]
    log = tmp_path / "log.txt"
    with open(log, "w") as out:
        agent = subprocess.Popen([str(part) for part in launch], cwd=tmp_path, stdout=out,
                                 stderr=subprocess.STDOUT, env=script_env(DDP_TEST_FAULT="save:0:1:hang"))
        try:
            for line, start_s in (("epoch 1/200", 600), ("DDP_TEST_FAULT: hang at save 1", 600)):
                deadline = time.monotonic() + start_s
                while line not in log.read_text():
                    assert agent.poll() is None and time.monotonic() < deadline, log.read_text()
                    time.sleep(0.1)
                agent.send_signal(signal.SIGINT)
            agent.wait(timeout=300)
        finally:
            if agent.poll() is None:
                agent.kill()
    text = log.read_text()
    assert text.count("Ctrl-C: every rank stops after the current step") == 1, text
    assert "second stop request: quitting at once, without a snapshot" in text, text
    assert not (tmp_path / "snapshot_train.pt").exists()


# --------------------------------------------------------------------------
# DDP's bucket layout after a resume under --amp
# --------------------------------------------------------------------------

def _bucket_layout_worker(rank, world_size, port, out):
    """Rank 0 of a 1-rank gloo group: the parameter order of DDP's buckets from
    the third step on, for an uninterrupted run under bf16 autocast and for a
    resumed one (rebuild_ddp_buckets, then two steps under autocast)."""
    import os

    import torch.nn.functional as F
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    import vision_tasks

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)
    cpu = torch.device("cpu")
    data = torch.utils.data.TensorDataset(torch.randn(16, 1, 28, 28), torch.randint(0, 10, (16,)))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    x, y = next(iter(loader))

    def layout(rebuild: bool) -> list:
        torch.manual_seed(0)
        net = vision_tasks.MnistCNN()
        names = {id(p): n for n, p in net.named_parameters()}
        model, buckets = DDP(net), []

        def hook(state, bucket):
            buckets.append([names[id(p)] for p in bucket.parameters()])
            return default_hooks.allreduce_hook(state, bucket)

        model.register_comm_hook(None, hook)
        amp = train_utils.autocast(cpu, torch.bfloat16)
        if rebuild:
            train_utils.rebuild_ddp_buckets(model, loader, F.cross_entropy, lambda t: t, cpu, amp)
        for _ in range(2 if rebuild else 3):
            buckets.clear()
            with amp:
                loss = F.cross_entropy(model(x), y)
            loss.backward()
        return buckets

    torch.save({"uninterrupted": layout(False), "resumed": layout(True)}, out)
    torch.distributed.destroy_process_group()


def test_a_resume_under_amp_lays_out_ddps_buckets_as_the_autocast_run(tmp_path):
    """Under bf16 autocast the cast nodes change the order in which gradients become
    ready (here fc1.bias moves to the second bucket, fc2's weight and bias swap), so
    the buckets rebuilt after a resume must come from a pass under the same autocast:
    with 3 or more ranks a different layout sums in another order (not bitwise).
    One rank shows the layout; the bitwise consequence needs 3 ranks and --amp
    (test_killed_worker_is_restarted_and_the_result_is_bitwise_unchanged)."""
    import torch.multiprocessing as mp

    from helpers import free_port

    out = tmp_path / "layout.pt"
    mp.spawn(_bucket_layout_worker, args=(1, free_port(), str(out)), nprocs=1)
    layouts = torch.load(out)
    print(layouts)
    assert layouts["resumed"] == layouts["uninterrupted"]

