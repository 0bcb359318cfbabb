r"""The training kit: one entry point for real runs, DDP or FSDP, under torchrun or srun.

Launch:
    torchrun --standalone --nproc_per_node=gpu train.py --dataset mnist     # one node
    torchrun --nnodes=N --nproc_per_node=gpu --rdzv-backend=c10d \
        --rdzv-endpoint=FIRST_NODE_HOST:29500 --rdzv-id=JOB_ID train.py     # N nodes
    srun --ntasks-per-node=GPUS python train.py                             # one task per GPU
    sbatch slurm/multi_gpu.sh --dataset mnist                               # on Slurm
    python train.py --plan 8x8 --strategy hsdp --dataset tokens ...         # check 8 nodes x 8 first

It trains what the ladder's rungs train (multigpu_spawn.py ... multinode_fsdp.py),
with the same arithmetic, and adds what a real run needs: exact resume after every
stop (mid-epoch too), stop signals (SIGUSR1, SIGTERM, Ctrl-C), the recipe flags,
W&B, TensorBoard, the profiler, time-out diagnosis, snapshot integrity checks.
--strategy fsdp shards the model (FSDP2) and saves sharded snapshots; see docs/.
Whether a run resumes exactly: tools/check_resume.py, with the same flags.

Copy this file, the train_utils package and tools/ for your own work; your task
goes in its own file (docs/custom-task.md).
"""

import argparse
import contextlib
import dataclasses
import gc
import os
import signal
import socket
import sys
from datetime import timedelta
from typing import Callable, Optional, Protocol

if __name__ == "__main__":
    # Ctrl-C in the seconds torch takes to import ends this process quietly (nothing is
    # trained yet), not in a KeyboardInterrupt traceback per rank; main() then takes over.
    signal.signal(signal.SIGINT, signal.SIG_DFL)

import torch  # noqa: E402
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset

import common
import train_utils

# --snapshot_path's default by --strategy: a file for DDP, a folder of sharded saves (one sub-folder per
# save) for FSDP and HSDP.
SNAPSHOT_PATHS = {"ddp": "snapshot_train.pt", "fsdp": "snapshot_train_fsdp", "hsdp": "snapshot_train_fsdp"}


def setup(timeout_s: float, snapshot_path: str) -> tuple[int, int, torch.device]:
    """Join the process group the launcher prepared (torchrun's RANK, LOCAL_RANK,
    WORLD_SIZE, MASTER_ADDR/PORT, or srun's SLURM_PROCID, SLURM_LOCALID, ...);
    return (rank, local_rank, device). A collective waiting over ``timeout_s``
    seconds raises, not hangs; a time-out's report writes every live rank's
    stack beside ``snapshot_path`` (--snapshot_path). Raises ConfigError when
    started by neither launcher, or when this local rank has no GPU of its
    own on a GPU node."""
    timeout = timedelta(seconds=timeout_s)
    store = train_utils.launcher_store(timeout)  # torchrun or srun; no key of an earlier attempt read
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    device = train_utils.device_for(local_rank)  # GPU indices restart at 0 on every node
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before init, so NCCL uses this GPU and no other
    # Each rank keeps its last collectives; on NCCL a stuck one dumps them beside the snapshot.
    train_utils.enable_flight_recorder(train_utils.stack_folder(snapshot_path), nccl=device.type == "cuda")
    train_utils.share_cpu_cores(device, world_size)
    train_utils.raise_open_file_limit()  # gloo groups hold a socket to every other rank: 5 x world_size files
    backend = train_utils.backend_for(device)  # nccl on CUDA, gloo on the CPU
    # device_id on CUDA: the group is bound to this rank's GPU (NCCL connects at once, and no collective
    # has to guess the device); gloo on the CPU takes none.
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout,
                            device_id=device if device.type == "cuda" else None)
    train_utils.watch_collectives(timeout_s)  # a side group that names the stuck ranks on a time-out
    train_utils.answer_stack_requests(train_utils.stack_folder(snapshot_path))  # where each rank is, then
    return rank, local_rank, device


class StepHook(Protocol):
    """A watcher of the training steps, the Trainer's one seam for a tool
    that checks a run (tools/check_resume.py): ``before(step)`` right before
    the first micro-batch of optimizer step ``step`` (the run's, 1-based),
    ``after(step, loss)`` right after each of its micro-batches, ``loss``
    the micro-batch's mean loss (0-dim, on the device)."""

    def before(self, step: int) -> None: ...

    def after(self, step: int, loss: torch.Tensor) -> None: ...


