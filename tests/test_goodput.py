"""The goodput ledger and the timeline beside the snapshot, file by file: a
real attempt killed by SIGKILL keeps its last step, the next counts the steps
after its snapshot as redone; torn lines, a new run at the same path, paths
that cannot be written; the same beside a snapshot in a bucket (moto's S3
server: the ``s3_server`` fixture), the ledger and the tracks objects PUT
whole. (Real runs stopped and resumed, restarted by torchrun, resized, and
preempted and requeued by Slurm assert the same through
``helpers.assert_goodput``: tests/test_fault_tolerance.py,
tests/test_stop_paths.py, tests/test_elastic.py, tests/test_s3_snapshots.py.)"""

import json
import os
import re
import subprocess
import sys
import time

from helpers import GOODPUT_LINE, REPO

from train_utils.logs.goodput import CATEGORIES, Goodput, attempt_totals, goodput_line, goodput_paths, read_ledger, \
    shares
from train_utils.logs import timeline
from train_utils.logs.timeline import read_trace
from train_utils.snapshots import bucket

# One attempt of one rank in a process of its own: 5 steps, a snapshot after
# step 3, then SIGKILL (no end record, no closing bracket). Its snapshot path
# (sys.argv[1]) in a bucket, the background PUTs come every sys.argv[2]
# seconds, and it waits for one after its last step before the kill.
KILLED_ATTEMPT = f"""
import os, signal, sys, time
sys.path.insert(0, {str(REPO)!r})
from train_utils.logs.goodput import Goodput
from train_utils.snapshots import bucket
if len(sys.argv) > 2:
    bucket.PUT_EVERY_S = float(sys.argv[2])
goodput = Goodput(sys.argv[1], 0)
goodput.begin("", 0, 1)
for step in range(1, 6):
    time.sleep(0.01)
    goodput.step(step)
    if step == 3:
        with goodput.timed("snapshot"):
            time.sleep(0.01)
        goodput.saved("in epoch 1 after step 3")
if len(sys.argv) > 2:
    time.sleep(5 * bucket.PUT_EVERY_S)  # a few background PUTs: the last holds step 5
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_attempt_keeps_its_last_step_and_the_next_counts_the_steps_after_its_snapshot_redone(tmp_path):
    snapshot = str(tmp_path / "snapshot_train.pt")
    launched = time.time()
    killed = subprocess.run([sys.executable, "-c", KILLED_ATTEMPT, snapshot], capture_output=True, text=True)
    assert killed.returncode == -9, killed.stderr
    ledger, trace = goodput_paths(snapshot)
    records = read_ledger(ledger)
    # The ledger grew by a line per record committed (the start, the snapshot), plus the step line written in place.
    assert [(r["record"], r["step"]) for r in records] == [("start", 0), ("snapshot", 3), ("step", 5)]
    assert launched - 1 < records[0]["started"] < records[0]["time"] < time.time()
    resumed = Goodput(snapshot, 0)
    resumed.begin("in epoch 1 after step 3", 3, 1)  # what a resume from that snapshot finds
    for step in (4, 5, 6):
        resumed.step(step)
    line = resumed.end("finished")
    records = read_ledger(ledger)
    redone = [r for r in records if r["record"] == "redone"]
    assert [(r["attempt"], r["by"], r["steps"]) for r in redone] == [(1, 2, 2)]
    totals = attempt_totals(records)
    assert sorted(totals) == [1, 2] and totals[1]["redone_steps"] == 2
    first = [r for r in records if r["attempt"] == 1 and r["record"] != "redone"]
    # Steps 4 and 5 moved from productive to redone: the productive seconds after the snapshot's record.
    moved = first[-1]["seconds"]["productive"] - first[1]["seconds"]["productive"]
    assert abs(totals[1]["seconds"]["redone"] - moved) < 1e-9 and moved >= 0.015
    for total in totals.values():
        assert abs(sum(total["seconds"].values()) - total["wall_s"]) < 1e-6
        assert min(total["seconds"].values()) >= 0
    match = GOODPUT_LINE.fullmatch(line)
    assert match and line == goodput_line(records), line
    assert int(match.group("goodput")[2:]) + sum(map(int, re.findall(r"(\d+)%", match.group("rest")))) == 100
    events = read_trace(trace)  # no closing bracket: attempt 2 appended to attempt 1's
    assert not open(trace).read().rstrip().endswith("]")
    assert {(e["pid"], e["tid"]) for e in events if e["name"] == "thread_name"} == {(1, 0), (2, 0)}
    assert {e["pid"] for e in events if e["name"] == "snapshot" and e["ph"] == "i"} == {1}
    assert [e["args"]["from"] for e in events if e["name"] == "resume"] == ["in epoch 1 after step 3"]
    assert [e["args"]["reason"] for e in events if e["name"] == "end"] == ["finished"]


def test_a_torn_line_is_skipped_and_a_fresh_start_after_a_finished_run_is_a_new_run(tmp_path):
    snapshot = str(tmp_path / "snap.pt")
    ledger, _ = goodput_paths(snapshot)
    first = Goodput(snapshot, 0, started_at=time.time() - 1)
    first.begin("", 0, 1)
    first.step(1)
    first.end("finished")
    with open(ledger, "a") as f:
        f.write('{"record":"step","run":1,"attempt":')  # a writer killed mid-line
    again = Goodput(snapshot, 0)
    again.begin("", 0, 1)  # no snapshot found (the user removed it): a new run at the same path
    again.step(1)
    line = again.end("finished")
    records = read_ledger(ledger)
    assert [(r["run"], r["attempt"], r["record"]) for r in records] == [
        (1, 1, "start"), (1, 1, "end"), (2, 2, "start"), (2, 2, "end")]
    assert list(attempt_totals(records)) == [2] and "redone" not in line  # the line covers the new run alone
    assert all(json.loads(text) for text in open(ledger).read().splitlines()[:2])


def test_a_snapshot_in_a_bucket_keeps_its_ledger_and_timeline_beside_it(s3_server, store_env, monkeypatch,
                                                                          capsys):
    """--snapshot_path s3://goodput/runs/snap.pt: the ledger the object
    runs/snap.pt.goodput.jsonl, the timeline an object per rank per attempt
    under runs/snap.pt.timeline/. A real attempt SIGKILLed after its step 5
    keeps what its background PUT wrote (its step 5); the next one, in this
    process, counts steps 4 and 5 redone, PUTs its start at once and its
    steps not at each (the bucket's ledger still ends at its start after
    three of them, its background PUT an hour away), its end at once; its track goes on in a second part
    once the first is full (parts of 200 bytes here). The reader merges
    the tracks; each object is a whole JSON array. A bucket that does not
    exist costs one warning line and the ledger, not the run."""
    s3_server.create_bucket("goodput")
    store_env(s3_server.env())
    snapshot = "s3://goodput/runs/snap.pt"
    ledger, trace = goodput_paths(snapshot)
    assert (ledger, trace) == ("s3://goodput/runs/snap.pt.goodput.jsonl", "s3://goodput/runs/snap.pt.timeline")
    launched = time.time()
    killed = subprocess.run([sys.executable, "-c", KILLED_ATTEMPT, snapshot, "0.2"], capture_output=True, text=True,
                            env={**os.environ, **s3_server.env()})
    assert killed.returncode == -9, killed.stderr
    assert [(r["record"], r["step"]) for r in read_ledger(ledger)] == [("start", 0), ("snapshot", 3), ("step", 5)]
    assert s3_server.keys("goodput") == ["runs/snap.pt.goodput.jsonl",
                                         "runs/snap.pt.timeline/attempt-0001.rank-00000.part-0000.json"]

    monkeypatch.setattr(timeline, "TRACK_PART_BYTES", 200)
    monkeypatch.setattr(bucket, "PUT_EVERY_S", 3600.0)  # no background PUT comes during the steps, however slow
    resumed = Goodput(snapshot, 0)
    resumed.begin("in epoch 1 after step 3", 3, 1)
    for step in (4, 5, 6):
        resumed.step(step)
    assert [(r["attempt"], r["record"]) for r in read_ledger(ledger)][-2:] == [(1, "redone"), (2, "start")]
    line = resumed.end("finished")
    records = read_ledger(ledger)
    assert [(r["attempt"], r["record"], r.get("step", r.get("steps"))) for r in records] == [
        (1, "start", 0), (1, "snapshot", 3), (1, "step", 5), (1, "redone", 2), (2, "start", 3), (2, "end", 6)]
    totals = attempt_totals(records)
    assert totals[1]["redone_steps"] == 2 and totals[1]["seconds"]["redone"] > 0
    for total in totals.values():
        assert abs(sum(total["seconds"].values()) - total["wall_s"]) < 1e-6 and min(total["seconds"].values()) >= 0
    assert launched - 1 < records[0]["started"] and records[-1]["time"] < time.time()
    assert line == goodput_line(records) and GOODPUT_LINE.fullmatch(line), line

    tracks = [key for key in s3_server.keys("goodput") if ".timeline/" in key]
    assert tracks == [f"runs/snap.pt.timeline/attempt-000{a}.rank-00000.part-000{p}.json" for a, p in
                      ((1, 0), (2, 0), (2, 1))], tracks
    for key in tracks:  # each a whole JSON array, its closing bracket written
        assert isinstance(json.loads(s3_server.client().get_object(Bucket="goodput", Key=key)["Body"].read()), list)
    events = read_trace(trace)
    assert {(e["pid"], e["tid"]) for e in events if e["name"] == "thread_name"} == {(1, 0), (2, 0)}
    assert {e["pid"] for e in events if e["name"] == "start-up" and e["ph"] == "X"} == {1, 2}
    assert {e["pid"] for e in events if e["name"] == "snapshot" and e["ph"] == "i"} == {1}
    assert [e["args"]["from"] for e in events if e["name"] == "resume"] == ["in epoch 1 after step 3"]
    assert [(e["pid"], e["args"]["reason"]) for e in events if e["name"] == "end"] == [(2, "finished")]

    missing = Goodput("s3://no-such-bucket/run/snapshot.pt", 0)  # a bucket that refuses: one line, no ledger
    missing.begin("", 0, 1)
    missing.step(1)
    assert missing.end("finished") == ""
    assert capsys.readouterr().err.splitlines() == [
        f"warning: cannot write the goodput ledger beside --snapshot_path (bucket no-such-bucket does not exist at "
        f"{s3_server.url}: create it, or pass another --snapshot_path); the run goes on without it"]


def test_a_snapshot_path_that_is_not_local_or_cannot_be_written_costs_no_run(tmp_path, capsys):
    """A URL of a scheme the kit keeps no logs at: none, silently; a folder
    that is a file: one warning line, and the run goes on. (A bucket that
    does not exist: the bucket's test above.)"""
    assert goodput_paths("gs://bucket/run/snapshot.pt") == (None, None)
    remote = Goodput("gs://bucket/run/snapshot.pt", 0)
    remote.begin("", 0, 1)
    remote.step(1)
    assert remote.end("finished") == "" and capsys.readouterr() == ("", "")
    (tmp_path / "file").write_text("")
    blocked = Goodput(str(tmp_path / "file" / "snap.pt"), 0)  # its folder is a file
    blocked.begin("", 0, 1)
    blocked.step(1)
    assert blocked.end("finished") == ""
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("warning: cannot write the goodput ledger beside --snapshot_path ("), err


def test_shares_are_whole_percents_that_sum_to_100():
    seconds = {"productive": 90.4, "start-up": 3.3, "redone": 3.3, "snapshot": 3.0}
    assert shares(seconds) == {"productive": 91, "start-up": 3, "redone": 3, "snapshot": 3}
    assert sum(shares(dict(zip(CATEGORIES, (1 / 3, 1 / 3, 1 / 3, 0, 0, 0, 0, 0)))).values()) == 100
