"""Training on one device: the first rung of the ladder.

Launch:
    python singlegpu.py                                    # synthetic task, no download
    python singlegpu.py --dataset mnist --total_epochs 5   # real data

One process, one device (the first GPU, else the CPU), a task and its recipe.
Each later script adds one distributed concept: `diff -u singlegpu.py multigpu_spawn.py`.
"""

import argparse
import os
import sys
import time
from typing import Callable, Optional

import torch
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader, Dataset

import common
import recipes


class Trainer:
    """Trains ``model`` (on ``device``) with ``optimizer`` and its lr ``scheduler``,
    scores ``val_data`` after every epoch, prints one line per epoch, saves the weights.
    ``task`` gives the loss and the batch transforms (common.Task); ``args`` the flags."""

    def __init__(self, model: torch.nn.Module, train_data: DataLoader, val_data: DataLoader,
                 optimizer: torch.optim.Optimizer, scheduler: LambdaLR, task: common.Task,
                 device: torch.device, args: argparse.Namespace) -> None:
        self.model = model
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
        start = time.perf_counter()
        # Loss sum and sample count, kept on the device: an .item() per step would wait for it.
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        for source, targets in self.train_data:
            source = self.task.train_transform(source.to(self.device))
            targets = targets.to(self.device)
            loss = self._run_batch(source, targets)
            totals[0] += loss * len(targets)  # weighted by samples, as evaluate() is
            totals[1] += len(targets)
        loss_sum, samples = totals.tolist()
        return loss_sum / samples, samples, time.perf_counter() - start

    def _save_checkpoint(self, epoch: int) -> None:
        torch.save(self.model.state_dict(), self.args.checkpoint_path)
        note = " (replacing an earlier run's: this script does not resume)" if self.replacing else ""
        print(f"epoch {epoch + 1} | checkpoint saved at {self.args.checkpoint_path}{note}", flush=True)
        self.replacing = False

    def train(self, max_epochs: int) -> None:
        for epoch in range(max_epochs):
            train_loss, samples, seconds = self._run_epoch(epoch)
            val_loss, val_acc = evaluate(self.model, self.val_data, self.task, self.device)
            accuracy = f" | val_acc {val_acc:.4f}" if val_acc is not None else ""
            line = (f"epoch {epoch + 1}/{max_epochs} | train_loss {train_loss:.6f} | val_loss {val_loss:.6f}"
                    f"{accuracy} | samples/s {samples / seconds:.1f} | epoch_s {seconds:.2f} | lr {self.lr:.6g}")
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
    """
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
    loss_sum, correct, samples = totals.tolist()
    return loss_sum / samples, (correct / samples if task.classification else None)


def prepare_dataloader(dataset: Dataset, batch_size: int, train: bool, seed: int, collate_fn: Callable) -> DataLoader:
    """Training: reshuffled every epoch from ``seed``, last partial batch dropped
    (a batch of 1 would break BatchNorm). Evaluation: every sample, in order.
    """
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=train,
        generator=torch.Generator().manual_seed(seed) if train else None,  # the shuffle's own stream
        drop_last=train,
        collate_fn=collate_fn,  # the task's batching (common.Task.collate_fn)
    )


def main(args: argparse.Namespace) -> None:
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(args.seed)  # the initial weights come from the seed
    task = common.load_task(args, download=True)
    recipes.set_recipe_flags(args, task.recipe)  # what no flag sets: the task's recipe (optimizer, lr, ...)
    model = task.model.to(device)
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
        print(line, flush=True)


def run(args: argparse.Namespace) -> None:
    """``main``; a ConfigError (a bad --dataset or --model, missing data) as one line, exit status 2."""
    try:
        main(args)
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
    add("--batch_size", type=positive, default=32, help="samples per step (default: %(default)s)")
    add("--dataset", default="synthetic", help=f"{', '.join(common.TASKS)}, or module:function (default: %(default)s)")
    add("--model", default=None, help="model for the task (default: the task's first)")
    add("--data_dir", default=os.environ.get("DATA_DIR", "data"), help="dataset root (default: $DATA_DIR or ./data)")
    add("--seed", type=int, default=0, help="seed for data split, weights, shuffling (default: %(default)s)")
    add("--checkpoint_path", default="checkpoint_singlegpu.pt", help="the model's state_dict (default: %(default)s)")
    return parser.parse_args()


if __name__ == "__main__":
    run(parse_args())
