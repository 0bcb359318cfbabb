"""train.py's command line: every flag of the kit, one error line under torchrun.

The callers say what varies with them: the task names, each task's models,
the default snapshot paths (``parse_args``).
"""

from __future__ import annotations

import argparse
import difflib
import os
from typing import Callable, Iterable, Mapping, Optional

from recipes import DECAY_PARAMS, LR_SCHEDULES, OPTIMIZERS, RECIPE_DEFAULTS
from .errors import report_to_torchrun


def positive(kind: type, zero: bool = False) -> Callable[[str], object]:
    """argparse type: a ``kind`` (int or float) > 0, or with ``zero`` >= 0 and
    finite, else a one-line usage error."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            article = "an" if kind is int else "a"
            raise argparse.ArgumentTypeError(f"expected {article} {kind.__name__}, got {text!r}")
        if zero:
            if not 0 <= value < float("inf"):  # also rejects NaN
                finite = " and finite" if kind is float else ""
                raise argparse.ArgumentTypeError(f"must be >= 0{finite}, got {text}")
        elif not value > 0:  # also rejects NaN
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    return parse


non_negative_float = positive(float, zero=True)
non_negative_int = positive(int, zero=True)


def _choice(*choices: str) -> Callable[[str], str]:
    """argparse type: one of ``choices``, else a one-line usage error."""

    def parse(text: str) -> str:
        if text not in choices:
            raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {', '.join(choices)})")
        return text

    return parse


class _OneRankParser(argparse.ArgumentParser):
    """An ArgumentParser that, under torchrun, prints help and errors from
    rank 0 only (every rank parses the same command line), an error as one
    line without the usage, and makes it torchrun's root cause. Exit status 2
    on an error, as argparse's."""

    def _print_message(self, message, file=None) -> None:
        if os.environ.get("RANK", "0") == "0":
            super()._print_message(message, file)

    def error(self, message: str):
        """argparse's usage and error, exit 2; under torchrun the error line
        alone (a pointer to --help instead of the usage), which torchrun's
        own failure report follows."""
        message += self._did_you_mean(message)
        report_to_torchrun(f"error: {message}")  # every rank: see one_line_errors
        if "TORCHELASTIC_RUN_ID" not in os.environ:
            super().error(message)
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help lists every flag)\n")

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
            if underscored in known:
                guess = underscored
            elif flag == "--epochs":
                guess = "--total_epochs"
            else:
                close = difflib.get_close_matches(underscored, known, n=1, cutoff=0.8)
                guess = close[0] if close else None
            if guess:
                meant.append(f"{flag} -> {guess}")
        return f" (did you mean: {', '.join(meant)}?)" if meant else ""


def _task_name(tasks: tuple) -> Callable[[str], str]:
    """argparse type for --dataset: one of ``tasks``, or a ``module:function``
    (``file.py:function``, ``dir/file.py:function``)."""

    def parse(text: str) -> str:
        if text in tasks or (":" in text and all(text.split(":", 1))):
            return text
        raise argparse.ArgumentTypeError(
            f"invalid choice: {text!r} (choose from {', '.join(tasks)}, or module:function "
            f"or file.py:function)")

    return parse


def parse_args(description: Optional[str], tasks: Iterable[str], *,
               models: Optional[Mapping[str, Iterable[str]]] = None,
               snapshot_paths: Optional[Mapping[str, str]] = None) -> argparse.Namespace:
    """Parse the command line (``sys.argv``): every flag of the kit, in a fixed order.

    ``tasks`` are the names ``--dataset`` accepts (``common.TASKS``), the first
    the default; a ``module:function`` (your own task, see docs/custom-task.md)
    is accepted too. ``models``: each task's models, the default first, for
    --model's help (``common.task_models()``). ``snapshot_paths``: the default
    --snapshot_path of each --strategy (None: no default). Invalid values
    (zero epochs, an unknown dataset, ...) end with argparse's usage line, exit status 2.
    """
    tasks = tuple(tasks)
    # allow_abbrev=False: a misspelt flag (--total_epoch) is an error naming the one meant, not taken for it.
    parser = _OneRankParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter,
                            allow_abbrev=False)
    _add_training_flags(parser, tasks, models or {})
    _add_output_flags(parser)
    _add_speed_flags(parser)
    _add_recipe_flags(parser)
    _add_run_flags(parser, snapshot_paths or {})
    args = parser.parse_args()
    if args.snapshot_path is None and snapshot_paths:
        args.snapshot_path = snapshot_paths[args.strategy]
    return args


