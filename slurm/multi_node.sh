#!/bin/bash
# multi_node.sh: train.py (the kit) on SEVERAL nodes: srun starts one torchrun
# agent per node, they meet on the job's first node, each starts one worker per
# GPU granted. Snapshots and requeues on preemption and before the time limit.
# Submit from the project folder (on storage every node sees: the snapshot goes
# there); arguments after the name go to train.py:
#     sbatch slurm/multi_node.sh --dataset cifar10 --total_epochs 30
#     sbatch --nodes=4 slurm/multi_node.sh --strategy fsdp   # node count from the job
# Watch: squeue --me; tail -f multi_node-<job id>.out. scancel stops it with a
# snapshot; the same sbatch command resumes. Edit: the #SBATCH lines; the
# environment and network blocks in slurm/env.sh. SCRIPT_NAME=multinode.py or
# multinode_fsdp.py: a rung instead of train.py. More: docs/slurm.md.

#SBATCH --job-name=multi_node       # the name in squeue, %x in the log file name, and the snapshot's name
#SBATCH --nodes=2                  # machines; the rendezvous expects exactly this many
#SBATCH --ntasks-per-node=1        # one task per node: its torchrun agent, which starts the workers
#SBATCH --gres=gpu:4               # GPUs per node; workers per node follow what is granted
#SBATCH --cpus-per-task=16         # CPU cores per node for all its workers (data loading)
#SBATCH --mem=64G                  # host memory per node
#SBATCH --time=02:00:00            # wall-clock limit; the warning signal comes 90 s before it
#SBATCH --output=%x-%j.out         # %x = job name, %j = job id; every node's output lands here
#SBATCH --open-mode=append         # a requeued job appends to its log instead of truncating it
#SBATCH --requeue                  # allow requeueing (by this script, by scontrol, on preemption)
#SBATCH --signal=B:USR1@90         # SIGUSR1 to the batch shell only, 90 s before the time limit
##SBATCH --partition=gpu           # many clusters want a partition: remove one # and name yours
##SBATCH --account=my-project      # and an account to charge: likewise

set -euo pipefail

if [ -z "${SLURM_JOB_ID:-}" ]; then
    echo "error: this is a Slurm batch script; submit it with: sbatch slurm/multi_node.sh [training args]" >&2
    exit 2
fi
# sbatch runs a copy of this file from a spool folder: the project is the submission folder.
PROJECT="${PROJECT_DIR:-$SLURM_SUBMIT_DIR}"
if [ ! -f "$PROJECT/slurm/env.sh" ]; then
    echo "error: $PROJECT/slurm/env.sh not found; run sbatch slurm/multi_node.sh from the project folder, or set PROJECT_DIR" >&2
    exit 2
fi
# Traps the stop signals first (they may come during set-up); defines snapshot_for and run_step.
source "$PROJECT/slurm/stop_and_requeue.sh"
# The environment, network and container blocks (edit them there): SCRIPT, DATA, CONTAINER.
source "$PROJECT/slurm/env.sh"
require_launcher torchrun

# Workers per node: the GPUs granted on each node, read on that node inside the
# step (PER_NODE below; --gres=gpu:4 grants the same everywhere, --gpus=N need
# not); one CPU worker per node where there is no GPU. This node's, for the log:
NPROC_PER_NODE="${SLURM_GPUS_ON_NODE:-1}"
# Run inside the step, on each node: its own SLURM_GPUS_ON_NODE replaces the
# @NPROC@ of --nproc_per_node, then exec (signals reach torchrun itself).
# shellcheck disable=SC2016  # expanded on each node, not here
PER_NODE=(bash -c 'exec "${@//@NPROC@/${SLURM_GPUS_ON_NODE:-1}}"' per-node)
# The rendezvous: the job's first node (sed, not head: see docs/slurm.md), at a
# port derived from the job id (slurm/env.sh), never a literal.
RDZV_HOST="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)"
RDZV_PORT="$(rendezvous_port)"
# This submission's snapshot (its arguments' hash in the name), claimed for this job:
# the same command resumes it; another live job holding it is refused.
snapshot_for "$@"
echo "job $SLURM_JOB_ID | restart ${SLURM_RESTART_COUNT:-0} | $SLURM_JOB_NUM_NODES nodes ($SLURM_JOB_NODELIST) x $NPROC_PER_NODE processes | rendezvous $RDZV_HOST:$RDZV_PORT | $SNAPSHOT | $(date -Is)"

# The training step: one torchrun agent per node in an srun step; one node failing
# ends it on all (--kill-on-bad-exit); --rdzv-id: the job id; the stop signals
# relayed as in multi_gpu.sh (docs/slurm.md). Defaults first: the same flag in "$@" overrides them.
run_step srun --kill-on-bad-exit=1 --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}" "${PER_NODE[@]}" \
    ${CONTAINER[@]+"${CONTAINER[@]}"} torchrun --nnodes="$SLURM_JOB_NUM_NODES" --nproc_per_node=@NPROC@ \
    --rdzv-backend=c10d --rdzv-endpoint="$RDZV_HOST:$RDZV_PORT" --rdzv-id="$SLURM_JOB_ID" \
    "${TORCHRUN_STOP_FLAGS[@]}" "$SCRIPT" --data_dir "$DATA" --snapshot_path "$SNAPSHOT" "$@"
