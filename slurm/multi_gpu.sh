#!/bin/bash
# multi_gpu.sh: multigpu_torchrun.py on ONE node, one process per GPU that
# Slurm gives the job, under torchrun; preemption-safe (snapshot + requeue).
#
# Submit from the project folder; arguments after the script name reach the
# training script:
#     sbatch slurm/multi_gpu.sh
#     sbatch slurm/multi_gpu.sh --dataset mnist --total_epochs 5
#     sbatch --gres=gpu:2 --time=01:00:00 slurm/multi_gpu.sh      # override any #SBATCH line
# Edit: the #SBATCH lines for your cluster (partition, GPUs, time), and the
# environment block below. Output: multi_gpu-<job id>.out in the folder you
# submitted from; the snapshot: snapshot-<job id>.pt there.
#
# Preemption and time limit: 90 s before the end, Slurm sends SIGUSR1 to this
# batch shell only (the B: in --signal). The shell relays it to torchrun, which
# relays it to every worker (--signals-to-handle below); each worker finishes
# its current step, all agree on the same step, rank 0 saves the snapshot, and
# the shell requeues the job, which resumes from that snapshot.
# Why B:, and not the signal to every process of the job: without B: Slurm
# signals only job *steps* (srun), and torchrun started by this shell is not
# one, so nobody would be warned. Why --signals-to-handle: torchrun's agent
# relays only SIGTERM, SIGINT, SIGHUP and SIGQUIT by default; any other signal
# kills it outright. And the torchrun detail that bounds the time: after
# relaying a signal, torchrun kills workers still running 30 s later, so a
# step plus a snapshot save must fit in 30 s (and in the 90 s warning).

#SBATCH --job-name=multi_gpu        # the name in squeue, and %x in the log file name
#SBATCH --nodes=1                  # one machine; slurm/multi_node.sh for more
#SBATCH --ntasks-per-node=1        # one task: the torchrun agent, which starts one worker per GPU
#SBATCH --gres=gpu:4               # GPUs on that node; the worker count follows whatever is granted
#SBATCH --cpus-per-task=16         # CPU cores for all workers (data loading, --num_workers)
#SBATCH --mem=64G                  # host memory for the whole node's job
#SBATCH --time=02:00:00            # wall-clock limit; the warning signal comes 90 s before it
#SBATCH --output=%x-%j.out         # %x = job name, %j = job id; stdout and stderr together
#SBATCH --open-mode=append         # a requeued job appends to its log instead of truncating it
#SBATCH --requeue                  # allow `scontrol requeue` (and requeue on preemption)
#SBATCH --signal=B:USR1@90         # SIGUSR1 to the batch shell only, 90 s before the time limit

set -euo pipefail

if [ -z "${SLURM_JOB_ID:-}" ]; then
    echo "error: this is a Slurm batch script; submit it with: sbatch slurm/multi_gpu.sh [training args]" >&2
    exit 2
fi

# The warning signal may come at any time, even during set-up: trap it first.
WARNED=0
TRAIN_PID=""
warn_and_stop() {
    # Once: a second relay would cut torchrun's orderly shutdown short.
    [ "$WARNED" = 1 ] && return
    WARNED=1
    echo "$(date -Is) got the warning signal: asking every rank to snapshot and stop"
    if [ -n "$TRAIN_PID" ]; then kill -USR1 "$TRAIN_PID" 2>/dev/null || true; fi
}
trap warn_and_stop USR1

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
SCRIPT="${PROJECT_DIR:-$SLURM_SUBMIT_DIR}/multigpu_torchrun.py"
if [ ! -f "$SCRIPT" ]; then
    echo "error: $SCRIPT not found; submit from the project folder (cd ddp-scripts && sbatch slurm/multi_gpu.sh) or set PROJECT_DIR" >&2
    exit 2
fi

# ---- Container (optional) ---------------------------------------------------
# CONTAINER_IMAGE=/path/ddp-scripts.sif sbatch slurm/multi_gpu.sh ...: torchrun
# runs inside the image (docs/containers.md), with the submission and project
# folders, $DATA_DIR and $CONTAINER_BINDS (comma-separated) bound at the same
# paths. CONTAINER_RUN replaces the command before the image (split at
# spaces; e.g. a podman run ... line). scontrol (requeue) stays here in the
# batch shell, outside the container: images rarely have Slurm's commands.
CONTAINER=()
if [ -n "${CONTAINER_IMAGE:-}" ]; then
    BINDS="$SLURM_SUBMIT_DIR,${PROJECT_DIR:-$SLURM_SUBMIT_DIR}${DATA_DIR:+,$DATA_DIR}${CONTAINER_BINDS:+,$CONTAINER_BINDS}"
    # shellcheck disable=SC2206  # word splitting of CONTAINER_RUN is the point
    CONTAINER=(${CONTAINER_RUN:-apptainer exec --nv --bind $BINDS} "$CONTAINER_IMAGE")
fi
# Below, ${CONTAINER[@]+"${CONTAINER[@]}"} is that command, or nothing at all
# without a container (also under set -u in bash before 4.4).

# One worker per GPU granted on this node; on a node without GPUs, one CPU worker.
NPROC_PER_NODE="${SLURM_GPUS_ON_NODE:-1}"

echo "job $SLURM_JOB_ID on $(hostname) | restart ${SLURM_RESTART_COUNT:-0} | $NPROC_PER_NODE processes | $(date -Is)"


# --standalone: a rendezvous on localhost at a port the OS picks, so two jobs
# on one node never collide (no MASTER_PORT to set on one node).
# Defaults first, so that the same flag in "$@" overrides them.
${CONTAINER[@]+"${CONTAINER[@]}"} torchrun --standalone --nproc_per_node="$NPROC_PER_NODE" \
    --signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 \
    "$SCRIPT" --snapshot_path "snapshot-$SLURM_JOB_ID.pt" "$@" &
TRAIN_PID=$!
# A warning during set-up, before there was anything to relay it to:
if [ "$WARNED" = 1 ]; then kill -USR1 "$TRAIN_PID" 2>/dev/null || true; fi
# In the background + wait: bash runs a trap only between commands, so while a
# foreground torchrun ran, the warning would wait until it ended. A trap cuts
# `wait` short, hence the loop until torchrun has really exited.
STATUS=0
while :; do
    wait "$TRAIN_PID" && STATUS=0 || STATUS=$?
    kill -0 "$TRAIN_PID" 2>/dev/null || break
done

if [ "$WARNED" = 1 ]; then
    echo "$(date -Is) training stopped (status $STATUS); requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID"
    exit 0
fi
echo "$(date -Is) done (status $STATUS)"
exit "$STATUS"
