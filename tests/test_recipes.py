"""The training recipe (train_utils/loop/recipe.py): optimizer and weight decay by
flag, learning-rate schedules with warm-up, gradient clipping over all ranks,
fp16 with a loss scaler, the task's defaults, the CIFAR-stem ResNet, and an
FSDP run killed while saving that resumes all of it bitwise."""

import argparse
import json
import os
import sys

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

import common
import recipes
import train_utils
from common import ConfigError
from recipes import lr_factor
from train_utils.distributed.devices import torch_version
from train_utils.distributed.fsdp import GLOO_AVG_REDUCE_SCATTER
from train_utils.ending import end_process
from train_utils.snapshots.file import read_snapshot
import vision_tasks
from dataset_files import build_cifar10_root
from helpers import REPO, PODS, TORCHRUN, check, epochs, error_lines, free_port, kit_trainer, one_process, parse_test, run

TORCHRUN_2 = PODS + ["--nproc_per_node=2", REPO / "train.py"]


def recipe_args(**flags) -> argparse.Namespace:
    return argparse.Namespace(**{**recipes.RECIPE_DEFAULTS, "total_epochs": 4, "clip_grad_norm": None,
                                 "amp": None, **flags})


def lrs(scheduler_class, steps: int, **options) -> list:
    """The learning rate of each of ``steps`` optimizer steps under one of torch's schedulers."""
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    scheduler = scheduler_class(optimizer, **options)
    found = []
    for _ in range(steps):
        found.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return found


def test_schedules_give_the_learning_rates_of_torchs_own_schedulers():
    """lr_factor against torch's CosineAnnealingLR (stepped per step), StepLR (per
    epoch) and LinearLR (the warm-up): the same learning rate at every step."""
    per_epoch, total = 5, 4 * 5
    factor = lr_factor(recipe_args(lr_schedule="cosine"), per_epoch)
    assert [0.1 * factor(k) for k in range(total)] == pytest.approx(
        lrs(torch.optim.lr_scheduler.CosineAnnealingLR, total, T_max=total), abs=1e-12)
    factor = lr_factor(recipe_args(lr_schedule="step", lr_step_epochs=2, lr_gamma=0.7), per_epoch)
    by_epoch = lrs(torch.optim.lr_scheduler.StepLR, 4, step_size=2, gamma=0.7)
    assert [0.1 * factor(k) for k in range(total)] == pytest.approx(
        [lr for lr in by_epoch for _ in range(per_epoch)], abs=1e-12)
    factor = lr_factor(recipe_args(warmup_epochs=0.8), per_epoch)  # 4 steps of warm-up
    assert [0.1 * factor(k) for k in range(8)] == pytest.approx(
        lrs(torch.optim.lr_scheduler.LinearLR, 8, start_factor=0.25, total_iters=3), abs=1e-12)
    factor = lr_factor(recipe_args(lr_schedule="cosine", warmup_epochs=1), per_epoch)
    assert factor(4) == 1.0 and factor(5) == 1.0 and 0 < factor(total - 1) < 0.02 and factor(total) == 0.0
    with pytest.raises(ConfigError, match="lr_schedule 'linear' .* is not one of"):
        lr_factor(recipe_args(lr_schedule="linear"), per_epoch)


def test_optimizer_and_weight_decay_by_flag():
    model = torch.nn.Linear(3, 1)
    for name, cls in (("sgd", torch.optim.SGD), ("adamw", torch.optim.AdamW),
                      ("adadelta", torch.optim.Adadelta)):
        optimizer = train_utils.build_optimizer(model, recipe_args(optimizer=name, lr=0.3, weight_decay=0.01))
        assert type(optimizer) is cls
        assert optimizer.param_groups[0]["lr"] == 0.3 and optimizer.param_groups[0]["weight_decay"] == 0.01
    with pytest.raises(ConfigError, match="optimizer 'lamb' .* is not one of sgd, adamw, adadelta"):
        train_utils.build_optimizer(model, recipe_args(optimizer="lamb"))


