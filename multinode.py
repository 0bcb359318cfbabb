r"""Data-parallel training on several machines under torchrun: global vs local ranks.

Launch, on every node (N nodes, G processes each; --nproc_per_node=2 on CPUs):
    torchrun --nnodes=N --nproc_per_node=gpu --rdzv-backend=c10d \
        --rdzv-endpoint=FIRST_NODE_HOST:29500 --rdzv-id=JOB_ID multinode.py

Adds over multigpu_torchrun.py: RANK (0..world_size-1, all nodes) and LOCAL_RANK
(0..G-1 on this node) differ: LOCAL_RANK picks the GPU and who downloads on each
node, RANK who prints and saves; every rank prints its line; snapshots on shared storage.

Your own task goes in its own file (docs/custom-task.md); the train_utils
package holds the machinery you keep as it is.
"""

import contextlib
import os
import socket
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset

import common
import train_utils


def ddp_setup(timeout_s: float) -> tuple[int, int, torch.device]:
    """Join the process group torchrun prepared (RANK, LOCAL_RANK, WORLD_SIZE,
    MASTER_ADDR/PORT in the environment); return (rank, local_rank, device).
    A collective waiting over ``timeout_s`` seconds raises, not hangs."""
    timeout = timedelta(seconds=timeout_s)
    store = train_utils.launcher_store(timeout)  # torchrun or srun; a fresh key prefix per restart
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    device = train_utils.device_for(local_rank)  # GPU indices restart at 0 on every node
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before init, so NCCL uses this GPU and no other
        train_utils.enable_nccl_diagnostics()  # a stuck collective dumps what each rank ran
    train_utils.share_cpu_cores(device, world_size)
    backend = train_utils.backend_for(device)  # nccl on CUDA, gloo on the CPU
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    train_utils.watch_collectives()  # a side group that names the stuck ranks on a time-out
    return rank, local_rank, device


