"""Section 6b, node_traffic: the bytes that cross between two nodes per
optimizer step under DDP, FSDP and HSDP, on the same GPT.

Two hosts on this machine: two network namespaces joined by a veth pair, each
end with its own address, as two machines joined by one link. train.py runs on
them as a 2-node job of 2 ranks each (one torchrun agent per host, gloo told
to use the link: GLOO_SOCKET_IFNAME), --dataset shakespeare_char's GPT. The
bytes are each host's link counters (``ip -s link``: what the kernel sent
through that interface); the two ranks of one host talk over its loopback and
are not counted. Each strategy runs twice, for ``short`` and ``long``
optimizer steps; the difference divided by the extra steps is the traffic of
a step, with start-up, the final evaluation and the snapshot subtracted out.

Beside each measured figure is what the algorithms predict per host and step
for a parameter size S (fp32 bytes), W = 4 ranks as R = 2 nodes x G = 2
ranks, the ranks of a node next to each other, each collective either a ring
(crossing between the hosts once each way) or a direct exchange (every rank
sends each other rank its part):
  DDP   all-reduce of the gradients over W ranks: ring 2 (W - 1) / W x S =
        1.5 S; direct, a reduce-scatter and an all-gather, each G x G x S / W:
        2 S
  FSDP  an all-gather in forward and one in backward, a reduce-scatter of
        the gradients, each over W ranks: ring 3 x (W - 1) / W x S = 2.25 S;
        direct 3 x G x G x S / W = 3 S (the root unit's parameters stay
        gathered for backward: a little less)
  HSDP  all-gathers and reduce-scatters inside a host; across, an all-reduce
        of each rank's shard (S / G) with its one other replica, G pairs at
        once: G x S / G = S either way
gloo picks its algorithm by collective and size; the ratio HSDP / FSDP is
what the choice of strategy turns on.

Needs root (network namespaces) and the Tiny Shakespeare corpus
(support/data.py); else the section says why it is skipped.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.harness import table, tail
from support.data import Absent, build_shakespeare_root
from support.runs import free_port

REPO = Path(__file__).resolve().parent.parent
# (namespace, address, interface) of each host; a /24 no test cluster uses.
HOSTS = (("ddp-traffic-a", "10.203.0.1", "trafa0"), ("ddp-traffic-b", "10.203.0.2", "trafb0"))
STRATEGIES = ("ddp", "fsdp", "hsdp")
# x S per host and step, (ring, direct exchange): the module's docstring
EXPECTED = {"ddp": (1.5, 2.0), "fsdp": (2.25, 3.0), "hsdp": (1.0, 1.0)}


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def _remove_hosts() -> None:
    for namespace, _, _ in HOSTS:
        _ip("netns", "delete", namespace, check=False)  # its end of the veth pair goes with it


@contextlib.contextmanager
def two_hosts():
    """Two network namespaces joined by a veth pair (``HOSTS``), removed after."""
    _remove_hosts()  # what an interrupted run left
    (a, address_a, link_a), (b, address_b, link_b) = HOSTS
    try:
        for namespace, _, _ in HOSTS:
            _ip("netns", "add", namespace)
            _ip("-n", namespace, "link", "set", "lo", "up")
        _ip("link", "add", link_a, "type", "veth", "peer", "name", link_b)
        for namespace, address, link in HOSTS:
            _ip("link", "set", link, "netns", namespace)
            _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", link)
            _ip("-n", namespace, "link", "set", link, "up")
        yield
    finally:
        _remove_hosts()


def sent_bytes() -> list[int]:
    """Bytes each host has sent through its end of the link so far."""
    counts = []
    for namespace, _, link in HOSTS:
        [info] = json.loads(_ip("-n", namespace, "-j", "-s", "link", "show", link).stdout)
        counts.append(int(info["stats64"]["tx"]["bytes"]))
    return counts


def run_job(strategy: str, steps: int, data_dir: Path, cwd: Path, timeout: float = 600) -> list[int]:
    """train.py --strategy ``strategy`` for ``steps`` optimizer steps as a job
    of the two hosts, 2 ranks each; returns the bytes each host sent.
    Raises RuntimeError with the output's tail when the job fails."""
    port = free_port()
    before = sent_bytes()
    agents = []
    for node, (namespace, _, link) in enumerate(HOSTS):
        cmd = ["ip", "netns", "exec", namespace, sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
               "--nproc_per_node=2", f"--node_rank={node}", f"--master_addr={HOSTS[0][1]}",
               f"--master_port={port}", str(REPO / "train.py"), "--strategy", strategy,
               "--dataset", "shakespeare_char", "--data_dir", str(data_dir), "--max_steps", str(steps),
               "--log_every_steps", "0", "--snapshot_path", f"snapshot-{strategy}-{steps}"]
        env = dict(os.environ, GLOO_SOCKET_IFNAME=link, NCCL_SOCKET_IFNAME=link, OMP_NUM_THREADS="1")
        agents.append(subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True))
    outputs = []
    try:
        for agent in agents:
            outputs.append(agent.communicate(timeout=timeout)[0])
    finally:
        for agent in agents:
            agent.kill()
    if any(agent.returncode for agent in agents):
        raise RuntimeError(f"{strategy}, {steps} steps failed: " + tail("".join(outputs).splitlines()))
    return [after - start for after, start in zip(sent_bytes(), before)]


def parameter_bytes() -> int:
    """S: the fp32 bytes of the parameters of --dataset shakespeare_char's GPT."""
    from gpt import GPT
    from text_tasks import SHAKESPEARE_MODEL

    return sum(p.numel() * p.element_size() for p in GPT(SHAKESPEARE_MODEL).parameters())


def section_node_traffic(short: int = 10, long: int = 30) -> dict:
    """The table of bytes between the hosts per step for each strategy."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return {"skipped": "needs root and iproute2 (network namespaces)"}
    try:
        data_dir = build_shakespeare_root(Path(tempfile.mkdtemp()) / "data")
    except Absent as exc:
        return {"skipped": f"Tiny Shakespeare absent ({exc})"}
    size = parameter_bytes()
    rows, result = [], {"parameter_bytes": size, "strategies": {}}
    with two_hosts(), tempfile.TemporaryDirectory() as folder:
        for strategy in STRATEGIES:
            sent = {steps: run_job(strategy, steps, data_dir, Path(folder)) for steps in (short, long)}
            per_host = [(sent[long][h] - sent[short][h]) / (long - short) for h in range(len(HOSTS))]
            mean = sum(per_host) / len(per_host)
            result["strategies"][strategy] = {"bytes_per_step_per_host": per_host, "sent": sent}
            ring, direct = EXPECTED[strategy]
            rows.append([strategy.upper(), f"{mean:,.0f}", f"{mean / size:.2f}", f"{ring:.2f}", f"{direct:.2f}"])
    ratio = (sum(result["strategies"]["hsdp"]["bytes_per_step_per_host"]) /
             sum(result["strategies"]["fsdp"]["bytes_per_step_per_host"]))
    result["hsdp_over_fsdp"] = ratio
    result["table"] = table(
        f"6b. bytes between two hosts per optimizer step (2 hosts x 2 ranks, gloo, shakespeare_char GPT, "
        f"S = {size:,} bytes of fp32 parameters); HSDP / FSDP = {ratio:.2f}",
        ["strategy", "bytes a host sends per step", "x S", "x S predicted, ring", "x S predicted, direct"], rows)
    return result
