"""The ladder's five rungs end to end, on the default synthetic task, as the
README's steps run them (the newcomer's walk, tests/walk.py, runs each
step's block as written, in the one folder a newcomer uses): each trains,
prints a line per epoch and the test split's once, and saves what a plain
model loads; rungs 2-5 print, digit for digit, the losses the kit prints for
the same flags (the parity of tests/test_parity.py, here on the synthetic
task); rungs 3 and 5 are stopped after their first command and resumed by the
second. A rung needs no kit: its imports (here), its files (the README's list
to copy: tests/test_start_and_stop.py). Bad input gets one line and exit
status 2."""

import ast
import re
import shutil
import sys

import pytest
import torch

from helpers import REPO, TORCHRUN, epochs, error_lines, parse_test, run
from walk import commands

RUNGS = ["singlegpu.py", "multigpu_spawn.py", "multigpu_torchrun.py", "multinode.py", "multinode_fsdp.py"]
SAVED = {"singlegpu.py": "checkpoint_singlegpu.pt", "multigpu_spawn.py": "checkpoint_multigpu_spawn.pt",
         "multigpu_torchrun.py": "snapshot_multigpu_torchrun.pt", "multinode.py": "snapshot_multinode.pt",
         "multinode_fsdp.py": "snapshot_multinode_fsdp"}
# What a rung may import: a few standard modules, torch, torchvision, tqdm, the task modules
# and what a recipe means (recipes.py).
ALLOWED = {"argparse", "os", "shutil", "socket", "sys", "time", "typing", "torch", "torchvision", "tqdm",
           "common", "vision_tasks", "fast_images", "text_tasks", "token_tasks", "gpt", "recipes"}
# Before torch 2.10, gloo's reduce_scatter sums where FSDP averages: on the CPU the FSDP rung
# needs torch 2.10 (docs/install.md), and refuses an older one in one line.
FSDP_TOO_OLD = not torch.cuda.is_available() and torch.__version__ < "2.10"
# The kit's runs the rungs' losses are compared with (conftest's kit_run, which other tests share):
# the README's steps train at most 4 epochs of DDP and 2 of FSDP.
KIT_EPOCHS = {"ddp": 4, "fsdp": 2}


