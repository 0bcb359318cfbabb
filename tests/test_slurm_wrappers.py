"""The sbatch wrappers in slurm/ as text, and their shared shell files run
by themselves: no cluster, no training, seconds.

What Slurm does with the wrappers is tests/test_slurm.py and
tests/test_stop_paths.py; here: every wrapper sources slurm/env.sh, once,
which checks that it runs under sbatch, sources slurm/stop_and_requeue.sh
(the stop traps) before anything slow, then sets up the environment, network
and container; no wrapper copies any of it; each header is short and every
``#SBATCH`` line says what it is for; every wrapper parses (``bash -n``) and
runs strict. Then what slurm/env.sh does when sourced (the traps before the
environment block, the virtual environment or the container command, the
script, the launcher check, the rendezvous port, which the ranks under srun
derive alike), and
slurm/stop_and_requeue.sh's own logic where a real cluster meets it only by
chance (its requeue's SIGTERM, two jobs taking one snapshot's claim), with
stand-in scontrol and squeue that make it happen every time.
"""

import datetime
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import LAUNCHER_VARIABLES, typed_snapshot, wrapper_snapshot
from tools.identity import run_identity, snapshot_for

REPO = Path(__file__).resolve().parent.parent
WRAPPERS = ["single_gpu.sh", "multi_gpu.sh", "multi_node.sh", "multi_node_srun.sh"]
MAX_HEADER_LINES = 12
# What only slurm/env.sh (or stop_and_requeue.sh) may hold: the sbatch-only check, the stop handling,
# the blocks a user edits, the checks, the port.
SHARED_ONLY = ["SLURM_JOB_ID:-", "stop_and_requeue.sh", "trap ", "VENV=", "activate", "CONTAINER=(",
               "CONTAINER_RUN", "SOCKET_IFNAME", "python -c", "--help", "15000", "--signals-to-handle", "DATA="]


