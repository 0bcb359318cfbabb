"""The language model on the real corpus: --dataset shakespeare_char (text_tasks.py:
nanoGPT's split, the vocabulary, the windows, the md5-checked download), the GPT
(gpt.py: shapes, weight tying, GPT-2's initialisation, causality), the
recipe LM training uses (decay on matrices only, AdamW's betas, warm-up in steps,
cosine to a minimum: nanoGPT's get_lr), --max_steps in the kit, stopped by SIGTERM
and resumed bitwise, and a rung training the GPT with the task's recipe."""

import argparse
import dataclasses
import hashlib
import io
import json
import math
import re
import shutil
import signal
import urllib.error

import pytest
import torch

import common
import recipes
import gpt
import text_tasks
from dataset_files import build_shakespeare_root, require_tinyshakespeare
from helpers import (FAULTY_TRAIN, REPO, PODS, TORCHRUN, check, epochs, evaluations, run, signal_when, snapshot_tensors,
                     stdout_lines, task_args, tiny_gpt_run)

TINY = ["--n_layer", "1", "--n_head", "2", "--n_embd", "32", "--block_size", "16"]


def lm_args(data_dir, **flags) -> argparse.Namespace:
    """What train.py passes common.load_task for --dataset shakespeare_char, no recipe flag given."""
    return task_args("shakespeare_char", data_dir, **{**{name: None for name in recipes.RECIPE_DEFAULTS}, **flags})


# --------------------------------------------------------------------------
# The task: split, vocabulary, windows, the recipe's defaults; the corpus missing
# --------------------------------------------------------------------------

def test_split_vocabulary_and_windows_are_nanogpts(tmp_path):
    """65 characters, sorted, as nanoGPT numbers them; the first 90% trains, the
    last 10% is held out (validation; no test set); windows of block_size characters
    tile the held-out part; training windows start a random 0..T-1 characters
    later (torch's generator: seeded, reproducible), y the next characters of x;
    the defaults are nanoGPT's CPU recipe."""
    text = require_tinyshakespeare().read_text(encoding="utf-8")
    args = lm_args(build_shakespeare_root(tmp_path))
    task = common.load_task(args, download=False)
    recipes.set_recipe_flags(args, task.recipe)  # as every script does after loading the task
    assert len(text) == 1115394 and task.decode(range(65)) == "".join(sorted(set(text)))
    split, T = int(len(text) * 0.9), 64  # nanoGPT's prepare.py: data[:int(n*0.9)]
    assert len(task.train_set) == (split - T) // T == 15684 and len(task.val_set) == (len(text) - split - 1) // T
    last = len(task.train_set) - 1
    torch.manual_seed(0)
    x, y = task.train_set.__getitems__([0, 5, last])
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (3, T)
    shifts = []
    for row, i in enumerate((0, 5, last)):
        start = next(i * T + r for r in range(T) if task.decode(x[row]) == text[i * T + r:i * T + r + T])
        assert task.decode(y[row]) == text[start + 1:start + T + 1]
        shifts.append(start - i * T)
    assert (last + 1) * T + T <= split  # no training window reaches into the held-out text
    torch.manual_seed(0)
    assert torch.equal(task.train_set.__getitems__([0, 5, last])[0], x)  # drawn from torch's generator
    draws = {tuple(task.train_set.__getitems__([5])[0][0, :4].tolist()) for _ in range(20)}
    assert len(draws) > 5 and len(set(shifts)) > 1  # a window starts anywhere in its block
    for i in (0, 7):  # held out: the windows tile the text
        assert task.decode(task.val_set[i][0]) == text[split + i * T:split + (i + 1) * T]
    assert task.test_set is None and task.decode(task.encode(text[:2000])) == text[:2000]
    assert task.tokens_per_sample == T and not task.classification
    with pytest.raises(common.ConfigError, match=r"the character '\\x00' is not in the vocabulary"):
        task.encode("\x00")
    recipe = (args.optimizer, args.lr, args.beta1, args.beta2, args.weight_decay, args.decay_params, args.lr_schedule,
              args.min_lr, args.warmup_steps, args.max_steps, args.clip_grad_norm, args.batch_size)
    assert recipe == ("adamw", 1e-3, 0.9, 0.99, 0.1, "matrices", "cosine", 1e-4, 100, 2000, 1.0, 12)
    config = task.model.config
    assert (args.model, config.n_layer, config.n_head, config.n_embd, config.block_size, config.dropout) == \
        ("gpt", 4, 4, 128, 64, 0.0)
    assert task.identity == {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 64, "vocab_size": 65}
    assert task.model.num_parameters(embeddings=False) == 795904  # nanoGPT prints "0.80M" for this model
    with pytest.raises(common.ConfigError, match="n_embd 30 is not a multiple of n_head 4"):
        common.load_task(lm_args(tmp_path, n_embd=30), download=False)


