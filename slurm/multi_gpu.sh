#!/bin/bash
# multi_gpu.sh: train.py (the kit) on ONE node under torchrun, one worker per
# GPU granted; on preemption and before the time limit it snapshots and requeues.
# Submit from the project folder; arguments after the name go to train.py:
#     sbatch slurm/multi_gpu.sh --dataset mnist --total_epochs 5
#     sbatch --gres=gpu:2 --time=01:00:00 slurm/multi_gpu.sh   # override any #SBATCH line
#     sbatch slurm/multi_gpu.sh --strategy fsdp                # FSDP: the snapshot is a folder
# Watch: squeue --me; tail -f multi_gpu-<job id>.out. scancel <job id> stops it
# with a snapshot (snapshot-<job name>-<run identity>.pt); the same sbatch command resumes.
# Edit: the #SBATCH lines (partition, account, GPUs, time); the environment in
# slurm/env.sh. SCRIPT_NAME=multigpu_torchrun.py: a rung instead of train.py.

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

# sbatch runs a copy of this file from a spool folder: the project is the submission folder.
PROJECT="${PROJECT_DIR:-${SLURM_SUBMIT_DIR:-$PWD}}"
[ -f "$PROJECT/slurm/env.sh" ] || { echo "error: $PROJECT/slurm/env.sh not found; run sbatch slurm/multi_gpu.sh" \
    "from the project folder, or set PROJECT_DIR" >&2; exit 2; }
# slurm/env.sh, what every wrapper shares: the sbatch-only check, the stop traps first (a
# signal may come during set-up), the blocks to edit (environment, network, container).
source "$PROJECT/slurm/env.sh"
require_launcher torchrun

# One worker per GPU granted on this node; on a node without GPUs, one CPU worker.
NPROC_PER_NODE="${SLURM_GPUS_ON_NODE:-1}"
# This submission's snapshot (the run's identity in its name), claimed for this job:
# the same command resumes it; another live job holding it is refused.
snapshot_for "$@"
echo "job $SLURM_JOB_ID on $(hostname) | restart ${SLURM_RESTART_COUNT:-0} | $NPROC_PER_NODE processes | $SNAPSHOT | $(date -Is)"

# The training step: torchrun in an srun step (what a preemption signals), at a
# free local port (--standalone), relaying the stop signals (TORCHRUN_STOP_FLAGS:
# SIGUSR1 too, 80 s to save; docs/slurm.md). Defaults first: the same flag in "$@" overrides them.
run_step srun --ntasks=1 --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}" ${SRUN_CONTAINER[@]+"${SRUN_CONTAINER[@]}"} \
    ${STEP_CONTAINER[@]+"${STEP_CONTAINER[@]}"} \
    torchrun --standalone --nproc_per_node="$NPROC_PER_NODE" "${TORCHRUN_STOP_FLAGS[@]}" \
    "$SCRIPT" --snapshot_path "$SNAPSHOT" "$@"
