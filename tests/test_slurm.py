"""The sbatch wrappers in slurm/, run unchanged under a real Slurm cluster
(slurmctld + slurmd daemons, see slurm_cluster.py), each running train.py,
all submitted at once: one node with four "GPUs" for single_gpu.sh and
multi_gpu.sh, two hosts in network namespaces for multi_node.sh and
multi_node_srun.sh (HSDP, one replica per host; srun's with a container
stand-in per rank), and beside them the
multinode.py rung across the two hosts with plain torchrun. Every way Slurm stops a job: tests/test_stop_paths.py;
the wrappers as text and their shared files: tests/test_slurm_wrappers.py.

Options on sbatch's command line (resources this machine has, partition,
--chdir for the output) override the wrappers' #SBATCH lines, as a user's
would; the wrappers themselves are submitted as they are in the repo.
"""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dataset_files import build_mnist_root
from helpers import FAULTY_TRAIN_JOB_ENV, LINK_LINE, REPO, STRAGGLER_LINE, TORCHRUN, epochs, parse_test, placement, \
    placements, script_env, wrapper_snapshot
from slurm_cluster import NETNS_NODES, NODE_IFACE


# What this machine can give a job; the wrappers ask for a real GPU node's share.
SMALL = ["--mem=1G", "--cpus-per-task=1", "--time=15"]
MULTI = ["--partition=multi"]
JOB_TIMEOUT_S = 300
# The ladder's rungs (multinode.py) print a line per rank and epoch; train.py says where each rank
# runs in rank 0's placement line (helpers.placement).
RUNG_RANK_LINE = re.compile(r"^\[rank (\d+) \| local_rank (\d+) \| host (\S+)\] epoch (\d+)", re.M)


@pytest.fixture(scope="module")
def cluster(slurm_cluster):
    """The session's one Slurm cluster (conftest.slurm_cluster)."""
    return slurm_cluster


def submit(cluster, folder, wrapper, *args, sbatch=(), env=None) -> int:
    """sbatch a wrapper from the project folder, output into ``folder``."""
    job_env = {"VENV_DIR": sys.prefix, **(env or {})}
    return cluster.sbatch([f"--chdir={folder}", *SMALL, *sbatch, f"slurm/{wrapper}", *args],
                          cwd=REPO, env=job_env)


def container_stand_in(folder) -> str:
    """A stand-in for ``apptainer exec [--env NAME=VALUE ...] IMAGE``
    (CONTAINER_RUN): sets each --env, says where it ran and puts the test's
    Python first on PATH, as an image would."""
    stand_in = folder / "container-exec"
    stand_in.write_text("#!/bin/sh\nwhile [ \"$1\" = --env ]; do export \"$2\"; shift 2; done\nimage=$1; shift\n"
                        "echo \"in container $image on $(hostname) as task ${SLURM_PROCID:-none}\"\n"
                        f"PATH={sys.prefix}/bin:$PATH exec \"$@\"\n")
    stand_in.chmod(0o755)
    return str(stand_in)


