#!/bin/bash
# multi_node_srun.sh: train.py (the kit) on SEVERAL nodes the way many cluster
# guides launch it: srun starts one task per GPU, no torchrun; each takes its
# rank from Slurm and meets the others on the job's first node, at a port
# derived from the job id. Snapshots and requeues on preemption and before the
# time limit, like multi_node.sh. Submit from the project folder (on storage
# every node sees); arguments after the name go to train.py:
#     sbatch --nodes=4 slurm/multi_node_srun.sh --dataset cifar10 --total_epochs 30
# Watch: squeue --me; tail -f multi_node_srun-<job id>.out. scancel stops it with
# a snapshot; the same sbatch command resumes. Edit: the #SBATCH lines (tasks per
# node = GPUs per node); the environment and network blocks in slurm/env.sh.
# SCRIPT_NAME: only a script that reads srun's variables (the rungs need torchrun).

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

# sbatch runs a copy of this file from a spool folder: the project is the submission folder.
PROJECT="${PROJECT_DIR:-${SLURM_SUBMIT_DIR:-$PWD}}"
[ -f "$PROJECT/slurm/env.sh" ] || { echo "error: $PROJECT/slurm/env.sh not found; run sbatch slurm/multi_node_srun.sh" \
    "from the project folder, or set PROJECT_DIR" >&2; exit 2; }
# slurm/env.sh, what every wrapper shares: the sbatch-only check, the stop traps first (a
# signal may come during set-up), the blocks to edit (environment, network, container).
source "$PROJECT/slurm/env.sh"
require_launcher python

# This submission's snapshot (the run's identity in its name), claimed for this job:
# the same command resumes it; another live job holding it is refused.
snapshot_for "$@"
echo "job $SLURM_JOB_ID | restart ${SLURM_RESTART_COUNT:-0} | $SLURM_JOB_NUM_NODES nodes ($SLURM_JOB_NODELIST) x ${SLURM_NTASKS_PER_NODE:-?} tasks | $SNAPSHOT | $(date -Is)"

# The training step: srun starts one rank per task, each in its own container
# when there is one; one rank failing ends every rank (--kill-on-bad-exit).
# Each rank finds the rendezvous itself (the job's first node; the port from
# the job id, as slurm/env.sh's rendezvous_port), unless MASTER_ADDR and
# MASTER_PORT are set. Defaults first: the same flag in "$@" overrides them.
run_step srun --kill-on-bad-exit=1 --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}" ${SRUN_CONTAINER[@]+"${SRUN_CONTAINER[@]}"} \
    ${STEP_CONTAINER[@]+"${STEP_CONTAINER[@]}"} \
    python "$SCRIPT" --data_dir "$DATA" --snapshot_path "$SNAPSHOT" "$@"
