r"""Fully sharded data-parallel training (FSDP2) on several nodes, processes started by torchrun.

Launch:
    torchrun --nnodes=2 --nproc_per_node=gpu --rdzv-backend=c10d \
        --rdzv-endpoint=FIRST_NODE_HOST:29500 --rdzv-id=JOB_ID multinode_fsdp.py   # on each node
    torchrun --standalone --nproc_per_node=2 multinode_fsdp.py                       # one machine's CPU

Adds over multinode.py: fully_shard on a device mesh instead of DDP (each rank holds
1/world_size of the weights, gradients, optimizer state), evaluation that runs as many
forwards on every rank, and sharded snapshots (torch.distributed.checkpoint, DCP).
"""

import argparse
import os
import shutil
import socket
import sys
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  torch workaround: import before any process group (docs/pitfalls.md)
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
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
        self.model = model  # sharded (shard_model): FSDP gathers a block's weights just to run it
        self.rank = dist.get_rank()  # global: unique across all nodes
        self.local_rank = int(os.environ["LOCAL_RANK"])  # on this node: 0, 1, ... on every node
        self.train_data, self.val_data = train_data, val_data
        self.optimizer, self.scheduler = optimizer, scheduler
        self.task, self.device, self.args = task, device, args
        self.epochs_run = 0
        folder = latest_snapshot(args.snapshot_path)
        if folder:  # a restart (torchrun's, or yours): go on from there
            self._load_snapshot(folder)

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
        print(f"[rank {self.rank} | local_rank {self.local_rank} | host {socket.gethostname()}] epoch {epoch + 1} "
              f"| batch_size {self.train_data.batch_size} | steps {len(self.train_data)}", flush=True)
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

    def _load_snapshot(self, path: str) -> None:
        snapshot = torch.load(os.path.join(path, "meta.pt"))
        # DCP fills this rank's own shards in place, reading their pieces from whichever files hold them.
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        dcp.load(model_state, checkpoint_id=os.path.join(path, "model"))
        dcp.load(optimizer_state, checkpoint_id=os.path.join(path, "optimizer"))
        set_state_dict(self.model, self.optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)
        self.scheduler.load_state_dict(snapshot["lr_schedule"])
        self.epochs_run = snapshot["epochs_run"]
        if self.rank == 0:
            print(f"resuming from snapshot {path} after epoch {self.epochs_run}", flush=True)

    def _save_snapshot(self, epoch: int) -> None:
        # Collective: each rank writes its shards into a new folder (DCP overwrites files in place).
        folder = os.path.join(self.args.snapshot_path, f"epoch-{epoch + 1}")
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)  # this rank's shards
        dcp.save(model_state, checkpoint_id=os.path.join(folder, "model"))
        dcp.save(optimizer_state, checkpoint_id=os.path.join(folder, "optimizer"))  # returns once all wrote
        if self.rank != 0:  # global rank 0 alone completes the save, on storage every node shares
            return
        snapshot = {"lr_schedule": self.scheduler.state_dict(), "epochs_run": epoch + 1}
        # meta.pt, last, completes the folder: one without it is a torn save. Written whole or not at all.
        torch.save(snapshot, os.path.join(folder, "meta.pt.tmp"))
        os.replace(os.path.join(folder, "meta.pt.tmp"), os.path.join(folder, "meta.pt"))
        for name in os.listdir(self.args.snapshot_path):  # the older snapshots, and torn ones, go
            if name != os.path.basename(folder):
                shutil.rmtree(os.path.join(self.args.snapshot_path, name), ignore_errors=True)
        print(f"epoch {epoch + 1} | snapshot saved at {folder}", flush=True)

    def train(self, max_epochs: int) -> None:
        for epoch in range(self.epochs_run, max_epochs):
            train_loss, samples, seconds = self._run_epoch(epoch)
            val_loss, val_acc = evaluate(self.model, self.val_data, self.task, self.device)
            accuracy = f" | val_acc {val_acc:.4f}" if val_acc is not None else ""
            line = (f"epoch {epoch + 1}/{max_epochs} | train_loss {train_loss:.6f} | val_loss {val_loss:.6f}"
                    f"{accuracy} | samples/s {samples / seconds:.1f} | epoch_s {seconds:.2f} | lr {self.lr:.6g}")
            if self.rank == 0:  # every rank holds the same numbers; one prints them
                print(line, flush=True)
            # Save after the last epoch too: the tutorials' `epoch % save_every == 0`
            # saves after the first epoch and can skip the last one.
            if (epoch + 1) % self.args.save_every == 0 or epoch + 1 == max_epochs:
                self._save_snapshot(epoch)


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: DataLoader, task: common.Task,
             device: torch.device) -> tuple[float, Optional[float]]:
    """(mean loss, accuracy or None) over every sample of ``data``: the sum of
    per-sample losses / samples, not a mean of batch means, which would
    over-weight a short last batch. Accuracy for a classification task only.
    Collective: each rank scores its shard, the sums are all-reduced. FSDP's forward all-gathers
    weights: every rank runs as many as the longest shard has batches (the last again, uncounted).
    """
    for buffer in model.buffers():  # BatchNorm statistics differ across ranks: use rank 0's, as saved
        dist.broadcast(buffer, src=0)
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, samples
    most = torch.tensor(len(data), device=device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)  # shards differ by one sample at most: by one batch
    batches = iter(data)
    for step in range(most.item()):
        if step < len(data):  # else this rank's shard is done: it keeps its last batch
            batch = next(batches)
        source, targets = batch
        source = task.eval_transform(source.to(device))
        targets = targets.to(device)
        output = model(source)
        if step >= len(data):  # the forward only joined the others' all-gathers
            continue
        totals[0] += task.loss_fn(output, targets, reduction="sum")
        if task.classification:
            totals[1] += (output.argmax(dim=1) == targets).sum()
        totals[2] += len(targets)
    model.train()
    model.reshard()  # the root stays gathered after a forward without a backward: free it
    dist.all_reduce(totals)
    loss_sum, correct, samples = totals.tolist()
    return loss_sum / samples, (correct / samples if task.classification else None)


