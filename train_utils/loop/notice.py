"""A cloud's preemption notice taken as a stop signal (--preemption_notice):
a spot or preemptible instance is told 30 s (GCE) to 2 minutes (AWS) before
it goes, on its instance metadata service, not by a signal. A thread of each
node's local rank 0 watches it and, at the notice, starts the stop that
SIGTERM starts (``stop.request_stop``): every rank stops after the same step
and rank 0 saves the snapshot, which the next start resumes.

The services, as the clouds document them:

* AWS (IMDSv2): ``PUT /latest/api/token`` with the header
  ``X-aws-ec2-metadata-token-ttl-seconds`` gives a session token; ``GET
  /latest/meta-data/spot/instance-action`` with the header
  ``X-aws-ec2-metadata-token`` answers 404 until an interruption is
  scheduled, then 200 and ``{"action": "terminate", "time": "..."}``
  (action: terminate, stop or hibernate). Base URL http://169.254.169.254.
  (docs.aws.amazon.com, "Spot Instance interruption notices".)
* GCE: ``GET /computeMetadata/v1/instance/preempted`` with the header
  ``Metadata-Flavor: Google`` answers ``FALSE``, then ``TRUE`` once the
  instance is being preempted. Base URL http://metadata.google.internal.
  (cloud.google.com, "Detect whether a VM was preempted".)

``PREEMPTION_NOTICE_URL`` replaces the base URL (a proxy, or a test's server).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from typing import Optional

from common import ConfigError
from ..output import print_line
from .stop import request_stop

BASE_URLS = {"aws": "http://169.254.169.254", "gce": "http://metadata.google.internal"}
NAMES = {"aws": "AWS spot interruption notice", "gce": "GCE preemption notice"}
POLL_S = 2.0  # between two asks: well inside the shortest notice (GCE's 30 s)
ASK_TIMEOUT_S = 2.0  # one request to a service on the instance's own link


class PreemptionNotice:
    """The instance metadata service of cloud ``cloud`` ("aws" or "gce")
    at ``base_url`` (None: ``PREEMPTION_NOTICE_URL``, else the cloud's own).
    ``ask()`` returns None while no notice is posted, else the notice in
    words ("terminate at 2026-12-06T16:02:00Z"); raises OSError (a
    urllib.error.URLError, a time-out) when the service does not answer."""

    def __init__(self, cloud: str, base_url: Optional[str] = None) -> None:
        self.cloud = cloud
        self.base = (base_url or os.environ.get("PREEMPTION_NOTICE_URL") or BASE_URLS[cloud]).rstrip("/")

    def _get(self, path: str, headers: dict, method: str = "GET") -> tuple[int, bytes]:
        """(HTTP status, body) of one request; 404 is an answer, not an error."""
        request = urllib.request.Request(self.base + path, headers=headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=ASK_TIMEOUT_S) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as exc:
            return exc.code, b""

    def ask(self) -> Optional[str]:
        """None while no notice is posted, else the notice in words; OSError
        (ValueError for a body that is no JSON) when the service fails."""
        if self.cloud == "gce":
            status, body = self._get("/computeMetadata/v1/instance/preempted", {"Metadata-Flavor": "Google"})
            if status != 200:
                raise OSError(f"HTTP {status} from {self.base}")
            return "preempted" if body.strip().upper() == b"TRUE" else None
        status, token = self._get("/latest/api/token", {"X-aws-ec2-metadata-token-ttl-seconds": "300"}, "PUT")
        if status != 200:
            raise OSError(f"HTTP {status} from {self.base} for an IMDSv2 token")
        status, body = self._get("/latest/meta-data/spot/instance-action",
                                 {"X-aws-ec2-metadata-token": token.decode()})
        if status == 404:
            return None
        if status != 200:
            raise OSError(f"HTTP {status} from {self.base}")
        notice = json.loads(body)
        return f"{notice.get('action', 'terminate')} at {notice.get('time', 'an unstated time')}"


def watch_preemption_notice(cloud: Optional[str], local_rank: int) -> Optional[threading.Thread]:
    """--preemption_notice ``cloud``: on local rank 0 (one watcher a node:
    the stop's all-reduce brings it to every rank), ask the instance's
    metadata service once now, then every ``POLL_S`` seconds in a daemon
    thread; at a notice rank's line ("notice: AWS spot interruption notice
    (terminate at ...) on host H: stopping as at SIGTERM") and
    ``request_stop``. Returns the thread (None: no watcher here). Raises
    ConfigError (one line) when the service does not answer the first ask:
    not an instance of that cloud, or its metadata service is blocked.
    Later failures are retried at the next poll."""
    if not cloud or local_rank != 0:
        return None
    notice = PreemptionNotice(cloud)
    try:
        first = notice.ask()
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--preemption_notice {cloud}: the instance metadata service at {notice.base} does not "
                          f"answer ({exc}); run on a {cloud.upper()} instance, or drop --preemption_notice") from None
    def watch(posted: Optional[str]) -> None:
        while posted is None:
            time.sleep(POLL_S)
            try:
                posted = notice.ask()
            except (OSError, ValueError):
                continue  # the service may hiccup; the next poll asks again
        print_line(f"notice: {NAMES[cloud]} ({posted}) on host {socket.gethostname()}: stopping as at SIGTERM")
        request_stop(f"the {NAMES[cloud]}")

    thread = threading.Thread(target=watch, args=(first,), name="preemption notice", daemon=True)
    thread.start()
    return thread
