"""A loopback TCP proxy that cuts an upload mid-stream, for the tests of
snapshots in a bucket: it forwards every connection to an S3 server
(``support/s3_server.py``) byte for byte until the ``cut_request``-th request
whose first line holds ``cut_pattern`` has sent ``cut_after_bytes`` bytes; it
then closes that connection on both sides (the store failing mid-upload) and
refuses every later one (the store staying down), until ``heal``.

    proxy = TcpProxy("127.0.0.1", server.port, cut_pattern=b"/snapshot.pt", cut_request=2)
    env = {**server.env(), "AWS_ENDPOINT_URL": proxy.url}
    ...
    proxy.stop()
"""

from __future__ import annotations

import socket
import threading


class TcpProxy:
    """Forwards 127.0.0.1:``port`` to ``host``:``target_port`` in threads of this process.

    Args:
        host, target_port: the server forwarded to.
        cut_pattern: bytes in a request line (b"PUT /bucket/key...") that count
            towards ``cut_request``; b"" counts none (a plain proxy).
        cut_request: which matching request is cut (1: the first).
        cut_after_bytes: how many bytes of that request, its line and headers
            included, reach the server before the cut.
    """

    def __init__(self, host: str, target_port: int, cut_pattern: bytes = b"", cut_request: int = 1,
                 cut_after_bytes: int = 2000) -> None:
        self.target = (host, target_port)
        self.cut_pattern, self.cut_request, self.cut_after_bytes = cut_pattern, cut_request, cut_after_bytes
        self.seen = 0  # matching requests seen
        self.cut = threading.Event()  # set once the cut happened: later connections are refused
        self._lock = threading.Lock()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._running = True
        threading.Thread(target=self._accept, name="tcp-proxy", daemon=True).start()

    @property
    def url(self) -> str:
        """The proxy's address, as AWS_ENDPOINT_URL takes it."""
        return f"http://127.0.0.1:{self.port}"

    def heal(self) -> None:
        """Forward connections again after a cut."""
        self.cut.clear()
        self.cut_pattern = b""

    def stop(self) -> None:
        self._running = False
        self.listener.close()

    def _accept(self) -> None:
        while self._running:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.cut.is_set():  # the store is down: the connection is dropped at once
                client.close()
                continue
            try:
                server = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            threading.Thread(target=self._upstream, args=(client, server), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        """Server to client, as is."""
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                try:
                    end.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _upstream(self, client: socket.socket, server: socket.socket) -> None:
        """Client to server, watching for the request to cut: bytes left before the cut, None when not armed."""
        left = None
        try:
            while True:
                data = client.recv(65536)
                if not data:
                    break
                if left is None and self.cut_pattern:
                    line_end = data.find(b"\r\n")
                    first = data[:line_end if line_end >= 0 else 200]
                    if first[:4] in (b"PUT ", b"POST") and self.cut_pattern in first:
                        with self._lock:
                            self.seen += 1
                            if self.seen == self.cut_request:
                                left = self.cut_after_bytes
                if left is not None:
                    server.sendall(data[:left])
                    left -= min(left, len(data))
                    if left == 0:
                        self.cut.set()
                        break
                else:
                    server.sendall(data)
        except OSError:
            pass
        finally:
            for end in (client, server):
                try:
                    end.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                end.close()
