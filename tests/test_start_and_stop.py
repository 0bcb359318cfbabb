"""What a user meets when a run starts and stops, end to end and in process:
the same command started twice is refused before it builds its task; a
long epoch shows progress lines and the metrics file holds its start record
from the start; a stop during an epoch's evaluation resumes bitwise; and the
start-up's smaller promises (files to copy, elastic rejoin, open files,
abbreviated flags, Ctrl-C while torch imports, missing data, workers for a
list of tensors)."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from helpers import (FAULTY_TRAIN, REPO, PODS, TORCHRUN, assert_same_snapshot, check, epochs, error_lines, free_port,
                     held_at_step, one_process, parse_test, run, script_env, signal_when, task_args)

KIT = PODS + ["--nproc_per_node=2"]


# --------------------------------------------------------------------------
# The kit, end to end
# --------------------------------------------------------------------------

MARKER_TASK = '''"""The synthetic task, noting each build in built.txt (one line per process)."""
import os

import common


def build(args, download):
    with open("built.txt", "a") as f:
        f.write(f"{os.getpid()}\\n")
    return common.synthetic_task(args, download)
'''


def test_the_same_command_started_twice_is_refused_before_it_builds_its_task(tmp_path):
    """A run holds its snapshot (held at step 5 until a stop signal); the
    same command started again is refused in one line, and builds no task:
    the claim is taken right after the process group starts, before the task
    (a download, say). Before, the second run built its task and loaders
    first (23 s for the language model)."""
    (tmp_path / "marker_task.py").write_text(MARKER_TASK)
    command = ["--dataset", "marker_task.py:build", "--total_epochs", "1"]
    first = subprocess.Popen([str(part) for part in KIT + [FAULTY_TRAIN, *command]], cwd=tmp_path,
                             env=script_env(DDP_TEST_FAULT="step:0:5:wait_signal"), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while len((tmp_path / "built.txt").read_text().split() if (tmp_path / "built.txt").exists() else []) < 2:
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()[0]
            time.sleep(0.2)
        second = one_process(command, tmp_path)  # the claim is the run's, whatever launched it
        assert second.returncode != 0
        assert [line for line in error_lines(second.stderr) if "is in use by" in line], second.stderr
        assert len((tmp_path / "built.txt").read_text().split()) == 2  # the first run's two ranks only
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=120)


def test_a_stop_during_evaluation_resumes_bitwise_with_progress_lines_and_a_start_record(kit_run, tmp_path):
    """Epoch 1's evaluation is where SIGTERM lands (rank 0 held at its start):
    every rank stops after one evaluation batch, rank 0 saves the epoch's
    training steps, and the same command evaluates epoch 1 again and trains
    on to an end bitwise equal to an uninterrupted run's (every epoch line,
    the test line, the snapshot). The stopped run printed a progress line
    every 10 steps (--log_every_steps) and left its metrics file holding its
    start record, though no epoch ended. Before, the stop waited for the
    whole evaluation pass, and the metrics file stayed empty until an epoch
    ended."""
    flags = ["--total_epochs", "4", "--log_every_steps", "10", "--metrics_path", "metrics.jsonl"]
    log = signal_when(KIT + [FAULTY_TRAIN, *flags], tmp_path, "DDP_TEST_FAULT: wait_signal at evaluate 1",
                      signal.SIGTERM, DDP_TEST_FAULT="evaluate:0:1:wait_signal")
    assert "stopped by SIGTERM" in log and "epoch 1 step 28 | snapshot saved at snapshot_train.pt" in log, log
    assert epochs(log) == []  # no epoch summarised: its evaluation was cut short
    steps = re.findall(r"^step (\d+) \| epoch 1 \| samples ([\d,]+) \| loss \S+ \| lr 0\.05 \| samples/s \S+ \| "
                       r"ms/step \S+$", log, re.M)
    assert steps == [("10", "640"), ("20", "1,280")], log  # 2 ranks x batch 32 a step, counted from the start
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [record.get("event") for record in records] == ["start"]
    resumed = check(run(KIT + [REPO / "train.py", *flags], tmp_path))
    assert "resuming from snapshot snapshot_train.pt in epoch 1 after step 28" in resumed.stdout
    folder, reference = kit_run("ddp", "--total_epochs", 4)
    drop_speed = [{key: value for key, value in line.items() if key not in ("samples_per_s", "flop_per_s", "epoch_s")}
                  for line in epochs(reference)]
    assert [{key: value for key, value in line.items() if key not in ("samples_per_s", "flop_per_s", "epoch_s")}
            for line in epochs(resumed.stdout)] == drop_speed
    assert parse_test(resumed.stdout) == parse_test(reference)
    assert_same_snapshot(tmp_path / "snapshot_train.pt", folder / "snapshot_train.pt")
    # The resumed run's count goes on from the samples trained before the stop (epoch 1's, in its record).
    epoch_1 = [record for record in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
               if record.get("epoch") == 1][-1]
    counted = re.search(r"^step 30 \| epoch 2 \| samples ([\d,]+) \|", resumed.stdout, re.M)
    assert counted and int(counted[1].replace(",", "")) == epoch_1["samples_run"] + 2 * 64, resumed.stdout


def test_a_stopped_run_exits_with_the_signals_status_on_every_rank_and_its_resume_with_0(tmp_path):
    """Two pods (each rank its own process with the plain environment, as a
    Kubernetes Job starts them), rank 0 alone sent SIGTERM while held before
    its 5th step: both ranks stop after the same step, and both exit 143
    (128 + SIGTERM), so that a Job, a JobSet or a PyTorchJob counts the pods
    as stopped, not succeeded, and starts them again (docs/launchers.md); the
    same pods started again resume and exit 0. Before, every rank of a
    stopped run exited 0. The first time rank 1's pod starts only once rank
    0 has said that it waits for it (before, rank 0 waited silently)."""
    hold_env, held = held_at_step(5)

    def start_pods(script, late_rank_1: bool = False, **env) -> list:
        port = str(free_port())
        pods = []
        for rank in (0, 1):
            if late_rank_1 and rank == 1:
                deadline = time.monotonic() + 600  # bounds a failure only
                while "rank 0 has waited" not in log(0):
                    assert pods[0].poll() is None and time.monotonic() < deadline, log(0)
                    time.sleep(0.1)
            pods.append(subprocess.Popen([sys.executable, str(script), "--total_epochs", "1"], cwd=tmp_path,
                                         env=script_env(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                                        MASTER_PORT=port, **env),
                                         stdout=open(tmp_path / f"rank{rank}.log", "w"), stderr=subprocess.STDOUT))
        return pods

    def log(rank: int) -> str:
        return (tmp_path / f"rank{rank}.log").read_text()

    pods = start_pods(FAULTY_TRAIN, late_rank_1=True, **hold_env)
    try:
        late = re.search(r"^rank 0 has waited (\d+) s for rank 1 to start \(1 of 2 started; --startup_timeout_s "
                         r"\d+ ends the wait\)$", log(0), re.M)
        assert late and int(late[1]) >= 10, log(0)
        deadline = time.monotonic() + 600  # bounds a failure only
        while held not in log(0):
            assert all(pod.poll() is None for pod in pods) and time.monotonic() < deadline, log(0) + log(1)
            time.sleep(0.1)
        pods[0].send_signal(signal.SIGTERM)
        statuses = [pod.wait(timeout=300) for pod in pods]
    finally:
        for pod in pods:
            pod.kill()
    assert statuses == [128 + signal.SIGTERM] * 2, log(0) + log(1)
    assert "stopped by SIGTERM after this step on every rank" in log(0), log(0)
    step = re.search(r"^epoch 1 step (\d+) \| snapshot saved at snapshot_train\.pt$", log(0), re.M)
    assert step and "test | loss" not in log(0), log(0)
    pods = start_pods(REPO / "train.py")
    statuses = [pod.wait(timeout=600) for pod in pods]
    assert statuses == [0, 0], log(0) + log(1)
    assert f"resuming from snapshot snapshot_train.pt in epoch 1 after step {step[1]}" in log(0), log(0)
    assert "test | loss" in log(0), log(0)


# --------------------------------------------------------------------------
# Start-up, in process or in one short process
# --------------------------------------------------------------------------

@pytest.mark.parametrize("environment, noted", [
    ({"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "3", "GROUP_WORLD_SIZE": "2"}, True),
    ({"TORCHELASTIC_USE_AGENT_STORE": "False", "TORCHELASTIC_MAX_RESTARTS": "3", "GROUP_WORLD_SIZE": "2"}, False),
    ({"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "0", "GROUP_WORLD_SIZE": "2"}, False),
    ({"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "3", "GROUP_WORLD_SIZE": "1"}, False),
], ids=["shared-store-restarts-nodes", "own-stores", "no-restarts", "one-node"])
def test_a_multi_node_restartable_torchrun_sharing_its_store_is_noted_at_start(monkeypatch, environment, noted):
    """Where a node that rejoins would wait until the rendezvous times out
    (torchrun's agents share their store with the workers, several nodes,
    restarts allowed), the start-up says so in one line, naming the setting."""
    from train_utils.distributed.devices import rejoin_note

    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    note = rejoin_note()
    assert bool(note) == noted
    assert not note or ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in note and "\n" not in note)


def test_the_open_file_limit_is_raised_to_the_hard_one():
    """gloo's meshes hold about 5 x world_size sockets a rank: the soft limit
    (often 1,024) is raised to the hard one at start."""
    code = ("import resource, sys; sys.path.insert(0, sys.argv[1]);"
            "from train_utils.distributed.launch import raise_open_file_limit; raise_open_file_limit();"
            "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE); print(soft == hard, soft)")
    hard = subprocess.run(["bash", "-c", "ulimit -Hn"], capture_output=True, text=True).stdout.strip()
    if hard == "unlimited" or int(hard) <= 200:
        pytest.skip(f"a hard limit of {hard} open files leaves no soft limit to raise here")
    result = subprocess.run(["bash", "-c", f'ulimit -Sn 200 && "{sys.executable}" -c "{code}" "{REPO}"'],
                            capture_output=True, text=True)
    assert result.stdout.split() == ["True", hard], result.stderr


def test_running_out_of_open_files_is_named_as_such_not_as_a_network_fault(one_process_group, monkeypatch):
    """A gloo group that cannot be made because the process has no file
    descriptors left (EMFILE, torch's error text stood in) is one line naming
    the limit and what to do; a network failure keeps its own line."""
    import common
    import torch.distributed as dist
    from train_utils.distributed.launch import gloo_group

    def refused(**kwargs):
        raise RuntimeError("[enforce fail at gloo/transport/tcp/pair.cc] socket: Too many open files")

    monkeypatch.setattr(dist, "new_group", refused)
    with pytest.raises(common.ConfigError) as info:
        gloo_group()
    assert "ran out of open files" in str(info.value) and "ulimit -n" in str(info.value)
    assert "GLOO_SOCKET_IFNAME" not in str(info.value)


def test_abbreviated_flags_are_refused_by_the_kit_and_the_rungs():
    """--total_epoch is not taken for --total_epochs (argparse's prefix
    matching is off): the kit names the flag meant."""
    for script in ("train.py", "singlegpu.py"):
        result = subprocess.run([sys.executable, REPO / script, "--total_epoch", "2"], capture_output=True,
                                text=True, env=script_env())
        assert result.returncode == 2 and "unrecognized arguments: --total_epoch 2" in result.stderr, result.stderr
        assert script != "train.py" or "--total_epoch -> --total_epochs" in result.stderr


def test_ctrl_c_while_torch_imports_ends_train_py_quietly(tmp_path):
    """Ctrl-C in the seconds torch takes to import: the process ends by the
    signal, no KeyboardInterrupt traceback (one per rank, before). A stand-in
    torch sends the process its own SIGINT while it is being imported, so
    the signal lands there whatever the machine's speed."""
    shim = tmp_path / "shim" / "torch"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("import os, signal, time\nos.kill(os.getpid(), signal.SIGINT)\ntime.sleep(5)\n")
    result = subprocess.run([sys.executable, REPO / "train.py"], capture_output=True, text=True,
                            env=script_env(PYTHONPATH=str(tmp_path / "shim")), timeout=60)
    assert result.returncode == -signal.SIGINT and "Traceback" not in result.stderr, result.stderr


def test_missing_mnist_names_the_offline_helper(tmp_path):
    import common

    with pytest.raises(common.ConfigError) as info:
        common.load_task(task_args("mnist", data_dir=tmp_path), download=False)
    assert "python vision_tasks.py THEIR_FOLDER mnist_t10k" in str(info.value)


def test_a_list_of_separate_tensors_trains_with_loader_workers():
    """A hand-written dataset of 300 separate tensors (more than a fork server
    can pass a worker as file descriptors) loads with workers: the kit
    switches torch to the file_system sharing strategy. The batches are the
    ones a loader without workers gives."""
    from torch.utils.data import DataLoader

    from train_utils.loop.loaders import loader_workers

    dataset = [(torch.zeros(3) + i, i % 2) for i in range(300)]
    strategy = torch.multiprocessing.get_sharing_strategy()
    try:
        loaded = [batch for batch in DataLoader(dataset, batch_size=50, **loader_workers(2, dataset))]
        assert torch.multiprocessing.get_sharing_strategy() == "file_system"
    finally:
        torch.multiprocessing.set_sharing_strategy(strategy)
    plain = list(DataLoader(dataset, batch_size=50))
    assert len(loaded) == len(plain) and all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
                                             for a, b in zip(loaded, plain))


