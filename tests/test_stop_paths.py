"""Every way a real Slurm cluster stops a job, driven by Slurm itself.

The session's test cluster (slurm_cluster.py) has preemption on: partitions
``stops`` (tier 1, GraceTime 300 s, seven hosts) and ``nograce`` (tier 1,
GraceTime 0, two hosts) under partition ``urgent`` (tier 10, all nine).
No signal is sent by hand:

- preemption: a high-priority ``sbatch -p urgent --exclusive`` job takes the
  nodes of a running ``multi_node.sh`` (2 hosts: a torchrun agent per host in
  the srun step, as ``multi_gpu.sh`` has one; 2 ranks a host under HSDP, one
  replica a host) and ``multi_node_srun.sh`` (2 hosts, a rank per task, no
  torchrun; its snapshot in a bucket only, each rank in a folder of its
  host's and run's own) job; Slurm sends the step SIGTERM;
  without a grace time, SIGTERM to everything and SIGKILL after KillWait
  (once with a save held past it); then, once no other job is being
  preempted, with ``SlurmctldParameters=preempt_send_user_signal`` (the job's
  ``--signal`` instead: SIGUSR1 to the batch shell);
- the time limit: the wrapper's own ``#SBATCH --signal=B:USR1@90`` warning,
  sent by Slurm's timer once the test has brought the job's limit near
  (``scontrol update TimeLimit``, while the ranks wait for it), on an array
  task (requeued as ``<id>_7``), and once with the warning after the last
  epoch;
- ``scontrol requeue`` (once while the ranks start), and ``scancel``;
- a sweep submitted from one folder, and the same command twice;
- a language model on nanoGPT's token files (``--dataset tokens``),
  evaluated every 20 steps, whose time-limit warning lands between two
  evaluations (``multi_node.sh`` on the two hosts of partition ``multi``).

Every job but the HSDP one runs train.py with 2 ranks, so one uninterrupted
run of it is the reference for all; the HSDP job's is a run of 4 ranks with
its mesh. ``--snapshot_every_steps`` is left unset, so only the
stop itself can write a mid-epoch snapshot. Every scenario runs side by side
with the others on its own nodes (one module fixture drives them all in
threads); each test then checks one: the job's end state, that each run
resumes exactly where the one before saved, that every epoch is summarised
once, and that the final weights equal those of an uninterrupted run,
bitwise. A fault injected from the test side (DDP_TEST_FAULT, with the job's
SCRIPT_NAME set to tests/train_with_fault.py: FAULTY_TRAIN_JOB_ENV) holds a
rank where a path needs it (in start-up, at step 30 until a stop signal
comes, after the last epoch, inside a save), so no path depends on when a
signal lands.
"""

from __future__ import annotations

import re
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

from dataset_files import build_token_files
from helpers import FAULTY_TRAIN_JOB_ENV, PODS, REPO, assert_bitwise, assert_goodput, assert_same_snapshot, \
    bucket_snapshot, epochs, evaluations, full_state, local_files, parse_test, script_env, snapshot_folder, \
    snapshot_keys, wrapper_snapshot
from slurm_cluster import KILL_WAIT_S
from train_utils.snapshots import bucket
from slurm_jobs import RESUME, SAVED, SCENARIO_TIMEOUT_S, STOP, Scenario, check_resumes_exactly, drive, \
    job_log, preempt, runs, scancel, scontrol_requeue, show, submit, warn_soon


# 3 epochs of 64 steps a rank. Every job that a trigger stops waits for it at
# step 30 (every rank, the injected fault; once both wait, the trigger comes),
# so the stop lands mid-training however fast the machine starts and trains.
EPOCHS = 3
SHORT = ["--total_epochs", str(EPOCHS), "--batch_size", "16"]
# The time-limit job's first run waits at step 30 (every rank, the injected
# fault) until the warning comes; once both wait, the test brings the time
# limit near (warn_soon) and Slurm's timer sends the warning within about a
# minute: it lands mid-training however fast the machine starts and trains,
# and the requeued run, not held, its limit given back, trains the rest.
HOLD_AT_STEP_30 = {"DDP_TEST_FAULT": "step:*:30:wait_signal_once", **FAULTY_TRAIN_JOB_ENV}
HELD_AT_STEP_30 = ("DDP_TEST_FAULT: wait_signal_once at step 30 on rank 0",
                   "DDP_TEST_FAULT: wait_signal_once at step 30 on rank 1")
