"""A cloud's instance metadata service on 127.0.0.1, as the tests and
benchmarks/preemption_notice.py use it for train.py --preemption_notice:
AWS's IMDSv2 (a session token from ``PUT /latest/api/token``, then ``GET
/latest/meta-data/spot/instance-action``: 404 until a notice is posted, then
200 with its JSON) and GCE's ``GET /computeMetadata/v1/instance/preempted``
(FALSE, then TRUE), with the headers each requires. Pass its ``url`` as
PREEMPTION_NOTICE_URL."""

from __future__ import annotations

import http.server
import json
import threading

NOTICE = {"action": "terminate", "time": "2026-12-06T16:02:00Z"}


class MetadataService(http.server.ThreadingHTTPServer):
    """AWS's IMDSv2 and GCE's preempted flag, on 127.0.0.1: no notice until
    ``post()``. A request without the service's header is refused as the
    real ones refuse it (401 for AWS without a session token, 403 for GCE
    without Metadata-Flavor). ``asks`` counts the notice requests."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.posted, self.asks = False, 0
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        """The base URL, for PREEMPTION_NOTICE_URL."""
        return f"http://127.0.0.1:{self.server_address[1]}"

    def post(self) -> None:
        """Post the notice: every ask from now on finds it."""
        self.posted = True


class Handler(http.server.BaseHTTPRequestHandler):
    """The two services' requests; anything else 404."""

    def log_message(self, *args) -> None:  # quiet
        pass

    def _answer(self, status: int, body: bytes = b"") -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_PUT(self) -> None:
        if self.path == "/latest/api/token" and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
            return self._answer(200, b"session-token")
        self._answer(400)

    def do_GET(self) -> None:
        service = self.server
        if self.path == "/latest/meta-data/spot/instance-action":
            if self.headers.get("X-aws-ec2-metadata-token") != "session-token":
                return self._answer(401)
            service.asks += 1
            return self._answer(200, json.dumps(NOTICE).encode()) if service.posted else self._answer(404)
        if self.path == "/computeMetadata/v1/instance/preempted":
            if self.headers.get("Metadata-Flavor") != "Google":
                return self._answer(403)
            service.asks += 1
            return self._answer(200, b"TRUE" if service.posted else b"FALSE")
        self._answer(404)
