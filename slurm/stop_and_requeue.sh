# stop_and_requeue.sh: sourced by slurm/env.sh, first thing in every wrapper
# (not run on its own; nothing to edit here). What the batch shell does so
# that every way Slurm stops a job ends with a snapshot and, where the job
# should run again, a requeue: the time-limit warning (SIGUSR1 here) is
# relayed to the training step, and after the step stopped the job is
# requeued; a preemption (SIGTERM to the step only) is seen as PreemptTime and
# requeued too, since a batch script that just ended during the grace time
# would end the job for good; on scontrol requeue and scancel (SIGTERM here
# too) Slurm decides. A run that already holds every epoch is never requeued.
# Also: the snapshot's name for a submission (tools/identity.py's), and the
# refusal to share it with another live job. The table, and what must fit before the SIGKILL:
# docs/slurm.md.

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

# torchrun's flags for the stop: it relays SIGUSR1 too (by default only
# SIGTERM, SIGINT, SIGHUP, SIGQUIT), and gives the workers 80 s to save before
# it kills them (its default is 30 s); the 90 s warning leaves 10 s to spare.
TORCHRUN_STOP_FLAGS=(--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 --shutdown-timeout=80)

# The training's rank 0 creates this file once the run holds every epoch
# (train_utils.report_run_finished): a warning or a preemption that came after
# the last epoch then ends the job instead of requeueing a run with nothing to
# train. In the job's working folder, which the ranks see as the snapshot's.
export TRAINING_FINISHED_FILE="$PWD/.finished-$SLURM_JOB_ID"

# snapshot_for ARGS...: sets SNAPSHOT, the --snapshot_path of this submission,
# relative to the working folder, as tools/identity.py names it (the one rule,
# which launchers/submitit_train.py follows too): snapshot-<job
# name>[-<array index>][-<8 hex digits>].pt, the digits the run's identity
# (the flags that say what the run learns, as train.py parses them, in one
# order; none when it has none; the rungs take the same flags); a
# --snapshot_path among them wins. With --strategy fsdp or hsdp a folder,
# without the .pt (sharded snapshots: one sub-folder per save). The same run
# submitted again (or requeued) gets the same name and resumes, whatever the
# order of its flags, and with a longer --total_epochs or --max_steps trains
# on; a sweep submitted from one folder (other --lr, say) gets one snapshot
# per point, never another's. A snapshot named by a hash of the arguments as
# typed is resumed where the identity's name has none yet, with a note. Then
# claims the snapshot for this job (<snapshot>.job holds the job id, read and
# written under flock) and exits 2 with one line when another job that is
# still queued or running holds it: two live jobs must never write one
# snapshot. A claim of a run started without Slurm (host and pid, no job)
# stays: train.py refuses it while that run lives. A snapshot in a bucket
# (--snapshot_path s3://...) has no claim file: train.py's lease in the bucket
# names the job, and refuses a run of another live job in one line.
snapshot_for() {
    local name="snapshot-$SLURM_JOB_NAME${SLURM_ARRAY_TASK_ID:+-$SLURM_ARRAY_TASK_ID}" found line
    # Its lines ("run identity ...", a note), then the snapshot's name; a flag train.py would refuse ends
    # the job here, with train.py's own line.
    found="$(${CONTAINER[@]+"${CONTAINER[@]}"} python "$PROJECT/tools/identity.py" --snapshot_for "$name" "$@")" \
        || exit 2
    SNAPSHOT="${found##*$'\n'}"  # its last line: a container's own words may come first
    while IFS= read -r line; do
        case "$line" in "run identity "*|"note: "*) echo "$line" ;; esac
    done <<< "$found"
    # A snapshot in a bucket (s3://...) is claimed by train.py itself, with a lease
    # in the bucket that names this job: no claim file in the working folder.
    [[ "$SNAPSHOT" == *://* ]] && return
    # The job as squeue and scontrol know it: an array task as <array job id>_<index>.
    local claim="$SNAPSHOT.job" job owner state lock
    job="${SLURM_ARRAY_JOB_ID:+${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}}"
    job="${job:-$SLURM_JOB_ID}"
    if ! { exec {lock}<>"$claim"; } 2>/dev/null; then
        echo "error: cannot write $PWD/$claim (the snapshot's claim): submit from a folder this job can write, or pass a writable --snapshot_path" >&2
        exit 2
    fi
    # Locked from reading the claim to writing it: two copies of one command
    # starting together would otherwise both find it free and both take it.
    if ! flock -w 60 "$lock" 2>/dev/null; then  # some Lustre mounts have no flock
        echo "warning: cannot lock $claim (flock); two copies of this command starting together could both take it" >&2
    fi
    owner="$(cat "$claim")"
    # train.py's run rewrites the claim as job=ID host=NAME pid=PID ...; one
    # started by hand (no job=) is left for the script to judge: it checks the pid.
    if [[ "$owner" == *=* ]]; then
        if [[ " $owner " =~ \ job=([^ ]+)\  ]]; then
            owner="${BASH_REMATCH[1]}"
        else
            exec {lock}>&-
            return
        fi
    fi
    if [ -n "$owner" ] && [ "$owner" != "$job" ]; then
        if ! state="$(squeue -h -j "$owner" -o %T 2>&1)"; then
            if [[ "$state" != *"Invalid job id"* ]]; then  # long gone is fine; not knowing is said
                echo "warning: cannot tell whether job $owner, which claimed $SNAPSHOT, still runs (squeue: ${state##*$'\n'}); going on" >&2
            fi
            state=""
        fi
        case "$state" in
            ""|COMPLETED|COMPLETING|CANCELLED|FAILED|TIMEOUT|NODE_FAIL|OUT_OF_MEMORY|PREEMPTED|BOOT_FAIL|DEADLINE) ;;
            *)  echo "error: snapshot $SNAPSHOT belongs to job $owner, which is $state: two live jobs must not share a snapshot; wait for job $owner to end (or scancel it), or submit with other arguments or --job-name" >&2
                exit 2 ;;
        esac
    fi
    echo "$job" > "$claim"
    exec {lock}>&-  # unlocked; the step does not inherit it
}