@pytest.fixture(scope="module")
def jobs(cluster, tmp_path_factory):
    """Every job of this file submitted at once, side by side on the cluster's
    nodes (four "GPUs" and eight CPUs each): {name: (job id, its folder)},
    and "plain": (the two torchrun agents, their folder). Each test then waits
    for its own."""
    folders = {name: tmp_path_factory.mktemp(name) for name in
               ("single_gpu", "multi_gpu", "multi_node", "srun", "wrong_folder")}
    data = build_mnist_root(folders["multi_gpu"] / "data", n_train=2000, n_test=500)
    srun = folders["srun"]
    submitted = {
        "single_gpu": submit(cluster, folders["single_gpu"], "single_gpu.sh", *SINGLE_ARGS, sbatch=["--gres=gpu:1"]),
        "multi_gpu": submit(cluster, folders["multi_gpu"], "multi_gpu.sh", "--dataset", "mnist", "--data_dir",
                            str(data), "--total_epochs", "2", sbatch=["--gres=gpu:2"]),
        "multi_node": submit(cluster, folders["multi_node"], "multi_node.sh", *HSDP_ARGS,
                             sbatch=[*MULTI, "--gres=gpu:2"], env={"GLOO_SOCKET_IFNAME": NODE_IFACE}),
        # VENV_DIR points nowhere: the job succeeds only if the wrapper left the
        # virtual environment alone and ran python through the container command.
        "srun": submit(cluster, srun, "multi_node_srun.sh", *SRUN_ARGS,
                       sbatch=[*MULTI, "--nodes=2", "--ntasks-per-node=2", "--gres=gpu:2"],
                       env={"GLOO_SOCKET_IFNAME": NODE_IFACE, "VENV_DIR": str(srun / "no-venv"),
                            "CONTAINER_IMAGE": "ddp.sif", "CONTAINER_RUN": container_stand_in(srun)}),
        # submitted from a folder that is not the project's
        "wrong_folder": cluster.sbatch([*SMALL, "--gres=gpu:1", str(REPO / "slurm" / "multi_gpu.sh")],
                                       cwd=folders["wrong_folder"], env={"VENV_DIR": sys.prefix}),
    }
    jobs = {name: (job, folders[name]) for name, job in submitted.items()}
    # and, beside them, the rung across the two hosts without Slurm (one torchrun per host)
    folder = tmp_path_factory.mktemp("plain")
    cmd = TORCHRUN + ["--nnodes=2", "--nproc_per_node=2", "--rdzv-backend=c10d", "--rdzv-endpoint=ddp-node1:29400",
                      "--rdzv-id=plain", str(REPO / "multinode.py"), "--total_epochs", "2"]
    agents = []
    for node in NETNS_NODES:  # output to files: a full pipe would stall an agent until its test reads it
        with open(folder / f"{node}.out", "w") as out, open(folder / f"{node}.err", "w") as err:
            agents.append(subprocess.Popen([str(part) for part in cluster.on_host(node, cmd)], cwd=folder,
                                           env=script_env(GLOO_SOCKET_IFNAME=NODE_IFACE), stdout=out, stderr=err))
    jobs["plain"] = (agents, folder)
    try:
        yield jobs
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
                agent.wait()


def finished(cluster, folder, job_id, name) -> tuple[dict, str]:
    info = cluster.wait(job_id, JOB_TIMEOUT_S)
    log = (folder / f"{name}-{job_id}.out").read_text()
    assert info["JobState"] == "COMPLETED", f"{info}\n{log}\n{cluster.logs()}"
    return info, log


SINGLE_ARGS = ["--total_epochs", "3", "--lr", "0.02"]


def test_single_gpu_wrapper_runs_train_py_as_one_process(cluster, jobs):
    job, folder = jobs["single_gpu"]
    info, log = finished(cluster, folder, job, "single_gpu")
    assert info["ExitCode"] == "0:0"
    assert f"job {job} on " in log and "| 1 processes |" in log
    assert [e["epoch"] for e in epochs(log)] == [1, 2, 3]  # the arguments reached the script
    assert parse_test(log)["loss"] < 0.1
    # the snapshot a requeued job resumes from, named after the job and the arguments
    config = torch.load(folder / wrapper_snapshot("single_gpu", SINGLE_ARGS), weights_only=True)["config"]
    assert config["world_size"] == 1 and config["lr"] == 0.02 and config["strategy"] == "ddp"


def test_multi_gpu_wrapper_runs_one_worker_per_gpu(cluster, jobs):
    job, folder = jobs["multi_gpu"]
    info, log = finished(cluster, folder, job, "multi_gpu")
    assert f"job {job} on " in log and "| 2 processes |" in log
    assert [e["epoch"] for e in epochs(log)] == [1, 2]
    assert parse_test(log)["acc"] > 0.8
    # The snapshot is named after the job and the arguments, so that the same command submitted again resumes.
    snapshot = wrapper_snapshot("multi_gpu", ["--dataset", "mnist", "--data_dir", folder / "data",
                                              "--total_epochs", "2"])
    assert f"| {snapshot} |" in log
    config = torch.load(folder / snapshot, weights_only=True)["config"]
    # two workers, from the two GPUs Slurm granted; the flags passed through
    assert config["world_size"] == 2 and config["dataset"] == "mnist"


HSDP_ARGS = ["--total_epochs", "2", "--strategy", "hsdp"]
SRUN_ARGS = ["--total_epochs", "1", "--strategy", "hsdp"]