# The bucket as the only durable store: the srun job's snapshot in a bucket of moto's S3
# server on the cluster's bridge (the bridge_s3_server fixture), each rank in a working
# folder of its host's and its run's own, <host>-run<restart count>, under the job's
# (tests/train_in_host_folder.py): no folder is shared, and the requeued run's are empty.
BUCKET, BUCKET_ROOT = "stops", "preempt-srun/snap.pt"
IN_BUCKET = ["--snapshot_path", f"s3://{BUCKET}/{BUCKET_ROOT}"]
IN_HOST_FOLDERS = {**HOLD_AT_STEP_30, "SCRIPT_NAME": "tests/train_in_host_folder.py"}
GPUS_2 = ["--gres=gpu:2"]
# What every scenario's final snapshot is compared with: train.py, 2 ranks, SHORT, never stopped.
REFERENCE = ("train.py", 2)
# HSDP on 2 hosts x 2 ranks (one replica a host: replicate 2 x shard 2), 28 steps an
# epoch, held at step 30 (epoch 2's 2nd) on all four; its reference: 4 ranks on one
# host, the same mesh.
HSDP = [*SHORT, "--strategy", "hsdp"]
HSDP_REFERENCE = ("train.py", 4, ("--shard_size", "2"))
HSDP_HELD_AT_STEP_30 = tuple(f"DDP_TEST_FAULT: wait_signal_once at step 30 on rank {rank}" for rank in range(4))
# The stop's save hangs (the injected fault, after the temporary file is written,
# before the rename), as a save too large for KillWait would: Slurm's SIGKILL
# must leave the snapshot before it whole.
SAVE_EVERY_EPOCH = [*SHORT, "--save_every", "1"]
HOLD_AT_STARTUP = {"DDP_TEST_FAULT": "startup:*:1:hang", **FAULTY_TRAIN_JOB_ENV}
AT_STARTUP = ("DDP_TEST_FAULT: hang at startup 1 on rank 0", "DDP_TEST_FAULT: hang at startup 1 on rank 1")
# A GPT on nanoGPT's token files (the first 20,000 characters of Tiny Shakespeare as
# shakespeare_char/prepare.py writes them, in each job's folder): 60 steps, evaluated
# after steps 20, 40 and 60; held at step 30, mid-interval, for the time-limit warning.
TOKEN_DATA = "tokens_data"
TOKENS = ["--dataset", "tokens", "--data_dir", TOKEN_DATA, "--n_layer", "1", "--n_head", "2", "--n_embd", "32",
          "--block_size", "16", "--dropout", "0.1", "--batch_size", "8", "--max_steps", "60", "--warmup_steps", "10",
          "--eval_every_steps", "20", "--eval_windows", "40", "--total_epochs", "1"]
# The same run submitted again once it has ended: its flags in another order and spelling, a
# longer --total_epochs and 20 more steps (the run's identity names the same snapshot: it trains
# on from step 60 to the new --max_steps, which sets the epochs when given).
TOKENS_AGAIN = ("--total_epochs", "2", "--eval_windows=40", "--eval_every_steps", "20", "--warmup_steps", "10",
                "--max_steps", "80", "--batch_size", "8", "--dropout", "0.10", "--block_size", "16",
                "--n_embd=32", "--n_head", "2", "--n_layer", "1", "--data_dir", f"./{TOKEN_DATA}",
                "--dataset", "tokens")
SCENARIOS = [
    Scenario("preempt-multi_node", "multi_node.sh", "ddp-stop[2-3]", ["--nodes=2", *GPUS_2], HSDP,
             preempt, HSDP_REFERENCE, env=dict(HOLD_AT_STEP_30), trigger_when=HSDP_HELD_AT_STEP_30),
    Scenario("preempt-srun", "multi_node_srun.sh", "ddp-stop[4-5]",
             ["--nodes=2", "--ntasks-per-node=1", "--gres=gpu:1"], [*SHORT, *IN_BUCKET], preempt, REFERENCE,
             env=dict(IN_HOST_FOLDERS), trigger_when=HELD_AT_STEP_30),
    Scenario("time-limit", "multi_gpu.sh", "ddp-stop6", [*GPUS_2, "--array=7"], SHORT, warn_soon,
             REFERENCE, env=dict(HOLD_AT_STEP_30), trigger_when=HELD_AT_STEP_30),
    Scenario("scontrol-requeue", "multi_gpu.sh", "ddp-stop6", GPUS_2, SHORT, scontrol_requeue,
             REFERENCE, env=dict(HOLD_AT_STEP_30), trigger_when=HELD_AT_STEP_30),
    Scenario("scancel", "multi_gpu.sh", "ddp-stop6", GPUS_2, SHORT, scancel, REFERENCE,
             resubmit=True, env=dict(HOLD_AT_STEP_30), trigger_when=HELD_AT_STEP_30),
    # scontrol requeue while every rank is still starting (held there by the injected fault)
    Scenario("startup-requeue", "multi_gpu.sh", "ddp-stop6", GPUS_2, SHORT, scontrol_requeue,
             REFERENCE, env=HOLD_AT_STARTUP, trigger_when=AT_STARTUP),
    # The time-limit warning after the last epoch: the run holds every epoch
    # (the injected fault holds rank 0 there until a stop signal comes, and the limit is
    # brought near then): not requeued.
    Scenario("finished-warned", "multi_gpu.sh", "ddp-stop9", GPUS_2, ["--total_epochs", "3"],
             warn_soon, REFERENCE, env={"DDP_TEST_FAULT": "finished:0:1:wait_signal", **FAULTY_TRAIN_JOB_ENV},
             trigger_when=("DDP_TEST_FAULT: wait_signal at finished 1 on rank 0",)),
    # Preemption without GraceTime: SIGTERM to everything at once, SIGKILL
    # after KillWait. Once with a stop that saves in time, once with a save
    # held past KillWait.
    Scenario("nograce", "multi_gpu.sh", "ddp-stop7", GPUS_2, SHORT, preempt, REFERENCE,
             partition="nograce", env=dict(HOLD_AT_STEP_30), trigger_when=HELD_AT_STEP_30),
    Scenario("nograce-killed-saving", "multi_gpu.sh", "ddp-stop8", GPUS_2, SAVE_EVERY_EPOCH, preempt,
             REFERENCE, partition="nograce", env={"DDP_TEST_FAULT": "save:0:3:hang", **FAULTY_TRAIN_JOB_ENV}),
    # Clusters that set preempt_send_user_signal send the job's --signal
    # (SIGUSR1 to the batch shell) at preemption instead of the first SIGTERM.
    # The setting is cluster-wide: the job waits at step 30 (the injected fault,
    # until a stop signal comes) for the other preemptions to be over, then it
    # is switched on (the gate) and the job preempted.
    Scenario("preempt-user-signal", "multi_gpu.sh", "ddp-stop1", GPUS_2, SHORT, preempt,
             REFERENCE, user_signal=True, env=dict(HOLD_AT_STEP_30), gate=threading.Event(),
             trigger_when=("DDP_TEST_FAULT: wait_signal_once at step 30 on rank 0",
                           "DDP_TEST_FAULT: wait_signal_once at step 30 on rank 1")),
    # nanoGPT's token files, 2 hosts (partition multi: no preemption there), the time limit mid-interval
    # launchers/submitit_train.py: a task per rank on two hosts, preempted (SIGTERM to the tasks), submitit's
    # requeue after the kit's snapshot; on preempt-srun's hosts once that job has ended
    Scenario("submitit", "launchers/submitit_train.py", "ddp-stop[4-5]",
             ["--nodes", "2", "--gpus_per_node", "1", "--script", "tests/train_with_fault.py"], SHORT, preempt,
             REFERENCE, env={"DDP_TEST_FAULT": "step:*:30:wait_signal_once"}, trigger_when=HELD_AT_STEP_30,
             after="preempt-srun"),
    # then submitted again with TOKENS_AGAIN
    Scenario("tokens-time-limit", "multi_node.sh", "ddp-node[1-2]", ["--nodes=2", "--gres=gpu:1"], TOKENS,
             warn_soon, REFERENCE, partition="multi", env=dict(HOLD_AT_STEP_30), trigger_when=HELD_AT_STEP_30,
             again=TOKENS_AGAIN),
]


