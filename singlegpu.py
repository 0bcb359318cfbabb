"""Training on one device: the first rung of the ladder.

Launch:
    python singlegpu.py                                    # synthetic task, no download
    python singlegpu.py --dataset mnist --total_epochs 5   # real data

Adds: nothing; this is the baseline. One process trains on one device: the
first GPU when there is one, the CPU otherwise. Each later script is this one
plus a single distributed concept; `diff -u singlegpu.py multigpu_spawn.py`
shows the first.
"""

import itertools
import time
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

import common


class Trainer:
    """Runs the epochs, evaluates, logs one summary line per epoch and saves.

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
        save_every: int,
        checkpoint_path: str,
        metrics_path: Optional[str],
        options: common.TrainOptions = common.TrainOptions(),
    ) -> None:
        self.device = device
        self.model = model.to(device)
        self.train_data = train_data
        self.val_data = val_data
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.save_every = save_every
        self.checkpoint_path = checkpoint_path
        self.metrics_path = metrics_path
        self.grad_accum_steps = options.grad_accum_steps
        self.autocast = common.autocast(device, options.amp)  # made once: a step must stay cheap
        self.train_transform, self.eval_transform = options.train_transform, options.eval_transform
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
        # Running sums stay on the device: a .item() per step would make the
        # CPU wait for the GPU at every step.
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)  # loss sum, samples
        # Whole optimizer steps only: a last group of fewer than grad_accum_steps
        # micro-batches is dropped, as drop_last drops a short batch.
        steps = len(self.train_data) - len(self.train_data) % self.grad_accum_steps
        common.reset_peak_memory(self.device)
        start = time.perf_counter()
        # A progress bar only on a terminal (disable=None), not in logs.
        for step, (source, targets) in enumerate(tqdm(
                itertools.islice(self.train_data, steps), total=steps,
                desc=f"epoch {epoch + 1}/{max_epochs}", leave=False, disable=None)):
            source = self.train_transform(source.to(self.device, non_blocking=True))
            targets = targets.to(self.device, non_blocking=True)
            loss = self._run_batch(source, targets, step)
            totals[0] += loss * len(targets)
            totals[1] += len(targets)
        loss_sum, samples = totals.tolist()  # waits for the device, so the time is honest
        seconds = time.perf_counter() - start
        common.check_finite(loss_sum / samples, epoch)
        return {"train_loss": loss_sum / samples, "samples_per_s": samples / seconds,
                "epoch_seconds": seconds, **common.peak_memory_mib(self.device)}

    def _save_checkpoint(self, epoch: int) -> None:
        common.atomic_save(self.model.state_dict(), self.checkpoint_path)
        common.say(f"epoch {epoch + 1} | checkpoint saved at {self.checkpoint_path}")

    def train(self, max_epochs: int) -> None:
        for epoch in range(max_epochs):
            record = {"epoch": epoch + 1, "total_epochs": max_epochs}
            record.update(self._run_epoch(epoch, max_epochs))
            record["val_loss"], record["val_accuracy"] = evaluate(
                self.model, self.val_data, self.loss_fn, self.device, self.eval_transform)
            common.log_metrics(record, self.metrics_path)
            # Save after the last epoch too: the tutorials' `epoch % save_every == 0`
            # saves after the first epoch and can skip the last one.
            if (epoch + 1) % self.save_every == 0 or epoch + 1 == max_epochs:
                self._save_checkpoint(epoch)


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: DataLoader, loss_fn: Callable[..., torch.Tensor],
             device: torch.device, transform: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
             ) -> tuple[float, Optional[float]]:
    """Mean loss and accuracy over every sample of ``data``.

    The loss is weighted by samples (sum of per-sample losses / sample count),
    not a mean of batch means, which would over-weight a short last batch.
    ``transform`` turns a batch's inputs, on the device, into the model's
    input (the task's ``eval_transform``; none: they already are).
    Returns (loss, accuracy); accuracy is None for regression.
    """
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
    loss_sum, correct, samples = totals.tolist()
    return loss_sum / samples, (correct / samples if loss_fn is F.cross_entropy else None)


def load_train_objs(args) -> tuple[common.Task, torch.optim.Optimizer]:
    task = common.load_task(args.dataset, args.model, args.data_dir, args.seed,
                            input_path=args.input_path)
    optimizer = torch.optim.SGD(task.model.parameters(), lr=args.lr, momentum=0.9)
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
        num_workers=num_workers,
        pin_memory=torch.cuda.is_available(),
        collate_fn=common.collate,  # whole batches from InMemoryImages pass through
    )


@common.exit_on_config_error
def main(device: torch.device, args) -> None:
    torch.manual_seed(args.seed)
    args.model = common.resolve_model(args.dataset, args.model)
    common.check_amp(args.amp, device, args.model)
    common.prepare_data(args.dataset, args.data_dir, download=True)
    task, optimizer = load_train_objs(args)
    train_data = prepare_dataloader(task.train_set, args.batch_size, args.num_workers, True, args.seed)
    val_data = prepare_dataloader(task.val_set, args.batch_size, args.num_workers, False, args.seed)
    test_data = prepare_dataloader(task.test_set, args.batch_size, args.num_workers, False, args.seed)
    common.check_steps(train_data, args.grad_accum_steps)
    common.check_writable(args.checkpoint_path, check=True)
    common.say(common.global_batch_line(args.batch_size, args.grad_accum_steps, 1))
    trainer = Trainer(task.model, train_data, val_data, optimizer, task.loss_fn, device,
                      args.save_every, args.checkpoint_path, args.metrics_path,
                      common.train_options(args, task))
    trainer.train(args.total_epochs)
    test_loss, test_accuracy = evaluate(trainer.model, test_data, task.loss_fn, device,
                                        task.eval_transform)
    common.log_metrics({"test_loss": test_loss, "test_accuracy": test_accuracy}, args.metrics_path)


if __name__ == "__main__":
    parser = common.build_parser(__doc__)
    parser.add_argument("--checkpoint_path", default="checkpoint.pt",
                        help="where to save the model's state_dict (default: checkpoint.pt)")
    args = parser.parse_args()
    main(common.get_device(0), args)