class Trainer:
    """Runs the epochs: trains, evaluates and prints a summary line per
    evaluation (after every epoch, or every --eval_every_steps optimizer
    steps: ``train_utils.Evaluations``), and has its ``checkpointer`` save
    snapshots (every --save_every epochs, after the last, inside an epoch
    when one is due, and at a stop signal) and load the one to resume from.

    ``task`` gives the model (on ``device``; under FSDP already sharded:
    ``shard_model``), the loss and the batch transforms (``common.Task``);
    ``optimizer`` is built on the model's parameters or shards; ``log``
    (``train_utils.RunLog``) prints and records the figures, and its W&B run
    id goes into every snapshot; ``local_rank`` this process's index on its
    node; ``config`` the run's (``train_utils.RunConfig``). The Trainer makes
    the run's stateful parts (the position ``progress``, the ``recipe``, the
    ``evaluations``) and the ``checkpointer`` given them. The run's one step
    counter is ``progress.step``, its optimizer steps. Collective: every
    rank makes one (the stop signal's gloo group, DDP's first broadcast)
    and calls ``train``; ``train_step`` and ``run_epoch`` are its parts,
    public for those who drive them. ``hook``: a ``StepHook`` the loop
    calls around every training micro-batch (None: none). ``hosts``: every
    rank's host name, indexed by rank (``gather_placement``'s), for the
    straggler watch's link probe on several hosts (None: no probe).
    """

    def __init__(self, task: common.Task, optimizer: torch.optim.Optimizer, train_data: DataLoader,
                 val_data: DataLoader, log: train_utils.RunLog, device: torch.device, local_rank: int,
                 config: train_utils.RunConfig, hook: Optional[StepHook] = None,
                 hosts: Optional[list] = None) -> None:
        self.task, self.model, self.optimizer, self.config = task, task.model, optimizer, config
        self.hook = hook
        self.device, self.rank, self.local_rank = device, dist.get_rank(), local_rank
        self.fsdp = config.sharded  # FSDP2 shards the model: fsdp, and hsdp on a 2-D mesh
        self.train_data, self.val_data, self.log = train_data, val_data, log
        self.progress = train_utils.Progress(device, train_data, self.rank, config.grad_accum_steps)
        self.recipe = train_utils.Recipe(optimizer, config, self.progress.steps_per_epoch,
                                         lambda: self.progress.step, device)
        self.evaluations = train_utils.Evaluations(
            config.eval_every_steps, config.max_steps_now or config.total_epochs * self.progress.steps_per_epoch,
            config.total_epochs, device)
        parts = {"progress": self.progress, "recipe": self.recipe, "evaluations": self.evaluations,
                 "trackers": log.wandb}  # what a snapshot holds besides the weights, loaded in this order
        self.checkpointer = train_utils.Checkpointer(
            config.snapshot_path, self.fsdp, task.model, optimizer, config.as_dict(), parts,
            asynchronous=not config.snapshot_sync, every_s=config.snapshot_every_s,
            every_steps=config.snapshot_every_steps, timeout_s=config.pg_timeout_s,
            write_timeout_s=config.startup_timeout_s)
        # FSDP's mixed precision is shard_model's policy; DDP's is autocast, made once (a step stays cheap).
        self.autocast = contextlib.nullcontext() if self.fsdp else train_utils.autocast(device, config.compute_dtype)
        self.stop = train_utils.StopSignal()  # SIGUSR1, SIGTERM, Ctrl-C: all ranks stop after the same step
        self.phases = train_utils.StepPhases(device)  # each step's time by phase on this rank, no device sync
        # A rank slower than its peers in a phase, named by rank 0: the figures ride on the stop signal's all-reduce.
        # On several hosts (``hosts``, every rank's) it also times each link between hosts once a window.
        self.stop.watch = train_utils.StragglerWatch(self.phases, self.rank, dist.get_world_size(),
                                                     lambda: self.progress.step, getattr(train_data, "num_workers", 0),
                                                     hosts, device, worker_stacks=train_utils.worker_stacks(train_data))
        self.step_log = train_utils.StepLog(config.log_every_steps, task.tokens_per_sample)  # rank 0's progress
        self.watch = train_utils.Watch(config.pg_timeout_s, config.grad_accum_steps)  # time-outs, where each rank is
        self.memory_reported = not self.fsdp  # FSDP: the state each rank holds, after the first epoch's steps
        # What MFU divides by: the peak of the precision the matrix products run in (bf16, fp16, tf32, fp32).
        self.precision = train_utils.compute_precision(device, config.compute_dtype)
        if not self.fsdp and dist.get_world_size() > 1:
            # DDP copies rank 0's weights to all ranks here, then averages gradients in every backward()
            # (one process has none to average: the wrapper would only copy them into its buckets and
            # all-reduce them with itself, a fifth of a small GPT's GPU step, for the same numbers).
            # gradient_as_bucket_view: each gradient is a view into DDP's all-reduce buckets, not a
            # tensor of its own copied out of them after every all-reduce (the same values, less memory).
            self.model = DDP(self.model, device_ids=[device.index] if device.type == "cuda" else None,
                             gradient_as_bucket_view=True)
        # The compiled module shares the model's weights and runs the training
        # forward; saving and evaluation use the plain model, so what is saved
        # loads without torch.compile. FSDP: its blocks were compiled before sharding (shard_model).
        self.compiled = train_utils.compile_model(self.model, config.compile and not self.fsdp)
        # The loss in fp32, compiled as a graph of its own under --compile (DDP and FSDP alike).
        self.loss_fn = train_utils.training_loss(task.loss_fn, config.compile)
        self.to_device = train_utils.HostToDevice(device, self.rank)  # queued, not waited for
        # The wait for slower ranks in DDP's gradient all-reduce counts as collective, not compute (FSDP's
        # gathers and reductions sit inside its forward and backward: not told apart).
        if not self.fsdp:
            train_utils.time_gradient_wait(self.plain_model, self.phases)
        self.profiler = train_utils.StepProfiler(config.profile_dir, device)  # --profile_dir: a few steps traced
        # Where this attempt's wall time goes (rank 0's ledger) and every rank's timeline, beside the snapshot.
        # "data" and "peers" are rank 0's phase totals (the phase timer's "data" and "collective").
        self.goodput = train_utils.Goodput(config.snapshot_path, self.rank, phases=self.phases.totals)

    @property
    def plain_model(self) -> torch.nn.Module:
        """The model without DDP's wrapper (FSDP's sharded model is its own; one
        process trains the model itself)."""
        return self.model.module if isinstance(self.model, DDP) else self.model

    def train(self) -> train_utils.Found:
        """Collective: load the snapshot to resume from, if any, then train up
        to --total_epochs, evaluating and printing as ``run_epoch`` does,
        snapshotting every --save_every epochs and after the last. Returns
        the snapshot resumed from (``train_utils.Found``; its ``path`` None
        for a fresh start); for one that already holds every epoch, or every
        step of --max_steps, nothing is trained: ``finished``, its ``line``
        saying so (``train_utils.nothing_to_train``). Raises
        ``train_utils.Stopped`` when a stop signal ended it, its snapshot
        written; ConfigError (one line) for a snapshot of another run or a
        damaged one, and when the training loss is not finite, before
        anything is saved. Whatever ends the run, a snapshot write in flight
        completes first: a rank that fails because a peer was lost keeps its
        last snapshot. Once it returns, or raises Stopped, every rank has
        passed the stop signal's last poll (``StopSignal.close``)."""
        found = self.checkpointer.find()
        resumed_from = found.position if found.path else ""  # in its saver's steps, as the ledger names saves
        finished = train_utils.nothing_to_train(found, self.config)  # all epochs, or --max_steps' samples
        if found.mismatch and not finished:  # the other strategy's snapshot: finished, or not this run's to resume
            raise common.ConfigError(found.mismatch)
        if found.path and not finished:
            found = self.checkpointer.load()  # weights, optimizer, every part: where this run goes on
            finished = train_utils.nothing_to_train(found, self.config, self.progress.step)
        if self.config.init_from:  # a new run's weights, unless it resumes (a requeued job goes on)
            self._init_weights(found)
        if finished:
            self.stop.close()
            return dataclasses.replace(found, finished=True, line=finished)
        if found.path and self.rank == 0:
            self.log.resumed(found.path, found.position, found.note)
        if isinstance(self.model, DDP) and self.progress.resumed:  # DDP's gradient buckets as if it never stopped
            train_utils.rebuild_ddp_buckets(self.model, self.train_data, self.task.loss_fn,
                                            self.task.eval_transform, self.device, self.autocast)
        self.log.start(self.config.as_dict())  # the metrics file's start record; the W&B run (the snapshot's)
        self.goodput.begin(resumed_from, self.progress.step, dist.get_world_size())  # start-up ends here
        try:
            for epoch in range(self.progress.epochs_run, self.config.total_epochs):
                self.run_epoch(epoch)
                # Save after the last epoch too: the tutorials' `epoch % save_every == 0`
                # saves after the first epoch and can skip the last one.
                if (epoch + 1) % self.config.save_every == 0 or epoch + 1 == self.config.total_epochs:
                    self._save()
            with self.goodput.timed("snapshot"):
                self.checkpointer.wait(together=True)  # the last snapshot written before the run reports its end
            self.stop.close()
        except BaseException:
            with contextlib.suppress(BaseException):  # the run's own error is the one to report
                self.checkpointer.wait()
            raise
        return found

    def _init_weights(self, found: train_utils.Found) -> None:
        """--init_from: without a snapshot to resume from, the weights of that
        source loaded into the model (``train_utils.load_initial_weights``;
        every rank, collective under FSDP), rank 0 printing where from. With
        one, the snapshot wins: it holds this run's own training (a requeued
        or restarted job must go on, not start over), and rank 0 says that
        --init_from was not read."""
        if found.path:
            line = (f"--init_from {self.config.init_from} not read: this run resumes from its snapshot "
                    f"{found.path}; {train_utils.START_AFRESH} from --init_from")
        else:
            line = train_utils.load_initial_weights(self.plain_model, self.config.init_from, self.fsdp)
        if self.rank == 0:
            train_utils.print_line(line)

    def run_epoch(self, epoch: int) -> list:
        """Collective: epoch ``epoch``'s (0-based) training steps from where the
        run stands (``progress``), with the evaluations due in it (first the
        one a resumed snapshot stands at, if a stop came before or during
        it), a snapshot where one is due, and at its end the epoch's
        evaluation (by epochs). Returns the records of its evaluations
        (rank 0 printed and logged them). Raises ``train_utils.Stopped``
        after the snapshot of the step a stop signal ended it at."""
        self.model.train()
        # A new shuffle each epoch (without it every epoch repeats epoch 0's order); after a
        # mid-epoch resume, the rest of the epoch's permutation split over this run's ranks.
        self.train_data.sampler.set_epoch(epoch, start=self.progress.start_samples, order=self.progress.start_order)
        self.train_data.dataset.set_epoch(epoch)  # what the task draws while loading is keyed by it
        self.evaluations.start_epoch(epoch)
        limit = train_utils.batches_left(self.config, self.progress.steps_per_epoch, epoch, self.progress.steps_run)
        batches = train_utils.EpochBatches(self.train_data, epoch, self.config.total_epochs,
                                           self.config.grad_accum_steps, limit,
                                           self.evaluations.running_loss if self.rank == 0 else None)
        records = []
        if self.evaluations.due(self.progress.step, epoch_end=False):  # a stop came before or during it
            records.append(self._evaluate())
        # One line per epoch, rank 0's (every rank runs as many steps of as many samples; where each runs
        # is the start-up placement line); --rank_lines: every rank's, naming it, as the ladder's rungs print.
        line = f"epoch {epoch + 1} | batch_size {self.train_data.batch_size} | steps {batches.total}"
        if self.config.rank_lines:
            train_utils.print_line(f"[rank {self.rank} | local_rank {self.local_rank} | host {socket.gethostname()}] "
                                   + line)
        elif self.rank == 0:
            train_utils.print_line(line)
        for source, targets in self.phases.data(batches):  # the wait for each batch timed as "data"
            self.watch.step(epoch, batches.done)  # where this rank is; until training runs, every rank's batch
            step = self.progress.step + 1  # the optimizer step this micro-batch belongs to
            if self.hook and self.progress.steps_run % self.config.grad_accum_steps == 0:
                self.hook.before(step)
            with self.phases.phase("compute"):
                loss = self.train_step(source, targets)
            if self.hook:
                self.hook.after(step, loss)
            self.evaluations.add(loss, len(targets))
            self.profiler.step()  # --profile_dir: the profiler's schedule; off: returns at once
            if self.progress.steps_run % self.config.grad_accum_steps:
                continue  # no stop, no snapshot mid-accumulation: its gradients would be lost
            self.step_log.step(self.progress.step, epoch, self.evaluations, self.recipe.last_lr)
            self.goodput.step(self.progress.step)  # the step's time; rank 0's ledger knows the step reached
            # Every rank learns of a stop signal, and of rank 0's snapshot clock, at the same step.
            with self.phases.phase("collective"):
                stopping = self.stop.poll(request=self.checkpointer.request())
            if stopping:
                self._stop()
            if self.evaluations.due(self.progress.step, epoch_end=False):
                records.append(self._evaluate())
            if self.checkpointer.due(self.progress.epoch_step, self.stop.requested) and batches.left:
                self._save()  # not at the epoch's end: that snapshot comes next
            self.phases.end_step()
        self.watch.after_steps(epoch)
        if not self.memory_reported:  # the optimizer made its state at the first step: measure it now
            train_utils.print_sharded_memory(self.model, self.optimizer, self.device)
            self.memory_reported = True
        if self.evaluations.due(self.progress.step, epoch_end=True):
            records.append(self._evaluate())
        # A --max_steps run that ends inside this epoch stays inside it: its snapshot holds the
        # position, so a higher --max_steps goes on from there.
        if not (self.config.max_steps and self.progress.step >= self.config.max_steps_now
                and self.progress.step < (epoch + 1) * self.progress.steps_per_epoch):
            self.progress.end_epoch(epoch)
        return records

    def train_step(self, source: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One micro-batch as the loader gives it (on the host), at the run's
        position: forward and backward, and after every --grad_accum_steps-th
        micro-batch of the epoch the optimizer step (``progress.step`` then
        counts it). Returns its mean loss (0-dim, on the device)."""
        source, targets = self.to_device(source, targets)
        source = self.task.train_transform(source)
        accum = self.config.grad_accum_steps
        first, last = self.progress.steps_run % accum == 0, (self.progress.steps_run + 1) % accum == 0
        if first:
            self.optimizer.zero_grad(set_to_none=True)
        with self._gradient_sync(last), self.autocast:
            loss = self.loss_fn(self.compiled(source), targets)
        # Summed over the micro-batches, the gradients of loss / accum are those
        # of the mean loss over the whole accumulated batch. (No division without
        # accumulation: an extra autograd op costs a small model ~10%.)
        self.recipe.backward(loss / accum if accum > 1 else loss)  # --amp fp16: the loss scaled
        self.phases.note_backward_end()  # since this rank's own backward work ended: the gradient all-reduce's wait
        self.progress.steps_run += 1
        if last:
            self.recipe.step()  # unscale (fp16), clip, optimizer step, next lr
            self.progress.step += 1
        return loss.detach()

    def _gradient_sync(self, last: bool):
        """The gradients' all-reduce (DDP) or reduce-scatter (FSDP) only on the
        micro-batch that ends an optimizer step; before it they are summed locally."""
        if self.fsdp:
            if self.config.grad_accum_steps > 1:
                self.model.set_requires_gradient_sync(last)
            return contextlib.nullcontext()
        return self.model.no_sync() if isinstance(self.model, DDP) and not last else contextlib.nullcontext()

    def _evaluate(self) -> dict:
        """Collective: the evaluation due now, of the held-out data (``evaluate``,
        a stop signal polled after each batch), and its record (rank 0 prints
        and logs it): the training figures of the interval since the last
        (``Evaluations.summary``, taken before evaluating), the validation
        scores, the recipe's and the speed figures. A stop during it: this
        rank's CPU random state put back as it was before (the evaluation's
        DataLoader drew its seed from it; the resumed run, which evaluates
        again, draws it again, as the uninterrupted run drew it once: a
        language model's windows and dropout draw from it next), then
        ``_stop``: the resumed run evaluates first."""
        summary = self.evaluations.summary()
        state = torch.get_rng_state()
        with self.goodput.timed("evaluation"):
            scores = evaluate(self.plain_model, self.val_data, self.task, self.device, self.fsdp, self.stop)
        if scores is None:
            torch.set_rng_state(state)
            self._stop()
        record = self.evaluations.record(self.progress.step, summary, scores)
        record |= self.recipe.epoch_figures()  # lr; fp16: the steps skipped since the last evaluation
        if self.task.tokens_per_sample:  # a language model's run counts its tokens too, as nanoGPT's plans do
            record["tokens_run"] = record["samples_run"] * self.task.tokens_per_sample
        if "samples_per_s" in record:  # LM tasks: tokens/s; every task: FLOP/s, on a GPU MFU
            record |= train_utils.throughput_figures(record["samples_per_s"], self.task.tokens_per_sample,
                                                     self.task.flops_per_sample, self.device, self.precision)
        if self.rank == 0:  # every rank holds the same numbers; one prints them
            self.log.log(record)
        return record

    def _stop(self) -> None:
        """Collective, a stop signal reaching every rank at this step: the
        snapshot of it written (rank 0 prints how long after the signal, or
        the preemption notice, it was committed), every rank past the stop
        signal's last poll, then ``train_utils.Stopped`` raised."""
        self.goodput.marker("stop", {"signal": self.stop.stopped_by, "step": self.progress.step})
        self._save(wait=True)
        if self.rank == 0:  # what a cloud's notice (30 s to 2 minutes) or a pod's grace must fit
            origin, seconds = self.stop.since_stop()
            train_utils.print_line(f"stop: snapshot committed {seconds:.1f} s after {origin}")
        self.stop.close()
        raise train_utils.Stopped(self.stop.stopped_by)

    def _save(self, wait: bool = False) -> None:
        """Collective: a snapshot now (``checkpointer.save``; ``wait``: its
        write waited for on every rank), the time it blocks training counted
        as "snapshot" and its position recorded in the goodput ledger."""
        with self.goodput.timed("snapshot"), self.phases.phase("snapshot"):
            self.checkpointer.save()
            if wait:
                self.checkpointer.wait(together=True)
        self.goodput.saved(train_utils.position(self.progress.epochs_run, self.progress.steps_run))

    def close(self) -> None:
        """The run's end, whatever ended it (train.py's ``main`` calls it in a
        ``finally``), in this order: the snapshot write in flight waited for
        and the format's buffers freed (``Checkpointer.close``); the W&B run
        finished, marked failed when an exception is ending the run, and
        TensorBoard closed (``RunLog.close``: wandb's own exit hook does not
        run where the process ends at once); DDP's wrapper let go and
        collected, so that it goes before its process group does (torch 2.8
        can deadlock otherwise). No collective: on an error path the ranks
        may be anywhere. The process group and the snapshot's claim are the
        process's: ``ending.end_process`` ends them."""
        failed = sys.exc_info()[0] not in (None, train_utils.Stopped)  # an exception on its way out
        self.checkpointer.close()
        # The attempt's last ledger record, where ``finish`` did not write it: a stop, or an error.
        self.goodput.end("failed" if failed else "stopped" if self.stop.stopped_by else "ended")
        self.log.close(failed)
        self.model = self.compiled = self.plain_model
        gc.collect()  # DDP's reducer holds reference cycles


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: DataLoader, task: common.Task, device: torch.device,
             fsdp: bool = False, stop: Optional[train_utils.StopSignal] = None) -> Optional[tuple]:
    """Mean loss, and accuracy for a classification task, over every sample of ``data``.

    The loss is weighted by samples (sum of per-sample losses / sample count),
    not a mean of batch means, which would over-weight a short last batch.
    Collective: each rank scores its shard, the sums are all-reduced. Pass DDP's
    ``.module`` (DDP's forward is a collective). An FSDP model's forward all-gathers
    parameters, so there every rank runs as many forwards as the longest shard has
    batches (``batches_for_every_rank``). ``stop``: polled after each batch that
    every rank has (``fewest_batches``), so a stop signal ends a long evaluation
    within a batch. Returns (loss, accuracy or None); None when ``stop`` ended it.
    """
    train_utils.broadcast_buffers(model)  # each rank's BatchNorm statistics differ: use rank 0's, as saved
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, samples
    batches = train_utils.batches_for_every_rank(data, device) if fsdp else \
        ((source, targets, True) for source, targets in data)
    polls = train_utils.fewest_batches(data, device) if stop else 0  # a poll is collective: equally many
    stopped = False
    for index, (source, targets, counted) in enumerate(train_utils.evaluating(batches)):
        source = task.eval_transform(source.to(device, non_blocking=True))
        targets = targets.to(device, non_blocking=True)
        output = train_utils.fp32(model(source))  # FSDP's mixed precision gives bf16 or fp16
        if counted:  # else this shard is done: the forward only joined the others' all-gathers
            totals[0] += task.loss_fn(output, targets, reduction="sum")
            if task.classification:
                totals[1] += (output.argmax(dim=1) == targets).sum()
            totals[2] += len(targets)
        if index < polls and stop.poll():  # a stop signal: the evaluation is redone on resume
            stopped = True
            break
    model.train()
    if fsdp:
        model.reshard()  # the root stays gathered after a forward without backward: free it
    if stopped:
        return None
    dist.all_reduce(totals)
    loss_sum, correct, samples = totals.tolist()
    return loss_sum / samples, (correct / samples if task.classification else None)