# A sweep submitted from one folder, the way people submit one:
# `for lr in ...; do sbatch slurm/multi_gpu.sh ... --lr $lr; done`; then the
# first command once more while its job still runs. The injected fault holds the
# first job once it has trained every epoch until a stop signal comes, so
# that it is still running when the others start, however fast it trains.
SWEEP_NODE = "ddp-stop9"
SWEEP_HOLD = {"DDP_TEST_FAULT": "finished:0:1:wait_signal", **FAULTY_TRAIN_JOB_ENV}
SWEEP_SHORTER = ["--total_epochs", "2", "--batch_size", "16"]
SWEEP = [Scenario("sweep", "multi_gpu.sh", SWEEP_NODE, GPUS_2, SHORT, None, REFERENCE,
                  env=SWEEP_HOLD),
         Scenario("sweep", "multi_gpu.sh", SWEEP_NODE, GPUS_2, [*SWEEP_SHORTER, "--lr", "0.02"], None,
                  REFERENCE),
         Scenario("sweep", "multi_gpu.sh", SWEEP_NODE, GPUS_2, SHORT, None, REFERENCE,
                  env=SWEEP_HOLD)]


def _drive_sweep(cluster, folder: Path) -> None:
    """Submits the sweep's first point, then, once it trains, the second and
    the first again; waits for those two, then ends the first (held by the
    injected fault after its last epoch) with scancel."""
    first, second, again = SWEEP
    deadline = time.monotonic() + SCENARIO_TIMEOUT_S
    jobs = [submit(cluster, first, folder)]
    while f"epoch 2/{SHORT[1]}" not in job_log(folder, first, jobs[0]):
        assert time.monotonic() < deadline, f"never reached epoch 2:\n{job_log(folder, first, jobs[0])}"
        time.sleep(0.2)
    jobs += [submit(cluster, second, folder), submit(cluster, again, folder)]
    for scenario, job in zip(SWEEP[1:], jobs[1:]):
        scenario.infos.append(cluster.wait(job, max(deadline - time.monotonic(), 1)))
        scenario.logs.append(job_log(folder, scenario, job))
    while "DDP_TEST_FAULT: wait_signal at finished 1" not in job_log(folder, first, jobs[0]):
        assert time.monotonic() < deadline, f"never finished:\n{job_log(folder, first, jobs[0])}"
        time.sleep(0.2)
    scancel(cluster, jobs[0], SWEEP_NODE)
    first.infos.append(cluster.wait(jobs[0], max(deadline - time.monotonic(), 1)))
    first.logs.append(job_log(folder, first, jobs[0]))


def _reference(script: str, nproc: int, args: list, folder: Path) -> Path:
    """The snapshot of ``script`` run uninterrupted in ``folder`` (made, if
    missing) with ``args``, its ranks started as pods; its stdout in folder/stdout.txt."""
    folder.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(PODS + [f"--nproc_per_node={nproc}", str(REPO / script), *args],
                            cwd=folder, env=script_env(), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    (folder / "stdout.txt").write_text(result.stdout)
    if "hsdp" in args:  # the script's default --snapshot_path: a folder of sharded snapshots
        return folder / f"snapshot_{script[:-3]}_fsdp"
    return folder / f"snapshot_{script[:-3]}.pt"


def reference_key(scenario) -> tuple:
    """The key of the scenario's uninterrupted run among the fixture's references (where the
    snapshot goes is no part of it)."""
    args = list(scenario.args)
    if "--snapshot_path" in args:
        del args[args.index("--snapshot_path"):args.index("--snapshot_path") + 2]
    return (*scenario.reference, tuple(args))


def assert_same_training(scenario, folder: Path, reference: Path, scratch: Path, array_index=None,
                         server=None) -> None:
    """The final snapshot the scenario's job left in ``folder`` (or, with
    IN_BUCKET, in the bucket of ``server``) holds the training of its
    uninterrupted ``reference``, bitwise: a file's weights, optimizer,
    schedule and loss scale (assert_same_snapshot); a sharded snapshot
    folder's the same, gathered (in ``scratch``), and each rank's RNG."""
    if IN_BUCKET[1] in scenario.args:  # DDP: the bucket's object, downloaded
        assert_same_snapshot(bucket_snapshot(server, BUCKET, BUCKET_ROOT, scratch), reference)
        return
    snapshot = folder / wrapper_snapshot(scenario.name, scenario.args, array_index)
    if "hsdp" not in scenario.args:
        assert_same_snapshot(snapshot, reference)
        return
    ours = full_state(snapshot_folder(snapshot.with_suffix("")), scratch / "job")[1]
    assert_bitwise(ours, full_state(snapshot_folder(reference), scratch / "reference")[1])


def _wait_until(condition, timeout_s: float = SCENARIO_TIMEOUT_S + 60) -> None:
    """Poll ``condition()`` until true; past ``timeout_s`` go on (each
    scenario's own deadline reports what went wrong)."""
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.5)


