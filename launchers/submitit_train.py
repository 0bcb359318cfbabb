"""Submit train.py to Slurm with submitit: one task per GPU, each a rank.

    pip install submitit
    python launchers/submitit_train.py --nodes 2 --gpus_per_node 4 --time_min 120 -- --dataset mnist

The flags before ``--`` size the job; those after go to train.py. It prints
the job id and the log folder, then returns (``--wait``: it waits for the
job and prints how it ended). Each task runs ``python train.py ARGS`` as a
child process: the kit takes its rank, local rank and rendezvous from srun's
variables, as under slurm/multi_node_srun.sh (docs/slurm.md).

A stop ends in the kit's snapshot, then submitit's requeue:
- Before the time limit, Slurm sends SIGUSR1 to every task (``--signal
  USR1@90``, submitit's ``slurm_signal_delay_s``, the signal chosen by
  SUBMITIT_PREEMPT_SIGNAL); on a preemption with a grace time, SIGTERM.
  Every rank finishes its step and rank 0 saves the snapshot, as with the
  wrappers.
- Then, unless the run already holds every epoch, rank 0 hands over to
  submitit's own checkpoint-and-requeue: the job goes back to the queue, and
  its next start resumes from the snapshot. A SIGTERM that is not a
  preemption (scancel, scontrol requeue) is left to Slurm, as the wrappers
  do.

submitit's own handler is not let loose on the signal itself: it would
requeue at once, mid-step, before any snapshot is written.
The snapshot is named as the wrappers name it: ``snapshot-<job name>[-<the
run's identity>].pt`` in the folder you submit from (tools/identity.py),
unless you pass --snapshot_path.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

# submitit's handler, and the --signal of the jobs it writes, follow this variable: the kit
# stops on SIGUSR1 (and SIGTERM). Set before submitit is imported, in the job as here.
os.environ.setdefault("SUBMITIT_PREEMPT_SIGNAL", "USR1")
import submitit  # noqa: E402

PROJECT = Path(__file__).resolve().parent.parent


class KitTask(submitit.helpers.Checkpointable):
    """One Slurm task of the job: ``python SCRIPT ARGS`` as a child process,
    in the submission folder, and after it ends the requeue decision.
    Picklable (submitit sends it to the job); nothing here imports torch."""

    def __init__(self, script: str, args: list, folder: str) -> None:
        self.script, self.args, self.folder = script, list(args), folder

    def __call__(self) -> int:
        """Run the task; return its exit status: 0, or for a run a SIGTERM
        stopped that Slurm ends or requeues itself (scancel, scontrol
        requeue, the time limit) 143, a stopped run's. Requeues it on
        SIGUSR1 or a preemption. Raises RuntimeError when the training failed
        (any other non-zero status), which submitit reports."""
        job = submitit.JobEnvironment()
        requeue = signal.getsignal(signal.SIGUSR1)  # submitit's checkpoint-and-requeue
        received = []

        def note(signum, frame):  # relayed: the child may be in a process group of its own
            received.append(signum)
            if child.poll() is None:
                child.send_signal(signum)

        finished = Path(self.folder) / f".finished-{job.job_id}"
        env = dict(os.environ, TRAINING_FINISHED_FILE=str(finished))
        child = subprocess.Popen([sys.executable, self.script, *self.args], cwd=self.folder, env=env)
        for signum in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(signum, note)
        status = child.wait()
        for signum in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(signum, signal.SIG_IGN)  # the requeue SIGTERMs this task too
        done = finished.exists()  # rank 0 of the kit made it: the run holds every epoch
        if done and job.global_rank == 0:
            finished.unlink()
        if done or not received:
            if status:
                raise RuntimeError(f"{Path(self.script).name} ended with status {status}")
            return status
        if signal.SIGUSR1 in received or _preempted(job.job_id):
            print(f"rank {job.global_rank}: stopped by {signal.Signals(received[0]).name}, snapshot saved; "
                  f"requeueing", flush=True)
            requeue(signal.SIGUSR1, None)  # rank 0: this task pickled again, scontrol requeue, exit
        return status


def _preempted(job_id: str) -> bool:
    """Whether Slurm has picked the job for preemption (its PreemptTime is set)."""
    record = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout
    return "PreemptTime=" in record and "PreemptTime=None" not in record


def snapshot_path(job_name: str, args: list) -> str:
    """The --snapshot_path of a submission named ``job_name`` running
    train.py's ``args``, named as the Slurm wrappers name it
    (``tools.identity.snapshot_for``, the one rule: a --snapshot_path
    given, else snapshot-<job name>[-<the run's identity>].pt, a folder (no
    .pt) under --strategy fsdp or hsdp); prints the lines saying how it was
    chosen. Ends the process with train.py's one line for a flag train.py
    refuses."""
    sys.path.insert(0, str(PROJECT))
    from tools.identity import snapshot_for  # here, not at the top: the job's tasks never import torch

    path, lines = snapshot_for(f"snapshot-{job_name}", args)
    for line in lines:
        print(line, flush=True)
    return path


def main(argv: list) -> int:
    """Parse the job's flags and train.py's (after ``--``), submit; print the
    job id. Returns 0 once submitted (with ``--wait``, 1 for a job that did
    not complete); 2, with one line on stderr, where there is no ``sbatch`` to
    submit with, and 1 where sbatch refuses the job (its own error line)."""
    cut = argv.index("--") if "--" in argv else len(argv)
    ours, train_args = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=1, help="nodes (default: 1)")
    parser.add_argument("--gpus_per_node", type=int, default=1, help="GPUs, and so tasks, per node (default: 1)")
    parser.add_argument("--cpus_per_task", type=int, default=8, help="CPU cores per task (default: 8)")
    parser.add_argument("--mem_gb", type=int, default=64, help="host memory per node, GB (default: 64)")
    parser.add_argument("--time_min", type=int, default=120, help="time limit, minutes (default: 120)")
    parser.add_argument("--partition", help="Slurm partition (default: the cluster's)")
    parser.add_argument("--account", help="Slurm account (default: yours)")
    parser.add_argument("--job_name", default="train", help="the job's name, in squeue and the snapshot's name")
    parser.add_argument("--folder", default="submitit", help="submitit's logs and job files (default: ./submitit)")
    parser.add_argument("--slurm", action="append", default=[], metavar="KEY=VALUE",
                        help="any other sbatch option, without its dashes (--slurm nodelist=gpu[1-2])")
    parser.add_argument("--script", default="train.py", help="the script in the project folder (default: train.py)")
    parser.add_argument("--wait", action="store_true", help="wait for the job; print how it ended")
    args = parser.parse_args(ours)
    if shutil.which("sbatch") is None:
        print("error: no sbatch on PATH: launchers/submitit_train.py submits to a Slurm cluster; run it on a "
              "machine that submits there (a login node), or start train.py with torchrun here "
              "(docs/launchers.md)", file=sys.stderr)
        return 2
    extra = {"requeue": True, **dict(option.split("=", 1) for option in args.slurm)}
    snapshot = snapshot_path(args.job_name, train_args)
    train_args += ["--snapshot_path", snapshot]  # the one given, again (train.py takes the last), or the default
    executor = submitit.AutoExecutor(folder=args.folder, cluster="slurm")
    executor.update_parameters(
        name=args.job_name, nodes=args.nodes, tasks_per_node=args.gpus_per_node, cpus_per_task=args.cpus_per_task,
        mem_gb=args.mem_gb, timeout_min=args.time_min, slurm_signal_delay_s=90, stderr_to_stdout=True,
        slurm_partition=args.partition, slurm_account=args.account,
        slurm_gres=f"gpu:{args.gpus_per_node}" if args.gpus_per_node else None,
        slurm_additional_parameters=extra)
    try:
        job = executor.submit(KitTask(str(PROJECT / args.script), train_args, os.getcwd()))
    except submitit.core.utils.FailedJobError as exc:  # sbatch's own refusal, its lines in the message
        lines = [line for line in str(exc).splitlines() if line.strip()]
        said = next((line for line in lines if "fatal" in line), lines[-1] if lines else "no message")
        print(f"error: sbatch refused the job: {said.strip()}", file=sys.stderr)
        return 1
    print(f"job {job.job_id} submitted | {snapshot} | logs in {args.folder}/", flush=True)
    if args.wait:
        try:
            print(f"job {job.job_id} ended: status {job.result()}")
        except submitit.core.utils.UncompletedJobError as exc:
            print(f"job {job.job_id} did not complete: {exc}")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