def test_the_task_gives_the_recipe_defaults_and_the_command_line_overrides_them(tmp_path, monkeypatch):
    (tmp_path / "recipe_task.py").write_text(
        "import common\n"
        "def task(args, download):\n"
        "    t = common.synthetic_task(args, download)\n"
        "    t.recipe = {'optimizer': 'adamw', 'lr': 0.003, 'weight_decay': 0.1}\n"
        "    return t\n"
        "def bad(args, download):\n"
        "    t = common.synthetic_task(args, download)\n"
        "    t.recipe = {'learning_rate': 0.1}\n"
        "    return t\n")
    monkeypatch.chdir(tmp_path)
    flags = dict(dataset="recipe_task:task", data_dir="data", input_path="fast", seed=0, model=None,
                 **{name: None for name in recipes.RECIPE_DEFAULTS})
    args = argparse.Namespace(**dict(flags, lr=0.01))
    recipes.set_recipe_flags(args, common.load_task(args, download=False).recipe)  # as every script does
    assert (args.optimizer, args.lr, args.weight_decay, args.lr_schedule) == ("adamw", 0.01, 0.1, "constant")
    assert vision_tasks.CIFAR10_RECIPE["weight_decay"] == 5e-4  # the CIFAR-10 usual, set by the task
    bad = argparse.Namespace(**dict(flags, dataset="recipe_task:bad"))
    with pytest.raises(ConfigError, match="Task.recipe sets learning_rate, which is no recipe flag"):
        recipes.set_recipe_flags(bad, common.load_task(bad, download=False).recipe)


def test_a_snapshot_from_before_the_optimizer_flag_is_sgds(tmp_path):
    """Snapshots written before --optimizer existed hold no "optimizer" in their
    config: they trained SGD, so SGD resumes them and another is refused by name."""
    path = tmp_path / "old.pt"
    config = {"dataset": "synthetic", "model": "mlp", "seed": 0, "input_path": "fast", "world_size": 2,
              "batch_size": 32, "grad_accum_steps": 1}
    torch.save({"config": config, "epochs_run": 1, "steps_run": 0}, path)
    assert read_snapshot(str(path), dict(config, optimizer="sgd", total_epochs=2))["epochs_run"] == 1
    with pytest.raises(ConfigError, match=r"different run \(optimizer sgd -> adamw\)"):
        read_snapshot(str(path), dict(config, optimizer="adamw", total_epochs=2))


def test_epoch_line_metrics_and_tensorboard_show_the_learning_rate(tmp_path):
    """Step decay x0.5 per epoch: the epoch line, the JSON record and TensorBoard's
    "lr" scalar give each epoch's learning rate."""
    result = check(one_process(["--total_epochs", "3", "--lr", "0.08",
                        "--lr_schedule", "step", "--lr_gamma", "0.5", "--metrics_path", "m.jsonl",
                        "--tensorboard_dir", "tb"], tmp_path))
    assert [e["lr"] for e in epochs(result.stdout)] == [0.08, 0.04, 0.02]
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in records if "epoch" in r] == [0.08, 0.04, 0.02]
    assert records[0]["config"]["lr_schedule"] == "step"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb")).Reload()
    assert [(e.step, round(e.value, 6)) for e in events.Scalars("lr")] == [(1, 0.08), (2, 0.04), (3, 0.02)]


# --------------------------------------------------------------------------
# Resume: the schedule and the loss scale go on exactly; changes are said
# --------------------------------------------------------------------------

COSINE = ["--batch_size", "16", "--lr_schedule", "cosine", "--warmup_epochs", "0.5"]


def test_a_resume_says_what_a_new_horizon_or_lr_changes_and_refuses_another_optimizer(tmp_path):
    check(run(TORCHRUN_2 + COSINE + ["--total_epochs", "2"], tmp_path))
    before = (tmp_path / "snapshot_train.pt").read_bytes()
    refused = one_process(COSINE + ["--total_epochs", "3", "--optimizer", "adamw"], tmp_path)
    assert refused.returncode != 0
    assert set(error_lines(refused.stderr)) == {
        "error: snapshot snapshot_train.pt comes from a different run (optimizer sgd -> adamw); "
        "resume with its settings, or delete it or pass another --snapshot_path to start afresh"}
    assert (tmp_path / "snapshot_train.pt").read_bytes() == before

    resumed = check(run(TORCHRUN_2 + COSINE + ["--total_epochs", "3", "--lr", "0.02"], tmp_path))
    # 1844 samples, 2 ranks of batch 16: 57 steps per epoch, 28 of warm-up, 171 in all
    factor = lr_factor(recipe_args(lr_schedule="cosine", warmup_epochs=0.5, total_epochs=3), 57)
    assert ("recipe changed at resume (lr 0.05 -> 0.02, total_epochs 2 -> 3): the cosine schedule now "
            f"runs to epoch 3; the next step's learning rate is {0.02 * factor(114):.6g}") in resumed.stdout
    assert resumed.stdout.count("recipe changed") == 1  # rank 0 says it
    assert epochs(resumed.stdout)[0]["lr"] == pytest.approx(0.02 * factor(170), rel=1e-5)