@pytest.fixture(scope="module")
def stopped(slurm_cluster, bridge_s3_server, tmp_path_factory):
    """Runs every scenario side by side (one thread each) and the uninterrupted
    reference run beside them; returns
    ({name: (scenario, its folder)}, {(script, processes, args): snapshot})."""
    root = tmp_path_factory.mktemp("stops")
    threads, folders = [], {}
    bridge_s3_server.create_bucket(BUCKET)
    for scenario in SCENARIOS:
        folders[scenario.name] = folder = root / scenario.name
        folder.mkdir()
        if IN_BUCKET[1] in scenario.args:  # the store's endpoint and credentials, as AWS variables
            scenario.env.update(bridge_s3_server.env())
        if TOKEN_DATA in scenario.args:
            build_token_files(folder / TOKEN_DATA, chars=20000)

        def target(scenario=scenario, folder=folder):
            try:
                if scenario.after:  # its nodes are that scenario's until its job has ended
                    next(t for t in threads if t.name == scenario.after).join(SCENARIO_TIMEOUT_S + 60)
                drive(slurm_cluster, scenario, folder)
            except BaseException as exc:  # noqa: BLE001 - reported by the scenario's test
                scenario.error = f"{type(exc).__name__}: {exc}"

        threads.append(threading.Thread(target=target, daemon=True, name=scenario.name))
    folders["sweep"] = root / "sweep"
    folders["sweep"].mkdir()

    def sweep_target():
        try:
            _drive_sweep(slurm_cluster, folders["sweep"])
        except BaseException as exc:  # noqa: BLE001 - reported by the sweep's test
            SWEEP[0].error = f"{type(exc).__name__}: {exc}"

    sweep_thread = threading.Thread(target=sweep_target, daemon=True, name="sweep")
    sweep_thread.start()
    started = time.monotonic()
    for thread in threads:
        thread.start()
    # The one uninterrupted run the checks compare with (saving more often, or
    # fewer epochs, have no reference of their own: no test compares them)
    references = {(*REFERENCE, tuple(SHORT)): _reference(*REFERENCE, SHORT, root / "reference")}
    script, nproc, flags = HSDP_REFERENCE
    references[(*HSDP_REFERENCE, tuple(HSDP))] = _reference(script, nproc, [*HSDP, *flags], root / "reference-hsdp")

    def preempted(scenario, thread) -> bool:  # or never will be
        return scenario.signal_to_exit_s is not None or bool(scenario.error) or not thread.is_alive()

    # The cluster-wide setting, once no other job is being preempted: switched
    # on until the user-signal job's preemption is over, then off again; the
    # jobs of the other paths go on meanwhile.
    others = [(s, thread) for s, thread in zip(SCENARIOS, threads) if s.trigger is preempt and not s.user_signal]
    users = [(s, thread) for s, thread in zip(SCENARIOS, threads) if s.user_signal]
    _wait_until(lambda: all(preempted(s, thread) for s, thread in others))
    config = slurm_cluster.conf.read_text()
    slurm_cluster.conf.write_text(config + "SlurmctldParameters=preempt_send_user_signal\n")
    subprocess.run(["scontrol", "reconfigure"], env=slurm_cluster.env, check=True)
    try:
        for scenario, _ in users:
            scenario.gate.set()
        _wait_until(lambda: all(preempted(s, thread) for s, thread in users))
    finally:
        slurm_cluster.conf.write_text(config)
        subprocess.run(["scontrol", "reconfigure"], env=slurm_cluster.env, check=True)
    # The token files' uninterrupted run, while the last scenarios end: made above, it
    # would hold back the user-signal job's gate, which this thread opens after them.
    build_token_files(root / "reference-tokens" / TOKEN_DATA, chars=20000)
    references[(*REFERENCE, tuple(TOKENS))] = _reference(*REFERENCE, TOKENS, root / "reference-tokens")
    for thread in [*threads, sweep_thread]:
        thread.join(SCENARIO_TIMEOUT_S + 60)
    print(f"\nstop paths: every scenario ended after {time.monotonic() - started:.0f} s")
    return {s.name: s for s in SCENARIOS}, folders, references


@pytest.mark.parametrize("name", [s.name for s in SCENARIOS if s.trigger is preempt and s.partition == "stops"
                                  and s.wrapper.endswith(".sh")])