def latest_snapshot(root: str) -> Optional[str]:
    """The newest complete snapshot folder under ``root`` (one holding meta.pt), else None."""
    names = os.listdir(root) if os.path.isdir(root) else []
    done = [name for name in names if os.path.exists(os.path.join(root, name, "meta.pt"))]
    if not done:
        return None
    return os.path.join(root, max(done, key=lambda name: int(name.split("-")[1])))  # epoch-N, the highest N


def shard_model(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """Shard ``model`` (on ``device``) in place with FSDP2; return it. Each unit of
    common.fsdp_units (ResNet's residual blocks; a GPT's blocks alone) is all-gathered
    just before its forward and backward; the root takes the parameters left (a GPT's
    embeddings, its tied output)."""
    for param in model.parameters():  # fully_shard refuses channels-last weights (ResNets on CUDA)
        param.data = param.data.contiguous()
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))  # one dimension: every rank
    for unit in common.fsdp_units(model):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


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


def main(args: argparse.Namespace) -> None:
    # Every rank prints to one output: each line in one write, or two ranks' lines can run together.
    sys.stdout.reconfigure(write_through=False, line_buffering=True)
    local_rank = int(os.environ["LOCAL_RANK"])  # set by torchrun, with RANK, WORLD_SIZE, MASTER_ADDR/PORT
    device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before init, so NCCL uses this GPU and no other
    # NCCL joins with this process's GPU (device_id): its barriers then know which GPU to use.
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            device_id=device if device.type == "cuda" else None)
    if dist.get_backend() == "gloo" and torch.__version__ < "2.10":  # torch < 2.10: gloo sums, FSDP averages
        raise common.ConfigError("FSDP on the CPU (gloo) needs torch 2.10 or newer (docs/install.md)")
    rank = dist.get_rank()
    torch.manual_seed(args.seed)  # the initial weights come from the seed
    if local_rank == 0:  # one download per node (--data_dir is on each node's disk) while the others wait
        task = common.load_task(args, download=True)
    dist.barrier()
    if local_rank != 0:
        task = common.load_task(args, download=False)
    recipes.set_recipe_flags(args, task.recipe)  # what no flag sets: the task's recipe (optimizer, lr, ...)
    model = shard_model(task.model.to(device), device)  # before the optimizer: it replaces the parameters
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
    dist.destroy_process_group()
    os._exit(0)  # torch 2.15 workaround: gloo can abort the teardown once DTensors exist (docs/fsdp.md)


def run(args: argparse.Namespace) -> None:
    """``main``; a ConfigError (a bad --dataset or --model, missing data) as one line, exit status 2."""
    try:
        main(args)
    except common.ConfigError as exc:
        if os.environ.get("RANK", "0") == "0":  # every rank may raise the same: one line
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
    add("--snapshot_path", default="snapshot_multinode_fsdp",
        help="snapshot to resume from when it exists, and to save to (default: %(default)s)")
    return parser.parse_args()


if __name__ == "__main__":
    args = parse_args()
    if "LOCAL_RANK" not in os.environ:  # set by torchrun
        sys.exit(f"error: start {sys.argv[0]} with torchrun, as the launch lines at its top show")
    run(args)
