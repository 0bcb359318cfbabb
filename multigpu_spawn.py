"""Data-parallel training on one machine, processes started by mp.spawn.

Launch:
    python multigpu_spawn.py                      # one process per GPU (2 on a CPU-only machine)
    MASTER_PORT=29501 python multigpu_spawn.py    # when port 12355 is taken

Adds over singlegpu.py: the process group, DDP, DistributedSampler + set_epoch,
all-reduced metrics, exact sharded evaluation, rank 0 downloading and saving.
"""

import argparse
import os
import sys
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  torch workaround: import before any process group (docs/pitfalls.md)
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset

import common
import recipes


class Trainer:
    """Trains ``model`` (on ``device``) with ``optimizer`` and its lr ``scheduler``,
    scores ``val_data`` after every epoch, prints one line per epoch, saves the weights.
    ``task`` gives the loss and the batch transforms (common.Task); ``args`` the flags."""

    def __init__(self, model: torch.nn.Module, train_data: DataLoader, val_data: DataLoader,
                 optimizer: torch.optim.Optimizer, scheduler: LambdaLR, task: common.Task,
                 device: torch.device, args: argparse.Namespace) -> None:
        # DDP copies rank 0's weights to all ranks here, then averages gradients in every backward().
        self.model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        self.rank = dist.get_rank()
        self.train_data, self.val_data = train_data, val_data
        self.optimizer, self.scheduler = optimizer, scheduler
        self.task, self.device, self.args = task, device, args
        self.replacing = os.path.exists(args.checkpoint_path)  # an earlier run's: the first save says so

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.task.loss_fn(self.model(source), targets)
        loss.backward()
        self.optimizer.step()
        self.lr = self.scheduler.get_last_lr()[0]  # the learning rate this step used
        self.scheduler.step()  # the task's schedule moves after every optimizer step
        return loss.detach()

    def _run_epoch(self, epoch: int) -> tuple[float, float, float]:
        """One pass over the training data; (mean loss per sample, samples, seconds)."""
        self.model.train()
        self.train_data.sampler.set_epoch(epoch)  # a new shuffle each epoch, not epoch 0's again
        start = time.perf_counter()
        # Loss sum and sample count, kept on the device: an .item() per step would wait for it.
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        for source, targets in self.train_data:
            source = self.task.train_transform(source.to(self.device))
            targets = targets.to(self.device)
            loss = self._run_batch(source, targets)
            totals[0] += loss * len(targets)  # weighted by samples, as evaluate() is
            totals[1] += len(targets)
        dist.all_reduce(totals)  # sum over ranks: the global mean loss and sample count
        loss_sum, samples = totals.tolist()
        return loss_sum / samples, samples, time.perf_counter() - start

    def _save_checkpoint(self, epoch: int) -> None:
        if self.rank != 0:  # every rank holds the same weights; one saves them
            return
        torch.save(self.model.module.state_dict(), self.args.checkpoint_path)  # without DDP's prefix
        note = " (replacing an earlier run's: this script does not resume)" if self.replacing else ""
        print(f"epoch {epoch + 1} | checkpoint saved at {self.args.checkpoint_path}{note}", flush=True)
        self.replacing = False

    def train(self, max_epochs: int) -> None:
        for epoch in range(max_epochs):
            train_loss, samples, seconds = self._run_epoch(epoch)
            val_loss, val_acc = evaluate(self.model.module, self.val_data, self.task, self.device)
            accuracy = f" | val_acc {val_acc:.4f}" if val_acc is not None else ""
            line = (f"epoch {epoch + 1}/{max_epochs} | train_loss {train_loss:.6f} | val_loss {val_loss:.6f}"
                    f"{accuracy} | samples/s {samples / seconds:.1f} | epoch_s {seconds:.2f} | lr {self.lr:.6g}")
            if self.rank == 0:  # every rank holds the same numbers; one prints them
                print(line, flush=True)
            # Save after the last epoch too: the tutorials' `epoch % save_every == 0`
            # saves after the first epoch and can skip the last one.
            if (epoch + 1) % self.args.save_every == 0 or epoch + 1 == max_epochs:
                self._save_checkpoint(epoch)


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: DataLoader, task: common.Task,
             device: torch.device) -> tuple[float, Optional[float]]:
    """(mean loss, accuracy or None) over every sample of ``data``: the sum of
    per-sample losses / samples, not a mean of batch means, which would
    over-weight a short last batch. Accuracy for a classification task only.
    Collective: each rank scores its shard, the sums are all-reduced. Pass DDP's ``.module``.
    """
    for buffer in model.buffers():  # BatchNorm statistics differ across ranks: use rank 0's, as saved
        dist.broadcast(buffer, src=0)
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, samples
    for source, targets in data:
        source = task.eval_transform(source.to(device))
        targets = targets.to(device)
        output = model(source)
        totals[0] += task.loss_fn(output, targets, reduction="sum")
        if task.classification:
            totals[1] += (output.argmax(dim=1) == targets).sum()
        totals[2] += len(targets)
    model.train()
    dist.all_reduce(totals)
    loss_sum, correct, samples = totals.tolist()
    return loss_sum / samples, (correct / samples if task.classification else None)