def test_preempted_job_snapshots_is_requeued_and_resumes(stopped, name, tmp_path, bridge_s3_server, store_env):
    """A job of 2 hosts preempted while every rank waits at step 30: Slurm's
    SIGTERM stops every rank after one step, rank 0 saves, the batch shell
    requeues the job, the next run resumes there, and the job ends bitwise
    equal to an uninterrupted run. The srun job (a rank per task) keeps its
    snapshot in a bucket only: each rank works in a folder of its host's and
    its run's own, the requeued run's empty, so it can resume from the
    bucket alone, and no folder, the job's included, ever holds a snapshot,
    a claim or a goodput ledger; the bucket ends with one generation, no
    lease, and the goodput ledger and timeline beside the snapshot. The HSDP
    job (a torchrun agent a host) keeps a local one, with its goodput ledger
    beside it."""
    scenarios, folders, references = stopped
    scenario = scenarios[name]
    assert not scenario.error, show(scenario)
    info, log = scenario.infos[-1], scenario.logs[-1]
    assert info["JobState"] == "COMPLETED" and int(info["Restarts"]) >= 1, show(scenario)
    texts = runs(log)
    assert "(preempted at " in texts[0], texts[0]
    if scenario.user_signal:  # the job's --signal, to the batch shell, relayed from there
        assert "batch shell got SIGUSR1" in texts[0] and "stopped by SIGUSR1" in texts[0], texts[0]
    else:  # Slurm's SIGTERM reached the step (not the batch shell): every rank stopped after one step
        assert "stopped by SIGTERM" in texts[0] and "batch shell got" not in texts[0], texts[0]
    stops = check_resumes_exactly(texts, EPOCHS)
    assert len(stops) >= 1
    print(f"{name}: stopped at epoch {stops[0][0]} step {stops[0][1]}, {len(texts)} runs, "
          f"{scenario.signal_to_exit_s:.1f} s from the preemption to the job leaving RUNNING")
    assert parse_test(texts[-1])
    if name == "preempt-srun":  # 2 hosts x 1 task, ranks from Slurm
        assert "| 2 nodes (ddp-stop[4-5]) x 1 tasks |" in texts[0] and "world_size 2" in texts[0], texts[0]
    if name == "preempt-multi_node":  # 2 hosts x 2 ranks, a replica a host
        assert "| HSDP mesh replicate 2 x shard 2 |" in texts[0], texts[0]
    assert_same_training(scenario, folders[name], references[reference_key(scenario)], tmp_path,
                         server=bridge_s3_server)
    if IN_BUCKET[1] in scenario.args:
        check_the_bucket_is_the_only_store(scenario, folders[name], texts, bridge_s3_server)
        store_env(bridge_s3_server.env())  # the ledger and timeline are read from the bucket
        snapshot = IN_BUCKET[1]
    else:
        snapshot = folders[name] / wrapper_snapshot(scenario.name, scenario.args)
    # The goodput ledger: an attempt per run that trained (its epoch line), none of their steps redone (each
    # stop saved its last step), the requeue named; the last run's line over them all.
    trained = [text for text in texts if re.search(r"^epoch \d+ \| batch_size ", text, re.M)]
    records = assert_goodput(Path(snapshot).with_suffix("") if "hsdp" in scenario.args else snapshot,
                             [4 if "hsdp" in scenario.args else 2] * len(trained), [0] * (len(trained) - 1),
                             texts[-1])
    launches = [r["launch"] for r in records if r["record"] == "start"]
    assert len({launch["slurm_job"] for launch in launches}) == 1, launches
    assert int(launches[-1]["slurm_restart_count"]) >= 1, launches


def check_the_bucket_is_the_only_store(scenario, folder: Path, texts: list, server) -> None:
    """Every run of the IN_BUCKET job saved to and resumed from the bucket;
    each rank worked in its host's and its run's own folder (made by
    tests/train_in_host_folder.py, on both hosts for the first run and the
    last); no folder holds anything but the job's log (no snapshot, no claim
    file, no goodput ledger, no ``s3:`` folder); the bucket holds one
    committed generation (its manifest and snapshot object) and no lease
    (and beside the snapshot its goodput ledger and timeline: ``assert_goodput``)."""
    path = IN_BUCKET[1]
    assert STOP.search(texts[0]) and STOP.search(texts[0]).group(3) == path, texts[0]
    resumed = [RESUME.search(text) for text in texts[1:] if RESUME.search(text)]
    assert resumed and all(match.group(1) == path for match in resumed), texts
    hosts = ("ddp-stop4", "ddp-stop5")  # the job's nodes, ddp-stop[4-5]
    assert scenario.nodes == "ddp-stop[4-5]", scenario.nodes
    host_folders = sorted(entry.name for entry in folder.iterdir() if entry.is_dir())
    last = int(scenario.infos[-1]["Restarts"])
    assert {f"{host}-run{run}" for host in hosts for run in (0, last)} <= set(host_folders), host_folders
    assert all(re.fullmatch(rf"({'|'.join(hosts)})-run\d+", name) for name in host_folders), host_folders
    assert local_files(*(folder / name for name in host_folders)) == [], list(folder.rglob("*"))
    logs = [entry.name for entry in folder.iterdir() if entry.is_file()]
    assert logs == [f"{scenario.name}-{scenario.infos[-1]['JobId']}.out"], logs
    keys = snapshot_keys(server.keys(BUCKET))
    assert len(keys) == 2 and keys[0].endswith(bucket.MANIFEST) and keys[1].endswith(bucket.SNAPSHOT_OBJECT), keys


