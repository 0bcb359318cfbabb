"""The sbatch wrappers in slurm/, run unchanged under a real Slurm cluster
(slurmctld + three slurmd, see slurm_cluster.py): one node with two "GPUs"
for single_gpu.sh and multi_gpu.sh, two hosts in network namespaces for
multi_node.sh; a warning signal mid-training, requeue and resume; and
multinode.py across the two hosts with plain torchrun.

Options on sbatch's command line (resources this machine has, partition,
--chdir for the output) override the wrappers' #SBATCH lines, as a user's
would; the wrappers themselves are submitted as they are in the repo.
"""

import re
import subprocess
import sys
import time

import pytest
import torch

from conftest import REPO, TORCHRUN, assert_same_snapshot, build_mnist_root, epochs, parse_test, \
    run_together, script_env, snapshot_tensors
from slurm_cluster import NETNS_NODES, NODE_IFACE

# What this machine can give a job; the wrappers ask for a real GPU node's share.
SMALL = ["--mem=1G", "--cpus-per-task=1", "--time=15"]
MULTI = ["--partition=multi"]
JOB_TIMEOUT_S = 300
RANK_LINE = re.compile(r"^\[rank (\d+) \| local_rank (\d+) \| host (\S+)\] epoch (\d+)", re.M)


@pytest.fixture(scope="module")
def cluster(slurm_cluster):
    """The session's one Slurm cluster (conftest.slurm_cluster)."""
    return slurm_cluster


def submit(cluster, tmp_path, wrapper, *args, sbatch=(), env=None) -> int:
    """sbatch a wrapper from the project folder, output into tmp_path."""
    job_env = {"VENV_DIR": sys.prefix, **(env or {})}
    return cluster.sbatch([f"--chdir={tmp_path}", *SMALL, *sbatch, f"slurm/{wrapper}", *args],
                          cwd=REPO, env=job_env)


def finished(cluster, tmp_path, job_id, name) -> tuple[dict, str]:
    info = cluster.wait(job_id, JOB_TIMEOUT_S)
    log = (tmp_path / f"{name}-{job_id}.out").read_text()
    assert info["JobState"] == "COMPLETED", f"{info}\n{log}\n{cluster.logs()}"
    return info, log


def test_single_gpu_wrapper(cluster, tmp_path):
    job = submit(cluster, tmp_path, "single_gpu.sh", "--total_epochs", "3", "--lr", "0.02")
    info, log = finished(cluster, tmp_path, job, "single_gpu")
    assert info["ExitCode"] == "0:0"
    assert [e["epoch"] for e in epochs(log)] == [1, 2, 3]  # the arguments reached the script
    assert parse_test(log)["loss"] < 0.1
    state = torch.load(tmp_path / f"checkpoint-{job}.pt", weights_only=True)
    assert "net.0.weight" in state or any(key.endswith("weight") for key in state)


def test_multi_gpu_wrapper_runs_one_worker_per_gpu(cluster, tmp_path):
    data = build_mnist_root(tmp_path / "data", n_train=2000, n_test=500)
    job = submit(cluster, tmp_path, "multi_gpu.sh", "--dataset", "mnist", "--data_dir", str(data),
                 "--total_epochs", "2", sbatch=["--gres=gpu:2"])
    info, log = finished(cluster, tmp_path, job, "multi_gpu")
    assert f"job {job} on " in log and "| 2 processes |" in log
    assert [e["epoch"] for e in epochs(log)] == [1, 2]
    assert parse_test(log)["acc"] > 0.8
    config = torch.load(tmp_path / f"snapshot-{job}.pt", weights_only=True)["config"]
    # two workers, from the two GPUs Slurm granted; the flags passed through
    assert config["world_size"] == 2 and config["dataset"] == "mnist"
    # and one GPU gives one worker, with no edit to the wrapper
    job = submit(cluster, tmp_path, "multi_gpu.sh", "--total_epochs", "1", sbatch=["--gres=gpu:1"])
    _, log = finished(cluster, tmp_path, job, "multi_gpu")
    assert "| 1 processes |" in log
    assert torch.load(tmp_path / f"snapshot-{job}.pt", weights_only=True)["config"]["world_size"] == 1


