"""Fully sharded data parallel (FSDP2) on several machines: each rank holds 1/world_size of the model.

Launch, on every node (N nodes, G processes each; --nproc_per_node=2 on CPUs):
    torchrun --nnodes=N --nproc_per_node=gpu --rdzv-backend=c10d \
        --rdzv-endpoint=FIRST_NODE_HOST:29500 --rdzv-id=JOB_ID multinode_fsdp.py

Adds over multinode.py: DDP keeps full parameters, gradients and optimizer state on
every rank; FSDP (`fully_shard`) keeps 1/world_size of each, all-gathers a block's
parameters just before it runs and reduce-scatters its gradients after. Snapshots
become folders of per-rank shards (torch.distributed.checkpoint) that any world size
can resume; see docs/fsdp.md. Your own data and
model go in common.py; train_utils.py holds machinery you keep as it is.
"""

import os
import socket
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
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
    train_utils.share_cpu_cores(device, world_size)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timeout)
    return rank, local_rank, device


class Trainer:
    """Runs the epochs, evaluates, prints one summary line per epoch, saves
    snapshots and resumes from the newest complete one under --snapshot_path.

    ``model`` comes sharded (``shard_model``) and ``optimizer`` built on its shards;
    ``task`` gives the loss and the batch transforms (see common.Task);
    ``args`` the run's flags (--save_every, --grad_accum_steps, --amp,
    --compile, --metrics_path, --tensorboard_dir, the save path).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        train_data: DataLoader,
        val_data: DataLoader,
        optimizer: torch.optim.Optimizer,
        task: common.Task,
        device: torch.device,
        rank: int,
        local_rank: int,
        args,
    ) -> None:
        self.device = device
        self.rank = rank
        self.local_rank = local_rank
        self.model = model  # sharded, on the device (load_train_objs)
        self.train_data = train_data
        self.val_data = val_data
        self.optimizer = optimizer
        self.task = task
        self.args = args
        # Saved in snapshots; world_size None: any world size resumes them (DCP reshards).
        self.config = dict(vars(args), world_size=None)
        self.epochs_run = 0  # epochs finished
        self.steps_run = 0  # steps finished in epoch `epochs_run` (> 0 after a mid-epoch snapshot)
        self.epoch_totals = None  # that epoch's global (loss sum, samples) up to `steps_run`
        self.stop = train_utils.StopSignal()  # SIGUSR1, SIGTERM, Ctrl-C: all ranks stop after the same step
        self.memory_reported = False  # the state-per-rank line, once, after the first optimizer step
        folder = train_utils.latest_sharded_snapshot(args.snapshot_path)  # a folder per save
        if folder and train_utils.snapshot_on_every_node(
                os.path.join(folder, train_utils.SHARDED_SNAPSHOT_META)):  # or on none
            self._load_snapshot(folder)
        # The compiled module shares the model's weights and runs the training
        # forward; saving and evaluation use the plain model, so what is saved
        # loads without torch.compile.
        self.compiled = train_utils.compile_model(self.model, args.compile)

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor, step: int) -> torch.Tensor:
        """Forward and backward of one micro-batch (``step`` counts them from 0 in
        the epoch); the optimizer steps after every --grad_accum_steps-th."""
        accum = self.args.grad_accum_steps
        last = (step + 1) % accum == 0  # this micro-batch ends an optimizer step
        if step % accum == 0:
            self.optimizer.zero_grad(set_to_none=True)
        # FSDP reduce-scatters gradients in backward; with sync off it sums each block's
        # full-size gradients locally, so accumulating costs one reduce-scatter per
        # optimizer step, not per micro-batch (and full-size gradients in memory until then).
        if accum > 1:
            self.model.set_requires_gradient_sync(last)
        loss = self.task.loss_fn(self.compiled(source), targets)  # --amp: shard_model's policy
        # Summed over the micro-batches, the gradients of loss / accum are those
        # of the mean loss over the whole accumulated batch. (No division without
        # accumulation: an extra autograd op costs a small model ~10%.)
        (loss / accum if accum > 1 else loss).backward()
        if last:
            self.optimizer.step()
        return loss.detach()

    def _run_epoch(self, epoch: int, max_epochs: int) -> Optional[dict]:
        self.model.train()
        # A new shuffle each epoch; without this every epoch repeats epoch 0's order.
        self.train_data.sampler.set_epoch(epoch)
        # After a mid-epoch resume, skip the batches this rank already trained on.
        self.train_data.sampler.start = self.steps_run * self.train_data.batch_size
        host = socket.gethostname()  # every rank reports, so the split across nodes and GPUs shows
        train_utils.say(f"[rank {self.rank} | local_rank {self.local_rank} | host {host}] epoch {epoch + 1} "
                        f"| batch_size {self.train_data.batch_size} | steps {len(self.train_data)}")
        meter = train_utils.EpochMeter(epoch, max_epochs, self.device, self.epoch_totals)
        for step, (source, targets) in enumerate(meter.batches(self.train_data, self.args, self.rank),
                                                 start=self.steps_run):
            source = self.task.train_transform(source.to(self.device, non_blocking=True))
            targets = targets.to(self.device, non_blocking=True)
            meter.add(self._run_batch(source, targets, step), len(targets))
            self.steps_run = step + 1
            if self.steps_run % self.args.grad_accum_steps:
                continue  # no stop, no snapshot mid-accumulation: its gradients would be lost
            if not self.memory_reported:  # optimizers make their state at the first step: measure now
                train_utils.say_sharded_memory(self.model, self.optimizer, self.device)
                self.memory_reported = True
            if self.stop.poll():  # some rank got the signal; every rank stops after this step
                self._save_snapshot(meter)
                return None
            every = self.args.snapshot_every_steps  # and not at the epoch's end: that one comes next
            if every and self.steps_run % every == 0 and meter.steps_left:
                self._save_snapshot(meter)
        dist.all_reduce(meter.totals)  # sum over ranks: the global mean loss and sample count
        return meter.summary()

    def _load_snapshot(self, folder: str) -> None:
        # Refuses another run's, and a mid-epoch one of another world size.
        snapshot = train_utils.read_sharded_snapshot(folder, self.config, dist.get_world_size())
        # DCP loads into this model's and optimizer's own sharded state dicts, in place:
        # each rank reads its shards' pieces from whichever files hold them (resharding).
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        dcp.load(model_state, checkpoint_id=os.path.join(folder, "model"))
        dcp.load(optimizer_state, checkpoint_id=os.path.join(folder, "optimizer"))
        set_state_dict(self.model, self.optimizer, model_state_dict=model_state,
                       optim_state_dict=optimizer_state)
        for group in self.optimizer.param_groups:  # a new --lr takes over from the snapshot's
            group["lr"] = self.args.lr
        self.epochs_run, self.steps_run = snapshot["epochs_run"], snapshot["steps_run"]
        self.epoch_totals = snapshot["epoch_totals"]
        # This rank's random streams go on where they were: same dropout, shuffles, augmentations.
        if self.rank < snapshot["world_size"]:  # a rank the saving run did not have: fresh seed
            train_utils.set_rng_state(snapshot["rng_states"][self.rank], self.device,
                                      self.train_data.generator)
        if self.rank == 0:
            train_utils.say(f"resuming from snapshot {folder} "
                            f"{train_utils.position(self.epochs_run, self.steps_run)}"
                            f"{train_utils.resharding_note(snapshot['world_size'])}")

    def _save_snapshot(self, meter: Optional[train_utils.EpochMeter] = None) -> None:
        """Collective: a new folder of every rank's shards; then the previous snapshot
        goes. Mid-epoch, ``meter`` holds the epoch so far (its totals are saved too)."""
        epoch_totals = meter.global_totals() if meter else None
        # Every rank's RNG states travel to rank 0, so that a resumed run draws
        # the same dropout masks and augmentations on every rank.
        rng_states = train_utils.gather_rng_states(self.device, self.train_data.generator)
        # FSDP leaves buffers alone (DDP broadcast rank 0's in every forward): each rank's
        # BatchNorm statistics drift apart. Save rank 0's, as multinode.py does.
        for buffer in self.model.buffers():
            dist.broadcast(buffer, src=0)
        # Each rank writes its own shards, DCP's rank 0 the index (.metadata); no rank ever
        # holds the full state. A new folder each time: DCP overwrites files in place.
        folder = train_utils.sharded_snapshot_folder(self.args.snapshot_path, self.epochs_run,
                                                     self.steps_run)
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        dcp.save(model_state, checkpoint_id=os.path.join(folder, "model"))  # plain state_dict keys
        dcp.save(optimizer_state, checkpoint_id=os.path.join(folder, "optimizer"))
        if self.rank != 0:
            return
        snapshot = {
            "epochs_run": self.epochs_run,
            "steps_run": self.steps_run,
            "epoch_totals": epoch_totals,
            "rng_states": rng_states,
            "config": self.config,
            "world_size": dist.get_world_size(),
        }
        # The folder's last file, temp file + rename: once it is there, the snapshot is complete.
        train_utils.atomic_save(snapshot, os.path.join(folder, train_utils.SHARDED_SNAPSHOT_META))
        train_utils.remove_other_sharded_snapshots(self.args.snapshot_path, keep=folder)
        train_utils.say(f"{train_utils.position(self.epochs_run, self.steps_run, short=True)} | "
                        f"snapshot saved at {folder}")

    def train(self, max_epochs: int) -> bool:
        for epoch in range(self.epochs_run, max_epochs):
            record = self._run_epoch(epoch, max_epochs)
            if record is None:  # stopped by the signal, after a snapshot of this step
                return False
            record["val_loss"], record["val_accuracy"] = evaluate(
                self.model, self.val_data, self.task, self.device)
            if self.rank == 0:  # every rank holds the same numbers; one prints them
                train_utils.log_metrics(record, self.args)
            self.epochs_run, self.steps_run, self.epoch_totals = epoch + 1, 0, None
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
    Collective: each rank scores its shard, the sums are all-reduced. Pass the FSDP
    model: its forward all-gathers each block's parameters, a collective too, so every
    rank runs as many forwards as the longest shard has batches (shards differ by one
    sample at most); a rank past its last batch runs that batch again, counted nowhere.
    Returns (loss, accuracy or None).
    """
    # Each rank holds its own BatchNorm statistics: score with rank 0's, which it saves.
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, samples
    batches = iter(data)
    for _ in range(train_utils.most_batches(data, device)):  # of any rank
        batch = next(batches, None)
        if batch is None:  # this shard is done: the same collective forward, output unused
            model(source)
            continue
        source, targets = batch
        source = task.eval_transform(source.to(device, non_blocking=True))
        targets = targets.to(device, non_blocking=True)
        output = model(source)
        totals[0] += task.loss_fn(output, targets, reduction="sum")
        if task.classification:
            totals[1] += (output.argmax(dim=1) == targets).sum()
        totals[2] += len(targets)
    model.train()
    model.reshard()  # the root stays gathered after a forward without backward: free it
    dist.all_reduce(totals)
    loss_sum, correct, samples = totals.tolist()
    return loss_sum / samples, (correct / samples if task.classification else None)


