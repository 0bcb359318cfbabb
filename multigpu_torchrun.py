"""Data-parallel training on one machine under torchrun, with snapshots.

Launch:
    torchrun --standalone --nproc_per_node=gpu multigpu_torchrun.py      # one process per GPU
    torchrun --standalone --nproc_per_node=2 multigpu_torchrun.py        # CPU: choose a number
    torchrun --standalone --nproc_per_node=2 --max-restarts=3 multigpu_torchrun.py
    sbatch slurm/multi_gpu.sh                                            # under Slurm

Adds over multigpu_spawn.py: torchrun starts the processes and hands each its
RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (no port of ours to collide),
and may restart them all after a failure (--max-restarts). To make a restart
worth it, the script saves a snapshot (model, optimizer, the position in the
run down to the step, every rank's RNG states, the run's settings) at epoch
ends and every --snapshot_every_steps steps, and resumes from it
automatically: the resumed run continues exactly where the snapshot was taken.
On SIGUSR1 (a scheduler's warning before a time limit or preemption; see
slurm/multi_gpu.sh), every rank finishes its step, all stop at the same step,
rank 0 saves a snapshot and the script exits 0, ready to be resumed.
"""

import contextlib
import itertools
import os
import signal
import time
from datetime import timedelta
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm

import common