def prepare_dataloader(dataset: Optional[Dataset], batch_size: int, num_workers: int, train: bool,
                       seed: int, collate_fn: Callable) -> Optional[DataLoader]:
    """Training: reshuffled every epoch from ``seed``, last partial batch dropped
    (a batch of 1 would break BatchNorm); each rank takes its 1/world_size of the
    epoch's permutation (DistributedSampler, resumable mid-epoch). Evaluation:
    rank r takes samples r, r+W, r+2W, ... unpadded, each sample once. Batches
    are made by ``collate_fn`` (the task's, ``common.Task.collate_fn``). The
    task's random draws while loading are keyed by (``seed``, epoch, sample)
    (``train_utils.SeededFetches``; the Trainer gives the training dataset
    its epoch), so no worker count or resume changes them. None for no
    ``dataset`` (a task without a test split, ``common.Task``)."""
    if dataset is None:
        return None
    rank, world_size = dist.get_rank(), dist.get_world_size()
    # What the task draws while loading is keyed by (seed, epoch, sample), wherever it loads; in an
    # evaluation by (seed, 0, sample): each evaluation of the same weights gives the same loss.
    dataset = train_utils.SeededFetches(dataset, seed)
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
        # From a fork server; they ignore stop signals; a training loader's workers, where there are peers to
        # compare, sample their stacks for the straggler watch (while their rank waits for data).
        **train_utils.loader_workers(num_workers, dataset, sample_stacks=train and world_size > 1),
        pin_memory=torch.cuda.is_available(),
        # The task's batching (common.collate passes InMemoryImages' whole batches), each tensor made
        # dense: the loader pins what it returns, and only a dense pinned tensor copies without a wait.
        collate_fn=train_utils.DenseBatches(collate_fn),
    )


