"""The run's configuration: every flag of the kit as a field of one frozen
``RunConfig``, each field carrying its flag (type, help) and its properties
(must match at a resume, may change at a resume, defaulted by the task,
per process), and ``resolve_config``, which turns the parsed command line
and the built task into the one configuration the run uses from then on.

The properties are read from the fields (``must_match``,
``changeable_at_resume``, ``task_defaults``, ``per_process``): a new flag is
one field here, its properties beside it.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping, Optional

import torch

from common import ConfigError
from recipes import DECAY_PARAMS, LR_SCHEDULES, OPTIMIZERS, RECIPE_DEFAULTS, recipe_values


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


def choice(*choices: str) -> Callable[[str], str]:
    """argparse type: one of ``choices``, else a one-line usage error."""

    def parse(text: str) -> str:
        if text not in choices:
            raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {', '.join(choices)})")
        return text

    return parse


def flag(default: Any, help: str, *, group: str, identity: bool = False, must_match: bool = False,
         changeable: bool = False, per_process: bool = False, task_default: bool = False, **argparse_options: Any):
    """A ``RunConfig`` field and its command-line flag ``--NAME``.

    ``default``: the value where neither the command line nor the task sets
    one (a ``task_default`` field's is ``recipes.RECIPE_DEFAULTS``'); ``help``
    and ``argparse_options`` (type, choices, action, ...) are the flag's;
    ``group``: the --help section it is listed in. Properties:
    ``identity``: it says what a run learns, so a run given another value is
    another run (another point of a sweep), and the Slurm wrappers name the
    snapshot by it (``identity_flags``); the flags that only say how long a
    run goes on (a longer run extends the same one), how fast its steps go,
    or what it prints and where it writes are not; ``must_match``: a
    snapshot saved with another value comes from another run and is
    refused; ``changeable``: a resumed run may change it, and the resume
    line says so (the recipe); ``per_process``: it may differ between the
    processes of one job (node-local paths); ``task_default``: left unset on
    the command line, the task's recipe (``common.Task.recipe``) gives it."""
    metadata = {"help": help, "group": group, "identity": identity, "must_match": must_match,
                "changeable": changeable, "per_process": per_process, "task_default": task_default,
                "argparse": argparse_options}
    return field(default=default, metadata=MappingProxyType(metadata))


TRAINING, OUTPUT, SPEED, RECIPE, RUN = ("what to train, on what, for how long", "figures, samples and traces",
                                        "how the steps run", "the recipe (docs/recipes.md)",
                                        "how the run is spread, snapshotted and timed out")


