"""Shared test helpers: run the scripts the way users do, parse their output,
read their snapshots. Plain functions, no pytest fixtures or hooks (those are
in conftest.py); what the benchmark uses too (the launcher, the epoch line,
train.py's Trainer in process) is the support package's, imported here; the
datasets written in the real on-disk formats are in dataset_files.py."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
sys.path.insert(0, str(REPO))  # so tests can import common, the scripts and support

# What the benchmark uses too lives in the project's support package.
from support.runs import (EPOCH_LINE, LAUNCHER_VARIABLES, PODS, TORCHRUN, epochs, free_port,  # noqa: E402,F401
                          script_env, snapshot_tensors)
from support.trainer import kit_trainer, load_task, plain_task, task_args  # noqa: E402,F401

IN_CI = os.environ.get("CI", "").lower() == "true"

# train.py with a fault injected from the test side: launch it where train.py
# is launched, with the same arguments, and DDP_TEST_FAULT="POINT:RANK:N:ACTION"
# in the environment (its docstring says more). The kit holds no test hook, so
# a test that sets DDP_TEST_FAULT must launch this, not train.py.
FAULTY_TRAIN = REPO / "tests" / "train_with_fault.py"
# The same under a Slurm wrapper (or in a container that binds the project
# folder): slurm/env.sh runs $PROJECT/$SCRIPT_NAME (train.py by default), so a
# job given DDP_TEST_FAULT gets this in its environment too.
FAULTY_TRAIN_JOB_ENV = {"SCRIPT_NAME": str(FAULTY_TRAIN.relative_to(REPO))}

TEST_LINE = re.compile(r"^test \| loss (?P<loss>\S+)(?: \| acc (?P<acc>\S+))?$", re.M)
# An evaluation's line under --eval_every_steps (train_utils.logs.metrics.STEP_LINE_PARTS), as
# the tiny GPTs of the tests print it on a CPU: no val_acc, no mfu; no speed figures on an
# evaluation a resumed run redoes before training.
STEP_LINE = re.compile(
    r"^step (?P<step>\d+)/(?P<total_steps>\d+) \| epoch (?P<epoch>\d+)/(?P<total>\d+) \| "
    r"train_loss (?P<train_loss>\S+) \| val_loss (?P<val_loss>\S+) \| best_val_loss (?P<best_val_loss>\S+) \| "
    r"best_step (?P<best_step>\d+)(?: \| samples/s \S+ \| tokens/s \S+ \| flop/s \S+)? \| interval_s \S+ \| "
    r"lr (?P<lr>\S+)$", re.M)


# A tiny GPT with dropout and the character task's CPU recipe, every flag given (so that
# both language-model tasks train by the same flags), on tiny_corpus (conftest): 1,124
# training windows of 16, 70 steps an epoch at 2 ranks x 8; --max_steps 80 (70 in epoch 1),
# evaluated after steps 25, 50, 75 and 80 over 40 held-out windows.
TINY_GPT = ["--n_layer", "1", "--n_head", "2", "--n_embd", "32", "--block_size", "16"]
TINY_GPT_RECIPE = ["--batch_size", "8", "--lr", "1e-3", "--beta2", "0.99", "--min_lr", "1e-4", "--warmup_steps", "10",
                   "--dropout", "0.1", "--log_every_steps", "0"]


def tiny_gpt_run(dataset: str, data_dir) -> list:
    """The flags of the tiny GPT's run above on ``dataset`` in ``data_dir`` (its metrics in metrics.jsonl)."""
    return ["--dataset", dataset, "--data_dir", str(data_dir), *TINY_GPT, *TINY_GPT_RECIPE, "--max_steps", "80",
            "--eval_every_steps", "25", "--eval_windows", "40", "--metrics_path", "metrics.jsonl"]


def without_package(folder: Path, name: str) -> dict:
    """Environment entries under which importing the package ``name`` raises
    ImportError, as where it is not installed: a stand-in package in
    ``folder``/shim, first on PYTHONPATH. Pass them to ``run``."""
    shim = folder / "shim" / name
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text(f"raise ImportError(\"No module named '{name}'\")\n")
    return {"PYTHONPATH": str(folder / "shim")}


