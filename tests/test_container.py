"""The container image (Dockerfile), built and run for real with podman.

No registry is reachable from the CI machine, so the Dockerfile's default base
(an official PyTorch image) cannot be pulled; the test makes its own base: a
Debian root file system with Python, made by debootstrap from the Debian
mirror apt uses here, imported with `podman import` and passed as
``--build-arg BASE``. The build then installs requirements.txt from PyPI (the
CUDA torch, which runs on a CPU) and copies the scripts in. In the image:

- train.py in two containers as two torchrun nodes on the host network,
  with the checkout bind-mounted over /workspace (the seeds' way), trains on
  the real MNIST digits and scores at least 90% on the held-out ones;
- slurm/multi_node.sh with CONTAINER_IMAGE on a real Slurm cluster
  (tests/slurm_cluster.py), a podman command as CONTAINER_RUN;
- slurm/multi_gpu.sh preempted and slurm/multi_node_srun.sh (a container per
  rank) sent back by scontrol requeue, with CONTAINER_IMAGE and the wrappers'
  default `apptainer exec` line: each resumes bitwise in the image. Apptainer
  is not installable here; tests/standins/apptainer runs the built image,
  mounted as a sandbox folder, the way it does where it matters (the command
  is the srun task itself, where Slurm's signals reach it). Podman cannot
  stand in for these: it runs the container outside the job step, and a
  preemption's SIGTERM was seen lost (docs/containers.md).

Podman is rootful with private settings (docs/containers.md says why each is
needed): its configuration, storage, run and temporary folders all live in one
temporary folder, removed at the end with everything in it. Image and base are
built once per module (tests/container_image.py; .ci/run starts that build in
the background before the test command, DDP_TEST_IMAGE_ROOT naming its
folder) and print their times and the image size (pytest -s).
Skipped, with the reason, where podman, runc or debootstrap are missing or not
root (the wrapper tests also without Slurm); under CI=true they fail instead.
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
from pathlib import Path

import pytest

from container_image import PREBUILT_VAR, RUN_TIMEOUT_S, Image, Podman, _checked, build, prebuilt, unavailable_reason
from dataset_files import build_mnist_root
from helpers import FAULTY_TRAIN_JOB_ENV, IN_CI, REPO, assert_same_snapshot, check, epochs, free_port, parse_test, \
    placement, run, run_together, wrapper_snapshot
from slurm_cluster import NETNS_NODES, NODE_IFACE
from slurm_jobs import SCENARIO_TIMEOUT_S, Scenario, check_resumes_exactly, drive, preempt, runs, \
    scontrol_requeue, show

# tests/standins/apptainer: `apptainer exec` for a sandbox image (unshare, chroot).
STANDINS = REPO / "tests" / "standins"


@pytest.fixture(scope="session")
def removals() -> list:
    """The background ``rm`` processes of ``Podman.cleanup``: waited for, and
    their folders checked gone, at the end of the test session."""
    started: list = []
    yield started
    for remover, folder in started:
        assert remover.wait(timeout=600) == 0 and not folder.exists(), f"{folder} was not removed"


@pytest.fixture(scope="module")
def image(tmp_path_factory, removals) -> Image:
    """The repository's Dockerfile built with podman on a debootstrap base,
    once per module (by .ci/run in the background, while the environments
    install and the first tests run, when DDP_TEST_IMAGE_ROOT names its
    folder); prints the time of each step and the image size. Removes
    images, containers and podman's storage afterwards (the folder's deletion
    finishing in the background: ``removals``)."""
    reason = unavailable_reason()
    if reason:
        if IN_CI:
            pytest.fail(f"the container test must run in CI, but: {reason}")
        pytest.skip(f"cannot build the image here: {reason}")
    ready = None
    root = Path(os.environ[PREBUILT_VAR]) if os.environ.get(PREBUILT_VAR) else tmp_path_factory.mktemp("container")
    try:
        ready = prebuilt(root) if os.environ.get(PREBUILT_VAR) else build(root, sys.executable)
        yield ready
    except RuntimeError as exc:
        pytest.fail(str(exc))
    finally:
        podman = ready.podman if ready else Podman(root / "podman")
        removals.append((podman.cleanup(), podman.root.with_name(podman.root.name + ".removing")))
        assert podman.leftovers() == []


def test_image_holds_the_project(image):
    """The image's Python has torch, torchvision and tqdm as requirements.txt
    asks, the kit (train.py, train_utils) and the five rungs are in /workspace
    (its working directory), train_utils imports, and torchrun and python are
    on the PATH (one container: each start costs seconds)."""
    probe = ("import os, torch, torchvision, tqdm, train_utils; print(os.getcwd()); print(torch.__version__); "
             "print(sorted(f for f in os.listdir('.') if f.endswith('.py')))")
    result = _checked(image.podman.run(image.tag, "sh", "-c", 'python3 -c "$0" && torchrun --help >/dev/null '
                                       '&& python --version', probe), "probe")
    cwd, version, files, python = result.stdout.splitlines()[-4:]
    assert cwd == "/workspace"
    assert tuple(int(part) for part in version.split(".")[:2]) >= (2, 13)
    for script in ("train.py", "common.py", "vision_tasks.py", "fast_images.py", "singlegpu.py",
                   "multigpu_spawn.py", "multigpu_torchrun.py", "multinode.py", "multinode_fsdp.py"):
        assert f"'{script}'" in files
    assert python.startswith("Python 3.")


def test_two_containers_as_two_nodes_learn_real_mnist(image, tmp_path):
    """train.py in two containers on the host network, one torchrun agent
    each (--nnodes=2 --nproc_per_node=1), meeting through c10d rendezvous, on
    8,000 real digits mounted read-only at /data, one epoch: >= 90% on the 2,000
    held out. Both containers share the host name and run torchrun as PID 1,
    so each gets its own --local-addr (127.0.0.1, 127.0.0.2); without it they
    describe themselves identically and wait until the join timeout. The
    checkout is bind-mounted read-only over /workspace; a shared folder stands
    for the nodes' shared storage, where the outputs go. (torchrun
    --standalone in the image: the stop tests below, slurm/multi_gpu.sh.)"""
    data = build_mnist_root(tmp_path / "data")
    shared = tmp_path / "shared"
    shared.mkdir()
    port = free_port()
    cmds = [image.podman.run_cmd(
        image.tag, "torchrun", "--nnodes=2", "--nproc_per_node=1", "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=container{port}",
        f"--local-addr=127.0.0.{node + 1}",
        f"--rdzv-conf=is_host={int(node == 0)}",  # the first agent hosts the rendezvous store
        "/workspace/train.py", "--dataset", "mnist", "--data_dir", "/data", "--total_epochs", "1",
        "--metrics_path", "/shared/metrics.jsonl",
        volumes={REPO: "/workspace:ro", data: "/data:ro", shared: "/shared"}, workdir="/shared",
        env={"GLOO_SOCKET_IFNAME": "lo", "PYTHONUNBUFFERED": "1"}) for node in range(2)]
    started = time.monotonic()
    outputs = run_together(cmds, [tmp_path, tmp_path], image.podman.env, timeout=RUN_TIMEOUT_S)
    print(f"two containers as two nodes: {time.monotonic() - started:.1f} s")
    for code, stdout, stderr in outputs:
        assert code == 0, f"exit {code}\n--- stdout\n{stdout[-3000:]}\n--- stderr\n{stderr[-4000:]}"
    everything = "".join(stdout for _, stdout, _ in outputs)
    # Global rank 0 alone prints the summary, once, in one of the two containers.
    summaries = [stdout for _, stdout, _ in outputs if epochs(stdout)]
    assert len(summaries) == 1 and [e["epoch"] for e in epochs(summaries[0])] == [1]
    assert "world_size 2" in summaries[0]
    assert len(re.findall(r"^test \| loss", everything, re.M)) == 1
    assert parse_test(summaries[0])["acc"] >= 0.9  # one epoch (0.956 outside the container); chance is 0.1
    print("\n".join(line for line in summaries[0].splitlines() if line.startswith(("epoch", "test"))))
    # Each container ran one process: global ranks 0 and 1, local rank 0 on both (rank 0's placement line).
    assert sorted((rank, local) for rank, local, _ in placement(everything)) == [(0, 0), (1, 0)], everything
    assert len(re.findall(r"^epoch 1 \| batch_size 32 \| steps \d+$", everything, re.M)) == 1  # one line, rank 0's
    assert (shared / "snapshot_train.pt").is_file()  # train.py's default --snapshot_path
    records = [json.loads(line) for line in (shared / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("event") or ("epoch" if "epoch" in r else "test") for r in records] == [
        "start", "epoch", "test"]


def _podman_env(image: Image) -> dict:
    """The variables that point podman at the test's settings, for helpers.run."""
    return {name: image.podman.env[name] for name in ("CONTAINERS_CONF", "CONTAINERS_STORAGE_CONF", "TMPDIR")}