def test_missing_corpus_is_one_line_and_the_download_is_md5_checked(tmp_path, monkeypatch):
    """Offline: one line naming the file, its size and md5. A failed download, or
    one whose md5 is not the corpus's, says so in one line and leaves no file; the
    corpus's bytes are kept and trained on."""
    corpus = require_tinyshakespeare().read_bytes()
    assert hashlib.md5(corpus).hexdigest() == text_tasks.SHAKESPEARE_MD5
    target = tmp_path / "shakespeare_char" / "input.txt"
    with pytest.raises(common.ConfigError) as info:
        common.load_task(lm_args(tmp_path), download=False)
    assert "\n" not in str(info.value) and str(target) in str(info.value)
    assert "1,115,394 bytes, md5 6fb458f1232090904fb40fe944165e91" in str(info.value)
    asked = []

    def serve(body):
        def urlopen(url, timeout):
            asked.append(url)
            if body is None:
                raise urllib.error.URLError("Temporary failure in name resolution")
            return io.BytesIO(body)
        return urlopen

    for body, error in ((None, "could not download Tiny Shakespeare from .* name resolution"),
                        (corpus[:-1], "has md5 [0-9a-f]{32}, not 6fb458f1232090904fb40fe944165e91")):
        monkeypatch.setattr(text_tasks.urllib.request, "urlopen", serve(body))
        with pytest.raises(common.ConfigError, match=error) as info:
            common.load_task(lm_args(tmp_path), download=True)
        assert "\n" not in str(info.value) and "put the file there by hand" in str(info.value)
        assert list(target.parent.iterdir()) == []
    monkeypatch.setattr(text_tasks.urllib.request, "urlopen", serve(corpus))
    assert len(common.load_task(lm_args(tmp_path), download=True).train_set) == 15684
    assert target.read_bytes() == corpus and asked == [text_tasks.SHAKESPEARE_URL] * 3


# --------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------

def test_gpt_shapes_tying_initialisation_and_causality():
    torch.manual_seed(0)
    V, T, L, C = 65, 16, 2, 64
    model = gpt.GPT(gpt.GPTConfig(vocab_size=V, block_size=T, n_layer=L, n_head=4, n_embd=C, bias=True))
    idx = torch.randint(0, V, (3, T))
    logits = model(idx)
    assert logits.shape == (3, T, V) and logits.dtype == torch.float32
    assert model.lm_head.weight is model.wte.weight and isinstance(model.blocks[0], gpt.Block)
    per_block = 2 * 2 * C + (C * 3 * C + 3 * C) + (C * C + C) + (C * 4 * C + 4 * C) + (4 * C * C + C)
    assert model.num_parameters() == V * C + T * C + L * per_block + 2 * C  # the tied weight once
    assert model.num_parameters(embeddings=False) == model.num_parameters() - T * C
    weights = dict(model.named_parameters())
    assert abs(weights["blocks.0.attn.c_attn.weight"].std().item() - 0.02) < 0.002
    assert abs(weights["wte.weight"].std().item() - 0.02) < 0.002
    for name in ("blocks.0.attn.c_proj.weight", "blocks.1.mlp.c_proj.weight"):  # 0.02 / sqrt(2 n_layer)
        assert abs(weights[name].std().item() - 0.01) < 0.001, name
    assert all(not p.any() for name, p in weights.items() if name.endswith("bias"))
    assert torch.equal(weights["blocks.0.ln_1.weight"], torch.ones(C))
    changed = idx.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % V  # the future of position 9 changes, its logits must not
    after = model(changed)
    assert torch.allclose(after[:, :10], logits[:, :10], atol=1e-6) and not torch.allclose(after[:, 10], logits[:, 10])
    with pytest.raises(ValueError, match="longer than block_size 16"):
        model(torch.zeros(1, T + 1, dtype=torch.int64))
    with pytest.raises(common.ConfigError, match="n_embd 30 is not a multiple of n_head 4"):
        gpt.GPT(gpt.GPTConfig(vocab_size=V, block_size=T, n_layer=1, n_head=4, n_embd=30))