def build_task(args: argparse.Namespace, local_rank: int, amp: Optional[str]) -> tuple[common.Task,
                                                                                     train_utils.RunConfig]:
    """Collective: the task (one download per node: local rank 0 first, the
    others after) and the run's configuration, resolved from ``args`` and
    the task (``train_utils.resolve_config``; ``amp``: --amp as the job runs
    it). The model comes from --seed, the same on every rank. ``args``
    stays as parsed: the task function gets a copy, in which it names the
    model it chose (``common.choose_model``) and, under --init_from, the
    sizes of the weights (``train_utils.take_initial_sizes``). Raises
    ConfigError (one line, on every rank) when the task cannot load, or for
    a task flag the task does not read."""
    # One seed for the initial weights on every rank (DDP copies rank 0's to all anyway;
    # FSDP keeps each rank's slice of its own copy).
    torch.manual_seed(args.seed)
    task_args = argparse.Namespace(**vars(args))
    if getattr(args, "init_from", None):  # the GPT's sizes of the weights it starts from, where no flag gives one
        train_utils.take_initial_sizes(task_args)
    task = train_utils.downloaders_first(common.load_task, task_args, local_rank == 0)  # --data_dir is per node
    # A node's ranks (torchrun's, or srun's: train_utils.launcher_store): HSDP's default shard size.
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    # --max_steps counts steps of the global batch the run started with, whatever this start's world size.
    budget_batch = train_utils.saved_budget_batch(args.snapshot_path)
    return task, train_utils.resolve_config(args, task, dist.get_world_size(), amp, train_utils.task_flag_values(args),
                                            local_world_size, model=task_args.model,
                                            output_flags=train_utils.output_flags(args.dataset),
                                            budget_batch=budget_batch)