class Trainer:
    """Runs the epochs, evaluates, prints one summary line per epoch, saves
    snapshots and resumes from --snapshot_path when it exists.

    ``task`` gives the loss and the batch transforms (see common.Task);
    ``args`` the run's flags (--save_every, --grad_accum_steps, --amp,
    --compile, --metrics_path, --tensorboard_dir, --profile_dir, the save path).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        train_data: DataLoader,
        val_data: DataLoader,
        recipe: train_utils.Recipe,
        task: common.Task,
        device: torch.device,
        rank: int,
        local_rank: int,
        args,
    ) -> None:
        self.device = device
        self.rank = rank
        self.local_rank = local_rank
        self.model = model.to(device)
        self.train_data = train_data
        self.val_data = val_data
        self.recipe = recipe  # the optimizer, its lr schedule, the loss scaler, clipping
        self.optimizer = recipe.optimizer
        self.task = task
        self.args = args
        self.autocast = train_utils.autocast(device, args.amp)  # made once: a step must stay cheap
        self.config = dict(vars(args), world_size=dist.get_world_size())  # saved in snapshots
        self.progress = train_utils.Progress(device, train_data, rank)  # epochs, steps, RNG states
        self.stop = train_utils.StopSignal()  # SIGUSR1, SIGTERM, Ctrl-C: all ranks stop after the same step
        if train_utils.snapshot_on_every_node(args.snapshot_path):  # or on none
            self._load_snapshot(args.snapshot_path)
        # DDP copies rank 0's weights to all ranks here, then averages gradients in every backward().
        self.model = DDP(self.model, device_ids=[device.index] if device.type == "cuda" else None)
        if self.progress.resumed:  # DDP's gradient buckets as if it had never stopped
            train_utils.rebuild_ddp_buckets(self.model, train_data, task.loss_fn, task.eval_transform, device,
                                            self.autocast)  # --amp: under autocast, as the first step ran
        # The compiled module shares the model's weights and runs the training
        # forward; saving and evaluation use the plain model, so what is saved
        # loads without torch.compile.
        self.compiled = train_utils.compile_model(self.model, args.compile)
        self.profiler = train_utils.StepProfiler(args, device)  # --profile_dir: a few steps traced

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor, step: int) -> torch.Tensor:
        """Forward and backward of one micro-batch (``step`` counts them from 0 in
        the epoch); the optimizer steps after every --grad_accum_steps-th."""
        accum = self.args.grad_accum_steps
        last = (step + 1) % accum == 0  # this micro-batch ends an optimizer step
        if step % accum == 0:
            self.optimizer.zero_grad(set_to_none=True)
        # DDP's forward decides whether its backward all-reduces the gradients: under
        # no_sync() they are only summed locally, one all-reduce per optimizer step.
        with contextlib.nullcontext() if last else self.model.no_sync(), self.autocast:
            loss = self.task.loss_fn(self.compiled(source), targets)
        # Summed over the micro-batches, the gradients of loss / accum are those
        # of the mean loss over the whole accumulated batch. (No division without
        # accumulation: an extra autograd op costs a small model ~10%.)
        self.recipe.backward(loss / accum if accum > 1 else loss)  # --amp fp16: the loss scaled
        if last:
            self.recipe.step()  # unscale (fp16), clip, optimizer step, next lr
            train_utils.use_training_timeout(self.args.pg_timeout_s)  # from the first step on
        return loss.detach()

    def _run_epoch(self, epoch: int, max_epochs: int) -> Optional[dict]:
        self.model.train()
        # A new shuffle each epoch; without this every epoch repeats epoch 0's order.
        self.train_data.sampler.set_epoch(epoch)
        # After a mid-epoch resume, skip the batches this rank already trained on.
        self.train_data.sampler.start = self.progress.steps_run * self.train_data.batch_size
        host = socket.gethostname()  # every rank reports, so the split across nodes and GPUs shows
        train_utils.print_line(f"[rank {self.rank} | local_rank {self.local_rank} | host {host}] epoch {epoch + 1} "
                               f"| batch_size {self.train_data.batch_size} | steps {len(self.train_data)}")
        meter = train_utils.EpochMeter(epoch, max_epochs, self.device, self.progress.epoch_totals)
        for step, (source, targets) in enumerate(meter.batches(self.train_data, self.args),
                                                 start=self.progress.steps_run):
            source = self.task.train_transform(source.to(self.device, non_blocking=True))
            targets = targets.to(self.device, non_blocking=True)
            meter.add(self._run_batch(source, targets, step), len(targets))
            self.profiler.step()  # --profile_dir: the profiler's schedule; off: returns at once
            self.progress.steps_run = step + 1
            if self.progress.steps_run % self.args.grad_accum_steps:
                continue  # no stop, no snapshot mid-accumulation: its gradients would be lost
            if self.stop.poll():  # some rank got the signal; every rank stops after this step
                self._save_snapshot(meter)
                return None
            every = self.args.snapshot_every_steps  # and not at the epoch's end: that one comes next
            if every and self.progress.steps_run % every == 0 and meter.steps_left:
                self._save_snapshot(meter)
        dist.all_reduce(meter.totals)  # sum over ranks: the global mean loss and sample count
        return meter.summary() | self.recipe.epoch_figures()  # lr; fp16: steps skipped

    def _load_snapshot(self, snapshot_path: str) -> None:
        snapshot = train_utils.read_snapshot(snapshot_path, self.config)  # refuses another run's
        self.model.load_state_dict(snapshot["model"])
        self.optimizer.load_state_dict(snapshot["optimizer"])
        self.recipe.resume(snapshot)  # the schedule and loss scale go on; a new --lr takes over
        self.progress.load_state_dict(snapshot)  # and this rank's RNG states: the same random draws
        if self.rank == 0:
            train_utils.log_resume(snapshot_path, self.progress.position(), self.progress.resize_note(self.recipe))

    def _save_snapshot(self, meter: Optional[train_utils.EpochMeter] = None) -> None:
        """Collective. Mid-epoch, ``meter`` holds the epoch so far (its totals are saved too)."""
        progress = self.progress.state_dict(meter)  # every rank's RNG states, gathered
        if self.rank != 0:  # every rank holds the same weights; one saves them
            return
        snapshot = {
            "model": self.model.module.state_dict(),  # .module: loadable without DDP
            "optimizer": self.optimizer.state_dict(),
            **progress,  # epochs_run, steps_run, epoch_totals, rng_states
            **self.recipe.state_dict(),  # lr_schedule, loss_scaler
            "config": self.config,
        }
        train_utils.atomic_save(snapshot, self.args.snapshot_path)  # temp file + rename: never torn
        train_utils.print_line(f"{self.progress.tag()} | snapshot saved at {self.args.snapshot_path}")

    def train(self, max_epochs: int) -> bool:
        for epoch in range(self.progress.epochs_run, max_epochs):
            record = self._run_epoch(epoch, max_epochs)
            if record is None:  # stopped by the signal, after a snapshot of this step
                return False
            record["val_loss"], record["val_accuracy"] = evaluate(
                self.model.module, self.val_data, self.task, self.device)
            if self.rank == 0:  # every rank holds the same numbers; one prints them
                train_utils.log_metrics(record, self.args)
            self.progress.end_epoch(epoch)
            # Save after the last epoch too: the tutorials' `epoch % save_every == 0`
            # saves after the first epoch and can skip the last one.
            if (epoch + 1) % self.args.save_every == 0 or epoch + 1 == max_epochs:
                self._save_snapshot()
        return True


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: DataLoader, task: common.Task,
             device: torch.device) -> tuple[float, Optional[float]]:
    """Mean loss, and accuracy for a classification task, over every sample of ``data``.

    The loss is weighted by samples (sum of per-sample losses / sample count),
    not a mean of batch means, which would over-weight a short last batch.
    Collective: ranks score their shards, sums all-reduced; pass ``.module``: DDP's forward is one too.
    Returns (loss, accuracy or None).
    """
    train_utils.broadcast_buffers(model)  # each rank's BatchNorm statistics differ: use rank 0's, as saved
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, samples
    for source, targets in train_utils.evaluating(data):  # with a progress bar where stderr is a terminal
        source = task.eval_transform(source.to(device, non_blocking=True))
        targets = targets.to(device, non_blocking=True)
        output = model(source)
        totals[0] += task.loss_fn(output, targets, reduction="sum")
        if task.classification:
            totals[1] += (output.argmax(dim=1) == targets).sum()
        totals[2] += len(targets)
    model.train()
    dist.all_reduce(totals)
    loss_sum, correct, samples = totals.tolist()
    return loss_sum / samples, (correct / samples if task.classification else None)


def load_train_objs(args, download: bool) -> tuple[common.Task, torch.optim.Optimizer]:
    task = train_utils.downloaders_first(common.load_task, args, download)
    optimizer = train_utils.build_optimizer(task.model, args)  # --optimizer, --lr, --weight_decay
    return task, optimizer


def prepare_dataloader(dataset: Dataset, batch_size: int, num_workers: int, train: bool,
                       seed: int) -> DataLoader:
    """Training: reshuffled every epoch from ``seed``, last partial batch dropped
    (a batch of 1 would break BatchNorm); each rank takes its 1/world_size of the
    epoch's permutation (DistributedSampler). Evaluation: rank r takes samples r,
    r+W, r+2W, ... unpadded, each sample once."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if not train:
        dataset = Subset(dataset, range(rank, len(dataset), world_size))
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=False,  # the sampler shuffles
        sampler=train_utils.ResumableDistributedSampler(dataset, world_size, rank, seed=seed) if train else None,
        # Workers are seeded from this generator, which snapshots save and restore.
        generator=torch.Generator().manual_seed(seed + rank) if train else None,
        drop_last=train,
        **train_utils.loader_workers(num_workers, dataset),  # from a fork server; they ignore stop signals
        pin_memory=torch.cuda.is_available(),
        collate_fn=common.collate,  # whole batches from InMemoryImages pass through
    )