def _add_training_flags(parser: argparse.ArgumentParser, tasks: tuple,
                        models: Mapping[str, Iterable[str]]) -> None:
    """What to train, on what, for how long: --total_epochs ... --num_workers."""
    add = parser.add_argument
    add("--total_epochs", type=positive(int), default=10, help="epochs to train (default: 10)")
    add("--save_every", type=positive(int), default=5,
        help="save every N epochs; the last epoch is always saved (default: 5)")
    add("--batch_size", type=positive(int), default=None,
        help="samples per step *per process*; the global batch size is "
             "batch_size x grad_accum_steps x world_size (default: the task's; 32, shakespeare_char 12)")
    add("--lr", type=positive(float), default=None,
        help="peak learning rate (default: the task's; synthetic 0.05)")
    add("--dataset", type=_task_name(tasks), default=tasks[0],
        help=f"task to train: {', '.join(tasks)}, or module:function (or file.py:function, "
             f"dir/file.py:function) for your own (default: {tasks[0]}, needs no download)")
    listed = "".join(f"{task} {', '.join(models[task])}; " for task in tasks if task in models)
    add("--model", default=None,
        help=f"model for the task: {listed}your own task: what its task function accepts "
             f"(default: the task's first)")
    add("--data_dir", default=os.environ.get("DATA_DIR", "data"),
        help="dataset root, as torchvision expects it (default: $DATA_DIR or ./data)")
    add("--seed", type=int, default=0, help="seed for data split, model init, shuffling (default: 0)")
    add("--num_workers", type=non_negative_int, default=0,
        help="DataLoader worker processes per training process (default: 0)")
    add("--n_layer", type=positive(int), default=None, help="GPT tasks: transformer blocks (default: the task's)")
    add("--n_head", type=positive(int), default=None, help="GPT tasks: heads (default: the task's)")
    add("--n_embd", type=positive(int), default=None, help="GPT tasks: width (default: the task's)")
    add("--block_size", type=positive(int), default=None, help="GPT tasks: context, tokens (default: the task's)")
    add("--dropout", type=non_negative_float, default=None,
        help="GPT tasks: dropout probability (default: the task's)")


