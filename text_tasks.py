"""The built-in language-model task, shakespeare_char: a character-level GPT on Tiny Shakespeare.

A task module like yours (docs/custom-task.md): ``common.TASKS`` names its
function as ``"text_tasks:shakespeare_char_task"``, and ``common.load_task``
imports it the way it imports ``--dataset my_module:my_task``.

  shakespeare_char  the 1,115,394 characters of Tiny Shakespeare (karpathy/char-rnn),
                    each character a token (65 of them); the first 90% to train,
                    the last 10% held out to validate, nanoGPT's split (no test
                    set); a ``gpt.GPT``; the cross-entropy in nats per character;
                    nanoGPT's CPU recipe.

Reads ``shakespeare_char/input.txt`` under ``--data_dir``; with ``download``
(local rank 0 first, ``train_utils.downloaders_first``) it fetches a missing
file from karpathy/char-rnn and checks its md5. See docs/language-model.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import socket
import urllib.request
from typing import Sequence

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from common import Batch, ConfigError, Task, choose_model
from gpt import GPT, GPTConfig

SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
SHAKESPEARE_MD5 = "6fb458f1232090904fb40fe944165e91"
SHAKESPEARE_BYTES = 1115394
TRAIN_FRACTION = 0.9  # the first 90% of the text trains, the last 10% is held out (nanoGPT's split)
# --model: the models this module's task function accepts (common.task_models).
MODELS = {"shakespeare_char_task": ("gpt",)}

# The model's sizes (the --n_layer ... --dropout flags) and the recipe where no flag
# says otherwise: nanoGPT's CPU recipe for this corpus (its README, "I only have a
# macbook"): 4 layers, 4 heads, 128 wide, a 64-character context, batch 12, no
# dropout; AdamW lr 1e-3, betas (0.9, 0.99), weight decay 0.1 on matrices only,
# 100 warm-up steps, cosine to 1e-4 at step 2,000, gradients clipped to norm 1.
# vocab_size: the corpus's 65 characters; the task sets that of the text it reads.
SHAKESPEARE_MODEL = GPTConfig(block_size=64, vocab_size=65, n_layer=4, n_head=4, n_embd=128, dropout=0.0)
SIZE_FLAGS = ("n_layer", "n_head", "n_embd", "block_size", "dropout")  # the GPTConfig fields train.py's flags set
SHAKESPEARE_RECIPE = {"optimizer": "adamw", "lr": 1e-3, "beta1": 0.9, "beta2": 0.99, "weight_decay": 0.1,
                      "decay_params": "matrices", "lr_schedule": "cosine", "min_lr": 1e-4,
                      "warmup_steps": 100, "max_steps": 2000, "clip_grad_norm": 1.0, "batch_size": 12,
                      "log_every_steps": 100}


class CharVocabulary:
    """Characters <-> token ids: the sorted set of a text's characters, id i
    the i-th of them (nanoGPT's ``shakespeare_char/prepare.py`` numbering, so
    the ids are its ids). ``chars``: that string; ``len()``: the vocabulary size."""

    def __init__(self, text: str) -> None:
        self.chars = "".join(sorted(set(text)))
        self._ids = {char: i for i, char in enumerate(self.chars)}

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``. Raises ConfigError (one line) for a character not in the vocabulary."""
        try:
            return [self._ids[char] for char in text]
        except KeyError as exc:
            raise ConfigError(f"the character {exc.args[0]!r} is not in the vocabulary "
                              f"({len(self)} characters of the training text)") from None

    def decode(self, ids: Sequence[int]) -> str:
        """The text of token ids ``ids`` (ints, or a 1-D integer tensor)."""
        return "".join(self.chars[int(i)] for i in ids)