def test_multi_node_wrapper_two_hosts_four_ranks_hsdp(cluster, jobs):
    """--strategy hsdp passes through to train.py, whose mesh is one replica
    per host (torchrun's LOCAL_WORLD_SIZE, 2 on each); the snapshot the
    wrapper names for it is a folder of sharded saves (DDP across the hosts:
    test_stop_paths.py's preemption of multi_node.sh)."""
    job, folder = jobs["multi_node"]
    info, log = finished(cluster, folder, job, "multi_node")
    assert info["NodeList"] == "ddp-node[1-2]"
    # The rendezvous: on the job's first host, at the port derived from the job id.
    assert f"| 2 nodes (ddp-node[1-2]) x 2 processes | rendezvous ddp-node1:{15000 + job % 15000} |" in log
    seen = placement(log)
    assert seen == {(0, 0, "ddp-node1"), (1, 1, "ddp-node1"), (2, 0, "ddp-node2"), (3, 1, "ddp-node2")} \
        or seen == {(0, 0, "ddp-node2"), (1, 1, "ddp-node2"), (2, 0, "ddp-node1"), (3, 1, "ddp-node1")}, log
    assert "| world_size 4 | " in log and "| HSDP mesh replicate 2 x shard 2 |" in log, log
    assert [e["epoch"] for e in epochs(log)] == [1, 2]  # global rank 0 alone prints the summary
    assert parse_test(log)["loss"] < 0.2
    snapshot = folder / wrapper_snapshot("multi_node", HSDP_ARGS)[:-len(".pt")]
    assert f"| {snapshot.name} |" in log and snapshot.is_dir(), log
    [meta] = snapshot.glob("*/meta.pt")  # the last save's folder, the one before it deleted
    assert meta.parent.name == "epoch-2"
    assert torch.load(meta, weights_only=True)["world_size"] == 4


def test_srun_wrapper_one_task_per_gpu_on_two_hosts_each_in_the_container(cluster, jobs):
    """slurm/multi_node_srun.sh: srun starts 2 tasks on each of 2 hosts, no
    torchrun; each takes its rank from Slurm and meets the others on the
    job's first host. With CONTAINER_IMAGE (a stand-in for apptainer as
    CONTAINER_RUN) srun wraps each task's python in the container command.
    --strategy hsdp: a host's tasks (srun's tasks per node) are the shard
    size. In a real image, preempted and requeued: tests/test_container.py."""
    job, folder = jobs["srun"]
    _, log = finished(cluster, folder, job, "multi_node_srun")
    ran = set(re.findall(r"^in container ddp\.sif on (\S+) as task (\d+)$", log, re.M))
    # every rank through the container (and the batch shell's python check, as task 0)
    assert {(host, int(task)) for host, task in ran} >= {("ddp-node1", 0), ("ddp-node1", 1),
                                                         ("ddp-node2", 2), ("ddp-node2", 3)}, log
    assert "| 2 nodes (ddp-node[1-2]) x 2 tasks |" in log, log
    seen = placement(log)
    # srun's default block distribution: ranks 0, 1 on the first host, 2, 3 on the second
    assert seen == {(0, 0, "ddp-node1"), (1, 1, "ddp-node1"), (2, 0, "ddp-node2"), (3, 1, "ddp-node2")}, log
    assert "| HSDP mesh replicate 2 x shard 2 |" in log, log
    assert [e["epoch"] for e in epochs(log)] == [1]
    snapshot = folder / wrapper_snapshot("multi_node_srun", SRUN_ARGS)[:-len(".pt")]
    [meta] = snapshot.glob("*/meta.pt")
    assert torch.load(meta, weights_only=True)["world_size"] == 4


def test_submitted_from_the_wrong_folder_fails_clearly(cluster, jobs):
    job, folder = jobs["wrong_folder"]
    info = cluster.wait(job, JOB_TIMEOUT_S)
    log = (folder / f"multi_gpu-{job}.out").read_text()
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0", info
    assert log.strip().splitlines() == [
        f"error: {folder}/slurm/env.sh not found; run sbatch slurm/multi_gpu.sh "
        f"from the project folder, or set PROJECT_DIR"]