def test_multi_node_wrapper_two_hosts_four_ranks(cluster, tmp_path):
    job = submit(cluster, tmp_path, "multi_node.sh", "--total_epochs", "2",
                 sbatch=[*MULTI, "--gres=gpu:2"], env={"GLOO_SOCKET_IFNAME": NODE_IFACE})
    info, log = finished(cluster, tmp_path, job, "multi_node")
    assert info["NodeList"] == "ddp-node[1-2]"
    # The rendezvous: on the job's first host, at the port derived from the job id.
    assert f"| 2 nodes (ddp-node[1-2]) x 2 processes | rendezvous ddp-node1:{15000 + job % 15000} |" in log
    seen = {(int(rank), int(local), host) for rank, local, host, _ in RANK_LINE.findall(log)}
    assert seen == {(0, 0, "ddp-node1"), (1, 1, "ddp-node1"), (2, 0, "ddp-node2"), (3, 1, "ddp-node2")} \
        or seen == {(0, 0, "ddp-node2"), (1, 1, "ddp-node2"), (2, 0, "ddp-node1"), (3, 1, "ddp-node1")}, log
    assert [e["epoch"] for e in epochs(log)] == [1, 2]  # global rank 0 alone prints the summary
    assert parse_test(log)["loss"] < 0.2
    assert torch.load(tmp_path / f"snapshot-{job}.pt", weights_only=True)["config"]["world_size"] == 4