def run(cmd: list[str], cwd: Path, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    """Run a command as a user would; return it with stdout/stderr as text."""
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=script_env(**env),
                          capture_output=True, text=True, timeout=timeout)


def one_process(flags: list, cwd: Path, script: Path = REPO / "train.py", timeout: float = 600,
                **env: str) -> subprocess.CompletedProcess:
    """Run ``script`` (train.py) ``flags`` as the one process of a job that its
    launcher started itself with the plain environment (RANK 0, WORLD_SIZE
    1, MASTER_ADDR, MASTER_PORT: a Kubernetes pod's), in ``cwd``: one
    process, no torchrun agent beside it, started as ``support/pods.py``
    starts a rank (forked, torch already imported). For what a run does
    whatever launched it; what torchrun adds (its restarts, its relayed
    signals, its root cause) is tested under torchrun."""
    return run([*PODS, "--nproc_per_node=1", script, *flags], cwd, timeout, **env)


# Rank 0's line naming a rank slower than its peers (train_utils.loop.stragglers.straggler_line), both kinds.
STRAGGLER_LINE = re.compile(r"^straggler: rank (?P<rank>\d+) \(host (?P<host>\S+)\) is (?:no longer )?slow in "
                            r"(?P<phase>\w+): .*?, over steps (?P<first>\d+)-(?P<last>\d+)(?P<rest>.*)$", re.M)
# The straggler watch's line for a link between hosts (stragglers.link_line).
LINK_LINE = re.compile(r"^straggler: the link from rank (?P<sender>\d+) \(host (?P<sender_host>\S+)\) to rank "
                       r"(?P<receiver>\d+) \(host (?P<receiver_host>\S+)\) is (?P<state>slow|no longer slow): "
                       r".*?, over steps (?P<first>\d+)-(?P<last>\d+)$", re.M)