def shard_model(model: torch.nn.Module, device: torch.device, bf16: bool) -> torch.nn.Module:
    """Shard ``model`` (already on ``device``) in place with FSDP2; return it.

    Each of ``train_utils.fsdp_blocks`` becomes one FSDP unit, then the root takes
    the parameters left. A rank keeps 1/world_size of every parameter; a unit's are
    all-gathered just before its forward (and its backward) and freed after.
    ``bf16`` (--amp): parameters gathered and used in bf16, gradients reduced and
    weights kept in fp32, the output fp32; BatchNorm layers stay fp32, each a unit of
    its own (bf16 BatchNorm fails on a CPU), passing bf16 on to the next layer.
    """
    # Named explicitly: without a mesh, fully_shard takes the accelerator's device type
    # (torch 2.15), which a CPU process group on a machine with a GPU cannot serve.
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    dtype = torch.bfloat16 if bf16 else None
    if bf16:
        norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
        for norm in norms:
            fully_shard(norm, mesh=mesh, mp_policy=MixedPrecisionPolicy(torch.float32, output_dtype=dtype))
    for block in train_utils.fsdp_blocks(model):
        if not isinstance(block, FSDPModule):  # not a BatchNorm sharded above
            fully_shard(block, mesh=mesh, mp_policy=MixedPrecisionPolicy(dtype, torch.float32))
    fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(dtype, torch.float32, torch.float32))
    return model


