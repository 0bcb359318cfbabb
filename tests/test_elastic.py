"""Elastic torchrun (``--nnodes=MIN:MAX``, c10d rendezvous): a node lost mid-run
leaves the others going at the smaller world size, and a node that joins makes
the job grow back, without a hang. Two real torchrun agents on this host, each
one "node" of 2 ranks under HSDP (a replica a node), each in a working folder
of its own, the snapshot in a bucket (moto's S3 server on 127.0.0.1, the
``s3_server`` fixture) as where nodes share no filesystem; the lost one is
SIGKILLed with its workers (no stop signal, as a node that dies), then
started again in a new, empty folder. (Slurm's node loss under DDP:
tests/test_slurm.py.)"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

from dataset_files import build_mnist_root
from helpers import FAULTY_TRAIN, REPO, TORCHRUN, assert_goodput, free_port, local_files, script_env, snapshot_keys

from train_utils.snapshots import bucket

# torch's dynamic rendezvous shares its agent's store with the workers by
# default, and that store's address is not renewed when the membership
# changes (the workers of a joining node wait for it until a time-out);
# elastic jobs turn the sharing off (docs/fault-tolerance.md).
ELASTIC_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}


def elastic_launch(port: int, hosts: bool, last_call_s: int = 1, nproc: int = 1) -> list:
    """torchrun for one node (``nproc`` ranks) of a 1-to-2-node elastic job meeting at ``port``,
    whose agent hosts the rendezvous (``hosts``) or not: on one host every
    agent matches the endpoint, and the first to bind it would host it, so
    the node that survives is told to (the rendezvous host's loss ends a job),
    and its address sorts first (``--local-addr``), so its workers are the first
    ranks in every round it is in, whichever agent started first;
    short rendezvous timeouts (a dead node's heartbeat missed for 3 s; a round
    of fewer than 2 nodes closes ``last_call_s`` after its first one joined)
    and a monitor that looks every 0.5 s, so that a loss or a join is seen
    quickly."""
    return TORCHRUN + ["--nnodes=1:2", f"--nproc_per_node={nproc}", "--rdzv-backend=c10d",
                       f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=elastic-test",
                       f"--local-addr=127.0.0.{1 if hosts else 2}",
                       "--max-restarts=3", "--monitor-interval=0.5",
                       f"--rdzv-conf=is_host={str(hosts).lower()},join_timeout=60,last_call_timeout={last_call_s},"
                       "close_timeout=10,keep_alive_interval=1,keep_alive_max_attempt=3"]


class Agents:
    """torchrun agents started by a test, each logging to <folder>/<name>.log
    and working in <folder>/<name>, a folder of its own, empty at its start;
    whatever is left is SIGKILLed, workers too, at the end (``close``)."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.procs = folder, {}

    def start(self, name: str, cmd: list, **env: str) -> None:
        """Start agent ``name`` in its own process group and its own new folder."""
        (self.folder / name).mkdir()
        with open(self.folder / f"{name}.log", "w") as log:
            self.procs[name] = subprocess.Popen([str(part) for part in cmd], cwd=self.folder / name, stdout=log,
                                                stderr=subprocess.STDOUT, env=script_env(**env),
                                                start_new_session=True)

    def log(self, name: str) -> str:
        return (self.folder / f"{name}.log").read_text(errors="replace")

    def wait_for(self, name: str, line: str, count: int = 1, timeout: float = 120) -> None:
        """Wait until ``line`` is in agent ``name``'s log ``count`` times; fail,
        showing every log, when its agent ends first or after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while self.log(name).count(line) < count:
            assert self.procs[name].poll() is None and time.monotonic() < deadline, \
                f"waiting for {line!r} x{count} in {name}.log\n" + self.logs()
            time.sleep(0.2)

    def logs(self) -> str:
        return "\n".join(f"--- {name}.log\n{self.log(name)[-6000:]}" for name in self.procs)

    def kill(self, name: str) -> None:
        """SIGKILL agent ``name`` and its workers (each in a session of its own,
        torchrun's), as a node that dies: no stop signal, no snapshot."""
        agent = self.procs[name]
        workers = _children(agent.pid)
        os.killpg(agent.pid, signal.SIGKILL)
        for pid in workers:
            _kill(pid)
        agent.wait()

    def close(self) -> None:
        for agent in self.procs.values():
            if agent.poll() is None:
                workers = _children(agent.pid)
                os.killpg(agent.pid, signal.SIGKILL)
                for pid in workers:
                    _kill(pid)
                agent.wait()


def _children(pid: int) -> list:
    """The pids of process ``pid``'s children (Linux's /proc)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(child) for child in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_hsdp_shrinks_to_one_node_mid_epoch_and_grows_back(tmp_path, s3_server, store_env):
    """The job of docs/fault-tolerance.md under HSDP, each node a replica of 2
    ranks, on real MNIST digits (1,600 to train, batch 16, a snapshot every 5
    steps): nodes a (ranks 0 and 1) and b (2 and 3) start together, one round
    of 2 nodes (replicate 2 x shard 2: 25 steps an epoch). b's workers are held
    before their step 8 and b is SIGKILLed with them there, after the snapshot
    at step 5; a goes on alone, mid-epoch, at world size 2 (one replica:
    replicate 1 x shard 2), resharding that snapshot (the 320 samples trained
    are its first 10 steps), and rank 0 is held before its 31st step there
    (step 41), rank 1 waiting for it. b started again joins: torchrun stops
    a's workers with SIGTERM; they agree on the step after (step 42: 1,344
    samples) and the stop path saves there; the grown job, 2 replicas again,
    resumes that mid-epoch at world size 4 (step 21) and finishes, exit 0 on
    both nodes. The one epoch is summarised once,
    counting 1,600 samples: each trained once (the steps b lost since the
    snapshot re-run once). b's agent starts first and waits for a's
    rendezvous, so that both join a's first round (its last call waits 10 s
    for a second node). Fails without the resize (a mid-epoch snapshot at
    another world size was refused: a used up its restarts) and without the
    store keys every rank of a round agrees on (launch.store_prefix: keyed on
    each agent's restart count, a's ranks (1) and b's (0) waited for each
    other at process-group start until the restarts ran out). The snapshot
    lives in a bucket only, each agent working in a folder of its own (b
    started again in a new, empty one): every save and resume names the
    bucket, no folder holds a snapshot (nor a goodput ledger), and the
    bucket ends with the one committed save and no lease. Fails where an
    s3:// path is taken as a local folder (the saves land in a's folder,
    under s3:, and b's new folder resumes none). The goodput ledger beside
    the snapshot in the bucket counts the three attempts (4, 2 and 4
    ranks), steps 6 and 7 of the first redone (after its step-5 snapshot:
    its ranks on a fail on b's loss and commit their last record), none of
    the second (its stop's snapshot), and the timeline in the bucket has a
    track per rank of each, b's lost ranks' included."""
    data = build_mnist_root(tmp_path / "data", n_train=1777, n_test=100)  # 1,600 train, 177 validation
    port = free_port()
    s3_server.create_bucket("elastic")
    path = "s3://elastic/runs/hsdp"
    flags = ["--dataset", "mnist", "--data_dir", data, "--batch_size", "16", "--total_epochs", "1",
             "--strategy", "hsdp", "--snapshot_every_steps", "5", "--metrics_path", "metrics.jsonl",
             "--snapshot_path", path]
    store = s3_server.env()
    # a and b held by DDP_TEST_FAULT (FAULTY_TRAIN); b started again runs train.py itself.
    host, other = (elastic_launch(port, hosts, last_call_s=10, nproc=2) + [FAULTY_TRAIN, *flags]
                   for hosts in (True, False))
    other_again = elastic_launch(port, False, last_call_s=10, nproc=2) + [REPO / "train.py", *flags]
    agents = Agents(tmp_path)
    launched = time.time()
    try:
        # b's agent first, up to where it reaches for the rendezvous (LOGLEVEL=INFO makes torchrun
        # say so), which a's agent hosts: both then join a's first round at once, however long
        # each takes to start on a busy machine.
        agents.start("b", other, DDP_TEST_FAULT="step:*:8:wait_signal_once", LOGLEVEL="INFO", **ELASTIC_ENV,
                     **store)
        agents.wait_for("b", "Starting elastic_operator with launch configs")
        # a's rank 0: held before its 31st step in each process (only a process of the world
        # of 2 gets there: the first round ends at b's step 8).
        agents.start("a", host, DDP_TEST_FAULT="step:0:31:wait_signal", **ELASTIC_ENV, **store)
        agents.wait_for("a", "| HSDP mesh replicate 2 x shard 2 |")
        agents.wait_for("a", f"epoch 1 step 5 | snapshot saved at {path}/epoch-1-step-5")
        agents.wait_for("b", "DDP_TEST_FAULT: wait_signal_once at step 8 on rank 2")
        agents.wait_for("b", "DDP_TEST_FAULT: wait_signal_once at step 8 on rank 3")
        agents.kill("b")
        agents.wait_for("a", "| HSDP mesh replicate 1 x shard 2 |")
        agents.wait_for("a", f"resuming from snapshot {path}/epoch-1-step-5 in epoch 1 after step 10 "
                             "(saved by world_size 4 as HSDP replicate 2 x shard 2, resharded to 2 as HSDP "
                             "replicate 1 x shard 2: ")
        agents.wait_for("a", "DDP_TEST_FAULT: wait_signal at step 31 on rank 0")
        agents.start("b_again", other_again, **ELASTIC_ENV, **store)
        for name in ("a", "b_again"):
            assert agents.procs[name].wait(timeout=180) == 0, agents.logs()
    finally:
        agents.close()
    text = agents.log("a") + agents.log("b_again")
    assert f"epoch 1 step 42 | snapshot saved at {path}/epoch-1-step-42" in text, agents.logs()
    assert re.search(rf"^resuming from snapshot {path}/epoch-1-step-42 in epoch 1 after step 21 "
                     r"\(saved by world_size 2 as HSDP replicate 1 x shard 2, resharded to 4 as HSDP replicate 2 x "
                     r"shard 2: .*epoch 1 goes on after 1344 of its 1600 samples", text, re.M), agents.logs()
    assert text.count("epoch 1/1 |") == 1 and text.count("test | loss") == 1, agents.logs()
    records = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [r["samples"] for r in records if "epoch" in r] == [1600]
    # what each agent's folder holds: rank 0's metrics (a's), nothing else
    assert [local_files(tmp_path / name) for name in ("a", "b", "b_again")] == [["metrics.jsonl"], [], []]
    keys = s3_server.keys("elastic")  # the epoch's save alone, committed; the lease given back
    assert all(key.startswith("runs/hsdp/epoch-1/") for key in snapshot_keys(keys)), keys
    assert f"runs/hsdp/epoch-1/{bucket.MANIFEST}" in keys, keys
    assert all(key.startswith(("runs/hsdp.goodput.jsonl", "runs/hsdp.timeline/"))
               for key in set(keys) - set(snapshot_keys(keys))), keys
    store_env(s3_server.env())
    assert_goodput(path, [4, 2, 4], [7 - 5, 0], text, since=launched)