# run_step COMMAND...: start the training step in the background, wait until
# it has really ended, then requeue the job if it was warned or preempted
# (or, LOST_NODES_REQUEUE set, lost nodes before the training finished).
# Exits the batch shell.
run_step() {
    rm -f "$TRAINING_FINISHED_FILE"  # a requeued job's earlier run may have left one
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
    # Picked for preemption: PreemptTime is set (None otherwise). NumNodes:
    # fewer than the job started with after Slurm took failed nodes out of it.
    local record preempted nodes_left
    record="$(scontrol show job "$SLURM_JOB_ID" || true)"
    preempted="$(sed -n 's/.*PreemptTime=\([^ ]*\).*/\1/p' <<< "$record")"
    nodes_left="$(sed -n 's/.*NumNodes=\([0-9]*\).*/\1/p' <<< "$record")"
    [ "$preempted" = None ] && preempted=""
    # The training holds every epoch: the job is done, whatever came after it.
    if [ -e "$TRAINING_FINISHED_FILE" ]; then
        rm -f "$TRAINING_FINISHED_FILE"
        if [ -n "$STOP_SIGNAL$preempted" ]; then
            local late="SIG$STOP_SIGNAL"
            [ -n "$preempted" ] && late="the preemption"
            echo "$(date -Is) done: training holds every epoch (step status $status; $late came after the last epoch); not requeueing"
            exit 0
        fi
        echo "$(date -Is) done (status $status)"
        exit "$status"
    fi
    # A job that outlives a node's failure (sbatch --no-kill; LOST_NODES_REQUEUE
    # set by multi_node.sh) whose step ended unfinished after it lost nodes:
    # too few nodes left to go on (elastic), or the step died with the node.
    # Requeued, as Slurm requeues a job that a node failure ended.
    if [ -n "${LOST_NODES_REQUEUE:-}" ] && [ -z "$STOP_SIGNAL$preempted" ] && [ -n "$nodes_left" ] \
            && [ "$nodes_left" -lt "$SLURM_JOB_NUM_NODES" ]; then
        echo "$(date -Is) training stopped (status $status) with $nodes_left of the job's $SLURM_JOB_NUM_NODES nodes left; requeueing job $job"
        trap '' TERM
        scontrol requeue "$job"
        exit 0
    fi
    if [ "$STOP_SIGNAL" = USR1 ] || [ -n "$preempted" ]; then
        echo "$(date -Is) training stopped (status $status); requeueing job $job${preempted:+ (preempted at $preempted)}"
        # The requeue SIGTERMs this shell too; the step has ended, so there is
        # nothing left to stop, and the trap's line would only mislead.
        trap '' TERM
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