def load_train_objs(args, download: bool,
                    device: torch.device) -> tuple[common.Task, torch.optim.Optimizer]:
    task = train_utils.downloaders_first(common.load_task, args, download)
    # Before the optimizer: fully_shard replaces the parameters with sharded ones.
    task.model = shard_model(task.model.to(device), device, args.amp)
    optimizer = common.build_optimizer(task.model, args.lr)
    return task, optimizer


def prepare_dataloader(dataset: Dataset, batch_size: int, num_workers: int, train: bool,
                       seed: int) -> DataLoader:
    """Training: each rank its 1/world_size of a permutation drawn from (seed, epoch)
    (DistributedSampler), last partial batch dropped (a batch of 1 would break BatchNorm).
    Evaluation: rank r takes samples r, r+W, r+2W, ... unpadded, each sample once."""
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
        worker_init_fn=train_utils.ignore_stop_signal,  # the rank itself handles stop signals
        drop_last=train,
        num_workers=num_workers,
        pin_memory=torch.cuda.is_available(),
        collate_fn=common.collate,  # whole batches from InMemoryImages pass through
    )


@train_utils.exit_on_config_error
def main(args) -> None:
    rank, local_rank, device = ddp_setup(args.startup_timeout_s)
    train_utils.check_fsdp_backend()  # refused on gloo before torch 2.10
    # One seed for the initial weights on every rank: each keeps its slice of its own
    # copy (DDP copied rank 0's to all instead).
    torch.manual_seed(args.seed)
    # One process per node downloads (--data_dir is usually node-local; pre-stage a shared one).
    task, optimizer = load_train_objs(args, download=local_rank == 0, device=device)
    # Then each rank its own random stream, or all would draw the same dropout masks.
    torch.manual_seed(args.seed + rank)
    train_data = prepare_dataloader(task.train_set, args.batch_size, args.num_workers, True, args.seed)
    val_data = prepare_dataloader(task.val_set, args.batch_size, args.num_workers, False, args.seed)
    test_data = prepare_dataloader(task.test_set, args.batch_size, args.num_workers, False, args.seed)
    train_utils.check_run(args, device, train_data,  # every rank writes its shards there
                          os.path.join(args.snapshot_path, train_utils.SHARDED_SNAPSHOT_META), saves=True)
    if rank == 0:
        train_utils.say(train_utils.run_line(device, args))
    trainer = Trainer(task.model, train_data, val_data, optimizer, task, device, rank, local_rank, args)
    if trainer.train(args.total_epochs):  # False: stopped by the signal, snapshot saved
        test_loss, test_accuracy = evaluate(trainer.model, test_data, task, device)
        if rank == 0:
            train_utils.log_metrics({"test_loss": test_loss, "test_accuracy": test_accuracy}, args)
    trainer.stop.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    args = train_utils.parse_args(__doc__, common.TASKS, ["snapshot_path", "snapshot_every_steps",
                                                          "pg_timeout_s"])
    main(args)
    train_utils.exit_skipping_teardown()  # FSDP: the process group outlives destroy (torch 2.15)