def check(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """Assert exit status 0, showing the output tail when not, and that the
    run named no straggler (``STRAGGLER_LINE``, ``LINK_LINE``): the runs the suite checks
    are clean, so a line there is a false alarm."""
    assert result.returncode == 0, (
        f"exit {result.returncode}\n--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-5000:]}")
    false_alarms = [line for output in (result.stdout or "", result.stderr or "") for line in output.splitlines()
                    if STRAGGLER_LINE.match(line) or LINK_LINE.match(line)]
    assert not false_alarms, f"a clean run named a straggler:\n{result.stdout[-3000:]}"
    return result


def evaluations(stdout: str) -> list[dict]:
    """The evaluation lines of a run under --eval_every_steps, as dicts of their
    figures but for speed (strings as printed: equal lines, equal dicts)."""
    return [m.groupdict() for m in STEP_LINE.finditer(stdout)]


# train.py's start-up line of where each rank runs (train_utils.describe_placement), one per start.
PLACEMENT_LINE = re.compile(r"^placement: (.*)$", re.M)
PLACEMENT_HOST = re.compile(r"^host (\S+): ranks? ([\d,-]+) \(local_rank ([\d,-]+), ([^)]+)\)$")


def _numbers(ranges: str) -> list[int]:
    """``0-3,8`` as [0, 1, 2, 3, 8] (train_utils.logs.startup.number_ranges, read back)."""
    numbers = []
    for part in ranges.split(","):
        first, _, last = part.partition("-")
        numbers += range(int(first), int(last or first) + 1)
    return numbers


def placements(stdout: str) -> list[set]:
    """Each placement line of ``stdout`` (one per start of train.py) as the
    set of (rank, local_rank, host) it names, its ranks and local ranks read
    back from their ranges, pairwise in order."""
    found = []
    for line in PLACEMENT_LINE.findall(stdout):
        seen = set()
        for part in line.split(" | "):
            host, ranks, locals_, _ = PLACEMENT_HOST.match(part).groups()
            ranks, locals_ = _numbers(ranks), _numbers(locals_)
            assert len(ranks) == len(locals_), line
            seen |= {(rank, local, host) for rank, local in zip(ranks, locals_)}
        found.append(seen)
    return found


def placement(stdout: str) -> set:
    """Every (rank, local_rank, host) that ``stdout``'s placement lines name (``placements``), all starts together."""
    return set().union(*placements(stdout))


def parse_test(stdout: str) -> dict:
    m = TEST_LINE.search(stdout)
    assert m, f"no test line in:\n{stdout[-2000:]}"
    return {k: float(v) for k, v in m.groupdict().items() if v is not None}


def stdout_lines(stdout: str) -> list[str]:
    """A run's stdout lines, less gloo's "[Gloo] Rank 0 is connected to 1 peer
    ranks. Expected number of connected peer ranks is : 1" banner, which torch
    2.8 prints there in some cases, each rank in pieces: two ranks' banners can
    interleave into lines that start mid-banner, or leave an empty line."""
    return [line for line in stdout.splitlines()
            if line and "[Gloo] " not in line and "connected peer ranks is" not in line]


def error_lines(stderr: str) -> list[str]:
    """The scripts' one-line errors ("error: ...") in a run's stderr."""
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


def assert_same_snapshot(path_a: Path, path_b: Path) -> None:
    """Two snapshots hold the same training: epochs run, and weights, optimizer
    state, learning rates, schedule step and loss scale bitwise equal."""
    epochs_a, a = snapshot_tensors(path_a)
    epochs_b, b = snapshot_tensors(path_b)
    assert epochs_a == epochs_b
    assert a.keys() == b.keys()
    assert [name for name in a if not torch.equal(a[name], b[name])] == []


def signal_when(launch: list, cwd: Path, line, signum: int, start_s: float = 600,
                stop_s: float = 300, **env: str) -> str:
    """Run ``launch`` in ``cwd`` (stdout and stderr to cwd/log.txt; ``env``
    added to the environment), send it ``signum`` once ``line`` (a string, or
    a tuple of strings: all of them) appears in its output (within
    ``start_s`` seconds), wait up to ``stop_s`` seconds for it to end; return
    the whole log."""
    log = cwd / "log.txt"
    lines = (line,) if isinstance(line, str) else tuple(line)
    with open(log, "w") as out:
        agent = subprocess.Popen([str(part) for part in launch], cwd=cwd, env=script_env(**env),
                                 stdout=out, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + start_s
            while not all(wanted in log.read_text() for wanted in lines):
                assert agent.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
            agent.send_signal(signum)
            agent.wait(timeout=stop_s)
        finally:
            if agent.poll() is None:
                agent.kill()
    return log.read_text()


def held_at_step(step: int) -> tuple[dict, str]:
    """For ``signal_when``: the environment under which ``FAULTY_TRAIN`` (launch
    it, not train.py) holds rank 0 before its ``step``-th training step
    (micro-batches, counted from 1 over the run's first attempt) until a stop
    signal comes, and the line it prints there. A signal sent on that line
    lands mid-run however fast the machine trains, with rank 0 held and the
    other ranks already in that step, waiting for it in a collective: the
    ranks get the signal at different points and must still agree on one
    step to stop after."""
    return ({"DDP_TEST_FAULT": f"step:0:{step}:wait_signal_once"},
            f"DDP_TEST_FAULT: wait_signal_once at step {step} on rank 0")


def wrapper_snapshot(job_name: str, args: list = (), array_index=None) -> str:
    """The --snapshot_path a resumable Slurm wrapper gives a submission
    (slurm/stop_and_requeue.sh's snapshot_for): snapshot-<job name>[-<array
    index>][-<the run's identity: tools/identity.py's digits, where
    the arguments give any flag it counts>].pt."""
    from tools import identity

    name = f"snapshot-{job_name}" + (f"-{array_index}" if array_index is not None else "")
    words = identity.identity_of([str(arg) for arg in args])
    if words:
        name += "-" + identity.run_identity(words)
    return name + ".pt"


def bucket_snapshot(server, bucket_name: str, root: str, folder) -> str:
    """The newest committed generation of the DDP snapshot at
    ``s3://bucket_name/root`` in ``server`` (support/s3_server.py's), downloaded
    to ``folder``/s3.pt; returns that file's path."""
    from train_utils.snapshots import bucket

    keys = server.keys(bucket_name, root + "/")
    manifests = sorted(key for key in keys if key.endswith("/" + bucket.MANIFEST))
    body = server.client().get_object(Bucket=bucket_name, Key=manifests[-1].replace(bucket.MANIFEST,
                                                                                    bucket.SNAPSHOT_OBJECT))
    target = Path(folder) / "s3.pt"
    target.write_bytes(body["Body"].read())
    return str(target)


def local_files(*folders) -> list:
    """Every file or folder under ``folders`` (paths relative to its folder)
    but the runs' logs (log.txt, stdout.txt): a snapshot, a claim, a goodput
    ledger or an ``s3:`` folder left on disk would be here."""
    found = []
    for folder in folders:
        for path, dirs, files in os.walk(folder):
            found += [os.path.relpath(os.path.join(path, name), folder) for name in dirs + files
                      if name not in ("log.txt", "stdout.txt")]
    return found


def typed_snapshot(job_name: str, args: list) -> str:
    """The name a snapshot of the wrappers has when named by a hash of the
    arguments as typed: the first 8 hex digits of the SHA-256 of the
    arguments, each followed by a NUL byte (resumed where the identity's name
    does not exist yet)."""
    return f"snapshot-{job_name}-" + hashlib.sha256("".join(f"{arg}\0" for arg in args).encode()).hexdigest()[:8] + ".pt"


def run_together(cmds: list[list], cwds: list[Path], env: dict, timeout: float = 300) -> list[tuple]:
    """Start every command at once, each in its folder (torchrun agents of one
    job, say), wait for all; return (returncode, stdout, stderr) per command.
    On a timeout, kills those still running before raising."""
    procs = [subprocess.Popen([str(part) for part in cmd], cwd=cwd, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for cmd, cwd in zip(cmds, cwds)]
    outputs = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=timeout)
            outputs.append((proc.returncode, stdout, stderr))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return outputs


# Sharded (FSDP) snapshots, gathered for comparison

def snapshot_folder(root) -> str:
    """The one snapshot folder a finished run leaves under ``root`` (older ones are removed)."""
    folders = sorted(os.listdir(root))
    assert len(folders) == 1, folders
    return os.path.join(root, folders[0])


def full_state(folder, out_dir) -> tuple[dict, dict]:
    """(weights, everything) of a sharded snapshot folder, gathered into plain tensors with
    DCP's converter: model state_dict, momentum buffers ("optimizer.<name>") or other
    optimizer state ("optimizer.<name>.<key>"), and from its meta file every rank's CPU
    RNG state ("rng.<rank>"), the lr schedule's step and the loss scaler's state."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from train_utils.snapshots.sharded import ShardedSnapshots

    os.makedirs(out_dir, exist_ok=True)
    for part in ("model", "optimizer"):
        dcp_to_torch_save(os.path.join(folder, part), os.path.join(out_dir, f"{part}.pt"))
    weights = torch.load(os.path.join(out_dir, "model.pt"), weights_only=True)
    optimizer = torch.load(os.path.join(out_dir, "optimizer.pt"), weights_only=True)
    meta = torch.load(os.path.join(folder, ShardedSnapshots.META), weights_only=True)
    tensors = dict(weights)
    for name, state in optimizer["state"].items():
        for key, value in state.items():  # SGD's momentum_buffer; AdamW's exp_avg, exp_avg_sq, step
            tensors[f"optimizer.{name}" + ("" if key == "momentum_buffer" else f".{key}")] = torch.as_tensor(value)
    for rank, states in enumerate(meta["rng_states"]):
        tensors[f"rng.{rank}"] = states["cpu"]
    tensors["position"] = torch.tensor([meta["epochs_run"], meta["steps_run"]])
    tensors["lr_schedule.step"] = torch.tensor(meta["lr_schedule"]["last_epoch"])
    for key, value in (meta["loss_scaler"] or {}).items():
        tensors[f"loss_scaler.{key}"] = torch.as_tensor(value)
    return weights, tensors


def assert_bitwise(a: dict, b: dict) -> None:
    """Two ``full_state`` dicts hold the same names and bitwise equal tensors."""
    assert a.keys() == b.keys()
    assert [name for name in a if not torch.equal(a[name], b[name])] == []


# A small evaluation problem, for the tests of sharded evaluation (DDP's and FSDP's)

N_EVAL = 97  # divisible by neither 2 nor 3 nor the batch size


class BatchNormClassifier(torch.nn.Module):
    """A linear classifier behind a BatchNorm, whose running statistics a
    test sets, as they differ per rank after training."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(5)
        self.fc = torch.nn.Linear(5, 4)

    def forward(self, x):
        return self.fc(self.norm(x))


def eval_problem():
    """(``N_EVAL`` samples of 5 features in 4 classes, a BatchNormClassifier
    with set BatchNorm statistics), the same at every call."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(N_EVAL, 5, generator=g)
    y = torch.randint(0, 4, (N_EVAL,), generator=g)
    torch.manual_seed(3)
    model = BatchNormClassifier()
    model.norm.running_mean.copy_(torch.randn(5, generator=g))
    model.norm.running_var.copy_(torch.rand(5, generator=g) + 0.5)
    return torch.utils.data.TensorDataset(x, y), model


def snapshot_keys(keys: list) -> list:
    """The keys of a bucket's listing but the goodput ledger and timeline beside a snapshot."""
    return [key for key in keys if not re.search(r"\.goodput\.jsonl$|\.timeline/", key)]


GOODPUT_LINE = re.compile(r"^goodput (?P<goodput>\d\.\d\d)(?: \((?P<rest>[^)]*)\))?$", re.M)


def assert_goodput(snapshot, world_sizes: list, redone: list, stdout: str = "", since: float = 0.0) -> list:
    """The goodput ledger and timeline beside ``snapshot`` (its --snapshot_path)
    after a run of ``len(world_sizes)`` attempts, attempt i trained by
    ``world_sizes[i - 1]`` ranks: each attempt's categories are >= 0 and sum
    to its wall time, which starts after ``since`` (time.time() before the
    first launch; 0: unchecked) and ends by now; attempt i's steps redone by
    attempt i + 1 are ``redone[i - 1]``; the timeline parses as Perfetto
    reads a JSON-array trace without its closing bracket and has a track per
    rank per attempt (pid the attempt, tid the rank), each with its start-up
    span; ``stdout`` (the run's last attempt), where given, ends with the
    goodput line, the ledger's, whose shares sum to 100% +- 2. A ``redone``
    entry None is not checked (an attempt killed outright beside a snapshot
    in a bucket: its last record may be up to 10 s old). ``snapshot`` an
    ``s3://`` URL: its objects are read through this process's bucket
    client (the ``store_env`` fixture points it at the store). Returns the
    ledger's records."""
    from train_utils.logs.goodput import attempt_totals, goodput_line, goodput_paths, read_ledger
    from train_utils.logs.timeline import read_trace

    ledger, trace = goodput_paths(str(snapshot))
    records = read_ledger(ledger)
    totals = attempt_totals(records)
    assert sorted(totals) == list(range(1, len(world_sizes) + 1)), records
    for attempt, total in totals.items():
        seconds = total["seconds"]
        assert abs(sum(seconds.values()) - total["wall_s"]) < 1e-6, (attempt, total)
        assert min(seconds.values()) >= -1e-3, (attempt, total)
        last = [r for r in records if r["attempt"] == attempt and r["record"] != "redone"][-1]
        assert since - 1 <= last["started"] <= last["time"] <= time.time(), (since, last)
    found = [totals[attempt]["redone_steps"] for attempt in sorted(totals)[:-1]]
    assert len(found) == len(redone) and [None if want is None else steps
                                          for steps, want in zip(found, redone)] == redone, records
    events = read_trace(trace)
    tracks = {(e["pid"], e["tid"]) for e in events if e["name"] == "thread_name"}
    assert tracks == {(attempt, rank) for attempt, size in enumerate(world_sizes, 1) for rank in range(size)}, tracks
    started = {(e["pid"], e["tid"]) for e in events if e["name"] == "start-up" and e["ph"] == "X"}
    assert started == tracks, started
    if stdout:
        lines = GOODPUT_LINE.findall(stdout)
        assert len(lines) == 1, stdout[-3000:]
        match = GOODPUT_LINE.search(stdout)
        assert match.group(0) == goodput_line(records), (match.group(0), records)
        rest = re.findall(r"(\S+) (\d+)%", match.group("rest") or "")
        assert abs(float(match.group("goodput")) * 100 + sum(int(share) for _, share in rest) - 100) <= 2, match
    return records