@dataclass(frozen=True)
class RunConfig:
    """What a run of train.py trains and how, resolved once
    (``resolve_config``) and never changed after: the flags, the task's
    recipe where the command line left one unset, and what follows from
    them (--amp as the job runs it, --grad_accum_steps under
    --global_batch_size, --total_epochs under --max_steps, the model the
    task chose), read by the run as they are: ``sharded`` and
    ``compute_dtype`` say what --strategy and --amp mean. ``task_flags``
    holds the task module's own flags (``common.Task`` modules' ``FLAGS``)
    and ``task_identity`` the task's ``identity``. A snapshot stores
    ``as_dict()``; a resumed run compares it with its own (the fields that
    ``must_match``, and the identity whole)."""

    # What to train, on what, for how long. The order is --help's, and the one the resume line
    # names changed flags in (--lr first) and a refusal names what differs in (--dataset first).
    lr: float = flag(RECIPE_DEFAULTS["lr"], "peak learning rate; 0: the weights stay as they are, every "
                     "evaluation scores them (default: the task's; synthetic 0.05)",
                     group=TRAINING, identity=True, changeable=True, task_default=True,
                     type=positive(float, zero=True))
    total_epochs: int = flag(10, "epochs to train (default: 10)", group=TRAINING, changeable=True, type=positive(int))
    save_every: int = flag(5, "save every N epochs; the last epoch is always saved (default: 5)", group=TRAINING,
                           type=positive(int))
    dataset: str = flag("synthetic", "task to train", group=TRAINING, identity=True, must_match=True)
    model: Optional[str] = flag(None, "model for the task (default: the task's first)", group=TRAINING, identity=True,
                                must_match=True)
    data_dir: str = flag("data", "dataset root, as torchvision expects it (default: $DATA_DIR or ./data)",
                         group=TRAINING, identity=True, per_process=True)
    seed: int = flag(0, "seed for data split, model init, shuffling (default: 0)", group=TRAINING, identity=True,
                     must_match=True, type=int)
    batch_size: int = flag(RECIPE_DEFAULTS["batch_size"],
                           "samples per step *per process*; the global batch size is batch_size x "
                           "grad_accum_steps x world_size (default: the task's; 32, shakespeare_char 12)",
                           group=TRAINING, identity=True, must_match=True, task_default=True, type=positive(int))
    init_from: Optional[str] = flag(
        None, "start a new run (step 0, optimizer and schedule fresh) from these weights: a kit snapshot (a "
              "DDP snapshot file, or an FSDP/HSDP snapshot folder), nanoGPT's ckpt.pt, or a Hugging Face GPT-2 "
              "folder (save_pretrained's); the GPT's sizes are the weights' unless a flag gives them (a smaller "
              "--block_size crops the position embedding). A snapshot at --snapshot_path wins: the run resumes "
              "from it and reads no --init_from (default: the task's own initialisation)",
        group=TRAINING, identity=True)
    num_workers: int = flag(0, "DataLoader worker processes per training process (default: 0)", group=TRAINING,
                            per_process=True, type=non_negative_int)

    # Figures, samples and traces
    metrics_path: Optional[str] = flag(None, "also write each epoch's summary as one JSON object per line here",
                                       group=OUTPUT, per_process=True)
    tensorboard_dir: Optional[str] = flag(
        None, "also write each epoch's figures for TensorBoard here (needs: pip install tensorboard)",
        group=OUTPUT, per_process=True)
    wandb_project: Optional[str] = flag(
        None, "also log the flags, each epoch's figures and the test figures to a Weights & Biases run in this "
              "project, from rank 0; a resumed run continues it; WANDB_MODE=offline, WANDB_ENTITY etc. apply "
              "(needs: pip install wandb)", group=OUTPUT)
    log_every_steps: int = flag(
        RECIPE_DEFAULTS["log_every_steps"],
        "also print a progress line on rank 0 every N optimizer steps, in a log file as on a terminal: step, "
        "epoch, loss, lr, samples/s or tokens/s, ms a step; 0: none "
        f"(default: the task's; shakespeare_char 100, else {RECIPE_DEFAULTS['log_every_steps']})",
        group=OUTPUT, task_default=True, type=non_negative_int)
    eval_every_steps: int = flag(
        RECIPE_DEFAULTS["eval_every_steps"],
        "evaluate every N optimizer steps of the run, and after its last, instead of after every epoch "
        "(nanoGPT's eval_interval), each evaluation one summary line and metrics record with the best "
        f"validation loss so far; 0: after every epoch (default: the task's; tokens 2000, else "
        f"{RECIPE_DEFAULTS['eval_every_steps']})", group=OUTPUT, task_default=True, type=non_negative_int)
    eval_windows: int = flag(
        RECIPE_DEFAULTS["eval_windows"],
        "held-out samples (a language model's windows) each evaluation scores: a fixed subset drawn from "
        "--seed, the same in every evaluation and every run (nanoGPT's eval_iters x batch_size); 0: all "
        f"(default: the task's; tokens 2400, else {RECIPE_DEFAULTS['eval_windows']})",
        group=OUTPUT, task_default=True, type=non_negative_int)
    rank_lines: bool = flag(
        False, "every rank prints its own line at each epoch's start, naming its rank, local_rank and host "
               "(default: one line, from rank 0; where each rank runs is the start-up placement line)",
        group=OUTPUT, action="store_true")
    profile_dir: Optional[str] = flag(
        None, "trace training steps 3-7 with torch.profiler on every rank, one trace file per rank here, for "
              "Perfetto or chrome://tracing (default: no profiler)", group=OUTPUT)

    # How the steps run
    amp: Optional[str] = flag(
        None, "autocast for the training forward pass: bf16 where every GPU of the job has it, else fp16 with a "
              "loss scaler; 'bf16' or 'fp16' forces one, also on a CPU (plain --amp on a CPU only where it was "
              "measured to help, see docs/performance.md)",
        group=SPEED, identity=True, nargs="?", const="auto", choices=("auto", "bf16", "fp16"))
    compile: bool = flag(False, "torch.compile the training model and its loss, under FSDP each transformer "
                                "block (saved weights stay loadable without it)", group=SPEED, action="store_true")
    no_tf32: bool = flag(False, "on GPUs, fp32 matmuls and convolutions in full fp32 instead of on TF32 tensor "
                                "cores (default: TF32 on Ampere or newer, "
                                "torch.set_float32_matmul_precision('high'))", group=SPEED, action="store_true")
    deterministic: bool = flag(
        False, "bitwise-repeatable GPU kernels (deterministic algorithms, cuBLAS workspace, cuDNN): a GPU run "
               "stopped and resumed ends bitwise equal to one that never stopped; slower (default: off; CPU "
               "runs are repeatable without it)", group=SPEED, action="store_true")
    grad_accum_steps: int = flag(1, "micro-batches of --batch_size per optimizer step (default: 1)", group=SPEED,
                                 identity=True, must_match=True, type=positive(int))
    global_batch_size: Optional[int] = flag(
        None, "keep this global batch at any world size: --grad_accum_steps becomes it / (batch_size x "
              "world_size), which must divide it (elastic jobs; default: off)", group=SPEED, identity=True,
        type=positive(int))
    activation_checkpointing: bool = flag(
        False, "recompute each transformer block's activations in the backward pass: less memory, the same "
               "losses (default: off)", group=SPEED, action="store_true")

    # The recipe: each default the task's choice (Task.recipe), else recipes.RECIPE_DEFAULTS
    optimizer: str = flag(RECIPE_DEFAULTS["optimizer"], "optimizer (default: the task's; synthetic sgd, "
                                                        "momentum 0.9)",
                          group=RECIPE, identity=True, must_match=True, task_default=True, choices=tuple(OPTIMIZERS))
    weight_decay: float = flag(RECIPE_DEFAULTS["weight_decay"], "weight decay (default: the task's; synthetic 0)",
                               group=RECIPE, identity=True, changeable=True, task_default=True, type=non_negative_float)
    lr_schedule: str = flag(
        RECIPE_DEFAULTS["lr_schedule"],
        "learning rate over the run: constant, cosine (down to --min_lr one step after the last) or step (x "
        "--lr_gamma every --lr_step_epochs) (default: the task's; synthetic constant)",
        group=RECIPE, identity=True, changeable=True, task_default=True, choices=LR_SCHEDULES)
    warmup_epochs: float = flag(
        RECIPE_DEFAULTS["warmup_epochs"],
        "linear warm-up over this many (fractional) epochs of steps (default: the task's; 0)",
        group=RECIPE, identity=True, changeable=True, task_default=True, type=non_negative_float)
    clip_grad_norm: Optional[float] = flag(
        RECIPE_DEFAULTS["clip_grad_norm"],
        "clip the gradients' total L2 norm, over all ranks, to this; 0: no clipping (default: the task's; 0)",
        group=RECIPE, identity=True, changeable=True, task_default=True, type=non_negative_float)
    max_steps: int = flag(
        RECIPE_DEFAULTS["max_steps"],
        f"optimizer steps to train, the last epoch cut short; 0: --total_epochs (default: the task's; "
        f"{RECIPE_DEFAULTS['max_steps']})", group=RECIPE, changeable=True, task_default=True,
        type=non_negative_int)
    warmup_steps: int = flag(
        RECIPE_DEFAULTS["warmup_steps"],
        f"linear warm-up over this many optimizer steps (--warmup_epochs 0) (default: the task's; "
        f"{RECIPE_DEFAULTS['warmup_steps']})", group=RECIPE, identity=True, changeable=True, task_default=True,
        type=non_negative_int)
    min_lr: float = flag(RECIPE_DEFAULTS["min_lr"],
                         f"where the cosine ends (default: the task's; {RECIPE_DEFAULTS['min_lr']})",
                         group=RECIPE, identity=True, changeable=True, task_default=True, type=non_negative_float)
    beta1: float = flag(RECIPE_DEFAULTS["beta1"], f"AdamW's beta1 (default: the task's; {RECIPE_DEFAULTS['beta1']})",
                        group=RECIPE, identity=True, changeable=True, task_default=True, type=non_negative_float)
    beta2: float = flag(RECIPE_DEFAULTS["beta2"], f"AdamW's beta2 (default: the task's; {RECIPE_DEFAULTS['beta2']})",
                        group=RECIPE, identity=True, changeable=True, task_default=True, type=non_negative_float)
    lr_step_epochs: int = flag(
        RECIPE_DEFAULTS["lr_step_epochs"],
        f"step schedule: epochs between decays (default: the task's; {RECIPE_DEFAULTS['lr_step_epochs']})",
        group=RECIPE, identity=True, changeable=True, task_default=True, type=positive(int))
    lr_gamma: float = flag(
        RECIPE_DEFAULTS["lr_gamma"],
        f"step schedule: factor per decay (default: the task's; {RECIPE_DEFAULTS['lr_gamma']})",
        group=RECIPE, identity=True, changeable=True, task_default=True, type=positive(float))
    decay_params: str = flag(
        RECIPE_DEFAULTS["decay_params"],
        "all: every parameter decays; matrices: 2-D ones only, not biases or norms (default: the task's; all)",
        group=RECIPE, identity=True, must_match=True, task_default=True, choices=DECAY_PARAMS)

    # How the run is spread, snapshotted and timed out
    strategy: str = flag("ddp", "ddp: every rank holds the whole model (DistributedDataParallel); fsdp: each "
                                "holds 1/world_size of it (FSDP2), snapshots sharded; hsdp: sharded within a "
                                "group of --shard_size ranks (a node), replicated across the groups, snapshots as "
                                "fsdp's (docs/fsdp.md) (default: ddp)",
                         group=RUN, type=choice("ddp", "fsdp", "hsdp"))
    shard_size: int = flag(0, "--strategy hsdp: the ranks one replica of the model is sharded over; it must "
                              "divide world_size (default: 0, the ranks of one node, torchrun's LOCAL_WORLD_SIZE)",
                           group=RUN, type=non_negative_int)
    snapshot_path: Optional[str] = flag(None, "snapshot to resume from when it exists, and to save to",
                                        group=RUN, per_process=True)
    snapshot_every_steps: int = flag(
        0, "also snapshot every N optimizer steps inside an epoch, so a restart loses at most N steps (0: only at "
           "epoch ends) (default: 0)", group=RUN, type=non_negative_int)
    snapshot_every_s: float = flag(
        0, "also snapshot inside an epoch once this many seconds have passed since the last snapshot, e.g. 60 "
           "(0: off) (default: 0)", group=RUN, type=non_negative_float)
    preemption_notice: Optional[str] = flag(
        None, "also stop as at SIGTERM when the cloud posts this instance's preemption notice on its metadata "
              "service: aws (spot instance-action, IMDSv2) or gce (instance/preempted); one watcher per node, "
              "every 2 s; PREEMPTION_NOTICE_URL replaces the service's address (default: off)",
        group=RUN, per_process=True, choices=("aws", "gce"))
    snapshot_sync: bool = flag(False, "write each snapshot before training goes on (default: a CPU copy written "
                                      "in the background, one write at a time)", group=RUN, action="store_true")
    pg_timeout_s: float = flag(
        600, "once training runs, seconds a collective may wait for the other ranks before the job fails: on "
             "the CPU (gloo) rank 0 names the ranks that did not arrive; on GPUs (NCCL) NCCL's watchdog ends "
             "every waiting rank (SIGABRT) and the flight recorder's dumps name the collective (docs/runs.md) "
             "(default: 600)", group=RUN, type=positive(float))
    startup_timeout_s: float = flag(
        1800, "the same during start-up and the first training step (downloads, compilation), and for the "
              "ranks waiting for a snapshot's write; a rank that never joins ends the job with one line from "
              "every rank that waited (default: 1800)",
        group=RUN, type=positive(float))

    # The task's own flags (its module's FLAGS) and identity (common.Task.identity): no command-line flag;
    # and those of its flags that say what the trained model writes (its module's OUTPUT_FLAGS): no recipe.
    task_flags: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    task_identity: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    task_output_flags: tuple = ()
    # The processes of this start, and the global batch size --max_steps and --warmup_steps count in:
    # the first start's, kept in the run's snapshots (None: this start's). No command-line flag.
    world_size: int = 1
    budget_batch: Optional[int] = None

    @property
    def sharded(self) -> bool:
        """Whether the model is sharded (FSDP2: --strategy fsdp, or hsdp on a
        2-D mesh) and its snapshots are folders of shards; else DDP, every
        rank holding the whole model, snapshots one file."""
        return is_sharded(self.strategy)

    @property
    def compute_dtype(self) -> Optional[torch.dtype]:
        """The dtype the training forward computes in: None without --amp,
        else torch.bfloat16 or torch.float16 (the latter with a loss scaler).
        --amp as the job runs it: on CUDA plain --amp is "bf16" or "fp16"
        already (``loop.resolve_amp``, every rank's GPU asked), elsewhere
        "auto" is bf16."""
        if self.amp is None:
            return None
        return torch.float16 if self.amp == "fp16" else torch.bfloat16

    @property
    def global_batch(self) -> int:
        """Samples one optimizer step of this start trains over all ranks:
        --batch_size x --grad_accum_steps x world_size."""
        return self.batch_size * self.grad_accum_steps * self.world_size

    def steps_now(self, steps: int) -> int:
        """``steps`` optimizer steps of the run's first global batch
        (``budget_batch``) as steps of this start's (``global_batch``): the
        same samples, rounded up to whole steps. A run resumed at another
        world size without --global_batch_size has another global batch;
        its --max_steps and --warmup_steps still mean the samples (a
        language model's tokens) the run planned, as nanoGPT's iterations
        of a fixed number of tokens do."""
        return steps_in_batch(steps, self.budget_batch or self.global_batch, self.global_batch)

    @property
    def max_steps_now(self) -> int:
        """--max_steps in this start's optimizer steps (``steps_now``); 0 without --max_steps."""
        return self.steps_now(self.max_steps)

    @property
    def warmup_steps_now(self) -> int:
        """--warmup_steps in this start's optimizer steps (``steps_now``)."""
        return self.steps_now(self.warmup_steps)

    @property
    def budget_samples(self) -> int:
        """The samples --max_steps plans: its steps x the run's first global
        batch (``budget_batch``); 0 without --max_steps."""
        return self.max_steps * (self.budget_batch or self.global_batch)

    def as_dict(self) -> dict:
        """The configuration as plain values, the task's flags among the
        kit's, its identity under "task_identity" and the run's first global
        batch under "budget_batch": what snapshots, the metrics file's start
        record and W&B store."""
        values = {f.name: getattr(self, f.name) for f in flags()}
        return {**values, **self.task_flags, "task_identity": dict(self.task_identity),
                "budget_batch": self.budget_batch or self.global_batch}