@pytest.mark.parametrize("script", RUNGS)
def test_rung_imports_no_training_machinery(script):
    tree = ast.parse((REPO / script).read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported <= ALLOWED, imported - ALLOWED


def _losses(stdout: str) -> list[tuple[str, str]]:
    """(train_loss, val_loss) of each epoch line, as printed."""
    return [(line.split("train_loss ")[1].split(" ")[0], line.split("val_loss ")[1].split(" ")[0])
            for line in stdout.splitlines() if line.startswith("epoch ") and "train_loss" in line]


def readme_step(script: str) -> tuple:
    """(number of the README's ```bash block, its commands) of the step that runs ``script``."""
    readme = (REPO / "README.md").read_text()
    for number, block in enumerate(re.findall(r"```bash\n(.*?)```", readme, re.S)):
        if number and re.search(rf"(?:^|\s){re.escape(script)}(?:\s|$)", block, re.M):
            return number, commands(block)
    raise AssertionError(f"no README step runs {script}")


def runs_of(stdout: str) -> list:
    """A block's output cut into its runs: each run prints its epochs and then its
    test line (a resumed run that has nothing left prints neither)."""
    ends = [match.end() for match in re.finditer(r"^test \| loss .*$", stdout, re.M)]
    return [stdout[start:end] for start, end in zip([0, *ends], ends)]


@pytest.mark.parametrize("script", RUNGS)
def test_rung_trains_resumes_and_prints_the_kits_losses(script, newcomer_walk, kit_run, tmp_path):
    """The README step's commands as a newcomer runs them: the loss falls, one
    summary line per epoch (rank 0 prints), the test split's line once a run,
    a save every --save_every epochs and after the last, and what was saved
    loads into a plain model (the FSDP rung: a folder per save, the older
    ones removed). Rungs 2-5 print, digit for digit, the losses train.py
    prints for the same flags (DDP, or FSDP for the FSDP rung) never stopped;
    where the step is two commands (rungs 3 and 5), the second resumes after
    the first's last epoch, and the two runs' epochs are the kit's
    uninterrupted run's: the rung resumes exactly. On the CPU before torch
    2.10, the FSDP rung refuses in one line instead of training with
    gradients world_size times too large."""
    if script == "multinode_fsdp.py" and FSDP_TOO_OLD:
        refused = run(TORCHRUN + ["--standalone", "--nproc_per_node=2", REPO / script], tmp_path)
        assert refused.returncode != 0 and error_lines(refused.stderr) == [
            "error: FSDP on the CPU (gloo) needs torch 2.10 or newer (docs/install.md)"], refused.stderr
        assert epochs(refused.stdout) == []
        return
    number, steps = readme_step(script)
    block = newcomer_walk.block("README.md", number)
    launches = list(dict.fromkeys(command.rstrip(" &") for command in steps if script in command))  # nodes: one
    totals = [int(re.search(r"--total_epochs (\d+)", command).group(1)) if "--total_epochs" in command else 10
              for command in launches]
    runs = runs_of(block.stdout)
    assert len(runs) == len(launches), block.stdout
    lines = [line for stdout in runs for line in epochs(stdout)]
    assert [int(e["epoch"]) for e in lines] == list(range(1, totals[-1] + 1)), block.stdout
    if len(totals) > 1:  # the second command resumes where the first saved
        assert "resuming" not in runs[0] and f"resuming from snapshot {SAVED[script]}" in runs[1], runs
        assert f" after epoch {totals[0]}" in runs[1]
    assert lines[-1]["train_loss"] < 0.2 * lines[0]["train_loss"]  # Var(y) ~ 1, noise floor 0.01
    assert lines[-1]["val_loss"] < 0.05 and parse_test(runs[-1])["loss"] < 0.05
    assert all(e["samples_per_s"] > 0 and e["epoch_s"] > 0 and e["lr"] == 0.05 for e in lines)
    assert all(stdout.count("test | loss") == 1 for stdout in runs)  # rank 0 alone prints
    saves = [int(epoch) for epoch in re.findall(r"^epoch (\d+) \| (?:checkpoint|snapshot) saved", block.stdout,
                                                re.M)]
    every = 5  # --save_every's default
    assert saves == [epoch for epoch in range(1, totals[-1] + 1) if epoch % every == 0 or epoch in totals], saves
    saved = newcomer_walk.saved("README.md", number, SAVED[script])
    if script == "multinode_fsdp.py":  # a folder per save; the older ones removed
        assert [p.name for p in saved.iterdir()] == [f"epoch-{totals[-1]}"]
        assert (saved / f"epoch-{totals[-1]}" / "meta.pt").exists()
    else:
        state = torch.load(saved, weights_only=True)
        import common
        common.synthetic_model("mlp").load_state_dict(state.get("model", state))  # no DDP prefix
    if script == "multinode.py":  # every rank says where it runs, once per epoch; global rank 0 prints
        for rank in (0, 1):
            assert block.stdout.count(f"[rank {rank} | local_rank 0 | host ") == totals[-1]
        assert "] epoch 1 | batch_size 32 | steps 28" in block.stdout  # 1844 samples / 2 ranks / 32
    if script != "singlegpu.py":  # the kit never trains differently from the ladder
        strategy = "fsdp" if script == "multinode_fsdp.py" else "ddp"
        kit = _losses(kit_run(strategy, "--total_epochs", KIT_EPOCHS[strategy])[1])
        rung = [loss for stdout in runs for loss in _losses(stdout)]
        assert rung == kit[:len(rung)]


@pytest.mark.parametrize("script", ["multigpu_torchrun.py", "multinode_fsdp.py"])
def test_a_snapshot_of_another_model_fails_before_training_and_is_kept(script, newcomer_walk, tmp_path):
    """The step's snapshot resumed with --model linear: the load fails before any
    epoch is trained and every saved file is left as it was (the kit names what
    differs in one line; a rung leaves that to torch)."""
    if script == "multinode_fsdp.py" and FSDP_TOO_OLD:
        pytest.skip(f"torch {torch.__version__}: FSDP on the CPU (gloo) needs torch 2.10 (docs/install.md)")
    number, _ = readme_step(script)
    saved = newcomer_walk.saved("README.md", number, SAVED[script])
    copy = shutil.copytree if saved.is_dir() else shutil.copy
    copy(saved, tmp_path / SAVED[script])
    kept = sorted((p.relative_to(tmp_path), p.read_bytes()) for p in tmp_path.rglob("*") if p.is_file())
    other = run(TORCHRUN + ["--standalone", "--nproc_per_node=2", REPO / script, "--total_epochs", "6",
                            "--model", "linear"], tmp_path)
    assert other.returncode != 0 and epochs(other.stdout) == [], other.stderr
    assert sorted((p.relative_to(tmp_path), p.read_bytes()) for p in tmp_path.rglob("*") if p.is_file()) == kept


def test_torchrun_rung_refuses_plain_python(tmp_path):
    result = run([sys.executable, REPO / "multigpu_torchrun.py"], tmp_path)
    assert result.returncode == 1
    assert result.stderr.strip() == (f"error: start {REPO / 'multigpu_torchrun.py'} with torchrun, "
                                     f"as the launch lines at its top show")


@pytest.mark.parametrize("flags, message", [
    (["--total_epochs", "0"], "--total_epochs: must be > 0"),
    (["--batch_size", "-4"], "--batch_size: must be > 0"),
    (["--save_every", "x"], "--save_every: invalid positive value: 'x'"),
])
def test_bad_flags_give_usage_error(flags, message, tmp_path):
    result = run([sys.executable, REPO / "singlegpu.py"] + flags, tmp_path)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("flags, message", [
    (["--model", "resnet18"], "error: --model resnet18 is not available for --dataset synthetic; "
                              "choose one of mlp, linear"),
    (["--batch_size", "5000"], "error: --batch_size 5000 leaves no full batch to train; lower it"),
    (["--dataset", "imagenet"], "error: --dataset imagenet: cannot load task function ''"),
])
def test_bad_input_is_one_line(flags, message, tmp_path):
    result = run([sys.executable, REPO / "singlegpu.py"] + flags, tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().startswith(message) and "\n" not in result.stderr.strip(), result.stderr
    assert not (tmp_path / "checkpoint_singlegpu.pt").exists()


def test_missing_dataset_names_folder_files_and_fix(tmp_path):
    """No network here: the download fails on rank 0, which says why in one line;
    torchrun stops the rank waiting for it."""
    result = run(TORCHRUN + ["--standalone", "--nproc_per_node=2", REPO / "multigpu_torchrun.py",
                             "--dataset", "mnist", "--data_dir", tmp_path / "nothing"], tmp_path,
                 timeout=120)
    assert result.returncode != 0
    errors = error_lines(result.stderr)
    assert len(errors) == 1, result.stderr
    assert str(tmp_path / "nothing" / "MNIST" / "raw") in errors[0]
    assert "train-images-idx3-ubyte" in errors[0] and "Pre-stage" in errors[0]
    assert "Traceback (most recent call last)" not in result.stderr.split("error: ")[0]


def test_spawn_with_more_processes_than_gpus_is_one_line(monkeypatch, capsys):
    """multigpu_spawn.py --world_size 2 on a machine with one GPU (torch's
    answers stood in): one line, before any process starts."""
    import runpy

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(sys, "argv", ["multigpu_spawn.py", "--world_size", "2"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(REPO / "multigpu_spawn.py"), run_name="__main__")
    assert exit_.value.code == "error: --world_size 2 is more processes than this machine's 1 GPUs; pass at most 1"