def build_model(task: common.Task, config: train_utils.RunConfig, rank: int,
                device: torch.device) -> torch.optim.Optimizer:
    """The task's model on ``device`` (``task.model``; checkpointed, and sharded
    under FSDP), and the optimizer over it (--optimizer, --lr,
    --weight_decay). Under FSDP and HSDP a task that gives a model factory
    (``common.Task.model_factory``) has it built on the meta device, sharded,
    and only this rank's shards materialised, with the initial weights of
    the model built whole (``train_utils.build_on_meta``). After it each
    rank draws from its own random stream (--seed + rank), or all would
    draw the same dropout masks."""
    init_record = None  # a meta-device build's record, replayed into this rank's shards once sharded
    if config.sharded and task.model_factory is not None:  # no rank ever holds the whole model
        task.model, init_record = train_utils.build_on_meta(task.model_factory)
    else:
        task.model = task.model.to(device)
    # The model's FLOPs per sample, counted on the plain model (before checkpointing and sharding wrap it),
    # by rank 0 alone: it logs the figures, and torch's FLOP counter costs 0.1 s of start-up. A meta
    # model's are counted on the meta device: shapes alone.
    if task.flops_per_sample is None and rank == 0:
        task.flops_per_sample = train_utils.flops_per_sample(task, device if init_record is None
                                                             else torch.device("meta"))
    if config.activation_checkpointing:  # before DDP and FSDP wrap the blocks
        train_utils.checkpoint_activations(task.model)
    if config.sharded:  # before the optimizer: fully_shard replaces the parameters
        if config.compile:  # torchtitan's order: each FSDP unit compiled, then sharded
            train_utils.compile_blocks(common.fsdp_units(task.model))
        task.model = train_utils.shard_model(task.model, device, config.compute_dtype, config.shard_size)
        if init_record is not None:  # memory for this rank's shards, and their initial values
            train_utils.materialize_shards(task.model, init_record, device)
    torch.manual_seed(config.seed + rank)
    return train_utils.build_optimizer(task.model, config)  # --optimizer, --lr, --weight_decay