@train_utils.one_line_errors
def main(args) -> None:
    train_utils.catch_stop_signals()  # from here a stop signal ends start-up cleanly, at once
    rank, local_rank, device = ddp_setup(args.startup_timeout_s)
    # Each rank its own random stream, or all would draw the same dropout masks
    # (initial weights still match: DDP copies rank 0's to all).
    torch.manual_seed(args.seed + rank)
    # One process per node downloads (--data_dir is usually node-local; pre-stage a shared one).
    task, optimizer = load_train_objs(args, download=local_rank == 0)
    train_data = prepare_dataloader(task.train_set, args.batch_size, args.num_workers, True, args.seed)
    val_data = prepare_dataloader(task.val_set, args.batch_size, args.num_workers, False, args.seed)
    test_data = prepare_dataloader(task.test_set, args.batch_size, args.num_workers, False, args.seed)
    train_utils.check_before_training(args, device, train_data, args.snapshot_path, saves=rank == 0)
    if rank == 0:
        train_utils.print_line(train_utils.describe_run(device, args))
    recipe = train_utils.Recipe(optimizer, args, len(train_data) // args.grad_accum_steps, device)
    trainer = Trainer(task.model, train_data, val_data, recipe, task, device, rank, local_rank, args)
    train_utils.start_wandb_run(args)  # --wandb_project: rank 0's W&B run (after a resume, the snapshot's)
    if trainer.train(args.total_epochs):  # False: stopped by the signal, snapshot saved
        test_loss, test_accuracy = evaluate(trainer.model.module, test_data, task, device)
        if rank == 0:
            train_utils.log_metrics({"test_loss": test_loss, "test_accuracy": test_accuracy}, args)
            train_utils.report_run_finished()  # a Slurm wrapper requeues only a run with epochs left
    trainer.stop.close()
    del trainer  # free DDP before its process group: torch 2.8 can deadlock otherwise
    dist.destroy_process_group()


if __name__ == "__main__":
    args = train_utils.parse_args(__doc__, common.TASKS, ["snapshot_path", "snapshot_every_steps", "pg_timeout_s"])
    main(args)
