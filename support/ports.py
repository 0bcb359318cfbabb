"""A port for a test's or a benchmark's rendezvous, which no connection takes
meanwhile. No torch here: support/pods.py imports it without torch."""

from __future__ import annotations

import random
import socket

# Below the kernel's ephemeral ports, which it gives the local end of every
# outgoing connection (a store client's, a gloo pair's): a port picked among
# those could be taken by a connection between the pick and the bind.
_DEFAULT_EPHEMERAL = (32768, 60999)  # Linux's default net.ipv4.ip_local_port_range
_PICKS = random.SystemRandom()  # each process its own choices, however it was started (a fork too)


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range of ephemeral ports (net.ipv4.ip_local_port_range),
    Linux's default where it cannot be read."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(word) for word in f.read().split())
        return low, high
    except (OSError, ValueError):
        return _DEFAULT_EPHEMERAL


def free_port() -> int:
    """A TCP port nothing listens on right now, on any address, picked at
    random from the 10,000 below the kernel's ephemeral range, so that no
    outgoing connection takes it before the rendezvous binds it (a port the
    OS picks for a bind to port 0 comes from that range, where it can); the
    OS's pick where none of 200 tries is free."""
    low = ephemeral_range()[0]
    for _ in range(200):
        port = _PICKS.randrange(max(1024, low - 10000), low)
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
