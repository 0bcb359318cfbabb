#!/bin/bash
# multi_gpu.sh: multigpu_torchrun.py on ONE node under torchrun, one worker per
# GPU granted; on preemption and before the time limit it snapshots and requeues.
# Submit from the project folder; arguments after the name go to the script:
#     sbatch slurm/multi_gpu.sh --dataset mnist --total_epochs 5
#     sbatch --gres=gpu:2 --time=01:00:00 slurm/multi_gpu.sh   # override any #SBATCH line
# Watch: squeue --me; tail -f multi_gpu-<job id>.out. scancel <job id> stops it
# with a snapshot (snapshot-<job name>.pt); the same sbatch command resumes.
# Edit: the #SBATCH lines (partition, account, GPUs, time), the environment block.
# How each way Slurm stops a job ends: docs/slurm.md.

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
# sbatch runs a copy of this file from a spool folder: the project is the submission folder.
PROJECT="${PROJECT_DIR:-$SLURM_SUBMIT_DIR}"
if [ ! -f "$PROJECT/multigpu_torchrun.py" ]; then
    echo "error: $PROJECT/multigpu_torchrun.py not found; run sbatch slurm/multi_gpu.sh from the project folder, or set PROJECT_DIR" >&2
    exit 2
fi
# Traps the stop signals first (they may come during set-up); defines run_step.
source "$PROJECT/slurm/stop_and_requeue.sh"

# --- environment (identical in every wrapper; edit for your cluster) ---
set +u  # activation scripts (conda, some module systems) read unset variables
# Default: the project's .venv (README set-up) or VENV_DIR's, where it exists and
# no CONTAINER_IMAGE is set. A line below this one takes over from it:
VENV="${VENV_DIR:-$SLURM_SUBMIT_DIR/.venv}"
if [ -z "${CONTAINER_IMAGE:-}" ] && [ -f "$VENV/bin/activate" ]; then source "$VENV/bin/activate"; fi
# module load cuda/12.4 python/3.11                       # a module system, or
# eval "$(conda shell.bash hook)" && conda activate ddp   # conda, or
# CONTAINER_IMAGE=image.sif: a container instead (the container block below)
set -u
# --- end environment ---

# --- container (identical in every wrapper) ---
# CONTAINER_IMAGE=image.sif: the training command runs in the image (docs/containers.md);
# CONTAINER_RUN replaces the command before the image (split at spaces).
CONTAINER=()
if [ -n "${CONTAINER_IMAGE:-}" ]; then
    BINDS="$SLURM_SUBMIT_DIR,$PROJECT${DATA_DIR:+,$DATA_DIR}${CONTAINER_BINDS:+,$CONTAINER_BINDS}"
    # shellcheck disable=SC2206  # word splitting of CONTAINER_RUN is the point
    CONTAINER=(${CONTAINER_RUN:-apptainer exec --nv --bind $BINDS} "$CONTAINER_IMAGE")
fi
# ${CONTAINER[@]+"${CONTAINER[@]}"}: that command, or nothing (also under set -u in bash < 4.4).
# --- end container ---
require_torchrun ${CONTAINER[@]+"${CONTAINER[@]}"}

# One worker per GPU granted on this node; on a node without GPUs, one CPU worker.
NPROC_PER_NODE="${SLURM_GPUS_ON_NODE:-1}"
# This submission's snapshot (its arguments' hash in the name), claimed for this job:
# the same command resumes it; another live job holding it is refused.
snapshot_for "$@"
echo "job $SLURM_JOB_ID on $(hostname) | restart ${SLURM_RESTART_COUNT:-0} | $NPROC_PER_NODE processes | $SNAPSHOT | $(date -Is)"

# The training step: torchrun in an srun step (what a preemption signals), at a
# free local port (--standalone); it relays SIGUSR1 too and gives the workers 80 s
# to save (docs/slurm.md). Defaults first: the same flag in "$@" overrides them.
run_step srun --ntasks=1 --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}" ${CONTAINER[@]+"${CONTAINER[@]}"} \
    torchrun --standalone --nproc_per_node="$NPROC_PER_NODE" \
    --signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 --shutdown-timeout=80 \
    "$PROJECT/multigpu_torchrun.py" --snapshot_path "$SNAPSHOT" "$@"
