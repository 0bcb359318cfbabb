"""The built-in language-model tasks: a character-level GPT on Tiny
Shakespeare, and a GPT on any corpus tokenized the way nanoGPT tokenizes one.

A task module like yours (docs/custom-task.md): ``common.TASKS`` names its
functions as ``"text_tasks:shakespeare_char_task"`` and
``"text_tasks:token_file_task"``, and ``common.load_task`` imports them the
way it imports ``--dataset my_module:my_task``.

  shakespeare_char  the 1,115,394 characters of Tiny Shakespeare (karpathy/char-rnn),
                    each character a token (65 of them); the first 90% to train,
                    the last 10% held out to validate, nanoGPT's split (no test
                    set); a ``gpt.GPT``; the cross-entropy in nats per character;
                    nanoGPT's CPU recipe. Reads ``shakespeare_char/input.txt``
                    under ``--data_dir``; with ``download`` (local rank 0 first,
                    ``train_utils.downloaders_first``) it fetches a missing file
                    from karpathy/char-rnn and checks its md5.
  tokens            nanoGPT's token files in the folder ``--data_dir``:
                    ``train.bin`` and ``val.bin`` (uint16 ids, memory-mapped,
                    never read whole) and optionally ``meta.pkl`` (the
                    vocabulary; else GPT-2's, padded to 50,304); a ``gpt.GPT``
                    (GPT-2 small unless the size flags say otherwise); nanoGPT's
                    GPT-2 recipe. Nothing is downloaded.

Both cut the same windows (``TokenWindows``) from their tokens: a tensor in
memory, or a ``TokenFile``. See docs/language-model.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import hashlib
import os
import pickle
import socket
import struct
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
# --model: the models this module's task functions accept, the default first (train.py's --help lists them).
MODELS = {"shakespeare_char_task": ("gpt",), "token_file_task": ("gpt",)}
# The flags this module's tasks read, as argparse's add_argument takes them (train.py adds them to its
# own; the rungs have none, and train with the defaults). Unset (None), a flag is the task's default.
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
    "train_files": {"help": "--dataset tokens: a glob of the training token files in --data_dir "
                    "(default: *train*.bin: nanoGPT's train.bin, or shards such as llm.c's)"},
    "val_files": {"help": "--dataset tokens: a glob of the validation token files in --data_dir "
                  "(default: *val*.bin)"},
}
# The flags above that change only what a run prints, not what it trains: a run
# submitted again with them changed is the same run (train_utils/identity.py).
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


# --dataset tokens: nanoGPT's token files (train.bin, val.bin, optionally meta.pkl) under --data_dir.
TOKEN_FILES_HINT = ("make train.bin and val.bin (and meta.pkl for a vocabulary of your own) with nanoGPT's "
                    "data/<name>/prepare.py and pass their folder as --data_dir (docs/language-model.md)")
GPT2_VOCAB = 50257  # GPT-2's BPE tokens (tiktoken's "gpt2"): ids 0..50256, the last one <|endoftext|>
GPT2_PADDED_VOCAB = 50304  # padded up to a multiple of 64, as nanoGPT pads it: faster matrix products
UINT16_IDS = 1 << 16  # ids a uint16 file can hold
# llm.c's token shards (dev/data/data_common.py's write_datafile; modded-nanogpt's FineWeb
# shards too): a header of 256 int32 (magic, version, the token count, zeros), then uint16 ids.
LLMC_MAGIC, LLMC_VERSION, LLMC_HEADER_BYTES = 20240520, 1, 256 * 4
MOST_OPEN_SHARDS = 4  # memory maps a process holds at once; the least recently read is closed first
SAMPLE_START = "\n"  # --sample_chars: the sample's first token, as nanoGPT's sample.py starts
# The model and recipe where no flag says otherwise: nanoGPT's train.py defaults,
# its GPT-2 (124M) on OpenWebText recipe for one process: GPT-2 small's shape,
# a 1,024-token context, batch 12, no dropout; AdamW lr 6e-4, betas (0.9,
# 0.95), weight decay 0.1 on matrices only, 2,000 warm-up steps, cosine to
# 6e-5 at step 600,000, gradients clipped to norm 1; an evaluation every
# 2,000 steps over 2,400 held-out windows (its eval_interval, and eval_iters
# 200 of batch 12). Its global batch of ~0.5M tokens (12 x 1,024 x 40
# micro-batches) is --global_batch_size 480: docs/language-model.md.
TOKEN_MODEL = GPTConfig(block_size=1024, vocab_size=GPT2_PADDED_VOCAB, n_layer=12, n_head=12, n_embd=768,
                        dropout=0.0)
TOKEN_RECIPE = {"optimizer": "adamw", "lr": 6e-4, "beta1": 0.9, "beta2": 0.95, "weight_decay": 0.1,
                "decay_params": "matrices", "lr_schedule": "cosine", "min_lr": 6e-5, "warmup_steps": 2000,
                "max_steps": 600000, "clip_grad_norm": 1.0, "batch_size": 12, "log_every_steps": 10,
                "eval_every_steps": 2000, "eval_windows": 2400}


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
    (--dataset shakespeare_char) or a ``TokenFile`` read where the windows
    are (--dataset tokens, a file of any size): one window sampler, two
    sources, the same windows of the same ids either way.

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

    def __init__(self, tokens, block_size: int, shift: bool = False, name: str = "a text", seed: int = 0) -> None:
        # Shards: each one's windows, numbered on from the shard before (one int64 a shard, none a window).
        self.shards = list(tokens) if isinstance(tokens, (list, tuple)) else [tokens]
        longest = max(map(len, self.shards), default=0)
        if longest < block_size + 1 + (block_size - 1 if shift else 0):
            unit = "characters" if isinstance(tokens, torch.Tensor) else "tokens"
            raise ConfigError(f"{name} of {longest} {unit} is too short for one window of "
                              f"--block_size {block_size} (+1 for the targets"
                              f"{', + up to block_size - 1 for the random offset' if shift else ''}); "
                              f"pass a smaller --block_size")
        self.block_size, self.shift, self.seed = block_size, shift, seed
        self.epoch: Optional[int] = None  # set_epoch's: None until the loop gives one
        self._offsets = torch.arange(block_size + 1)
        counts = [max(0, (len(shard) - 1 - (block_size - 1 if shift else 0)) // block_size)
                  for shard in self.shards]
        self._first = torch.tensor([0, *counts], dtype=torch.int64).cumsum(0)
        self._open: list = []  # the shards read last, most recent last (MOST_OPEN_SHARDS)

    def set_epoch(self, epoch: int) -> None:
        """The epoch (0-based) the next fetches belong to: the training
        offsets are keyed by it from now on (in a loader worker started after
        this call too: workers that are not persistent get the dataset as it
        is when the epoch's iterator starts)."""
        self.epoch = epoch

    def __len__(self) -> int:  # with shift, the last window may start block_size - 1 later
        return int(self._first[-1])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.__getitems__([index])
        return x[0], y[0]

    def windows(self, indices: list[int]) -> torch.Tensor:
        """int64 (B, block_size + 1): the windows ``indices`` with the token
        after each (training: each at its random offset). Raises IndexError
        for an index out of range."""
        if not indices or min(indices) < -len(self) or max(indices) >= len(self):
            raise IndexError(f"window indices {indices} out of range for {len(self)} windows")
        windows = torch.tensor(indices, dtype=torch.int64) % len(self)
        shard = torch.searchsorted(self._first[1:], windows, right=True)  # each window's shard
        starts = (windows - self._first[shard]) * self.block_size
        if self.shift and self.epoch is not None:
            starts += torch.tensor([draw_key(self.seed, self.epoch, index) % self.block_size
                                    for index in windows.tolist()], dtype=torch.int64)
        elif self.shift:
            starts += torch.randint(self.block_size, starts.shape)
        if len(self.shards) == 1:
            return self._rows(0, starts)
        rows = torch.empty(len(windows), self.block_size + 1, dtype=torch.int64)
        for one in shard.unique().tolist():
            picked = shard == one
            rows[picked] = self._rows(one, starts[picked])
        return rows

    def _rows(self, shard: int, starts: torch.Tensor) -> torch.Tensor:
        """int64 (B, block_size + 1): the tokens of shard ``shard`` from each
        of ``starts`` on. A shard read is kept open (a file's memory map) with
        the few read last; the one read longest ago is closed beyond
        MOST_OPEN_SHARDS."""
        tokens = self.shards[shard]
        if isinstance(tokens, torch.Tensor):
            return tokens[starts[:, None] + self._offsets]
        if shard in self._open:
            self._open.remove(shard)
        self._open.append(shard)
        while len(self._open) > MOST_OPEN_SHARDS:
            self.shards[self._open.pop(0)].close()
        return tokens.rows(starts, self.block_size + 1)

    def __getitems__(self, indices: list[int]) -> Batch:
        rows = self.windows(indices)
        # Two dense tensors, not two views of rows: a view keeps rows' strides, and a
        # strided batch is not what the loader pins, so its copy to a GPU would go
        # through a pageable temporary and wait for the GPU (docs/performance.md).
        return Batch((rows[:, :-1].contiguous(), rows[:, 1:].contiguous()))


class TokenFile:
    """A file of token ids, uint16, read where the windows are, never whole:
    nanoGPT's ``train.bin`` and ``val.bin`` (and any shard written the same
    way), as its ``data/<name>/prepare.py`` scripts write them with numpy's
    ``tofile``, ids back to back in native byte order (little-endian on x86
    and ARM); or a shard in llm.c's format (its ``dev/data`` scripts, and
    modded-nanogpt's FineWeb shards: ``fineweb_train_000001.bin`` ...), a
    header of 256 little-endian int32 (magic 20240520, version 1, the token
    count; ``LLMC_MAGIC``) before the ids.

    ``len()``: its tokens. ``rows(starts, width)``: int64 (B, width), row b
    the ``width`` tokens from token ``starts[b]`` on (``starts`` int64
    (B,)). The file is memory-mapped (``torch.from_file``, private and
    read-only: nothing is written back) at the first ``rows`` in each
    process, so only the pages a window touches are read and held, and the
    operating system shares them between the processes of a node;
    ``close()`` drops the map (the next ``rows`` maps it again). Pickling
    it (a DataLoader worker started by a fork server gets a pickled dataset)
    sends the path, not the map: a mapped tensor sent to a worker would be
    copied whole into shared memory. The ids are mapped as int16 (what every
    supported torch indexes) and read back as uint16 (0..65535).

    Raises ConfigError (one line) for a missing file, an odd number of bytes,
    and an llm.c header of another version or whose token count is not what
    the file holds (a shard cut short by a copy).
    """

    def __init__(self, path: str) -> None:
        if not os.path.isfile(path):
            raise ConfigError(f"--dataset tokens: no {path}; {TOKEN_FILES_HINT}")
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(12)
        magic, version, count = struct.unpack("<3i", head) if len(head) == 12 else (0, 0, 0)
        self.offset = 0  # tokens before the first id: llm.c's header
        if magic == LLMC_MAGIC:
            if version != LLMC_VERSION:
                raise ConfigError(f"--dataset tokens: {path} is an llm.c token shard of version {version}; "
                                  f"the kit reads version {LLMC_VERSION} (uint16 ids, as llm.c's and "
                                  f"modded-nanogpt's FineWeb shards are)")
            if size != LLMC_HEADER_BYTES + 2 * count:
                raise ConfigError(f"--dataset tokens: {path}'s header gives {count:,} tokens, but the file "
                                  f"holds {(size - LLMC_HEADER_BYTES) / 2:,.1f} after its header: a shard cut "
                                  f"short (or grown) by a copy? Copy it again from where it was made")
            self.offset, size = LLMC_HEADER_BYTES // 2, size - LLMC_HEADER_BYTES
        elif size % 2:
            raise ConfigError(f"--dataset tokens: {path} has {size:,} bytes, an odd number: not uint16 token "
                              f"ids (2 bytes each, as nanoGPT's prepare.py writes them); {TOKEN_FILES_HINT}")
        self.path, self.length = path, size // 2
        self._tokens = None  # the map, made in each process at its first read

    def __len__(self) -> int:
        return self.length

    def __getstate__(self) -> dict:
        return {"path": self.path, "length": self.length, "offset": self.offset}

    def __setstate__(self, state: dict) -> None:
        self.path, self.length, self.offset, self._tokens = state["path"], state["length"], state["offset"], None

    def rows(self, starts: torch.Tensor, width: int) -> torch.Tensor:
        if self._tokens is None:
            mapped = torch.from_file(self.path, shared=False, size=self.offset + self.length, dtype=torch.int16)
            self._tokens = mapped[self.offset:]
        rows = self._tokens[starts[:, None] + torch.arange(width)]
        return rows.to(torch.int64) & 0xFFFF

    def close(self) -> None:
        """Drop this process's map of the file (nothing is written: it is read-only)."""
        self._tokens = None

    def sample(self, chunks: int = 32, chunk_tokens: int = 1 << 16) -> tuple[int, int]:
        """(the largest id, its token index) in ``chunks`` stretches of
        ``chunk_tokens`` tokens spread evenly over the file, its first and
        its last included: read with plain file reads (no map, so none of it
        stays in this process's memory), at most 2 x chunks x chunk_tokens
        bytes whatever the file's size; (-1, -1) for an empty file."""
        if not self.length:
            return -1, -1
        step = max(1, (self.length - chunk_tokens) // max(1, chunks - 1))
        firsts = sorted({min(i * step, max(0, self.length - chunk_tokens)) for i in range(chunks)})
        largest, where = -1, -1
        with open(self.path, "rb") as f:
            for first in firsts:
                f.seek(2 * (self.offset + first))
                data = f.read(2 * min(chunk_tokens, self.length - first))
                ids = torch.frombuffer(bytearray(data), dtype=torch.int16).to(torch.int64) & 0xFFFF
                top = int(ids.argmax())
                if int(ids[top]) > largest:
                    largest, where = int(ids[top]), first + top
        return largest, where


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
    vocabulary, which a snapshot's weights must have (dropout may change)."""
    return {name: getattr(config, name) for name in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size")}


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
    that ``args`` sets (the flags) in its place; the rungs, which have no
    such flags, get the defaults. Checked by ``GPTConfig``: raises
    ConfigError (one line) for n_embd not a multiple of n_head, a size < 1 or
    a dropout outside [0, 1)."""
    given = {name: getattr(args, name) for name in SIZE_FLAGS if getattr(args, name, None) is not None}
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
    int64 (B, block_size) contexts and next characters. Model: ``gpt.GPT``
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
    model = GPT(dataclasses.replace(config, vocab_size=len(vocabulary)))
    return Task(train, held_out, None, model, lm_loss, classification=False,
                recipe=dict(SHAKESPEARE_RECIPE), tokens_per_sample=block_size,
                decode=vocabulary.decode, encode=vocabulary.encode, identity=gpt_identity(model.config),
                sample_text=text_sampler(args, vocabulary.decode, vocabulary.encode))


# --------------------------------------------------------------------------
# tokens: nanoGPT's token files, memory-mapped
# --------------------------------------------------------------------------

class _PlainValues(pickle.Unpickler):
    """An unpickler of plain values only (dicts, lists, strings, numbers: what
    nanoGPT's meta.pkl holds): it imports nothing, so a meta.pkl made to run
    code when loaded is refused instead."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"it names {module}.{name}, and only plain values are read")


def read_meta(path: str) -> dict:
    """nanoGPT's ``meta.pkl`` at ``path`` (``prepare.py`` of a character-level
    corpus writes it): a dict with ``vocab_size`` (an int, 1..65,536: the
    ids a uint16 file holds) and, for a vocabulary that can be written out,
    ``itos`` {id: string} and ``stoi`` {string: id}. Read without running
    code (``_PlainValues``). Raises ConfigError (one line) for a file that is
    not such a dict."""
    try:
        with open(path, "rb") as f:
            meta = _PlainValues(f).load()
    except (OSError, pickle.UnpicklingError, EOFError, ValueError, TypeError) as exc:
        raise ConfigError(f"--dataset tokens: cannot read {path} as nanoGPT's meta.pkl ({exc}); "
                          f"{TOKEN_FILES_HINT}") from None
    vocab_size = meta.get("vocab_size") if isinstance(meta, dict) else None
    if type(vocab_size) is not int or not 1 <= vocab_size <= UINT16_IDS:
        raise ConfigError(f"--dataset tokens: {path} gives no vocab_size from 1 to {UINT16_IDS:,} (it holds "
                          f"{vocab_size!r}); nanoGPT's meta.pkl is a dict with the vocabulary's size as "
                          f"'vocab_size', and uint16 files hold ids below {UINT16_IDS:,}")
    return meta


def check_token_ids(files: Sequence[TokenFile], vocab_size: int, vocabulary: str) -> None:
    """Raise ConfigError (one line) when a sample of each file's ids
    (``TokenFile.sample``: its first and last tokens and 30 stretches
    between, 128 KB a stretch) holds one outside 0..vocab_size - 1
    (``vocabulary``: where that size comes from, for the message): a file of
    another tokenizer, or not token ids at all. A sample, not the whole file:
    a corpus of billions of tokens is checked in milliseconds."""
    chunks = max(2, 32 // max(1, len(files)))  # a set of shards: about as much read as from one file
    for tokens in files:
        largest, where = tokens.sample(chunks)
        if largest >= vocab_size:
            raise ConfigError(f"--dataset tokens: {tokens.path} holds token id {largest} (token {where:,}), "
                              f"outside the vocabulary of {vocab_size:,} ({vocabulary}); a file of another "
                              f"tokenizer? Put the meta.pkl of its prepare.py beside it, or {TOKEN_FILES_HINT}")


def token_files(data_dir: str, pattern: Optional[str], split: str) -> list:
    """The ``TokenFile``s of one split of --dataset tokens, in name order:
    those the glob ``pattern`` matches (--train_files, --val_files; relative
    to ``data_dir`` unless absolute), else the ``*{split}*.bin`` files in
    ``data_dir``: nanoGPT's ``train.bin`` and ``val.bin``, or a set of
    shards (``fineweb_train_000001.bin`` ...; nanoGPT-style headerless
    shards or llm.c's, ``TokenFile``). Raises ConfigError (one line) when
    nothing matches, for a file ``TokenFile`` refuses, and for a set that
    mixes llm.c's shards with files without its header (a damaged magic
    would otherwise read as token ids)."""
    given = pattern is not None
    pattern = pattern if given else f"*{split}*.bin"
    matched = sorted(path for path in glob.glob(os.path.join(data_dir, pattern)) if os.path.isfile(path))
    if not matched:
        flag = f"--{split}_files {pattern}" if given else f"no --{split}_files, so *{split}*.bin"
        raise ConfigError(f"--dataset tokens: no {split} token files in --data_dir {data_dir} ({flag} matches "
                          f"nothing); {TOKEN_FILES_HINT}, or name the shards with --{split}_files GLOB")
    files = [TokenFile(path) for path in matched]
    headed = [f for f in files if f.offset]
    if headed and len(headed) < len(files):  # a damaged magic reads as a headerless file: refuse the mix
        plain = next(f for f in files if not f.offset)
        raise ConfigError(f"--dataset tokens: {plain.path} has no llm.c header (magic {LLMC_MAGIC}), while "
                          f"{headed[0].path} has one: the {split} files of a set are all in one format; a "
                          f"shard whose header is damaged? Make it again, or leave it out with --{split}_files")
    return files


def corpus_identity(files: Sequence[TokenFile]) -> str:
    """A set of token files as a run's identity (``Task.identity``): how many,
    their tokens, and the first 12 hex digits of the SHA-256 of each one's
    name (not its folder: a node-local copy is the same corpus) and token
    count, so that a resume onto shards renamed, added, removed or cut short
    is refused."""
    digest = hashlib.sha256("".join(f"{os.path.basename(f.path)}\0{len(f)}\0" for f in files).encode())
    return f"{len(files)} file{'s' if len(files) > 1 else ''}, {sum(map(len, files)):,} tokens, " \
           f"{digest.hexdigest()[:12]}"


def _names(files: Sequence[TokenFile]) -> str:
    """A set of token files, for a message: the one path, or the first and how many."""
    return files[0].path if len(files) == 1 else f"{files[0].path} and {len(files) - 1} more"


def token_file_task(args: argparse.Namespace, download: bool) -> Task:
    """``--dataset tokens``: a corpus tokenized the way nanoGPT's
    ``data/<name>/prepare.py`` scripts write it, in the folder --data_dir:
    ``train.bin`` and ``val.bin``, uint16 token ids back to back, each
    memory-mapped (``TokenFile``: a file of any size, read where the windows
    are), and optionally ``meta.pkl``.

    Vocabulary: ``meta.pkl``'s ``vocab_size`` when it is there (its
    ``itos``/``stoi`` give ``decode``/``encode``, so --sample_chars writes
    text), else GPT-2's 50,257 tokens, the model's embedding padded to
    50,304 (nanoGPT's choice; no ``decode``: GPT-2's BPE is not part of the
    kit). The ids are checked against it on a sample of each file
    (``check_token_ids``). Samples: ``TokenWindows`` of --block_size tokens,
    the training ones at a random offset (the character task's windows, so
    an epoch visits ``train.bin`` once), the held-out ones tiling ``val.bin``
    (the validation set; no test set). Model: ``gpt.GPT`` of the
    --n_layer --n_head --n_embd --block_size --dropout flags
    (``TOKEN_MODEL``'s where unset: GPT-2 small); loss ``lm_loss`` (nats per
    token); recipe ``TOKEN_RECIPE`` (nanoGPT's train.py defaults, with an
    evaluation every 2,000 steps over 2,400 held-out windows). Nothing is
    downloaded (``download`` is unused). Raises ConfigError (one line) for
    a missing file or folder, a file of an odd number of bytes or too short
    for one window, a bad meta.pkl, an id outside the vocabulary, a model
    other than ``gpt`` and bad sizes.
    """
    choose_model(args, MODELS["token_file_task"])
    config = model_config(args, TOKEN_MODEL)
    if not os.path.isdir(args.data_dir):
        raise ConfigError(f"--dataset tokens: --data_dir {args.data_dir} is not a folder; {TOKEN_FILES_HINT}")
    train_files, val_files = (token_files(args.data_dir, getattr(args, flag, None), split)
                              for flag, split in (("train_files", "train"), ("val_files", "val")))
    meta_path = os.path.join(args.data_dir, "meta.pkl")
    decode = encode = None
    if os.path.isfile(meta_path):
        meta = read_meta(meta_path)
        vocab_size = model_vocab = meta["vocab_size"]
        vocabulary = f"vocab_size of {meta_path}"
        itos, stoi = meta.get("itos"), meta.get("stoi")
        if isinstance(itos, dict) and isinstance(stoi, dict):
            words = MetaVocabulary(itos, stoi)
            decode, encode = words.decode, words.encode
    else:
        vocab_size, model_vocab = GPT2_VOCAB, GPT2_PADDED_VOCAB
        vocabulary = f"GPT-2's, as no {meta_path} gives another"
    check_token_ids([*train_files, *val_files], vocab_size, vocabulary)
    block_size = config.block_size
    train, held_out = (TokenWindows(files, block_size, shift=split == "train", seed=args.seed,
                                    name=f"--dataset tokens: {_names(files)}")
                       for files, split in ((train_files, "train"), (val_files, "val")))
    model = GPT(dataclasses.replace(config, vocab_size=model_vocab))
    if getattr(args, "sample_chars", 0) and decode is None:
        raise ConfigError(f"--sample_chars: --dataset tokens writes text only with a vocabulary to decode, a "
                          f"meta.pkl holding itos and stoi beside the token files (GPT-2's BPE is not part of "
                          f"the kit); leave the flag out, or {TOKEN_FILES_HINT}")
    return Task(train, held_out, None, model, lm_loss, classification=False, recipe=dict(TOKEN_RECIPE),
                tokens_per_sample=block_size, decode=decode, encode=encode,
                identity={**gpt_identity(model.config), "train_files": corpus_identity(train_files),
                          "val_files": corpus_identity(val_files)},
                sample_text=text_sampler(args, decode, encode) if decode else None)


class MetaVocabulary:
    """A meta.pkl's vocabulary: ``itos`` {id: string}, ``stoi`` {string: id}
    (nanoGPT's character-level prepare.py: one character per id)."""

    def __init__(self, itos: dict, stoi: dict) -> None:
        self.itos, self.stoi = itos, stoi

    def decode(self, ids: Sequence[int]) -> str:
        """The text of token ids ``ids`` (ints, or a 1-D integer tensor); an id
        meta.pkl does not name is left out."""
        return "".join(self.itos.get(int(i), "") for i in ids)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, one per character. Raises ConfigError (one
        line) for a character meta.pkl's ``stoi`` does not hold."""
        try:
            return [self.stoi[char] for char in text]
        except KeyError as exc:
            raise ConfigError(f"the character {exc.args[0]!r} is not in meta.pkl's vocabulary") from None