class CharWindows(Dataset):
    """(context, next characters) windows of a token sequence: item i is
    (x, y), both int64 (block_size,), x = tokens[s : s + block_size] and y =
    tokens[s + 1 : s + block_size + 1] (y[t] is the character after x[t]).

    Held out (``shift=False``): s = i x block_size, so the windows tile the
    sequence without overlap and every character but the last few is a
    target exactly once. Training (``shift=True``): s = i x block_size + r,
    r drawn uniformly from [0, block_size) for each item at each fetch, from
    torch's default generator (as torchvision's RandomCrop draws its crops;
    the kit's snapshots save that generator's state, so a resumed run draws
    the same): an epoch still covers the text once on average, but a window
    starts at any character, as nanoGPT's random offsets do, instead of the
    same len() windows every epoch, which a model of some millions of
    parameters learns by heart within a few epochs. ``__getitems__`` cuts a
    whole batch in one indexing op, returning ``common.Batch((x, y))``,
    int64 (B, block_size) each. Raises ConfigError when ``tokens`` (int64
    (N,)) is too short for one window.
    """

    def __init__(self, tokens: torch.Tensor, block_size: int, shift: bool = False) -> None:
        if len(tokens) < block_size + 1 + (block_size - 1 if shift else 0):
            raise ConfigError(f"a text of {len(tokens)} characters is too short for one window of "
                              f"--block_size {block_size} (+1 for the targets); pass a smaller --block_size")
        self.tokens, self.block_size, self.shift = tokens, block_size, shift
        self._offsets = torch.arange(block_size + 1)

    def __len__(self) -> int:  # with shift, the last window may start block_size - 1 later
        return (len(self.tokens) - 1 - (self.block_size - 1 if self.shift else 0)) // self.block_size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.__getitems__([index])
        return x[0], y[0]

    def __getitems__(self, indices: list[int]) -> Batch:
        if not indices or min(indices) < -len(self) or max(indices) >= len(self):
            raise IndexError(f"window indices {indices} out of range for {len(self)} windows")
        starts = torch.tensor(indices, dtype=torch.int64) % len(self) * self.block_size
        if self.shift:
            starts += torch.randint(self.block_size, starts.shape)
        rows = self.tokens[starts[:, None] + self._offsets]  # (B, block_size + 1)
        return Batch((rows[:, :-1], rows[:, 1:]))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of next-token logits, in nats per token (character): float
    (B, T, vocab) logits and int64 (B, T) targets -> a 0-dim tensor.

    A sample is a window of T tokens and its loss the mean over its T
    positions, so ``"mean"`` is the mean over every token of the batch and
    ``"sum"`` the sum of the windows' means (B x the mean): the kit divides
    that by the samples it scored, which gives nats per character again.
    ``exp`` of it is the perplexity; divided by ln 2, bits per character."""
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction=reduction)
    return loss / targets.shape[1] if reduction == "sum" else loss


def download_corpus(path: str) -> None:
    """Download Tiny Shakespeare to ``path`` (its folder made if missing), through a
    temporary file renamed into place once its md5 is ``SHAKESPEARE_MD5``. Raises
    ConfigError (one line) when the download fails or the file is not the corpus."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    partial = f"{path}.{socket.gethostname()}.{os.getpid()}.part"  # nodes may share --data_dir
    try:
        with urllib.request.urlopen(SHAKESPEARE_URL, timeout=60) as response:
            data = response.read()
        digest = hashlib.md5(data).hexdigest()
        if digest != SHAKESPEARE_MD5:
            raise ConfigError(f"the file downloaded from {SHAKESPEARE_URL} has md5 {digest}, not "
                              f"{SHAKESPEARE_MD5}: not the corpus; {missing_corpus_hint(path)}")
        with open(partial, "wb") as f:
            f.write(data)
        os.replace(partial, path)
    except OSError as exc:  # URLError, time-outs, a full disk
        raise ConfigError(f"could not download Tiny Shakespeare from {SHAKESPEARE_URL} "
                          f"({getattr(exc, 'reason', exc)}); {missing_corpus_hint(path)}") from None
    finally:
        if os.path.exists(partial):
            os.remove(partial)


