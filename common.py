"""The task contract: what a task is, how ``--dataset`` finds one, the synthetic task.

Every script trains a ``Task``, built by a task function ``(args, download) ->
Task`` that ``--dataset`` names: by a short name in ``TASKS``, as
``module:function``, or by its file (``my_task.py:function``,
``dir/my_task.py:function``). A task of your own goes in its own file, found
the same way as the built-ins (docs/custom-task.md): the scripts, train_utils
and this file need no edit. What a task's recipe means is recipes.py's. This
module imports no training machinery, so a task module can import it alone.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset, Subset, default_collate

VAL_FRACTION = 0.1  # of the official train split, seeded, the same on every rank


class ConfigError(Exception):
    """A mistake in the user's input or environment (bad flag, missing data,
    incompatible snapshot), raised with a one-line message that says what is
    wrong and what to do; the scripts print it as that line and exit 2,
    without a traceback."""


def identity(source: torch.Tensor) -> torch.Tensor:
    """The default batch transform: the inputs already are the model's input."""
    return source


class Batch(tuple):
    """A batch a dataset assembled itself, (inputs, targets); ``collate`` passes it through."""


def collate(batch):
    """The default ``Task.collate_fn``: a ``Batch`` (from a dataset's
    ``__getitems__``, e.g. ``fast_images.InMemoryImages``) passes through; a
    list of per-sample items is stacked by ``default_collate``, and refused
    (ConfigError) when their tensors differ in size."""
    if isinstance(batch, Batch):
        return tuple(batch)
    try:
        return default_collate(batch)
    except RuntimeError as exc:
        if not any(sign in str(exc) for sign in ("stack expects each tensor to be equal size",
                                                 "each element in list of batch should be of equal size")):
            raise
        raise ConfigError(f"the task's items differ in size ({exc}), so the default batching cannot "
                          f"stack them; give the Task a collate_fn that makes one batch of them, e.g. "
                          f"by padding (docs/custom-task.md)") from None


class _ModelOrFactory:
    """``Task.model``'s descriptor: a task gives an ``nn.Module``, or a
    function of no arguments that builds one (its model factory, kept as
    ``Task.model_factory``). Reading ``task.model`` gives the module, a
    factory's built at the first read, from the global RNG as it stands
    then; setting it to a module replaces the model (and the factory: wrap
    a factory's model in a factory, ``lambda: Wrapper(factory())``, to keep
    the meta-device build). A dataclass field
    whose descriptor raises AttributeError when read on the class has no
    default (Python's dataclasses docs, "Descriptor-typed fields")."""

    def __get__(self, task: Optional["Task"], owner: type = None) -> nn.Module:
        if task is None:
            raise AttributeError("model")  # on the class: no default, a Task must be given one
        if task.__dict__.get("_model") is None and task.model_factory is not None:
            task.__dict__["_model"] = task.model_factory()
        return task.__dict__.get("_model")

    def __set__(self, task: "Task", value) -> None:
        if value is None or isinstance(value, nn.Module):  # None: a Task of no model, for tools and tests
            task.__dict__.update(_model=value, _factory=None)  # the module replaces a factory's
        elif callable(value):
            task.__dict__.update(_model=None, _factory=value)
        else:
            raise ConfigError(f"Task.model must be an nn.Module or a function of no arguments that builds one, "
                            f"not {type(value).__name__}")