def test_time_limit_warning_snapshots_and_requeues_until_done(stopped):
    scenarios, folders, references = stopped
    scenario = scenarios["time-limit"]
    assert not scenario.error, show(scenario)
    info, log = scenario.infos[-1], scenario.logs[-1]
    assert info["JobState"] == "COMPLETED" and int(info["Restarts"]) >= 1, show(scenario)
    texts = runs(log)
    assert len(texts) >= 2
    # The wrapper's own #SBATCH --signal=B:USR1@90 warned the batch shell, which
    # relayed it and requeued the array task as itself.
    array_task = f"{info['ArrayJobId']}_7"
    assert "batch shell got SIGUSR1" in texts[0] and f"requeueing job {array_task}" in texts[0], texts[0]
    stops = check_resumes_exactly(texts, EPOCHS)
    # Slurm's timer sends the warning while the first run waits for it (epoch
    # 1, at step 30): it stops after that step, and the next run trains the rest.
    assert "stopped by SIGUSR1 after this step" in texts[0] and [epoch for epoch, _ in stops] == [1], texts
    print(f"time-limit: {len(texts)} runs, stops at {stops}, {scenario.signal_to_exit_s:.1f} s from the "
          f"limit brought near to leaving RUNNING")
    assert_same_snapshot(folders["time-limit"] / wrapper_snapshot("time-limit", scenario.args, 7),
                         references[reference_key(scenario)])


def test_scontrol_requeue_snapshots_and_slurm_requeues(stopped):
    scenarios, folders, references = stopped
    scenario = scenarios["scontrol-requeue"]
    assert not scenario.error, show(scenario)
    info, log = scenario.infos[-1], scenario.logs[-1]
    assert info["JobState"] == "COMPLETED" and int(info["Restarts"]) == 1, show(scenario)
    texts = runs(log)
    # SIGTERM to every process of the job, the batch shell too; Slurm requeued it, not the shell
    assert "batch shell got SIGTERM" in texts[0] and "requeueing job" not in texts[0], texts[0]
    stops = check_resumes_exactly(texts, EPOCHS)
    assert len(stops) == 1, texts
    print(f"scontrol-requeue: stopped at {stops[0]}, {scenario.signal_to_exit_s:.1f} s to leave RUNNING")
    assert_same_snapshot(folders["scontrol-requeue"] / wrapper_snapshot("scontrol-requeue", scenario.args),
                         references[reference_key(scenario)])


def test_scancel_snapshots_and_the_same_command_resumes(stopped):
    scenarios, folders, references = stopped
    scenario = scenarios["scancel"]
    assert not scenario.error, show(scenario)
    (cancelled, again), (first_log, second_log) = scenario.infos, scenario.logs
    # Cancelled, not requeued, with the snapshot of the step it stopped at on disk
    assert cancelled["JobState"] == "CANCELLED" and int(cancelled["Restarts"]) == 0, show(scenario)
    assert "batch shell got SIGTERM" in first_log and "requeueing" not in first_log, first_log
    assert again["JobState"] == "COMPLETED", show(scenario)
    stops = check_resumes_exactly([first_log, second_log], EPOCHS)
    assert len(stops) == 1, first_log
    print(f"scancel: stopped at {stops[0]}, {scenario.signal_to_exit_s:.1f} s to leave RUNNING")
    assert_same_snapshot(folders["scancel"] / wrapper_snapshot("scancel", scenario.args),
                         references[reference_key(scenario)])


def test_a_preempted_submitit_job_snapshots_requeues_and_resumes_bitwise(stopped):
    """launchers/submitit_train.py, two hosts, a task per rank, preempted
    while every rank waits at step 30 (SIGTERM to the tasks, GraceTime):
    every rank stops after its step and rank 0 saves the snapshot; only then
    does rank 0, seeing the job picked for preemption, hand over to
    submitit's requeue. The requeued job runs the pickled task again,
    resumes at the step it stopped, and ends bitwise equal to an
    uninterrupted run."""
    scenarios, folders, references = stopped
    scenario = scenarios["submitit"]
    assert not scenario.error, show(scenario)
    info, log = scenario.infos[-1], scenario.logs[-1]
    assert info["JobState"] == "COMPLETED" and int(info["Restarts"]) >= 1, show(scenario)
    assert info["NumNodes"] == "2", info
    # (preempt_send_user_signal is switched on only once this preemption is over)
    assert "stopped by SIGTERM after this step on every rank" in log, log
    assert "rank 0: stopped by SIGTERM, snapshot saved; requeueing" in log, log
    stop, resumed = STOP.search(log), RESUME.search(log)
    assert stop and resumed and (resumed.group(2), resumed.group(3)) == stop.group(1, 2), log
    print(f"submitit: stopped at epoch {stop.group(1)} step {stop.group(2)}, requeued, resumed there")
    assert_same_snapshot(folders["submitit"] / wrapper_snapshot("submitit", scenario.args),
                         references[reference_key(scenario)])


def test_a_stop_during_start_up_ends_cleanly_and_slurm_requeues(stopped):
    """scontrol requeue while every rank is still in start-up (held there, after
    the process group exists, by the injected fault): each rank ends at once with
    one line from rank 0, Slurm requeues the job, the next run trains it all."""
    scenarios, folders, references = stopped
    scenario = scenarios["startup-requeue"]
    assert not scenario.error, show(scenario)
    info, log = scenario.infos[-1], scenario.logs[-1]
    assert info["JobState"] == "COMPLETED" and int(info["Restarts"]) == 1, show(scenario)
    first, second = runs(log)
    assert "batch shell got SIGTERM" in first and "stopped by SIGTERM during start-up" in first, first
    assert "Traceback" not in first.split("stopped by SIGTERM during start-up")[0], first
    assert not epochs(first) and "snapshot saved" not in first, first
    check_resumes_exactly([first, second], EPOCHS)
    print(f"startup-requeue: {scenario.signal_to_exit_s:.1f} s from scontrol requeue to leaving RUNNING")
    assert_same_snapshot(folders[scenario.name] / wrapper_snapshot(scenario.name, scenario.args),
                         references[reference_key(scenario)])


