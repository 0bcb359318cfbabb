"""pytest's fixtures and hooks for the tests: the real-MNIST fixture, the
session's one Slurm cluster, and each test file's time at the end of the run.
The helpers the tests call are in helpers.py (running the scripts, parsing
their output, snapshots) and dataset_files.py (datasets on disk)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dataset_files import build_mnist_root
from helpers import IN_CI


@pytest.fixture(scope="session")
def mnist_root(tmp_path_factory) -> Path:
    """8,000 real digits to train on, the last 2,000 held out as the test split."""
    return build_mnist_root(tmp_path_factory.mktemp("mnist"))


# --------------------------------------------------------------------------
# One Slurm cluster per test session
# --------------------------------------------------------------------------

@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A real Slurm cluster (tests/slurm_cluster.py: munged, slurmctld, three
    slurmd, two network-namespace hosts), started once for the whole session
    and shared by every module that submits jobs; stopped, and checked to
    leave nothing behind, at the end. Skips with the reason where it cannot
    run; under CI=true that fails instead."""
    import time

    from slurm_cluster import SlurmCluster, unavailable_reason

    reason = unavailable_reason()
    if reason:
        if IN_CI:
            pytest.fail(f"Slurm tests must run in CI, but: {reason}")
        pytest.skip(f"no Slurm cluster here: {reason}")
    started = time.monotonic()
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    cluster.start()
    print(f"Slurm cluster up in {time.monotonic() - started:.1f} s")
    try:
        yield cluster
    finally:
        cluster.stop()
    # The harness promises to leave the machine as it found it.
    assert cluster.leftovers() == []


# --------------------------------------------------------------------------
# Each test file's time, printed at the end of the run
# --------------------------------------------------------------------------

_FILE_SECONDS: dict = {}


def pytest_runtest_logreport(report) -> None:
    """Add each test phase's duration (setup, call, teardown) to its file's total."""
    path = report.nodeid.split("::")[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter) -> None:
    """Print the seconds each test file took, longest first (fixtures included)."""
    terminalreporter.section("seconds per test file")
    for path, seconds in sorted(_FILE_SECONDS.items(), key=lambda item: -item[1]):
        terminalreporter.write_line(f"{seconds:8.1f} s  {path}")
    terminalreporter.write_line(f"{sum(_FILE_SECONDS.values()):8.1f} s  in all")