# --------------------------------------------------------------------------
# The README's lists of files to copy, and the language model's commands
# --------------------------------------------------------------------------

def _listed_files(sentence_start: str) -> list:
    """The backticked names of the README sentence that begins ``sentence_start``, up to its end."""
    readme = " ".join((REPO / "README.md").read_text().split())
    sentence = readme[readme.index(sentence_start):]
    sentence = sentence[:sentence.index(". ") if ". " in sentence else len(sentence)]
    return re.findall(r"`([\w./]+)`", sentence)


def test_the_readmes_files_to_copy_are_all_a_copy_needs(tmp_path):
    """Exactly the files the README lists, copied into an empty folder with a
    rung and the kit: the rung and the kit train there, and the kit's --help
    lists every task's models (a task module missing would be left out)."""
    rung_files = _listed_files("To take a rung elsewhere, copy it with these files:")
    kit_files = _listed_files("To make the kit your own, copy these into your project:")
    assert {"common.py", "recipes.py", "gpt.py"} <= set(rung_files) and "train_utils/" in kit_files
    for folder, files in (("rung", ["singlegpu.py", *rung_files]), ("kit", kit_files)):
        for name in files:
            source, target = REPO / name.rstrip("/"), tmp_path / folder / name.rstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            if source.is_dir():
                shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy(source, target)
    check(run([sys.executable, "singlegpu.py", "--total_epochs", "1"], tmp_path / "rung"))
    check(run(TORCHRUN + ["--standalone", "--nproc_per_node=1", "train.py", "--total_epochs", "1"], tmp_path / "kit"))
    helped = check(run([sys.executable, "train.py", "--help"], tmp_path / "kit")).stdout
    for task_model in ("mnist cnn", "cifar10 resnet18", "shakespeare_char gpt"):
        assert task_model in " ".join(helped.split()), helped


def test_the_language_model_pages_commands_run_in_the_readmes_folder():
    """Each training command of docs/language-model.md writes an output path
    of its own (the README's commands leave snapshot_train.pt, a synthetic
    run's, in that folder), the rungs save every epoch (an epoch takes
    minutes), and the sampling command reads the CPU recipe's snapshot."""
    blocks = re.findall(r"```bash\n(.*?)```", (REPO / "docs" / "language-model.md").read_text(), re.S)
    commands = [line for block in blocks for line in block.splitlines() if "shakespeare_char" in line]
    paths = [re.search(r"--(?:snapshot|checkpoint)_path (\S+)", command) for command in commands]
    assert all(paths), commands
    training = [path.group(1) for path, command in zip(paths, commands) if "--sample_chars" not in command]
    assert len(set(training)) == len(training) and not {"snapshot_train.pt", "snapshot_multigpu_torchrun.pt",
                                                         "checkpoint_singlegpu.pt"} & set(training)
    sampling = [path.group(1) for path, command in zip(paths, commands) if "--sample_chars" in command]
    assert sampling == [training[0]]
    assert all("--save_every 1" in command for command in commands if "train.py" not in command)
