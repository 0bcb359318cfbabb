#!/bin/bash
# multi_gpu.sh: multigpu_torchrun.py on ONE node, one process per GPU that
# Slurm gives the job, under torchrun; survives preemption, requeue and the
# time limit (snapshot, then requeue).
#
# Submit from the project folder; arguments after the script name reach the
# training script:
#     sbatch slurm/multi_gpu.sh
#     sbatch slurm/multi_gpu.sh --dataset mnist --total_epochs 5
#     sbatch --gres=gpu:2 --time=01:00:00 slurm/multi_gpu.sh      # override any #SBATCH line
# Watch: squeue --me; tail -f multi_gpu-<job id>.out. Stop: scancel <job id>
# (the ranks save a snapshot first; the same sbatch command resumes from it).
# Edit: the #SBATCH lines for your cluster (partition, account, GPUs, time),
# and the environment block below.
# Output: multi_gpu-<job id>.out in the folder you submitted from. The
# snapshot: snapshot-<job name>.pt there, so that submitting the same command
# again (after a scancel, a crash or a lost requeue) resumes; start afresh
# with another --job-name, or delete the snapshot.
#
# How each way Slurm stops a job ends (slurm/stop_and_requeue.sh, and the table
# in docs/slurm.md): on the time-limit warning (SIGUSR1 to this batch shell,
# 90 s before the end, the B: below) and on a preemption (SIGTERM to the srun
# step), every rank finishes its step, all stop after the same one, rank 0
# saves the snapshot, and the job is requeued and resumes there; on
# `scontrol requeue` Slurm requeues it, on `scancel` it ends with the snapshot
# on disk. torchrun gets 80 s (--shutdown-timeout) for its workers to save
# before it kills them: the rest of a step, one more step and the save must
# fit in that, and in the 90 s of the warning.

#SBATCH --job-name=multi_gpu        # the name in squeue, %x in the log file name, and the snapshot's name
#SBATCH --nodes=1                  # one machine; slurm/multi_node.sh for more
#SBATCH --ntasks-per-node=1        # one task: the torchrun agent, which starts one worker per GPU
#SBATCH --gres=gpu:4               # GPUs on that node; the worker count follows whatever is granted
#SBATCH --cpus-per-task=16         # CPU cores for all workers (data loading, --num_workers)
#SBATCH --mem=64G                  # host memory for the whole node's job
#SBATCH --time=02:00:00            # wall-clock limit; the warning signal comes 90 s before it
#SBATCH --output=%x-%j.out         # %x = job name, %j = job id; stdout and stderr together
#SBATCH --open-mode=append         # a requeued job appends to its log instead of truncating it
#SBATCH --requeue                  # allow requeueing (by this script, by scontrol, on preemption)
#SBATCH --signal=B:USR1@90         # SIGUSR1 to the batch shell only, 90 s before the time limit
##SBATCH --partition=gpu           # many clusters want a partition: remove one # and name yours
##SBATCH --account=my-project      # and an account to charge: likewise

set -euo pipefail

if [ -z "${SLURM_JOB_ID:-}" ]; then
    echo "error: this is a Slurm batch script; submit it with: sbatch slurm/multi_gpu.sh [training args]" >&2
    exit 2
fi

# sbatch runs a copy of this file from a spool folder, so the project is found
# from the submission folder, not from this file's location.
PROJECT="${PROJECT_DIR:-$SLURM_SUBMIT_DIR}"
if [ ! -f "$PROJECT/multigpu_torchrun.py" ]; then
    echo "error: $PROJECT/multigpu_torchrun.py not found; submit from the project folder (cd ddp-scripts && sbatch slurm/multi_gpu.sh) or set PROJECT_DIR" >&2
    exit 2
fi
# Traps the stop signals first (they may come during set-up), then run_step below.
source "$PROJECT/slurm/stop_and_requeue.sh"

# ---- Environment: edit for your cluster ------------------------------------
set +u  # activation scripts (conda, some module systems) read unset variables
# Default: the project's virtual environment (README set-up) or the one VENV_DIR
# names, where it exists. A line below this one takes over from it:
VENV="${VENV_DIR:-$SLURM_SUBMIT_DIR/.venv}"
if [ -z "${CONTAINER_IMAGE:-}" ] && [ -f "$VENV/bin/activate" ]; then source "$VENV/bin/activate"; fi
# module load cuda/12.4 python/3.11          # a module system, or
# eval "$(conda shell.bash hook)" && conda activate ddp   # conda, or
# CONTAINER_IMAGE=image.sif: a container instead (see "Container" below)
set -u
# ---------------------------------------------------------------------------

# ---- Container (optional) ---------------------------------------------------
# CONTAINER_IMAGE=/path/ddp-scripts.sif sbatch slurm/multi_gpu.sh ...: torchrun
# runs inside the image (docs/containers.md), with the submission and project
# folders, $DATA_DIR and $CONTAINER_BINDS (comma-separated) bound at the same
# paths. CONTAINER_RUN replaces the command before the image (split at
# spaces; e.g. a podman run ... line). scontrol (requeue) stays here in the
# batch shell, outside the container: images rarely have Slurm's commands.
CONTAINER=()
if [ -n "${CONTAINER_IMAGE:-}" ]; then
    BINDS="$SLURM_SUBMIT_DIR,$PROJECT${DATA_DIR:+,$DATA_DIR}${CONTAINER_BINDS:+,$CONTAINER_BINDS}"
    # shellcheck disable=SC2206  # word splitting of CONTAINER_RUN is the point
    CONTAINER=(${CONTAINER_RUN:-apptainer exec --nv --bind $BINDS} "$CONTAINER_IMAGE")
fi
# Below, ${CONTAINER[@]+"${CONTAINER[@]}"} is that command, or nothing at all
# without a container (also under set -u in bash before 4.4).
require_torchrun ${CONTAINER[@]+"${CONTAINER[@]}"}

# One worker per GPU granted on this node; on a node without GPUs, one CPU worker.
NPROC_PER_NODE="${SLURM_GPUS_ON_NODE:-1}"

echo "job $SLURM_JOB_ID on $(hostname) | restart ${SLURM_RESTART_COUNT:-0} | $NPROC_PER_NODE processes | $(date -Is)"

# srun: a job step, which is what Slurm signals on a preemption (the batch
# shell is not signalled then). --cpus-per-task: srun of Slurm 22.05-23.02 does
# not inherit it from sbatch. --standalone: a rendezvous on localhost at a port
# the OS picks, so two jobs on one node never collide. --signals-to-handle:
# torchrun's agent relays SIGTERM, SIGINT, SIGHUP and SIGQUIT by default, and
# dies of any other signal, SIGUSR1 included. Defaults first, so that the same
# flag in "$@" overrides them.
run_step srun --ntasks=1 --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}" ${CONTAINER[@]+"${CONTAINER[@]}"} \
    torchrun --standalone --nproc_per_node="$NPROC_PER_NODE" \
    --signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 --shutdown-timeout=80 \
    "$PROJECT/multigpu_torchrun.py" --snapshot_path "snapshot-$SLURM_JOB_NAME${SLURM_ARRAY_TASK_ID:+-$SLURM_ARRAY_TASK_ID}.pt" "$@"