@dataclass
class Task:
    """Everything a script needs to train one dataset.

    Items of the datasets are (input, target) pairs; ``collate_fn`` (a
    DataLoader's: a list of items -> (inputs, targets), batch first) makes
    batches of them. A task of variable-length items gives its own, e.g. one
    that pads, as a top-level function (DataLoader workers are sent it).
    ``test_set`` None: the task has no test split, and no test line is printed.
    ``loss_fn(output, targets, reduction="mean"|"sum")``: the mean (training)
    or the sum (evaluation) of the per-sample losses, as ``F.mse_loss`` and
    ``F.cross_entropy`` do. ``model``: an ``nn.Module``, or a model factory,
    a function of no arguments that builds one from the global RNG
    (``model_factory``): a factory lets train.py build the model under FSDP
    and HSDP on the meta device, with no memory, and give each rank only
    its shards (``train_utils.build_on_meta``), while ``task.model`` builds
    it whole where the model is read (DDP, the rungs). ``classification``: the model outputs (N, classes)
    logits and the targets are int64 (N,) class indices; evaluation then
    reports accuracy too. ``train_transform``/``eval_transform``: a batch's
    inputs, on the device -> the model's input (e.g.
    ``fast_images.DeviceTransform``). ``recipe``: the task's values of the
    recipe flags (keys of ``recipes.RECIPE_DEFAULTS``); the command line's win.

    For train.py: a language model's ``tokens_per_sample`` (its context
    length; 0: not counted in tokens), ``decode`` (token ids -> text) and
    ``encode`` (text -> token ids); ``flops_per_sample``, the training FLOPs
    of one sample (None: train.py counts them); ``identity``, what else
    beside --dataset, --model and --seed makes two runs the same (the GPT's
    sizes: train.py refuses a snapshot of another); ``sample_text``, (the
    trained model, its device) -> the text it writes after training;
    ``corpus``, what a language model reads, for the kit's task line (its
    files or text, tokens and vocabulary; "": not said).
    """

    train_set: Dataset
    val_set: Dataset
    test_set: Optional[Dataset]
    model: nn.Module = _ModelOrFactory()
    loss_fn: Callable[..., torch.Tensor]
    classification: bool
    train_transform: Callable[[torch.Tensor], torch.Tensor] = field(default=identity)
    eval_transform: Callable[[torch.Tensor], torch.Tensor] = field(default=identity)
    recipe: dict = field(default_factory=dict)
    collate_fn: Callable[[list], tuple] = field(default=collate)
    tokens_per_sample: int = 0
    decode: Optional[Callable[[Sequence[int]], str]] = None
    encode: Optional[Callable[[str], list]] = None
    flops_per_sample: Optional[float] = None
    identity: dict = field(default_factory=dict)
    sample_text: Optional[Callable[[nn.Module, torch.device], str]] = None
    corpus: str = ""

    @property
    def model_factory(self) -> Optional[Callable[[], nn.Module]]:
        """The function of no arguments the task gave as its model, which
        builds it (None: the task gave a built ``nn.Module``)."""
        return self.__dict__.get("_factory")


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that FSDP shards one by one (the FSDP rung's
    and train.py's, ``train_utils.shard_model``); the root, sharded after them, takes the
    parameters left. A transformer (an ``nn.ModuleList`` named ``blocks``, as
    ``gpt.GPT`` has): its blocks that hold parameters, so that embeddings,
    the final norm and an output layer tied to the embedding stay in the root.
    Any other model: the root's children that hold parameters, a container
    child's (``nn.Sequential``, ``nn.ModuleList``: ResNet's residual blocks)
    children instead, and none that shares a parameter with another.
    """
    if isinstance(getattr(model, "blocks", None), nn.ModuleList):
        return [block for block in model.blocks if next(block.parameters(), None) is not None]
    units = []
    for child in model.children():
        parts = list(child.children()) if isinstance(child, (nn.Sequential, nn.ModuleList)) else [child]
        units += [part for part in parts if next(part.parameters(), None) is not None]
    owners: dict = {}  # parameter -> the units holding it
    for unit in units:
        for param in unit.parameters():
            owners.setdefault(param, set()).add(unit)
    return [unit for unit in units if all(len(owners[p]) == 1 for p in unit.parameters())]


# The short names --dataset accepts, each a task function as "module:function",
# the form --dataset takes for yours; the first is the default.
TASKS: dict[str, str] = {
    "synthetic": "common:synthetic_task",
    "mnist": "vision_tasks:mnist_task",
    "cifar10": "vision_tasks:cifar10_task",
    "shakespeare_char": "text_tasks:shakespeare_char_task",
    "tokens": "token_tasks:token_file_task",
}


def task_function(spec: str) -> Callable[[argparse.Namespace, bool], Task]:
    """The task function ``spec`` names, imported: ``"module:function"``, or
    ``"file.py:function"`` / ``"dir/file.py:function"`` (a path from the
    current folder, or absolute). A module is looked for on ``sys.path`` (the
    scripts' folder, then PYTHONPATH), then in the current folder; a file is
    imported as the module its name makes (``_task_file_module``). Raises
    ConfigError (one line) when the module, the file or the function is not there.
    """
    module_name, _, function = spec.partition(":")
    if os.getcwd() not in sys.path:  # Python searches the script's folder, not the current one
        sys.path.append(os.getcwd())
    if module_name.endswith(".py") or os.sep in module_name or "/" in module_name:
        module_name = _task_file_module(module_name, function)
    try:
        return getattr(importlib.import_module(module_name), function)
    except (ImportError, AttributeError) as exc:
        reason = str(exc)
        missing = getattr(exc, "name", None)
        if isinstance(exc, ModuleNotFoundError) and missing and (module_name + ".").startswith(missing + "."):
            scripts = os.path.abspath(sys.path[0]) if sys.path and sys.path[0] else os.getcwd()
            reason = (f"no {module_name.replace('.', '/')}.py beside the scripts ({scripts}), in the "
                      f"current folder ({os.getcwd()}) or on PYTHONPATH "
                      f"({os.environ.get('PYTHONPATH') or 'not set'}); put it in one of them")
        raise ConfigError(f"cannot load task function {function!r} from module "
                          f"{module_name!r} ({reason})") from None


# The folders of the task files --dataset named by path: the kit's DataLoader workers import from them.
TASK_FILE_FOLDERS: list[str] = []


def _task_file_module(path: str, function: str) -> str:
    """The module name of the task file at ``path`` (``dir/my_task.py`` ->
    ``my_task``), its folder put first on ``sys.path`` so that this process
    and its DataLoader workers import it by that name. Raises ConfigError when
    the file is missing, its name is no module name, or another file's module
    of that name is imported already."""
    name = os.path.splitext(os.path.basename(path))[0]
    if not os.path.isfile(path):
        raise ConfigError(f"cannot load task function {function!r}: no file {path} (from the current "
                          f"folder {os.getcwd()}); give its path, or module:function for a module on "
                          f"PYTHONPATH")
    if not path.endswith(".py") or not name.isidentifier():
        raise ConfigError(f"cannot load task function {function!r} from {path}: a task file is imported "
                          f"as a module, so its name must be one (letters, digits, _) ending in .py")
    folder = os.path.dirname(os.path.abspath(path))
    loaded = getattr(sys.modules.get(name), "__file__", None)
    if loaded and not os.path.samefile(loaded, path):
        raise ConfigError(f"cannot load task function {function!r} from {path}: a module named {name} "
                          f"is already imported from {loaded}; rename your file")
    for folders in (sys.path, TASK_FILE_FOLDERS):
        if folder in folders:
            folders.remove(folder)
        folders.insert(0, folder)
    return name


def load_task(args: argparse.Namespace, download: bool) -> Task:
    """The task ``args.dataset`` names (a key of ``TASKS``, or what
    ``task_function`` takes), built by its task function. That reads what it
    needs from ``args`` (data_dir, seed, model, ...), sets ``args.model`` to
    the model it chose, and downloads missing files only when ``download``.
    Raises ConfigError (one line) for an unknown task or model, missing data,
    or a task function that returns no ``Task``.
    """
    try:
        task_fn = task_function(TASKS.get(args.dataset, args.dataset))
    except ConfigError as exc:
        raise ConfigError(f"--dataset {args.dataset}: {exc}") from None
    task = task_fn(args, download)
    if not isinstance(task, Task):
        shown = repr(task) if len(repr(task)) <= 40 else repr(task)[:37] + "..."
        raise ConfigError(f"--dataset {args.dataset}: the task function returned {shown} "
                          f"({type(task).__name__}), not a common.Task; end it with "
                          f"`return common.Task(train_set, val_set, test_set, model, loss_fn, "
                          f"classification)` (docs/custom-task.md)")
    return task


def choose_model(args: argparse.Namespace, choices: tuple[str, ...]) -> str:
    """Set and return ``args.model``: its value, or the first of ``choices``;
    ConfigError when it is none of them."""
    if args.model is None:
        args.model = choices[0]
    if args.model not in choices:
        raise ConfigError(f"--model {args.model} is not available for --dataset {args.dataset}; "
                          f"choose one of {', '.join(choices)}")
    return args.model


# SplitMix64's finaliser (Steele, Lea and Flood, "Fast splittable pseudorandom
# number generators", OOPSLA 2014; the constants of Vigna's splitmix64.c).
_MASK64 = (1 << 64) - 1


def _mix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def draw_key(seed: int, epoch: int, index: int) -> int:
    """The key of sample ``index``'s random draws in epoch ``epoch`` (0-based)
    of a run seeded ``seed``: an int in [0, 2**63), a fixed function of the
    three (SplitMix64's finaliser applied to each in turn), so a draw made
    from it is the same in the main process or any loader worker, at any
    world size, before or after a resume. Usable as a seed
    (``torch.manual_seed``) or, modulo n, as a draw from range(n) (bias
    below n / 2**63)."""
    key = _mix64(seed & _MASK64)
    key = _mix64(key ^ (epoch & _MASK64))
    return _mix64(key ^ (index & _MASK64)) >> 1


def split_indices(n: int, val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Seeded (train, val) split of range(n), the same on every rank (a
    private generator: the global RNG is untouched)."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    n_val = int(n * val_fraction)
    return perm[n_val:], perm[:n_val]


# --------------------------------------------------------------------------
# synthetic: a seeded regression, no download (the smallest task function)
# --------------------------------------------------------------------------

SYNTHETIC_FEATURES = 20
# --model: the models this module's task function accepts, the default first (train.py's --help).
MODELS = {"synthetic_task": ("mlp", "linear")}


class SyntheticRegression(Dataset):
    """y = x @ w + b + noise, items (x float32 (20,), y float32 (1,)), drawn
    from private generators: every rank that builds it with the same ``seed``
    and ``split`` holds identical tensors. Train (2,048 samples) and test (512)
    share w and b (the relation to learn), not x and the noise. w ~ N(0, 1/20)
    makes Var(y) about 1: the MSE of a zero predictor is ~1, the best
    achievable the noise variance, 0.01.
    """

    def __init__(self, seed: int, split: str) -> None:
        relation = torch.Generator().manual_seed(seed)
        w = torch.randn(SYNTHETIC_FEATURES, 1, generator=relation) / SYNTHETIC_FEATURES ** 0.5
        b = torch.randn(1, generator=relation)
        n = 2048 if split == "train" else 512
        g = torch.Generator().manual_seed(seed + (1 if split == "train" else 2))
        self.x = torch.randn(n, SYNTHETIC_FEATURES, generator=g)
        self.y = self.x @ w + b + 0.1 * torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int):
        return self.x[index], self.y[index]


def synthetic_model(model: str = "mlp") -> nn.Module:
    """A freshly initialized model (from the global torch RNG) of the synthetic
    task, float32 (N, 20) -> (N, 1): ``mlp`` (20-64-1, ReLU) or ``linear``."""
    if model == "linear":
        return nn.Linear(SYNTHETIC_FEATURES, 1)
    return nn.Sequential(nn.Linear(SYNTHETIC_FEATURES, 64), nn.ReLU(), nn.Linear(64, 1))


def synthetic_task(args: argparse.Namespace, download: bool) -> Task:
    """The default task: ``SyntheticRegression``, an MLP (or ``--model linear``)
    float32 (N, 20) -> (N, 1), MSE loss. Needs no files, so ``download`` is unused."""
    model = choose_model(args, MODELS["synthetic_task"])
    full, test = SyntheticRegression(args.seed, "train"), SyntheticRegression(args.seed, "test")
    train_idx, val_idx = split_indices(len(full), VAL_FRACTION, args.seed)
    return Task(Subset(full, train_idx), Subset(full, val_idx), test,
                synthetic_model(model), F.mse_loss, classification=False)
