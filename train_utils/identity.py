"""A run's identity: the flags that say what a run learns, parsed and in
one order, so that one run submitted again under another spelling is known
as the same run, and another point of a sweep as another.

The Slurm wrappers name a submission's snapshot by it
(``snapshot-<job name>-<8 hex digits>.pt``; slurm/stop_and_requeue.sh), run as
a file, in the job's environment or container:

    python train_utils/identity.py --dataset tokens --lr 3e-4 --total_epochs 4
    # 05fbcd44 --lr 0.0003 --dataset tokens

What counts: every flag of train.py given with a value other than its
default, except those that only say how long the run goes on (a longer run
extends the same one), how fast its steps go, or what it prints and where it
writes, and the task module's own flags except its ``OUTPUT_FLAGS``. The
flags of the identity are ``IDENTITY_FLAGS``; docs/slurm.md lists them.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys

if __name__ == "__main__":  # run as a file: the project folder, not this one, on the path
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402 - after the path above
from train_utils import cli, config  # noqa: E402

IDENTITY_FLAGS = config.identity_flags()  # the fields of RunConfig marked identity=True


def identity_flags(args: argparse.Namespace, defaults: argparse.Namespace, names) -> list:
    """The run's identity as command-line words: ``--name value`` for each of
    ``names`` (in their order) whose value in ``args`` differs from its value
    in ``defaults`` (both ``parse``'s), values as parsed (``--lr 3e-4`` and
    ``--lr 0.0003`` are one run), a path normalised (``./data`` is ``data``)."""
    words = []
    for name in names:
        value, default = getattr(args, name, None), getattr(defaults, name, None)
        if name == "data_dir":
            value, default = os.path.normpath(value), os.path.normpath(default)
        if value != default:
            words += [f"--{name}", str(value)]
    return words


def run_identity(words: list) -> str:
    """The 8 hex digits that name a run: the start of the SHA-256 of
    ``words`` (``identity_flags``'s), each followed by a NUL byte."""
    return hashlib.sha256(b"".join(word.encode() + b"\0" for word in words)).hexdigest()[:8]


def parse(argv: list) -> argparse.Namespace:
    """train.py's command-line arguments ``argv`` parsed as train.py parses
    them (``cli.parse_args``: the kit's flags and those of the task
    --dataset names; unset, a flag the task's recipe fills is None, and
    --snapshot_path too). A flag train.py would refuse ends the process as
    it would there: one line, status 2."""
    saved = sys.argv
    sys.argv = ["train.py", *argv]
    try:
        return cli.parse_args(None, common.TASKS)
    finally:
        sys.argv = saved


def identity_of(argv: list) -> list:
    """The identity (``identity_flags``'s words) of train.py's command-line
    arguments ``argv``: the flags of ``IDENTITY_FLAGS`` and the task module's
    own but its ``OUTPUT_FLAGS``, against their defaults (no flag given,
    and the task's flags under ``argv``'s --dataset). Ends the process as
    ``parse`` does."""
    args = parse(argv)
    defaults = parse(["--dataset", args.dataset])  # the task's own flags' defaults too
    defaults.dataset = parse([]).dataset
    module, flags = next(iter(cli.task_flags((args.dataset,)).items()), (None, {}))
    output = getattr(sys.modules.get(module), "OUTPUT_FLAGS", ())
    return identity_flags(args, defaults, [*IDENTITY_FLAGS, *(name for name in flags if name not in output)])


def main(argv: list) -> int:
    """``identity.py [train.py's flags]``: print the run's identity's digits
    and its flags on one line ("05fbcd44 --lr 0.0003 --dataset tokens"; the
    digits alone for a run that gives none of them)."""
    words = identity_of(argv)
    print(run_identity(words), *words)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