def test_gpt_sizes_are_one_config_checked_where_it_is_made(tmp_path):
    """GPTConfig has nanoGPT's fields, in its order, and its defaults (GPT-2
    small's shape; no biases). A bad size is one ConfigError line, the same
    whether code or train.py's flags give it, and the flags' are refused
    before the corpus is read (there is none at tmp_path)."""
    fields = [(field.name, field.default) for field in dataclasses.fields(gpt.GPTConfig)]
    assert fields == [("block_size", 1024), ("vocab_size", 50304), ("n_layer", 12), ("n_head", 12),
                      ("n_embd", 768), ("dropout", 0.0), ("bias", False)]
    for sizes, error in ((dict(n_layer=0, block_size=0), "the GPT's sizes must be 1 or more: n_layer 0, block_size 0"),
                         (dict(n_embd=30, n_head=12), "n_embd 30 is not a multiple of n_head 12"),
                         (dict(dropout=1.0), r"dropout 1.0 is outside \[0, 1\)")):
        with pytest.raises(common.ConfigError, match=error) as info:
            gpt.GPTConfig(**sizes)
        assert "\n" not in str(info.value)
        with pytest.raises(common.ConfigError, match=error):
            common.load_task(lm_args(tmp_path, **sizes), download=False)


# --------------------------------------------------------------------------
# The recipe: decay on matrices only, AdamW's betas, warm-up steps, cosine to min_lr
# --------------------------------------------------------------------------

def recipe_args(**flags) -> argparse.Namespace:
    return argparse.Namespace(**{**recipes.RECIPE_DEFAULTS, **text_tasks.SHAKESPEARE_RECIPE, "total_epochs": 1,
                                 **flags})


def nanogpt_lr(it: int, lr=1e-3, min_lr=1e-4, warmup=100, decay_iters=2000) -> float:
    """nanoGPT's train.py get_lr after the warm-up (its cosine to min_lr)."""
    if it > decay_iters:
        return min_lr
    coeff = 0.5 * (1.0 + math.cos(math.pi * (it - warmup) / (decay_iters - warmup)))
    return min_lr + coeff * (lr - min_lr)