# --------------------------------------------------------------------------
# The Slurm wrappers' container path: CONTAINER_IMAGE, with podman for apptainer
# --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster(image, slurm_cluster):
    """The session's one Slurm cluster (conftest.slurm_cluster), for the wrappers
    run with CONTAINER_IMAGE; asked for after the image is built."""
    return slurm_cluster


def _wrapper_in_container(image: Image, cluster, tmp_path, wrapper: str, args: list, sbatch: list,
                          volumes: dict, env: dict = None) -> tuple[int, str]:
    """sbatch ``wrapper`` from the project folder with CONTAINER_IMAGE set and
    CONTAINER_RUN a podman command line (Apptainer is not installable here):
    the wrapper's own logic is what is tested. VENV_DIR points nowhere, so the
    job can only succeed if the wrapper left the virtual environment alone and
    used the image's Python. Returns the job id and its log."""
    run_words = ["podman", "run", "--rm", "--pull=never", "--network=host", f"--workdir={tmp_path}",
                 *(f"--volume={host}:{inside}" for host, inside in volumes.items()),
                 *(f"--env={name}={value}" for name, value in (env or {}).items())]
    job_env = {**_podman_env(image), "VENV_DIR": str(tmp_path / "no-venv"),
               "CONTAINER_IMAGE": image.tag, "CONTAINER_RUN": " ".join(run_words)}
    job = cluster.sbatch([f"--chdir={tmp_path}", "--mem=1G", "--cpus-per-task=1", "--time=15", *sbatch,
                          f"slurm/{wrapper}", *args], cwd=REPO, env=job_env)
    started = time.monotonic()
    info = cluster.wait(job, RUN_TIMEOUT_S)
    log = (tmp_path / f"{wrapper[:-3]}-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", f"{info}\n{log}\n{cluster.logs()}"
    print(f"{wrapper} job in the container: {time.monotonic() - started:.1f} s")
    print("\n".join(line for line in log.splitlines() if line.startswith(("job ", "epoch", "test"))))
    return job, log


def test_multi_node_wrapper_runs_each_node_in_the_container(image, cluster, tmp_path):
    """slurm/multi_node.sh with CONTAINER_IMAGE on two hosts (network
    namespaces): srun starts a container per node, torchrun in each; the
    rendezvous host comes from scontrol in the batch shell (the image has no
    Slurm commands)."""
    job, log = _wrapper_in_container(
        image, cluster, tmp_path, "multi_node.sh", ["--total_epochs", "2"], ["--partition=multi", "--gres=gpu:1"],
        volumes={REPO: f"{REPO}:ro", tmp_path: str(tmp_path)}, env={"GLOO_SOCKET_IFNAME": NODE_IFACE})
    assert f"| 2 nodes (ddp-node[1-2]) x 1 processes | rendezvous ddp-node1:{15000 + job % 15000} |" in log
    seen = {(rank, host) for rank, _, host in placement(log)}
    assert {rank for rank, _ in seen} == {0, 1} and {host for _, host in seen} == set(NETNS_NODES), log
    assert [e["epoch"] for e in epochs(log)] == [1, 2]  # global rank 0 alone prints the summary
    assert parse_test(log)["loss"] < 0.2
    assert (tmp_path / wrapper_snapshot("multi_node", ["--total_epochs", "2"])).is_file()


# --------------------------------------------------------------------------
# Stops inside the container: real preemption and scontrol requeue, with the
# wrappers' default `apptainer exec` line
# --------------------------------------------------------------------------

CONTAINER_SHORT = ["--total_epochs", "4", "--batch_size", "16"]
# Each job's ranks wait at their 30th step (in epoch 1) until a stop signal
# comes (a fault injected from the test side, first attempt only: the job's
# SCRIPT_NAME is tests/train_with_fault.py, which the container sees in the
# project folder it binds), and the stop is triggered once both wait: it
# lands mid-training whatever the machine's speed.
HOLD_AT_STEP_30 = {"DDP_TEST_FAULT": "step:*:30:wait_signal_once", **FAULTY_TRAIN_JOB_ENV}
HELD_AT_STEP_30 = ("DDP_TEST_FAULT: wait_signal_once at step 30 on rank 0",
                   "DDP_TEST_FAULT: wait_signal_once at step 30 on rank 1")


@pytest.fixture(scope="module")
def sandbox(image) -> Path:
    """The built image as an Apptainer sandbox image: the root file system of a
    podman container made from it (``podman mount``), a folder. Removed with
    the image's podman storage."""
    _checked(image.podman("create", "--name", "ddp-sandbox", image.tag, "true"), "podman create")
    return Path(_checked(image.podman("mount", "ddp-sandbox"), "podman mount").stdout.strip())


def _stop_in_container(cluster, sandbox: Path, folder: Path, scenario) -> None:
    """Drive ``scenario`` (tests/slurm_jobs.py) with CONTAINER_IMAGE the sandbox
    and no CONTAINER_RUN: the wrapper's default ``apptainer exec --nv --bind
    ...`` line runs, and PATH finds the stand-in. VENV_DIR points nowhere, so
    only the image's Python can train."""
    scenario.env.update(PATH=f"{STANDINS}:{os.environ['PATH']}", CONTAINER_IMAGE=str(sandbox),
                        VENV_DIR=str(folder / "no-venv"))
    try:
        drive(cluster, scenario, folder)
    except BaseException as exc:  # noqa: BLE001 - reported by the test
        scenario.error = f"{type(exc).__name__}: {exc}"


def _reference_in_container(sandbox: Path, script: str, nproc: int, args: list, folder: Path) -> Path:
    """The uninterrupted run, in the same image (its torch, not the tests')."""
    folder.mkdir()
    cmd = [STANDINS / "apptainer", "exec", "--bind", REPO, sandbox, "torchrun", "--standalone",
           f"--nproc_per_node={nproc}", REPO / script, *args]
    check(run(cmd, cwd=folder, timeout=RUN_TIMEOUT_S, GLOO_SOCKET_IFNAME="lo"))
    return folder / f"snapshot_{script[:-3]}.pt"


def test_stops_inside_the_container_resume_exactly(cluster, sandbox, tmp_path):
    """slurm/multi_gpu.sh preempted (SIGTERM to the step, GraceTime 300 s, then
    the batch shell requeues) and slurm/multi_node_srun.sh (two hosts, a
    container per rank) sent back by scontrol requeue, both with
    CONTAINER_IMAGE and the default apptainer line: each stops with a
    snapshot, is requeued, resumes where it stopped, and ends bitwise equal to
    an uninterrupted run in the same image, as without a container
    (tests/test_stop_paths.py)."""
    scenarios = [
        Scenario("container-preempt", "multi_gpu.sh", "ddp-stop1", ["--gres=gpu:2"], CONTAINER_SHORT, preempt,
                 ("train.py", 2), env=dict(HOLD_AT_STEP_30), trigger_when=HELD_AT_STEP_30),
        Scenario("container-srun-requeue", "multi_node_srun.sh", "ddp-stop[2-3]",
                 ["--nodes=2", "--ntasks-per-node=1", "--gres=gpu:1"], CONTAINER_SHORT, scontrol_requeue,
                 ("train.py", 2), env=dict(HOLD_AT_STEP_30), trigger_when=HELD_AT_STEP_30),
    ]
    threads = []
    for scenario in scenarios:
        (tmp_path / scenario.name).mkdir()
        threads.append(threading.Thread(target=_stop_in_container, daemon=True,
                                        args=(cluster, sandbox, tmp_path / scenario.name, scenario)))
        threads[-1].start()
    try:
        references = {scenario.name: _reference_in_container(sandbox, *scenario.reference, CONTAINER_SHORT,
                                                             tmp_path / f"reference-{scenario.name}")
                      for scenario in scenarios}
    finally:  # the jobs end (or time out) before the next test uses these hosts
        for thread in threads:
            thread.join(SCENARIO_TIMEOUT_S + 60)
    for scenario in scenarios:
        assert not scenario.error and scenario.infos, show(scenario)
        info = scenario.infos[-1]
        assert info["JobState"] == "COMPLETED" and int(info["Restarts"]) >= 1, show(scenario)
        texts = runs(scenario.logs[-1])
        # A preemption sends SIGTERM, or the job's --signal (SIGUSR1 to the batch shell) where
        # SlurmctldParameters=preempt_send_user_signal is set: tests/test_stop_paths.py sets it
        # for one of its jobs and removes it again, but slurmctld 22.05 may keep acting on it for
        # a later preemption (seen once in four CI runs). Either is a stop the wrapper handles.
        stops_by = ("stopped by SIGTERM", "stopped by SIGUSR1") if scenario.trigger is preempt \
            else ("stopped by SIGTERM",)
        assert any(stop_by in texts[0] for stop_by in stops_by), texts[0]
        stops = check_resumes_exactly(texts, int(CONTAINER_SHORT[1]))
        assert len(stops) == 1, texts
        print(f"{scenario.name}: stopped at epoch {stops[0][0]} step {stops[0][1]}, {len(texts)} runs, "
              f"{scenario.signal_to_exit_s:.1f} s from the trigger to leaving RUNNING")
        assert_same_snapshot(tmp_path / scenario.name / wrapper_snapshot(scenario.name, scenario.args),
                             references[scenario.name])
