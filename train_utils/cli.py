"""The command line every script shares: the same flags in the same order,
plus the few a rung adds (``SCRIPT_FLAGS``).
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from typing import Callable, Iterable, Optional

from .errors import report_to_torchrun
from .recipe import LR_SCHEDULES, OPTIMIZERS


def positive(kind: type) -> Callable[[str], object]:
    """argparse type: a ``kind`` (int or float) > 0, else a one-line usage error."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got {text!r}")
        if not value > 0:  # also rejects NaN
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    return parse


def non_negative_float(text: str) -> float:
    """argparse type: a float >= 0, else a one-line usage error."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a float, got {text!r}")
    if not 0 <= value < float("inf"):  # also rejects NaN
        raise argparse.ArgumentTypeError(f"must be >= 0 and finite, got {text}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: an int >= 0, else a one-line usage error."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int, got {text!r}")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _choice(*choices: str) -> Callable[[str], str]:
    """argparse type: one of ``choices``, else a one-line usage error."""

    def parse(text: str) -> str:
        if text not in choices:
            raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {', '.join(choices)})")
        return text

    return parse


# Where each script saves by default (--checkpoint_path or --snapshot_path):
# named after the script, so that the README's steps, run in one folder, never
# resume from, refuse or overwrite each other's files. A script not named here
# (your copy of one) saves as <checkpoint|snapshot>_<its name>.pt.
DEFAULT_OUTPUTS = {
    "singlegpu.py": "checkpoint_singlegpu.pt",
    "multigpu_spawn.py": "checkpoint_multigpu_spawn.pt",
    "multigpu_torchrun.py": "snapshot_multigpu_torchrun.pt",
    "multinode.py": "snapshot_multinode.pt",
    "multinode_fsdp.py": "snapshot_multinode_fsdp",  # a folder: one sub-folder per sharded save
    "train.py": None,  # train.py chooses: snapshot_train.pt (DDP) or the folder snapshot_train_fsdp (FSDP)
}
OUTPUT = "<named after the script: DEFAULT_OUTPUTS>"  # SCRIPT_FLAGS' default for the two paths

# The flags only some scripts take: name -> (argparse type, default, help).
SCRIPT_FLAGS = {
    "strategy": (_choice("ddp", "fsdp"), "ddp", "ddp: every rank holds the whole model (DistributedDataParallel); "
                                                "fsdp: each holds 1/world_size of it (FSDP2), snapshots sharded"),
    "checkpoint_path": (str, OUTPUT, "where to save the model's state_dict"),
    "world_size": (positive(int), None, "processes to start (default: the number of GPUs, "
                                        "or 2 on a machine without GPUs)"),
    "snapshot_path": (str, OUTPUT, "snapshot to resume from when it exists, and to save to"),
    "snapshot_every_steps": (non_negative_int, 0, "also snapshot every N steps inside an epoch, "
                                                  "so a restart loses at most N steps (0: only "
                                                  "at epoch ends)"),
    "pg_timeout_s": (positive(float), 600, "once training runs, seconds a collective may wait "
                                           "for the other ranks before the job fails, naming "
                                           "the ranks that did not arrive"),
    "startup_timeout_s": (positive(float), 1800, "the same during start-up and the first training "
                                                 "step (downloads, compilation)"),
}


# The models each built-in task accepts, first the default (what its task
# function passes to common.choose_model), for --model's help.
TASK_MODELS = {
    "synthetic": ("mlp", "linear"),
    "mnist": ("cnn",),
    "cifar10": ("resnet18", "resnet50", "resnet18_imagenet", "resnet50_imagenet"),
}


class _OneRankParser(argparse.ArgumentParser):
    """An ArgumentParser that, under torchrun, prints usage, help and errors
    from rank 0 only (every rank parses the same command line), and makes the
    error torchrun's root cause. Exit status 2 on an error, as argparse's."""

    def _print_message(self, message, file=None) -> None:
        if os.environ.get("RANK", "0") == "0":
            super()._print_message(message, file)

    def error(self, message: str):
        message += self._did_you_mean(message)
        report_to_torchrun(f"error: {message}")  # every rank: see one_line_errors
        super().error(message)

    def _did_you_mean(self, message: str) -> str:
        """For unrecognized flags, the flags meant: dashes for underscores
        (pytorch/examples' ``--batch-size``), ``--epochs`` for ``--total_epochs``,
        or a close spelling (difflib); '' when none is close."""
        if not message.startswith("unrecognized arguments:"):
            return ""
        known = [flag for action in self._actions for flag in action.option_strings]
        meant = []
        for word in message.split(":", 1)[1].split():
            if not word.startswith("--"):
                continue
            flag = word.split("=")[0]
            underscored = "--" + flag[2:].replace("-", "_")
            guess = (underscored if underscored in known else "--total_epochs" if flag == "--epochs"
                     else next(iter(difflib.get_close_matches(underscored, known, n=1, cutoff=0.8)), None))
            if guess:
                meant.append(f"{flag} -> {guess}")
        return f" (did you mean: {', '.join(meant)}?)" if meant else ""


def default_output(name: str, script: str) -> str:
    """The default of ``--<name>`` (checkpoint_path or snapshot_path) for the
    script file ``script`` (e.g. "multinode.py"): its ``DEFAULT_OUTPUTS``
    entry, else ``<checkpoint|snapshot>_<script without .py>.pt``."""
    if script in DEFAULT_OUTPUTS:
        return DEFAULT_OUTPUTS[script]
    return f"{name.split('_')[0]}_{os.path.splitext(script)[0]}.pt"


def _task_name(tasks: tuple) -> Callable[[str], str]:
    """argparse type for --dataset: one of ``tasks``, or a ``module:function``."""

    def parse(text: str) -> str:
        if text in tasks or (":" in text and all(text.split(":", 1))):
            return text
        raise argparse.ArgumentTypeError(
            f"invalid choice: {text!r} (choose from {', '.join(tasks)}, or module:function)")

    return parse


def parse_args(description: Optional[str], tasks: Iterable[str],
               script_flags: Iterable[str] = ()) -> argparse.Namespace:
    """Parse the command line: the flags every script shares, in the same
    order everywhere, then the ``script_flags`` (names of ``SCRIPT_FLAGS``).

    ``tasks`` are the names ``--dataset`` accepts (``common.TASKS``); a
    ``module:function`` (your own task, see docs/custom-task.md) is accepted
    too. Invalid values (zero or negative epochs, batch size, lr, save
    interval; an unknown dataset) end with argparse's usage line and exit 2.

    ``--checkpoint_path`` and ``--snapshot_path`` default to the running
    script's own name (``sys.argv[0]``) in ``DEFAULT_OUTPUTS``, e.g.
    ``snapshot_multinode.pt`` for multinode.py; ``--help`` shows it.
    """
    tasks = tuple(tasks)
    parser = _OneRankParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--total_epochs", type=positive(int), default=10, help="epochs to train (default: 10)")
    add("--save_every", type=positive(int), default=5,
        help="save every N epochs; the last epoch is always saved (default: 5)")
    add("--batch_size", type=positive(int), default=32,
        help="samples per step *per process*; the global batch size is "
             "batch_size x grad_accum_steps x world_size (default: 32)")
    add("--lr", type=positive(float), default=None,
        help="peak learning rate (default: the task's; synthetic 0.05)")
    add("--dataset", type=_task_name(tasks), default=tasks[0],
        help=f"task to train: {', '.join(tasks)}, or module:function for your own "
             f"(default: {tasks[0]}, needs no download)")
    models = "; ".join(f"{task} {', '.join(TASK_MODELS[task])}" for task in tasks if task in TASK_MODELS)
    add("--model", default=None,
        help=f"model for the task: {models}; your own task: what its task function accepts "
             f"(default: the task's first)")
    add("--data_dir", default=os.environ.get("DATA_DIR", "data"),
        help="dataset root, as torchvision expects it (default: $DATA_DIR or ./data)")
    add("--seed", type=int, default=0, help="seed for data split, model init, shuffling (default: 0)")
    add("--num_workers", type=non_negative_int, default=0,
        help="DataLoader worker processes per training process (default: 0)")
    add("--metrics_path", default=None,
        help="also write each epoch's summary as one JSON object per line here")
    add("--tensorboard_dir", default=None,
        help="also write each epoch's figures for TensorBoard here (needs: pip install tensorboard)")
    add("--wandb_project", default=None,
        help="also log the flags, each epoch's figures and the test figures to a Weights & Biases run "
             "in this project, from rank 0; a resumed run continues it; WANDB_MODE=offline, "
             "WANDB_ENTITY etc. apply (needs: pip install wandb)")
    add("--profile_dir", default=None,
        help="trace training steps 3-5 with torch.profiler on every rank, one trace file per rank "
             "here, for Perfetto or chrome://tracing (default: no profiler)")
    add("--input_path", choices=("fast", "torchvision"), default="fast",
        help="mnist/cifar10 input: 'fast' holds decoded uint8 images in memory and augments "
             "whole batches on the device; 'torchvision' is the per-sample Dataset + "
             "transforms path (default: fast)")
    add("--amp", nargs="?", const="auto", choices=("auto", "bf16", "fp16"), default=None,
        help="autocast for the training forward pass: bf16 where the GPU has it, else fp16 "
             "with a loss scaler; 'bf16' or 'fp16' forces one, also on a CPU (plain --amp on "
             "a CPU only where it was measured to help, see docs/performance.md)")
    add("--compile", action="store_true",
        help="torch.compile the training model (saved weights stay loadable without it)")
    add("--grad_accum_steps", type=positive(int), default=1,
        help="micro-batches of --batch_size per optimizer step (default: 1)")
    # The recipe (train_utils.recipe): each default is the task's choice (Task.recipe),
    # else common.RECIPE_DEFAULTS; see docs/recipes.md.
    add("--optimizer", choices=tuple(OPTIMIZERS), default=None,
        help="optimizer (default: the task's; synthetic sgd, momentum 0.9)")
    add("--weight_decay", type=non_negative_float, default=None,
        help="weight decay (default: the task's; synthetic 0)")
    add("--lr_schedule", choices=LR_SCHEDULES, default=None,
        help="learning rate over the run: constant, cosine (down to 0 one step after the last) or step "
             "(x --lr_gamma every --lr_step_epochs) (default: the task's; synthetic constant)")
    add("--warmup_epochs", type=non_negative_float, default=None,
        help="linear warm-up over this many (fractional) epochs of steps (default: the task's; 0)")
    add("--lr_step_epochs", type=positive(int), default=None,
        help="step schedule: epochs between decays (default: the task's; 1)")
    add("--lr_gamma", type=positive(float), default=None,
        help="step schedule: factor per decay (default: the task's; 0.1)")
    add("--clip_grad_norm", type=positive(float), default=None,
        help="clip the gradients' total L2 norm, over all ranks, to this (default: no clipping)")
    _add_script_flags(parser, list(script_flags))
    return parser.parse_args()


def _add_script_flags(parser: argparse.ArgumentParser, names: list) -> None:
    """Add the ``SCRIPT_FLAGS`` called ``names`` (--pg_timeout_s brings --startup_timeout_s)."""
    if "pg_timeout_s" in names:  # the two timeouts go together
        names.append("startup_timeout_s")
    for name in names:
        kind, default, text = SCRIPT_FLAGS[name]
        if default == OUTPUT:
            default = default_output(name, os.path.basename(sys.argv[0]))
        parser.add_argument(f"--{name}", type=kind, default=default,
                            help=text + (f" (default: {default})" if default is not None else ""))
