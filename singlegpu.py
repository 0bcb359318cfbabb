"""Training on one device: the first rung of the ladder.

Launch:
    python singlegpu.py                                    # synthetic task, no download
    python singlegpu.py --dataset mnist --total_epochs 5   # real data

The baseline: one process on one device, the first GPU or else the CPU.
Each later script adds one distributed concept; `diff -u singlegpu.py
multigpu_spawn.py` shows the first.

Your own task goes in its own file (docs/custom-task.md); the train_utils
package holds the machinery you keep as it is.
"""

from typing import Optional

import torch
from torch.utils.data import DataLoader, Dataset

import common
import train_utils


class Trainer:
    """Runs the epochs, evaluates, prints one summary line per epoch, saves
    its checkpoint.

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
        args,
    ) -> None:
        self.device = device
        self.model = model.to(device)
        self.train_data = train_data
        self.val_data = val_data
        self.recipe = recipe  # the optimizer, its lr schedule, the loss scaler, clipping
        self.optimizer = recipe.optimizer
        self.task = task
        self.args = args
        self.autocast = train_utils.autocast(device, args.amp)  # made once: a step must stay cheap
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
        with self.autocast:
            loss = self.task.loss_fn(self.compiled(source), targets)
        # Summed over the micro-batches, the gradients of loss / accum are those
        # of the mean loss over the whole accumulated batch. (No division without
        # accumulation: an extra autograd op costs a small model ~10%.)
        self.recipe.backward(loss / accum if accum > 1 else loss)  # --amp fp16: the loss scaled
        if last:
            self.recipe.step()  # unscale (fp16), clip, optimizer step, next lr
        return loss.detach()

    def _run_epoch(self, epoch: int, max_epochs: int) -> dict:
        self.model.train()
        meter = train_utils.EpochMeter(epoch, max_epochs, self.device)  # loss sum, samples, time
        for step, (source, targets) in enumerate(meter.batches(self.train_data, self.args)):
            source = self.task.train_transform(source.to(self.device, non_blocking=True))
            targets = targets.to(self.device, non_blocking=True)
            meter.add(self._run_batch(source, targets, step), len(targets))
            self.profiler.step()  # --profile_dir: the profiler's schedule; off: returns at once
        return meter.summary() | self.recipe.epoch_figures()  # lr; fp16: steps skipped

    def _save_checkpoint(self, epoch: int) -> None:
        train_utils.atomic_save(self.model.state_dict(), self.args.checkpoint_path)
        train_utils.print_line(f"epoch {epoch + 1} | checkpoint saved at {self.args.checkpoint_path}")

    def train(self, max_epochs: int) -> None:
        for epoch in range(max_epochs):
            record = self._run_epoch(epoch, max_epochs)
            record["val_loss"], record["val_accuracy"] = evaluate(
                self.model, self.val_data, self.task, self.device)
            train_utils.log_metrics(record, self.args)
            # Save after the last epoch too: the tutorials' `epoch % save_every == 0`
            # saves after the first epoch and can skip the last one.
            if (epoch + 1) % self.args.save_every == 0 or epoch + 1 == max_epochs:
                self._save_checkpoint(epoch)


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: DataLoader, task: common.Task,
             device: torch.device) -> tuple[float, Optional[float]]:
    """Mean loss, and accuracy for a classification task, over every sample of ``data``.

    The loss is weighted by samples (sum of per-sample losses / sample count),
    not a mean of batch means, which would over-weight a short last batch.
    Returns (loss, accuracy or None).
    """
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
    loss_sum, correct, samples = totals.tolist()
    return loss_sum / samples, (correct / samples if task.classification else None)


def load_train_objs(args, download: bool) -> tuple[common.Task, torch.optim.Optimizer]:
    task = common.load_task(args, download)
    optimizer = train_utils.build_optimizer(task.model, args)  # --optimizer, --lr, --weight_decay
    return task, optimizer


def prepare_dataloader(dataset: Dataset, batch_size: int, num_workers: int, train: bool,
                       seed: int) -> DataLoader:
    """Training: reshuffled every epoch from ``seed``, last partial batch dropped
    (a batch of 1 would break BatchNorm). Evaluation: every sample, in order."""
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=train,
        generator=torch.Generator().manual_seed(seed) if train else None,
        drop_last=train,
        **train_utils.loader_workers(num_workers, dataset),  # from a fork server; they ignore stop signals
        pin_memory=torch.cuda.is_available(),
        collate_fn=common.collate,  # whole batches from InMemoryImages pass through
    )


@train_utils.one_line_errors
def main(device: torch.device, args) -> None:
    torch.manual_seed(args.seed)
    task, optimizer = load_train_objs(args, download=True)
    train_data = prepare_dataloader(task.train_set, args.batch_size, args.num_workers, True, args.seed)
    val_data = prepare_dataloader(task.val_set, args.batch_size, args.num_workers, False, args.seed)
    test_data = prepare_dataloader(task.test_set, args.batch_size, args.num_workers, False, args.seed)
    train_utils.check_before_training(args, device, train_data, args.checkpoint_path, saves=True)
    train_utils.print_line(train_utils.describe_run(device, args))
    recipe = train_utils.Recipe(optimizer, args, len(train_data) // args.grad_accum_steps, device)
    trainer = Trainer(task.model, train_data, val_data, recipe, task, device, args)
    train_utils.start_wandb_run(args)  # --wandb_project: rank 0's W&B run (after a resume, the snapshot's)
    trainer.train(args.total_epochs)
    test_loss, test_accuracy = evaluate(trainer.model, test_data, task, device)
    train_utils.log_metrics({"test_loss": test_loss, "test_accuracy": test_accuracy}, args)


if __name__ == "__main__":
    args = train_utils.parse_args(__doc__, common.TASKS, ["checkpoint_path"])
    main(train_utils.device_for(0, one_process=True), args)  # a GPU, another accelerator, or the CPU
