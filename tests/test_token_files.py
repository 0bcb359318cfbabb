"""--dataset tokens: nanoGPT's token files (train.bin, val.bin, meta.pkl),
memory-mapped and cut into the character task's windows; evaluation every N
steps over a fixed set of held-out windows (--eval_every_steps,
--eval_windows) with the best validation loss kept; GPT-2's sizes.

In process: the task against --dataset shakespeare_char on the same text
(the same windows, vocabulary and model), its one-line errors, GPT-2 small
with the padded vocabulary, the held-out subset and the step evaluations'
bookkeeping. End to end (2 ranks, a tiny GPT evaluated every 25 steps): the
same evaluation lines and weights as the character task (its epoch lines
over nanoGPT's whole CPU recipe: docs/language-model.md's results table);
the same tokens as NumPy .npy files (build-nanogpt's shards) print the
same evaluation lines; a run stopped mid-interval and during an
evaluation resumes bitwise (DDP), and mid-interval under FSDP; a token file
of gigabytes trains in a small fraction of its size in memory."""

from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import re
import shutil
import signal
import sys

import pytest
import torch

import common
import recipes
import token_tasks
from dataset_files import build_shakespeare_root, build_token_files
from support.data import write_token_shard
from helpers import (FAULTY_TRAIN, REPO, PODS, stdout_lines, assert_bitwise, check, epochs, error_lines, evaluations,
                     full_state, one_process, run, signal_when, snapshot_folder, snapshot_tensors, task_args, tiny_gpt_run)

KIT = PODS + ["--nproc_per_node=2"]
CHARS = 20000  # the corpus's first 20,000 characters: 1,124 training windows of 16, 70 steps an epoch at 2 x 8


def lm_args(dataset: str, data_dir, **flags) -> argparse.Namespace:
    """What train.py passes common.load_task, no recipe flag given."""
    return task_args(dataset, data_dir, **{**{name: None for name in recipes.RECIPE_DEFAULTS}, **flags})


def tiny(**flags) -> dict:
    return dict(n_layer=1, n_head=2, n_embd=32, block_size=16, **flags)


# --------------------------------------------------------------------------
# The task, in process
# --------------------------------------------------------------------------

def test_token_files_are_the_character_tasks_text_read_where_the_windows_are(tmp_path):
    """Tiny Shakespeare as nanoGPT's shakespeare_char/prepare.py writes it:
    the token task has the character task's vocabulary (meta.pkl), split,
    windows (the same random offsets from the same seed), held-out windows
    and initial weights. A pickled TokenFile (what a DataLoader worker gets)
    is its path, not its tokens, and reads the same. The defaults are
    nanoGPT's train.py (its GPT-2 recipe)."""
    chars = build_shakespeare_root(tmp_path / "chars")
    tokens = build_token_files(tmp_path / "tokens")
    torch.manual_seed(0)
    char_task = common.load_task(lm_args("shakespeare_char", chars, **tiny()), download=False)
    torch.manual_seed(0)
    args = lm_args("tokens", tokens, **tiny())
    token_task = common.load_task(args, download=False)
    assert token_task.decode(range(65)) == char_task.decode(range(65))
    assert token_task.encode("ROMEO:\n") == char_task.encode("ROMEO:\n")
    assert (len(token_task.train_set), len(token_task.val_set)) == (len(char_task.train_set), len(char_task.val_set))
    last = len(token_task.train_set) - 1
    windows = []
    for task in (char_task, token_task):
        torch.manual_seed(1)
        windows.append([*task.train_set.__getitems__([0, 7, 4000, last]),
                        *task.val_set.__getitems__([0, 1, len(task.val_set) - 1])])
    for a, b in zip(*windows):
        assert a.dtype == b.dtype == torch.int64 and torch.equal(a, b)
    weights = []
    for task in (char_task, token_task):  # each gives a model factory: built at the first read, from the seed
        torch.manual_seed(0)
        weights.append(task.model.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(*(w.values() for w in weights)))
    [train_file] = token_task.train_set.shards
    assert isinstance(train_file, token_tasks.TokenFile) and len(train_file) == int(1115394 * 0.9)
    sent = pickle.dumps(train_file)
    assert len(sent) < 500 and str(tokens / "train.bin").encode() in sent
    again = pickle.loads(sent)
    assert again._tokens is None  # mapped where it is read
    starts = torch.tensor([0, 5, len(train_file) - 3])
    assert torch.equal(again.rows(starts, 3), train_file.rows(starts, 3))
    assert token_task.test_set is None and token_task.tokens_per_sample == 16
    recipes.set_recipe_flags(args, token_task.recipe)  # as every script does after loading the task
    assert {name: getattr(args, name) for name in token_tasks.TOKEN_RECIPE} == token_tasks.TOKEN_RECIPE


def _write(path, ids) -> None:
    import array

    with open(path, "wb") as f:
        array.array("H", ids).tofile(f)