def test_multinode_plain_torchrun_across_two_hosts(jobs):
    """No Slurm: the same torchrun command on each host, as the README shows
    (the rung, multinode.py; started with the jobs above)."""
    agents, folder = jobs["plain"]
    outputs = []
    for agent, node in zip(agents, NETNS_NODES):
        agent.wait(timeout=JOB_TIMEOUT_S)
        outputs.append((agent.returncode, (folder / f"{node}.out").read_text(), (folder / f"{node}.err").read_text()))
    for code, stdout, stderr in outputs:
        assert code == 0, stderr[-3000:]
    seen = {(int(rank), host) for _, stdout, _ in outputs for rank, _, host, _ in RUNG_RANK_LINE.findall(stdout)}
    assert {rank for rank, _ in seen} == {0, 1, 2, 3}
    assert {host for _, host in seen} == set(NETNS_NODES)
    summary = [stdout for _, stdout, _ in outputs if epochs(stdout)]
    assert len(summary) == 1 and [e["epoch"] for e in epochs(summary[0])] == [1, 2]


def pods(cluster, folder: Path, flags: list, **extra_env) -> list[tuple[int, str, str]]:
    """train.py as a launcher that starts each process itself starts it (a
    Kubernetes PyTorchJob's or JobSet's pods): one process on each host, with
    RANK, WORLD_SIZE, MASTER_ADDR (the first host's address) and MASTER_PORT
    alone, no torchrun and no LOCAL_RANK (and ``extra_env``). Returns each
    one's (exit status, stdout, stderr)."""
    runs = []
    for rank, node in enumerate(NETNS_NODES):  # output to files, as for the agents above
        env = script_env(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR=NETNS_NODES["ddp-node1"], MASTER_PORT="29511",
                         GLOO_SOCKET_IFNAME=NODE_IFACE, **extra_env)
        with open(folder / f"{node}.out", "w") as out, open(folder / f"{node}.err", "w") as err:
            runs.append(subprocess.Popen([str(part) for part in cluster.on_host(
                node, [sys.executable, REPO / "train.py", *flags])], cwd=folder, env=env, stdout=out, stderr=err))
    for run in runs:
        run.wait(timeout=JOB_TIMEOUT_S)
    return [(run.returncode, (folder / f"{node}.out").read_text(), (folder / f"{node}.err").read_text())
            for run, node in zip(runs, NETNS_NODES)]


def test_pods_with_the_plain_environment_train_and_resume(cluster, tmp_path):
    """Two "pods", one process each on its own host: each derives its local
    rank (0: alone on its host) and they train; the same command with more
    epochs resumes from the snapshot rank 0 wrote."""
    flags = ["--dataset", "synthetic", "--total_epochs", "1"]
    first = pods(cluster, tmp_path, flags)
    for code, _, stderr in first:
        assert code == 0, stderr[-3000:]
    seen = {where for _, stdout, _ in first for where in placement(stdout)}
    assert seen == {(0, 0, "ddp-node1"), (1, 0, "ddp-node2")}
    again = pods(cluster, tmp_path, flags[:-1] + ["2"])
    for code, _, stderr in again:
        assert code == 0, stderr[-3000:]
    assert "resuming from snapshot snapshot_train.pt after epoch 1" in again[0][1]
    assert [e["epoch"] for e in epochs(again[0][1])] == [2]


def test_a_slow_link_between_two_hosts_is_named_by_its_two_ends(cluster, tmp_path):
    """Two pods, one rank on each host. From its 10th batch to its 50th, rank
    1 limits what its host sends to 16 Mbit/s (tc tbf on its network
    interface, tests/straggler_task.py): rank 0 names the link from rank 1
    (host ddp-node2) to rank 0 (host ddp-node1) within 40 steps, and once
    more when the limit is gone; no rank is named, and the run trains on."""
    from test_stragglers import FIRST, LAST, WITHIN

    flags = ["--dataset", "straggler_task:build_task", "--batch_size", "16", "--total_epochs", "2"]
    outputs = pods(cluster, tmp_path, flags, PYTHONPATH=str(REPO / "tests"),
                   STRAGGLER_FAULT=f"tbf:1:{FIRST}:{LAST}:{NODE_IFACE}:16mbit")
    for code, _, stderr in outputs:
        assert code == 0, stderr[-3000:]
    stdout = outputs[0][1]
    assert "straggler_task: tbf from batch 10 on rank 1" in outputs[1][2]
    lines = [match.groupdict() for match in LINK_LINE.finditer(stdout)]
    assert [(line["sender"], line["sender_host"], line["receiver"], line["receiver_host"], line["state"])
            for line in lines] == [("1", "ddp-node2", "0", "ddp-node1", "slow"),
                                   ("1", "ddp-node2", "0", "ddp-node1", "no longer slow")], stdout[-3000:]
    assert int(lines[0]["last"]) <= FIRST + WITHIN and int(lines[1]["last"]) > LAST, lines
    assert not STRAGGLER_LINE.search(stdout), stdout[-3000:]
    assert [e["epoch"] for e in epochs(stdout)] == [1, 2]


