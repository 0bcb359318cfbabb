#!/bin/bash
# multi_node.sh: multinode.py on SEVERAL nodes: srun starts one torchrun agent
# per node, the agents meet at a c10d rendezvous on the job's first node, and
# each starts one worker per GPU Slurm gave the job on its node. Preemption-
# safe (snapshot + requeue), like slurm/multi_gpu.sh.
#
# Submit from the project folder; arguments after the script name reach the
# training script:
#     sbatch slurm/multi_node.sh
#     sbatch slurm/multi_node.sh --dataset cifar10 --total_epochs 30
#     sbatch --nodes=4 slurm/multi_node.sh         # the node count comes from the job
# Watch: squeue --me; tail -f multi_node-<job id>.out. Stop: scancel <job id>
# (the ranks save a snapshot first; the same sbatch command resumes from it).
# Edit: the #SBATCH lines for your cluster (partition, account, GPUs, time),
# and the environment block below (on nodes with several networks, name the
# one to use). The folder you submit from must be on storage every node sees:
# the snapshot is written there. Data: each node's local rank 0 downloads to
# node-local storage ($SLURM_TMPDIR where the cluster has it, else
# /tmp/$USER/ddp-data); set DATA_DIR to a pre-staged copy instead.
# Output: multi_node-<job id>.out (all nodes' output, one file); the snapshot:
# snapshot-<job name>.pt, so that the same command submitted again resumes;
# start afresh with another --job-name, or delete the snapshot.
#
# Stops, preemption, requeue: as in slurm/multi_gpu.sh (stop_and_requeue.sh,
# docs/slurm.md). The time-limit warning comes to this batch shell only (B:),
# which relays it to srun, which signals the tasks on every node; a
# preemption's SIGTERM goes to the srun step directly; torchrun relays either
# to its workers. All ranks stop after the same step, global rank 0 saves the
# snapshot, and the job is requeued where it should run again. torchrun kills
# workers still running 80 s after relaying a signal: a step plus the save
# must fit.

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

# sbatch runs a copy of this file from a spool folder, so the project is found
# from the submission folder, not from this file's location.
# SCRIPT_NAME=multinode_fsdp.py sbatch slurm/multi_node.sh: the FSDP rung instead (docs/fsdp.md).
PROJECT="${PROJECT_DIR:-$SLURM_SUBMIT_DIR}"
SCRIPT="$PROJECT/${SCRIPT_NAME:-multinode.py}"
if [ ! -f "$SCRIPT" ]; then
    echo "error: $SCRIPT not found; submit from the project folder (cd ddp-scripts && sbatch slurm/multi_node.sh) or set PROJECT_DIR" >&2
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
# Nodes with several networks: the one the nodes reach each other on. gloo
# needs it even in NCCL jobs (the stop signal's CPU group); `ip -brief addr`.
# export NCCL_SOCKET_IFNAME=ib0 GLOO_SOCKET_IFNAME=eth0
set -u
# ---------------------------------------------------------------------------

# ---- Container (optional) ---------------------------------------------------
# CONTAINER_IMAGE=/path/ddp-scripts.sif sbatch slurm/multi_node.sh ...: srun
# starts each node's torchrun inside the image (docs/containers.md), with the
# submission and project folders, $DATA_DIR and $CONTAINER_BINDS (comma-
# separated) bound at the same paths. CONTAINER_RUN replaces the command
# before the image (split at spaces; e.g. a podman run ... line). scontrol
# (rendezvous host, requeue) stays here in the batch shell, outside the
# container: images rarely have Slurm's commands, and without the first
# node's name each node would wait at a rendezvous of its own (a hang).
CONTAINER=()
if [ -n "${CONTAINER_IMAGE:-}" ]; then
    BINDS="$SLURM_SUBMIT_DIR,$PROJECT${DATA_DIR:+,$DATA_DIR}${CONTAINER_BINDS:+,$CONTAINER_BINDS}"
    # shellcheck disable=SC2206  # word splitting of CONTAINER_RUN is the point
    CONTAINER=(${CONTAINER_RUN:-apptainer exec --nv --bind $BINDS} "$CONTAINER_IMAGE")
fi
# Below, ${CONTAINER[@]+"${CONTAINER[@]}"} is that command, or nothing at all
# without a container (also under set -u in bash before 4.4).
require_torchrun ${CONTAINER[@]+"${CONTAINER[@]}"}

# Workers per node: the GPUs granted on this (the first) node, the same on
# every node with --gres; one CPU worker per node where there is no GPU.
NPROC_PER_NODE="${SLURM_GPUS_ON_NODE:-1}"
# The rendezvous host: the job's first node (this batch shell runs there).
# (sed, not head: head would stop reading, and under pipefail the SIGPIPE
# scontrol gets on a long node list would end the job.)
MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)"
# A port from the job id, never a literal: jobs sharing a node get different
# ports (unless their ids differ by a multiple of 15000), and a requeued job
# (same id) gets its own again. 15000-29999 lies below Linux's ephemeral range
# (32768-60999), so no outgoing connection already holds it.
MASTER_PORT=$((15000 + SLURM_JOB_ID % 15000))
export MASTER_ADDR MASTER_PORT

echo "job $SLURM_JOB_ID | restart ${SLURM_RESTART_COUNT:-0} | $SLURM_JOB_NUM_NODES nodes ($SLURM_JOB_NODELIST) x $NPROC_PER_NODE processes | rendezvous $MASTER_ADDR:$MASTER_PORT | $(date -Is)"


# Node-local data (every node's local rank 0 downloads its own copy), unless
# DATA_DIR names a pre-staged one.
DATA="${DATA_DIR:-${SLURM_TMPDIR:-/tmp/${USER:-$(id -un)}/ddp-data}}"

# --rdzv-id: the job id, so agents of different jobs never join each other.
# --kill-on-bad-exit: one node failing ends the step on all nodes.
# --cpus-per-task: srun of Slurm 22.05-23.02 does not inherit it from sbatch, and
# would confine each node's workers to one core where cores are bound to tasks.
# --signals-to-handle, --shutdown-timeout: as in slurm/multi_gpu.sh.
# Defaults first, so that the same flag in "$@" overrides them.
run_step srun --kill-on-bad-exit=1 --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}" ${CONTAINER[@]+"${CONTAINER[@]}"} torchrun \
    --nnodes="$SLURM_JOB_NUM_NODES" --nproc_per_node="$NPROC_PER_NODE" \
    --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$SLURM_JOB_ID" \
    --signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 --shutdown-timeout=80 \
    "$SCRIPT" --data_dir "$DATA" \
    --snapshot_path "snapshot-$SLURM_JOB_NAME${SLURM_ARRAY_TASK_ID:+-$SLURM_ARRAY_TASK_ID}.pt" "$@"