def prepare_dataloader(dataset: Dataset, batch_size: int, train: bool, seed: int, collate_fn: Callable) -> DataLoader:
    """Training: reshuffled every epoch from ``seed``, last partial batch dropped
    (a batch of 1 would break BatchNorm). Evaluation: every sample, in order.
    Each rank takes its 1/world_size share of an epoch (DistributedSampler) and evaluation
    samples r, r+W, r+2W, ...: each once (DistributedSampler would pad shards with repeats).
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if not train:
        dataset = Subset(dataset, range(rank, len(dataset), world_size))
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=False,  # the sampler shuffles
        sampler=DistributedSampler(dataset, world_size, rank, seed=seed) if train else None,
        generator=torch.Generator().manual_seed(seed) if train else None,  # the loader's seed draw: not dropout's RNG
        drop_last=train,
        collate_fn=collate_fn,  # the task's batching (common.Task.collate_fn)
    )


def main(rank: int, world_size: int, args: argparse.Namespace) -> None:
    device = torch.device(f"cuda:{rank}" if torch.cuda.is_available() else "cpu")  # rank i drives GPU i
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before init, so NCCL uses this GPU and no other
    # Join the others at MASTER_ADDR:MASTER_PORT (set at the bottom of this file).
    # NCCL joins with this process's GPU (device_id): its barriers then know which GPU to use.
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world_size,
                            device_id=device if device.type == "cuda" else None)
    torch.manual_seed(args.seed)  # the initial weights come from the seed
    if rank == 0:  # rank 0 downloads while the others wait, so no two write the same files
        task = common.load_task(args, download=True)
    dist.barrier()
    if rank != 0:
        task = common.load_task(args, download=False)
    recipes.set_recipe_flags(args, task.recipe)  # what no flag sets: the task's recipe (optimizer, lr, ...)
    model = task.model.to(device)
    torch.manual_seed(args.seed + rank)  # each rank its own stream, or all draw the same dropout masks
    optimizer = recipes.build_optimizer(model, args)  # the task's optimizer, lr, weight decay
    train_data = prepare_dataloader(task.train_set, args.batch_size, True, args.seed, task.collate_fn)
    val_data = prepare_dataloader(task.val_set, args.batch_size, False, args.seed, task.collate_fn)
    if len(train_data) == 0:
        raise common.ConfigError(f"--batch_size {args.batch_size} leaves no full batch to train; lower it")
    scheduler = LambdaLR(optimizer, recipes.lr_factor(args, len(train_data)))  # optimizer step -> lr factor
    trainer = Trainer(model, train_data, val_data, optimizer, scheduler, task, device, args)
    trainer.train(args.total_epochs)
    if task.test_set is not None:  # None: the task holds no test split (common.Task), so no test line
        test_data = prepare_dataloader(task.test_set, args.batch_size, False, args.seed, task.collate_fn)
        test_loss, test_acc = evaluate(model, test_data, task, device)
        line = f"test | loss {test_loss:.6f}" + (f" | acc {test_acc:.4f}" if test_acc is not None else "")
        if rank == 0:
            print(line, flush=True)
    del trainer  # torch 2.8: DDP still alive at destroy_process_group can hang the exit
    dist.destroy_process_group()


def run(rank: int, world_size: int, args: argparse.Namespace) -> None:
    """``main``; a ConfigError (a bad --dataset or --model, missing data) as one line, exit status 2."""
    try:
        main(rank, world_size, args)
    except common.ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


def positive(text: str) -> int:
    """argparse type: an int > 0."""
    if int(text) <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return int(text)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    add = parser.add_argument  # every default is shown by --help
    add("--total_epochs", type=positive, default=10, help="epochs to train (default: %(default)s)")
    add("--save_every", type=positive, default=5, help="save every N epochs, and after the last (default: %(default)s)")
    add("--batch_size", type=positive, default=32, help="samples per step and process (default: %(default)s)")
    add("--dataset", default="synthetic", help=f"{', '.join(common.TASKS)}, or module:function (default: %(default)s)")
    add("--model", default=None, help="model for the task (default: the task's first)")
    add("--data_dir", default=os.environ.get("DATA_DIR", "data"), help="dataset root (default: $DATA_DIR or ./data)")
    add("--seed", type=int, default=0, help="seed for data split, weights, shuffling (default: %(default)s)")
    add("--checkpoint_path", default="checkpoint_multigpu_spawn.pt", help="the model's state_dict (default: %(default)s)")
    add("--world_size", type=positive, default=torch.cuda.device_count() or 2,
        help="processes to start, at most one per GPU (default: one per GPU, or 2 without GPUs)")
    return parser.parse_args()


if __name__ == "__main__":
    args = parse_args()
    if torch.cuda.is_available() and args.world_size > torch.cuda.device_count():  # one GPU per process
        sys.exit(f"error: --world_size {args.world_size} is more processes than this machine's "
                 f"{torch.cuda.device_count()} GPUs; pass at most {torch.cuda.device_count()}")
    # Where the processes meet: a fixed address and port on this machine; the environment may override them.
    os.environ.setdefault("MASTER_ADDR", "localhost")
    os.environ.setdefault("MASTER_PORT", "12355")
    mp.spawn(run, args=(args.world_size, args), nprocs=args.world_size)  # run(rank, world_size, args)