def test_a_warning_after_the_last_epoch_does_not_requeue_a_finished_run(stopped):
    """The wrapper's time-limit warning lands after the last epoch (the injected
    fault holds rank 0 there, once every epoch and the test are done, until a
    stop signal comes, and the test brings the time limit near then): the
    batch shell learns from the training that the run is finished, and the job
    ends COMPLETED, in one run, instead of being requeued for a run with
    nothing to train."""
    scenarios, folders, _ = stopped
    scenario = scenarios["finished-warned"]
    assert not scenario.error, show(scenario)
    info, log = scenario.infos[-1], scenario.logs[-1]
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", show(scenario)
    texts = runs(log)
    assert len(texts) == 1 and info["Restarts"] == "0", show(scenario)
    last = texts[-1]
    assert "DDP_TEST_FAULT: wait_signal at finished 1" in last and "batch shell got SIGUSR1" in last, last
    assert "test | loss" in last and "SIGUSR1 came after the last epoch); not requeueing" in last, last
    assert "requeueing job" not in last.replace("not requeueing", ""), last
    check_resumes_exactly(texts, 3)  # and no run had "nothing to train"
    print(f"finished-warned: {len(texts)} runs, restarts {info['Restarts']}")


def test_preemption_without_grace_time_snapshots_within_kill_wait(stopped):
    """GraceTime=0: SIGTERM to every process of the job at once, batch shell
    included; the ranks stop after one step and rank 0 saves before Slurm's
    SIGKILL (KillWait after the SIGTERM); Slurm requeues; the run resumes
    exactly."""
    scenarios, folders, references = stopped
    scenario = scenarios["nograce"]
    assert not scenario.error, show(scenario)
    info, log = scenario.infos[-1], scenario.logs[-1]
    assert info["JobState"] == "COMPLETED" and int(info["Restarts"]) >= 1, show(scenario)
    texts = runs(log)
    assert "batch shell got SIGTERM" in texts[0] and "stopped by SIGTERM" in texts[0], texts[0]
    stops = check_resumes_exactly(texts, EPOCHS)
    assert len(stops) == 1, texts
    print(f"nograce: stopped at {stops[0]}, {scenario.signal_to_exit_s:.1f} s from the preemption to leaving "
          f"RUNNING (KillWait {KILL_WAIT_S} s)")
    assert_same_snapshot(folders[scenario.name] / wrapper_snapshot(scenario.name, scenario.args),
                         references[reference_key(scenario)])


def test_preemption_without_grace_time_killed_mid_save_resumes_from_the_last_whole_snapshot(stopped):
    """GraceTime=0 and a save that outlasts KillWait (the injected fault holds the
    third save after its temporary file is written): Slurm's SIGKILL lands
    mid-save; the snapshot before it is whole (temporary file + rename), the
    requeued run resumes from it, and the end is bitwise that of a run never
    interrupted; the killed save's temporary file is gone at the end."""
    scenarios, folders, references = stopped
    scenario = scenarios["nograce-killed-saving"]
    assert not scenario.error, show(scenario)
    info, log = scenario.infos[-1], scenario.logs[-1]
    assert info["JobState"] == "COMPLETED" and int(info["Restarts"]) >= 1, show(scenario)
    texts = runs(log)
    held = texts[0].split("DDP_TEST_FAULT: hang at save 3")
    assert len(held) == 2 and "snapshot saved" not in held[1], texts[0]
    assert "batch shell got SIGTERM" in texts[0], texts[0]
    # What the killed save held is trained again (an epoch the first run had
    # summarised, say); every later run resumes where the one before saved.
    last_saved = [(m.group(1), m.group(2)) for m in SAVED.finditer(held[0])][-1]
    resumed = RESUME.search(texts[1])
    assert resumed, texts[1]
    position = (resumed.group(2), resumed.group(3)) if resumed.group(2) else (resumed.group(4), None)
    assert position == last_saved, (last_saved, texts[1])
    check_resumes_exactly(texts[1:], EPOCHS, first=int(last_saved[0]) + (0 if last_saved[1] else 1))
    print(f"nograce-killed-saving: killed mid-save, resumed {resumed.group(0)!r}, "
          f"{scenario.signal_to_exit_s:.1f} s from the preemption to leaving RUNNING")
    folder = folders[scenario.name]
    assert_same_snapshot(folder / wrapper_snapshot(scenario.name, scenario.args),
                         references[(*scenario.reference, tuple(SHORT))])  # saving more often changes nothing
    assert not list(folder.glob("*.tmp")), list(folder.iterdir())


