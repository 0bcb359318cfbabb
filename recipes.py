"""What a recipe means: the optimizer and the learning-rate schedule its values name.

A recipe is how a model is trained (docs/recipes.md): a value for each key of
``RECIPE_DEFAULTS`` (``--optimizer``, ``--lr``, ``--lr_schedule``, the warm-up,
...), the command line's, else the task's (``common.Task.recipe``), else the
default (``set_recipe_flags``). The rungs and the kit build the optimizer and
the schedule with ``build_optimizer`` and ``lr_factor``, so both train a task
the same way. Imports torch and the task contract's ConfigError only, so a
rung can import it.
"""

from __future__ import annotations

import argparse
import inspect
import math
from typing import Callable, Optional, Protocol

import torch

from common import ConfigError

# The recipe flags' values where neither the command line nor the task's recipe
# sets one: build_optimizer and lr_factor say what theirs mean, `train.py --help` the others'.
RECIPE_DEFAULTS = {"optimizer": "sgd", "lr": 0.05, "weight_decay": 0.0, "lr_schedule": "constant",
                   "warmup_epochs": 0.0, "lr_step_epochs": 1, "lr_gamma": 0.1,
                   "beta1": 0.9, "beta2": 0.999, "decay_params": "all", "warmup_steps": 0, "min_lr": 0.0,
                   "max_steps": 0, "clip_grad_norm": None, "batch_size": 32,
                   "log_every_steps": 0, "eval_every_steps": 0, "eval_windows": 0}

# --optimizer: name -> (class, keyword arguments besides lr and weight_decay).
# SGD's momentum 0.9 is the usual one for image classification (He et al. 2016);
# AdamW and Adadelta keep torch's defaults. Add your own here.
OPTIMIZERS: dict[str, tuple[type, dict]] = {
    "sgd": (torch.optim.SGD, {"momentum": 0.9}),
    "adamw": (torch.optim.AdamW, {}),
    "adadelta": (torch.optim.Adadelta, {}),
}
LR_SCHEDULES = ("constant", "cosine", "step")
DECAY_PARAMS = ("all", "matrices")


class RecipeSettings(Protocol):
    """The recipe's settings ``build_optimizer`` and ``lr_factor`` read: the
    kit's ``train_utils.RunConfig`` has them, and so has a rung's parsed
    command line (its ``argparse.Namespace``) once ``set_recipe_flags`` has
    filled in what no flag set."""

    optimizer: str
    lr: float
    weight_decay: float
    beta1: float
    beta2: float
    decay_params: str
    lr_schedule: str
    warmup_epochs: float
    warmup_steps: int
    min_lr: float
    lr_step_epochs: int
    lr_gamma: float
    max_steps: int
    total_epochs: int


def recipe_values(args: argparse.Namespace, recipe: dict) -> dict:
    """{recipe flag (a key of ``RECIPE_DEFAULTS``): its value}: the command
    line's (``args``; None or absent: unset, the rungs have no such flags),
    else the task's (``recipe``, ``Task.recipe``), else ``RECIPE_DEFAULTS``'.
    Raises ConfigError (one line) for a key of ``recipe`` that is no recipe flag."""
    unknown = sorted(set(recipe) - set(RECIPE_DEFAULTS))
    if unknown:
        raise ConfigError(f"--dataset {args.dataset}: Task.recipe sets {', '.join(unknown)}, which "
                          f"is no recipe flag; use keys of {', '.join(RECIPE_DEFAULTS)}")
    given = {name: getattr(args, name, None) for name in RECIPE_DEFAULTS}
    return {name: recipe.get(name, default) if given[name] is None else given[name]
            for name, default in RECIPE_DEFAULTS.items()}


def set_recipe_flags(args: argparse.Namespace, recipe: dict) -> None:
    """Set each recipe flag of ``args`` to its value (``recipe_values``)."""
    for name, value in recipe_values(args, recipe).items():
        setattr(args, name, value)