def _add_output_flags(parser: argparse.ArgumentParser) -> None:
    """Where figures, samples and traces go besides stdout, and how often the
    held-out loss is measured: --metrics_path ... --profile_dir."""
    add = parser.add_argument
    add("--metrics_path", default=None,
        help="also write each epoch's summary as one JSON object per line here")
    add("--tensorboard_dir", default=None,
        help="also write each epoch's figures for TensorBoard here (needs: pip install tensorboard)")
    add("--wandb_project", default=None,
        help="also log the flags, each epoch's figures and the test figures to a Weights & Biases run "
             "in this project, from rank 0; a resumed run continues it; WANDB_MODE=offline, "
             "WANDB_ENTITY etc. apply (needs: pip install wandb)")
    add("--sample_chars", type=non_negative_int, default=0,
        help="LM tasks: characters the model writes, printed after training and on a rerun of a "
             "finished run; 0: none (default: 0)")
    add("--temperature", type=positive(float), default=0.8, help="--sample_chars: logits / this (default: 0.8)")
    add("--top_k", type=positive(int), default=200, help="--sample_chars: from the k likeliest (default: 200)")
    add("--log_every_steps", type=non_negative_int, default=None,
        help="also print a progress line on rank 0 every N optimizer steps, in a log file as on a terminal: "
             "step, epoch, loss, lr, samples/s or tokens/s, ms a step; 0: none "
             f"(default: the task's; shakespeare_char 100, else {RECIPE_DEFAULTS['log_every_steps']})")
    add("--eval_every_steps", type=non_negative_int, default=None,
        help="evaluate every N optimizer steps of the run, and after its last, instead of after every epoch "
             "(nanoGPT's eval_interval), each evaluation one summary line and metrics record with the best "
             "validation loss so far; 0: after every epoch "
             f"(default: the task's; tokens 2000, else {RECIPE_DEFAULTS['eval_every_steps']})")
    add("--eval_windows", type=non_negative_int, default=None,
        help="held-out samples (a language model's windows) each evaluation scores: a fixed subset drawn "
             "from --seed, the same in every evaluation and every run (nanoGPT's eval_iters x batch_size); "
             f"0: all (default: the task's; tokens 2400, else {RECIPE_DEFAULTS['eval_windows']})")
    add("--profile_dir", default=None,
        help="trace training steps 3-5 with torch.profiler on every rank, one trace file per rank "
             "here, for Perfetto or chrome://tracing (default: no profiler)")


def _add_speed_flags(parser: argparse.ArgumentParser) -> None:
    """How the steps run: --input_path ... --activation_checkpointing."""
    add = parser.add_argument
    add("--input_path", choices=("fast", "torchvision"), default="fast",
        help="mnist/cifar10 input: 'fast' holds decoded uint8 images in memory and augments "
             "whole batches on the device; 'torchvision' is the per-sample Dataset + "
             "transforms path (default: fast)")
    add("--amp", nargs="?", const="auto", choices=("auto", "bf16", "fp16"), default=None,
        help="autocast for the training forward pass: bf16 where every GPU of the job has it, else fp16 "
             "with a loss scaler; 'bf16' or 'fp16' forces one, also on a CPU (plain --amp on "
             "a CPU only where it was measured to help, see docs/performance.md)")
    add("--compile", action="store_true",
        help="torch.compile the training model, under FSDP each transformer block (saved weights stay "
             "loadable without it)")
    add("--no_tf32", action="store_true",
        help="on GPUs, fp32 matmuls and convolutions in full fp32 instead of on TF32 tensor cores "
             "(default: TF32 on Ampere or newer, torch.set_float32_matmul_precision('high'))")
    add("--deterministic", action="store_true",
        help="bitwise-repeatable GPU kernels (deterministic algorithms, cuBLAS workspace, cuDNN): a GPU run "
             "stopped and resumed ends bitwise equal to one that never stopped; slower (default: off; "
             "CPU runs are repeatable without it)")
    add("--grad_accum_steps", type=positive(int), default=1,
        help="micro-batches of --batch_size per optimizer step (default: 1)")
    add("--global_batch_size", type=positive(int), default=None,
        help="keep this global batch at any world size: --grad_accum_steps becomes it / (batch_size x "
             "world_size), which must divide it (elastic jobs; default: off)")
    add("--activation_checkpointing", action="store_true",
        help="recompute each transformer block's activations in the backward pass: less memory, "
             "the same losses (default: off)")


