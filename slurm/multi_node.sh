#!/bin/bash
# multi_node.sh: train.py (the kit) on SEVERAL nodes: srun starts one torchrun
# agent per node, they meet on the job's first node, each starts one worker per
# GPU granted. Snapshots and requeues on preemption and before the time limit.
# Submit from the project folder (on storage every node sees: the snapshot goes
# there); arguments after the name go to train.py:
#     sbatch slurm/multi_node.sh --dataset cifar10 --total_epochs 30
#     sbatch --nodes=4 slurm/multi_node.sh --strategy hsdp   # node count from the job; docs/fsdp.md
#     ELASTIC_MIN_NODES=1 sbatch --no-kill slurm/multi_node.sh --snapshot_every_steps 500
# (elastic: a node that dies costs the steps since the last snapshot, not the job)
# Watch: squeue --me; tail -f multi_node-<job id>.out. scancel stops it with a
# snapshot; the same sbatch command resumes. Edit: #SBATCH lines; slurm/env.sh's
# blocks. SCRIPT_NAME=multinode.py: a rung instead of train.py. More: docs/slurm.md.

#SBATCH --job-name=multi_node       # the name in squeue, %x in the log file name, and the snapshot's name
#SBATCH --nodes=2                  # machines; the rendezvous expects exactly this many (elastic: at most)
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

# sbatch runs a copy of this file from a spool folder: the project is the submission folder.
PROJECT="${PROJECT_DIR:-${SLURM_SUBMIT_DIR:-$PWD}}"
[ -f "$PROJECT/slurm/env.sh" ] || { echo "error: $PROJECT/slurm/env.sh not found; run sbatch slurm/multi_node.sh" \
    "from the project folder, or set PROJECT_DIR" >&2; exit 2; }
# slurm/env.sh, what every wrapper shares: the sbatch-only check, the stop traps first (a
# signal may come during set-up), the blocks to edit (environment, network, container).
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
# This submission's snapshot (the run's identity in its name), claimed for this job:
# the same command resumes it; another live job holding it is refused.
snapshot_for "$@"
# Fixed size: one node failing ends the step on all (--kill-on-bad-exit), and
# Slurm ends the job and requeues it (under sbatch --no-kill run_step does).
# Elastic, ELASTIC_MIN_NODES=M (1 to the job's nodes) with sbatch --no-kill
# (the job outlives a node's failure): srun --no-kill keeps the step's tasks
# on the other nodes running, and their torchrun agents (--nnodes=M:<nodes>)
# start the training again on the nodes left, from the last snapshot, as long
# as M of them remain (the job's first node among them: it holds the
# rendezvous and the batch shell); with fewer the step ends and run_step
# requeues the job. ELASTIC_MAX_RESTARTS (default 3): torchrun's
# --max-restarts; ELASTIC_RDZV_CONF: its --rdzv-conf (join_timeout=600 s,
# last_call_timeout=30 s by default). docs/slurm.md.
NNODES="$SLURM_JOB_NUM_NODES"
# run_step: a step that ended unfinished after the job lost nodes is requeued.
LOST_NODES_REQUEUE=1
STEP_FLAGS=(--kill-on-bad-exit=1)
ELASTIC_FLAGS=()
ELASTIC_ENV=()
if [ -n "${ELASTIC_MIN_NODES:-}" ]; then
    if ! [[ "$ELASTIC_MIN_NODES" =~ ^[0-9]+$ ]] || [ "$ELASTIC_MIN_NODES" -lt 1 ] \
            || [ "$ELASTIC_MIN_NODES" -gt "$SLURM_JOB_NUM_NODES" ]; then
        echo "error: ELASTIC_MIN_NODES is '$ELASTIC_MIN_NODES'; it must be a whole number from 1 to the job's $SLURM_JOB_NUM_NODES nodes" >&2
        exit 2
    fi
    if ! [[ "${ELASTIC_MAX_RESTARTS:-3}" =~ ^[0-9]+$ ]]; then
        echo "error: ELASTIC_MAX_RESTARTS is '$ELASTIC_MAX_RESTARTS'; it must be a whole number (torchrun --max-restarts)" >&2
        exit 2
    fi
    NNODES="$ELASTIC_MIN_NODES:$SLURM_JOB_NUM_NODES"
    STEP_FLAGS=(--no-kill --kill-on-bad-exit=0)
    ELASTIC_FLAGS=(--max-restarts="${ELASTIC_MAX_RESTARTS:-3}" ${ELASTIC_RDZV_CONF:+--rdzv-conf="$ELASTIC_RDZV_CONF"})
    # Each round's rank 0 serves a fresh store, instead of the agents sharing
    # the first round's, whose address they never renew (docs/fault-tolerance.md);
    # set with env inside the container command, so that it reaches torchrun there too.
    ELASTIC_ENV=(env TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)
fi
echo "job $SLURM_JOB_ID | restart ${SLURM_RESTART_COUNT:-0} | $SLURM_JOB_NUM_NODES nodes ($SLURM_JOB_NODELIST) x $NPROC_PER_NODE processes${ELASTIC_MIN_NODES:+ | elastic, at least $ELASTIC_MIN_NODES nodes} | rendezvous $RDZV_HOST:$RDZV_PORT | $SNAPSHOT | $(date -Is)"

# The training step: one torchrun agent per node in an srun step; --rdzv-id:
# the job id; the stop signals relayed as in multi_gpu.sh (docs/slurm.md).
# Defaults first: the same flag in "$@" overrides them.
run_step srun "${STEP_FLAGS[@]}" --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}" \
    ${SRUN_CONTAINER[@]+"${SRUN_CONTAINER[@]}"} "${PER_NODE[@]}" ${STEP_CONTAINER[@]+"${STEP_CONTAINER[@]}"} \
    ${ELASTIC_ENV[@]+"${ELASTIC_ENV[@]}"} torchrun --nnodes="$NNODES" --nproc_per_node=@NPROC@ \
    --rdzv-backend=c10d --rdzv-endpoint="$RDZV_HOST:$RDZV_PORT" --rdzv-id="$SLURM_JOB_ID" \
    ${ELASTIC_FLAGS[@]+"${ELASTIC_FLAGS[@]}"} "${TORCHRUN_STOP_FLAGS[@]}" "$SCRIPT" --data_dir "$DATA" --snapshot_path "$SNAPSHOT" "$@"
