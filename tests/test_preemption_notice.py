"""A cloud's preemption notice (--preemption_notice) stops a run as SIGTERM
does: a metadata service on loopback that answers as AWS's IMDSv2 and GCE's
metadata server do (their request paths and headers; the base URL through
PREEMPTION_NOTICE_URL), the notice posted while the run trains."""

from __future__ import annotations

import subprocess
import time

import pytest

from helpers import FAULTY_TRAIN, PODS, error_lines, held_at_step, one_process, script_env
from support.metadata_service import MetadataService

from train_utils.loop import PreemptionNotice

@pytest.fixture
def service():
    server = MetadataService()
    yield server
    server.shutdown()
    server.server_close()


@pytest.mark.quick
@pytest.mark.parametrize("cloud, posted", [("aws", "terminate at 2026-12-06T16:02:00Z"), ("gce", "preempted")])
def test_the_notice_is_read_as_each_cloud_posts_it(service, cloud, posted):
    """Each cloud's request (AWS: a session token first, then its header;
    GCE: Metadata-Flavor): None before the notice, the notice after it."""
    notice = PreemptionNotice(cloud, service.url)
    assert notice.ask() is None
    service.post()
    assert notice.ask() == posted and service.asks == 2


def test_a_posted_notice_stops_every_rank_after_its_snapshot(service, tmp_path):
    """Two pods with --preemption_notice aws, rank 0 held before its 5th
    step; the notice is posted: rank 0's watcher names it, the run stops as
    at SIGTERM (every rank exits 143, the stop's snapshot written) and rank 0
    says how long after the notice the snapshot was committed. A service
    that does not answer: one line at start-up, exit 2."""
    hold_env, held = held_at_step(5)
    log = tmp_path / "log.txt"
    launch = PODS + ["--nproc_per_node=2", FAULTY_TRAIN, "--preemption_notice", "aws"]
    with open(log, "w") as out:
        job = subprocess.Popen([str(part) for part in launch], cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT,
                               env=script_env(PREEMPTION_NOTICE_URL=service.url, **hold_env), text=True)
        try:
            deadline = time.monotonic() + 600  # bounds a failure only
            while held not in log.read_text():
                assert job.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
            service.post()
            job.wait(timeout=300)
        finally:
            if job.poll() is None:
                job.kill()
    text = log.read_text()
    assert job.returncode == 143, text[-3000:]
    assert "notice: AWS spot interruption notice (terminate at 2026-12-06T16:02:00Z) on host " in text, text[-3000:]
    assert "stopped by SIGTERM after this step on every rank" in text
    assert "snapshot saved at snapshot_train.pt" in text and (tmp_path / "snapshot_train.pt").exists()
    assert "stop: snapshot committed " in text and " s after the AWS spot interruption notice" in text

    refused = one_process(["--preemption_notice", "gce"], tmp_path,
                          PREEMPTION_NOTICE_URL="http://127.0.0.1:9")  # the discard port: nothing listens
    assert refused.returncode == 2
    assert error_lines(refused.stderr) == [
        "error: --preemption_notice gce: the instance metadata service at http://127.0.0.1:9 does not answer "
        "(<urlopen error [Errno 111] Connection refused>); run on a GCE instance, or drop --preemption_notice"]
