"""tests/train_with_fault.py (train.py with DDP_TEST_FAULT's fault, or none)
run in a working folder of this host's and this run's own: ``<host>-run<N>``
under the folder it starts in (made if missing; N: the job's
SLURM_RESTART_COUNT, 0 for its first run). The test cluster's hosts
(network namespaces) share this machine's filesystem; a cluster whose hosts
share none gives each host a folder no other sees, and a requeued job may
land on other hosts, whose folders are empty: this is that, for a Slurm
wrapper's step (``SCRIPT_NAME=tests/train_in_host_folder.py``). Every
argument goes on as it is; a relative path in them is then relative to the
host's folder."""

from __future__ import annotations

import os
import runpy
import socket
import sys
from pathlib import Path

FAULTY_TRAIN = Path(__file__).resolve().parent / "train_with_fault.py"


def host_folder() -> str:
    """``<host name>-run<SLURM_RESTART_COUNT or 0>``: the folder this process works in."""
    return f"{socket.gethostname()}-run{os.environ.get('SLURM_RESTART_COUNT') or 0}"


if __name__ == "__main__":
    os.makedirs(host_folder(), exist_ok=True)  # ranks of one host start together
    os.chdir(host_folder())
    sys.argv[0] = str(FAULTY_TRAIN)
    runpy.run_path(str(FAULTY_TRAIN), run_name="__main__")