def shard_folder(folder, tokens: list, parts: int, header: bool, val: list) -> None:
    """``folder`` with ``tokens`` cut into ``parts`` shards fineweb_train_00000k.bin (k from 1, as
    llm.c numbers them) and ``val`` as fineweb_val_000000.bin."""
    folder.mkdir(parents=True)
    size = -(-len(tokens) // parts)
    for k in range(parts):
        write_token_shard(folder / f"fineweb_train_{k + 1:06d}.bin", tokens[k * size:(k + 1) * size], header)
    write_token_shard(folder / "fineweb_val_000000.bin", val, header)


def npy_shard_folder(folder, tokens: list, parts: int, dtype: str, val: list) -> None:
    """``folder`` with ``tokens`` cut into ``parts`` NumPy files edufineweb_train_00000k.npy
    (np.save of a 1-D array of ``dtype``, as build-nanogpt's fineweb.py writes its
    shards) and ``val`` as edufineweb_val_000000.npy."""
    import numpy as np

    folder.mkdir(parents=True)
    size = -(-len(tokens) // parts)
    for k in range(parts):
        part = [t & 0xFFFF for t in tokens[k * size:(k + 1) * size]]
        np.save(folder / f"edufineweb_train_{k + 1:06d}.npy", np.array(part, dtype=dtype))
    np.save(folder / "edufineweb_val_000000.npy", np.array([t & 0xFFFF for t in val], dtype=dtype))


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch ran.txt",))


def test_bad_token_files_are_one_line_each_and_left_as_they_are(tmp_path, monkeypatch):
    """A missing folder or file, an odd number of bytes, a meta.pkl that is no
    vocabulary (or is made to run code: refused, the code not run), an id
    outside the vocabulary (meta.pkl's, or GPT-2's 50,257 without one), a
    file too short for one window: one ConfigError line each, naming the
    file; no file written or changed."""
    monkeypatch.chdir(tmp_path)
    good = build_token_files(tmp_path / "good", chars=4000)
    cases = []

    def case(name, error, **flags):
        folder = tmp_path / name
        folder.mkdir()
        for part in ("train.bin", "val.bin", "meta.pkl"):
            (folder / part).write_bytes((good / part).read_bytes())
        cases.append((folder, error, flags))
        return folder

    (case("no_val", r"no val token files in --data_dir .*no_val \(no --val_files, so \*val\*.bin or "
                    r"\*val\*.npy matches nothing\); make train.bin and val.bin .* nanoGPT's data/<name>/prepare.py")
     / "val.bin").unlink()
    with open(case("odd", r"odd/train.bin has 7,201 bytes, an odd number: not uint16 token ids") / "train.bin",
              "ab") as f:
        f.write(b"\0")
    with open(case("unsafe", r"cannot read .*unsafe/meta.pkl as nanoGPT's meta.pkl \(it names posix.system")
              / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": _Boom()}, f)
    with open(case("no_size", r"no_size/meta.pkl gives no vocab_size from 1 to 65,536 \(it holds None\)")
              / "meta.pkl", "wb") as f:
        pickle.dump({"itos": {}}, f)
    with open(case("small_vocab", r"small_vocab/train.bin holds token id \d+ \(token [\d,]+\), outside the "
                   r"vocabulary of 20 \(vocab_size of .*meta.pkl\)") / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": 20}, f)
    gpt2 = case("gpt2", r"gpt2/val.bin holds token id 50257 \(token 3\), outside the vocabulary of 50,257 "
                r"\(GPT-2's, as no .*meta.pkl gives another\)")
    (gpt2 / "meta.pkl").unlink()
    _write(gpt2 / "val.bin", [1, 2, 3, 50257] + [5] * 200)
    _write(case("short", r"short/val.bin of 16 tokens is too short for one window of --block_size 16 "
                r"\(\+1 for the targets\); pass a smaller --block_size") / "val.bin", [1] * 16)
    cases.append((tmp_path / "absent", r"--data_dir .*absent is not a folder", {}))
    for folder, error, flags in cases:
        before = {p.name: p.read_bytes() for p in folder.iterdir()} if folder.is_dir() else None
        with pytest.raises(common.ConfigError, match=error) as info:
            common.load_task(lm_args("tokens", folder, **tiny(**flags)), download=False)
        assert "\n" not in str(info.value) and str(info.value).startswith("--dataset tokens: ")
        assert before is None or {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert not (tmp_path / "ran.txt").exists()


def test_shards_in_llmcs_format_and_headerless_give_the_same_windows_none_across_a_shards_end(tmp_path):
    """The training text as 3 shards, once with llm.c's header, once
    without (nanoGPT-style), found by *train*.bin / *val*.bin, and as
    build-nanogpt's NumPy .npy shards (uint16, and int32), found by
    *train*.npy / *val*.npy: all give the same windows; each window lies inside one shard (the count is the sum of
    each shard's own windows) and holds that shard's tokens where its index
    says, at its keyed offset; --train_files picks a subset; the index is
    one int64 a shard, not a window."""
    good = build_token_files(tmp_path / "good", chars=CHARS)
    train = torch.frombuffer(bytearray((good / "train.bin").read_bytes()), dtype=torch.int16).tolist()
    val = torch.frombuffer(bytearray((good / "val.bin").read_bytes()), dtype=torch.int16).tolist()
    for name, header in (("llmc", True), ("plain", False)):
        shard_folder(tmp_path / name, train, 3, header, val)
        (tmp_path / name / "meta.pkl").write_bytes((good / "meta.pkl").read_bytes())
    for name, dtype in (("npy_uint16", "uint16"), ("npy_int32", "int32")):
        npy_shard_folder(tmp_path / name, train, 3, dtype, val)
        (tmp_path / name / "meta.pkl").write_bytes((good / "meta.pkl").read_bytes())
    tasks = {name: common.load_task(lm_args("tokens", tmp_path / name, **tiny()), download=False)
             for name in ("llmc", "plain", "npy_uint16", "npy_int32")}
    windows = tasks["llmc"].train_set
    size = -(-len(train) // 3)
    shards = [train[k * size:(k + 1) * size] for k in range(3)]
    assert [len(f) for f in windows.shards] == [len(part) for part in shards]
    assert len(windows) == sum((len(part) - 1 - 15) // 16 for part in shards) < (len(train) - 1 - 15) // 16
    assert windows._first.numel() * 8 <= 8 * 4  # one int64 a shard (and one more)
    for name in ("llmc", "plain", "npy_uint16", "npy_int32"):
        tasks[name].train_set.set_epoch(2)
    indices = list(range(len(windows)))
    rows = windows.windows(indices)
    for name in ("plain", "npy_uint16", "npy_int32"):
        assert torch.equal(rows, tasks[name].train_set.windows(indices)), name
        assert torch.equal(tasks["llmc"].val_set.windows([0, 3]), tasks[name].val_set.windows([0, 3])), name
    assert [f.format for f in tasks["npy_int32"].train_set.shards] == ["npy"] * 3
    first = windows._first.tolist()
    for index in (0, first[1] - 1, first[1], len(windows) - 1):  # a shard's first and last windows
        shard = max(k for k in range(3) if first[k] <= index)
        start = (index - first[shard]) * 16 + common.draw_key(0, 2, index) % 16
        assert rows[index].tolist() == [t & 0xFFFF for t in shards[shard][start:start + 17]]
    picked = common.load_task(lm_args("tokens", tmp_path / "llmc", train_files="*_00000[12].bin", **tiny()),
                              download=False)
    assert [os.path.basename(f.path) for f in picked.train_set.shards] == ["fineweb_train_000001.bin",
                                                                           "fineweb_train_000002.bin"]
    # The shards are the run's identity: a resume onto a set changed (here a shard removed) is refused.
    from train_utils.snapshots.file import check_same_run

    identity = tasks["llmc"].identity
    assert identity["train_files"].startswith(f"3 files, {len(train):,} tokens, ")
    (tmp_path / "llmc" / "fineweb_train_000003.bin").unlink()
    fewer = common.load_task(lm_args("tokens", tmp_path / "llmc", **tiny()), download=False).identity
    with pytest.raises(common.ConfigError, match=r"snapshot s.pt comes from a different run \(train_files 3 files, "
                       r"[\d,]+ tokens, \w{12} -> 2 files, [\d,]+ tokens, \w{12}\)"):
        check_same_run({"config": {"task_identity": identity}}, "s.pt", {"task_identity": fewer})


def test_bad_shards_are_one_line_each_and_left_as_they_are(tmp_path):
    """llm.c's header of another version; a token count the file does not
    hold (a shard cut short); a set mixing shards with and without the
    header (a damaged magic); no file matching --train_files; a .npy file of
    floats, of 2 dimensions, or cut short; .npy files beside .bin ones: one
    ConfigError line each, naming the file; nothing written."""
    ids = list(range(65)) * 20
    cases = []

    def case(name, error, **flags):
        folder = tmp_path / name
        shard_folder(folder, ids, 2, True, ids)
        cases.append((folder, error, flags))
        return folder

    write_token_shard(case("version", r"version/fineweb_train_000002.bin is an llm.c token shard of version 2; the kit "
                     r"reads version 1") / "fineweb_train_000002.bin", ids[:650], True, version=2)
    with open(case("cut", r"cut/fineweb_train_000002.bin's header gives 650 tokens, but the file holds 649.5 "
                   r"after its header: a shard cut short") / "fineweb_train_000002.bin", "r+b") as f:
        f.truncate(1024 + 1299)
    write_token_shard(case("mixed", r"mixed/fineweb_train_000002.bin has no llm.c header \(magic 20240520\), while "
                     r".*mixed/fineweb_train_000001.bin has one") / "fineweb_train_000002.bin", ids[:650], False)
    case("glob", r"no train token files in --data_dir .*glob \(--train_files train_\*.bin matches nothing\)",
         train_files="train_*.bin")
    import numpy as np

    def npy_case(name, error, array):
        folder = tmp_path / name
        npy_shard_folder(folder, ids, 2, "uint16", ids)
        np.save(folder / "edufineweb_train_000002.npy", array)
        cases.append((folder, error, {}))
        return folder

    npy_case("npy_float", r"npy_float/edufineweb_train_000002.npy is a NumPy array of dtype <f4 and shape "
             r"\(650,\); the kit reads a 1-D array of token ids of dtype uint16 or int32",
             np.array(ids[:650], dtype=np.float32))
    npy_case("npy_2d", r"npy_2d/edufineweb_train_000002.npy is a NumPy array of dtype <u2 and shape \(325, 2\)",
             np.array(ids[:650], dtype=np.uint16).reshape(325, 2))
    with open(npy_case("npy_cut", r"npy_cut/edufineweb_train_000002.npy's header gives 650 tokens, but the file "
                       r"holds 649.5 after its header: a shard cut short", np.array(ids[:650], dtype=np.uint16))
              / "edufineweb_train_000002.npy", "r+b") as f:
        f.truncate(128 + 1299)
    np.save(case("npy_mixed", r"the train files in --data_dir .*npy_mixed mix NumPy .npy files "
                 r"\(.*edufineweb_train_000001.npy\) with others \(.*fineweb_train_000001.bin\): the train files "
                 r"of a set are all in one format; pick one set with --train_files GLOB")
            / "edufineweb_train_000001.npy", np.array(ids, dtype=np.uint16))
    for folder, error, flags in cases:
        before = {p.name: p.read_bytes() for p in folder.iterdir()}
        with pytest.raises(common.ConfigError, match=error) as info:
            common.load_task(lm_args("tokens", folder, **tiny(**flags)), download=False)
        assert "\n" not in str(info.value) and str(info.value).startswith("--dataset tokens: ")
        assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


# --------------------------------------------------------------------------
# Token shards in a bucket (--data_dir s3://bucket/prefix), in process
# --------------------------------------------------------------------------

def upload(s3_server, folder, bucket: str, prefix: str) -> str:
    """Every file of ``folder`` put in a new ``bucket`` of the test's S3 server
    under ``prefix``/ (as ``aws s3 cp --recursive`` does); returns the
    ``s3://bucket/prefix`` URL."""
    url = s3_server.create_bucket(bucket)
    client = s3_server.client()
    for path in sorted(folder.iterdir()):
        client.upload_file(str(path), bucket, f"{prefix}/{path.name}")
    return f"{url}/{prefix}"


@pytest.fixture
def bucket_env(s3_server, monkeypatch):
    """The test's S3 server in the standard AWS variables, and a new client
    for this process (token_tasks makes one a process, from the variables)."""
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(token_tasks, "_FILESYSTEM", [None, None], raising=False)
    return s3_server


def test_shards_in_a_bucket_give_the_disks_windows_in_the_same_keyed_order(tmp_path, bucket_env):
    """llm.c shards uploaded to a bucket, --data_dir s3://bucket/prefix: the
    task has the folder's shards (an object one level deeper is not
    matched, as a glob does not match it in a folder), vocabulary and
    identity; at 2 ranks x 2 DataLoader workers (forked from a process that
    has read the bucket already: each makes its own client; train.py's
    workers come from its fork server, below) each rank's batches of epoch
    1's keyed order are the disk's,
    bitwise, with blocks of 1,000 bytes and a cache of 3 (rows across
    blocks, blocks dropped and fetched again); a pickled shard is its URL, and
    the cache holds at most its bound."""
    from torch.utils.data import DataLoader

    import train_utils

    good = build_token_files(tmp_path / "good", chars=CHARS)
    train = torch.frombuffer(bytearray((good / "train.bin").read_bytes()), dtype=torch.int16).tolist()
    val = torch.frombuffer(bytearray((good / "val.bin").read_bytes()), dtype=torch.int16).tolist()
    shard_folder(tmp_path / "llmc", train, 3, True, val)
    (tmp_path / "llmc" / "meta.pkl").write_bytes((good / "meta.pkl").read_bytes())
    url = upload(bucket_env, tmp_path / "llmc", "corpus", "fineweb")
    bucket_env.client().put_object(Bucket="corpus", Key="fineweb/old/fineweb_train_000009.bin",
                                   Body=(tmp_path / "llmc" / "fineweb_train_000001.bin").read_bytes())
    disk = common.load_task(lm_args("tokens", tmp_path / "llmc", **tiny()), download=False)
    bucket = common.load_task(lm_args("tokens", url, **tiny()), download=False)
    assert [os.path.basename(f.path) for f in bucket.train_set.shards] == [
        f"fineweb_train_00000{k}.bin" for k in (1, 2, 3)]
    assert all(isinstance(f, token_tasks.BucketTokenFile) for f in bucket.train_set.shards)
    assert bucket.identity == disk.identity and bucket.decode(range(20)) == disk.decode(range(20))
    assert bucket.corpus.endswith(f"(vocab_size of {url}/meta.pkl)")
    for shard in bucket.train_set.shards:
        shard.block_bytes, shard.cache_bytes = 1000, 3000
    held_out = list(range(len(disk.val_set)))
    assert torch.equal(bucket.val_set.windows(held_out), disk.val_set.windows(held_out))  # read before the forks
    for task in (disk, bucket):
        task.train_set.set_epoch(1)
    for rank in (0, 1):
        sampler = train_utils.ResumableDistributedSampler(bucket.train_set, 2, rank, seed=0)
        sampler.set_epoch(1)
        order = list(sampler)
        expected = [torch.cat(disk.train_set.__getitems__(order[i:i + 8]), 1) for i in range(0, len(order) - 7, 8)]
        loader = DataLoader(bucket.train_set, batch_size=8, sampler=sampler, drop_last=True,
                            collate_fn=common.collate, num_workers=2, multiprocessing_context="fork")
        batches = [torch.cat(batch, 1) for batch in loader]
        assert len(batches) == len(expected) == len(disk.train_set) // 16, rank
        assert all(torch.equal(a, b) for a, b in zip(batches, expected)), rank
    shard = bucket.train_set.shards[1]
    starts = torch.tensor([0, 95, 3000, 5300])
    assert torch.equal(shard.rows(starts, 600), disk.train_set.shards[1].rows(starts, 600))  # 2 or 3 blocks a row
    assert 0 < len(shard._blocks) <= 3
    sent = pickle.dumps(shard)
    assert len(sent) < 600 and f"{url}/fineweb_train_000002.bin".encode() in sent
    assert pickle.loads(sent)._blocks == {}


def test_bad_bucket_places_are_one_line_each(tmp_path, bucket_env, monkeypatch):
    """--data_dir s3://...: a bucket that does not exist, a prefix with no
    object under it, a prefix without token files, an endpoint that does not
    answer (within 90 s: bounded time-outs and retries), and s3fs not
    installed: one ConfigError line each, saying what to do."""
    import time

    folder = tmp_path / "small"
    shard_folder(folder, list(range(65)) * 20, 1, True, list(range(65)) * 20)
    url = upload(bucket_env, folder, "small", "shards")
    cases = [("s3://no-such-bucket/shards", r"s3://no-such-bucket/shards is not there \(.*\); create the bucket "
                                            r"and upload the shards.*AWS_ENDPOINT_URL"),
             ("s3://small/none", r"nothing under --data_dir s3://small/none: no object has that prefix; upload "),
             (url, r"no train token files in --data_dir s3://small/shards \(--train_files train_\*.bin matches "
                   r"nothing\)")]
    for data_dir, error in cases:
        flags = {"train_files": "train_*.bin"} if data_dir == url else {}
        with pytest.raises(common.ConfigError, match=error) as info:
            common.load_task(lm_args("tokens", data_dir, **tiny(**flags)), download=False)
        assert "\n" not in str(info.value) and str(info.value).startswith("--dataset tokens: ")
    from support.ports import free_port

    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    monkeypatch.setattr(token_tasks, "_FILESYSTEM", [None, None], raising=False)
    started = time.monotonic()
    with pytest.raises(common.ConfigError, match=r"^--dataset tokens: s3://small/shards: the endpoint "
                       r"http://127.0.0.1:\d+ does not answer \(.*\); check AWS_ENDPOINT_URL and the network"):
        common.load_task(lm_args("tokens", url, **tiny()), download=False)
    assert time.monotonic() - started < 90
    monkeypatch.setitem(sys.modules, "s3fs", None)  # as where it is not installed: importing it fails
    monkeypatch.setattr(token_tasks, "_FILESYSTEM", [None, None], raising=False)
    with pytest.raises(common.ConfigError, match=r"^--data_dir s3://\.\.\.: reading token shards from a bucket "
                       r"needs s3fs \(fsspec's S3 client\): pip install s3fs$"):
        common.load_task(lm_args("tokens", url, **tiny()), download=False)


def test_gpt2_small_with_the_padded_vocabulary_takes_a_step(tmp_path):
    """Without meta.pkl, GPT-2's vocabulary: the default sizes are GPT-2
    small's (12 layers, 12 heads, 768 wide, a 1,024-token context), the
    embedding padded to 50,304 rows (nanoGPT's choice), 123.6M parameters
    besides the position embedding; its loss on GPT-2 ids starts near a
    uniform guess's, ln 50,304, and a backward pass gives every parameter
    a gradient."""
    folder = tmp_path / "gpt2"
    folder.mkdir()
    g = torch.Generator().manual_seed(0)
    for name in ("train.bin", "val.bin"):
        _write(folder / name, torch.randint(0, 50257, (3000,), generator=g).tolist())
    torch.manual_seed(0)
    task = common.load_task(lm_args("tokens", folder), download=False)
    config = task.model.config
    assert (config.n_layer, config.n_head, config.n_embd, config.block_size, config.vocab_size) == \
        (12, 12, 768, 1024, 50304)
    per_block = 2 * 768 + 768 * 3 * 768 + 768 * 768 + 2 * 768 * 4 * 768
    assert task.model.num_parameters(embeddings=False) == 50304 * 768 + 12 * per_block + 768 == 123_587_328  # nanoGPT prints "123.59M"
    assert task.decode is None and task.encode is None  # GPT-2's BPE is not part of the kit
    x, y = task.train_set.__getitems__([0])
    loss = task.loss_fn(task.model(x[:, :32]), y[:, :32])
    assert abs(loss.item() - math.log(50304)) < 0.5
    loss.backward()
    assert all(p.grad is not None for p in task.model.parameters())


def test_eval_windows_are_a_fixed_subset_and_step_evaluations_keep_the_best(one_process_group):
    """--eval_windows: the same sorted subset from the same seed, another from
    another seed, the whole set for 0 or more than it holds. Evaluations by
    steps: due every N steps and at the last, once each; the record's
    training loss is the interval's (carried over a snapshot), the best
    validation loss and its step are kept, and a snapshot's state gives them
    back."""
    import train_utils

    data = list(range(1000))
    subset = train_utils.eval_subset(data, 40, seed=3)
    assert list(subset.indices) == sorted(subset.indices) and len(set(subset.indices)) == 40
    assert train_utils.eval_subset(data, 40, seed=3).indices == subset.indices
    assert train_utils.eval_subset(data, 40, seed=4).indices != subset.indices
    assert train_utils.eval_subset(data, 0, 3) is data and train_utils.eval_subset(data, 1000, 3) is data
    evals = train_utils.Evaluations(25, 60, 2, torch.device("cpu"))
    assert [step for step in range(1, 61) if evals.due(step, epoch_end=step == 30)] == [25, 50, 60]
    by_epochs = train_utils.Evaluations(0, 60, 2, torch.device("cpu"))
    assert not by_epochs.due(25, epoch_end=False) and by_epochs.due(30, epoch_end=True)
    evals.add(torch.tensor(2.0), 8)
    evals.add(torch.tensor(4.0), 8)
    first = evals.record(25, evals.summary(), (3.5, None))
    assert (first["train_loss"], first["best_val_loss"], first["best_step"], first["samples"]) == (3.0, 3.5, 25, 16)
    assert first["samples_per_s"] > 0 and not evals.due(25, False) and evals.due(50, False)
    evals.add(torch.tensor(1.0), 8)
    state = evals.state_dict()
    resumed = train_utils.Evaluations(25, 60, 2, torch.device("cpu"))
    resumed.load_state_dict(state)
    resumed.add(torch.tensor(3.0), 8)
    second = resumed.record(50, resumed.summary(), (3.7, None))
    assert (second["train_loss"], second["best_val_loss"], second["best_step"]) == (2.0, 3.5, 25)
    assert resumed.record(60, resumed.summary(), (3.1, None))["best_step"] == 60
    assert second["samples"] == 16 and second["samples_per_s"] > 0


# --------------------------------------------------------------------------
# End to end: parity with the character task, exact resume, memory
# --------------------------------------------------------------------------

def step_flags(data, dataset: str = "tokens", strategy: str = "ddp") -> list:
    """The tiny GPT's run (helpers.tiny_gpt_run: 80 steps, 70 in epoch 1; evaluations after
    steps 25, 50, 75 and 80) on ``dataset`` in ``data``, under ``strategy``."""
    return [*tiny_gpt_run(dataset, data), "--strategy", strategy]


@pytest.fixture(scope="module")
def uninterrupted(kit_run, tiny_corpus):
    """The data and the uninterrupted runs the tests below compare with: the
    token files and the text of the corpus's first 20,000 characters
    (tiny_corpus), and train.py (2 ranks) on each with ``step_flags``, DDP,
    and on the token files under FSDP: {name: (folder, stdout)}, names
    "shakespeare_char", "tokens", "tokens-fsdp" (conftest's kit_run: the
    session's tests share them); and the two data folders."""
    runs = {}
    for name, dataset, strategy in (("shakespeare_char", "shakespeare_char", "ddp"), ("tokens", "tokens", "ddp"),
                                    ("tokens-fsdp", "tokens", "fsdp")):
        runs[name] = kit_run(strategy, *tiny_gpt_run(dataset, tiny_corpus[dataset]))
    return runs, tiny_corpus


def test_token_files_train_as_the_character_task_does(uninterrupted):
    """train.py, 2 ranks, a tiny GPT with dropout: --dataset tokens on the
    shakespeare_char layout of the corpus's first 20,000 characters and
    --dataset shakespeare_char on the same text, with the same flags (80
    steps, 70 of them in epoch 1, evaluated every 25 steps), print the same
    summary lines, one an evaluation, and end with bitwise the same weights,
    AdamW state, schedule and RNG states. The evaluation lines carry the
    interval's training loss, the best validation loss and its step, and the
    metrics records too; no epoch line."""
    runs, _ = uninterrupted
    lines = {name: evaluations(runs[name][1]) for name in ("shakespeare_char", "tokens")}
    assert [(e["step"], e["total_steps"], e["epoch"]) for e in lines["tokens"]] == [
        ("25", "80", "1"), ("50", "80", "1"), ("75", "80", "2"), ("80", "80", "2")], runs["tokens"][1]
    assert lines["tokens"] == lines["shakespeare_char"]
    assert not epochs(runs["tokens"][1])  # an evaluation's line each, no epoch line
    best = min(lines["tokens"], key=lambda e: float(e["val_loss"]))
    assert (lines["tokens"][-1]["best_val_loss"], lines["tokens"][-1]["best_step"]) == (best["val_loss"], best["step"])
    records = [json.loads(line) for line in (runs["tokens"][0] / "metrics.jsonl").read_text().splitlines()][1:]
    assert [r["step"] for r in records] == [25, 50, 75, 80] and records[-1]["best_step"] == int(best["step"])
    assert [r["samples"] for r in records] == [400, 400, 400, 80]  # 25 steps x 16 windows; the last 5
    # The run's samples and tokens so far, each record's (windows of 16 tokens):
    assert [(r["samples_run"], r["tokens_run"]) for r in records] == [(400, 6400), (800, 12800), (1200, 19200),
                                                                      (1280, 20480)]
    (steps_a, a), (steps_b, b) = (snapshot_tensors(runs[name][0] / "snapshot_train.pt", rng=True)
                                  for name in ("tokens", "shakespeare_char"))
    assert steps_a == steps_b == 1 and a.keys() == b.keys()  # both inside epoch 2, after its 10th step
    assert [name for name in a if not torch.equal(a[name], b[name])] == []


def test_the_task_line_names_the_model_its_parameters_the_corpus_and_its_vocabulary(uninterrupted):
    """After the start-up line rank 0 says what trains on what, once: the
    task, the model's class and parameters (the tied embedding once; whole
    under FSDP, where each rank holds a shard), each split's samples (windows
    of 16 tokens), and the corpus: its tokens to train and held out, and the
    vocabulary (the text's characters; the token files' meta.pkl)."""
    import gpt

    runs, corpus = uninterrupted
    text = (corpus["shakespeare_char"] / "shakespeare_char" / "input.txt").read_text()
    vocabulary = len(set(text))
    model = gpt.GPT(gpt.GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=vocabulary))
    parameters = sum(p.numel() for p in model.parameters())
    meta = os.path.join(corpus["tokens"], "meta.pkl")
    lines = {name: [line for line in stdout_lines(runs[name][1]) if line.startswith("task ")] for name in runs}
    windows = {split: (tokens - 1) // 16 for split, tokens in (("train", 18000), ("val", 2000))}  # 16 + 1 tokens each
    model_and_samples = f"model GPT, {parameters:,} parameters | samples train {windows['train']:,}, val {windows['val']}"
    assert lines["shakespeare_char"] == [
        f"task shakespeare_char | {model_and_samples} | corpus Tiny Shakespeare, 18,000 tokens to train and "
        f"2,000 held out, vocabulary {vocabulary} (its characters)"], runs["shakespeare_char"][1][:2000]
    assert lines["tokens"] == lines["tokens-fsdp"] == [
        f"task tokens | {model_and_samples} | corpus train 1 file, 18,000 tokens, val 1 file, 2,000 tokens, "
        f"vocabulary {vocabulary} (vocab_size of {meta})"], runs["tokens"][1][:2000]


def test_npy_files_of_the_same_tokens_print_the_same_evaluation_lines(uninterrupted, tmp_path):
    """build-nanogpt's format: the token files above saved as NumPy .npy
    files (np.save of uint16 ids, edufineweb_train_000001.npy ...; found by
    the default globs), the same run: the same evaluation lines."""
    import numpy as np

    runs, corpus = uninterrupted
    data = tmp_path / "npy"
    data.mkdir()
    for split in ("train", "val"):
        ids = np.fromfile(corpus["tokens"] / f"{split}.bin", dtype=np.uint16)
        np.save(data / f"edufineweb_{split}_000001.npy", ids)
    shutil.copy(corpus["tokens"] / "meta.pkl", data / "meta.pkl")
    result = check(run(KIT + [REPO / "train.py", *step_flags(data)], tmp_path, OMP_NUM_THREADS="1"))
    assert evaluations(result.stdout) == evaluations(runs["tokens"][1]) != []


def test_a_token_run_stopped_mid_interval_and_during_an_evaluation_resumes_bitwise(uninterrupted, tmp_path):
    """DDP, 2 ranks, the run above. SIGTERM at step 37 (mid-interval; the
    ranks stop after step 37 or 38), then, resumed, at step 50's evaluation
    (every rank stops after one evaluation batch; the snapshot of step 50 is
    saved): the third run evaluates step 50 first and trains on. Every
    evaluation line is the uninterrupted run's but for speed (the training
    loss over each interval too, carried through both stops; the best
    validation loss and its step), each printed once, each record counts the
    samples and tokens of the run so far as it does, and the end is bitwise
    the same: weights, AdamW's moments, the schedule, every rank's RNG state."""
    runs, data = uninterrupted
    straight, reference = runs["tokens"]
    expected = evaluations(reference)
    flags = step_flags(data["tokens"])
    held = KIT + [FAULTY_TRAIN, *flags]
    first = signal_when(held, tmp_path, "DDP_TEST_FAULT: wait_signal_once at step 37", signal.SIGTERM,
                        DDP_TEST_FAULT="step:0:37:wait_signal_once")
    # The stop comes after step 37 or 38: the ranks learn of it one poll later (an all-reduce in flight).
    assert re.search(r"^epoch 1 step 3[78] \| snapshot saved", first, re.M), first
    second = signal_when(held, tmp_path, "DDP_TEST_FAULT: wait_signal at evaluate 1", signal.SIGTERM,
                         DDP_TEST_FAULT="evaluate:0:1:wait_signal")
    assert re.search(r"resuming from snapshot snapshot_train.pt in epoch 1 after step 3[78]\n", second), second
    assert "epoch 1 step 50 | snapshot saved" in second and evaluations(second) == [], second
    third = check(run(KIT + [REPO / "train.py", *flags], tmp_path)).stdout
    assert "resuming from snapshot snapshot_train.pt in epoch 1 after step 50" in third
    assert evaluations(first) + evaluations(third) == expected

    def counted(folder) -> list:
        return [(r["step"], r["samples_run"], r["tokens_run"])
                for r in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines()) if "step" in r]

    assert counted(tmp_path) == counted(straight)
    steps_a, a = snapshot_tensors(straight / "snapshot_train.pt", rng=True)
    steps_b, b = snapshot_tensors(tmp_path / "snapshot_train.pt", rng=True)
    assert steps_a == steps_b == 1 and a["lr_schedule.step"].item() == 80 and a.keys() == b.keys()
    assert [name for name in a if not torch.equal(a[name], b[name])] == []


def test_a_token_run_from_a_bucket_prints_the_disks_evaluation_lines_through_a_stop(uninterrupted, tmp_path,
                                                                                    s3_server):
    """The token files above uploaded to a bucket of a local S3 server,
    --data_dir s3://bucket/prefix, 2 ranks with 2 DataLoader workers each
    (from the kit's fork server): stopped by SIGTERM at step 37 and resumed,
    the two runs print the uninterrupted run's evaluation lines from disk
    (0 workers) and end bitwise as it does; a bucket that does not exist
    ends train.py in one line, exit status 2, and nothing is saved."""
    runs, data = uninterrupted
    straight, reference = runs["tokens"]
    url = upload(s3_server, data["tokens"], "tokens-run", "shakespeare_char")
    flags = [*step_flags(url), "--num_workers", "2"]
    first = signal_when(KIT + [FAULTY_TRAIN, *flags], tmp_path, "DDP_TEST_FAULT: wait_signal_once at step 37",
                        signal.SIGTERM, DDP_TEST_FAULT="step:0:37:wait_signal_once", **s3_server.env())
    assert re.search(r"^epoch 1 step 3[78] \| snapshot saved", first, re.M), first[-3000:]
    second = check(run(KIT + [REPO / "train.py", *flags], tmp_path, **s3_server.env())).stdout
    assert "resuming from snapshot snapshot_train.pt in epoch 1 after step 3" in second, second[-3000:]
    assert f"vocab_size of {url}/meta.pkl" in second
    assert evaluations(first) + evaluations(second) == evaluations(reference) != []
    steps_a, a = snapshot_tensors(straight / "snapshot_train.pt", rng=True)
    steps_b, b = snapshot_tensors(tmp_path / "snapshot_train.pt", rng=True)
    assert steps_a == steps_b and a.keys() == b.keys()
    assert [name for name in a if not torch.equal(a[name], b[name])] == []
    (tmp_path / "missing").mkdir()
    missing = one_process(step_flags("s3://no-such-bucket/tokens"), tmp_path / "missing", **s3_server.env())
    assert missing.returncode == 2 and error_lines(missing.stderr)[:1] == [
        "error: --dataset tokens: s3://no-such-bucket/tokens is not there (The specified bucket does not exist); "
        "create the bucket and upload the shards, or pass the --data_dir they are in; the endpoint and "
        "credentials come from the standard AWS variables (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, "
        "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, AWS_DEFAULT_REGION)"], missing.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "missing").iterdir()) == []


def test_another_vocabulary_at_resume_is_one_line_and_the_snapshot_is_kept(uninterrupted, tmp_path):
    """The finished run above, its meta.pkl replaced by another corpus's (the
    whole of Tiny Shakespeare: 65 characters, the run's ids still valid),
    extended with a raised --max_steps and asked for a sample: each ends
    with one line naming the vocabulary sizes (exit status 2), rather than a
    size-mismatch traceback from loading the embedding; the snapshot is
    left as it was."""
    runs, data = uninterrupted
    straight, _ = runs["tokens"]
    corpus, folder = tmp_path / "data", tmp_path / "run"
    shutil.copytree(data["tokens"], corpus)
    shutil.copytree(straight, folder)
    before = pickle.loads((corpus / "meta.pkl").read_bytes())["vocab_size"]
    shutil.copy(build_token_files(tmp_path / "whole") / "meta.pkl", corpus / "meta.pkl")
    assert before < 65 == pickle.loads((corpus / "meta.pkl").read_bytes())["vocab_size"]
    saved = (folder / "snapshot_train.pt").read_bytes()
    flags = step_flags(corpus)
    for extra in (["--max_steps", "100"], ["--sample_chars", "20"]):
        result = run(KIT + [REPO / "train.py", *flags, *extra], folder)
        assert result.returncode != 0 and "size mismatch" not in result.stdout + result.stderr, result.stderr[-3000:]
        assert error_lines(result.stderr) == [
            f"error: snapshot snapshot_train.pt comes from a different run (vocab_size {before} -> 65); resume "
            f"with its settings, or delete it or pass another --snapshot_path to start afresh"], result.stderr
    assert (folder / "snapshot_train.pt").read_bytes() == saved


def test_an_fsdp_token_run_stopped_mid_interval_resumes_bitwise(uninterrupted, tmp_path):
    """FSDP, 2 ranks, the run above stopped by SIGTERM at step 62 or 63
    (between the evaluations of steps 50 and 75) and resumed: the same
    evaluation lines, the interval's training loss carried through the
    sharded snapshot, and bitwise the same end state."""
    runs, data = uninterrupted
    straight, reference = runs["tokens-fsdp"]
    expected = evaluations(reference)
    assert [e["step"] for e in expected] == ["25", "50", "75", "80"]
    flags = step_flags(data["tokens"], strategy="fsdp")
    first = signal_when(KIT + [FAULTY_TRAIN, *flags], tmp_path, "DDP_TEST_FAULT: wait_signal_once at step 62",
                        signal.SIGTERM, DDP_TEST_FAULT="step:0:62:wait_signal_once")
    assert re.search(r"^epoch 1 step 6[23] \| snapshot saved", first, re.M), first
    second = check(run(KIT + [REPO / "train.py", *flags], tmp_path)).stdout
    assert "resuming from snapshot snapshot_train_fsdp/" in second
    assert evaluations(first) + evaluations(second) == expected
    assert_bitwise(*(full_state(snapshot_folder(folder / "snapshot_train_fsdp"), tmp_path / f"{name}-full")[1]
                     for name, folder in (("straight", straight), ("stopped", tmp_path))))


# The memory test's rank reports its peak resident memory (VmHWM: every page it
# held at once, the file's mapped pages included) as it exits.
PEAK_MEMORY_WRAPPER = '''import atexit, os, runpy, sys, time
started = time.monotonic()
def report():
    with open("/proc/self/status") as f:
        peak = next(line for line in f if line.startswith("VmHWM:")).split()[1]
    with open("/proc/self/io") as f:  # bytes this process read by read() calls (a map's pages are not among them)
        read = next(line for line in f if line.startswith("rchar:")).split()[1]
    # One write of the whole line (print writes the text and its newline apart,
    # so the two ranks' lines could interleave on their shared output).
    os.write(1, f"rank {os.environ['RANK']} peak_rss_kib {peak} rchar {read} "
                f"seconds {time.monotonic() - started:.1f}\\n".encode())
atexit.register(report)
sys.path[0] = REPO  # the project's modules, as when train.py runs itself
sys.argv[0] = os.path.join(REPO, "train.py")
runpy.run_path(sys.argv[0], run_name="__main__")
'''


def test_a_corpus_of_gigabytes_in_shards_trains_in_a_small_fraction_of_its_size(tmp_path):
    """20 GiB of training tokens as 10 llm.c shards of 2 GiB (sparse files: a
    header, a few real token ids, zeros between; 21 million windows of 512
    tokens) and 2 ranks of a tiny GPT, 5 steps, 2 DataLoader workers each:
    every rank's peak resident memory stays under 2 GiB and it reads under
    1 GiB through read() calls (its imports, the header checks and the ids'
    sample: the shards are mapped, never read through), as the index of the windows is
    one int64 a shard and each worker maps the shards itself (a map sent to
    it would be copied whole). Prints each rank's peak memory, bytes read and
    seconds from its start to its end (start-up, 5 steps, the evaluation)."""
    import array

    folder = tmp_path / "big"
    folder.mkdir()
    shard_bytes, g = 2 << 30, torch.Generator().manual_seed(0)
    for k in range(10):
        path = folder / f"fineweb_train_{k + 1:06d}.bin"
        write_token_shard(path, [], True, count=(shard_bytes - 1024) // 2)
        with open(path, "r+b") as f:
            f.truncate(shard_bytes)
            for where in (1024, shard_bytes // 3 & ~1, shard_bytes - 4096):
                f.seek(where)
                f.write(array.array("H", torch.randint(0, 65, (2048,), generator=g).tolist()).tobytes())
    write_token_shard(folder / "fineweb_val_000000.bin", torch.randint(0, 65, (8192,), generator=g).tolist(), True)
    with open(folder / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": 65}, f)
    (tmp_path / "peak_memory.py").write_text(PEAK_MEMORY_WRAPPER.replace("REPO", repr(str(REPO))))
    result = check(run(KIT + [tmp_path / "peak_memory.py", "--dataset", "tokens", "--data_dir", folder,
                              "--n_layer", "1", "--n_head", "2", "--n_embd", "32", "--block_size", "512",
                              "--batch_size", "4", "--max_steps", "5", "--eval_windows", "4", "--num_workers", "2",
                              "--log_every_steps", "0"], tmp_path))
    ranks = {int(rank): (int(kib) * 1024, int(read), float(seconds)) for rank, kib, read, seconds in
             re.findall(r"^rank (\d) peak_rss_kib (\d+) rchar (\d+) seconds ([\d.]+)$", result.stdout, re.M)}
    print("10 shards, 20 GiB; per rank: " + "; ".join(
        f"rank {r} peak {peak / 2**20:.0f} MiB, read {read / 2**20:.1f} MiB, {seconds:.1f} s"
        for r, (peak, read, seconds) in sorted(ranks.items())))
    assert sorted(ranks) == [0, 1], result.stdout
    assert all(peak < 2 << 30 and read < 1 << 30 for peak, read, _ in ranks.values()), ranks
    assert sum(f.stat().st_blocks * 512 for f in folder.iterdir()) < 1 << 20  # still sparse: nothing written