def read(wrapper: str) -> str:
    return (REPO / "slurm" / wrapper).read_text()


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_wrapper_sources_the_shared_file_once_and_copies_nothing_of_it(wrapper):
    """One source line, slurm/env.sh, which holds the rest in order: the
    sbatch-only check, then the stop traps (a signal may come during set-up),
    then the environment; the one command of the training step runs the
    script slurm/env.sh chose (train.py unless SCRIPT_NAME says otherwise)."""
    text = read(wrapper)
    assert re.findall(r"^\s*(?:source|\.) .*$", text, re.M) == ['source "$PROJECT/slurm/env.sh"'], wrapper
    assert [word for word in SHARED_ONLY if word in text] == []
    assert '"$SCRIPT"' in text and re.search(r"^require_launcher (python|torchrun)$", text, re.M)
    env_sh = read("env.sh")
    order = [env_sh.index(line) for line in ('if [ -z "${SLURM_JOB_ID:-}" ]; then',
                                             'source "$PROJECT/slurm/stop_and_requeue.sh"\n',
                                             "# --- environment (edit for your cluster) ---")]
    assert order == sorted(order), order


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_header_says_what_it_runs_how_to_submit_and_what_to_edit(wrapper):
    """At most 12 comment lines between the #! line and the first #SBATCH;
    the details are in docs/slurm.md."""
    lines = read(wrapper).splitlines()
    assert lines[0] == "#!/bin/bash"
    first = next(i for i, line in enumerate(lines) if line.startswith("#SBATCH"))
    header = [line for line in lines[1:first] if line.startswith("#")]
    assert header and len(header) <= MAX_HEADER_LINES, f"{len(header)} header lines:\n" + "\n".join(header)
    text = "\n".join(header)
    assert header[0].startswith(f"# {wrapper}: train.py"), header[0]
    assert f"sbatch slurm/{wrapper}" in text or f"slurm/{wrapper} " in text
    assert "Edit:" in text and "slurm/env.sh" in text and "SCRIPT_NAME" in text, text


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_every_sbatch_line_is_explained_and_nothing_is_hard_coded(wrapper):
    """``#SBATCH --option   # what it is for``, the commented-out ``##SBATCH``
    ones too, all before the first command (sbatch ignores later ones); no
    node, process or port count written in."""
    text = read(wrapper)
    directives = [line for line in text.splitlines() if re.match(r"##?SBATCH", line)]
    assert directives
    unexplained = [line for line in directives if not re.match(r"##?SBATCH \S+ +# \S", line)]
    assert not unexplained, unexplained
    for option in ("--partition", "--account"):  # waiting for the cluster's names
        assert any(line.startswith(f"##SBATCH {option}=") for line in directives), option
    for option in ("--time=", "--output=%x-%j.out", "--requeue", "--signal=B:USR1@90", "--open-mode=append"):
        assert any(option in line for line in directives), option
    body = text.splitlines()
    first_command = next(i for i, line in enumerate(body) if line and not line.startswith("#"))
    assert all(i < first_command for i, line in enumerate(body) if line.startswith("#SBATCH"))
    assert not re.search(r"--nnodes=\d|--nproc_per_node=[2-9]|MASTER_PORT=\d+\s*$", text, re.M)


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_wrapper_parses_and_runs_strict(wrapper):
    text = read(wrapper)
    result = subprocess.run(["bash", "-n", str(REPO / "slurm" / wrapper)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert re.search(r"^set -euo pipefail$", text, re.M)
    # The training step is found at a glance.
    assert re.search(r"^# The training step:", text, re.M)
    # The project is the submission folder (or PROJECT_DIR); the error for a
    # wrong submission folder assumes no folder name.
    assert re.search(r'^PROJECT="\$\{PROJECT_DIR:-\$\{SLURM_SUBMIT_DIR:-\$PWD\}\}"$', text, re.M)
    assert "cd ddp-scripts" not in text and "from the project folder" in text


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_wrapper_outside_sbatch_says_how_to_submit(wrapper, tmp_path):
    """Run by hand from the project folder (slurm/env.sh's check, naming the
    wrapper run), or from elsewhere (the wrapper's own check: no env.sh there)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("SLURM_") and key != "PROJECT_DIR"}
    result = subprocess.run(["bash", f"slurm/{wrapper}"], cwd=REPO, env=env, capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: this is a Slurm batch script; submit it with: sbatch slurm/{wrapper} [training args]"]
    assert result.stdout == ""
    result = subprocess.run(["bash", REPO / "slurm" / wrapper], cwd=tmp_path, env=env, capture_output=True,
                            text=True)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: {tmp_path}/slurm/env.sh not found; run sbatch slurm/{wrapper} from the project folder, "
        f"or set PROJECT_DIR"]
    assert result.stdout == ""


def test_multi_node_takes_each_nodes_worker_count_on_that_node():
    """--gpus=6 over 2 nodes can grant 4 and 2: each node's torchrun must start
    as many workers as its own node's SLURM_GPUS_ON_NODE, read inside the step,
    not the batch host's. The wrapper's own PER_NODE prefix, run as srun would on
    a node (printf in torchrun's place); one worker where the node has no GPU."""
    text = read("multi_node.sh")
    [per_node] = [line for line in text.splitlines() if line.startswith("PER_NODE=(")]
    assert "--nproc_per_node=@NPROC@" in text and '"${PER_NODE[@]}"' in text
    command = per_node + '\n"${PER_NODE[@]}" printf "%s\\n" --nnodes=2 --nproc_per_node=@NPROC@ train.py'
    for gpus, workers in (("2", "2"), ("4", "4"), (None, "1")):
        env = {key: value for key, value in os.environ.items() if key != "SLURM_GPUS_ON_NODE"}
        env.update({"SLURM_GPUS_ON_NODE": gpus} if gpus else {})
        result = subprocess.run(["bash", "-c", command], env=env, capture_output=True, text=True)
        assert result.stdout.split() == ["--nnodes=2", f"--nproc_per_node={workers}", "train.py"], result


# --------------------------------------------------------------------------
# slurm/env.sh, sourced as a wrapper sources it
# --------------------------------------------------------------------------

def _env_sh(folder: Path, commands: str, path: str = "/usr/bin:/bin", **env: str) -> subprocess.CompletedProcess:
    """``commands`` in a strict bash that sourced slurm/env.sh as a wrapper
    does (PROJECT the repository), in job 31337 submitted from ``folder``,
    with ``path`` as PATH and ``env`` added."""
    script = f'set -euo pipefail; PROJECT="{REPO}"; source "{REPO}/slurm/env.sh"; {commands}'
    job = {"PATH": path, "SLURM_JOB_ID": "31337", "SLURM_SUBMIT_DIR": str(folder), "USER": "someone", **env}
    return subprocess.run(["bash", "-c", script], cwd=folder, env=job, capture_output=True, text=True,
                          timeout=120)


def _fake_venv(folder: Path) -> Path:
    """A folder whose bin/activate marks that it was sourced (VENV_ACTIVATED=1)."""
    (folder / "bin").mkdir(parents=True)
    (folder / "bin" / "activate").write_text("export VENV_ACTIVATED=1\n")
    return folder


def test_env_sh_activates_the_venv_or_builds_the_container_command(tmp_path):
    venv = _fake_venv(tmp_path / "venv")
    show = 'echo "venv=${VENV_ACTIVATED:-0}"; echo "script=$SCRIPT"; echo "data=$DATA"; printf "[%s]" "${CONTAINER[@]+"${CONTAINER[@]}"}"'
    result = _env_sh(tmp_path, show, VENV_DIR=str(venv))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["venv=1", f"script={REPO}/train.py", "data=/tmp/someone/ddp-data",
                                          "[]"]  # no container command
    # The project's own .venv, by default, where it exists
    _fake_venv(tmp_path / ".venv")
    assert _env_sh(tmp_path, show).stdout.startswith("venv=1\n")
    # A container image: no venv; apptainer binds the submission and project folders, DATA_DIR and more;
    # the job's id is passed in (train.py claims the snapshot for the job; podman and docker pass no
    # environment of their own accord)
    result = _env_sh(tmp_path, show, VENV_DIR=str(venv), CONTAINER_IMAGE="ddp.sif", DATA_DIR="/data",
                     CONTAINER_BINDS="/scratch,/models")
    assert result.stdout.splitlines() == [
        "venv=0", f"script={REPO}/train.py", "data=/data",
        f"[apptainer][exec][--nv][--bind][{tmp_path},{REPO},/data,/scratch,/models]"
        "[--env][SLURM_JOB_ID=31337][ddp.sif]"], result.stderr
    result = _env_sh(tmp_path, show, CONTAINER_IMAGE="ddp:latest", CONTAINER_RUN="podman run --rm",
                     SCRIPT_NAME="multinode.py", SLURM_TMPDIR="/local", SLURM_ARRAY_JOB_ID="31330",
                     SLURM_ARRAY_TASK_ID="7")
    assert result.stdout.splitlines() == [
        "venv=0", f"script={REPO}/multinode.py", "data=/local",
        "[podman][run][--rm][--env][SLURM_JOB_ID=31337][--env][SLURM_ARRAY_JOB_ID=31330]"
        "[--env][SLURM_ARRAY_TASK_ID=7][ddp:latest]"], result.stderr


# A stand-in srun: notes its arguments (NUL-separated) in a file of its own,
# numbered, in the folder SRUN_CALLS names; a one-task step of the batch
# shell's own (--ntasks=1 --nodes=1) runs its command here, as pyxis would in
# the container; the training step is only noted.
STAND_IN_SRUN = r"""
printf '%s\0' "$@" > "$SRUN_CALLS/$(printf %03d "$(ls "$SRUN_CALLS" | wc -l)")"
[ "$1 $2" = "--ntasks=1 --nodes=1" ] || exit 0
while [ "${1#-}" != "$1" ]; do shift; done
exec "$@"
"""


@pytest.mark.parametrize("wrapper", ["single_gpu.sh", "multi_gpu.sh", "multi_node.sh", "multi_node_srun.sh"])
def test_pyxis_image_runs_the_training_step_with_sruns_container_flags(wrapper, tmp_path):
    """PYXIS_IMAGE: no apptainer line and no venv; the training step's srun
    gets --container-image, the submission and project folders (and
    DATA_DIR) mounted at the same paths, the working folder, one container
    per job and node; its command is the plain launcher. The batch shell's
    own python (launcher check, run identity, rendezvous port) runs in
    one-task steps with the same flags. pyxis is not installed here: a
    stand-in srun notes each line the wrapper builds."""
    bin_dir = tmp_path / "bin"
    _stand_in(bin_dir, "srun", STAND_IN_SRUN)
    _stand_in(bin_dir, "scontrol", 'case "$1 $2" in "show hostnames") echo node1; echo node2 ;; esac')
    _stand_in(bin_dir, "squeue", "exit 0")
    calls = tmp_path / "srun.calls"
    calls.mkdir()
    env = {"PATH": f"{bin_dir}:{Path(sys.executable).parent}:/usr/bin:/bin", "SLURM_JOB_ID": "31337",
           "SLURM_JOB_NAME": "pyxis", "SLURM_SUBMIT_DIR": str(tmp_path), "PROJECT_DIR": str(REPO),
           "SLURM_JOB_NUM_NODES": "2",
           "SLURM_JOB_NODELIST": "node[1-2]", "SRUN_CALLS": str(calls), "USER": "someone",
           "PYXIS_IMAGE": "nvcr.io#nvidia/pytorch:25.01-py3", "DATA_DIR": "/data", "VENV_DIR": "/nowhere"}
    result = subprocess.run(["bash", str(REPO / "slurm" / wrapper), "--lr", "0.5"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [path.read_text().split("\0")[:-1] for path in sorted(calls.iterdir())]
    flags = ["--container-image=nvcr.io#nvidia/pytorch:25.01-py3", "--container-name=ddp-31337",
             f"--container-mounts={tmp_path}:{tmp_path},{REPO}:{REPO},/data:/data", f"--container-workdir={tmp_path}"]
    *own, step = lines
    assert own and all(line[:2] == ["--ntasks=1", "--nodes=1"] and line[2:6] == flags and line[6] == "python"
                       for line in own), own
    assert any("tools/identity.py" in " ".join(line) for line in own), own
    assert step[:2] != ["--ntasks=1", "--nodes=1"] and "apptainer" not in step, step
    at = step.index(flags[0])
    assert step[at:at + 4] == flags, step
    command = step[at + 4:]
    launcher = {"multi_node_srun.sh": "python", "multi_node.sh": "bash"}.get(wrapper, "torchrun")
    assert command[0] == launcher and f"{REPO}/train.py" in command and command[-2:] == ["--lr", "0.5"], step
    assert f"snapshot-pyxis-{run_identity(['--lr', '0.5'])}.pt" in command, step


def test_env_sh_traps_the_stop_signals_before_the_environment_block(tmp_path):
    """The time-limit warning may come while the environment activates (a
    conda or module set-up takes seconds): by then the stop handler's traps
    are set, and sourcing env.sh leaves them set."""
    venv = _fake_venv(tmp_path / "venv")
    (venv / "bin" / "activate").write_text("trap -p USR1 TERM\n")
    result = _env_sh(tmp_path, "echo after; trap -p USR1 TERM", VENV_DIR=str(venv))
    assert result.returncode == 0, result.stderr
    during, after = result.stdout.split("after\n")
    for traps in (during, after):
        assert "on_stop_signal USR1" in traps and "on_stop_signal TERM" in traps, result.stdout


def test_env_sh_refuses_a_missing_script_or_launcher_in_one_line(tmp_path):
    result = _env_sh(tmp_path, "echo sourced", SCRIPT_NAME="nosuch.py")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip() == (f"error: {REPO}/nosuch.py not found; SCRIPT_NAME names a script in the "
                                     f"project folder ({REPO})")
    # No python on the PATH (an empty bin folder): the srun wrapper's check
    empty = tmp_path / "empty"
    empty.mkdir()
    for launcher in ("python", "torchrun"):
        result = _env_sh(tmp_path, f"require_launcher {launcher}; echo fine", path=f"{empty}:/bin")
        assert result.returncode == 2 and "fine" not in result.stdout, result
        assert result.stderr.startswith(f"error: no working {launcher}; activate the environment in the "
                                        "environment block of slurm/env.sh"), result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    # A torchrun whose torch is too old for the flags the stop needs: the environment's
    # package metadata says so (a torch-<version>.dist-info found first on the path).
    old = tmp_path / "old"
    old.mkdir()
    (old / "torchrun").write_text("#!/bin/sh\nexit 0\n")
    (old / "torchrun").chmod(0o755)
    python_dir = Path(sys.executable).parent
    for version, flag in (("2.8.0", "--signals-to-handle"), ("2.11.0+cu126", "--shutdown-timeout")):
        metadata = tmp_path / version / f"torch-{version}.dist-info"
        metadata.mkdir(parents=True)
        (metadata / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
        result = _env_sh(tmp_path, "require_launcher torchrun; echo fine", path=f"{old}:{python_dir}:/usr/bin:/bin",
                         PYTHONPATH=str(metadata.parent))
        assert result.returncode == 2 and result.stderr.strip() == (
            f"error: this torchrun (torch {version}) has no {flag}, which the stop on a time-limit warning or "
            f"a preemption needs (torch 2.12 or newer; docs/install.md)"), result.stderr
    # The tests' own torch passes both checks
    result = _env_sh(tmp_path, "require_launcher python; require_launcher torchrun; echo fine",
                     path=f"{Path(sys.executable).parent}:/usr/bin:/bin")
    assert result.returncode == 0 and result.stdout == "fine\n", result.stderr


@pytest.mark.parametrize("job_id", ["31337", "15000", "1", "987654"])
def test_the_shell_and_each_srun_rank_derive_the_same_rendezvous_port(tmp_path, monkeypatch, job_id):
    """multi_node.sh's torchrun rendezvous (rendezvous_port in slurm/env.sh)
    and multi_node_srun.sh's ranks (train_utils.launcher_store under srun, no
    torchrun) meet at the same port for a job: 15000 + job id % 15000, the
    formula train_utils/distributed/rendezvous.py holds for both. The
    srun rank also takes rank, local rank, world size and the first host from
    Slurm's variables."""
    import train_utils

    shell = _env_sh(tmp_path, "rendezvous_port", path=f"{Path(sys.executable).parent}:/usr/bin:/bin",
                    SLURM_JOB_ID=job_id)
    assert shell.returncode == 0, shell.stderr
    env = {key: value for key, value in os.environ.items()
           if not key.startswith("SLURM_") and key not in LAUNCHER_VARIABLES}
    env.update(SLURM_STEP_ID="0", SLURM_PROCID="5", SLURM_LOCALID="1", SLURM_STEP_NUM_TASKS="8",
               SLURM_NTASKS="8", SLURM_JOB_ID=job_id, SLURM_STEP_NODELIST="gpu[07-09,12],cpu1")
    monkeypatch.setattr(os, "environ", env)  # a copy: nothing leaks into later tests
    with pytest.raises(RuntimeError):  # no host gpu07 here: the connection fails, after the variables are set
        train_utils.launcher_store(datetime.timedelta(milliseconds=1))
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["MASTER_ADDR"]) == ("5", "1", "8", "gpu07")
    assert shell.stdout.strip() == env["MASTER_PORT"] == str(15000 + int(job_id) % 15000)
    assert 15000 <= int(env["MASTER_PORT"]) < 30000


# --------------------------------------------------------------------------
# slurm/stop_and_requeue.sh, sourced as a wrapper sources it
# --------------------------------------------------------------------------

def _stand_in(bin_dir: Path, command: str, body: str) -> None:
    """An executable bash script ``bin_dir/command`` running ``body``, in place
    of the Slurm command of that name (first on the PATH ``_batch_shell`` gives)."""
    bin_dir.mkdir(exist_ok=True)
    path = bin_dir / command
    path.write_text(f"#!/bin/bash\n{body}\n")
    path.chmod(0o755)


def _batch_shell(folder: Path, bin_dir: Path, job_id: str, job_name: str, commands: str,
                 *args: str) -> subprocess.CompletedProcess:
    """``commands`` (with ARGS as "$@") in a strict bash that sourced
    slurm/stop_and_requeue.sh, as a wrapper's batch shell does, in job
    ``job_id`` named ``job_name``, in ``folder``, with ``bin_dir`` first on PATH."""
    script = f'set -euo pipefail; source "{REPO}/slurm/stop_and_requeue.sh"; {commands}'
    # The tests' python first after the stand-ins, as the environment block activates it.
    env = {"PATH": f"{bin_dir}:{Path(sys.executable).parent}:/usr/bin:/bin", "SLURM_JOB_ID": job_id,
           "SLURM_JOB_NAME": job_name, "PROJECT": str(REPO)}
    return subprocess.run(["bash", "-c", script, "bash", *args], cwd=folder, env=env, capture_output=True,
                          text=True, timeout=90)


def test_a_job_requeueing_itself_does_not_report_its_own_requeue_as_a_stop(tmp_path):
    """After a preemption the batch shell requeues the job itself, and Slurm's
    requeue SIGTERMs that shell while scontrol is still running. The step has
    ended by then: the shell must requeue and exit 0 without announcing a stop
    ("batch shell got SIGTERM ..."), which would read as a second stop. CI caught
    the line once on the test cluster, where it depends on when the SIGTERM
    lands; here a stand-in scontrol sends it during the requeue, every time."""
    bin_dir = tmp_path / "bin"
    _stand_in(bin_dir, "scontrol",
              "case \"$1\" in\n"
              "  show) echo 'JobId=7 JobName=demo PreemptTime=2026-11-25T00:00:00 Restarts=0' ;;\n"
              "  requeue) echo \"requeue $2\" >> requeued; kill -TERM \"$PPID\"; sleep 1 ;;\n"
              "esac")
    result = _batch_shell(tmp_path, bin_dir, "7", "demo", "run_step true")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "requeueing job 7 (preempted at 2026-11-25T00:00:00)" in result.stdout, result.stdout
    assert (tmp_path / "requeued").read_text() == "requeue 7\n"
    assert "batch shell got" not in result.stdout, result.stdout


@pytest.mark.parametrize("nodes_left, finished, requeued", [(1, False, True), (2, False, False), (1, True, False)])
def test_a_step_that_ended_after_its_job_lost_a_node_is_requeued_unless_finished(tmp_path, nodes_left, finished,
                                                                                 requeued):
    """multi_node.sh (LOST_NODES_REQUEUE) under sbatch --no-kill: Slurm takes a
    failed node out of the job instead of ending it, and no longer requeues
    it. A step that then ends unfinished with fewer nodes than the job
    started with (an elastic one with too few left) is requeued by the batch
    shell; one that lost no node, or whose training holds every epoch, is not.
    The real case, on the test cluster: test_slurm.py's elastic tests."""
    bin_dir = tmp_path / "bin"
    _stand_in(bin_dir, "scontrol",
              "case \"$1\" in\n"
              f"  show) echo 'JobId=7 JobName=demo PreemptTime=None NumNodes={nodes_left} Restarts=0' ;;\n"
              "  requeue) echo \"requeue $2\" >> requeued ;;\n"
              "esac")
    step = 'touch "$TRAINING_FINISHED_FILE"; exit 1' if finished else "exit 1"
    result = _batch_shell(tmp_path, bin_dir, "7", "demo",
                          f"SLURM_JOB_NUM_NODES=2 LOST_NODES_REQUEUE=1; run_step bash -c '{step}'")
    if requeued:
        assert result.returncode == 0, result.stdout + result.stderr
        assert "training stopped (status 1) with 1 of the job's 2 nodes left; requeueing job 7" in result.stdout
        assert (tmp_path / "requeued").read_text() == "requeue 7\n"
    else:
        assert result.returncode == 1 and "requeueing" not in result.stdout, result.stdout + result.stderr
        assert not (tmp_path / "requeued").exists()


def _stand_in_squeue(bin_dir: Path, state: str) -> None:
    """An squeue that reports every job it is asked about in ``state``."""
    _stand_in(bin_dir, "squeue", f"echo {state}")


def _snapshot_for(folder: Path, bin_dir: Path, job_id: str, *args: str) -> subprocess.CompletedProcess:
    """snapshot_for ARGS in job ``job_id`` of a sweep, then prints the snapshot it chose."""
    return _batch_shell(folder, bin_dir, job_id, "sweep", 'snapshot_for "$@"; echo "SNAPSHOT=$SNAPSHOT"', *args)


def test_a_job_waits_for_the_claim_another_job_is_taking(tmp_path):
    """Two copies of one command starting together: the second reads the claim
    only once the first has written it, so it sees a live owner and is refused,
    rather than finding the claim free and taking it too. Here job 5 holds the
    claim's lock (as snapshot_for does, with flock on the claim file) for a
    second before writing its id."""
    bin_dir = tmp_path / "bin"
    _stand_in_squeue(bin_dir, "RUNNING")
    claim = tmp_path / "snapshot-sweep.pt.job"
    claim.touch()
    first = subprocess.Popen(["flock", str(claim), "bash", "-c", "touch held; sleep 1; echo 5 > snapshot-sweep.pt.job"],
                             cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "held").exists():  # job 5 holds the lock
            assert time.monotonic() < deadline and first.poll() is None, "flock never took the claim's lock"
            time.sleep(0.05)
        second = _snapshot_for(tmp_path, bin_dir, "6")
    finally:
        first.wait(timeout=30)
    assert second.returncode == 2, second.stdout + second.stderr
    assert second.stderr.strip() == (
        "error: snapshot snapshot-sweep.pt belongs to job 5, which is RUNNING: two live jobs must not share a "
        "snapshot; wait for job 5 to end (or scancel it), or submit with other arguments or --job-name")
    assert claim.read_text() == "5\n"


def test_a_submissions_snapshot_is_named_by_the_runs_identity_and_is_a_folder_under_fsdp(tmp_path):
    """The same run, the same name, however its flags are ordered or spelt and
    however long it runs (a requeued job, the same command again, a raised
    --total_epochs or --max_steps, another --num_workers); another point of a
    sweep (another --lr, another --dropout), another name; a run that gives no
    flag of its identity, the bare name; --strategy fsdp (train.py's sharded
    snapshots) a folder's name, without .pt; a --snapshot_path given wins."""
    def chosen(*args: str) -> str:  # the rule, in process: tools/identity.py's snapshot_for
        return snapshot_for("snapshot-sweep", list(args), str(tmp_path))[0]

    first = chosen("--dataset", "shakespeare_char", "--lr", "3e-4", "--n_layer", "2", "--max_steps", "60")
    assert first.startswith("snapshot-sweep-") and first.endswith(".pt") and len(first) == len("snapshot-sweep-.pt") + 8
    assert first == wrapper_snapshot("sweep", ["--dataset", "shakespeare_char", "--lr", "3e-4", "--n_layer", "2"])
    same = [("--n_layer=2", "--max_steps", "90", "--lr", "0.0003", "--dataset", "shakespeare_char", "--num_workers", "2"),
            ("--dataset=shakespeare_char", "--total_epochs", "3", "--n_layer", "2", "--lr=.0003", "--sample_chars", "40")]
    for args in same:
        assert chosen(*args) == first, args
    others = [("--dataset", "shakespeare_char", "--lr", "1e-3", "--n_layer", "2"),
              ("--dataset", "shakespeare_char", "--lr", "3e-4", "--n_layer", "2", "--dropout", "0.1"),
              ("--dataset", "shakespeare_char", "--lr", "3e-4", "--n_layer", "3")]
    names = {chosen(*args) for args in others}
    assert len(names) == len(others) and first not in names, names
    assert chosen() == chosen("--total_epochs", "3", "--compile") == "snapshot-sweep.pt"
    lr = wrapper_snapshot("sweep", ["--lr", "1"])
    assert chosen("--strategy", "fsdp", "--lr", "1") == chosen("--lr=1", "--strategy=fsdp") == lr[:-3]
    assert chosen("--strategy", "fsdp", "--strategy", "ddp", "--lr", "1") == lr
    assert chosen("--strategy", "fsdp", "--snapshot_path", "mine") == "mine"
    # The batch shell's step (slurm/stop_and_requeue.sh) runs that rule and says what it chose.
    bin_dir = tmp_path / "bin"
    _stand_in_squeue(bin_dir, "COMPLETED")
    printed = _snapshot_for(tmp_path, bin_dir, "6", "--lr", "0.5", "--total_epochs", "3").stdout
    assert "run identity " in printed and ": --lr 0.5\n" in printed, printed
    assert printed.splitlines()[-1] == f"SNAPSHOT={wrapper_snapshot('sweep', ['--lr', '0.5'])}", printed


def test_a_snapshot_named_by_the_arguments_as_typed_is_resumed_with_a_note(tmp_path):
    """A snapshot named by a hash of the arguments as typed, and none yet by
    the run's identity: that one is resumed, with a note naming both; once
    the identity's name exists, it is the one."""
    args = ["--lr", "0.1", "--total_epochs", "4"]
    typed, named = typed_snapshot("sweep", args), wrapper_snapshot("sweep", args)
    assert typed != named
    (tmp_path / typed).write_bytes(b"a snapshot")
    chosen, lines = snapshot_for("snapshot-sweep", args, str(tmp_path))  # the rule the batch shell runs
    assert chosen == typed, lines
    assert any(line.startswith(f"note: resuming {typed}, this command's snapshot named by its arguments as typed "
                               f"(the run's identity names it {named}") for line in lines), lines
    (tmp_path / named).write_bytes(b"a newer snapshot")
    chosen, lines = snapshot_for("snapshot-sweep", args, str(tmp_path))
    assert chosen == named and not any(line.startswith("note:") for line in lines), lines


def test_a_flag_train_py_refuses_ends_the_job_before_its_snapshot_is_named(tmp_path):
    """--learning_rate (nanoGPT's name): the job ends with train.py's own line
    and status 2, before any claim is written."""
    bin_dir = tmp_path / "bin"
    _stand_in_squeue(bin_dir, "COMPLETED")
    result = _snapshot_for(tmp_path, bin_dir, "6", "--learning_rate", "0.1")
    assert result.returncode == 2 and "SNAPSHOT=" not in result.stdout, result
    assert result.stderr.splitlines()[-1].startswith("train.py: error: unrecognized arguments: --learning_rate 0.1 "
                                                     "(did you mean: --learning_rate -> --lr?)"), result.stderr
    assert not list(tmp_path.glob("*.job"))


def test_a_claim_that_cannot_be_written_is_one_line_and_exit_2(tmp_path):
    bin_dir = tmp_path / "bin"
    _stand_in_squeue(bin_dir, "RUNNING")
    result = _snapshot_for(tmp_path, bin_dir, "6", "--snapshot_path", "missing/snapshot.pt")
    assert result.returncode == 2 and "SNAPSHOT=" not in result.stdout, result.stdout + result.stderr
    assert result.stderr.strip() == (
        f"error: cannot write {tmp_path}/missing/snapshot.pt.job (the snapshot's claim): submit from a folder "
        "this job can write, or pass a writable --snapshot_path")
    # A claim written by a job that has ended is taken over.
    (tmp_path / "snapshot-sweep.pt.job").write_text("5\n")
    _stand_in_squeue(bin_dir, "COMPLETED")
    result = _snapshot_for(tmp_path, bin_dir, "6")
    assert result.returncode == 0 and "SNAPSHOT=snapshot-sweep.pt" in result.stdout, result.stderr
    assert (tmp_path / "snapshot-sweep.pt.job").read_text() == "6\n"


def test_a_claim_train_py_rewrote_is_read_by_its_job_and_a_hand_started_runs_is_left_to_the_script(tmp_path):
    """train.py writes job=ID host=... pid=...: the job id is what counts; a
    claim of a run started by hand (no job) is neither refused nor taken here."""
    bin_dir = tmp_path / "bin"
    _stand_in_squeue(bin_dir, "RUNNING")
    claim = tmp_path / "snapshot-sweep.pt.job"
    claim.write_text("job=5 host=node1 pid=99 start=7\n")
    refused = _snapshot_for(tmp_path, bin_dir, "6")
    assert refused.returncode == 2 and "belongs to job 5, which is RUNNING" in refused.stderr, refused.stderr
    requeued = _snapshot_for(tmp_path, bin_dir, "5")
    assert requeued.returncode == 0 and claim.read_text() == "5\n", requeued.stderr
    claim.write_text("host=node1 pid=99 start=7\n")
    result = _snapshot_for(tmp_path, bin_dir, "6")
    assert result.returncode == 0 and "SNAPSHOT=snapshot-sweep.pt" in result.stdout, result.stderr
    assert claim.read_text() == "host=node1 pid=99 start=7\n"


def test_the_submitit_launcher_without_sbatch_is_one_line(tmp_path):
    """launchers/submitit_train.py on a machine with no Slurm client (a
    laptop, a pod): one line saying what it needs and what to run instead,
    exit status 2, no job folder made (not submitit's traceback)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(sys.executable)
    result = subprocess.run([sys.executable, str(REPO / "launchers" / "submitit_train.py"), "--folder",
                             str(tmp_path / "jobs"), "--", "--total_epochs", "1"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120, env={**os.environ, "PATH": str(bin_dir)})
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        "error: no sbatch on PATH: launchers/submitit_train.py submits to a Slurm cluster; run it on a machine that "
        "submits there (a login node), or start train.py with torchrun here (docs/launchers.md)"]
    assert not (tmp_path / "jobs").exists()
