"""The built-in GPT on a corpus of your own, tokenized the way nanoGPT
tokenizes one: its token files, or shards such as llm.c's, memory-mapped.

A task module like yours (docs/custom-task.md): ``common.TASKS`` names its
function as ``"token_tasks:token_file_task"``, and ``common.load_task``
imports it the way it imports ``--dataset my_module:my_task``. It trains
text_tasks.py's GPT with text_tasks.py's windows, loss, flags and sampler.

  tokens            nanoGPT's token files in the folder ``--data_dir``:
                    ``train.bin`` and ``val.bin`` (uint16 ids, memory-mapped,
                    never read whole; or shards: llm.c's ``.bin``,
                    build-nanogpt's ``.npy``) and optionally ``meta.pkl`` (the
                    vocabulary; else GPT-2's, padded to 50,304); a ``gpt.GPT``
                    (GPT-2 small unless the size flags say otherwise); nanoGPT's
                    GPT-2 recipe. Nothing is downloaded.

See docs/language-model.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import glob
import hashlib
import os
import pickle
import struct
from typing import Optional, Sequence

import torch

import text_tasks
from common import ConfigError, Task, choose_model
from gpt import GPT, GPTConfig
from text_tasks import TokenWindows, gpt_identity, lm_loss, model_config, text_sampler

# --model: the models this module's task function accepts, the default first (train.py's --help lists them).
MODELS = {"token_file_task": ("gpt",)}
# --data_dir s3://bucket/prefix: shards read by ranged GETs of aligned blocks, kept in a bounded
# cache per open shard (--bucket_cache_mib a process, over MOST_OPEN_SHARDS shards). A block is
# small next to a shard (llm.c's are 200 MB) so that a random window costs one GET of a block,
# not a shard's worth; large next to a window (2 KiB at block_size 1,024) so that the held-out
# windows, which tile the file, and windows close together share GETs.
BUCKET = "s3://"
BUCKET_BLOCK_BYTES = 64 << 10
BUCKET_CACHE_MIB = 64
# botocore's client settings for the bucket: bounded time-outs and retries, so that an endpoint
# that does not answer ends the run in about a minute instead of hanging it.
BUCKET_CLIENT = {"connect_timeout": 5, "read_timeout": 30, "retries": {"max_attempts": 3, "mode": "standard"}}
BUCKET_HINT = ("the endpoint and credentials come from the standard AWS variables (AWS_ENDPOINT_URL, "
               "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_PROFILE, AWS_DEFAULT_REGION)")
# The flags this module's task reads: the GPT tasks' (text_tasks.py's), and which files to read.
FLAGS = {
    **text_tasks.FLAGS,
    "train_files": {"help": "--dataset tokens: a glob of the training token files in --data_dir "
                    "(default: *train*.bin and *train*.npy: nanoGPT's train.bin, shards such as llm.c's, "
                    "or build-nanogpt's .npy shards)"},
    "val_files": {"help": "--dataset tokens: a glob of the validation token files in --data_dir "
                  "(default: *val*.bin and *val*.npy)"},
    "bucket_cache_mib": {"type": int, "default": BUCKET_CACHE_MIB,
                         "help": "--dataset tokens with --data_dir s3://bucket/prefix: MiB of shard blocks a "
                                 "process (each DataLoader worker too) keeps read from the bucket "
                                 f"(default: {BUCKET_CACHE_MIB})"},
}
# The flags above that change nothing a run trains, only what it prints or how it reads (tools/identity.py).
OUTPUT_FLAGS = (*text_tasks.OUTPUT_FLAGS, "bucket_cache_mib")

TOKEN_FILES_HINT = ("make train.bin and val.bin (and meta.pkl for a vocabulary of your own) with nanoGPT's "
                    "data/<name>/prepare.py and pass their folder as --data_dir (docs/language-model.md)")
GPT2_VOCAB = 50257  # GPT-2's BPE tokens (tiktoken's "gpt2"): ids 0..50256, the last one <|endoftext|>
GPT2_PADDED_VOCAB = 50304  # padded up to a multiple of 64, as nanoGPT pads it: faster matrix products
UINT16_IDS = 1 << 16  # ids a uint16 file can hold
# llm.c's token shards (dev/data/data_common.py's write_datafile; modded-nanogpt's FineWeb
# shards too): a header of 256 int32 (magic, version, the token count, zeros), then uint16 ids.
LLMC_MAGIC, LLMC_VERSION, LLMC_HEADER_BYTES = 20240520, 1, 256 * 4
# NumPy's .npy files (np.save; build-nanogpt's fineweb.py writes its shards so, uint16 ids):
# a header (magic, version, the array's dtype and shape) before the ids.
NPY_MAGIC = b"\x93NUMPY"
# The .npy dtypes read (NumPy's names): the torch dtype each is mapped as, and the mask
# that reads it back (int16 read back as uint16; int32 as it is).
NPY_DTYPES = {"<u2": (torch.int16, 0xFFFF), "<i4": (torch.int32, None)}
MOST_OPEN_SHARDS = 4  # memory maps a process holds at once; the least recently read is closed first
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


class TokenFileWindows(TokenWindows):
    """``text_tasks.TokenWindows`` cut from token files (``TokenFile``s): the
    same windows of the same ids as from those tokens in memory, the same
    offsets. ``files``: one file, or a set of shards; each window lies
    inside one shard, the windows numbered on from the shard before (one
    int64 a shard is kept, none a window). A shard read is kept open (its
    memory map) with the few read last; the one read longest ago is closed
    beyond MOST_OPEN_SHARDS. Raises ConfigError when no shard is long
    enough for one window."""

    unit = "tokens"

    def _hold(self, files, name: str) -> int:
        self.shards = list(files) if isinstance(files, (list, tuple)) else [files]
        counts = [self._windows_in(len(shard)) for shard in self.shards]
        if not any(counts):
            raise self._too_short(max(map(len, self.shards), default=0), name)
        self._first = torch.tensor([0, *counts], dtype=torch.int64).cumsum(0)
        self._open: list = []  # the shards read last, most recent last (MOST_OPEN_SHARDS)
        return int(self._first[-1])

    def windows(self, indices: list[int]) -> torch.Tensor:
        windows = self._window_indices(indices)
        shard = torch.searchsorted(self._first[1:], windows, right=True)  # each window's shard
        starts = (windows - self._first[shard]) * self.block_size + self._draw_offsets(windows)
        rows = torch.empty(len(windows), self.block_size + 1, dtype=torch.int64)
        for one in shard.unique().tolist():
            picked = shard == one
            rows[picked] = self._rows(one, starts[picked])
        return rows

    def _rows(self, shard: int, starts: torch.Tensor) -> torch.Tensor:
        """int64 (B, block_size + 1): the tokens of shard ``shard`` from each of ``starts`` on."""
        if shard in self._open:
            self._open.remove(shard)
        self._open.append(shard)
        while len(self._open) > MOST_OPEN_SHARDS:
            self.shards[self._open.pop(0)].close()
        return self.shards[shard].rows(starts, self.block_size + 1)


class TokenFile:
    """A file of token ids, read where the windows are, never whole:
    nanoGPT's ``train.bin`` and ``val.bin`` (and any shard written the same
    way), as its ``data/<name>/prepare.py`` scripts write them with numpy's
    ``tofile``, uint16 ids back to back in native byte order (little-endian
    on x86 and ARM); a shard in llm.c's format (its ``dev/data`` scripts, and
    modded-nanogpt's FineWeb shards: ``fineweb_train_000001.bin`` ...), a
    header of 256 little-endian int32 (magic 20240520, version 1, the token
    count; ``LLMC_MAGIC``) before uint16 ids; or a NumPy ``.npy`` file of a
    1-D array of uint16 or int32 ids (``np.save``: build-nanogpt's
    ``edufineweb_train_000001.npy`` ...), its header read with
    ``numpy.lib.format``.

    ``len()``: its tokens. ``rows(starts, width)``: int64 (B, width), row b
    the ``width`` tokens from token ``starts[b]`` on (``starts`` int64
    (B,)). The file is memory-mapped (``torch.from_file``, private and
    read-only: nothing is written back) at the first ``rows`` in each
    process, so only the pages a window touches are read and held, and the
    operating system shares them between the processes of a node;
    ``close()`` drops the map (the next ``rows`` maps it again). Pickling
    it (a DataLoader worker started by a fork server gets a pickled dataset)
    sends the path, not the map: a mapped tensor sent to a worker would be
    copied whole into shared memory. uint16 ids are mapped as int16 (what
    every supported torch indexes) and read back as uint16 (0..65535).

    Raises ConfigError (one line) for a missing file, an odd number of bytes,
    an llm.c header of another version or whose token count is not what the
    file holds (a shard cut short by a copy), and a .npy file of another
    dtype or shape, or cut short.
    """

    def __init__(self, path: str) -> None:
        if not os.path.isfile(path):
            raise ConfigError(f"--dataset tokens: no {path}; {TOKEN_FILES_HINT}")
        with open(path, "rb") as f:
            self._read_header(path, os.path.getsize(path), f)

    def _read_header(self, path: str, size: int, f) -> None:
        """Take the format, dtype, offset and token count of the file
        ``path`` of ``size`` bytes from its header, read from ``f`` (a binary
        file object at byte 0 holding at least its first bytes)."""
        head = f.read(12)
        magic, version, count = struct.unpack("<3i", head) if len(head) == 12 else (0, 0, 0)
        self.offset = 0  # ids before the first one: llm.c's header, or a .npy file's
        self.dtype, self.mask = NPY_DTYPES["<u2"]  # uint16 ids, mapped as int16
        self.format = "bin"  # "bin" (headerless), "llm.c" or "npy"
        if head.startswith(NPY_MAGIC):
            f.seek(0)
            length = self._read_npy_header(path, size, f)
        elif magic == LLMC_MAGIC:
            self.format = "llm.c"
            if version != LLMC_VERSION:
                raise ConfigError(f"--dataset tokens: {path} is an llm.c token shard of version {version}; "
                                  f"the kit reads version {LLMC_VERSION} (uint16 ids, as llm.c's and "
                                  f"modded-nanogpt's FineWeb shards are)")
            if size != LLMC_HEADER_BYTES + 2 * count:
                raise ConfigError(f"--dataset tokens: {path}'s header gives {count:,} tokens, but the file "
                                  f"holds {(size - LLMC_HEADER_BYTES) / 2:,.1f} after its header: a shard cut "
                                  f"short (or grown) by a copy? Copy it again from where it was made")
            self.offset, length = LLMC_HEADER_BYTES // 2, count
        elif size % 2:
            raise ConfigError(f"--dataset tokens: {path} has {size:,} bytes, an odd number: not uint16 token "
                              f"ids (2 bytes each, as nanoGPT's prepare.py writes them); {TOKEN_FILES_HINT}")
        else:
            length = size // 2
        self.path, self.length = path, length
        self._tokens = None  # the map, made in each process at its first read

    def _read_npy_header(self, path: str, size: int, f) -> int:
        """Take the dtype and data offset of the .npy file ``path`` (``size``
        bytes) from its header, read from ``f`` (at byte 0); return its
        tokens. ConfigError (one line) if it is not a 1-D array of uint16 or
        int32 ids the file holds whole."""
        import numpy.lib.format as npy  # numpy comes with torchvision

        try:
            version = npy.read_magic(f)
            read_header = {(1, 0): npy.read_array_header_1_0, (2, 0): npy.read_array_header_2_0}[version]
            shape, _, dtype = read_header(f)
            data_bytes = f.tell()
        except (ValueError, KeyError, OSError) as exc:
            raise ConfigError(f"--dataset tokens: cannot read {path}'s NumPy header ({exc}); write it again "
                              f"with np.save") from None
        if dtype.str not in NPY_DTYPES or len(shape) != 1:
            raise ConfigError(f"--dataset tokens: {path} is a NumPy array of dtype {dtype.str} and shape "
                              f"{shape}; the kit reads a 1-D array of token ids of dtype uint16 or int32 "
                              f"(np.save(path, np.array(ids, dtype=np.uint16)), as build-nanogpt writes them)")
        self.dtype, self.mask = NPY_DTYPES[dtype.str]
        itemsize = dtype.itemsize
        if size != data_bytes + itemsize * shape[0] or data_bytes % itemsize:
            raise ConfigError(f"--dataset tokens: {path}'s header gives {shape[0]:,} tokens, but the file "
                              f"holds {(size - data_bytes) / itemsize:,.1f} after its header: a shard cut "
                              f"short (or grown) by a copy? Copy it again from where it was made")
        self.format, self.offset = "npy", data_bytes // itemsize
        return shape[0]

    def __len__(self) -> int:
        return self.length

    def __getstate__(self) -> dict:
        return {"path": self.path, "length": self.length, "offset": self.offset, "dtype": self.dtype,
                "mask": self.mask, "format": self.format}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._tokens = None

    def _ids(self, tokens: torch.Tensor) -> torch.Tensor:
        """The mapped ``tokens`` (this file's dtype) as int64 ids."""
        ids = tokens.to(torch.int64)
        return ids & self.mask if self.mask is not None else ids

    def rows(self, starts: torch.Tensor, width: int) -> torch.Tensor:
        if self._tokens is None:
            mapped = torch.from_file(self.path, shared=False, size=self.offset + self.length, dtype=self.dtype)
            self._tokens = mapped[self.offset:]
        return self._ids(self._tokens[starts[:, None] + torch.arange(width)])

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
        itemsize = self.dtype.itemsize
        starts = [itemsize * (self.offset + first) for first in firsts]
        ends = [start + itemsize * min(chunk_tokens, self.length - first) for start, first in zip(starts, firsts)]
        largest, where = -1, -1
        for first, data in zip(firsts, self._read_ranges(starts, ends)):
            ids = self._ids(torch.frombuffer(bytearray(data), dtype=self.dtype))
            top = int(ids.argmax())
            if int(ids[top]) > largest:
                largest, where = int(ids[top]), first + top
        return largest, where

    def _read_ranges(self, starts: list[int], ends: list[int]) -> list[bytes]:
        """The file's bytes from each of ``starts`` to each of ``ends``
        (exclusive), by plain file reads."""
        read = []
        with open(self.path, "rb") as f:
            for start, end in zip(starts, ends):
                f.seek(start)
                read.append(f.read(end - start))
        return read


class BucketTokenFile(TokenFile):
    """A ``TokenFile`` in a bucket (``s3://bucket/key``): the same formats,
    checks, ``len()``, ``rows`` and ``sample``, read by ranged GETs instead
    of a memory map. The header is one ranged read at construction. ``rows``
    reads the file in aligned blocks of ``block_bytes``: the blocks a
    batch's rows touch that are not cached are fetched at once (concurrent
    GETs, ``fsspec``'s ``cat_ranges``), and the blocks read last are kept,
    at most ``cache_bytes`` of them (least recently used dropped first; a
    single batch needing more holds them until its rows are cut). Each
    process (each DataLoader worker, forked or started by a fork server)
    reads through its own client (``bucket_filesystem``); pickling sends
    the URL, the size and the header's fields, never a client or a block.
    ``close()`` drops the blocks.

    Raises ConfigError (one line) as ``TokenFile`` does, and for a bucket
    that cannot be read (``bucket_errors``)."""

    def __init__(self, path: str, size: int, cache_bytes: int, block_bytes: int = BUCKET_BLOCK_BYTES) -> None:
        import io

        self.size, self.cache_bytes, self.block_bytes = size, cache_bytes, block_bytes
        self._blocks: dict = {}
        [head] = bucket_read(path, [0], [min(size, 4096)])  # a .npy header is ~128 bytes, llm.c's 1 KiB
        self._read_header(path, size, io.BytesIO(head))

    def __getstate__(self) -> dict:
        return {**super().__getstate__(), "size": self.size, "cache_bytes": self.cache_bytes,
                "block_bytes": self.block_bytes}

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._blocks = {}

    def _read_ranges(self, starts: list[int], ends: list[int]) -> list[bytes]:
        return bucket_read(self.path, starts, ends)

    def rows(self, starts: torch.Tensor, width: int) -> torch.Tensor:
        itemsize, block = self.dtype.itemsize, self.block_bytes
        firsts = ((self.offset + starts) * itemsize).tolist()  # each row's first byte
        spans = [(first // block, (first + width * itemsize - 1) // block) for first in firsts]
        missing = sorted({b for low, high in spans for b in range(low, high + 1)} - self._blocks.keys())
        if missing:
            ends = [min(self.size, (b + 1) * block) for b in missing]
            self._blocks.update(zip(missing, bucket_read(self.path, [b * block for b in missing], ends)))
        data = bytearray()
        for first, (low, high) in zip(firsts, spans):
            for b in range(low, high + 1):  # most recently used last: dict order is the LRU order
                self._blocks[b] = self._blocks.pop(b)
            joined = b"".join(self._blocks[b] for b in range(low, high + 1))
            data += joined[first - low * block:first - low * block + width * itemsize]
        while len(self._blocks) > max(1, self.cache_bytes // block):
            del self._blocks[next(iter(self._blocks))]
        return self._ids(torch.frombuffer(data, dtype=self.dtype).view(len(firsts), width))

    def close(self) -> None:
        """Drop this process's cached blocks of the file."""
        self._blocks = {}


_FILESYSTEM: list = [None, None]  # (the process id, its s3fs.S3FileSystem): one client a process


def bucket_filesystem():
    """This process's ``s3fs.S3FileSystem`` (fsspec's S3 client, over
    aiobotocore): made at its first use in each process, never one inherited
    across a fork (its event loop and connections belong to the parent; a
    DataLoader worker makes its own). Endpoint, region and credentials come
    from the standard AWS variables and files (``AWS_ENDPOINT_URL``,
    profiles), as boto reads them; time-outs and retries ``BUCKET_CLIENT``'s.
    Raises ConfigError (one line) where s3fs is not installed."""
    if _FILESYSTEM[0] != os.getpid():
        try:
            import s3fs
        except ImportError:
            raise ConfigError("--data_dir s3://...: reading token shards from a bucket needs s3fs (fsspec's S3 "
                              "client): pip install s3fs") from None
        _FILESYSTEM[:] = [os.getpid(), s3fs.S3FileSystem(skip_instance_cache=True, config_kwargs=BUCKET_CLIENT)]
    return _FILESYSTEM[1]


def bucket_errors(place: str, exc: BaseException) -> Optional[ConfigError]:
    """The one-line ConfigError for ``exc``, raised reading ``place`` (an
    ``s3://`` URL): a bucket that does not exist, credentials refused, an
    endpoint that does not answer (after ``BUCKET_CLIENT``'s retries); None
    for an error of another kind."""
    endpoint = os.environ.get("AWS_ENDPOINT_URL", "AWS's default endpoint")
    if isinstance(exc, FileNotFoundError):
        return ConfigError(f"--dataset tokens: {place} is not there ({exc}); create the bucket and upload the "
                           f"shards, or pass the --data_dir they are in; {BUCKET_HINT}")
    if isinstance(exc, PermissionError):
        return ConfigError(f"--dataset tokens: {place}: the store refuses these credentials ({exc}); "
                           f"{BUCKET_HINT}")
    try:
        from botocore.exceptions import BotoCoreError
    except ImportError:
        return None
    if isinstance(exc, (BotoCoreError, OSError)):
        return ConfigError(f"--dataset tokens: {place}: the endpoint {endpoint} does not answer ("
                           f"{type(exc).__name__}: {exc}); check AWS_ENDPOINT_URL and the network; {BUCKET_HINT}")
    return None


@contextlib.contextmanager
def bucket_access(place: str):
    """Around a read of ``place`` (an ``s3://`` URL): a failure
    ``bucket_errors`` knows is raised as its one-line ConfigError, any
    other as it is."""
    try:
        yield
    except Exception as exc:
        error = bucket_errors(place, exc)
        if error is None:
            raise
        raise error from None


def bucket_read(path: str, starts: list[int], ends: list[int]) -> list[bytes]:
    """The bytes of the object ``path`` (``s3://bucket/key``) from each of
    ``starts`` to each of ``ends`` (exclusive): ranged GETs, concurrent
    (``cat_ranges``), each retried as ``BUCKET_CLIENT`` says. Raises
    ConfigError (one line, ``bucket_errors``) where the bucket cannot be
    read."""
    with bucket_access(path):
        return bucket_filesystem().cat_ranges([path] * len(starts), starts, ends, on_error="raise")


def bucket_listing(data_dir: str) -> dict[str, int]:
    """{URL: bytes} of every object under the prefix ``data_dir``
    (``s3://bucket/prefix``), one listing. Raises ConfigError (one line)
    where there is none (``bucket_errors`` for a bucket that cannot be
    read)."""
    root = data_dir.rstrip("/")
    with bucket_access(data_dir):
        found = bucket_filesystem().find(root[len(BUCKET):], detail=True)
    listing = {BUCKET + name: info["size"] for name, info in found.items() if info.get("type") == "file"}
    if not listing:
        raise ConfigError(f"--dataset tokens: nothing under --data_dir {data_dir}: no object has that prefix; "
                          f"upload the token files there (aws s3 cp --recursive FOLDER {root}/), or pass the "
                          f"prefix they are under")
    return listing


def _matches(listing: dict[str, int], data_dir: str, pattern: str) -> list[str]:
    """The URLs of ``listing`` that the glob ``pattern`` matches, as
    ``glob.glob`` matches file names in a folder: relative to ``data_dir``
    unless it is an ``s3://`` URL itself; ``*`` never crosses a ``/``."""
    import fnmatch

    full = pattern if pattern.startswith(BUCKET) else f"{data_dir.rstrip('/')}/{pattern}"
    return [url for url in listing if fnmatch.fnmatchcase(url, full) and url.count("/") == full.count("/")]


class _PlainValues(pickle.Unpickler):
    """An unpickler of plain values only (dicts, lists, strings, numbers: what
    nanoGPT's meta.pkl holds): it imports nothing, so a meta.pkl made to run
    code when loaded is refused instead."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"it names {module}.{name}, and only plain values are read")


def read_meta(path: str, data: Optional[bytes] = None) -> dict:
    """nanoGPT's ``meta.pkl`` at ``path`` (``prepare.py`` of a character-level
    corpus writes it): a dict with ``vocab_size`` (an int, 1..65,536: the
    ids a uint16 file holds) and, for a vocabulary that can be written out,
    ``itos`` {id: string} and ``stoi`` {string: id}. Read without running
    code (``_PlainValues``). Raises ConfigError (one line) for a file that is
    not such a dict. ``data``: the file's bytes, read elsewhere (from a
    bucket), instead of reading ``path``."""
    import io

    try:
        with (io.BytesIO(data) if data is not None else open(path, "rb")) as f:
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


def token_files(data_dir: str, pattern: Optional[str], split: str, listing: Optional[dict] = None,
                cache_bytes: int = BUCKET_CACHE_MIB << 20) -> list:
    """The ``TokenFile``s of one split of --dataset tokens, in name order:
    those the glob ``pattern`` matches (--train_files, --val_files; relative
    to ``data_dir`` unless absolute), else the ``*{split}*.bin`` and
    ``*{split}*.npy`` files in ``data_dir``: nanoGPT's ``train.bin`` and
    ``val.bin``, or a set of shards (``fineweb_train_000001.bin`` ...;
    nanoGPT-style headerless shards or llm.c's; build-nanogpt's .npy ones:
    ``TokenFile``). Raises ConfigError (one line) when nothing matches, for a
    file ``TokenFile`` refuses, for a set that mixes .npy files with others
    (the same corpus in two formats, perhaps), and for one that mixes
    llm.c's shards with files without its header (a damaged magic would
    otherwise read as token ids). ``listing``: for a ``data_dir`` in a
    bucket (``s3://bucket/prefix``), its objects (``bucket_listing``), read
    as ``BucketTokenFile``s each caching at most ``cache_bytes``."""
    given = pattern is not None
    patterns = [pattern] if given else [f"*{split}*.bin", f"*{split}*.npy"]
    if listing is not None:
        matched = sorted({url for each in patterns for url in _matches(listing, data_dir, each)})
    else:
        matched = sorted({path for each in patterns for path in glob.glob(os.path.join(data_dir, each))
                          if os.path.isfile(path)})
    if not matched:
        flag = f"--{split}_files {pattern}" if given else f"no --{split}_files, so *{split}*.bin or *{split}*.npy"
        raise ConfigError(f"--dataset tokens: no {split} token files in --data_dir {data_dir} ({flag} matches "
                          f"nothing); {TOKEN_FILES_HINT}, or name the shards with --{split}_files GLOB")
    files = ([BucketTokenFile(url, listing[url], cache_bytes) for url in matched] if listing is not None
             else [TokenFile(path) for path in matched])
    numpy_files = [f for f in files if f.format == "npy"]
    if numpy_files and len(numpy_files) < len(files):
        other = next(f for f in files if f.format != "npy")
        raise ConfigError(f"--dataset tokens: the {split} files in --data_dir {data_dir} mix NumPy .npy files "
                          f"({numpy_files[0].path}) with others ({other.path}): the {split} files of a set are "
                          f"all in one format; pick one set with --{split}_files GLOB")
    headed = [f for f in files if f.format == "llm.c"]
    if headed and len(headed) < len(files):  # a damaged magic reads as a headerless file: refuse the mix
        plain = next(f for f in files if f.format != "llm.c")
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
    return f"{corpus_size(files)}, {digest.hexdigest()[:12]}"


def corpus_size(files: Sequence[TokenFile]) -> str:
    """A set of token files, for the task line: "3 files, 1,048,576 tokens"."""
    return f"{len(files)} file{'s' if len(files) > 1 else ''}, {sum(map(len, files)):,} tokens"


def _names(files: Sequence[TokenFile]) -> str:
    """A set of token files, for a message: the one path, or the first and how many."""
    return files[0].path if len(files) == 1 else f"{files[0].path} and {len(files) - 1} more"


def weights_vocabulary(args: argparse.Namespace, vocab_size: int, model_vocab: int, vocabulary: str) -> int:
    """The model's vocabulary: ``model_vocab`` (the corpus's ``vocab_size``,
    GPT-2's padded to 50,304 where no meta.pkl gives one), or under
    --init_from the weights' (``args.vocab_size``, ``train_utils.take_initial_sizes``),
    which must be the corpus's: meta.pkl's vocab_size exactly, GPT-2's 50,257
    or a padding of it (nanoGPT's 50,304) for a corpus of GPT-2's tokens.
    Raises ConfigError (one line) when they disagree: the same ids would be
    other tokens."""
    weights = getattr(args, "vocab_size", None)
    if weights is None:
        return model_vocab
    if weights == vocab_size or (model_vocab == GPT2_PADDED_VOCAB and weights >= GPT2_VOCAB):
        return weights
    raise ConfigError(f"--init_from {args.init_from}: its vocabulary has {weights:,} tokens, the corpus's "
                      f"{vocab_size:,} ({vocabulary}): the same ids would be other tokens; train on token files "
                      f"of the weights' tokenizer (and its meta.pkl), or start without --init_from")


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
    kit); under --init_from the weights' vocabulary, which must agree
    (``weights_vocabulary``). The ids are checked against it on a sample of each file
    (``check_token_ids``). Samples: ``TokenWindows`` of --block_size tokens,
    the training ones at a random offset (the character task's windows, so
    an epoch visits ``train.bin`` once), the held-out ones tiling ``val.bin``
    (the validation set; no test set). Model: a factory of ``gpt.GPT`` of the
    --n_layer --n_head --n_embd --block_size --dropout flags
    (``TOKEN_MODEL``'s where unset: GPT-2 small); loss ``lm_loss`` (nats per
    token); recipe ``TOKEN_RECIPE`` (nanoGPT's train.py defaults, with an
    evaluation every 2,000 steps over 2,400 held-out windows). Nothing is
    downloaded (``download`` is unused). Raises ConfigError (one line) for
    a missing file or folder, a file of an odd number of bytes or too short
    for one window, a bad meta.pkl, a vocabulary other than the weights', an
    id outside the vocabulary, a model other than ``gpt`` and bad sizes.
    """
    choose_model(args, MODELS["token_file_task"])
    config = model_config(args, TOKEN_MODEL)
    data_dir = str(args.data_dir)
    listing = cache_bytes = None
    if data_dir.startswith(BUCKET):
        cache_mib = getattr(args, "bucket_cache_mib", None) or BUCKET_CACHE_MIB
        if cache_mib < 1:
            raise ConfigError(f"--bucket_cache_mib {cache_mib}: give at least 1 (MiB of shard blocks a process keeps)")
        listing, cache_bytes = bucket_listing(data_dir), (cache_mib << 20) // MOST_OPEN_SHARDS
        meta_path = f"{data_dir.rstrip('/')}/meta.pkl"
        meta_data = bucket_read(meta_path, [0], [listing[meta_path]])[0] if meta_path in listing else None
        has_meta = meta_data is not None
    else:
        if not os.path.isdir(data_dir):
            raise ConfigError(f"--dataset tokens: --data_dir {data_dir} is not a folder; {TOKEN_FILES_HINT}")
        meta_path, meta_data = os.path.join(data_dir, "meta.pkl"), None
        has_meta = os.path.isfile(meta_path)
    train_files, val_files = (token_files(data_dir, getattr(args, flag, None), split, listing,
                                          cache_bytes or BUCKET_CACHE_MIB << 20)
                              for flag, split in (("train_files", "train"), ("val_files", "val")))
    decode = encode = None
    if has_meta:
        meta = read_meta(meta_path, meta_data)
        vocab_size = model_vocab = meta["vocab_size"]
        vocabulary = f"vocab_size of {meta_path}"
        itos, stoi = meta.get("itos"), meta.get("stoi")
        if isinstance(itos, dict) and isinstance(stoi, dict):
            words = MetaVocabulary(itos, stoi)
            decode, encode = words.decode, words.encode
    else:
        vocab_size, model_vocab = GPT2_VOCAB, GPT2_PADDED_VOCAB
        vocabulary = f"GPT-2's, as no {meta_path} gives another"
    model_vocab = weights_vocabulary(args, vocab_size, model_vocab, vocabulary)
    check_token_ids([*train_files, *val_files], vocab_size, vocabulary)
    block_size = config.block_size
    train, held_out = (TokenFileWindows(files, block_size, shift=split == "train", seed=args.seed,
                                        name=f"--dataset tokens: {_names(files)}")
                       for files, split in ((train_files, "train"), (val_files, "val")))
    gpt_config = dataclasses.replace(config, vocab_size=model_vocab)
    if getattr(args, "sample_chars", 0) and decode is None:
        raise ConfigError(f"--sample_chars: --dataset tokens writes text only with a vocabulary to decode, a "
                          f"meta.pkl holding itos and stoi beside the token files (GPT-2's BPE is not part of "
                          f"the kit); leave the flag out, or {TOKEN_FILES_HINT}")
    # A model factory: under FSDP train.py builds it on the meta device, each rank materialising its shards.
    return Task(train, held_out, None, functools.partial(GPT, gpt_config), lm_loss, classification=False,
                recipe=dict(TOKEN_RECIPE),
                tokens_per_sample=block_size, decode=decode, encode=encode,
                identity={**gpt_identity(gpt_config), "train_files": corpus_identity(train_files),
                          "val_files": corpus_identity(val_files)},
                sample_text=text_sampler(args, decode, encode) if decode else None,
                corpus=f"train {corpus_size(train_files)}, val {corpus_size(val_files)}, vocabulary "
                       f"{vocab_size:,} ({vocabulary})")


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