def test_lm_recipe_decays_matrices_only_and_follows_nanogpts_schedule():
    model = gpt.GPT(gpt.GPTConfig(vocab_size=65, block_size=16, n_layer=2, n_head=2, n_embd=32, bias=True))
    optimizer = recipes.build_optimizer(model, recipe_args())
    names = {id(p): name for name, p in model.named_parameters()}
    decayed, kept = ({names[id(p)] for p in group["params"]} for group in optimizer.param_groups)
    assert type(optimizer) is torch.optim.AdamW and len(optimizer.param_groups) == 2
    assert decayed == {"wte.weight", "wpe.weight"} | {f"blocks.{i}.{part}.weight" for i in range(2) for part in
                                                      ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")}
    assert kept and all(name.endswith("bias") or ".ln_" in name or name.startswith("ln_f") for name in kept)
    assert [(g["weight_decay"], g["betas"]) for g in optimizer.param_groups] == [(0.1, (0.9, 0.99)), (0.0, (0.9, 0.99))]
    assert len(decayed) + len(kept) == len(list(model.parameters()))  # the tied weight once
    assert len(recipes.build_optimizer(model, recipe_args(decay_params="all")).param_groups) == 1  # the others' recipe
    factor = recipes.lr_factor(recipe_args(), steps_per_epoch=1307)  # max_steps, not epochs, sets the horizon
    assert [factor(k) for k in range(100)] == [(k + 1) / 100 for k in range(100)]
    assert [1e-3 * factor(k) for k in range(100, 2200)] == pytest.approx([nanogpt_lr(k) for k in range(100, 2200)],
                                                                         rel=1e-12)
    with pytest.raises(common.ConfigError, match="give the warm-up in one of them"):
        recipes.lr_factor(recipe_args(warmup_epochs=0.5), 1307)
    with pytest.raises(common.ConfigError, match="--min_lr 0.002 is above --lr 0.001"):
        recipes.lr_factor(recipe_args(min_lr=0.002), 1307)


# --------------------------------------------------------------------------
# The kit: --max_steps, stopped by SIGTERM, resumed bitwise; a rung trains the GPT
# --------------------------------------------------------------------------

def test_max_steps_run_stopped_in_its_last_epoch_resumes_bitwise_with_other_workers_and_extends(
        kit_run, tiny_corpus, tmp_path):
    """train.py, 2 ranks, a tiny GPT with dropout on the corpus's first 20,000
    characters and the task's recipe (AdamW, warm-up, cosine to min_lr,
    clipping), evaluated every 25 steps: --max_steps 80 is 70 steps of epoch 1
    and 10 of epoch 2 (helpers.tiny_gpt_run; the uninterrupted run loads
    without workers). SIGTERM in epoch 2 to the same command with 2 loader
    workers; resumed with 4, it ends bitwise equal to the uninterrupted run
    (weights, AdamW's moments, the schedule, every rank's RNG state), each
    evaluation line printed once and as it printed: the windows' offsets and
    the dropout masks are keyed by sample, not by worker. The finished run
    then extends to --max_steps 150: epoch 2 goes on from step 80, the
    cosine over 150 steps."""
    straight_dir, straight = kit_run("ddp", *tiny_gpt_run("shakespeare_char", tiny_corpus["shakespeare_char"]))
    flags = ["--strategy", "ddp", *tiny_gpt_run("shakespeare_char", tiny_corpus["shakespeare_char"])]
    launch = PODS + ["--nproc_per_node=2", REPO / "train.py", *flags]
    held = PODS + ["--nproc_per_node=2", FAULTY_TRAIN, *flags]  # held by DDP_TEST_FAULT
    records = [json.loads(line) for line in (straight_dir / "metrics.jsonl").read_text().splitlines()]
    evaluated = [r for r in records if "val_loss" in r]
    assert [(r["step"], r["epoch"]) for r in evaluated] == [(25, 1), (50, 1), (75, 2), (80, 2)]
    assert evaluated[-1]["lr"] == pytest.approx(1e-4 + 0.5 * (1 + math.cos(math.pi * 69 / 70)) * 9e-4)  # step 80's
    assert evaluated[-1]["val_loss"] < 3.5 < math.log(65)  # it learns (a uniform guess: ln 65 = 4.17 nats/char)
    # Rank 0's epoch line gives the steps each epoch runs: epoch 2's 10 of its 70.
    assert "epoch 1 | batch_size 8 | steps 70" in stdout_lines(straight)
    assert "epoch 2 | batch_size 8 | steps 10" in stdout_lines(straight), straight
    text = signal_when([*held, "--num_workers", "2"], tmp_path, "DDP_TEST_FAULT: wait_signal at step 75",
                       signal.SIGTERM, DDP_TEST_FAULT="step:*:75:wait_signal")
    assert text.count("stopped by SIGTERM") == 1 and "step 80/80" not in text, text  # stopped, not finished
    resumed = check(run([*launch, "--num_workers", "4"], tmp_path))
    assert re.search(r"resuming from snapshot snapshot_train.pt in epoch 2 after step [56]\b", resumed.stdout)
    assert evaluations(text) + evaluations(resumed.stdout) == evaluations(straight)
    steps_a, a = snapshot_tensors(straight_dir / "snapshot_train.pt", rng=True)
    steps_b, b = snapshot_tensors(tmp_path / "snapshot_train.pt", rng=True)
    # Both stand inside epoch 2 (10 of its 70 steps): one epoch done.
    assert steps_a == steps_b == 1 and a["lr_schedule.step"].item() == 80 and a.keys() == b.keys()
    assert [name for name in a if not torch.equal(a[name], b[name])] == []
    assert "test | loss" not in straight + resumed.stdout  # no test split: no test line
    # The finished run extends: epoch 2 goes on from step 80, the cosine now over 150 steps.
    longer_dir = tmp_path / "longer"
    longer_dir.mkdir()
    shutil.copy(straight_dir / "snapshot_train.pt", longer_dir)
    longer = check(run([*launch, "--max_steps", "150"], longer_dir))
    assert "recipe changed at resume (total_epochs 2 -> 3, max_steps 80 -> 150): the cosine schedule now runs " \
           "to epoch 3" in longer.stdout, longer.stdout
    assert "resuming from snapshot snapshot_train.pt in epoch 2 after step 10\n" in longer.stdout
    assert "epoch 2 | batch_size 8 | steps 60" in stdout_lines(longer.stdout) and \
        "epoch 3 | batch_size 8 | steps 10" in stdout_lines(longer.stdout)  # epoch 2's last 60 steps, then 10 of epoch 3
    later = evaluations(longer.stdout)
    assert [(e["step"], e["epoch"]) for e in later] == [("100", "2"), ("125", "2"), ("150", "3")]
    assert float(later[-1]["lr"]) == pytest.approx(1e-4 + 0.5 * (1 + math.cos(math.pi * 139 / 140)) * 9e-4,
                                                   rel=1e-4)  # step 150's, as printed


def test_a_rung_trains_the_gpt_with_the_tasks_recipe(tmp_path):
    """multigpu_torchrun.py, 2 ranks: --dataset shakespeare_char (a task file sizing
    it down, the corpus's first 20,000 characters) trains with the task's AdamW and
    warm-up-then-cosine schedule; the loss falls from ln 65 (4.17 nats/char)."""
    data = build_shakespeare_root(tmp_path / "data", chars=20000)
    (tmp_path / "tiny_lm.py").write_text(
        "import text_tasks\n"
        "def task(args, download):\n"
        "    args.n_layer, args.n_head, args.n_embd, args.block_size = 1, 2, 32, 16\n"
        "    task = text_tasks.shakespeare_char_task(args, download)\n"
        "    task.recipe.update(warmup_steps=10, max_steps=140)  # the schedule over these 2 epochs\n"
        "    return task\n")
    result = check(run(TORCHRUN + ["--standalone", "--nproc_per_node=2", REPO / "multigpu_torchrun.py",
                                   "--dataset", "tiny_lm.py:task", "--data_dir", data, "--total_epochs", "2",
                                   "--batch_size", "8"],
                       tmp_path))
    lines = epochs(result.stdout)  # 1,124 windows / 2 ranks / 8 per batch: 70 steps an epoch
    assert [e["epoch"] for e in lines] == [1, 2]
    assert [e["lr"] for e in lines] == pytest.approx([1e-4 + 0.5 * (1 + math.cos(math.pi * (k - 10) / 130)) * 9e-4
                                                      for k in (69, 139)], rel=1e-5)  # 6 digits shown
    assert lines[0]["train_loss"] < 4.0 and lines[1]["val_loss"] < 3.4
    assert "test | loss" not in result.stdout  # the task holds no test split
