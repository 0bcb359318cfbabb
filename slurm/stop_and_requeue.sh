# stop_and_requeue.sh: sourced by slurm/multi_gpu.sh, multi_node.sh and
# multi_node_srun.sh (not run on its own). What the batch shell does so that
# every way Slurm stops a job ends with a snapshot and, where the job should run
# again, a requeue: the time-limit warning (SIGUSR1 here) is relayed to the
# training step, and after the step stopped the job is requeued; a preemption
# (SIGTERM to the step only) is seen as PreemptTime and requeued too, since a
# batch script that just ended during the grace time would end the job for good;
# on scontrol requeue and scancel (SIGTERM here too) Slurm decides. The table,
# and what must fit before the SIGKILL: docs/slurm.md.

# The signal this shell got: USR1 or TERM; empty while none came.
STOP_SIGNAL=""
# The training step (srun, or torchrun), once started.
STEP_PID=""

on_stop_signal() {
    # Once: a second relay could cut the orderly stop short.
    [ -n "$STOP_SIGNAL" ] && return
    STOP_SIGNAL=$1
    echo "$(date -Is) batch shell got SIG$1: every rank stops after its current step and saves a snapshot"
    # SIGTERM reaches every process of the job from Slurm itself; the warning
    # reaches this shell only, and goes on to the step from here.
    if [ "$1" = USR1 ] && [ -n "$STEP_PID" ]; then kill -USR1 "$STEP_PID" 2>/dev/null || true; fi
}
# Trapped before anything else: the warning may come during set-up.
trap 'on_stop_signal USR1' USR1
trap 'on_stop_signal TERM' TERM

# require_torchrun [container command...]: one line and exit 2 when the torchrun
# there is missing or lacks the two flags the wrappers use.
require_torchrun() {
    local help
    if ! help="$("$@" torchrun --help 2>&1)"; then
        echo "error: no working torchrun${1:+ in the container}; activate the environment in the wrapper's environment block (${help##*$'\n'})" >&2
        exit 2
    fi
    for flag in --signals-to-handle --shutdown-timeout; do
        if [[ "$help" != *"$flag"* && "$help" != *"${flag//-/_}"* ]]; then
            echo "error: this torchrun has no $flag, which the stop on a time-limit warning or a preemption needs (torch 2.12 or newer; docs/install.md)" >&2
            exit 2
        fi
    done
}

# run_step COMMAND...: start the training step in the background, wait until
# it has really ended, then requeue the job if it was warned or preempted.
# Exits the batch shell.
run_step() {
    "$@" &
    STEP_PID=$!
    # A warning during set-up, before there was a step to relay it to:
    if [ "$STOP_SIGNAL" = USR1 ]; then kill -USR1 "$STEP_PID" 2>/dev/null || true; fi
    # In the background + wait: bash runs a trap only between commands, so
    # while a foreground step ran the warning would wait until it ended. A trap
    # cuts `wait` short, hence the loop until the step has really exited.
    local status=0
    while :; do
        wait "$STEP_PID" && status=0 || status=$?
        kill -0 "$STEP_PID" 2>/dev/null || break
    done
    # An array task is requeued as itself: <array job id>_<task index>.
    local job="${SLURM_ARRAY_JOB_ID:+${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}}"
    job="${job:-$SLURM_JOB_ID}"
    # Picked for preemption: PreemptTime is set (None otherwise).
    local preempted
    preempted="$(scontrol show job "$SLURM_JOB_ID" | sed -n 's/.*PreemptTime=\([^ ]*\).*/\1/p' || true)"
    [ "$preempted" = None ] && preempted=""
    if [ "$STOP_SIGNAL" = USR1 ] || [ -n "$preempted" ]; then
        echo "$(date -Is) training stopped (status $status); requeueing job $job${preempted:+ (preempted at $preempted)}"
        scontrol requeue "$job"
        exit 0
    fi
    if [ "$STOP_SIGNAL" = TERM ]; then
        echo "$(date -Is) training stopped (status $status) by SIGTERM (scancel, scontrol requeue or the time limit): Slurm decides whether the job runs again"
    else
        echo "$(date -Is) done (status $status)"
    fi
    exit "$status"
}