def ddp_setup(timeout_s: float) -> tuple[int, torch.device]:
    """Join the process group torchrun prepared; return (rank, this rank's device).

    torchrun gives each process RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT and TORCHELASTIC_RESTART_COUNT (how often it restarted the job).
    A collective that waits longer than ``timeout_s`` seconds raises, so a
    rank stuck or gone makes the job fail instead of hang.
    Raises ConfigError when the script was not started by torchrun.
    """
    if "RANK" not in os.environ:
        raise common.ConfigError("start this script with torchrun, e.g. torchrun --standalone "
                                 "--nproc_per_node=gpu multigpu_torchrun.py (or =2 on CPU)")
    rank = int(os.environ["RANK"])
    # One node: RANK equals LOCAL_RANK, so rank i drives GPU i. multinode.py separates them.
    device = common.get_device(rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before init, so NCCL uses this GPU and no other
        backend = "nccl"
    else:
        backend = "gloo"  # torchrun sets OMP_NUM_THREADS=1 when it starts several
    # torchrun's agent keeps one key-value store at MASTER_ADDR:MASTER_PORT across
    # restarts. Give each attempt its own key prefix: without it a restarted rank
    # can read the addresses its failed predecessor left there, then fail or hang
    # connecting (seen with torch 2.15). init_method "env://" would not do this.
    world_size, timeout = int(os.environ["WORLD_SIZE"]), timedelta(seconds=timeout_s)
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=rank == 0 and not agent_hosts_store, timeout=timeout)
    store = dist.PrefixStore(f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    init_process_group(backend=backend, store=store, rank=rank, world_size=world_size,
                       timeout=timeout)
    return rank, device


class ResumableDistributedSampler(DistributedSampler):
    """A DistributedSampler that can start an epoch part-way.

    Setting ``start`` skips the first ``start`` indices of this rank's share
    of the epoch, so a run resumed from a mid-epoch snapshot continues the
    same permutation at the next batch: no sample repeated, none skipped.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.start = 0

    def __iter__(self):
        return itertools.islice(super().__iter__(), self.start, None)

    def __len__(self) -> int:
        return self.num_samples - self.start


class StopSignal:
    """Turns a signal into a stop that every rank takes at the same step.

    A scheduler's warning (Slurm's ``--signal``, relayed by torchrun) reaches
    the ranks at slightly different moments, possibly mid-step. The handler
    only sets a flag. Once per step each rank adds its flag to an all-reduce
    (MAX) and reads the previous step's result, so all ranks learn "some rank
    was signalled" at the same step, one step after the earliest signal.
    The all-reduce runs asynchronously on a separate CPU (gloo) group: it
    never waits for the GPU, and by the next step it has long finished, so a
    step costs no extra wait. Create it on every rank (``new_group`` is
    collective); ``poll`` too must be called by every rank, equally often.
    """

    def __init__(self, signum: int = signal.SIGUSR1) -> None:
        self.signum = signum
        self.received = False
        signal.signal(signum, self._handler)
        self.group = dist.new_group(backend="gloo")
        self.flag = torch.zeros(1)
        self.work = None

    def _handler(self, signum, frame) -> None:
        self.received = True

    def poll(self) -> bool:
        """Collective. True on every rank at the same call, one call after
        the first rank got the signal; False otherwise."""
        stop = False
        if self.work is not None:
            self.work.wait()
            stop = self.flag.item() > 0
        self.flag.fill_(float(self.received))
        self.work = dist.all_reduce(self.flag, op=dist.ReduceOp.MAX, group=self.group,
                                    async_op=True)
        return stop

    def close(self) -> None:
        """Wait for the last all-reduce, before the process group goes away."""
        if self.work is not None:
            self.work.wait()
            self.work = None


def ignore_stop_signal(worker_id: int) -> None:
    """DataLoader ``worker_init_fn``: loader workers ignore SIGUSR1.

    torchrun signals a rank's whole process group, loader workers included.
    Forked workers inherit the rank's flag-setting handler (harmless), but
    workers started by forkserver or spawn (Python 3.14's default on Linux is
    forkserver) would die of it, and the rank with them, before it could save.
    """
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


class Trainer:
    """Runs the epochs, evaluates, logs one summary line per epoch, saves
    snapshots and resumes from ``snapshot_path`` when it exists.

    Batches from ``train_data``/``val_data`` are (source, targets) pairs with
    the shapes of ``common.Task``; ``loss_fn(output, targets, reduction=...)``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        train_data: DataLoader,
        val_data: DataLoader,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[..., torch.Tensor],
        device: torch.device,
        rank: int,
        save_every: int,
        snapshot_every_steps: int,
        snapshot_path: str,
        metrics_path: Optional[str],
        config: dict,
        options: common.TrainOptions = common.TrainOptions(),
    ) -> None:
        self.device = device
        self.rank = rank
        self.model = model.to(device)
        self.train_data = train_data
        self.val_data = val_data
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.save_every = save_every
        self.snapshot_every_steps = snapshot_every_steps
        self.snapshot_path = snapshot_path
        self.metrics_path = metrics_path
        self.config = config
        self.grad_accum_steps = options.grad_accum_steps
        self.autocast = common.autocast(device, options.amp)  # made once: a step must stay cheap
        self.train_transform, self.eval_transform = options.train_transform, options.eval_transform
        self.epochs_run = 0  # epochs finished
        self.steps_run = 0  # steps finished in epoch `epochs_run` (> 0 after a mid-epoch snapshot)
        # The epoch's global (loss sum, samples) up to `steps_run`, so its summary stays exact.
        self.epoch_totals = torch.zeros(2, dtype=torch.float64, device=device)
        self.stop = StopSignal()  # SIGUSR1: snapshot and stop at the same step on all ranks
        self.stopped = False
        if os.path.exists(snapshot_path):
            self._load_snapshot(snapshot_path)
        # DDP broadcasts rank 0's weights to all ranks here, then averages the
        # gradients across ranks during every backward().
        self.model = DDP(self.model, device_ids=[device.index] if device.type == "cuda" else None)
        # The compiled module shares the model's weights and runs the training
        # forward; saving and evaluation use the plain model, so what is saved
        # loads without torch.compile.
        self.compiled = common.compile_model(self.model, options.compile)

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor, step: int) -> torch.Tensor:
        """Forward and backward of one micro-batch; ``step`` counts them from 0
        in the epoch. The optimizer steps after every ``grad_accum_steps``-th."""
        common.fault_point("step")  # test hook: a no-op unless DDP_TEST_FAULT is set
        last = (step + 1) % self.grad_accum_steps == 0  # this micro-batch ends an optimizer step
        if step % self.grad_accum_steps == 0:
            self.optimizer.zero_grad(set_to_none=True)
        # DDP all-reduces the gradients during backward. Under no_sync() it only
        # adds them up locally; the last micro-batch's backward all-reduces the
        # sums: one all-reduce per optimizer step, not one per micro-batch.
        with contextlib.nullcontext() if last else self.model.no_sync():
            with self.autocast:
                loss = self.loss_fn(self.compiled(source), targets)
            # Summed over the micro-batches, the gradients of loss / grad_accum_steps
            # are those of the mean loss over the whole accumulated batch. (Without
            # accumulation no division: an extra autograd op costs a small model ~10%.)
            (loss / self.grad_accum_steps if self.grad_accum_steps > 1 else loss).backward()
        if last:
            self.optimizer.step()
        return loss.detach()

    def _run_epoch(self, epoch: int, max_epochs: int) -> dict:
        self.model.train()
        # A new shuffle each epoch; without this every epoch repeats epoch 0's order.
        self.train_data.sampler.set_epoch(epoch)
        # After a mid-epoch resume, skip the batches this rank already trained on.
        self.train_data.sampler.start = self.steps_run * self.train_data.batch_size
        # Running sums stay on the device: a .item() per step would make the
        # CPU wait for the GPU at every step.
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)  # loss sum, samples
        # Whole optimizer steps only: a last group of fewer than grad_accum_steps
        # micro-batches is dropped, as drop_last drops a short batch.
        steps = len(self.train_data) - len(self.train_data) % self.grad_accum_steps
        steps_per_epoch = self.steps_run + steps  # a resume starts at an optimizer-step boundary
        common.reset_peak_memory(self.device)
        start = time.perf_counter()
        # A progress bar only on a terminal (disable=None), not in logs.
        for source, targets in tqdm(itertools.islice(self.train_data, steps), total=steps,
                                    desc=f"epoch {epoch + 1}/{max_epochs}", leave=False,
                                    disable=True if self.rank != 0 else None):
            source = self.train_transform(source.to(self.device, non_blocking=True))
            targets = targets.to(self.device, non_blocking=True)
            loss = self._run_batch(source, targets, self.steps_run)
            totals[0] += loss * len(targets)
            totals[1] += len(targets)
            self.steps_run += 1
            # Polled at optimizer-step boundaries only: a snapshot between micro-batches
            # would lose the gradients accumulated so far. Every rank polls equally often.
            if self.steps_run % self.grad_accum_steps == 0 and self.stop.poll():
                # Every rank is here after the same step: save it and end the run.
                self._save_snapshot(epoch, totals)
                # Nobody exits before rank 0 has saved: under srun --kill-on-bad-exit
                # an early exit elsewhere would get rank 0 killed mid-save.
                dist.barrier()
                self.stopped = True
                return {}
            if (self.snapshot_every_steps and self.steps_run % self.snapshot_every_steps == 0
                    and self.steps_run < steps_per_epoch):
                self._save_snapshot(epoch, totals)
        dist.all_reduce(totals)  # sum over ranks: the global mean loss and sample count
        new_samples = totals[1].item()  # waits for the device, so the time is honest
        seconds = time.perf_counter() - start
        loss_sum, samples = (totals + self.epoch_totals).tolist()
        common.check_finite(loss_sum / samples, epoch)
        self.steps_run = 0
        self.epoch_totals.zero_()
        return {"train_loss": loss_sum / samples, "samples_per_s": new_samples / seconds,
                "epoch_seconds": seconds, **common.peak_memory_mib(self.device)}

    def _rng_state(self) -> dict:
        cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        return {"cpu": torch.get_rng_state(), "cuda": cuda,
                "loader": self.train_data.generator.get_state()}

    def _load_snapshot(self, snapshot_path: str) -> None:
        try:
            # weights_only=True unpickles tensors and plain containers only, never
            # arbitrary objects: a crafted file cannot run code here.
            snapshot = torch.load(snapshot_path, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise common.ConfigError(
                f"cannot read snapshot {snapshot_path} ({type(exc).__name__}: "
                f"{str(exc).strip().splitlines()[0] if str(exc).strip() else 'no detail'}); "
                f"move it away to start afresh, or pass another --snapshot_path") from None
        changed = [f"{key} {snapshot['config'].get(key)} -> {self.config[key]}"
                   for key in ("dataset", "model", "world_size", "batch_size", "grad_accum_steps")
                   if snapshot["config"].get(key) != self.config[key]]
        if changed:
            raise common.ConfigError(
                f"snapshot {snapshot_path} comes from a different run ({', '.join(changed)}); "
                f"resume with its settings, or pass another --snapshot_path")
        self.model.load_state_dict(snapshot["model"])
        self.optimizer.load_state_dict(snapshot["optimizer"])
        # The snapshot's learning rate came back with the optimizer state; a new --lr
        # (say, lower after a divergence) takes over from here.
        for group in self.optimizer.param_groups:
            group["lr"] = self.config["lr"]
        self.epochs_run = snapshot["epochs_run"]
        self.steps_run = snapshot["steps_run"]
        self.epoch_totals = snapshot["epoch_totals"].to(self.device)
        state = snapshot["rng_states"][self.rank]
        torch.set_rng_state(state["cpu"])
        if state["cuda"] is not None:
            torch.cuda.set_rng_state(state["cuda"], self.device)
        self.train_data.generator.set_state(state["loader"])
        if self.rank == 0:
            where = (f"in epoch {self.epochs_run + 1} after step {self.steps_run}" if self.steps_run
                     else f"after epoch {self.epochs_run}")
            common.say(f"resuming from snapshot {snapshot_path} {where}")

    def _save_snapshot(self, epoch: int, totals: Optional[torch.Tensor] = None) -> None:
        """Collective. At the end of ``epoch``, or (with this rank's running
        ``totals``) in its middle, after ``self.steps_run`` steps."""
        if totals is None:
            epochs_run, steps_run = epoch + 1, 0
            epoch_totals = torch.zeros(2, dtype=torch.float64)
        else:
            epochs_run, steps_run = epoch, self.steps_run
            epoch_totals = totals.clone()
            dist.all_reduce(epoch_totals)
            epoch_totals = (epoch_totals + self.epoch_totals).cpu()
            common.check_finite(epoch_totals[0].item() / epoch_totals[1].item(), epoch)
        # Every rank's RNG state travels to rank 0, so that a resumed run draws
        # the same dropout masks and augmentations on every rank.
        rng_states = [None] * dist.get_world_size()
        dist.all_gather_object(rng_states, self._rng_state())
        if self.rank != 0:
            return
        snapshot = {
            "model": self.model.module.state_dict(),  # .module: loadable without DDP
            "optimizer": self.optimizer.state_dict(),
            "epochs_run": epochs_run,
            "steps_run": steps_run,
            "epoch_totals": epoch_totals,
            "rng_states": rng_states,
            "config": self.config,
        }
        common.atomic_save(snapshot, self.snapshot_path)  # temp file + rename: never torn
        where = f" step {steps_run}" if steps_run else ""
        common.say(f"epoch {epoch + 1}{where} | snapshot saved at {self.snapshot_path}")

    def train(self, max_epochs: int) -> bool:
        """Train up to ``max_epochs``; False if stopped early by the signal
        (a snapshot of the step reached is saved), True when finished."""
        for epoch in range(self.epochs_run, max_epochs):
            record = {"epoch": epoch + 1, "total_epochs": max_epochs}
            record.update(self._run_epoch(epoch, max_epochs))
            if self.stopped:
                return False
            record["val_loss"], record["val_accuracy"] = evaluate(
                self.model.module, self.val_data, self.loss_fn, self.device, self.eval_transform)
            if self.rank == 0:  # every rank holds the same numbers; one prints them
                common.log_metrics(record, self.metrics_path)
            # Save after the last epoch too: the tutorials' `epoch % save_every == 0`
            # saves after the first epoch and can skip the last one.
            if (epoch + 1) % self.save_every == 0 or epoch + 1 == max_epochs:
                self._save_snapshot(epoch)
        return True


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: DataLoader, loss_fn: Callable[..., torch.Tensor],
             device: torch.device, transform: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
             ) -> tuple[float, Optional[float]]:
    """Mean loss and accuracy over every sample of the whole evaluation set.

    Collective: every rank calls it with its own shard (see prepare_dataloader),
    and the sums are all-reduced, so every rank returns the same exact values.
    The loss is weighted by samples (sum of per-sample losses / sample count),
    not a mean of batch means, which would over-weight a short last batch.
    Pass the plain module (``ddp_model.module``): shards may differ by one
    batch, and DDP's forward may broadcast buffers, a collective that would
    then wait forever for the ranks that have already finished.
    ``transform`` turns a batch's inputs, on the device, into the model's
    input (the task's ``eval_transform``; none: they already are).
    Returns (loss, accuracy); accuracy is None for regression.
    """
    # DDP broadcasts buffers (BatchNorm running stats) from rank 0 before each
    # training forward, so after the last step each rank holds its own. Use
    # rank 0's everywhere, so the result is that of the model rank 0 saves.
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, samples
    for source, targets in data:
        source = source.to(device, non_blocking=True)
        source = transform(source) if transform else source
        targets = targets.to(device, non_blocking=True)
        output = model(source)
        totals[0] += loss_fn(output, targets, reduction="sum")
        if loss_fn is F.cross_entropy:
            totals[1] += (output.argmax(dim=1) == targets).sum()
        totals[2] += len(targets)
    model.train()
    dist.all_reduce(totals)
    loss_sum, correct, samples = totals.tolist()
    return loss_sum / samples, (correct / samples if loss_fn is F.cross_entropy else None)


