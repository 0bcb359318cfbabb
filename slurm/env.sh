# env.sh: sourced by every wrapper in slurm/ (single_gpu.sh, multi_gpu.sh,
# multi_node.sh, multi_node_srun.sh), its one source line; not run on its
# own. The one file to edit for your cluster: the environment block (where
# python and torch come from), the network block (nodes with several
# networks), the container block's variables (an image for apptainer, or for
# srun's pyxis). In this order: the check that
# the wrapper runs under sbatch, the stop handling (its traps before anything
# slow), those blocks, then what every wrapper needs from them: the script it
# runs (SCRIPT), the multi-node jobs' data folder (DATA), the rendezvous port
# (rendezvous_port) and the check that python or torchrun works
# (require_launcher). Expects PROJECT, the project folder, from the wrapper.

# Run by hand (bash slurm/multi_gpu.sh), a wrapper has no job: say how to
# submit it, by its own name (under sbatch it runs as a spool copy instead).
if [ -z "${SLURM_JOB_ID:-}" ]; then
    wrapper="${BASH_SOURCE[1]:-$0}"
    echo "error: this is a Slurm batch script; submit it with: sbatch slurm/${wrapper##*/} [training args]" >&2
    exit 2
fi
# The stop signals' traps first (the warning may come during set-up), then
# snapshot_for and run_step: slurm/stop_and_requeue.sh.
source "$PROJECT/slurm/stop_and_requeue.sh"

# --- environment (edit for your cluster) ---
set +u  # activation scripts (conda, some module systems) read unset variables
# Default: the project's .venv (README set-up) or VENV_DIR's, where it exists and
# no CONTAINER_IMAGE is set. A line below this one takes over from it:
VENV="${VENV_DIR:-$SLURM_SUBMIT_DIR/.venv}"
if [ -z "${CONTAINER_IMAGE:-}${PYXIS_IMAGE:-}" ] && [ -f "$VENV/bin/activate" ]; then source "$VENV/bin/activate"; fi
# module load cuda/12.4 python/3.11                       # a module system, or
# eval "$(conda shell.bash hook)" && conda activate ddp   # conda, or
# CONTAINER_IMAGE=image.sif: a container instead (the container block below)
set -u
# --- end environment ---

# --- network (multi-node jobs) ---
# Nodes with several networks: the one the nodes reach each other on. gloo
# needs it even in NCCL jobs (the stop signal's CPU group); `ip -brief addr`.
# export NCCL_SOCKET_IFNAME=ib0 GLOO_SOCKET_IFNAME=eth0
# --- end network ---

# --- container ---
# CONTAINER_IMAGE=image.sif: the training command runs in the image (docs/containers.md);
# CONTAINER_RUN replaces the command before the image (split at spaces);
# CONTAINER_BINDS: more folders to bind (comma-separated), beside the project,
# the submission folder and DATA_DIR.
# PYXIS_IMAGE=nvcr.io#nvidia/pytorch:25.01-py3 (or a .sqsh file): instead, srun's own
# --container-image (pyxis and enroot, on most NVIDIA clusters), the same folders
# mounted; the batch shell's own python calls run there too, each a one-task step.
CONTAINER=()       # runs a command of the batch shell in the container
SRUN_CONTAINER=()  # the training step's srun options for it (pyxis)
STEP_CONTAINER=()  # the command the training command runs under in the step (apptainer)
BINDS="$SLURM_SUBMIT_DIR,$PROJECT${DATA_DIR:+,$DATA_DIR}${CONTAINER_BINDS:+,$CONTAINER_BINDS}"
if [ -n "${PYXIS_IMAGE:-}" ]; then
    # pyxis mounts SRC:DST; the job's environment reaches the container as it is.
    SRUN_CONTAINER=(--container-image="$PYXIS_IMAGE" --container-name="ddp-$SLURM_JOB_ID"
                    --container-mounts="$(sed -E 's/([^,]+)/\1:\1/g' <<< "$BINDS")" --container-workdir="$PWD")
    CONTAINER=(srun --ntasks=1 --nodes=1 "${SRUN_CONTAINER[@]}")
