"""The built-in character-level language model, a GPT on Tiny Shakespeare,
and what every GPT task builds from: the windows cut from a token sequence,
the loss, the GPT's flags and sizes, the sampler (token_tasks.py's task, the
same GPT on nanoGPT's token files, imports them from here).

A task module like yours (docs/custom-task.md): ``common.TASKS`` names its
function as ``"text_tasks:shakespeare_char_task"``, and ``common.load_task``
imports it the way it imports ``--dataset my_module:my_task``.

  shakespeare_char  the 1,115,394 characters of Tiny Shakespeare (karpathy/char-rnn),
                    each character a token (65 of them); the first 90% to train,
                    the last 10% held out to validate, nanoGPT's split (no test
                    set); a ``gpt.GPT``; the cross-entropy in nats per character;
                    nanoGPT's CPU recipe. Reads ``shakespeare_char/input.txt``
                    under ``--data_dir``; with ``download`` (local rank 0 first,
                    ``train_utils.downloaders_first``) it fetches a missing file
                    from karpathy/char-rnn and checks its md5.

See docs/language-model.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import os
import socket
import urllib.request
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from common import Batch, ConfigError, Task, choose_model, draw_key
from gpt import GPT, GPTConfig

SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
SHAKESPEARE_MD5 = "6fb458f1232090904fb40fe944165e91"
SHAKESPEARE_BYTES = 1115394
TRAIN_FRACTION = 0.9  # the first 90% of the text trains, the last 10% is held out (nanoGPT's split)
# --model: the models this module's task function accepts, the default first (train.py's --help lists them).
MODELS = {"shakespeare_char_task": ("gpt",)}
# The flags of the GPT tasks (this module's, and token_tasks.py's, which adds its own), as argparse's
# add_argument takes them (train.py adds them to its own; the rungs have none, and train with the
# defaults). Unset (None), a flag is the task's default.
FLAGS = {
    "n_layer": {"type": int, "help": "GPT tasks: transformer blocks (default: the task's)"},
    "n_head": {"type": int, "help": "GPT tasks: heads (default: the task's)"},
    "n_embd": {"type": int, "help": "GPT tasks: width (default: the task's)"},
    "block_size": {"type": int, "help": "GPT tasks: context, tokens (default: the task's)"},
    "dropout": {"type": float, "help": "GPT tasks: dropout probability (default: the task's)"},
    "sample_chars": {"type": int, "default": 0, "help": "characters the model writes, printed after training "
                     "and on a rerun of a finished run; 0: none (default: 0)"},
    "temperature": {"type": float, "default": 0.8, "help": "--sample_chars: logits / this (default: 0.8)"},
    "top_k": {"type": int, "default": 200, "help": "--sample_chars: from the k likeliest (default: 200)"},
}
# The flags above that change only what a run prints, not what it trains: a run
# submitted again with them changed is the same run (tools/identity.py).
OUTPUT_FLAGS = ("sample_chars", "temperature", "top_k")

# The model's sizes (the --n_layer ... --dropout flags) and the recipe where no flag
# says otherwise: nanoGPT's CPU recipe for this corpus (its README, "I only have a
# macbook"): 4 layers, 4 heads, 128 wide, a 64-character context, batch 12, no
# dropout; AdamW lr 1e-3, betas (0.9, 0.99), weight decay 0.1 on matrices only,
# 100 warm-up steps, cosine to 1e-4 at step 2,000, gradients clipped to norm 1.
# vocab_size: the corpus's 65 characters; the task sets that of the text it reads.
SHAKESPEARE_MODEL = GPTConfig(block_size=64, vocab_size=65, n_layer=4, n_head=4, n_embd=128, dropout=0.0)
SIZE_FLAGS = ("n_layer", "n_head", "n_embd", "block_size", "dropout")  # the GPTConfig fields of FLAGS
SHAKESPEARE_RECIPE = {"optimizer": "adamw", "lr": 1e-3, "beta1": 0.9, "beta2": 0.99, "weight_decay": 0.1,
                      "decay_params": "matrices", "lr_schedule": "cosine", "min_lr": 1e-4,
                      "warmup_steps": 100, "max_steps": 2000, "clip_grad_norm": 1.0, "batch_size": 12,
                      "log_every_steps": 100}
SAMPLE_START = "\n"  # --sample_chars: the sample's first token, as nanoGPT's sample.py starts


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


class TokenWindows(Dataset):
    """(context, next tokens) windows of a token sequence: item i is (x, y),
    both int64 (block_size,), x = tokens[s : s + block_size] and y =
    tokens[s + 1 : s + block_size + 1] (y[t] is the token after x[t]).
    ``tokens``: the sequence, an int64 (N,) tensor in memory
    (--dataset shakespeare_char); ``token_tasks.TokenFileWindows`` cuts the
    same windows from token files (--dataset tokens).

    Held out (``shift=False``): s = i x block_size, so the windows tile the
    sequence without overlap and every token but the last few is a target
    exactly once. Training (``shift=True``): s = i x block_size + r, r in
    [0, block_size) for each item, so that an epoch still covers the
    sequence once on average, but a window starts at any token, as nanoGPT's
    random offsets do, instead of the same len() windows every epoch, which
    a model of some millions of parameters learns by heart within a few
    epochs. Once the training loop has called ``set_epoch`` (the kit does,
    each epoch), r is keyed by (``seed``, epoch, i) (``common.draw_key``):
    the same in the main process or any loader worker, at any world size,
    after any resume, and nothing is drawn from torch's generators. Before
    (the rungs, which give the dataset no epoch), r comes from torch's
    default generator at each fetch, as torchvision's RandomCrop draws its
    crops. ``__getitems__`` cuts a whole batch at
    once, returning ``common.Batch((x, y))``, int64 (B, block_size) each,
    both contiguous, cut from ``windows``' (B, block_size + 1) rows.
    Raises ConfigError when the sequence is too short for one window
    (``name``: what it is, for the message).
    """

    unit = "characters"  # what a token is, for that message

    def __init__(self, tokens, block_size: int, shift: bool = False, name: str = "a text", seed: int = 0) -> None:
        self.block_size, self.shift, self.seed = block_size, shift, seed
        self.epoch: Optional[int] = None  # set_epoch's: None until the loop gives one
        self._offsets = torch.arange(block_size + 1)
        self._length = self._hold(tokens, name)

    def _hold(self, tokens: torch.Tensor, name: str) -> int:
        """Keep ``tokens`` to cut the windows from; return how many they hold."""
        self.tokens = tokens
        count = self._windows_in(len(tokens))
        if not count:
            raise self._too_short(len(tokens), name)
        return count

    def _windows_in(self, tokens: int) -> int:
        """The windows a sequence of ``tokens`` tokens holds (with shift, the
        last may start block_size - 1 later)."""
        return max(0, (tokens - 1 - (self.block_size - 1 if self.shift else 0)) // self.block_size)

    def _too_short(self, tokens: int, name: str) -> ConfigError:
        """The error for ``name``, of ``tokens`` tokens, too short for one window."""
        return ConfigError(f"{name} of {tokens} {self.unit} is too short for one window of "
                           f"--block_size {self.block_size} (+1 for the targets"
                           f"{', + up to block_size - 1 for the random offset' if self.shift else ''}); "
                           f"pass a smaller --block_size")

    def set_epoch(self, epoch: int) -> None:
        """The epoch (0-based) the next fetches belong to: the training
        offsets are keyed by it from now on (in a loader worker started after
        this call too: workers that are not persistent get the dataset as it
        is when the epoch's iterator starts)."""
        self.epoch = epoch

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.__getitems__([index])
        return x[0], y[0]

    def _window_indices(self, indices: list[int]) -> torch.Tensor:
        """``indices`` as an int64 tensor, negative ones counted from the end.
        Raises IndexError for an index out of range."""
        if not indices or min(indices) < -len(self) or max(indices) >= len(self):
            raise IndexError(f"window indices {indices} out of range for {len(self)} windows")
        return torch.tensor(indices, dtype=torch.int64) % len(self)

    def _draw_offsets(self, windows: torch.Tensor) -> torch.Tensor:
        """Each window's random offset r (training; 0 held out), int64 like ``windows``."""
        if self.shift and self.epoch is not None:
            return torch.tensor([draw_key(self.seed, self.epoch, index) % self.block_size
                                 for index in windows.tolist()], dtype=torch.int64)
        if self.shift:
            return torch.randint(self.block_size, windows.shape)
        return torch.zeros_like(windows)

    def windows(self, indices: list[int]) -> torch.Tensor:
        """int64 (B, block_size + 1): the windows ``indices`` with the token
        after each (training: each at its random offset). Raises IndexError
        for an index out of range."""
        windows = self._window_indices(indices)
        starts = windows * self.block_size + self._draw_offsets(windows)
        return self.tokens[starts[:, None] + self._offsets]

    def __getitems__(self, indices: list[int]) -> Batch:
        rows = self.windows(indices)
        # Two dense tensors, not two views of rows: a view keeps rows' strides, and a
        # strided batch is not what the loader pins, so its copy to a GPU would go
        # through a pageable temporary and wait for the GPU (docs/performance.md).
        return Batch((rows[:, :-1].contiguous(), rows[:, 1:].contiguous()))


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


def gpt_identity(config: GPTConfig) -> dict:
    """The GPT's shape as a task's identity (``Task.identity``): its sizes and
    vocabulary, which a snapshot's weights must have (dropout may change),
    and ``bias`` where the GPT has biases (a GPT-2 it started from: the
    default, none, is left out, as snapshots saved before it hold it)."""
    identity = {name: getattr(config, name) for name in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size")}
    return {**identity, "bias": True} if config.bias else identity


def text_sampler(args: argparse.Namespace, decode, encode):
    """``Task.sample_text`` for --sample_chars N (``FLAGS``; None for 0, and
    for the rungs, which have no such flag): (model, device) -> a header line
    and the N tokens the model writes after a newline (``SAMPLE_START``),
    decoded, drawn from softmax(logits / --temperature) over the --top_k
    likeliest (``gpt.GPT.generate``) with a generator seeded by --seed: the
    same text on every rank, and again for the same weights and flags.
    Raises ConfigError (one line) for a --temperature or --top_k that is
    not above 0, or a negative --sample_chars."""
    chars, temperature, top_k = (getattr(args, name, FLAGS[name]["default"])
                                 for name in ("sample_chars", "temperature", "top_k"))
    bad = [f"--{name} {value}" for name, value in (("sample_chars", chars), ("temperature", temperature),
                                                   ("top_k", top_k)) if value < (0 if name == "sample_chars" else 1e-12)]
    if bad:
        raise ConfigError(f"{', '.join(bad)}: --sample_chars is 0 or more, --temperature and --top_k above 0")
    if not chars:
        return None

    def sample_text(model: torch.nn.Module, device: torch.device) -> str:
        try:
            start = encode(SAMPLE_START)
        except (KeyError, ValueError, ConfigError):  # no newline in the vocabulary
            start = [0]
        idx = torch.tensor([start], dtype=torch.long, device=device)
        out = model.generate(idx, chars, temperature, top_k, torch.Generator().manual_seed(args.seed))
        return (f"sample | {chars} characters | temperature {temperature:g} | top_k {top_k}\n"
                f"{decode(out[0, len(start):].tolist())}")

    return sample_text


def model_config(args: argparse.Namespace, defaults: GPTConfig = SHAKESPEARE_MODEL) -> GPTConfig:
    """The GPT's sizes: ``defaults`` (the task's) with each of ``SIZE_FLAGS``
    that ``args`` sets (the flags) in its place, and ``bias`` where ``args``
    has one (no flag: the --init_from weights', ``train.build_task``); the
    rungs, which have no such flags, get the defaults. Checked by ``GPTConfig``: raises
    ConfigError (one line) for n_embd not a multiple of n_head, a size < 1 or
    a dropout outside [0, 1)."""
    given = {name: getattr(args, name) for name in SIZE_FLAGS if getattr(args, name, None) is not None}
    if getattr(args, "bias", None) is not None:  # no flag: the weights of --init_from say (GPT-2 has biases)
        given["bias"] = args.bias
    return dataclasses.replace(defaults, **given)


def shakespeare_char_task(args: argparse.Namespace, download: bool) -> Task:
    """``--dataset shakespeare_char``: Tiny Shakespeare, one token per character.

    Vocabulary: the sorted set of the whole text's characters
    (``CharVocabulary``, 65 for the corpus). Split: the first 90% of the text
    trains, the last 10% is held out (nanoGPT's split, so its validation
    losses compare); the held-out part is the validation set, and there is no
    test set (``Task.test_set`` None: no test line), as nanoGPT's split has
    none: a test line over the same text would repeat the last validation
    loss. Samples: ``TokenWindows`` of --block_size characters (training: each
    shifted by a random 0..block_size-1 characters; held out: tiling the text);
    int64 (B, block_size) contexts and next characters. Model: a factory of ``gpt.GPT``
    of the --n_layer --n_head --n_embd --block_size --dropout flags
    (``SHAKESPEARE_MODEL``'s where unset; checked before the
    corpus is read) and the vocabulary's size; loss ``lm_loss`` (nats per
    character); recipe ``SHAKESPEARE_RECIPE``. The Task's ``tokens_per_sample``
    is block_size, its ``decode``/``encode`` the vocabulary's, its identity
    the GPT's shape (``gpt_identity``), and under --sample_chars its
    ``sample_text`` writes (``text_sampler``). Raises
    ConfigError (one line) for a missing corpus that cannot be downloaded,
    a model other than ``gpt`` and bad sizes.
    """
    choose_model(args, MODELS["shakespeare_char_task"])
    config = model_config(args)
    text = read_corpus(args.data_dir, download)
    vocabulary = CharVocabulary(text)
    tokens = torch.tensor(vocabulary.encode(text), dtype=torch.int64)
    split = int(len(tokens) * TRAIN_FRACTION)
    block_size = config.block_size
    train = TokenWindows(tokens[:split], block_size, shift=True, name="the training text", seed=args.seed)
    held_out = TokenWindows(tokens[split:], block_size, name="the held-out text")
    gpt_config = dataclasses.replace(config, vocab_size=len(vocabulary))
    # A model factory: under FSDP train.py builds it on the meta device, each rank materialising its shards.
    return Task(train, held_out, None, functools.partial(GPT, gpt_config), lm_loss, classification=False,
                recipe=dict(SHAKESPEARE_RECIPE), tokens_per_sample=block_size,
                decode=vocabulary.decode, encode=vocabulary.encode, identity=gpt_identity(gpt_config),
                sample_text=text_sampler(args, vocabulary.decode, vocabulary.encode),
                corpus=f"Tiny Shakespeare, {split:,} tokens to train and {len(tokens) - split:,} held out, "
                       f"vocabulary {len(vocabulary)} (its characters)")