def skypilot_run_block() -> str:
    """The ``run:`` commands of docs/launchers.md's SkyPilot task file (its
    ```yaml block that has them)."""
    tasks = re.findall(r"```yaml\n(.*?)```", (REPO / "docs" / "launchers.md").read_text(), re.S)
    run = next(found for task in tasks if (found := re.search(r"^run: \|\n((?:  .*\n)+)", task, re.M))).group(1)
    return "".join(line[2:] + "\n" for line in run.splitlines())


def test_the_skypilot_task_files_run_commands_train_on_two_nodes(cluster, tmp_path):
    """docs/launchers.md's ``run:`` block, as SkyPilot runs it on each node of
    a 2-node cluster (its variables; the file's envs given as ``sky launch
    --env`` would, a CPU node counting as one "GPU"), trains and resumes."""
    run_block = skypilot_run_block()
    assert "torchrun" in run_block and "$SKYPILOT_NODE_RANK" in run_block

    def launch(flags: str) -> list[tuple[int, str, str]]:
        started = []
        for rank, node in enumerate(NETNS_NODES):
            env = script_env(SKYPILOT_NODE_RANK=str(rank), SKYPILOT_NODE_IPS="\n".join(NETNS_NODES.values()) + "\n",
                             SKYPILOT_NUM_NODES="2", SKYPILOT_NUM_GPUS_PER_NODE="1", TRAIN_FLAGS=flags,
                             SNAPSHOT_DIR=str(tmp_path / "checkpoint"), GLOO_SOCKET_IFNAME=NODE_IFACE,
                             PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
            with open(tmp_path / f"{node}.out", "w") as out, open(tmp_path / f"{node}.err", "w") as err:
                started.append(subprocess.Popen(cluster.on_host(node, ["bash", "-c", run_block]), cwd=REPO,
                                                env=env, stdout=out, stderr=err))
        for job in started:
            job.wait(timeout=JOB_TIMEOUT_S)
        return [(job.returncode, (tmp_path / f"{node}.out").read_text(), (tmp_path / f"{node}.err").read_text())
                for job, node in zip(started, NETNS_NODES)]

    first = launch("--dataset synthetic --total_epochs 1")
    for code, _, stderr in first:
        assert code == 0, stderr[-3000:]
    hosts = {host for _, stdout, _ in first for _, _, host in placement(stdout)}
    assert hosts == set(NETNS_NODES)
    again = launch("--dataset synthetic --total_epochs 2")
    summary = "".join(stdout for _, stdout, _ in again)
    assert f"resuming from snapshot {tmp_path}/checkpoint/snapshot_train.pt after epoch 1" in summary
    assert [e["epoch"] for e in epochs(summary)] == [2]


# multi_node.sh elastic (ELASTIC_MIN_NODES, sbatch --no-kill) on the two
# hosts, one worker each: 2,275 digits, 2,048 to train after the validation
# split, 32 steps of 32 per rank; a snapshot every 20 steps. Rank 1 (on the
# second host: the rendezvous ranks the hosts by name) waits before step 25
# (a fault injected from the test side: DDP_TEST_FAULT, with the job's
# SCRIPT_NAME tests/train_with_fault.py), rank 0 in that step's all-reduce;
# then the second host dies: its slurmd, the step's slurmstepd, its torchrun
# agent and worker.
ELASTIC_DIGITS, ELASTIC_TRAINED = 2275, 2048
ELASTIC_ARGS = ["--total_epochs", "1", "--snapshot_every_steps", "20", "--metrics_path", "metrics.jsonl"]
ELASTIC_HELD_STEP = 25
# Slurm takes a node that stops answering out of the job after SlurmdTimeout
# (300 s by default); shorter while this test's job is the only one.
ELASTIC_SLURMD_TIMEOUT_S = 20


def elastic_job_loses_a_host(cluster, folder) -> tuple[int, Path]:
    """Submits the elastic job (at least 1 node; a rendezvous round closes 1 s
    after its first node joined; ELASTIC_ARGS on the MNIST slice), waits
    until rank 1 is held on ddp-node2 before step ELASTIC_HELD_STEP and kills
    that host; returns (job id, its log) once the job has left RUNNING, with
    ddp-node2's slurmd started again."""
    # A host is killed and Slurm's timeout lowered for the whole cluster: the
    # jobs of the tests before (this file's, on the same hosts) must be gone.
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while queued := subprocess.run(["squeue", "-h", "-o", "%i %T %N"], env=cluster.env, capture_output=True,
                                   text=True, check=True).stdout.strip():
        assert time.monotonic() < deadline, f"other jobs still queued or running:\n{queued}"
        time.sleep(1)
    data = build_mnist_root(folder / "data", n_train=ELASTIC_DIGITS, n_test=200)
    held = f"DDP_TEST_FAULT: wait_signal_once at step {ELASTIC_HELD_STEP} on rank 1"
    job = submit(cluster, folder, "multi_node.sh", "--dataset", "mnist", "--batch_size", "32", *ELASTIC_ARGS,
                 "--data_dir", str(data),
                 sbatch=[*MULTI, "--nodes=2", "--gres=gpu:1", "--no-kill"],
                 env={"GLOO_SOCKET_IFNAME": NODE_IFACE, "ELASTIC_MIN_NODES": "1",
                      "ELASTIC_RDZV_CONF": "last_call_timeout=1",
                      "DDP_TEST_FAULT": f"step:1:{ELASTIC_HELD_STEP}:wait_signal_once", **FAULTY_TRAIN_JOB_ENV})
    log_path = folder / f"multi_node-{job}.out"
    log, deadline = "", time.monotonic() + JOB_TIMEOUT_S
    while held not in log:
        assert time.monotonic() < deadline and cluster.job(job)["JobState"] in ("PENDING", "RUNNING"), log
        time.sleep(0.5)
        log = log_path.read_text() if log_path.exists() else ""
    hosts = {rank: host for rank, _, host in placement(log)}
    assert hosts == {0: "ddp-node1", 1: "ddp-node2"}, log  # the rendezvous (and batch) host survives
    try:
        with cluster.configured(f"SlurmdTimeout={ELASTIC_SLURMD_TIMEOUT_S}"):
            assert cluster.kill_node("ddp-node2")
            while cluster.job(job)["JobState"] == "RUNNING":
                assert time.monotonic() < deadline, f"{cluster.job(job)}\n{log_path.read_text()}"
                time.sleep(0.5)
    finally:
        cluster.revive_node("ddp-node2")
    return job, log_path


def epoch_samples(folder) -> list:
    """The samples each epoch summary of the metrics file counted."""
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [record["samples"] for record in records if "epoch" in record]


def test_elastic_multi_node_goes_on_without_a_dead_node_and_completes(cluster, tmp_path):
    """The second host dies mid-epoch: Slurm takes it out of the job (no
    NODE_FAIL, no requeue), srun keeps the first host's task, its torchrun
    agent starts the training again at world size 1, which resumes mid-epoch
    from the step-20 snapshot (1,280 of the epoch's 2,048 samples trained) and
    trains the rest: the job ends COMPLETED, never requeued, the epoch
    summarised once over every sample."""
    job, log_path = elastic_job_loses_a_host(cluster, tmp_path)
    info = cluster.wait(job, JOB_TIMEOUT_S)
    log = log_path.read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0" and info["ExitCode"] == "0:0", \
        f"{info}\n{log}"
    assert info["NodeList"] == "ddp-node1" and "Node failure on ddp-node2" in log, info  # taken out of the job
    resumed = re.findall(r"^resuming from snapshot \S+ in epoch 1 after step 40 \(saved by world_size 2, "
                         r"resumed by 1: .*; epoch 1 goes on after 1280 of its 2048 samples \(step 20 by "
                         r"world_size 2\) at step 40, the rest split over 1 rank\b.*$", log, re.M)
    assert len(resumed) == 1 and placements(log)[-1] == {(0, 0, "ddp-node1")}, log
    assert "\nepoch 1 | batch_size 32 | steps 24\n" in log, log
    assert [e["epoch"] for e in epochs(log)] == [1], log  # summarised once, by the world of one
    assert epoch_samples(tmp_path) == [ELASTIC_TRAINED]  # every digit of the epoch once
    assert parse_test(log)