elif [ -n "${CONTAINER_IMAGE:-}" ]; then
    # The job's id reaches train.py in the container, which claims the snapshot
    # for this job (docs/slurm.md): apptainer passes the environment anyway,
    # podman and docker only what --env names.
    JOB_ENV=(--env "SLURM_JOB_ID=$SLURM_JOB_ID")
    if [ -n "${SLURM_ARRAY_JOB_ID:-}" ]; then
        JOB_ENV+=(--env "SLURM_ARRAY_JOB_ID=$SLURM_ARRAY_JOB_ID" --env "SLURM_ARRAY_TASK_ID=$SLURM_ARRAY_TASK_ID")
    fi
    # shellcheck disable=SC2206  # word splitting of CONTAINER_RUN is the point
    CONTAINER=(${CONTAINER_RUN:-apptainer exec --nv --bind $BINDS} "${JOB_ENV[@]}" "$CONTAINER_IMAGE")
    STEP_CONTAINER=("${CONTAINER[@]}")
fi
# ${CONTAINER[@]+"${CONTAINER[@]}"}: that command, or nothing (also under set -u in bash < 4.4).
# --- end container ---

# The training script: train.py, the kit. SCRIPT_NAME=multinode.py (say) runs
# another script of the project folder instead, one of the ladder's rungs: it
# gets the same arguments, but has no stop handling of its own (docs/slurm.md).
SCRIPT="$PROJECT/${SCRIPT_NAME:-train.py}"
if [ ! -f "$SCRIPT" ]; then
    echo "error: $SCRIPT not found; SCRIPT_NAME names a script in the project folder ($PROJECT)" >&2
    exit 2
fi

# Multi-node jobs' data: node-local (each node's local rank 0 downloads a
# copy), unless DATA_DIR names a pre-staged folder.
DATA="${DATA_DIR:-${SLURM_TMPDIR:-/tmp/${USER:-$(id -un)}/ddp-data}}"

# rendezvous_port: prints the port the ranks of this job meet at on its first
# node. The formula lives once, in train_utils/distributed/rendezvous.py (run as a
# file: no torch import), which the srun ranks use too; run after require_launcher.
rendezvous_port() {
    ${CONTAINER[@]+"${CONTAINER[@]}"} python "$PROJECT/train_utils/distributed/rendezvous.py" "$SLURM_JOB_ID"
}

# require_launcher python|torchrun: one line and exit 2 when that command,
# in the container if there is one, is missing; torchrun's torch must also be
# 2.12 or newer, the first whose torchrun has both flags the stop on a
# time-limit warning or a preemption needs (--signals-to-handle came in 2.10,
# --shutdown-timeout in 2.12; docs/install.md). The version is read from the
# environment's package metadata, without importing torch (`torchrun --help`
# would: seconds of CPU at every start of the job).
require_launcher() {
    local found where="${CONTAINER_IMAGE:+ in the container}"
    if [ "$1" = python ]; then
        if ! ${CONTAINER[@]+"${CONTAINER[@]}"} python -c '' 2>/dev/null; then
            echo "error: no working python$where; activate the environment in the environment block of slurm/env.sh" >&2
            exit 2
        fi
        return
    fi
    # One python start (one container start): "major minor version", or why not.
    if ! found="$(${CONTAINER[@]+"${CONTAINER[@]}"} python -c '
import re, shutil, sys
from importlib.metadata import PackageNotFoundError, version
if shutil.which("torchrun") is None:
    sys.exit("torchrun: command not found")
try:
    torch = version("torch")
except PackageNotFoundError:
    sys.exit("torchrun found, but no torch package beside python")
print(*re.match(r"(\d+)\.(\d+)", torch).groups(), torch)' 2>&1)"; then
        echo "error: no working torchrun$where; activate the environment in the environment block of slurm/env.sh (${found##*$'\n'})" >&2
        exit 2
    fi
    read -r major minor version <<<"$found"
    if [ "$major" -lt 2 ] || { [ "$major" -eq 2 ] && [ "$minor" -lt 12 ]; }; then
        local flag=--shutdown-timeout
        [ "$major" -eq 2 ] && [ "$minor" -ge 10 ] || flag=--signals-to-handle
        echo "error: this torchrun (torch $version) has no $flag, which the stop on a time-limit warning or a preemption needs (torch 2.12 or newer; docs/install.md)" >&2
        exit 2
    fi
}
