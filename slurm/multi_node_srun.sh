#!/bin/bash
# multi_node_srun.sh: multinode.py on SEVERAL nodes, launched the way many
# cluster guides do it: srun starts one task per GPU, no torchrun. Each task
# takes its rank, local rank and world size from Slurm (SLURM_PROCID,
# SLURM_LOCALID, SLURM_NTASKS; train_utils.launcher_store), and meets the
# others on the job's first node. Survives preemption, requeue and the time
# limit like slurm/multi_node.sh.
#
# Submit from the project folder; arguments after the script name reach the
# training script:
#     sbatch slurm/multi_node_srun.sh
#     sbatch --nodes=4 slurm/multi_node_srun.sh --dataset cifar10 --total_epochs 30
# Watch: squeue --me; tail -f multi_node_srun-<job id>.out. Stop: scancel <job id>
# (the ranks save a snapshot first; the same sbatch command resumes from it).
# Edit: the #SBATCH lines for your cluster (partition, account, GPUs, time;
# --ntasks-per-node must equal the GPUs per node), and the environment block.
# The folder you submit from must be on storage every node sees. Data and
# snapshot: as in slurm/multi_node.sh.
#
# Against torchrun under srun (slurm/multi_node.sh): Slurm signals every task
# itself, so nothing needs relaying and nothing kills a rank 80 s into its
# save; but a crashed rank ends the job (no torchrun restarts), and GPUs are
# bound to tasks by --ntasks-per-node and --gres as the cluster sets them.
# Stops, preemption and requeue: slurm/stop_and_requeue.sh, docs/slurm.md.

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

# sbatch runs a copy of this file from a spool folder, so the project is found
# from the submission folder, not from this file's location.
PROJECT="${PROJECT_DIR:-$SLURM_SUBMIT_DIR}"
SCRIPT="$PROJECT/${SCRIPT_NAME:-multinode.py}"
if [ ! -f "$SCRIPT" ]; then
    echo "error: $SCRIPT not found; submit from the project folder (cd ddp-scripts && sbatch slurm/multi_node_srun.sh) or set PROJECT_DIR" >&2
    exit 2
fi
# Traps the stop signals first (they may come during set-up), then run_step below.
source "$PROJECT/slurm/stop_and_requeue.sh"

# ---- Environment: edit for your cluster ------------------------------------
set +u  # activation scripts (conda, some module systems) read unset variables
# Default: the project's virtual environment (README set-up) or the one VENV_DIR
# names, where it exists. A line below this one takes over from it:
VENV="${VENV_DIR:-$SLURM_SUBMIT_DIR/.venv}"
if [ -f "$VENV/bin/activate" ]; then source "$VENV/bin/activate"; fi
# module load cuda/12.4 python/3.11          # a module system, or
# eval "$(conda shell.bash hook)" && conda activate ddp   # conda
# Nodes with several networks: the one the nodes reach each other on. gloo
# needs it even in NCCL jobs (the stop signal's CPU group); `ip -brief addr`.
# export NCCL_SOCKET_IFNAME=ib0 GLOO_SOCKET_IFNAME=eth0
set -u
# ---------------------------------------------------------------------------
if ! command -v python >/dev/null; then
    echo "error: no python found; activate the environment in the wrapper's environment block" >&2
    exit 2
fi

# The rendezvous: the job's first node, at a port derived from the job id
# (what each task would derive by itself; exported so the log shows it).
MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)"
MASTER_PORT=$((15000 + SLURM_JOB_ID % 15000))
export MASTER_ADDR MASTER_PORT

echo "job $SLURM_JOB_ID | restart ${SLURM_RESTART_COUNT:-0} | $SLURM_JOB_NUM_NODES nodes ($SLURM_JOB_NODELIST) x ${SLURM_NTASKS_PER_NODE:-?} tasks | rendezvous $MASTER_ADDR:$MASTER_PORT | $(date -Is)"

DATA="${DATA_DIR:-${SLURM_TMPDIR:-/tmp/${USER:-$(id -un)}/ddp-data}}"

# One rank per task; --kill-on-bad-exit: one rank failing ends every rank.
# --cpus-per-task: srun of Slurm 22.05-23.02 does not inherit it from sbatch.
run_step srun --kill-on-bad-exit=1 --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}" \
    python "$SCRIPT" --data_dir "$DATA" \
    --snapshot_path "snapshot-$SLURM_JOB_NAME${SLURM_ARRAY_TASK_ID:+-$SLURM_ARRAY_TASK_ID}.pt" "$@"
