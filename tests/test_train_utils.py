"""Focused tests of train_utils.py: device choice, the start-up and epoch
lines, atomic saves."""

import glob
import json
import re
import warnings

import pytest
import torch

import train_utils
from conftest import EPOCH_LINE, REPO, TEST_LINE, TORCHRUN, check, error_lines, run, task_args


def test_device_for_refuses_a_local_rank_without_its_own_gpu(monkeypatch):
    """Three processes on a node showing two GPUs: local rank 2 gets one line
    naming what it asked for and what is visible, not a raw CUDA error."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert train_utils.device_for(1) == torch.device("cuda", 1)
    with pytest.raises(train_utils.ConfigError) as info:
        train_utils.device_for(2)
    message = str(info.value)
    assert "local rank 2 needs GPU 2" in message and "only 2 GPU(s)" in message
    assert "--nproc_per_node=2" in message and "\n" not in message


def test_device_for_is_the_cpu_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert train_utils.device_for(5) == torch.device("cpu")


def test_gpus_torch_cannot_use_are_reported_with_torchs_reason(monkeypatch):
    """GPU device files present, but this torch build cannot use them (here: the
    warning torch gives for a driver too old for its CUDA build)."""
    def unavailable():
        warnings.warn("CUDA initialization: The NVIDIA driver on your system is too old "
                      "(found version 11040).\nPlease update your GPU driver.")
        return False

    monkeypatch.setattr(glob, "glob", lambda pattern: ["/dev/nvidia0"])
    monkeypatch.setattr(torch.cuda, "is_available", unavailable)
    reason = train_utils.unusable_gpu_reason()
    assert reason.startswith("CUDA initialization: The NVIDIA driver on your system is too old")
    line = train_utils.run_line(torch.device("cpu"), task_args("synthetic", batch_size=32,
                                                               grad_accum_steps=1))
    note, start = line.split("\n")
    assert note.startswith("note: this machine has NVIDIA GPUs, but torch cannot use them (CUDA")
    assert "training on the CPU" in note
    assert start.startswith("device cpu | backend none | world_size 1 | global batch size 32")


def test_no_gpu_files_means_nothing_to_report(monkeypatch):
    monkeypatch.setattr(glob, "glob", lambda pattern: [])
    assert train_utils.unusable_gpu_reason() is None
    line = train_utils.run_line(torch.device("cpu"), task_args("synthetic", batch_size=8,
                                                               grad_accum_steps=4))
    assert line == ("device cpu | backend none | world_size 1 | global batch size 32 = "
                    "batch_size 8 x grad_accum_steps 4 x world_size 1")


def test_log_metrics_prints_the_parsable_line_and_writes_json(tmp_path, capsys, monkeypatch):
    path = tmp_path / "m.jsonl"
    record = {"epoch": 3, "total_epochs": 10, "train_loss": 0.5, "samples_per_s": 1234.5,
              "epoch_seconds": 2.25, "val_loss": 0.25, "val_accuracy": 0.875}
    args = task_args("synthetic", metrics_path=str(path), tensorboard_dir=None)
    monkeypatch.setitem(train_utils.RUN, "started", False)
    train_utils.log_metrics(record, args)
    train_utils.log_metrics({"test_loss": 0.3, "test_accuracy": None}, args)
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
    train_utils.atomic_save({"a": torch.arange(3)}, str(path))
    train_utils.atomic_save({"a": torch.arange(5)}, str(path))
    assert torch.equal(torch.load(path, weights_only=True)["a"], torch.arange(5))
    assert [p.name for p in tmp_path.iterdir()] == ["snap.pt"]


def test_atomic_save_failure_keeps_the_old_file(tmp_path):
    path = tmp_path / "snap.pt"
    train_utils.atomic_save({"a": torch.arange(3)}, str(path))

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        train_utils.atomic_save({"a": Unpicklable()}, str(path))
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

    from conftest import REPO, script_env

    result = subprocess.run([sys.executable, "-c", COMPILE_WORKERS_PROBE, str(REPO)], capture_output=True,
                            text=True, timeout=300, cwd=tmp_path,
                            env=script_env(TORCHINDUCTOR_COMPILE_THREADS="2"))
    assert result.returncode == 0, result.stderr[-3000:]
    children, all_blocked, own_mask_kept = result.stdout.split()[-3:]
    assert int(children) >= 1 and all_blocked == "True" and own_mask_kept == "True", result.stdout


def test_first_host_of_a_slurm_hostlist():
    assert train_utils.first_host("ddp-node[1-2]") == "ddp-node1"
    assert train_utils.first_host("gpu[07-09,12],cpu1") == "gpu07"
    assert train_utils.first_host("a,b") == "a"
    assert train_utils.first_host("rack[2-3]-n[4,6]") == "rack2-n4"


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
    averages = train_utils.torch_version() >= train_utils.GLOO_AVG_REDUCE_SCATTER
    assert measured == (1.5 if averages else 3.0), (torch.__version__, measured)


def test_fsdp_on_gloo_is_refused_in_one_line_where_gloo_sums(tmp_path):
    if train_utils.torch_version() >= train_utils.GLOO_AVG_REDUCE_SCATTER:
        pytest.skip(f"torch {torch.__version__}'s gloo averages: multinode_fsdp.py trains on the CPU (tests/test_fsdp.py)")
    result = run(TORCHRUN + ["--standalone", "--nproc_per_node=2", REPO / "multinode_fsdp.py"], tmp_path,
                 timeout=120)
    assert result.returncode != 0
    assert error_lines(result.stderr) == [
        f"error: FSDP on the CPU (gloo) needs torch 2.10 or newer: torch {torch.__version__}'s gloo sums "
        f"where FSDP averages gradients; pip install 'torch>=2.10', or train on GPUs"]
    assert "Root Cause" in result.stderr and "FSDP on the CPU (gloo) needs torch 2.10" in result.stderr
    assert not list(tmp_path.iterdir())  # refused before anything was written


def test_older_torch_than_tested_gets_a_one_line_note(monkeypatch):
    args = task_args("synthetic", batch_size=32, grad_accum_steps=1)
    plain = train_utils.run_line(torch.device("cpu"), args)
    monkeypatch.setattr(torch, "__version__", "2.7.1+cpu")
    assert train_utils.run_line(torch.device("cpu"), args).splitlines() == [
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

    loader = torch.utils.data.DataLoader(Pids(), num_workers=1, worker_init_fn=train_utils.ignore_stop_signal,
                                         persistent_workers=True)
    iterator = iter(loader)
    worker = int(next(iterator))
    status = dict(line.split(":\t", 1) for line in open(f"/proc/{worker}/status").read().splitlines())
    ignored = int(status["SigIgn"], 16)
    del iterator
    assert worker != os.getpid()
    assert [signum for signum in train_utils.STOP_SIGNALS if not ignored >> (signum - 1) & 1] == []
