"""Snapshots in a bucket (``--snapshot_path s3://...``), against moto's S3
server on 127.0.0.1 (the ``s3_server`` fixture): runs stopped by SIGTERM and
by SIGKILL resumed from other, empty working folders, bitwise equal to a run
never interrupted with a local snapshot; an upload cut mid-stream by a
loopback proxy (support/tcp_proxy.py); the claim as a lease in the bucket;
the bad places' one lines; the choice of the generation to resume."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from helpers import (FAULTY_TRAIN, PODS, REPO, assert_goodput, assert_same_snapshot, bucket_snapshot, check, epochs,
                     error_lines, held_at_step, local_files, parse_test, run, script_env, snapshot_keys)

from train_utils.snapshots import bucket

# The synthetic task at one rank: 57 steps an epoch; a snapshot after every epoch.
FLAGS = ["--total_epochs", "3", "--save_every", "1"]
ONE_RANK = PODS + ["--nproc_per_node=1"]


def wait_for_line(process, line: str, timeout: float = 300) -> str:
    """Read ``process``'s output (stdout, stderr joined) until ``line``; return what was read."""
    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = process.stdout.readline()
        assert text, "".join(seen)  # ended first
        seen.append(text)
        if line in text:
            return "".join(seen)
    raise AssertionError("".join(seen))


@pytest.fixture(scope="module")
def reference(kit_run):
    """The same run never interrupted, its snapshot a local file."""
    folder, stdout = kit_run("ddp", *FLAGS, processes=1)
    return folder / "snapshot_train.pt", stdout