def finish(trainer: Trainer, found: train_utils.Found, test_data: Optional[DataLoader]) -> None:
    """Collective: the run holds every epoch (``trainer.train`` returned
    ``found``). A run that trained now: the test figures (none for a task
    without a test split: ``test_data`` None). Then what the model writes (a
    language model's sample: ``Task.sample_text``; a finished snapshot's
    weights loaded first), rank 0's line that nothing was left to train
    (``found.line``, for a finished snapshot), the attempt's last goodput
    record and rank 0's goodput line over the run's attempts (a run that
    trained now: ``Goodput.end``), and rank 0 tells a Slurm
    wrapper that nothing is left to train, so a late stop signal does not
    requeue it."""
    task = trainer.task
    if found.finished and task.sample_text is not None:
        trainer.checkpointer.load_model()
    elif not found.finished and test_data is not None:
        with trainer.goodput.timed("evaluation"):
            test_loss, test_accuracy = evaluate(trainer.plain_model, test_data, task, trainer.device, trainer.fsdp)
        if trainer.rank == 0:
            trainer.log.log({"test_loss": test_loss, "test_accuracy": test_accuracy})
    # FSDP: every rank runs the forwards; rank 0 prints
    train_utils.print_sample(trainer.plain_model, task, trainer.device, trainer.fsdp)
    goodput = trainer.goodput.end("finished")  # over every attempt of the run; '' where nothing was trained now
    if trainer.rank == 0:
        if found.finished:
            train_utils.print_line(found.line)
        if goodput:
            train_utils.print_line(goodput)
        train_utils.report_run_finished()


