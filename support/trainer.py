"""train.py's Trainer and a task's pieces, built in process as train.py
builds them: for tests and benchmarks that call its steps directly."""

from __future__ import annotations

import argparse
import os

import torch

def task_args(dataset: str, data_dir="data", input_path: str = "torchvision", seed: int = 0,
              model=None, **flags) -> argparse.Namespace:
    """The parsed command line a script would pass to ``common.load_task``
    (the task's fields), plus any other ``flags``."""
    return argparse.Namespace(dataset=dataset, data_dir=str(data_dir), input_path=input_path,
                              seed=seed, model=model, **flags)


def load_task(dataset: str, data_dir="data", input_path: str = "torchvision", seed: int = 0):
    """``common.load_task`` as a script calls it, without downloading (the
    per-sample torchvision path by default)."""
    import common

    return common.load_task(task_args(dataset, data_dir, input_path, seed), download=False)


def plain_task(loss_fn, classification: bool, model=None):
    """A ``common.Task`` with no data: a loss, whether it is a classification,
    and ``model`` (None unless given)."""
    import common

    return common.Task(None, None, None, model, loss_fn, classification)


def kit_trainer(model: torch.nn.Module, optimizer, loss_fn, out_dir: str, local_rank: int = 0,
                grad_accum_steps: int = 1, device: torch.device = torch.device("cpu"), amp=None,
                train_data=None, val_data=None, **recipe):
    """train.py's Trainer around ``model`` on ``device`` (the CPU unless
    given; DDP-wrapped at a world size above 1), under --amp ``amp``, with
    ``train_data`` (a loader of ``train.prepare_dataloader``'s making; by
    default one of ``grad_accum_steps`` empty samples, for driving its
    public ``train_step``), ``val_data`` (a loader to evaluate, for
    ``run_epoch``; None: none) and no snapshot to resume: for calling its
    ``train_step`` or ``run_epoch`` directly. Needs a process group (the rank
    is the group's), ``local_rank`` this process's index on its node.
    ``optimizer``'s type and lr, ``grad_accum_steps`` and ``recipe`` (recipe
    flags, e.g. ``clip_grad_norm=0.05``) are the run's flags, the rest their
    defaults (``train_utils.RunConfig``). The snapshot path does not exist:
    its Checkpointer finds nothing to load."""
    import train
    import train_utils

    config = train_utils.RunConfig(
        strategy="ddp", grad_accum_steps=grad_accum_steps, amp=amp, total_epochs=1, save_every=1,
        snapshot_path=os.path.join(out_dir, "absent.pt"), lr=optimizer.param_groups[0]["lr"],
        optimizer=type(optimizer).__name__.lower(), **recipe)
    if train_data is None:
        train_data = train.prepare_dataloader(torch.utils.data.TensorDataset(torch.zeros(grad_accum_steps, 1)),
                                              1, 0, True, 0, torch.utils.data.default_collate)
    return train.Trainer(plain_task(loss_fn, False, model), optimizer, train_data, val_data, train_utils.RunLog(),
                         device, local_rank, config)


def trainer_as_train_py_builds_it(argv: list, rank: int, device: torch.device = torch.device("cpu")):
    """train.py's Trainer for the command line ``argv`` (its flags), built in
    this process as train.py's ``main`` builds it, under the process group
    that exists (``rank`` this process's, on one node): the task loaded
    (downloading nothing), the configuration resolved, the model (sharded
    under --strategy fsdp, compiled under --compile) and the optimizer, the
    loaders. Nothing claimed and nothing loaded yet: ``train()`` loads the
    snapshot, ``checkpointer.find()`` then ``checkpointer.load()`` alone too. Returns (trainer, its
    training loader)."""
    import common
    import train
    import train_utils

    args = train_utils.parse_args(None, common.TASKS, argv=[str(arg) for arg in argv])
    task, config = train.build_task(args, rank, train_utils.resolve_amp(args.amp, device))
    optimizer = train.build_model(task, config, rank, device)
    train_data, val_data = (train.prepare_dataloader(data, config.batch_size, config.num_workers, training,
                                                     config.seed, task.collate_fn)
                            for data, training in ((task.train_set, True), (task.val_set, False)))
    log = train_utils.RunLog(config.metrics_path, config.tensorboard_dir, config.wandb_project)
    return train.Trainer(task, optimizer, train_data, val_data, log, device, rank, config), train_data
