"""An S3 server for the tests and benchmarks: moto's (``moto[s3]`` with Flask, the
S3 implementation that boto's and s3fs's own test suites run against),
started as its own process on one address (127.0.0.1 unless told, or a
network-namespace bridge's address) and a free port. It keeps its objects in
memory and ends with the process.

The kit's clients reach it as they reach any S3-compatible store, through
the standard AWS variables: ``env()`` gives ``AWS_ENDPOINT_URL`` and a pair
of credentials the server accepts.

    server = S3Server()
    server.create_bucket("runs")
    subprocess.run([...], env={**os.environ, **server.env()})
    server.stop()
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from support.ports import free_port

REGION = "us-east-1"
# moto accepts any pair; these only have to be set, as a real store needs them.
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}


class S3Server:
    """moto's S3 server in a child process, listening on ``host`` only.

    Args:
        host: the address it binds (127.0.0.1, or a bridge's address for
            network-namespace hosts); never 0.0.0.0.
        start_timeout_s: seconds to wait for it to answer.

    Raises:
        RuntimeError: it did not answer within ``start_timeout_s`` (its
            output is in the message).
    """

    def __init__(self, host: str = "127.0.0.1", start_timeout_s: float = 60.0) -> None:
        if host in ("", "0.0.0.0", "::"):
            raise ValueError("S3Server listens on one address, not on every one")
        self.host, self.port = host, free_port()
        # Its log (a line a request) goes to a file, not a pipe: a pipe nobody reads fills after some
        # hundreds of requests, and the server then blocks every request on writing its line.
        self.log = tempfile.TemporaryFile()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", host, "-p", str(self.port)],
            stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + start_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                break
            try:
                urllib.request.urlopen(f"{self.url}/moto-api/", timeout=2).close()
                return
            except (urllib.error.URLError, ConnectionError, socket.timeout):
                time.sleep(0.2)
        self.stop()
        self.log.seek(0)
        raise RuntimeError(f"moto's S3 server on {self.url} did not start: "
                           f"{self.log.read().decode(errors='replace')[-2000:]}")

    @property
    def url(self) -> str:
        """The endpoint, as AWS_ENDPOINT_URL takes it."""
        return f"http://{self.host}:{self.port}"

    def env(self) -> dict[str, str]:
        """The variables a client needs to reach this server and nothing
        else: the endpoint, a region and credentials."""
        return {"AWS_ENDPOINT_URL": self.url, "AWS_DEFAULT_REGION": REGION, **CREDENTIALS}

    def client(self):
        """A boto3 S3 client of this server."""
        import boto3

        return boto3.client("s3", endpoint_url=self.url, region_name=REGION,
                            aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"])

    def create_bucket(self, name: str) -> str:
        """Make bucket ``name``; returns ``s3://name``."""
        self.client().create_bucket(Bucket=name)
        return f"s3://{name}"

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        """Every object key in ``bucket`` under ``prefix``, sorted."""
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return sorted(item["Key"] for page in pages for item in page.get("Contents", []))

    def stop(self) -> None:
        """End the server; its objects go with it."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