# A user's task with a flag of its own outside its identity, as the GPT tasks' --dropout is.
DROPOUT_TASK = """
import torch.nn as nn

import common

FLAGS = {"dropout": {"type": float, "default": 0.0, "help": "dropout probability (default: 0.0)"},
         "greeting": {"type": str, "default": "", "help": "what the trained model says (default: nothing)"}}
OUTPUT_FLAGS = ("greeting",)  # what the trained model writes: no recipe


def build_task(args, download):
    task = common.synthetic_task(args, download)
    task.model = nn.Sequential(task.model, nn.Dropout(args.dropout))
    return task
"""


def test_a_resume_names_a_changed_task_flag_outside_the_identity(tmp_path):
    """--dropout raised at resume is taken, and said, as a recipe change is; a
    flag of the task's OUTPUT_FLAGS (what the trained model writes, as
    --sample_chars) changed with it is no recipe and is not named."""
    (tmp_path / "dropout_task.py").write_text(DROPOUT_TASK)
    flags = ["--dataset", "dropout_task:build_task"]
    check(one_process(flags + ["--total_epochs", "1"], tmp_path, PYTHONPATH=str(tmp_path)))
    resumed = check(one_process(flags + ["--total_epochs", "2", "--dropout", "0.1", "--greeting", "hello"], tmp_path,
                                PYTHONPATH=str(tmp_path)))
    assert "recipe changed at resume (total_epochs 1 -> 2, dropout 0.0 -> 0.1): " in resumed.stdout


@pytest.mark.skipif(torch_version() < GLOO_AVG_REDUCE_SCATTER,
                    reason=f"torch {torch.__version__}: FSDP on gloo needs torch 2.10")
def test_fsdp_recipe_killed_while_saving_and_restarted_ends_bitwise(tmp_path):
    """train.py --strategy fsdp: AdamW, cosine with warm-up, clipping of sharded (DTensor)
    gradients, fp16 with the loss scaler, 2 micro-batches per step. Rank 0 is
    SIGKILLed in its 2nd save (epoch 1 step 80), after every rank wrote its
    shards, before the meta file that completes the folder: torchrun restarts
    all, the restart resumes from the previous folder, still complete (epoch 1
    step 40), removes the torn one, resumes the schedule and the scale, and the
    final shards are bitwise the uninterrupted run's."""
    from helpers import FAULTY_TRAIN, assert_bitwise, full_state, snapshot_folder
    from test_fsdp import fsdp

    flags = ["--total_epochs", "2", "--batch_size", "8", "--grad_accum_steps", "2", "--snapshot_every_steps", "20",
             "--optimizer", "adamw", "--lr", "0.01", "--weight_decay", "0.05", "--lr_schedule", "cosine",
             "--warmup_epochs", "0.5", "--clip_grad_norm", "0.5", "--amp", "fp16"]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    uninterrupted = check(run(fsdp(2, *flags), tmp_path / "a"))
    killed = check(run(fsdp(2, *flags, restarts=1, script=FAULTY_TRAIN), tmp_path / "b",
                       DDP_TEST_FAULT="save:0:2:kill"))
    assert "DDP_TEST_FAULT: kill at save 2 on rank 0" in killed.stderr
    assert "resuming from snapshot snapshot_train_fsdp/epoch-1-step-40 in epoch 1 after step 40" in killed.stdout
    assert sorted(os.listdir(tmp_path / "b" / "snapshot_train_fsdp")) == ["epoch-2"]  # the torn one removed
    # Each epoch's summary, timings aside, is the uninterrupted run's: epoch 1's carried over the restart.
    def figures(stdout):
        return [{k: v for k, v in e.items() if k not in ("epoch_s", "samples_per_s", "flop_per_s")}
                for e in epochs(stdout)]

    assert figures(killed.stdout) == figures(uninterrupted.stdout) and len(figures(killed.stdout)) == 2
    straight = full_state(snapshot_folder(tmp_path / "a" / "snapshot_train_fsdp"), tmp_path / "ga")[1]
    restarted = full_state(snapshot_folder(tmp_path / "b" / "snapshot_train_fsdp"), tmp_path / "gb")[1]
    assert "optimizer.0.weight.exp_avg_sq" in straight and straight["loss_scaler.scale"] < 65536.0
    assert_bitwise(straight, restarted)


