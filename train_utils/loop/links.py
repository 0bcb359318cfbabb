"""A slow network link between two hosts, measured link by link.

A slow link makes every rank of a ring slower by the same amount: each
waits in the same all-reduce, so comparing the ranks' collective time
names nothing. What tells the links apart is a transfer over each of them.
Once a window (the straggler watch's, ``stragglers.WINDOW_STEPS`` steps),
each rank whose previous rank (in rank order) runs on another host receives
``PROBE_BYTES`` from it over the training's own process group, and times
the receive; ranks whose neighbours share their host take no part. The
straggler watch carries the seconds to every rank and compares each link
between hosts with the others (``slow_links``).
"""

from __future__ import annotations

import time
from typing import Optional

import torch
import torch.distributed as dist

# A probe's size: a healthy link moves it in well under a millisecond at
# 10 Gb/s and up (2 ms at 1 Gb/s); a link running at a tenth of its peers'
# speed then takes milliseconds more, above the straggler watch's floor.
PROBE_BYTES = 256 * 1024
START_TAG, PROBE_TAG = 1, 2  # point-to-point tags of the start message and the probe


class LinkProbe:
    """Times the transfer of ``PROBE_BYTES`` over each link between hosts.

    ``hosts``: every rank's host name, indexed by rank (the start-up's
    placement); ``rank``: this one; ``device``: the training's device (the
    probe's tensors live there and go through the default process group,
    the one the training's collectives use: NCCL's links on GPUs, gloo's
    TCP on the CPU). The links probed are those from rank r - 1 to rank r
    (modulo the world size) whose ranks run on different hosts
    (``links_between_hosts``); nothing is probed when fewer than two such
    links exist (one host: every link is inside it; then ``active`` is False).

    ``measure()`` is collective among the ranks at the ends of those links:
    every rank calls it at the same point (the watch's window poll). The
    links take turns (``link_turns``): no host sends and receives a probe at
    once, so a host whose sending is slow does not slow the probe it
    receives (its acknowledgements would queue behind its own probe). In
    its turn a sender sends a one-element start message, then the probe;
    the receiver times the probe from the start message's arrival, so that
    a sender that reaches the call later than its receiver (one that waited
    longer in the step's collectives) adds nothing. (A receiver that comes
    later finds part of the probe arrived: a slow link then reads a little
    faster, never a fast one slower.) On the CPU ``measure`` returns those
    seconds (host clock, ``time.perf_counter``); on CUDA the seconds of the
    previous call's probe, from CUDA events around it read once they have
    completed (a window late, never waited for); 0.0 where there is no
    figure (this rank's link in is inside its host, or no event has
    completed yet).
    """

    def __init__(self, hosts: list, rank: int, device: torch.device) -> None:
        world_size = len(hosts)
        self.links = links_between_hosts(hosts)
        self.active = len(self.links) >= 2
        self.turn = link_turns(self.links)  # each link's turn, by its receiving rank
        self.previous, self.next = (rank - 1) % world_size, (rank + 1) % world_size
        self.receives = self.active and rank in self.links  # this rank's link in crosses hosts
        self.sends = self.active and self.next in self.links  # its link out does
        self.rank, self.cuda = rank, device.type == "cuda"
        elements = PROBE_BYTES // 4  # float32
        self.start_out = torch.ones(1, device=device) if self.sends else None
        self.probe_out = torch.zeros(elements, device=device) if self.sends else None
        self.start_in = torch.empty(1, device=device) if self.receives else None
        self.probe_in = torch.empty(elements, device=device) if self.receives else None
        self.events: Optional[tuple] = None  # CUDA: the (start, end) events of the probe in flight

    def measure(self) -> float:
        """The probe (see the class). Returns seconds (float), 0.0 where there is no figure."""
        seconds = 0.0
        if self.cuda and self.receives and self.events is not None and self.events[1].query():
            seconds = self.events[0].elapsed_time(self.events[1]) / 1000  # ms -> s
        for turn in range(max(self.turn.values(), default=-1) + 1):
            if self.receives and self.turn[self.rank] == turn:
                received = self._receive()
                seconds = seconds if self.cuda else received
            if self.sends and self.turn[self.next] == turn:
                self._send()
        return seconds

    def _send(self) -> None:
        """The start message, then the probe, to the next rank."""
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, self.start_out, self.next, tag=START_TAG),
                                            dist.P2POp(dist.isend, self.probe_out, self.next, tag=PROBE_TAG)]):
            work.wait()

    def _receive(self) -> float:
        """The start message, then the probe, from the previous rank. CPU:
        returns the probe's seconds from the start message's arrival. CUDA:
        returns 0.0; a pair of events around the probe's receive, on the
        current stream (``work.wait()`` makes the stream, not the host, wait)."""
        start = dist.irecv(self.start_in, self.previous, tag=START_TAG)
        probe = dist.irecv(self.probe_in, self.previous, tag=PROBE_TAG)
        if self.cuda:
            start.wait()
            events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            events[0].record()
            probe.wait()
            events[1].record()
            self.events = events
            return 0.0
        start.wait()
        started = time.perf_counter()
        probe.wait()
        return time.perf_counter() - started


def links_between_hosts(hosts: list) -> list:
    """The ranks r (ascending) whose link in, from rank r - 1 (modulo
    ``len(hosts)``), joins two hosts: ``hosts[r] != hosts[r - 1]``. Ranks
    placed host by host (torchrun, Slurm) give one such link per host when
    there are several hosts: ``["a", "a", "b", "b"]`` gives ``[0, 2]``."""
    return [rank for rank in range(len(hosts)) if hosts[rank] != hosts[rank - 1]]


def link_turns(links: list) -> dict:
    """{receiving rank: its link's turn} for ``links`` (``links_between_hosts``'s
    list, the links between hosts in ring order): the i-th link's turn is i
    mod 2, so that each host's link in and link out (neighbours in the ring
    of hosts) take different turns; an odd number of links (of hosts)
    gives the last link a third turn, its neighbours being the first (turn
    0) and the one before it (turn 1). A 2-colouring of an even cycle, 3
    colours for an odd one."""
    turns = {receiver: index % 2 for index, receiver in enumerate(links)}
    if len(links) % 2 and len(links) > 1:
        turns[links[-1]] = 2
    return turns
