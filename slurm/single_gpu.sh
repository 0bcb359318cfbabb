#!/bin/bash
# single_gpu.sh: train.py (the kit) on ONE GPU, one process under torchrun, so
# that it snapshots and requeues on preemption and before the time limit, as
# multi_gpu.sh does (singlegpu.py, the first rung, never resumes: run it as
# srun python singlegpu.py). Submit from the project folder; arguments after
# the name go to train.py:
#     sbatch slurm/single_gpu.sh --dataset mnist --total_epochs 5
# Output: single_gpu-<job id>.out and the snapshot (snapshot-single_gpu-<run identity>.pt),
# in the folder you submitted from; the same sbatch command resumes it.
# Edit: the #SBATCH lines (partition, account, time); the environment in
# slurm/env.sh. SCRIPT_NAME=<script>: another script (a rung) instead of train.py.

#SBATCH --job-name=single_gpu       # the name in squeue, %x in the log file name, and the snapshot's name
#SBATCH --nodes=1                  # one machine
#SBATCH --ntasks=1                 # one task: the torchrun agent, which starts the one worker
#SBATCH --gres=gpu:1               # one GPU
#SBATCH --cpus-per-task=4          # CPU cores for that process (data loading, --num_workers)
#SBATCH --mem=16G                  # host memory
#SBATCH --time=01:00:00            # wall-clock limit; the warning signal comes 90 s before it
#SBATCH --output=%x-%j.out         # %x = job name, %j = job id; stdout and stderr together
#SBATCH --open-mode=append         # a requeued job appends to its log instead of truncating it
#SBATCH --requeue                  # allow requeueing (by this script, by scontrol, on preemption)
#SBATCH --signal=B:USR1@90         # SIGUSR1 to the batch shell only, 90 s before the time limit
##SBATCH --partition=gpu           # many clusters want a partition: remove one # and name yours
##SBATCH --account=my-project      # and an account to charge: likewise

set -euo pipefail

# sbatch runs a copy of this file from a spool folder: the project is the submission folder.
PROJECT="${PROJECT_DIR:-${SLURM_SUBMIT_DIR:-$PWD}}"
[ -f "$PROJECT/slurm/env.sh" ] || { echo "error: $PROJECT/slurm/env.sh not found; run sbatch slurm/single_gpu.sh" \
    "from the project folder, or set PROJECT_DIR" >&2; exit 2; }
# slurm/env.sh, what every wrapper shares: the sbatch-only check, the stop traps first (a
# signal may come during set-up), the blocks to edit (environment, network, container).
source "$PROJECT/slurm/env.sh"
require_launcher torchrun

# This submission's snapshot (the run's identity in its name), claimed for this job:
# the same command resumes it; another live job holding it is refused.
snapshot_for "$@"
echo "job $SLURM_JOB_ID on $(hostname) | restart ${SLURM_RESTART_COUNT:-0} | 1 processes | $SNAPSHOT | $(date -Is)"

# The training step: torchrun with one worker in an srun step (what a preemption
# signals), at a free local port (--standalone), relaying the stop signals
# (TORCHRUN_STOP_FLAGS; docs/slurm.md). Defaults first: the same flag in "$@" overrides them.
run_step srun --ntasks=1 --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}" ${SRUN_CONTAINER[@]+"${SRUN_CONTAINER[@]}"} \
    ${STEP_CONTAINER[@]+"${STEP_CONTAINER[@]}"} \
    torchrun --standalone --nproc_per_node=1 "${TORCHRUN_STOP_FLAGS[@]}" \
    "$SCRIPT" --snapshot_path "$SNAPSHOT" "$@"