@pytest.mark.parametrize("wrapper,name,sbatch,env,script,nproc", [
    ("multi_gpu.sh", "multi_gpu", ["--gres=gpu:2"], {}, "multigpu_torchrun.py", 2),
    ("multi_node.sh", "multi_node", [*MULTI, "--gres=gpu:1"], {"GLOO_SOCKET_IFNAME": NODE_IFACE},
     "multinode.py", 2),
])
def test_warning_signal_snapshots_requeues_and_resumes(cluster, tmp_path, wrapper, name, sbatch, env,
                                                       script, nproc):
    """SIGUSR1 to the batch shell mid-training (what --signal=B:USR1@90 sends):
    all ranks stop after the same step, the snapshot is saved, the job is
    requeued and resumes there; the final weights equal an uninterrupted run's."""
    args = ["--total_epochs", "16", "--batch_size", "8"]
    job = submit(cluster, tmp_path, wrapper, *args, sbatch=sbatch, env=env)
    out = tmp_path / f"{name}-{job}.out"
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not (out.exists() and "epoch 2/16" in out.read_text()):
        assert time.monotonic() < deadline and cluster.job(job)["JobState"] in ("PENDING", "RUNNING"), \
            f"{cluster.job(job)}\n{out.read_text() if out.exists() else ''}"
        time.sleep(0.2)
    subprocess.run(["scancel", "--signal=USR1", "--batch", str(job)], env=cluster.env, check=True)
    # Requeued: pending again, restart count 1.
    while True:
        info = cluster.job(job)
        if info["JobState"] == "PENDING" and int(info["Restarts"]) >= 1:
            break
        assert info["JobState"] in ("RUNNING", "COMPLETING", "REQUEUED", "PENDING") \
            and time.monotonic() < deadline, f"{info}\n{out.read_text()}"
        time.sleep(0.2)
    # Slurm holds a requeued job for about 2 minutes, so that the node has
    # cleaned up after the previous run; a test need not wait that long, only
    # until the nodes are no longer completing that run, plus 2 s: slurmd
    # refuses a launch credential issued in the same second as the revocation
    # of the previous one ("Job credential revoked").
    while any("comp" in state for state in cluster.node_states().values()):
        assert time.monotonic() < deadline, cluster.node_states()
        time.sleep(0.2)
    time.sleep(2)
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=cluster.env, check=True)
    info, log = finished(cluster, tmp_path, job, name)
    assert int(info["Restarts"]) == 1 and info["ExitCode"] == "0:0"

    first, second = log.split("| restart 1 |")
    assert "| restart 0 |" in first and "got the warning signal" in first
    stop = re.search(r"^epoch (\d+) step (\d+) \| snapshot saved at snapshot-\d+\.pt$", first, re.M)
    assert stop and "stopped by SIGUSR1" in first and "requeueing job" in first, first
    epoch, step = stop.groups()
    assert f"resuming from snapshot snapshot-{job}.pt in epoch {epoch} after step {step}" in second
    # Every epoch summarised exactly once over the two attempts: nothing lost, nothing redone.
    assert [e["epoch"] for e in epochs(first)] == list(range(1, int(epoch)))
    assert [e["epoch"] for e in epochs(second)] == list(range(int(epoch), 17))
    assert parse_test(second)

    # The same training without interruption, plain torchrun on this machine.
    reference = tmp_path / "reference"
    reference.mkdir()
    result = subprocess.run(TORCHRUN + ["--standalone", f"--nproc_per_node={nproc}", str(REPO / script),
                                        *args], cwd=reference, env=script_env(), capture_output=True,
                            text=True, timeout=JOB_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    assert snapshot_tensors(tmp_path / f"snapshot-{job}.pt")[0] == 16
    assert_same_snapshot(tmp_path / f"snapshot-{job}.pt", reference / "snapshot.pt")


def test_multinode_plain_torchrun_across_two_hosts(cluster, tmp_path):
    """No Slurm: the same torchrun command on each host, as the README shows."""
    port = 29400
    cmd = TORCHRUN + ["--nnodes=2", "--nproc_per_node=2", "--rdzv-backend=c10d",
                      f"--rdzv-endpoint=ddp-node1:{port}", "--rdzv-id=plain", str(REPO / "multinode.py"),
                      "--total_epochs", "2"]
    outputs = run_together([cluster.on_host(node, cmd) for node in NETNS_NODES],
                           [tmp_path] * len(NETNS_NODES), script_env(GLOO_SOCKET_IFNAME=NODE_IFACE),
                           timeout=JOB_TIMEOUT_S)
    for code, stdout, stderr in outputs:
        assert code == 0, stderr[-3000:]
    seen = {(int(rank), host) for _, stdout, _ in outputs for rank, _, host, _ in RANK_LINE.findall(stdout)}
    assert {rank for rank, _ in seen} == {0, 1, 2, 3}
    assert {host for _, host in seen} == set(NETNS_NODES)
    summary = [stdout for _, stdout, _ in outputs if epochs(stdout)]
    assert len(summary) == 1 and [e["epoch"] for e in epochs(summary[0])] == [1, 2]


def test_submitted_from_the_wrong_folder_fails_clearly(cluster, tmp_path):
    job = cluster.sbatch([*SMALL, "--gres=gpu:2", str(REPO / "slurm" / "multi_gpu.sh")], cwd=tmp_path,
                         env={"VENV_DIR": sys.prefix})
    info = cluster.wait(job, JOB_TIMEOUT_S)
    log = (tmp_path / f"multi_gpu-{job}.out").read_text()
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0", info
    assert log.strip().splitlines() == [
        f"error: {tmp_path}/multigpu_torchrun.py not found; submit from the project folder "
        f"(cd ddp-scripts && sbatch slurm/multi_gpu.sh) or set PROJECT_DIR"]


@pytest.mark.parametrize("wrapper", ["single_gpu.sh", "multi_gpu.sh", "multi_node.sh"])
def test_wrapper_outside_sbatch_says_how_to_submit(wrapper):
    env = {key: value for key, value in script_env().items() if not key.startswith("SLURM_")}
    result = subprocess.run(["bash", f"slurm/{wrapper}"], cwd=REPO, env=env, capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: this is a Slurm batch script; submit it with: sbatch slurm/{wrapper} [training args]"]
    assert result.stdout == ""


@pytest.mark.parametrize("wrapper", ["single_gpu.sh", "multi_gpu.sh", "multi_node.sh"])
def test_every_sbatch_line_is_explained_and_nothing_is_hard_coded(wrapper):
    text = (REPO / "slurm" / wrapper).read_text()
    directives = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    assert directives and all(re.match(r"#SBATCH \S+\s+# \S", line) for line in directives), directives
    for option in ("--time=", "--output=%x-%j.out"):
        assert any(option in line for line in directives), option
    # #SBATCH lines after the first command are ignored by sbatch: all must come first.
    body = text.splitlines()
    first_command = next(i for i, line in enumerate(body) if line and not line.startswith("#"))
    assert all(i < first_command for i, line in enumerate(body) if line.startswith("#SBATCH"))
    assert "set -euo pipefail" in text and "$SLURM_SUBMIT_DIR" in text
    assert not re.search(r"--nnodes=\d|--nproc_per_node=\d|MASTER_PORT=\d+\s*$", text, re.M)
