#!/bin/bash
# single_gpu.sh: singlegpu.py on one GPU (or, on a node without one, the CPU).
# Submit from the project folder; arguments after the name go to the script:
#     sbatch slurm/single_gpu.sh --dataset mnist --total_epochs 5
# Output: single_gpu-<job id>.out and checkpoint-<job id>.pt, in the folder you
# submitted from. Edit: the #SBATCH lines (partition, account, time), the
# environment block. No --requeue and no warning signal, on purpose: singlegpu.py
# never resumes, so a requeued job would start over; for long runs use
# sbatch --gres=gpu:1 slurm/multi_gpu.sh (docs/slurm.md).

#SBATCH --job-name=single_gpu       # the name in squeue, and %x in the log file name
#SBATCH --nodes=1                  # one machine
#SBATCH --ntasks=1                 # one process
#SBATCH --gres=gpu:1               # one GPU
#SBATCH --cpus-per-task=4          # CPU cores for that process (data loading, --num_workers)
#SBATCH --mem=16G                  # host memory
#SBATCH --time=01:00:00            # wall-clock limit; the job is killed after it
#SBATCH --output=%x-%j.out         # %x = job name, %j = job id; stdout and stderr together
##SBATCH --partition=gpu           # many clusters want a partition: remove one # and name yours
##SBATCH --account=my-project      # and an account to charge: likewise

set -euo pipefail

if [ -z "${SLURM_JOB_ID:-}" ]; then
    echo "error: this is a Slurm batch script; submit it with: sbatch slurm/single_gpu.sh [training args]" >&2
    exit 2
fi
# sbatch runs a copy of this file from a spool folder: the project is the submission folder.
PROJECT="${PROJECT_DIR:-$SLURM_SUBMIT_DIR}"
SCRIPT="$PROJECT/singlegpu.py"
if [ ! -f "$SCRIPT" ]; then
    echo "error: $SCRIPT not found; run sbatch slurm/single_gpu.sh from the project folder, or set PROJECT_DIR" >&2
    exit 2
fi

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

# --- python check (identical in every wrapper that runs python itself) ---
if ! ${CONTAINER[@]+"${CONTAINER[@]}"} python -c '' 2>/dev/null; then
    echo "error: no working python${CONTAINER_IMAGE:+ in the container}; activate the environment in the wrapper's environment block" >&2
    exit 2
fi
# --- end python check ---

echo "job $SLURM_JOB_ID on $(hostname) | GPUs ${CUDA_VISIBLE_DEVICES:-none} | $(date -Is)"

# The training step: one python process. Defaults first: the same flag in "$@" overrides them.
${CONTAINER[@]+"${CONTAINER[@]}"} python "$SCRIPT" --checkpoint_path "checkpoint-$SLURM_JOB_ID.pt" "$@"
echo "$(date -Is) done"