# --------------------------------------------------------------------------
# Clipping: the total norm over every rank's gradients
# --------------------------------------------------------------------------

MAX_NORM = 0.05


def _clip_worker(rank: int, world_size: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)
    x, y = torch.load(os.path.join(out, "batch.pt"))
    mine = slice(rank * 8, rank * 8 + 8)  # each rank its half of the global batch of 16
    # DDP, as train.py's Trainer runs it: 2 micro-batches of 4, then one clipped step.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    trainer = kit_trainer(model, torch.optim.SGD(model.parameters(), lr=1.0),
                          F.mse_loss, out, rank, grad_accum_steps=2, clip_grad_norm=MAX_NORM)
    for part in (slice(mine.start, mine.start + 4), slice(mine.start + 4, mine.stop)):
        trainer.train_step(x[part], y[part])
    ddp = {name: p.detach().clone() for name, p in trainer.model.module.named_parameters()}
    # FSDP: the same model sharded, the same half batch, one step through the Recipe.
    torch.manual_seed(0)
    model = train_utils.shard_model(
        torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)),
        torch.device("cpu"), dtype=None)
    recipe = train_utils.Recipe(torch.optim.SGD(model.parameters(), lr=1.0),
                                train_utils.RunConfig(lr=1.0, clip_grad_norm=MAX_NORM, total_epochs=4), 1, lambda: 0,
                                torch.device("cpu"))
    recipe.backward(F.mse_loss(model(x[mine]), y[mine]))
    recipe.step()
    fsdp = {name: p.full_tensor() for name, p in model.named_parameters()}
    if rank == 0:
        torch.save({"ddp": ddp, "fsdp": fsdp}, os.path.join(out, "result.pt"))
    end_process(0)  # as train.py's runs end: the process group destroyed; FSDP: no interpreter teardown


def test_clip_grad_norm_clips_the_global_norm_under_ddp_accumulation_and_fsdp(tmp_path):
    """One SGD step (lr 1) clipped to norm 0.05, from the same weights and the same
    global batch of 16: one process with torch's clip_grad_norm_, two DDP ranks
    with 2 micro-batches each, two FSDP ranks holding half of each gradient. The
    weights after the step agree (summation order aside): each clipped the norm
    of the whole gradient, not of its rank's part."""
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(16, 6, generator=g), torch.randn(16, 1, generator=g) * 5
    torch.save((x, y), tmp_path / "batch.pt")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    start = {name: p.detach().clone() for name, p in model.named_parameters()}
    F.mse_loss(model(x), y).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    assert norm > 10 * MAX_NORM  # the clipping matters
    expected = {name: start[name] - p.grad for name, p in model.named_parameters()}
    mp.spawn(_clip_worker, args=(2, free_port(), str(tmp_path)), nprocs=2)
    result = torch.load(tmp_path / "result.pt")
    for kind in ("ddp", "fsdp"):
        for name, value in expected.items():
            torch.testing.assert_close(result[kind][name], value, rtol=1e-5, atol=1e-6, msg=f"{kind} {name}")


# --------------------------------------------------------------------------
# The CIFAR-10 ResNet
# --------------------------------------------------------------------------

def test_cifar_resnets_have_the_cifar_stem_and_the_published_parameter_counts():
    """11,173,962 and 23,520,842 parameters: kuangliu/pytorch-cifar's ResNet18 and
    ResNet50; the 3x3 stride-1 stem keeps 32x32 into the first block. torchvision's
    ImageNet stem stays available by name."""
    counts = {name: sum(p.numel() for p in vision_tasks.build_model("cifar10", name).parameters())
              for name in vision_tasks.CIFAR10_MODELS}
    assert counts == {"resnet18": 11_173_962, "resnet50": 23_520_842,
                      "resnet18_imagenet": 11_181_642, "resnet50_imagenet": 23_528_522}
    model = vision_tasks.build_model("cifar10", "resnet18")
    seen = {}
    model.layer1.register_forward_hook(lambda module, inputs, output: seen.update(shape=output.shape))
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    assert seen["shape"] == (2, 64, 32, 32)  # the ImageNet stem gives 8x8 here
    imagenet = vision_tasks.build_model("cifar10", "resnet18_imagenet")
    imagenet.layer1.register_forward_hook(lambda module, inputs, output: seen.update(shape=output.shape))
    imagenet(torch.randn(2, 3, 32, 32))
    assert seen["shape"] == (2, 64, 8, 8)