def test_stopped_by_sigterm_and_sigkill_resumes_from_the_bucket_in_another_empty_folder(
        s3_server, store_env, reference, tmp_path):
    """SIGTERM mid-epoch (the snapshot committed in the bucket), then a
    second run from another empty folder SIGKILLed (every process: the one
    rank kills itself) right after its epoch-end save started, then a third
    from a third empty folder: the result is bitwise the uninterrupted local
    run's, no working folder ever holds a snapshot, and the bucket keeps one
    generation, as a disk keeps one file. While the first run is held, a
    second run of the same path is refused by the lease in one line. The
    goodput ledger and timeline beside the snapshot in the bucket count the
    three attempts, none of the first's steps redone (its stop saved its
    last step), the last run's goodput line theirs."""
    s3_server.create_bucket("stops")
    path = "s3://stops/runs/a/snap.pt"
    env = s3_server.env()
    folders = [tmp_path / name for name in ("first", "second", "third", "other")]
    for folder in folders:
        folder.mkdir()
    hold, line = held_at_step(70)  # epoch 2's 13th step
    launched = time.time()
    held = subprocess.Popen([str(part) for part in ONE_RANK + [FAULTY_TRAIN, *FLAGS, "--snapshot_path", path]],
                            cwd=folders[0], env=script_env(**hold, **env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_line(held, line)
        # The same path from another folder while that run lives: refused by its lease, in one line.
        second = run(ONE_RANK + [REPO / "train.py", *FLAGS, "--snapshot_path", path], folders[3], **env)
        refusal = re.compile(rf"error: snapshot {path} is in use by pid \d+ on host {re.escape(socket.gethostname())}"
                             r": two live runs must not write one snapshot; wait for that run to end \(or stop "
                             r"it\), or pass another --snapshot_path$")
        lines = error_lines(second.stderr)
        assert second.returncode == 2 and len(lines) == 1 and refusal.match(lines[0]), second.stderr
        held.send_signal(signal.SIGTERM)
        log = held.communicate(timeout=120)[0]
    finally:
        if held.poll() is None:
            held.kill()
    assert "epoch 2 step 13 | snapshot saved at s3://stops/runs/a/snap.pt" in log, log

    # Killed: the rank SIGKILLs itself at its 45th step, the first of epoch 3, the epoch-2 upload in flight.
    killed = run(ONE_RANK + [FAULTY_TRAIN, *FLAGS, "--snapshot_path", path], folders[1],
                 DDP_TEST_FAULT="step:0:45:kill", **env)
    assert "resuming from snapshot s3://stops/runs/a/snap.pt in epoch 2 after step 13" in killed.stdout, killed.stderr
    assert killed.returncode != 0 and "test | loss" not in killed.stdout

    resumed = check(run(ONE_RANK + [REPO / "train.py", *FLAGS, "--snapshot_path", path], folders[2], **env))
    resumed_from = [line for line in resumed.stdout.splitlines() if line.startswith("resuming from")]
    assert resumed_from in (["resuming from snapshot s3://stops/runs/a/snap.pt after epoch 2"],  # committed
                            ["resuming from snapshot s3://stops/runs/a/snap.pt in epoch 2 after step 13"]), resumed_from
    reference_path, reference_stdout = reference
    assert parse_test(resumed.stdout) == parse_test(reference_stdout)
    assert epochs(resumed.stdout)[-1]["val_loss"] == epochs(reference_stdout)[-1]["val_loss"]
    assert_same_snapshot(reference_path, bucket_snapshot(s3_server, "stops", "runs/a/snap.pt", folders[3]))
    assert local_files(*folders[:3]) == []  # no snapshot, no "s3:" folder, no ledger, on disk
    keys = snapshot_keys(s3_server.keys("stops"))
    assert len(keys) == 2 and keys[0].endswith(bucket.MANIFEST) and keys[1].endswith(bucket.SNAPSHOT_OBJECT), keys
    # The second attempt was killed outright: its steps redone depend on which snapshot the third found.
    store_env(env)
    assert_goodput(path, [1, 1, 1], [0, None], resumed.stdout, since=launched)


def test_a_second_live_run_is_refused_by_the_lease_and_a_dead_runs_lease_is_taken_over(s3_server, store_env):
    """The claim in the bucket: a lease of a live run on another host
    (renewed just now) refuses this run in the one line a local claim gives;
    a lease of a dead process on this host is taken over (If-Match), and
    released at the end if still this run's. (A live run of this host
    refused by its lease: the SIGTERM test above.)"""
    s3_server.create_bucket("leases")
    store_env(s3_server.env())
    path, host = "s3://leases/a/snap.pt", socket.gethostname()
    me = {"host": host, "pid": str(os.getpid()), "start": "1"}
    s3 = s3_server.client()
    s3.put_object(Bucket="leases", Key="a/snap.pt.lease", Body=json.dumps({"host": "elsewhere", "pid": "7"}).encode())
    error, etag = bucket.take_lease(path, me, set())
    assert error.startswith("snapshot s3://leases/a/snap.pt is in use by pid 7 on host elsewhere, whose lease "
                            "leases/a/snap.pt.lease was renewed ") and "two live runs must not write" in error
    assert etag == ""
    dead = {"host": host, "pid": str(2**22 + 17)}  # beyond Linux's largest pid: no such process
    s3.put_object(Bucket="leases", Key="a/snap.pt.lease", Body=json.dumps(dead).encode())
    error, etag = bucket.take_lease(path, me, set())
    assert error == "" and etag
    assert json.loads(s3.get_object(Bucket="leases", Key="a/snap.pt.lease")["Body"].read()) == me
    bucket.Lease(path, me, etag).release()
    assert s3_server.keys("leases") == []


def test_an_upload_cut_mid_stream_keeps_the_previous_snapshot_which_the_resume_chooses(
        s3_server, reference, tmp_path):
    """A loopback proxy between the run and the store cuts the second
    snapshot's upload mid-stream and refuses every connection after (the
    store failing): the run ends in one line naming the intact snapshot, the
    bucket holds the previous generation only, and a run from another empty
    folder resumes from it (never from the torn one) to the uninterrupted
    run's result, the bucket then keeping one generation, as a disk keeps one
    file."""
    from support.tcp_proxy import TcpProxy

    s3_server.create_bucket("cuts")
    path = "s3://cuts/snap.pt"
    proxy = TcpProxy("127.0.0.1", s3_server.port, cut_pattern=b"/" + bucket.SNAPSHOT_OBJECT.encode(), cut_request=2,
                     cut_after_bytes=4000)
    cut_folder, resume_folder = tmp_path / "cut", tmp_path / "resume"
    cut_folder.mkdir()
    resume_folder.mkdir()
    try:
        started = time.monotonic()
        failed = run(ONE_RANK + [REPO / "train.py", *FLAGS, "--snapshot_path", path], cut_folder,
                     **dict(s3_server.env(), AWS_ENDPOINT_URL=proxy.url))
        took = time.monotonic() - started
    finally:
        proxy.stop()
    assert proxy.cut.is_set() and failed.returncode == 1 and took < 90
    lines = error_lines(failed.stderr)
    assert len(lines) == 1 and re.fullmatch(
        rf"error: cannot save snapshot {path}: the store at {proxy.url} does not answer \(\w+ after 3 attempts\): "
        rf"check AWS_ENDPOINT_URL and that the store is up; snapshot {path} \(after epoch 1\) is intact: fix "
        rf"that, then run the same command to resume from it", lines[0]), failed.stderr
    # The torn upload left nothing a resume could take; the lease stays (the store was down at the end):
    # the next run, on this host, sees its holder dead and takes it over.
    keys = snapshot_keys(s3_server.keys("cuts"))
    assert keys == ["snap.pt.lease", "snap.pt/00000001/manifest.json", "snap.pt/00000001/snapshot.pt"], keys

    resumed = check(run(ONE_RANK + [REPO / "train.py", *FLAGS, "--snapshot_path", path], resume_folder,
                        **s3_server.env()))
    assert "resuming from snapshot s3://cuts/snap.pt after epoch 1" in resumed.stdout
    reference_path, reference_stdout = reference
    assert parse_test(resumed.stdout) == parse_test(reference_stdout)
    assert_same_snapshot(reference_path, bucket_snapshot(s3_server, "cuts", "snap.pt", tmp_path))
    assert snapshot_keys(s3_server.keys("cuts")) == ["snap.pt/00000003/manifest.json",
                                                     "snap.pt/00000003/snapshot.pt"]
    assert local_files(cut_folder, resume_folder) == []


def test_bad_places_get_one_line_each_within_90_s(s3_server, store_env, monkeypatch, tmp_path):
    """A bucket that does not exist (a real run: exit 2, one line, nothing
    written), an endpoint that does not answer (connections refused, tried
    3 times), denied credentials (a store that checks them: moto's with
    its IAM checks on): one line each, in well under 90 s; and where boto3
    is not installed, the line says what to install."""
    from support.ports import free_port
    from support.s3_server import S3Server

    started = time.monotonic()
    missing = run(ONE_RANK + [REPO / "train.py", "--snapshot_path", "s3://no-such-bucket/a/snap.pt"], tmp_path,
                  **s3_server.env())
    assert missing.returncode == 2 and error_lines(missing.stderr) == [
        f"error: cannot use --snapshot_path s3://no-such-bucket/a/snap.pt: bucket no-such-bucket does not exist at "
        f"{s3_server.url}: create it, or pass another --snapshot_path"], missing.stderr
    assert local_files(tmp_path) == []

    down = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    store_env(dict(s3_server.env(), AWS_ENDPOINT_URL=down))
    assert bucket.check_bucket("s3://runs/a/snap.pt") == (
        f"cannot use --snapshot_path s3://runs/a/snap.pt: the store at {down} does not answer "
        f"(EndpointConnectionError after 3 attempts): check AWS_ENDPOINT_URL and that the store is up")

    monkeypatch.setenv("INITIAL_NO_AUTH_ACTION_COUNT", "0")  # moto checks every request's credentials
    strict = S3Server()
    try:
        store_env(strict.env())
        assert bucket.check_bucket("s3://runs/a/snap.pt") == (
            f"cannot use --snapshot_path s3://runs/a/snap.pt: {strict.url} denies access to bucket runs (403): "
            f"check the credentials (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE) and the "
            f"bucket's policy")
    finally:
        strict.stop()
    assert time.monotonic() - started < 90

    monkeypatch.setitem(sys.modules, "boto3", None)  # as where boto3 is not installed: its import fails
    bucket._CLIENT.clear()
    assert bucket.check_bucket("s3://runs/a/snap.pt") == (
        "--snapshot_path s3://runs/a/snap.pt is in a bucket, which needs boto3 and s3fs: pip install boto3 s3fs")


def test_the_resume_chooses_the_newest_generation_its_manifest_commits(s3_server, store_env):
    """``choose_generation``: the newest generation whose manifest exists and
    whose objects match it, never one without a manifest (an upload never
    committed) or one whose object is short of its manifest's size (torn);
    a multipart upload (parts of 5 MiB) is committed and read back whole,
    and the claim holder's clean-up removes the uncommitted generations and
    aborts a multipart upload never completed, keeping the committed one."""
    def manifest(size: int) -> dict:
        return {"objects": {"snapshot.pt": {"size": size, "sha256": "0"}}}

    manifests = {"r/00000002/manifest.json": manifest(10), "r/00000004/manifest.json": manifest(10)}
    sizes = {"r/00000002/snapshot.pt": 10, "r/00000002/manifest.json": 1,
             "r/00000003/snapshot.pt": 10,  # no manifest: never committed
             "r/00000004/snapshot.pt": 7, "r/00000004/manifest.json": 1,  # torn: shorter than its manifest says
             "r2/00000009/manifest.json": 1, "r/00000005": 3}  # another snapshot's; not a generation's object
    chosen = bucket.choose_generation("r", sizes, manifests.get)
    assert (chosen.name, chosen.prefix) == ("00000002", "r/00000002")
    assert bucket.choose_generation("r", {"r/00000003/snapshot.pt": 10}, manifests.get) is None

    s3_server.create_bucket("parts")
    store_env(s3_server.env())
    path = "s3://parts/big/snap.pt"
    store = bucket.SnapshotBucket(path, part_bytes=5 * 2**20)
    data = os.urandom(6 * 2**20)  # two parts
    store.write_generation(1, data, "epoch 1", 32)
    s3 = s3_server.client()
    s3.put_object(Bucket="parts", Key="big/snap.pt/00000002/snapshot.pt", Body=b"never committed")
    upload = s3.create_multipart_upload(Bucket="parts", Key="big/snap.pt/00000003/snapshot.pt")
    s3.upload_part(Bucket="parts", Key="big/snap.pt/00000003/snapshot.pt", UploadId=upload["UploadId"],
                   PartNumber=1, Body=os.urandom(5 * 2**20))
    assert bucket.remove_uncommitted(path) == ["big/snap.pt/00000002/snapshot.pt"]
    assert s3.list_multipart_uploads(Bucket="parts").get("Uploads", []) == []
    assert s3_server.keys("parts") == ["big/snap.pt/00000001/manifest.json", "big/snap.pt/00000001/snapshot.pt"]
    generation = bucket.newest_generation(path)
    assert generation.name == "00000001" and generation.manifest["budget_batch"] == 32
    store.chosen = generation
    assert store._download().getvalue() == data


def test_fsdp_stopped_by_sigterm_and_sigkill_resumes_from_the_bucket_bitwise(s3_server, kit_run, tmp_path):
    """FSDP's DCP saves in a bucket: 2 ranks stopped by SIGTERM mid-epoch
    (the save committed by its manifest); from another empty folder 1 rank
    resumes it (DCP reshards it from the bucket) and is SIGKILLed before its
    next save; from a third 2 ranks resume the same save and finish:
    bitwise the uninterrupted run's with local snapshots; no working folder
    holds a snapshot; the bucket keeps one save."""
    from helpers import assert_bitwise, full_state, snapshot_folder

    flags = ["--strategy", "fsdp", "--total_epochs", "1"]  # 29 steps at 2 ranks
    reference, reference_stdout = kit_run("fsdp", *flags[2:])  # the finished_run fixture's, shared
    s3_server.create_bucket("sharded")
    path = "s3://sharded/runs/fsdp"
    env = dict(s3_server.env(), OMP_NUM_THREADS="1")
    folders = [tmp_path / name for name in ("first", "second", "third", "saved")]
    for folder in folders:
        folder.mkdir()
    two_ranks = PODS + ["--nproc_per_node=2"]
    hold, line = held_at_step(10)
    held = subprocess.Popen([str(part) for part in two_ranks + [FAULTY_TRAIN, *flags, "--snapshot_path", path]],
                            cwd=folders[0], env=script_env(**hold, **env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_line(held, line)
        held.send_signal(signal.SIGTERM)
        log = held.communicate(timeout=120)[0]
    finally:
        if held.poll() is None:
            held.kill()
    saved = re.search(r"^epoch 1 step (\d+) \| snapshot saved at (s3://sharded/runs/fsdp/epoch-1-step-\d+)$", log,
                      re.M)
    assert saved, log[-3000:]
    step, folder = saved.groups()

    killed = run(ONE_RANK + [FAULTY_TRAIN, *flags, "--snapshot_path", path], folders[1],
                 DDP_TEST_FAULT="step:0:3:kill", **env)
    assert (f"resuming from snapshot {folder} in epoch 1 after step {2 * int(step)} (saved by world_size 2, "
            f"resharded to 1: weights and optimizer state exact;") in killed.stdout, killed.stdout[-3000:]
    assert killed.returncode != 0 and "test | loss" not in killed.stdout

    resumed = check(run(two_ranks + [REPO / "train.py", *flags, "--snapshot_path", path], folders[2], **env))
    assert f"resuming from snapshot {folder} in epoch 1 after step {step}\n" in resumed.stdout, resumed.stdout[-3000:]
    assert parse_test(resumed.stdout) == parse_test(reference_stdout)
    assert local_files(*folders[:3]) == []
    keys = snapshot_keys(s3_server.keys("sharded"))
    assert {key.split("/")[2] for key in keys} == {"epoch-1"}, keys
    for key in keys:  # the committed save, fetched for DCP's converter
        target = folders[3] / key
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(s3_server.client().get_object(Bucket="sharded", Key=key)["Body"].read())
    _, in_bucket = full_state(folders[3] / "runs" / "fsdp" / "epoch-1", tmp_path / "gathered-bucket")
    _, local = full_state(snapshot_folder(reference / "snapshot_train_fsdp"), tmp_path / "gathered-local")
    assert_bitwise(in_bucket, local)
