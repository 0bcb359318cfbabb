"""Elastic torchrun (``--nnodes=MIN:MAX``, c10d rendezvous): a node lost mid-run
leaves the others going at the smaller world size, and a node that joins makes
the job grow back, without a hang. Two real torchrun agents on this host, each
one "node"; the lost one is SIGKILLed with its worker (no stop signal, as a
node that dies), then started again."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from helpers import REPO, TORCHRUN, free_port, script_env

# torch's dynamic rendezvous shares its agent's store with the workers by
# default, and that store's address is not renewed when the membership
# changes (the workers of a joining node wait for it until a time-out);
# elastic jobs turn the sharing off (docs/fault-tolerance.md).
ELASTIC_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}


def elastic_launch(port: int, max_restarts: int = 3) -> list:
    """torchrun for one node of a 1-to-2-node elastic job meeting at ``port``:
    short rendezvous timeouts (a dead node's heartbeat missed for 3 s) and a
    monitor that looks every 0.5 s, so that a loss or a join is seen quickly."""
    return TORCHRUN + ["--nnodes=1:2", "--nproc_per_node=1", "--rdzv-backend=c10d",
                       f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=elastic-test",
                       f"--max-restarts={max_restarts}", "--monitor-interval=0.5",
                       "--rdzv-conf=join_timeout=60,last_call_timeout=1,close_timeout=10,"
                       "keep_alive_interval=1,keep_alive_max_attempt=3"]


class Agents:
    """torchrun agents started by a test, each logging to <folder>/<name>.log;
    whatever is left is SIGKILLed, workers too, at the end (``close``)."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.procs = folder, {}

    def start(self, name: str, cmd: list, **env: str) -> None:
        """Start agent ``name`` in its own process group."""
        with open(self.folder / f"{name}.log", "w") as log:
            self.procs[name] = subprocess.Popen([str(part) for part in cmd], cwd=self.folder, stdout=log,
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


# A worker that only meets the others through train_utils.launcher_store:
# says its place in the round, then all-reduces until a file named "finish"
# exists (every rank agrees when, through the all-reduce).
STORE_WORKER = f"""
import os, sys, time
from datetime import timedelta
sys.path.insert(0, {str(REPO)!r})
import torch, torch.distributed as dist
from train_utils.launch import launcher_store

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
store = launcher_store(timedelta(seconds=20))
dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=20))
print(f"worker {{os.getpid()}}: rank {{rank}} of {{world}}, restart {{os.environ['TORCHELASTIC_RESTART_COUNT']}}",
      flush=True)
while True:
    flag = torch.tensor([float(os.path.exists("finish"))])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item():
        break
    time.sleep(0.1)
dist.destroy_process_group()
"""


def test_a_node_lost_and_started_again_rejoins_without_a_hang(tmp_path):
    """A 2-node job loses node b (agent and worker SIGKILLed): node a's worker
    fails, its agent restarts it alone (restart count 1); b started again
    (restart count 0) joins, and both ranks of the grown job meet at
    process-group start, then end with exit 0. Keyed on the restart count,
    the two ranks waited for each other's keys under two prefixes
    (attempt_1, attempt_0) until the store's time-out, every round: the
    restarts ran out and the job failed."""
    (tmp_path / "worker.py").write_text(STORE_WORKER)
    launch = elastic_launch(free_port()) + ["worker.py"]
    agents = Agents(tmp_path)
    try:
        agents.start("a", launch, **ELASTIC_ENV)
        agents.wait_for("a", "rank 0 of 1, restart 0")  # a alone: it hosts the rendezvous
        agents.start("b", launch, **ELASTIC_ENV)
        agents.wait_for("b", "of 2, restart 0")
        agents.kill("b")
        agents.wait_for("a", "rank 0 of 1, restart 1")  # a's worker failed with b's; restarted alone
        agents.start("b_again", launch, **ELASTIC_ENV)
        agents.wait_for("b_again", "of 2, restart 0")
        agents.wait_for("a", "of 2, restart 1")
        (tmp_path / "finish").touch()
        for name in ("a", "b_again"):
            assert agents.procs[name].wait(timeout=60) == 0, agents.logs()
    finally:
        agents.close()