def test_a_sweep_from_one_folder_gives_each_point_its_own_snapshot(stopped):
    """Two points of a sweep (--lr) submitted from one folder while the first
    trains each write their own snapshot (the arguments' hash in its name)
    and neither resumes the other's; the first command submitted again while
    its job is still running is refused in one line naming that job, and its
    snapshot is left to it."""
    scenarios, folders, references = stopped
    first, second, again = SWEEP
    assert not first.error, first.error
    (first_info, first_log), (second_info, second_log), (again_info, again_log) = (
        (scenario.infos[0], scenario.logs[0]) for scenario in SWEEP)
    # the first job was ended by scancel once it held every epoch, the second ran to its end
    assert first_info["JobState"] == "CANCELLED" and "test | loss" in first_log, f"{first_info}\n{first_log}"
    assert second_info["JobState"] == "COMPLETED", f"{second_info}\n{second_log}"
    for log, total in ((first_log, EPOCHS), (second_log, int(SWEEP_SHORTER[1]))):
        assert "resuming from snapshot" not in log and len(runs(log)) == 1, log
        assert [e["epoch"] for e in epochs(log)] == list(range(1, total + 1)), log
    first_name, second_name = wrapper_snapshot("sweep", first.args), wrapper_snapshot("sweep", second.args)
    assert first_name != second_name and f"| {second_name} |" in second_log, second_log
    assert again_info["JobState"] == "FAILED" and again_info["ExitCode"] == "2:0", f"{again_info}\n{again_log}"
    refusal = [line for line in again_log.splitlines() if line.startswith("error:")]
    assert refusal == [f"error: snapshot {first_name} belongs to job {first_info['JobId']}, which is RUNNING: two "
                       f"live jobs must not share a snapshot; wait for job {first_info['JobId']} to end (or scancel "
                       f"it), or submit with other arguments or --job-name"], again_log
    folder = folders["sweep"]
    assert_same_snapshot(folder / first_name, references[(*first.reference, tuple(SHORT))])
    lr = torch.load(folder / second_name, weights_only=True)["config"]["lr"]
    assert lr == 0.02


def test_a_token_file_run_stopped_by_its_time_limit_between_evaluations_resumes_bitwise(stopped):
    """``sbatch slurm/multi_node.sh --dataset tokens ...`` on two hosts, a
    GPT on nanoGPT's token files evaluated every 20 steps: the wrapper's
    time-limit warning (Slurm's timer, the limit brought near while every
    rank waits at step 30) stops it between the evaluations of steps 20 and
    40; the wrapper requeues it, the next run resumes at that step, and the
    job ends with each evaluation printed once, the same lines as an
    uninterrupted run (the training loss of the interval the stop cut, and
    the best validation loss, carried over), and bitwise the same weights,
    AdamW state and schedule."""
    scenarios, folders, references = stopped
    scenario = scenarios["tokens-time-limit"]
    assert not scenario.error, show(scenario)
    info, log = scenario.infos[0], scenario.logs[0]
    assert info["JobState"] == "COMPLETED" and int(info["Restarts"]) >= 1, show(scenario)
    texts = runs(log)
    assert "batch shell got SIGUSR1" in texts[0] and f"requeueing job {info['JobId']}" in texts[0], texts[0]
    assert "stopped by SIGUSR1 after this step" in texts[0], texts[0]
    stops = [(int(epoch), int(step)) for epoch, step, _ in STOP.findall(texts[0])]
    assert len(stops) == 1 and stops[0][0] == 1 and 20 < stops[0][1] < 40, texts[0]  # between two evaluations
    resumed = RESUME.search(texts[1])
    assert resumed and (int(resumed.group(2)), int(resumed.group(3))) == stops[0], texts[1]
    assert "| 2 nodes (ddp-node[1-2]) x 1 processes |" in texts[0], texts[0]
    reference = (folders["tokens-time-limit"].parent / "reference-tokens" / "stdout.txt").read_text()
    assert [e["step"] for e in evaluations(reference)] == ["20", "40", "60"], reference
    assert [evaluations(text) for text in texts] == [evaluations(reference)[:1], evaluations(reference)[1:]], texts
    print(f"tokens-time-limit: stopped at {stops[0]}, {len(texts)} runs, {scenario.signal_to_exit_s:.1f} s from "
          f"the limit brought near to leaving RUNNING")
    first = folders["tokens-time-limit"] / f"{wrapper_snapshot('tokens-time-limit', scenario.args)}.first"
    assert_same_snapshot(first, references[reference_key(scenario)])


def test_a_two_node_run_submitted_again_reordered_and_longer_trains_on_from_its_snapshot(stopped):
    """The token-file run above, once it has ended (60 steps), submitted again
    to its two hosts with its flags in another order and spelling
    (``--n_embd=32``, ``--dropout 0.10``, ``./tokens_data``), --total_epochs
    raised to 2 and --max_steps to 80: the run's identity names the same
    snapshot, so the job
    resumes it at step 60 and trains steps 61-80, evaluating at 80, rather
    than starting a fresh run."""
    scenarios, folders, references = stopped
    scenario = scenarios["tokens-time-limit"]
    assert not scenario.error, show(scenario)
    assert len(scenario.infos) == 2, show(scenario)
    info, log = scenario.infos[1], scenario.logs[1]
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", f"{info}\n{log}"
    again = runs(log)[-1]
    # each run of each job names the identity (before its first line: the snapshot's name needs it)
    identities = re.findall(r"^run identity (\w{8}): ", scenario.logs[0] + log, re.M)
    assert len(set(identities)) == 1 and len(identities) == len(runs(scenario.logs[0])) + len(runs(log)), log
    name = wrapper_snapshot("tokens-time-limit", scenario.args)
    assert name == wrapper_snapshot("tokens-time-limit", list(TOKENS_AGAIN)) and f"| {name} |" in again, again
    resumed = RESUME.search(again)
    assert resumed and int(resumed.group(3)) == 60, again
    assert [e["step"] for e in evaluations(again)] == ["80"], again
    snapshot = torch.load(folders["tokens-time-limit"] / name, weights_only=True)
    assert snapshot["config"]["max_steps"] == 80, snapshot["config"]
