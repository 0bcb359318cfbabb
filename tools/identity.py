"""A run's identity: the flags that say what a run learns, parsed and in
one order, so that one run submitted again under another spelling is known
as the same run, and another point of a sweep as another; and the snapshot
a Slurm submission resumes and saves, named by it.

    python tools/identity.py --dataset tokens --lr 3e-4 --total_epochs 4
    # 05fbcd44 --lr 0.0003 --dataset tokens
    python tools/identity.py --snapshot_for snapshot-sweep --dataset tokens --lr 3e-4
    # run identity 05fbcd44: --lr 0.0003 --dataset tokens
    # snapshot-sweep-05fbcd44.pt

What counts: every flag of train.py given with a value other than its
default that says what the run learns (``config.identity_flags``: not those
that only say how long the run goes on, since a longer run extends the same
one, how fast its steps go, or what it prints and where it writes), and the
task module's own flags except its ``OUTPUT_FLAGS``; docs/slurm.md lists
them. The Slurm wrappers (slurm/stop_and_requeue.sh's ``snapshot_for``) and
launchers/submitit_train.py name a submission's snapshot with
``snapshot_for``, run as a file in the job's environment or container.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys

PROJECT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if PROJECT not in sys.path:  # run as a file: the project folder on the path
    sys.path.insert(0, PROJECT)

import common  # noqa: E402 - after the path above
from train_utils import cli, config  # noqa: E402


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
    ``words`` (``identity_flags``'s; or, for a snapshot named by a command
    as typed, its arguments), each followed by a NUL byte."""
    return hashlib.sha256(b"".join(word.encode() + b"\0" for word in words)).hexdigest()[:8]


def parse(argv: list) -> argparse.Namespace:
    """train.py's command-line arguments ``argv`` parsed as train.py parses
    them (``cli.parse_args``: the kit's flags and those of the task
    --dataset names; unset, a flag the task's recipe fills is None, and
    --snapshot_path too). A flag train.py would refuse ends the process as
    it would there: train.py's one line, status 2."""
    return cli.parse_args(None, common.TASKS, argv=argv, prog="train.py")


def identity_of(argv: list) -> list:
    """The identity (``identity_flags``'s words) of train.py's command-line
    arguments ``argv``: the flags of ``config.identity_flags`` and the task
    module's own but its ``OUTPUT_FLAGS``, against their defaults (no flag
    given, and the task's flags under ``argv``'s --dataset). Ends the
    process as ``parse`` does."""
    args = parse(argv)
    defaults = parse(["--dataset", args.dataset])  # the task's own flags' defaults too
    defaults.dataset = parse([]).dataset
    flags = next(iter(cli.task_flags((args.dataset,)).values()), {})
    output = cli.output_flags(args.dataset)
    return identity_flags(args, defaults, [*config.identity_flags(), *(name for name in flags if name not in output)])


def snapshot_for(name: str, argv: list, folder: str = ".") -> tuple[str, list]:
    """The --snapshot_path of a Slurm submission named ``name``
    (snapshot-<job name>[-<array index>]) that runs train.py with ``argv``,
    relative to its working ``folder``, and the lines that say how it was
    chosen (for the job's log). A --snapshot_path among ``argv`` wins (no
    line). Else ``name``-<the run's identity's digits> (``run_identity``;
    ``name`` alone for a run that gives no flag of its identity), a folder
    under a sharded --strategy (fsdp, hsdp: one sub-folder per save), a
    ``.pt`` file otherwise: the same run submitted again (or requeued) gets
    the same name, whatever the order or spelling of its flags, and with a
    longer --total_epochs or --max_steps trains on; another point of a sweep
    gets its own. Where no snapshot has that name yet and one named by a
    hash of the arguments as typed exists in ``folder``, that one is
    resumed, with a note. Ends the process as ``parse`` does for a flag
    train.py refuses."""
    args = parse(argv)
    if args.snapshot_path is not None:
        return args.snapshot_path, []
    suffix = "" if config.is_sharded(args.strategy) else ".pt"
    words, lines = identity_of(argv), []
    chosen = f"{name}{suffix}"
    if words:
        chosen = f"{name}-{run_identity(words)}{suffix}"
        lines.append(f"run identity {run_identity(words)}: {' '.join(words)}")
    typed = f"{name}-{run_identity(argv)}{suffix}" if argv else f"{name}{suffix}"  # the arguments as typed
    if typed != chosen and not os.path.exists(os.path.join(folder, chosen)) and \
            os.path.exists(os.path.join(folder, typed)):
        lines.append(f"note: resuming {typed}, this command's snapshot named by its arguments as typed (the run's "
                     f"identity names it {chosen}; pass --snapshot_path to choose)")
        chosen = typed
    return chosen, lines


def main(argv: list) -> int:
    """``identity.py [train.py's flags]``: print the run's identity's digits
    and its flags on one line ("05fbcd44 --lr 0.0003 --dataset tokens"; the
    digits alone for a run that gives none of them). ``identity.py
    --snapshot_for NAME [train.py's flags]``: print ``snapshot_for``'s lines,
    then the snapshot's path as the last line."""
    if argv[:1] == ["--snapshot_for"]:
        if len(argv) < 2:
            print("error: --snapshot_for needs the submission's name (snapshot-<job name>[-<array index>])",
                  file=sys.stderr)
            return 2
        path, lines = snapshot_for(argv[1], argv[2:])
        print(*lines, path, sep="\n")
        return 0
    words = identity_of(argv)
    print(run_identity(words), *words)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