def build_optimizer(model: torch.nn.Module, args: RecipeSettings) -> torch.optim.Optimizer:
    """The optimizer --optimizer names (``OPTIMIZERS``) over ``model``'s
    parameters, at --lr with --weight_decay (as torch defines it for each
    optimizer: decoupled for AdamW), and --beta1 --beta2 where it takes
    ``betas`` (AdamW). --decay_params ``all``: every parameter decays;
    ``matrices``: those of 2 dimensions or more (the weights of linear layers
    and embeddings) do, the others (biases, norms' gains) form a second group
    at weight decay 0, marked ``"decays": False`` (nanoGPT's
    ``configure_optimizers``). Build it once the parameters are final (the
    FSDP rung: after ``fully_shard``). Raises ConfigError for an optimizer or
    a decay_params name it does not know.
    """
    if args.optimizer not in OPTIMIZERS:  # a task's default; the command line is checked already
        raise ConfigError(f"optimizer {args.optimizer!r} (the task's recipe) is not one of "
                          f"{', '.join(OPTIMIZERS)}; pass --optimizer, or add it to OPTIMIZERS "
                          f"in recipes.py")
    if args.decay_params not in DECAY_PARAMS:
        raise ConfigError(f"decay_params {args.decay_params!r} (the task's recipe) is not one of "
                          f"{', '.join(DECAY_PARAMS)}; pass --decay_params")
    optimizer_class, options = OPTIMIZERS[args.optimizer]
    if "betas" in inspect.signature(optimizer_class).parameters:
        options = dict(options, betas=(args.beta1, args.beta2))
    if optimizer_class is torch.optim.AdamW and all(p.is_cuda for p in model.parameters()):
        # One kernel for every parameter's update: a small GPT's GPU step is 15% shorter, as in nanoGPT.
        options = dict(options, fused=True)
    parameters = model.parameters()
    if args.decay_params == "matrices":
        params = list(parameters)
        groups = [{"params": [p for p in params if p.dim() >= 2]},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0, "decays": False}]
        parameters = [group for group in groups if group["params"]]
    return optimizer_class(parameters, lr=args.lr, weight_decay=args.weight_decay, **options)


def lr_factor(args: RecipeSettings, steps_per_epoch: int, max_steps: Optional[int] = None,
              warmup_steps: Optional[int] = None) -> Callable[[int], float]:
    """The schedule: optimizer step k (0-based) -> the factor of --lr it uses.

    Warm-up: linear from 1/W to 1 over the first W steps (the gradual warm-up
    of Goyal et al. 2017, "Accurate, Large Minibatch SGD"), W = --warmup_steps,
    or round(--warmup_epochs x steps_per_epoch). The run lasts T steps:
    --max_steps, or --total_epochs x steps_per_epoch. (``max_steps`` and
    ``warmup_steps``, where given, stand for the flags: train.py's, counted
    in the global batch of a resized run, ``RunConfig.max_steps_now``.) After the warm-up,
    ``constant`` 1; ``cosine`` from 1 down to m = --min_lr / --lr at step T,
    m + (1 - m)(1 + cos(pi p)) / 2 with p the fraction of the T - W steps
    after the warm-up done (Loshchilov & Hutter 2017, SGDR, without restarts;
    nanoGPT's ``get_lr`` with its min_lr), then m; ``step`` --lr_gamma **
    (epoch // --lr_step_epochs), the epoch being k // steps_per_epoch (torch's
    StepLR stepped once per epoch), times the warm-up's factor. Raises
    ConfigError for a schedule name not in ``LR_SCHEDULES``, both warm-ups
    set, or --min_lr above a --lr other than 0.
    """
    if args.lr_schedule not in LR_SCHEDULES:
        raise ConfigError(f"lr_schedule {args.lr_schedule!r} (the task's recipe) is not one of "
                          f"{', '.join(LR_SCHEDULES)}; pass --lr_schedule")
    if args.warmup_steps and args.warmup_epochs:
        raise ConfigError(f"--warmup_steps {args.warmup_steps} and --warmup_epochs {args.warmup_epochs}: give "
                          f"the warm-up in one of them, the other 0 (the task's recipe may set one)")
    if args.lr and args.min_lr > args.lr:  # --lr 0: every step's lr is 0, whatever the schedule
        raise ConfigError(f"--min_lr {args.min_lr} is above --lr {args.lr}: the cosine would rise; pass a "
                          f"lower --min_lr (or 0)")
    max_steps = args.max_steps if max_steps is None else max_steps
    warmup_steps = args.warmup_steps if warmup_steps is None else warmup_steps
    warmup = warmup_steps or round(args.warmup_epochs * steps_per_epoch)
    total = max_steps or args.total_epochs * steps_per_epoch
    floor = args.min_lr / args.lr if args.lr else 0.0

    def factor(step: int) -> float:
        ramp = (step + 1) / warmup if step < warmup else 1.0
        if args.lr_schedule == "cosine":
            progress = max(0, step - warmup) / max(1, total - warmup)
            return ramp * (floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))
        if args.lr_schedule == "step":
            return ramp * args.lr_gamma ** (step // steps_per_epoch // args.lr_step_epochs)
        return ramp

    return factor  # a function, not an object: LambdaLR then saves none of its settings