def test_cifar10_default_recipe_trains_through_torchvisions_reader(tmp_path):
    """The cifar10 defaults (ResNet-18 with the CIFAR stem, SGD 0.1, weight
    decay 5e-4, cosine) on CIFAR-shaped synthetic images in the real file
    format, read by torchvision's own CIFAR10 class (its md5 check of the
    official archive bypassed: the files are ours), 2 ranks, 2 epochs: the
    training loss falls, each epoch's validation accuracy and the test
    accuracy are fractions, and the snapshot names the recipe and holds the
    10-class head. (A stop inside an epoch resumes bitwise on this task too,
    its augmentation on the device's generator included:
    tests/test_check_resume.py.)"""
    data = build_cifar10_root(tmp_path / "data", per_batch=32, n_test=20)  # 144 to train: 5 steps of 16 a rank
    # 2 ranks through tests/md5_bypass.py: the synthetic files' checksums are not the official ones.
    launch = TORCHRUN_2[:-1] + [REPO / "tests" / "md5_bypass.py"]
    flags = ["--dataset", "cifar10", "--data_dir", data, "--batch_size", "16", "--lr", "0.02", "--total_epochs", "2"]
    result = check(run(launch + [REPO / "train.py"] + flags, tmp_path))
    assert "device cpu" in result.stdout
    lines = epochs(result.stdout)
    assert len(lines) == 2 and lines[1]["train_loss"] < lines[0]["train_loss"]
    assert all(0 <= e["val_acc"] <= 1 for e in lines) and 0 <= parse_test(result.stdout)["acc"] <= 1
    snapshot = torch.load(tmp_path / "snapshot_train.pt", weights_only=True)
    config = snapshot["config"]
    assert (config["model"], config["optimizer"], config["weight_decay"], config["lr_schedule"]) == \
        ("resnet18", "sgd", 5e-4, "cosine")
    assert snapshot["model"]["fc.weight"].shape == (10, 512)


# --------------------------------------------------------------------------
# Any accelerator
# --------------------------------------------------------------------------

def test_device_and_backend_come_from_torch_accelerator(monkeypatch):
    """Here: the CPU and gloo. An XPU (faked: none on these machines) gives
    xpu:LOCAL_RANK; on MPS the CPU (no process-group backend for MPS, and the
    kit always runs under a process group)."""
    assert train_utils.device_for(0) == torch.device("cpu")
    assert train_utils.backend_for(torch.device("cpu")) == "gloo"
    if not hasattr(torch, "accelerator"):
        pytest.skip(f"torch {torch.__version__} has no torch.accelerator")
    monkeypatch.setattr(train_utils.distributed.devices, "cuda_available", lambda: False)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 2)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("xpu"))
    assert train_utils.device_for(1) == torch.device("xpu", 1)
    with pytest.raises(ConfigError, match="local rank 2 needs xpu device 2"):
        train_utils.device_for(2)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("mps"))
    assert train_utils.device_for(1) == torch.device("cpu")  # no backend for MPS: a Mac's CPU, with gloo


# --------------------------------------------------------------------------
# The tutorials' recipes, as docs/recipes.md gives them
# --------------------------------------------------------------------------

def documented_cifar10_commands() -> list:
    """The python/torchrun command lines of docs/recipes.md's ```bash blocks that
    train --dataset cifar10 (the sbatch lines pass the same flags to the wrappers)."""
    import re

    from walk import commands

    blocks = re.findall(r"```bash\n(.*?)```", (REPO / "docs" / "recipes.md").read_text(), re.S)
    return [command for block in blocks for command in commands(block)
            if "--dataset cifar10" in command and command.split()[0] in ("python", "torchrun")]


