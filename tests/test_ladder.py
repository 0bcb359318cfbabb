"""The ladder's five rungs end to end, on the default synthetic task, each in a
copy of the repository without train_utils/ and train.py (the rungs stand
alone), launched the way its docstring says; rungs 2-5 print the losses the
kit prints for the same flags (the parity of tests/test_parity.py, here on
the synthetic task); rungs 3-5 also stopped and resumed from their
snapshots. Bad input gets one line and exit status 2."""

import ast
import shutil
import sys

import pytest
import torch

from helpers import REPO, TORCHRUN, check, epochs, error_lines, free_port, parse_test, run

RUNGS = ["singlegpu.py", "multigpu_spawn.py", "multigpu_torchrun.py", "multinode.py", "multinode_fsdp.py"]
SAVED = {"singlegpu.py": "checkpoint_singlegpu.pt", "multigpu_spawn.py": "checkpoint_multigpu_spawn.pt",
         "multigpu_torchrun.py": "snapshot_multigpu_torchrun.pt", "multinode.py": "snapshot_multinode.pt",
         "multinode_fsdp.py": "snapshot_multinode_fsdp"}
# What a rung may import: a few standard modules, torch, torchvision, tqdm, the task modules
# and what a recipe means (recipes.py).
ALLOWED = {"argparse", "os", "shutil", "socket", "sys", "time", "typing", "torch", "torchvision", "tqdm",
           "common", "vision_tasks", "fast_images", "text_tasks", "token_tasks", "gpt", "recipes"}
# Before torch 2.10, gloo's reduce_scatter sums where FSDP averages: on the CPU the FSDP rung
# needs torch 2.10 (docs/install.md), and is not run on an older one.
FSDP_TOO_OLD = not torch.cuda.is_available() and torch.__version__ < "2.10"


def launch(script: str, folder) -> tuple[list, dict]:
    """The command (and extra environment) that starts ``script`` of ``folder`` with 2 processes."""
    if script == "singlegpu.py":
        return [sys.executable, folder / script], {}
    if script == "multigpu_spawn.py":
        return [sys.executable, folder / script, "--world_size", "2"], {"MASTER_PORT": str(free_port())}
    return TORCHRUN + ["--standalone", "--nproc_per_node=2", folder / script], {}


@pytest.fixture(scope="module")
def standalone(tmp_path_factory):
    """The repository's top-level files without train.py and train_utils/: what a
    learner copies to run a rung."""
    folder = tmp_path_factory.mktemp("standalone")
    for path in REPO.glob("*.py"):
        if path.name != "train.py":
            shutil.copy(path, folder)
    assert not (folder / "train_utils").exists()
    return folder


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


@pytest.mark.parametrize("script", RUNGS)
def test_rung_trains_standalone_and_resumes(script, standalone, kit_run, tmp_path):
    """4 epochs saving every 3rd: the loss falls, one summary line per epoch, what
    was saved loads into a plain model; rungs 2-5 print, digit for digit, the
    losses train.py prints for the same flags (DDP, or FSDP for the FSDP rung).
    Rungs 3-5 run the 4 epochs as a newcomer does (the README's two commands):
    2 epochs, then the same command asking for 4 resumes after epoch 2, and
    the two runs' epochs are, digit for digit, the kit's uninterrupted run's."""
    cmd, env = launch(script, standalone)
    env["OMP_NUM_THREADS"] = "1"  # what torchrun sets for 2 processes (mp.spawn sets nothing), as for the kit
    folder = tmp_path / "run"
    folder.mkdir()
    if script == "multinode_fsdp.py" and FSDP_TOO_OLD:
        pytest.skip(f"torch {torch.__version__}: FSDP on the CPU (gloo) needs torch 2.10 (docs/install.md)")
    resumes = script not in ("singlegpu.py", "multigpu_spawn.py")
    if resumes:
        first = check(run(cmd + ["--total_epochs", "2", "--save_every", "3"], folder, **env))
        assert "resuming" not in first.stdout and first.stdout.count("test | loss") == 1
        runs = [first.stdout]
    else:
        runs = []
    result = check(run(cmd + ["--total_epochs", "4", "--save_every", "3"], folder, **env))
    runs.append(result.stdout)
    if resumes:
        assert "resuming from snapshot " in result.stdout and " after epoch 2" in result.stdout
    lines = [line for stdout in runs for line in epochs(stdout)]
    if script != "singlegpu.py":  # the kit never trains differently from the ladder
        strategy = "fsdp" if script == "multinode_fsdp.py" else "ddp"
        assert [loss for stdout in runs for loss in _losses(stdout)] == \
            _losses(kit_run(strategy, "--total_epochs", 4)[1])
    assert [int(e["epoch"]) for e in lines] == [1, 2, 3, 4], runs
    assert lines[-1]["train_loss"] < 0.2 * lines[0]["train_loss"]  # Var(y) ~ 1, noise floor 0.01
    assert lines[-1]["val_loss"] < 0.05 and parse_test(result.stdout)["loss"] < 0.05
    assert all(e["samples_per_s"] > 0 and e["epoch_s"] > 0 and e["lr"] == 0.05 for e in lines)
    assert result.stdout.count("test | loss") == 1  # rank 0 alone prints
    assert "epoch 3 | " in result.stdout and "epoch 4 | " in result.stdout  # saved every 3rd and after the last
    saved = folder / SAVED[script]
    if script == "multinode_fsdp.py":  # a folder per save; the older ones removed
        assert [p.name for p in saved.iterdir()] == ["epoch-4"]
        assert (saved / "epoch-4" / "meta.pt").exists()
    else:
        state = torch.load(saved, weights_only=True)
        import common
        common.synthetic_model("mlp").load_state_dict(state.get("model", state))  # no DDP prefix
    if script == "multinode.py":  # every rank says where it runs, once per epoch
        for rank in (0, 1):
            assert [stdout.count(f"[rank {rank} | local_rank {rank} | host ") for stdout in runs] == [2, 2]
        assert "] epoch 1 | batch_size 32 | steps 28" in runs[0]  # 1844 samples / 2 ranks / 32
    if script in ("singlegpu.py", "multigpu_spawn.py", "multinode.py"):
        return  # multinode.py's snapshot code is multigpu_torchrun.py's, checked below
    # The snapshot holds another model than the one asked for: loading it fails before any
    # training, and the file is kept (train.py names what differs; a rung leaves that to torch).
    kept = sorted((p.relative_to(folder), p.read_bytes()) for p in folder.rglob("*") if p.is_file())
    other = run(cmd + ["--total_epochs", "4", "--model", "linear"], folder, **env)
    assert other.returncode != 0 and epochs(other.stdout) == [], other.stderr
    assert sorted((p.relative_to(folder), p.read_bytes()) for p in folder.rglob("*") if p.is_file()) == kept
    if script == "multigpu_torchrun.py":  # all 4 epochs held already: it resumes after epoch 4, trains none
        again = check(run(cmd + ["--total_epochs", "4"], folder, **env))
        assert f"resuming from snapshot {SAVED[script]} after epoch 4" in again.stdout and epochs(again.stdout) == []


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