def _add_recipe_flags(parser: argparse.ArgumentParser) -> None:
    """The recipe (train_utils.recipe): each default is the task's choice
    (Task.recipe), else recipes.RECIPE_DEFAULTS; see docs/recipes.md."""
    add = parser.add_argument
    add("--optimizer", choices=tuple(OPTIMIZERS), default=None,
        help="optimizer (default: the task's; synthetic sgd, momentum 0.9)")
    add("--weight_decay", type=non_negative_float, default=None,
        help="weight decay (default: the task's; synthetic 0)")
    add("--lr_schedule", choices=LR_SCHEDULES, default=None,
        help="learning rate over the run: constant, cosine (down to --min_lr one step after the last) or step "
             "(x --lr_gamma every --lr_step_epochs) (default: the task's; synthetic constant)")
    add("--warmup_epochs", type=non_negative_float, default=None,
        help="linear warm-up over this many (fractional) epochs of steps (default: the task's; 0)")
    add("--clip_grad_norm", type=non_negative_float, default=None,
        help="clip the gradients' total L2 norm, over all ranks, to this; 0: no clipping (default: the task's; 0)")
    add("--max_steps", type=non_negative_int, default=None,
        help="optimizer steps to train, the last epoch cut short; 0: --total_epochs "
             f"(default: the task's; {RECIPE_DEFAULTS['max_steps']})")
    add("--warmup_steps", type=non_negative_int, default=None,
        help="linear warm-up over this many optimizer steps (--warmup_epochs 0) "
             f"(default: the task's; {RECIPE_DEFAULTS['warmup_steps']})")
    add("--min_lr", type=non_negative_float, default=None,
        help=f"where the cosine ends (default: the task's; {RECIPE_DEFAULTS['min_lr']})")
    add("--beta1", type=non_negative_float, default=None,
        help=f"AdamW's beta1 (default: the task's; {RECIPE_DEFAULTS['beta1']})")
    add("--beta2", type=non_negative_float, default=None,
        help=f"AdamW's beta2 (default: the task's; {RECIPE_DEFAULTS['beta2']})")
    add("--lr_step_epochs", type=positive(int), default=None,
        help=f"step schedule: epochs between decays (default: the task's; {RECIPE_DEFAULTS['lr_step_epochs']})")
    add("--lr_gamma", type=positive(float), default=None,
        help=f"step schedule: factor per decay (default: the task's; {RECIPE_DEFAULTS['lr_gamma']})")
    add("--decay_params", choices=DECAY_PARAMS, default=None,
        help="all: every parameter decays; matrices: 2-D ones only, not biases or norms (default: the task's; all)")


def _add_run_flags(parser: argparse.ArgumentParser, snapshot_paths: Mapping[str, str]) -> None:
    """How the run is spread, snapshotted and timed out: --strategy ... --startup_timeout_s."""
    add = parser.add_argument
    add("--strategy", type=_choice("ddp", "fsdp"), default="ddp",
        help="ddp: every rank holds the whole model (DistributedDataParallel); fsdp: each holds "
             "1/world_size of it (FSDP2), snapshots sharded (default: ddp)")
    defaults = ", ".join(f"{path} with --strategy {strategy}" for strategy, path in snapshot_paths.items())
    add("--snapshot_path", default=None,
        help="snapshot to resume from when it exists, and to save to"
             + (f" (default: {defaults})" if defaults else ""))
    add("--snapshot_every_steps", type=non_negative_int, default=0,
        help="also snapshot every N steps inside an epoch, so a restart loses at most N steps "
             "(0: only at epoch ends) (default: 0)")
    add("--snapshot_every_s", type=non_negative_float, default=0,
        help="also snapshot inside an epoch once this many seconds have passed since the last "
             "snapshot, e.g. 60 (0: off) (default: 0)")
    add("--snapshot_sync", action="store_true",
        help="write each snapshot before training goes on (default: a CPU copy written in the "
             "background, one write at a time)")
    add("--pg_timeout_s", type=positive(float), default=600,
        help="once training runs, seconds a collective may wait for the other ranks before the job "
             "fails: on the CPU (gloo) rank 0 names the ranks that did not arrive; on GPUs (NCCL) "
             "NCCL's watchdog ends every waiting rank (SIGABRT) and the flight recorder's dumps "
             "name the collective (docs/runs.md) (default: 600)")
    add("--startup_timeout_s", type=positive(float), default=1800,
        help="the same during start-up and the first training step (downloads, compilation); a rank "
             "that never joins ends the job with one line from every rank that waited (default: 1800)")