# The strategies that shard the model with FSDP2 (--strategy), whose snapshots are folders of shards.
SHARDED_STRATEGIES = ("fsdp", "hsdp")


def is_sharded(strategy: str) -> bool:
    """Whether --strategy ``strategy`` shards the model (``SHARDED_STRATEGIES``):
    what ``RunConfig.sharded`` says, for the command line before the
    configuration exists (the snapshot's claim, its name)."""
    return strategy in SHARDED_STRATEGIES


def flags() -> tuple:
    """``RunConfig``'s fields that are command-line flags, in --help's order."""
    return tuple(f for f in dataclasses.fields(RunConfig) if "help" in f.metadata)


def _having(prop: str) -> tuple:
    return tuple(f.name for f in flags() if f.metadata[prop])


def identity_flags() -> tuple:
    """Flags that say what a run learns, in --help's order: given another
    value, another run (``flag``'s ``identity``; the Slurm wrappers' snapshot
    name, tools/identity.py)."""
    return _having("identity")


def must_match() -> tuple:
    """Flags whose value a resumed run must share with its snapshot: another
    value trained something else, or on other data (the seed draws the
    validation split too; another --optimizer holds other buffers)."""
    return _having("must_match")


def changeable_at_resume() -> tuple:
    """Flags a resumed run may change, the resume line saying what changed:
    the recipe (a lower --lr after a divergence, a longer --total_epochs)."""
    return _having("changeable")


