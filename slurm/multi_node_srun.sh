#!/bin/bash
# multi_node_srun.sh: multinode.py on SEVERAL nodes the way many cluster guides
# launch it: srun starts one task per GPU, no torchrun; each takes its rank from
# Slurm and meets the others on the job's first node. Snapshots and requeues on
# preemption and before the time limit, like multi_node.sh.
# Submit from the project folder (on storage every node sees); arguments after
# the name go to the script:
#     sbatch --nodes=4 slurm/multi_node_srun.sh --dataset cifar10 --total_epochs 30
# Watch: squeue --me; tail -f multi_node_srun-<job id>.out. scancel stops it with
# a snapshot; the same sbatch command resumes. Edit: the #SBATCH lines (tasks per
# node = GPUs per node), the environment and network blocks. Against torchrun,
# data, snapshot and each way Slurm stops a job: docs/slurm.md.

#SBATCH --job-name=multi_node_srun  # the name in squeue, %x in the log file name, and the snapshot's name
#SBATCH --nodes=2                  # machines
#SBATCH --ntasks-per-node=4        # one task (one rank) per GPU
#SBATCH --gres=gpu:4               # GPUs per node: as many as tasks per node
#SBATCH --cpus-per-task=4          # CPU cores per rank (data loading, --num_workers)
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
    echo "error: this is a Slurm batch script; submit it with: sbatch slurm/multi_node_srun.sh [training args]" >&2
    exit 2
fi
# sbatch runs a copy of this file from a spool folder: the project is the submission folder.
PROJECT="${PROJECT_DIR:-$SLURM_SUBMIT_DIR}"
SCRIPT="$PROJECT/${SCRIPT_NAME:-multinode.py}"
if [ ! -f "$SCRIPT" ]; then
    echo "error: $SCRIPT not found; run sbatch slurm/multi_node_srun.sh from the project folder, or set PROJECT_DIR" >&2
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

# --- network (identical in every multi-node wrapper) ---
# Nodes with several networks: the one the nodes reach each other on. gloo
# needs it even in NCCL jobs (the stop signal's CPU group); `ip -brief addr`.
# export NCCL_SOCKET_IFNAME=ib0 GLOO_SOCKET_IFNAME=eth0
# --- end network ---

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

# The rendezvous: the job's first node, at a port derived from the job id
# (what each task would derive by itself; exported so the log shows it).
MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)"
MASTER_PORT=$((15000 + SLURM_JOB_ID % 15000))
export MASTER_ADDR MASTER_PORT
# This submission's snapshot (its arguments' hash in the name), claimed for this job:
# the same command resumes it; another live job holding it is refused.
snapshot_for "$@"
echo "job $SLURM_JOB_ID | restart ${SLURM_RESTART_COUNT:-0} | $SLURM_JOB_NUM_NODES nodes ($SLURM_JOB_NODELIST) x ${SLURM_NTASKS_PER_NODE:-?} tasks | rendezvous $MASTER_ADDR:$MASTER_PORT | $SNAPSHOT | $(date -Is)"

# Node-local data (each node's local rank 0 downloads a copy), unless DATA_DIR names one.
DATA="${DATA_DIR:-${SLURM_TMPDIR:-/tmp/${USER:-$(id -un)}/ddp-data}}"

# The training step: srun starts one rank per task, each in its own container
# when there is one; one rank failing ends every rank (--kill-on-bad-exit).
run_step srun --kill-on-bad-exit=1 --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}" ${CONTAINER[@]+"${CONTAINER[@]}"} \
    python "$SCRIPT" --data_dir "$DATA" \
    --snapshot_path "$SNAPSHOT" "$@"