def build_run(args: argparse.Namespace, log: train_utils.RunLog, local_rank: int, device: torch.device,
              amp: Optional[str], hook: Optional[StepHook] = None) -> tuple[Trainer, Optional[DataLoader]]:
    """Collective: a run of ``args`` built from scratch: the task and the
    configuration (``build_task``; ``amp``: --amp as the job runs it), the
    model and optimizer (``build_model``), the loaders, the checks before
    training; rank 0 prints the start-up line, the placement line (where
    each rank runs: ``train_utils.describe_placement``) and the task line. Returns the ``Trainer``
    (``log`` its outputs, ``hook`` its ``StepHook``) and the test split's
    loader (None: no test split). Raises ConfigError (one line) as
    ``build_task`` and ``check_before_training`` do."""
    task, config = build_task(args, local_rank, amp)  # the configuration, resolved: frozen from here on
    optimizer = build_model(task, config, dist.get_rank(), device)
    val_set = train_utils.eval_subset(task.val_set, config.eval_windows, config.seed)  # --eval_windows: a few
    train_data, val_data, test_data = (prepare_dataloader(data, config.batch_size, config.num_workers, train,
                                                          config.seed, task.collate_fn)
                                       for data, train in ((task.train_set, True), (val_set, False),
                                                           (task.test_set, False)))
    train_utils.check_before_training(config, device, train_data)
    placement = train_utils.gather_placement(local_rank, device)  # where each rank runs, said once by rank 0
    if dist.get_rank() == 0:
        train_utils.print_line(train_utils.describe_run(device, config))
        train_utils.print_line(train_utils.describe_placement(placement))
        train_utils.print_line(train_utils.describe_task(args.dataset, task))
    hosts = [host for _, _, host, _ in placement]
    return Trainer(task, optimizer, train_data, val_data, log, device, local_rank, config, hook, hosts), test_data


