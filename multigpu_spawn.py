"""Data-parallel training on one machine, processes started by mp.spawn.

Launch:
    python multigpu_spawn.py                      # one process per GPU (2 on a CPU-only machine)
    python multigpu_spawn.py --world_size 4       # choose the number of processes
    MASTER_PORT=29501 python multigpu_spawn.py    # when port 12355 is taken

Adds over singlegpu.py: the process group (rank, world_size, backend nccl on
GPUs / gloo on CPU, rendezvous at MASTER_ADDR:MASTER_PORT), DistributedDataParallel
(gradients averaged across ranks in backward; with --grad_accum_steps, no_sync()
skips that for all but the last micro-batch of an optimizer step),
DistributedSampler (each rank trains on its own 1/world_size of the data; the
global batch size is batch_size x grad_accum_steps x world_size), metrics
reduced across ranks, exact sharded evaluation, and rank-0-only printing and
saving.
"""

import contextlib
import itertools
import os
import socket
import sys
import time
from datetime import timedelta
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm

import common


def ddp_setup(rank: int, world_size: int, timeout_s: float) -> torch.device:
    """Join the process group as ``rank`` of ``world_size``; return this rank's device.

    Rank 0 listens at MASTER_ADDR:MASTER_PORT (set by the parent, see the
    bottom of this file) and every rank connects there to find the others.
    A collective that waits longer than ``timeout_s`` seconds raises, so a
    rank stuck or gone makes the job fail instead of hang.
    """
    device = common.get_device(rank)  # one node: rank i drives GPU i
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before init, so NCCL uses this GPU and no other
        backend = "nccl"
    else:
        backend = "gloo"
        if "OMP_NUM_THREADS" not in os.environ:  # share the cores instead of oversubscribing them
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    init_process_group(backend=backend, rank=rank, world_size=world_size,
                       timeout=timedelta(seconds=timeout_s))
    return device


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
        rank: int,
        save_every: int,
        checkpoint_path: str,
        metrics_path: Optional[str],
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
        self.checkpoint_path = checkpoint_path
        self.metrics_path = metrics_path
        self.grad_accum_steps = options.grad_accum_steps
        self.autocast = common.autocast(device, options.amp)  # made once: a step must stay cheap
        self.train_transform, self.eval_transform = options.train_transform, options.eval_transform
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
                desc=f"epoch {epoch + 1}/{max_epochs}", leave=False,
                disable=True if self.rank != 0 else None)):
            source = self.train_transform(source.to(self.device, non_blocking=True))
            targets = targets.to(self.device, non_blocking=True)
            loss = self._run_batch(source, targets, step)
            totals[0] += loss * len(targets)
            totals[1] += len(targets)
        dist.all_reduce(totals)  # sum over ranks: the global mean loss and sample count
        loss_sum, samples = totals.tolist()  # waits for the device, so the time is honest
        seconds = time.perf_counter() - start
        common.check_finite(loss_sum / samples, epoch)
        return {"train_loss": loss_sum / samples, "samples_per_s": samples / seconds,
                "epoch_seconds": seconds, **common.peak_memory_mib(self.device)}

    def _save_checkpoint(self, epoch: int) -> None:
        # .module: the plain model's state_dict, loadable without DDP.
        common.atomic_save(self.model.module.state_dict(), self.checkpoint_path)
        common.say(f"epoch {epoch + 1} | checkpoint saved at {self.checkpoint_path}")

    def train(self, max_epochs: int) -> None:
        for epoch in range(max_epochs):
            record = {"epoch": epoch + 1, "total_epochs": max_epochs}
            record.update(self._run_epoch(epoch, max_epochs))
            record["val_loss"], record["val_accuracy"] = evaluate(
                self.model.module, self.val_data, self.loss_fn, self.device, self.eval_transform)
            if self.rank == 0:  # every rank holds the same numbers; one prints them
                common.log_metrics(record, self.metrics_path)
            # Save after the last epoch too: the tutorials' `epoch % save_every == 0`
            # saves after the first epoch and can skip the last one.
            if self.rank == 0 and ((epoch + 1) % self.save_every == 0 or epoch + 1 == max_epochs):
                self._save_checkpoint(epoch)


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
        sampler=DistributedSampler(dataset, world_size, rank, shuffle=True, seed=seed) if train else None,
        drop_last=train,
        num_workers=num_workers,
        pin_memory=torch.cuda.is_available(),
        collate_fn=common.collate,  # whole batches from InMemoryImages pass through
    )