def load_train_objs(args) -> tuple[common.Task, torch.optim.Optimizer]:
    task = common.load_task(args.dataset, args.model, args.data_dir, args.seed,
                            input_path=args.input_path)
    optimizer = torch.optim.SGD(task.model.parameters(), lr=args.lr, momentum=0.9)
    return task, optimizer


def prepare_dataloader(dataset: Dataset, batch_size: int, num_workers: int, train: bool,
                       seed: int) -> DataLoader:
    """Training: DistributedSampler gives each rank a disjoint 1/world_size of a
    permutation drawn from (seed, epoch), padding with repeats so all ranks
    take the same number of steps; last partial batch dropped (a batch of 1
    would break BatchNorm). Evaluation: rank r takes samples r, r+W, r+2W, ...
    with no padding, so every sample is counted exactly once (a
    DistributedSampler would repeat samples to even out the shards)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if not train:
        dataset = Subset(dataset, range(rank, len(dataset), world_size))
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=False,  # the sampler shuffles
        sampler=ResumableDistributedSampler(dataset, world_size, rank, shuffle=True, seed=seed)
        if train else None,
        # Workers are seeded from this generator, not the global RNG, so starting
        # an epoch part-way draws nothing from the global RNG; snapshots hold its state.
        generator=torch.Generator().manual_seed(seed + rank) if train else None,
        drop_last=train,
        num_workers=num_workers,
        worker_init_fn=ignore_stop_signal,
        pin_memory=torch.cuda.is_available(),
        collate_fn=common.collate,  # whole batches from InMemoryImages pass through
    )


@common.exit_on_config_error
def main(args) -> None:
    rank, device = ddp_setup(args.pg_timeout_s)
    # Each rank its own random stream (dropout, augmentation): the same seed
    # everywhere would give every rank the same dropout masks. Initial weights
    # still match, because DDP copies rank 0's to all.
    torch.manual_seed(args.seed + rank)
    args.model = common.resolve_model(args.dataset, args.model)
    common.check_amp(args.amp, device, args.model)
    if args.snapshot_every_steps % args.grad_accum_steps:  # snapshots fall between optimizer steps
        raise common.ConfigError(f"--snapshot_every_steps {args.snapshot_every_steps} is not a "
                                 f"multiple of --grad_accum_steps {args.grad_accum_steps}; a "
                                 f"snapshot must fall between optimizer steps")
    # Rank 0 downloads while the others wait, so no two write the same files.
    common.prepare_data(args.dataset, args.data_dir, download=rank == 0)
    task, optimizer = load_train_objs(args)
    train_data = prepare_dataloader(task.train_set, args.batch_size, args.num_workers, True, args.seed)
    val_data = prepare_dataloader(task.val_set, args.batch_size, args.num_workers, False, args.seed)
    test_data = prepare_dataloader(task.test_set, args.batch_size, args.num_workers, False, args.seed)
    common.check_steps(train_data, args.grad_accum_steps)
    common.check_writable(args.snapshot_path, check=rank == 0)  # rank 0 saves
    config = dict(vars(args), world_size=dist.get_world_size())  # stored in the snapshot
    if rank == 0:
        common.say(common.global_batch_line(args.batch_size, args.grad_accum_steps,
                                            dist.get_world_size()))
    trainer = Trainer(task.model, train_data, val_data, optimizer, task.loss_fn, device, rank,
                      args.save_every, args.snapshot_every_steps, args.snapshot_path,
                      args.metrics_path, config, common.train_options(args, task))
    finished = trainer.train(args.total_epochs)
    if finished:
        test_loss, test_accuracy = evaluate(trainer.model.module, test_data, task.loss_fn, device,
                                            task.eval_transform)
        if rank == 0:
            common.log_metrics({"test_loss": test_loss, "test_accuracy": test_accuracy},
                               args.metrics_path)
    elif rank == 0:
        common.say(f"stopped by {signal.Signals(trainer.stop.signum).name}: the snapshot holds "
                   f"every step trained; run the same command again to resume")
    trainer.stop.close()
    destroy_process_group()


if __name__ == "__main__":
    parser = common.build_parser(__doc__)
    parser.add_argument("--snapshot_path", default="snapshot.pt",
                        help="snapshot to resume from when it exists, and to save to "
                             "(default: snapshot.pt)")
    parser.add_argument("--snapshot_every_steps", type=common.non_negative_int, default=0,
                        help="also snapshot every N steps inside an epoch, so a restart "
                             "loses at most N steps (default: 0, only at epoch ends)")
    parser.add_argument("--pg_timeout_s", type=common.positive(float), default=1800,
                        help="seconds a collective may wait for the other ranks before "
                             "the job fails (default: 1800)")
    args = parser.parse_args()
    main(args)