def missing_corpus_hint(path: str) -> str:
    """Where to put the corpus by hand: the sentence the one-line errors end with."""
    return (f"put the file there by hand: {os.path.abspath(path)} ({SHAKESPEARE_BYTES:,} bytes, md5 "
            f"{SHAKESPEARE_MD5}, from {SHAKESPEARE_URL}), or point --data_dir at a folder holding "
            f"shakespeare_char/input.txt")


def read_corpus(data_dir: str, download: bool) -> str:
    """The text of ``data_dir/shakespeare_char/input.txt`` (UTF-8), downloaded first
    when missing and ``download``. A file that is there is read as it is (any
    text trains; a slice of the corpus makes a quick test). Raises ConfigError
    (one line) when it is missing and cannot be downloaded, or is no UTF-8 text."""
    path = os.path.join(data_dir, "shakespeare_char", "input.txt")
    if not os.path.isfile(path):
        if not download:
            raise ConfigError(f"shakespeare_char: no {path}; {missing_corpus_hint(path)}")
        download_corpus(path)
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"shakespeare_char: cannot read {path} as UTF-8 text ({exc})") from None


def model_config(args: argparse.Namespace) -> GPTConfig:
    """The GPT's sizes: ``SHAKESPEARE_MODEL`` with each of ``SIZE_FLAGS`` that
    ``args`` sets (the flags) in its place; the rungs, which have no such
    flags, get the defaults. Checked by ``GPTConfig``: raises ConfigError
    (one line) for n_embd not a multiple of n_head, a size < 1 or a dropout
    outside [0, 1)."""
    given = {name: getattr(args, name) for name in SIZE_FLAGS if getattr(args, name, None) is not None}
    return dataclasses.replace(SHAKESPEARE_MODEL, **given)


def shakespeare_char_task(args: argparse.Namespace, download: bool) -> Task:
    """``--dataset shakespeare_char``: Tiny Shakespeare, one token per character.

    Vocabulary: the sorted set of the whole text's characters
    (``CharVocabulary``, 65 for the corpus). Split: the first 90% of the text
    trains, the last 10% is held out (nanoGPT's split, so its validation
    losses compare); the held-out part is the validation set, and there is no
    test set (``Task.test_set`` None: no test line), as nanoGPT's split has
    none: a test line over the same text would repeat the last validation
    loss. Samples: ``CharWindows`` of --block_size characters (training: each
    shifted by a random 0..block_size-1 characters; held out: tiling the text);
    int64 (B, block_size) contexts and next characters. Model: ``gpt.GPT``
    of the --n_layer --n_head --n_embd --block_size --dropout flags
    (``SHAKESPEARE_MODEL``'s where unset, then set in ``args``; checked before the
    corpus is read) and the vocabulary's size; loss ``lm_loss`` (nats per
    character); recipe ``SHAKESPEARE_RECIPE``. The Task's ``tokens_per_sample``
    is block_size, its ``decode``/``encode`` the vocabulary's. Raises
    ConfigError (one line) for a missing corpus that cannot be downloaded,
    a model other than ``gpt`` and bad sizes.
    """
    choose_model(args, MODELS["shakespeare_char_task"])
    config = model_config(args)
    for name in SIZE_FLAGS:  # the sizes used, in the run's config (and its snapshots)
        setattr(args, name, getattr(config, name))
    text = read_corpus(args.data_dir, download)
    vocabulary = CharVocabulary(text)
    tokens = torch.tensor(vocabulary.encode(text), dtype=torch.int64)
    split = int(len(tokens) * TRAIN_FRACTION)
    block_size = config.block_size
    train, held_out = CharWindows(tokens[:split], block_size, shift=True), CharWindows(tokens[split:], block_size)
    model = GPT(dataclasses.replace(config, vocab_size=len(vocabulary)))
    return Task(train, held_out, None, model, lm_loss, classification=False,
                recipe=dict(SHAKESPEARE_RECIPE), tokens_per_sample=block_size,
                decode=vocabulary.decode, encode=vocabulary.encode)