def test_the_seed_recipes_for_cifar10_run_as_documented(tmp_path):
    """Each documented CIFAR-10 command, as written but for one epoch, on CIFAR-10
    files in the real format (synthetic images; torchvision's md5 check of the
    official archive patched out for the processes of this test only)."""
    import shutil

    found = documented_cifar10_commands()
    assert found, "docs/recipes.md gives no python or torchrun command for --dataset cifar10"
    recipe_flags = ("--optimizer", "--lr", "--weight_decay", "--lr_schedule", "--warmup_epochs", "--amp")
    # The recipe flags are the kit's: a command that passes one runs train.py.
    assert [c for c in found if any(f in c.split() for f in recipe_flags) and "train.py" not in c] == []
    data = build_cifar10_root(tmp_path / "data", per_batch=64, n_test=20)  # 288 to train: 1 step of 128 per rank
    patch = tmp_path / "patch"
    patch.mkdir()
    (patch / "sitecustomize.py").write_text(
        "import os\nimport torchvision.datasets.cifar as cifar\n"
        "cifar.check_integrity = lambda fpath, md5=None: os.path.isfile(fpath)\n")
    work = tmp_path / "work"
    work.mkdir()
    for script in REPO.glob("*.py"):
        shutil.copy(script, work)
    shutil.copytree(REPO / "train_utils", work / "train_utils", ignore=shutil.ignore_patterns("__pycache__"))
    launcher = {"python": [sys.executable], "torchrun": TORCHRUN}
    for command in found:
        words = command.split()
        words[words.index("--total_epochs") + 1] = "1"
        result = check(run(launcher[words[0]] + words[1:], work, DATA_DIR=str(data), PYTHONPATH=str(patch),
                           MASTER_PORT=str(free_port())))
        assert len(epochs(result.stdout)) == 1 and "test | loss" in result.stdout, command


def test_the_tasks_identity_is_compared_whole_and_an_older_snapshots_sizes_by_name(tmp_path):
    """A task's identity (the GPT's shape) is saved with the run's config and
    compared whole: another vocabulary is refused by name. A snapshot from
    before identities were saved kept the GPT's sizes among its flags: those
    the identity names are compared (it has no vocabulary size to compare)."""
    gpt = {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 64}
    config = {"dataset": "shakespeare_char", "model": "gpt", "seed": 0, "batch_size": 12, "grad_accum_steps": 1,
              "optimizer": "adamw", "decay_params": "matrices", "total_epochs": 2}
    now = dict(config, task_identity=dict(gpt, vocab_size=65))
    older, newer = tmp_path / "older.pt", tmp_path / "newer.pt"
    torch.save({"config": {**config, **gpt}, "epochs_run": 1, "steps_run": 0}, older)
    torch.save({"config": now, "epochs_run": 1, "steps_run": 0}, newer)
    assert read_snapshot(str(older), now)["epochs_run"] == read_snapshot(str(newer), now)["epochs_run"] == 1
    with pytest.raises(ConfigError, match=r"different run \(n_layer 4 -> 6\)"):
        read_snapshot(str(older), dict(config, task_identity=dict(gpt, n_layer=6, vocab_size=65)))
    with pytest.raises(ConfigError, match=r"different run \(vocab_size 65 -> 50304\)"):
        read_snapshot(str(newer), dict(config, task_identity=dict(gpt, vocab_size=50304)))


def test_a_snapshot_holding_keys_no_part_reads_is_refused_in_one_line(tmp_path, one_process_group):
    """The Checkpointer loads each of the run's parts from its own keys; a
    snapshot holding others (another program's, a newer version's) is
    refused in one line before anything is loaded, and left as it is."""
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = train_utils.RunConfig(snapshot_path=str(tmp_path / "snapshot.pt"), total_epochs=3).as_dict()
    path = tmp_path / "snapshot.pt"
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "config": dict(config, world_size=1),
                "epochs_run": 1, "steps_run": 0, "epoch_samples": 0, "rng_states": [], "ema": {"decay": 0.99}}, path)
    before = path.read_bytes()

    class Position:
        KEYS = ("epochs_run", "steps_run", "epoch_samples", "rng_states")

        def state_dict(self):
            return {}

        def load_state_dict(self, snapshot):
            raise AssertionError("loaded despite a key no part reads")

    checkpointer = train_utils.Checkpointer(str(path), False, model, optimizer, config, {"position": Position()})
    checkpointer.find()
    with pytest.raises(ConfigError) as info:
        checkpointer.load()
    assert str(info.value) == (f"snapshot {path} holds ema, which this train.py does not read: a snapshot of "
                               f"another program or version; delete it or pass another --snapshot_path to start "
                               f"afresh")
    assert path.read_bytes() == before