def start(args: argparse.Namespace) -> tuple[int, torch.device, Optional[str]]:
    """Collective: this process's start, up to building a run: the stop
    signals caught (from here a stop signal ends start-up cleanly, at once),
    and with --preemption_notice the cloud's notice watched (as a stop signal),
    --deterministic set (before the process group, which reads it under
    NCCL), the process group joined (``setup``), fp32's precision on GPUs
    set before the first matmul (TF32 unless --no_tf32), FSDP's backend
    checked (refused on gloo before torch 2.10, before anything is
    written), and --amp resolved, one dtype for the whole job (collective
    on CUDA). Returns (local_rank, device, --amp as the job runs it).
    Raises ConfigError (one line) as ``setup`` does, and for FSDP on a
    gloo that cannot average."""
    train_utils.catch_stop_signals()
    train_utils.set_deterministic(args.deterministic, args.compile)
    _, local_rank, device = setup(args.startup_timeout_s, args.snapshot_path)
    train_utils.watch_preemption_notice(args.preemption_notice, local_rank)  # a cloud's notice stops as SIGTERM
    train_utils.set_fp32_precision(device, args.no_tf32)
    if train_utils.is_sharded(args.strategy):
        train_utils.check_fsdp_backend()
    return local_rank, device, train_utils.resolve_amp(args.amp, device)


@train_utils.one_line_errors
def main(args: argparse.Namespace) -> int:
    """Train by ``args`` (``parse_args``), resuming from --snapshot_path when it
    holds a snapshot. Collective: every rank calls it, and runs under a
    process group from ``setup`` on. Returns the exit status, with which
    ``one_line_errors`` then ends the process: 0 for a run trained to its
    end or finished already, 128 + the signal's number for a run a stop
    signal stopped after its snapshot (``Stopped.status``: not done, the same
    command resumes). Bad input ends it with one line and exit status 2, a
    collective time-out with one line naming the ranks that did not arrive,
    exit status 1."""
    # Its start time: the metrics file's start record.
    log = train_utils.RunLog(args.metrics_path, args.tensorboard_dir, args.wandb_project)
    local_rank, device, amp = start(args)
    # One live run per snapshot: another's is refused here, before any download.
    train_utils.claim_snapshot_path(args.snapshot_path, train_utils.is_sharded(args.strategy))
    trainer, test_data = build_run(args, log, local_rank, device, amp)
    try:
        found = trainer.train()
        finish(trainer, found, test_data)
        return 0
    except train_utils.Stopped as stop:
        return stop.status  # every rank stopped at the same step, its snapshot written: the same command resumes
    finally:
        trainer.close()


if __name__ == "__main__":
    # --plan NODESxPROCS: the run these flags would make as that job, checked and printed by this one process.
    layout, argv = train_utils.plan_request(sys.argv[1:])
    args = train_utils.parse_args(__doc__, common.TASKS, models=train_utils.task_models,
                                  snapshot_paths=SNAPSHOT_PATHS, argv=argv)
    if layout:
        train_utils.check_plan(args, layout, argv, prepare_dataloader)
    main(args)
