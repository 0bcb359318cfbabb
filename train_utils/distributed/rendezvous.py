"""The rendezvous port of a Slurm job: one formula for Python and the Slurm
wrappers, so a job's srun tasks and its torchrun agents meet at the same port.

Imports nothing beyond the standard library, so a wrapper can run it as a
file, without loading torch or the package:

    MASTER_PORT="$(python train_utils/rendezvous.py "$SLURM_JOB_ID")"
"""

from __future__ import annotations

import os
import sys

FIRST_PORT = 15000  # above the well-known and most registered ports
PORTS = 15000  # 15000-29999: below Linux's default ephemeral range (32768-60999)


def slurm_port(job_id: int) -> int:
    """The TCP port of job ``job_id``'s rendezvous: 15000 + job id % 15000.

    Derived from the job id, never a literal, so two jobs that share a first
    node do not collide (unless their ids differ by a multiple of 15000)."""
    return FIRST_PORT + job_id % PORTS


def main(argv: list) -> int:
    """``rendezvous.py [JOB_ID]``: print the port (JOB_ID defaults to
    $SLURM_JOB_ID). A missing or non-numeric id: one line on stderr, status 2."""
    text = argv[1] if len(argv) > 1 else os.environ.get("SLURM_JOB_ID", "")
    if not text.isdigit():
        print(f"error: expected a Slurm job id (argument or SLURM_JOB_ID), got {text!r}", file=sys.stderr)
        return 2
    print(slurm_port(int(text)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