@common.exit_on_config_error
def main(rank: int, world_size: int, args) -> None:
    device = ddp_setup(rank, world_size, args.pg_timeout_s)
    # Each rank its own random stream (dropout, augmentation): the same seed
    # everywhere would give every rank the same dropout masks. Initial weights
    # still match, because DDP copies rank 0's to all.
    torch.manual_seed(args.seed + rank)
    args.model = common.resolve_model(args.dataset, args.model)
    common.check_amp(args.amp, device, args.model)
    # Rank 0 downloads while the others wait, so no two write the same files.
    common.prepare_data(args.dataset, args.data_dir, download=rank == 0)
    task, optimizer = load_train_objs(args)
    train_data = prepare_dataloader(task.train_set, args.batch_size, args.num_workers, True, args.seed)
    val_data = prepare_dataloader(task.val_set, args.batch_size, args.num_workers, False, args.seed)
    test_data = prepare_dataloader(task.test_set, args.batch_size, args.num_workers, False, args.seed)
    common.check_steps(train_data, args.grad_accum_steps)
    common.check_writable(args.checkpoint_path, check=rank == 0)  # rank 0 saves
    if rank == 0:
        common.say(common.global_batch_line(args.batch_size, args.grad_accum_steps, world_size))
    trainer = Trainer(task.model, train_data, val_data, optimizer, task.loss_fn, device, rank,
                      args.save_every, args.checkpoint_path, args.metrics_path,
                      common.train_options(args, task))
    trainer.train(args.total_epochs)
    test_loss, test_accuracy = evaluate(trainer.model.module, test_data, task.loss_fn, device,
                                        task.eval_transform)
    if rank == 0:
        common.log_metrics({"test_loss": test_loss, "test_accuracy": test_accuracy}, args.metrics_path)
    destroy_process_group()


def port_is_free(port: int) -> bool:
    """True when nothing on this machine listens on TCP ``port`` (any address)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the store does
        try:
            probe.bind(("", port))
        except OSError:
            return False
    return True


if __name__ == "__main__":
    parser = common.build_parser(__doc__)
    parser.add_argument("--checkpoint_path", default="checkpoint.pt",
                        help="where to save the model's state_dict (default: checkpoint.pt)")
    parser.add_argument("--world_size", type=common.positive(int), default=None,
                        help="processes to start (default: the number of GPUs, "
                             "or 2 on a machine without GPUs)")
    parser.add_argument("--pg_timeout_s", type=common.positive(float), default=1800,
                        help="seconds a collective may wait for the other ranks before "
                             "the job fails (default: 1800)")
    args = parser.parse_args()
    gpus = torch.cuda.device_count()
    world_size = args.world_size or gpus or 2
    cores = os.cpu_count() or 1
    if gpus and world_size > gpus:  # one process per GPU
        parser.error(f"--world_size {world_size} is more than the {gpus} GPUs of this machine")
    if not gpus and world_size > cores:  # on CPU, one process per core at most
        parser.error(f"--world_size {world_size} is more than the {cores} CPU cores of this machine")
    # A fixed address and port on one machine; the environment may override both.
    os.environ.setdefault("MASTER_ADDR", "localhost")
    os.environ.setdefault("MASTER_PORT", "12355")
    port = int(os.environ["MASTER_PORT"])
    if not port_is_free(port):
        sys.exit(f"error: MASTER_PORT {port} is already in use on this machine (another job?); "
                 f"set the MASTER_PORT environment variable to a free port, "
                 f"e.g. MASTER_PORT={port + 1} python multigpu_spawn.py")
    try:
        mp.spawn(main, args=(world_size, args), nprocs=world_size)
    except mp.ProcessExitedException as exc:  # a rank exited non-zero; it said why
        sys.exit(exc.exit_code or 1)
