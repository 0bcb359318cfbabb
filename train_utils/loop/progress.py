"""Exact resume: what a snapshot needs besides the model and optimizer state.

``Progress`` is where training stands (the run's optimizer steps, the epochs
run, the batches and samples of the epoch so far) and every rank's random
streams, a part of every snapshot (``state_dict`` / ``load_state_dict``; the
resumable sampler, in sampler.py, continues an epoch part-way);
``rebuild_ddp_buckets`` lays out DDP's buckets as an uninterrupted run has them.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Mapping, Optional

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from .sampler import batches_per_epoch
from ..config import steps_in_batch
from ..snapshots import position


def rebuild_ddp_buckets(model: torch.nn.Module, data: DataLoader, loss_fn: Callable,
                        eval_transform: Callable, device: torch.device,
                        autocast=contextlib.nullcontext()) -> None:
    """Collective, after resuming from a snapshot: lay out DDP's gradient
    buckets as an uninterrupted run has them by now, so that the resumed run
    stays bitwise equal to it at any world size.

    DDP all-reduces its first backward in buckets of parameters in reverse
    registration order, records the order in which gradients became ready,
    and from the second step on uses buckets rebuilt in that order
    (``Reducer::rebuild_buckets`` in torch/csrc/distributed/c10d/reducer.cpp).
    A ring all-reduce of 3 or more ranks sums each element in an order that
    depends on where it lies in the bucket, so without this the first step
    after a resume rounds differently (~1e-7) from the uninterrupted run's
    (with 2 ranks the sum of two numbers is the same either way).

    One forward and backward of ``data``'s first batch (shape (B, ...) of
    ``data.dataset``, each rank the same samples) in eval mode records the
    order; the RNG states are forked, BatchNorm statistics untouched
    (eval), and the gradients dropped. ``model`` is the DDP-wrapped model.
    ``autocast``: the context the training forward runs in (--amp's bf16
    autocast), since the cast nodes change the order gradients become ready.
    """
    first = DataLoader(data.dataset, batch_size=data.batch_size, collate_fn=data.collate_fn)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        source, targets = next(iter(first))
        model.eval()
        with autocast:
            loss = loss_fn(model(eval_transform(source.to(device))), targets.to(device))
        loss.backward()
        model.train()
    for parameter in model.parameters():
        parameter.grad = None


def gather_rng_states(device: torch.device, loader_generator: torch.Generator) -> list:
    """Collective: every rank's random states (CPU, the device's CUDA
    generator, the DataLoader's shuffling generator), gathered on every rank
    as a list indexed by rank; rank 0 saves it in the snapshot."""
    state = {"cpu": torch.get_rng_state(),
             "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
             "loader": loader_generator.get_state()}
    states: list = [None] * dist.get_world_size()
    dist.all_gather_object(states, state)
    return states


def set_rng_state(state: dict, device: torch.device, loader_generator: torch.Generator) -> None:
    """Restore one rank's states from ``gather_rng_states``: the resumed run
    draws the same dropout masks, augmentations and shuffles as the original."""
    torch.set_rng_state(state["cpu"])
    if state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"], device)
    loader_generator.set_state(state["loader"])


class Progress:
    """Where training stands, and the random streams an exact resume restores.

    ``step``: the run's optimizer steps so far, its one step counter (the lr
    schedule's, the evaluations', the progress line's). ``epochs_run``:
    epochs finished. ``steps_run``: the micro-batches finished in epoch
    ``epochs_run`` (> 0 only inside an epoch; the snapshot key's name).
    ``loader`` is the training DataLoader, ``grad_accum_steps`` micro-batches
    an optimizer step: ``steps_per_epoch`` optimizer steps an epoch; its
    generator (shuffles, loader worker seeds) is one of the streams saved,
    with the CPU and CUDA generators of ``device``. As a snapshot's part:
    ``KEYS``, ``state_dict``, ``load_state_dict``.
    """

    KEYS = ("epochs_run", "steps_run", "epoch_samples", "epoch_order", "rng_states")

    def __init__(self, device: torch.device, loader: DataLoader, rank: int, grad_accum_steps: int = 1) -> None:
        self.device, self.loader, self.rank, self.accum = device, loader, rank, grad_accum_steps
        self.steps_per_epoch = len(loader) // grad_accum_steps
        self.step = 0
        self.epochs_run = 0
        self.steps_run = 0
        self.saved_world_size: Optional[int] = None  # of the snapshot resumed from, if any
        self.saved_steps_run = 0  # the snapshot's steps_run, in its world size's steps
        self.saved_accum = grad_accum_steps  # the snapshot's (--global_batch_size: per world size)
        # Positions of epoch epochs_run's order trained before this start, and
        # steps_run then: the sampler's offset (ResumableDistributedSampler).
        self.start_samples = self.start_steps = 0
        # The order of the epoch this start goes on with ("randperm" or "keyed", the
        # snapshot's); None: the sampler's own for the dataset's size.
        self.start_order: Optional[str] = None

    @property
    def resumed(self) -> bool:
        """True when something was trained before this start."""
        return bool(self.epochs_run or self.steps_run)

    def end_epoch(self, epoch: int) -> None:
        """Epoch ``epoch`` (0-based) is finished: the next starts at its first step."""
        self.epochs_run, self.steps_run = epoch + 1, 0
        self.start_samples = self.start_steps = 0
        self.start_order = None

    def samples_trained(self) -> int:
        """Positions of this epoch's permutation trained so far: those before
        this start, then ``steps_run`` - ``start_steps`` batches on every rank
        (at most the dataset's size: a last step may take padding)."""
        batch = self.loader.batch_size * self.loader.sampler.num_replicas
        done = self.start_samples + (self.steps_run - self.start_steps) * batch
        return min(done, len(self.loader.sampler.dataset))

    def state_dict(self) -> dict:
        """Collective: {"epochs_run", "steps_run", "epoch_samples",
        "epoch_order", "rng_states"}.

        ``epoch_samples`` (``samples_trained``): the positions of the epoch's
        order trained, from which any world size goes on; ``epoch_order``
        that order's kind ("randperm" or "keyed": the sampler's ``order``),
        so that the epoch goes on in it whatever the sampler would choose now.
        ``rng_states`` is every rank's states, a list indexed by rank (an
        all-gather): a resumed run draws the same dropout masks,
        augmentations and shuffles on every rank. (The run's step follows
        from the position.)
        """
        return {"epochs_run": self.epochs_run,
                "steps_run": self.steps_run,
                "epoch_samples": self.samples_trained() if self.steps_run else 0,
                "epoch_order": getattr(self.loader.sampler, "order", "randperm"),
                "rng_states": gather_rng_states(self.device, self.loader.generator)}

    def load_state_dict(self, snapshot: dict) -> None:
        """Take the position of ``snapshot`` (from ``state_dict``) and this
        rank's random streams; a rank the saving run did not have (a run
        resumed at a larger world size) keeps its fresh seed. And the world
        size that saved it (``saved_world_size``: a sharded snapshot's
        ``snapshot["world_size"]``, else its config's).

        Inside an epoch the epoch goes on after its ``epoch_samples`` trained
        positions (a snapshot without it: ``steps_run`` x batch x saved world
        size), the rest split over this run's ranks. At another world size
        ``steps_run`` becomes this size's steps: the samples trained / this
        run's batch x world size, rounded down to whole optimizer steps
        (--grad_accum_steps micro-batches), for the schedule, the step
        numbers and the --snapshot_every_steps count. ``step``: the epochs
        run in this run's steps per epoch, plus the epoch's optimizer steps
        (at another world size an epoch has another number of steps, and
        the schedule, set in epochs, goes on from the epoch reached:
        ``Recipe.load_state_dict``)."""
        config = snapshot.get("config", {})
        self.epochs_run, self.steps_run = snapshot["epochs_run"], snapshot["steps_run"]
        self.saved_world_size = snapshot.get("world_size") or config.get("world_size")
        self.saved_steps_run = self.steps_run
        self.saved_accum = config.get("grad_accum_steps", self.accum)
        world_size, batch = self.loader.sampler.num_replicas, self.loader.batch_size
        saved_batch = config.get("batch_size", batch) * (self.saved_world_size or world_size)
        self.start_samples = snapshot.get("epoch_samples", self.steps_run * saved_batch) if self.steps_run else 0
        # A snapshot without it comes from a kit whose order was always torch.randperm's.
        self.start_order = snapshot.get("epoch_order", "randperm") if self.steps_run else None
        if self.steps_run and self.saved_world_size and self.saved_world_size != world_size:
            step = batch * world_size * self.accum
            self.steps_run = self.start_samples // step * self.accum
        self.start_steps = self.steps_run
        self.step = self.epochs_run * self.steps_per_epoch + self.steps_run // self.accum
        if self.rank < len(snapshot["rng_states"]):
            set_rng_state(snapshot["rng_states"][self.rank], self.device, self.loader.generator)

    def resize_note(self, config: Mapping, meshes: Optional[tuple] = None) -> str:
        """'' when the snapshot loaded (``load_state_dict``) was saved at this
        run's world size; else what changes, for the end of the resume line:

            (saved by world_size 2, resumed by 3: global batch size 64 -> 96
            at the same --lr, steps per epoch 28 -> 19; the cosine lr schedule,
            counted in epochs, goes on at step 19 of 57; random streams
            restored on ranks 0-1, rank 2 starts from its seed)

        ``meshes``: for a sharded snapshot, how the saving run and this one
        shard the model (``snapshots.sharded.mesh_name``: "FSDP", "HSDP
        replicate R x shard S"); the note then says DCP resharded it:

            (saved by world_size 4 as HSDP replicate 2 x shard 2, resharded
            to 2 as FSDP: weights and optimizer state exact; global batch
            size 32 -> 16 at the same --lr, ...)

        (the meshes named only where they are not both FSDP).

        Global batch size: --batch_size x --grad_accum_steps x world_size
        (--lr is not scaled with it: pass a new --lr to change it). Steps per
        epoch: optimizer steps, from ``self.loader``'s sampler at either world
        size (``batches_per_epoch``) // --grad_accum_steps. Under --max_steps,
        what its steps (of the run's first global batch, ``config``'s
        "budget_batch") make at this size (``RunConfig.max_steps_now``):
        "--max_steps 40 (steps of the first start's global batch 32) is 80
        steps of 16"; the schedule is then counted in samples. ``config``: the
        run's (``RunConfig.as_dict``). The schedule goes on at ``step``, counted in this
        run's steps per epoch from the epoch reached (``Recipe.load_state_dict``), so a
        schedule set in epochs (warm-up, cosine to --total_epochs, step decay
        every --lr_step_epochs) is where it would be after that many epochs
        and ends at --total_epochs; said only for a schedule other than a
        constant --lr. Inside an epoch the steps already taken in it count
        in this size's steps too (``load_state_dict``; ``epoch_note`` says
        where the epoch goes on). Random streams (``load_state_dict``): ranks below both
        world sizes take theirs back; a rank the saving run did not have
        keeps the fresh one of its start (from --seed + rank), and those of
        ranks this run lacks are dropped, so a resized run is deterministic
        but draws other dropout masks or augmentations than either run would.
        """
        saved, now = self.saved_world_size, dist.get_world_size()
        if saved is None or saved == now:
            return ""
        accum = (self.saved_accum, config["grad_accum_steps"])  # they differ under --global_batch_size
        steps = [batches_per_epoch(self.loader, size) // n for size, n in zip((saved, now), accum)]
        batch = config["batch_size"]
        schedule, warmup = "", config["warmup_epochs"] or config["warmup_steps"]
        total, budget = config["total_epochs"] * self.steps_per_epoch, ""
        if config["max_steps"]:  # steps of the run's first global batch: the same samples at this size
            planned, now_batch = config["budget_batch"], batch * accum[1] * now
            total = steps_in_batch(config["max_steps"], planned, now_batch)
            budget = (f"; --max_steps {config['max_steps']} (steps of the first start's global batch {planned}) "
                      f"is {total} steps of {now_batch}")
        if config["lr_schedule"] != "constant" or warmup:
            counted = "in samples" if config["max_steps"] else "in epochs"
            schedule = (f"; the {config['lr_schedule']} lr schedule{' with warm-up' if warmup else ''}, "
                        f"counted {counted}, goes on at step {self.step} of {total}")
        head = f"saved by world_size {saved}, resumed by {now}:"
        if meshes is not None:
            names = ("", "") if meshes == ("FSDP", "FSDP") else tuple(f" as {mesh}" for mesh in meshes)
            head = (f"saved by world_size {saved}{names[0]}, resharded to {now}{names[1]}: weights and "
                    f"optimizer state exact;")
        return (f" ({head} global batch size "
                f"{batch * accum[0] * saved} -> {batch * accum[1] * now} at the same --lr, "
                f"steps per epoch {steps[0]} -> {steps[1]}{budget}{schedule}{self.epoch_note()}; "
                f"{_streams_note(saved, now)})")

    def epoch_note(self) -> str:
        """'' unless the snapshot loaded was taken inside an epoch by another
        world size; else, for the resume line: "; epoch 2 goes on after 1280
        of its 2400 samples (step 20 by world_size 2) at step 40, the rest
        split over 1 rank"."""
        saved, now = self.saved_world_size, dist.get_world_size()
        if not self.saved_steps_run or saved is None or saved == now:
            return ""
        return (f"; epoch {self.epochs_run + 1} goes on after {self.start_samples} of its "
                f"{len(self.loader.sampler.dataset)} samples (step {self.saved_steps_run} by world_size "
                f"{saved}) at step {self.steps_run}, the rest split over {now} rank{'s' if now > 1 else ''}")

    @property
    def epoch_step(self) -> int:
        """The optimizer steps finished in epoch ``epochs_run`` (``steps_run``
        micro-batches, ``grad_accum_steps`` a step)."""
        return self.steps_run // self.accum

    def position(self) -> str:
        """``position`` of this progress: "after epoch 2", "in epoch 3 after step 40"."""
        return position(self.epochs_run, self.steps_run)


def _streams_note(saved: int, now: int) -> str:
    """Whose random streams a run of ``now`` ranks resumed from ``saved``
    ranks' snapshot restored: "random streams restored on ranks 0-1, rank 2
    starts from its seed", or "..., those of rank 2 dropped"."""
    streams = f"random streams restored on {_ranks(0, min(saved, now))}"
    if now > saved:
        return streams + f", {_ranks(saved, now)} start{'s' if now - saved == 1 else ''} from " \
                         f"{'its seed' if now - saved == 1 else 'their seeds'}"
    return streams + f", those of {_ranks(now, saved)} dropped"


def _ranks(first: int, end: int) -> str:
    """"rank 2" or "ranks 2-3": the ranks first .. end - 1."""
    return f"rank {first}" if end - first == 1 else f"ranks {first}-{end - 1}"
