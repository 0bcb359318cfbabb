"""train.py's command line: every flag of the kit, one error line under torchrun.

The callers say what varies with them: the task names, each task's models,
the default snapshot paths (``parse_args``).
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from typing import Callable, Iterable, Mapping, Optional, Sequence

import common
from . import config
from .errors import report_to_torchrun


def first_worker_to_say(what: str) -> bool:
    """Under torchrun: True for the first of this node's workers to call it
    with ``what``, False for the others (an exclusive file named ``what`` in
    the folder torchrun gives this attempt's workers' error files), so that a
    line every rank would print appears once whichever rank gets there
    first: torchrun ends the other workers as soon as one exits, and rank 0
    may be the slower. Elsewhere: True on rank 0 alone."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not error_file:
        return os.environ.get("RANK", "0") == "0"
    try:  # <run's folder>/attempt_<n>/<local rank>/error.json
        os.close(os.open(os.path.join(os.path.dirname(os.path.dirname(error_file)), what),
                         os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False
    except OSError:  # no folder to share: rank 0 says it
        return os.environ.get("RANK", "0") == "0"


class _OneRankParser(argparse.ArgumentParser):
    """An ArgumentParser that, under torchrun, prints help from rank 0 only
    (every rank parses the same command line) and an error once, from the
    first worker to meet it (``first_worker_to_say``), as one line without
    the usage, and makes it torchrun's root cause. Exit status 2 on an
    error, as argparse's."""

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
        if first_worker_to_say("usage-error"):
            sys.stderr.write(f"{self.prog}: error: {message} ({self.prog} --help lists every flag)\n")
            sys.stderr.flush()
        sys.exit(2)

    def _did_you_mean(self, message: str) -> str:
        """For unrecognized flags, the flags meant: dashes for underscores
        (pytorch/examples' ``--batch-size``), another tool's name for the same
        setting (``OTHER_NAMES``: ``--epochs``, nanoGPT's ``--learning_rate``),
        the program that does what a flag asks (``PROGRAMS``), or a close
        spelling (difflib); '' when none is close."""
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
            elif flag in OTHER_NAMES:
                guess = OTHER_NAMES[flag]
            elif flag in PROGRAMS:
                guess = PROGRAMS[flag]
            else:
                close = difflib.get_close_matches(underscored, known, n=1, cutoff=0.8)
                guess = close[0] if close else None
            if guess:
                meant.append(f"{flag} -> {guess}")
        return f" (did you mean: {', '.join(meant)}?)" if meant else ""


# The same settings under the names of the tools users come from: pytorch/examples'
# --epochs, nanoGPT's train.py configuration (its names: karpathy/nanoGPT train.py).
OTHER_NAMES = {
    "--epochs": "--total_epochs",
    "--learning_rate": "--lr",
    "--max_iters": "--max_steps",
    "--eval_interval": "--eval_every_steps",
    "--eval_iters": "--eval_windows",
    "--log_interval": "--log_every_steps",
    "--warmup_iters": "--warmup_steps",
    "--gradient_accumulation_steps": "--grad_accum_steps",
    "--grad_clip": "--clip_grad_norm",
    "--out_dir": "--snapshot_path",
    "--dtype": "--amp",
}
# What a program beside train.py does, asked of train.py as a flag: the program, given the same flags.
PROGRAMS = {"--check_resume": "tools/check_resume.py, with the same flags"}


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
               models: Optional[Callable[[], Mapping[str, Iterable[str]]]] = None,
               snapshot_paths: Optional[Mapping[str, str]] = None, argv: Optional[Sequence[str]] = None,
               prog: Optional[str] = None) -> argparse.Namespace:
    """Parse the command line ``argv`` (None: this process's, ``sys.argv[1:]``),
    which ``prog`` names in usage and error lines (None: this script's
    name): every flag of the kit (``config.RunConfig``'s, in its order), then
    the task modules' own (``task_flags``): the flags of the module of the
    task --dataset names, and only where --help asks for them, or the
    command line holds a flag the kit and that module do not know, those of
    every built-in task module too (each import costs its module's start-up:
    torchvision's 1.5 s of CPU for the image tasks).

    ``tasks`` are the names ``--dataset`` accepts (``common.TASKS``), the first
    the default; a ``module:function`` (your own task, see docs/custom-task.md)
    is accepted too. ``models``: () -> each task's models, the default first,
    for --model's help (``task_models``), called for --help only.
    ``snapshot_paths``: the default --snapshot_path of each --strategy
    (None: no default). Every flag the task's recipe gives is None where
    the command line leaves it unset (``config.resolve_config`` fills it).
    Invalid values (zero epochs, an unknown dataset, ...) end with
    argparse's usage line, exit status 2.
    """
    tasks = tuple(tasks)
    argv = list(sys.argv[1:] if argv is None else argv)
    dataset = _dataset_on_command_line(argv) or tasks[0]
    if not {"-h", "--help"} & set(argv):
        parser = _parser(description, prog, tasks, {}, snapshot_paths or {}, task_flags((dataset,)))
        args, unknown = parser.parse_known_args(argv)
        if not unknown:
            return _with_snapshot_path(args, snapshot_paths)
    # --help, or a flag the task does not know (another task's, a misspelt one): every task's flags.
    every = tuple(dict.fromkeys((*tasks, dataset)))
    parser = _parser(description, prog, tasks, models() if models else {}, snapshot_paths or {}, task_flags(every))
    return _with_snapshot_path(parser.parse_args(argv), snapshot_paths)


def _parser(description: Optional[str], prog: Optional[str], tasks: tuple, models: Mapping[str, Iterable[str]],
            snapshot_paths: Mapping[str, str], flags_of: Mapping[str, dict]) -> argparse.ArgumentParser:
    """train.py's parser (named ``prog``): the kit's flags, and each task module's of ``flags_of`` in a
    group of its own. A flag two modules declare (token_tasks.py's GPT flags are text_tasks.py's) is
    listed once, in the group of the first, whose title names the other's tasks too."""
    # allow_abbrev=False: a misspelt flag (--total_epoch) is an error naming the one meant, not taken for it.
    parser = _OneRankParser(prog=prog, description=description,
                            formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    groups: dict = {}
    for spec in config.flags():
        group = groups.setdefault(spec.metadata["group"], parser.add_argument_group(spec.metadata["group"]))
        options = dict(spec.metadata["argparse"], help=spec.metadata["help"],
                       default=None if spec.metadata["task_default"] else spec.default)
        options.update(_dynamic(spec.name, tasks, models, snapshot_paths))
        group.add_argument(f"--{spec.name}", **options)
    listed: set = set()
    for module, flags in flags_of.items():
        own = [name for name in flags if name not in listed]
        sharing = [task for other, its in flags_of.items() if other != module and set(own) & set(its)
                   for task in _tasks_of(other, tasks)]
        too = f"; {', '.join(sharing)} too" if sharing else ""
        group = parser.add_argument_group(f"flags of {module}.py's tasks ({', '.join(_tasks_of(module, tasks))}{too})")
        for name in own:
            group.add_argument(f"--{name}", **{"default": None, **flags[name]})
        listed.update(own)
    return parser


def _with_snapshot_path(args: argparse.Namespace, snapshot_paths: Optional[Mapping[str, str]]) -> argparse.Namespace:
    """``args`` with --snapshot_path's default for its --strategy, where it has none."""
    if args.snapshot_path is None and snapshot_paths:
        args.snapshot_path = snapshot_paths[args.strategy]
    return args


def _dynamic(name: str, tasks: tuple, models: Mapping[str, Iterable[str]],
             snapshot_paths: Mapping[str, str]) -> dict:
    """The argparse options of a flag that depend on the caller or the
    environment: --dataset's names, --model's list, --data_dir's $DATA_DIR,
    --snapshot_path's defaults."""
    if name == "dataset":
        return {"type": _task_name(tasks), "default": tasks[0],
                "help": f"task to train: {', '.join(tasks)}, or module:function (or file.py:function, "
                        f"dir/file.py:function) for your own (default: {tasks[0]}, needs no download)"}
    if name == "model":
        listed = "".join(f"{task} {', '.join(models[task])}; " for task in tasks if task in models)
        return {"help": f"model for the task: {listed}your own task: what its task function accepts "
                        f"(default: the task's first)"}
    if name == "data_dir":
        return {"default": os.environ.get("DATA_DIR", "data")}
    if name == "snapshot_path" and snapshot_paths:
        strategies = {path: [s for s, p in snapshot_paths.items() if p == path] for path in snapshot_paths.values()}
        defaults = ", ".join(f"{path} with --strategy {' or '.join(names)}" for path, names in strategies.items())
        return {"help": f"snapshot to resume from when it exists, and to save to (default: {defaults})"}
    return {}


def task_flags(tasks: tuple) -> dict:
    """{module name: its ``FLAGS``} of the modules of ``tasks`` (short names
    of ``common.TASKS``, or ``module:function``s) that import and declare
    flags (a task of your own may too: docs/custom-task.md). ``FLAGS``:
    {flag name: ``argparse.ArgumentParser.add_argument``'s keyword
    arguments}, the flags the module's task functions read from ``args``;
    unset, a flag is None (the task's default)."""
    found: dict = {}
    for task in tasks:
        try:
            module = sys.modules[common.task_function(common.TASKS.get(task, task)).__module__]
        except (common.ConfigError, KeyError):  # not there: --dataset's own error says so later
            continue
        flags = getattr(module, "FLAGS", None)
        if flags:
            found.setdefault(module.__name__, flags)
    return found


def output_flags(dataset: str) -> tuple[str, ...]:
    """The flags of the module of the task --dataset names (``task_flags``)
    that say what a trained model writes, not what the run learns: the
    module's ``OUTPUT_FLAGS`` (text_tasks': --sample_chars, --temperature,
    --top_k). Outside a run's identity and its recipe; () for a module that
    declares none."""
    module = next(iter(task_flags((dataset,))), None)
    return tuple(getattr(sys.modules.get(module), "OUTPUT_FLAGS", ())) if module else ()


def task_models() -> dict[str, tuple[str, ...]]:
    """The models each task of ``common.TASKS`` accepts, its default first, for
    --model's help: {short name: models}, read from the ``MODELS`` dict of the
    task's module ({task function name: models}, what the task function
    passes to ``common.choose_model``; every built-in task module exports one). A
    task whose module exports none, or cannot be imported (a copy of the
    scripts without it), is left out."""
    found = {}
    for name, spec in common.TASKS.items():
        try:
            function = common.task_function(spec)
        except common.ConfigError:
            continue
        models = getattr(sys.modules[function.__module__], "MODELS", {}).get(function.__name__)
        if models:
            found[name] = tuple(models)
    return found


def task_flag_values(args: argparse.Namespace) -> dict:
    """{flag: value} of the flags the task --dataset names reads (its module's
    ``FLAGS``), as ``args`` holds them. Raises ConfigError (one line) for a
    flag of another task module given on the command line (a value other
    than its default): the task would not read it."""
    own = next(iter(task_flags((args.dataset,)).values()), {})
    kit = {spec.name for spec in config.flags()}
    if set(vars(args)) - kit - set(own):  # parsed with every task's flags: one of them given?
        every = task_flags(tuple(common.TASKS))
        for name, flags in every.items():
            given = [flag for flag, options in flags.items()
                     if flag not in own and getattr(args, flag, None) not in (None, options.get("default"))]
            if given:
                readers = [task for module, its in every.items() if given[0] in its
                           for task in _tasks_of(module, tuple(common.TASKS))]
                raise common.ConfigError(f"--{given[0]} is a flag of {name}.py's tasks, which --dataset "
                                         f"{args.dataset} does not read; leave it out, or train one of "
                                         f"{', '.join(readers)}")
    return {flag: getattr(args, flag) for flag in own}


def _dataset_on_command_line(argv: list) -> Optional[str]:
    """--dataset's value on the command line ``argv``, before the whole parse; None where absent."""
    probe = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    probe.add_argument("--dataset")
    known, _ = probe.parse_known_args(argv)
    return known.dataset


def _tasks_of(module: str, tasks: tuple) -> list:
    """The short names of ``tasks`` whose function is in ``module`` (or the module itself when none is)."""
    names = [task for task in tasks if common.TASKS.get(task, task).split(":")[0] == module]
    return names or [module]
