#!/bin/bash
# single_gpu.sh: singlegpu.py on one GPU (or, on a node without one, the CPU).
#
# Submit from the project folder; arguments after the script name reach the
# training script:
#     sbatch slurm/single_gpu.sh
#     sbatch slurm/single_gpu.sh --dataset mnist --total_epochs 5
# Edit: the #SBATCH lines for your cluster (partition, time), and the
# environment block below. Output: single_gpu-<job id>.out in the folder you
# submitted from; the checkpoint: checkpoint-<job id>.pt there.
#
# No --requeue and no warning signal here, on purpose: singlegpu.py saves
# checkpoints but never resumes from one, so a requeued job would start over.
# For long runs use slurm/multi_gpu.sh with --gres=gpu:1: one worker, with
# snapshots, resume, and a clean stop before the time limit.

#SBATCH --job-name=single_gpu       # the name in squeue, and %x in the log file name
#SBATCH --nodes=1                  # one machine
#SBATCH --ntasks=1                 # one process
#SBATCH --gres=gpu:1               # one GPU
#SBATCH --cpus-per-task=4          # CPU cores for that process (data loading, --num_workers)
#SBATCH --mem=16G                  # host memory
#SBATCH --time=01:00:00            # wall-clock limit; the job is killed after it
#SBATCH --output=%x-%j.out         # %x = job name, %j = job id; stdout and stderr together

set -euo pipefail

if [ -z "${SLURM_JOB_ID:-}" ]; then
    echo "error: this is a Slurm batch script; submit it with: sbatch slurm/single_gpu.sh [training args]" >&2
    exit 2
fi

# ---- Environment: edit for your cluster ------------------------------------
set +u  # activation scripts (conda, some module systems) read unset variables
# module load cuda/12.4                      # a module system, or
# eval "$(conda shell.bash hook)"; conda activate ddp   # conda, or
# CONTAINER_IMAGE=image.sif: a container instead (see "Container" below)
# Default: the project's own virtual environment (README set-up), or VENV_DIR;
# with CONTAINER_IMAGE, the image's Python (nothing to activate out here).
[ -n "${CONTAINER_IMAGE:-}" ] || source "${VENV_DIR:-$SLURM_SUBMIT_DIR/.venv}/bin/activate"
set -u
# ---------------------------------------------------------------------------

# sbatch runs a copy of this file from a spool folder, so the training script
# is found from the submission folder, not from this file's location.
SCRIPT="${PROJECT_DIR:-$SLURM_SUBMIT_DIR}/singlegpu.py"
if [ ! -f "$SCRIPT" ]; then
    echo "error: $SCRIPT not found; submit from the project folder (cd ddp-scripts && sbatch slurm/single_gpu.sh) or set PROJECT_DIR" >&2
    exit 2
fi

# ---- Container (optional) ---------------------------------------------------
# CONTAINER_IMAGE=/path/ddp-scripts.sif sbatch slurm/single_gpu.sh ...: the
# script runs inside the image (docs/containers.md), with the submission and
# project folders, $DATA_DIR and $CONTAINER_BINDS (comma-separated) bound at
# the same paths. CONTAINER_RUN replaces the command before the image (split
# at spaces; e.g. a podman run ... line).
CONTAINER=()
if [ -n "${CONTAINER_IMAGE:-}" ]; then
    BINDS="$SLURM_SUBMIT_DIR,${PROJECT_DIR:-$SLURM_SUBMIT_DIR}${DATA_DIR:+,$DATA_DIR}${CONTAINER_BINDS:+,$CONTAINER_BINDS}"
    # shellcheck disable=SC2206  # word splitting of CONTAINER_RUN is the point
    CONTAINER=(${CONTAINER_RUN:-apptainer exec --nv --bind $BINDS} "$CONTAINER_IMAGE")
fi
# Below, ${CONTAINER[@]+"${CONTAINER[@]}"} is that command, or nothing at all
# without a container (also under set -u in bash before 4.4).

echo "job $SLURM_JOB_ID on $(hostname) | GPUs ${CUDA_VISIBLE_DEVICES:-none} | $(date -Is)"
# Defaults first, so that the same flag in "$@" overrides them.
${CONTAINER[@]+"${CONTAINER[@]}"} python "$SCRIPT" --checkpoint_path "checkpoint-$SLURM_JOB_ID.pt" "$@"
echo "$(date -Is) done"