def task_defaults() -> tuple:
    """Flags the task's recipe gives where the command line does not (the keys of ``recipes.RECIPE_DEFAULTS``)."""
    return _having("task_default")


def per_process() -> tuple:
    """Flags that may differ between the processes of one job: node-local paths, CPU counts, what rank 0 writes."""
    return _having("per_process")


def steps_in_batch(steps: int, planned_batch: int, batch: int) -> int:
    """``steps`` optimizer steps of a global batch of ``planned_batch``
    samples as steps of ``batch``: the same samples, rounded up to whole
    steps (``RunConfig.steps_now``)."""
    return -(-steps * planned_batch // batch)  # ceil, in integers


def batches_per_rank(samples: int, world_size: int, batch_size: int) -> int:
    """Full training batches each of ``world_size`` ranks gets from ``samples``
    samples: its share of the epoch's permutation (ceil(samples / world_size),
    the last positions padding: ``ResumableDistributedSampler``), in batches
    of ``batch_size``, the last partial one dropped."""
    return math.ceil(samples / world_size) // batch_size


def resolve_config(args: argparse.Namespace, task, world_size: int, amp: Optional[str],
                   task_flags: Optional[Mapping[str, Any]] = None, local_world_size: int = 1,
                   model: Optional[str] = None, output_flags: tuple = (),
                   budget_batch: Optional[int] = None) -> RunConfig:
    """The run's configuration, from the parsed command line ``args`` and the
    task built from it (``model``: the model its task function chose, where
    --model left it to the task: ``common.choose_model``), for
    ``world_size`` processes: each flag ``args`` leaves unset (None)
    that the task's recipe gives, the recipe's (``recipes.recipe_values``);
    --amp as the job runs it (``amp``: ``loop.resolve_amp``'s); with
    --global_batch_size, --grad_accum_steps = it / (batch_size x world_size);
    with --max_steps, --total_epochs = the epochs that hold its steps, counted
    in this start's global batch (``RunConfig.max_steps_now``; ``budget_batch``:
    the global batch the run's first start trained with, which its snapshot
    keeps, ``snapshots.saved_budget_batch``; None for a fresh run: this
    start's); the task's own flags (``task_flags``: {name: value}, ``cli.task_flag_values``),
    those of them that only say what the model writes (``output_flags``,
    ``cli.output_flags``) and its identity; under --strategy hsdp, --shard_size as the mesh uses it
    (``hsdp_shard_size``; 0 for the other strategies). Raises ConfigError (one
    line) for a global batch size the per-process batch does not divide, and
    as ``hsdp_shard_size`` does."""
    values = {f.name: getattr(args, f.name) for f in flags()}
    values.update(recipe_values(args, task.recipe), amp=amp, model=model or args.model)
    values["grad_accum_steps"] = accumulation_steps(values["global_batch_size"], values["batch_size"],
                                                    values["grad_accum_steps"], world_size)
    values["shard_size"] = hsdp_shard_size(values["strategy"], values["shard_size"], world_size, local_world_size)
    config = RunConfig(**values, task_flags=MappingProxyType(dict(task_flags or {})),
                       task_identity=MappingProxyType(dict(task.identity)), task_output_flags=tuple(output_flags),
                       world_size=world_size, budget_batch=budget_batch)
    if not config.max_steps:
        return config
    batches = batches_per_rank(len(task.train_set), world_size, config.batch_size)
    return dataclasses.replace(config, total_epochs=math.ceil(
        config.max_steps_now / max(1, batches // config.grad_accum_steps)))


def hsdp_shard_size(strategy: str, shard_size: int, world_size: int, local_world_size: int) -> int:
    """The ranks each replica of an HSDP model is sharded over: --shard_size
    (``shard_size``), or where it is 0 the ranks of one node
    (``local_world_size``), so that the all-gathers and reduce-scatters stay
    inside a node and only the gradients' all-reduce crosses nodes
    (torchtitan's and the FSDP2 docs' default layout). 0 for --strategy ddp
    and fsdp. Raises ConfigError (one line) for a --shard_size without
    --strategy hsdp, or one that does not divide ``world_size``."""
    if strategy != "hsdp":
        if shard_size:
            raise ConfigError(f"--shard_size {shard_size} applies to --strategy hsdp only; add --strategy hsdp, "
                              f"or drop --shard_size")
        return 0
    size = shard_size or local_world_size
    if world_size % size:
        given = f"--shard_size {size}" if shard_size else f"--shard_size's default, the {size} ranks of one node,"
        raise ConfigError(f"{given} does not divide world_size {world_size}; pass a --shard_size that divides it "
                          f"(e.g. {math.gcd(size, world_size)})")
    return size


def accumulation_steps(global_batch_size: Optional[int], batch_size: int, grad_accum_steps: int,
                       world_size: int) -> int:
    """--grad_accum_steps (``grad_accum_steps``), or under --global_batch_size
    G: G / (--batch_size x ``world_size``), so that the global batch, the
    steps per epoch and the schedule stay the same whatever the world size
    (an elastic job's). Raises ConfigError (one line) when that is not a
    whole number >= 1."""
    if not global_batch_size:
        return grad_accum_steps
    per_step = batch_size * world_size
    if global_batch_size % per_step:
        raise ConfigError(f"--global_batch_size {global_batch_size} is not a multiple of --batch_size {batch_size} x "
                          f"world_size {world_size} = {per_step}; pick one that every world size of the job "
                          f"divides (e.g. {per_step * max(1, global_batch_size // per_step)}), or a smaller "
                          f"--batch_size")
    return global_batch_size // per_step
