"""The sbatch wrappers in slurm/ as text: no cluster, no torch, a second or so.

What Slurm does with them is tests/test_slurm.py and tests/test_stop_paths.py;
here, what keeps them readable and keeps their copies from drifting apart:
the blocks marked ``# --- NAME (identical in ...) ---`` ... ``# --- end NAME ---``
are the same, byte for byte, in every wrapper that has them (and the wrappers
named below do have them), each header is short, every ``#SBATCH`` line says
what it is for, and every wrapper parses (``bash -n``) and runs strict. Also
slurm/stop_and_requeue.sh's own logic where a real cluster meets it only by
chance (its requeue's SIGTERM, two jobs taking one snapshot's claim), with
stand-in scontrol and squeue that make it happen every time.
"""

import re
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
WRAPPERS = ["single_gpu.sh", "multi_gpu.sh", "multi_node.sh", "multi_node_srun.sh"]

# Which wrapper must carry which shared block.
MUST_HAVE = {
    "environment": WRAPPERS,
    "container": WRAPPERS,
    "network": ["multi_node.sh", "multi_node_srun.sh"],
    "python check": ["single_gpu.sh", "multi_node_srun.sh"],
}
MAX_HEADER_LINES = 12
BEGIN = re.compile(r"^# --- (?P<name>[a-z ]+?) \(identical in [^)]*\) ---$")


def shared_blocks(text: str) -> dict:
    """{block name: its text, markers included} of one wrapper; each block
    opened must be closed, and appear once."""
    blocks, lines = {}, text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        begin = BEGIN.match(line.rstrip("\n"))
        if not begin:
            continue
        name = begin["name"]
        assert name not in blocks, f"block {name!r} appears twice"
        end = next((j for j in range(i + 1, len(lines)) if lines[j].rstrip("\n") == f"# --- end {name} ---"),
                   None)
        assert end is not None, f"block {name!r} has no '# --- end {name} ---' line"
        blocks[name] = "".join(lines[i:end + 1])
    return blocks


def read(wrapper: str) -> str:
    return (REPO / "slurm" / wrapper).read_text()


def test_each_wrapper_has_the_blocks_it_must():
    for name, wrappers in MUST_HAVE.items():
        for wrapper in wrappers:
            assert name in shared_blocks(read(wrapper)), f"{wrapper} lacks the {name!r} block"


def test_shared_blocks_are_identical_in_every_wrapper():
    found = {}  # block name -> {block text: [wrappers]}
    for wrapper in WRAPPERS:
        for name, block in shared_blocks(read(wrapper)).items():
            found.setdefault(name, {}).setdefault(block, []).append(wrapper)
    assert set(found) >= set(MUST_HAVE), found.keys()
    for name, versions in found.items():
        assert len(versions) == 1, f"the {name!r} block differs between " + " | ".join(
            ", ".join(wrappers) for wrappers in versions.values())


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_header_is_short(wrapper):
    """What it runs, how to submit, what to edit: at most 12 comment lines
    between the #! line and the first #SBATCH; the details are in docs/slurm.md."""
    lines = read(wrapper).splitlines()
    assert lines[0] == "#!/bin/bash"
    first = next(i for i, line in enumerate(lines) if line.startswith("#SBATCH"))
    header = [line for line in lines[1:first] if line.startswith("#")]
    assert header and len(header) <= MAX_HEADER_LINES, f"{len(header)} header lines:\n" + "\n".join(header)


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_every_sbatch_line_has_an_explanation(wrapper):
    """``#SBATCH --option   # what it is for``, the commented-out ``##SBATCH``
    ones too."""
    directives = [line for line in read(wrapper).splitlines() if re.match(r"##?SBATCH", line)]
    assert directives
    unexplained = [line for line in directives if not re.match(r"##?SBATCH \S+ +# \S", line)]
    assert not unexplained, unexplained
    for option in ("--partition", "--account"):  # waiting for the cluster's names
        assert any(line.startswith(f"##SBATCH {option}=") for line in directives), option


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_wrapper_parses_and_runs_strict(wrapper):
    text = read(wrapper)
    result = subprocess.run(["bash", "-n", str(REPO / "slurm" / wrapper)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert re.search(r"^set -euo pipefail$", text, re.M)
    # The training step is found at a glance.
    assert re.search(r"^# The training step:", text, re.M)
    # The error for a wrong submission folder assumes no folder name.
    assert "cd ddp-scripts" not in text and "from the project folder" in text


def test_multi_node_takes_each_nodes_worker_count_on_that_node():
    """--gpus=6 over 2 nodes can grant 4 and 2: each node's torchrun must start
    as many workers as its own node's SLURM_GPUS_ON_NODE, read inside the step,
    not the batch host's. The wrapper's own PER_NODE prefix, run as srun would on
    a node (printf in torchrun's place); one worker where the node has no GPU."""
    import os

    text = read("multi_node.sh")
    [per_node] = [line for line in text.splitlines() if line.startswith("PER_NODE=(")]
    assert "--nproc_per_node=@NPROC@" in text and '"${PER_NODE[@]}"' in text
    command = per_node + '\n"${PER_NODE[@]}" printf "%s\\n" --nnodes=2 --nproc_per_node=@NPROC@ multinode.py'
    for gpus, workers in (("2", "2"), ("4", "4"), (None, "1")):
        env = {key: value for key, value in os.environ.items() if key != "SLURM_GPUS_ON_NODE"}
        env.update({"SLURM_GPUS_ON_NODE": gpus} if gpus else {})
        result = subprocess.run(["bash", "-c", command], env=env, capture_output=True, text=True)
        assert result.stdout.split() == ["--nnodes=2", f"--nproc_per_node={workers}", "multinode.py"], result


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
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": job_id, "SLURM_JOB_NAME": job_name}
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
        deadline = time.monotonic() + 30
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
