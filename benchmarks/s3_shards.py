"""Token shards read from a bucket against the same shards on disk:
training tokens/s through the DataLoader, --dataset tokens.

llm.c shards of random GPT-2 ids (uint16) are written to a temporary folder
and uploaded to an S3 server this benchmark starts itself on 127.0.0.1
(support/s3_server.py: moto's, in memory); the task is loaded once with
--data_dir on the folder (memory-mapped shards) and once with --data_dir
s3://bucket/prefix (ranged GETs through the block cache,
token_tasks.BucketTokenFile). Each path trains nothing: the DataLoader of
one rank (``ResumableDistributedSampler``, epoch 1's shuffled order, as
train.py's loader) takes ``batches`` batches of 12 windows of 1,024 tokens
(nanoGPT's GPT-2 recipe), with 0 and 2 workers (forked, each making its own
S3 client as a worker of train.py's fork server does), the paths
interleaved.
The cache is smaller than the corpus unless told otherwise, so most
windows cost a GET of a block. Run as a program:

    .venv/bin/python -m benchmarks.s3_shards [corpus MiB] [cache MiB] [batches]

(defaults 64, 16, 30). The shards are small because moto copies a whole
object for each ranged GET, a cost of its own that grows with the object; a
remote store's round trip instead divides a worker's rate by the batches it
waits for in turn (a batch's blocks are fetched at once, concurrent GETs).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

BLOCK_SIZE, BATCH = 1024, 12  # nanoGPT's GPT-2 recipe: 12 windows of 1,024 tokens a micro-batch
SHARD_MIB = 4  # small shards: moto copies a whole object for each ranged GET (its cost, not a store's)


def write_shard(path: Path, ids: torch.Tensor) -> None:
    """An llm.c shard at ``path``: its header (256 little-endian int32: magic,
    version 1, the token count), then ``ids`` (int32, 0..65535) as uint16."""
    import token_tasks

    header = torch.zeros(256, dtype=torch.int32)
    header[:3] = torch.tensor([token_tasks.LLMC_MAGIC, token_tasks.LLMC_VERSION, ids.numel()])
    with open(path, "wb") as f:
        f.write(header.numpy().tobytes())
        f.write(ids.to(torch.int16).numpy().tobytes())  # the same 16 bits: read back as uint16


def write_shards(folder: Path, corpus_mib: int) -> int:
    """llm.c shards of ``SHARD_MIB`` MiB of random GPT-2 ids (and a small
    validation shard) in ``folder``; returns the training tokens."""
    folder.mkdir(parents=True)
    generator = torch.Generator().manual_seed(0)
    tokens = 0
    for k in range(max(1, corpus_mib // SHARD_MIB)):
        ids = torch.randint(0, 50257, (SHARD_MIB << 19,), generator=generator, dtype=torch.int32)
        write_shard(folder / f"fineweb_train_{k + 1:06d}.bin", ids)
        tokens += ids.numel()
    write_shard(folder / "fineweb_val_000000.bin", torch.randint(0, 50257, (1 << 16,), generator=generator,
                                                                 dtype=torch.int32))
    return tokens


def tokens_per_s(task, num_workers: int, batches: int) -> float:
    """Training tokens/s of ``batches`` batches of ``BATCH`` windows from one
    rank's DataLoader of ``task`` (1 replica, epoch 1's order), workers
    started anew, their start included, as each epoch starts them."""
    from torch.utils.data import DataLoader

    import common
    import train_utils

    sampler = train_utils.ResumableDistributedSampler(task.train_set, 1, 0, seed=0)
    sampler.set_epoch(1)
    task.train_set.set_epoch(1)
    workers = {"num_workers": num_workers, "multiprocessing_context": "fork"} if num_workers else {}
    loader = DataLoader(task.train_set, batch_size=BATCH, sampler=sampler, drop_last=True,
                        collate_fn=common.collate, **workers)
    started, taken = time.perf_counter(), 0
    for x, _ in loader:
        taken += x.numel()
        if taken >= batches * BATCH * BLOCK_SIZE:
            break
    return taken / (time.perf_counter() - started)


def main(corpus_mib: int = 64, cache_mib: int = 16, batches: int = 30, reps: int = 3) -> dict:
    import common
    from support.s3_server import S3Server

    server = S3Server()
    try:
        os.environ.update(server.env())  # the workers, forked, read it too
        with tempfile.TemporaryDirectory(prefix="s3-shards-") as work:
            folder = Path(work) / "shards"
            tokens = write_shards(folder, corpus_mib)
            server.create_bucket("corpus")
            client = server.client()
            for path in sorted(folder.iterdir()):
                client.upload_file(str(path), "corpus", f"fineweb/{path.name}")
            tasks = {}
            for name, data_dir in (("disk", str(folder)), ("bucket", "s3://corpus/fineweb")):
                args = argparse.Namespace(dataset="tokens", data_dir=data_dir, input_path="torchvision", seed=0,
                                          model=None, n_layer=1, n_head=2, n_embd=32, block_size=BLOCK_SIZE,
                                          bucket_cache_mib=cache_mib)
                tasks[name] = common.load_task(args, download=False)
            runs = {(name, workers): [] for workers in (0, 2) for name in tasks}
            for _ in range(reps):  # interleaved
                for (name, workers), figures in runs.items():
                    figures.append(tokens_per_s(tasks[name], workers, batches))
    finally:
        server.stop()
    print(f"{tokens:,} training tokens in {corpus_mib // SHARD_MIB} llm.c shards of {SHARD_MIB} MiB, "
          f"--bucket_cache_mib {cache_mib}, {batches} batches of {BATCH} x {BLOCK_SIZE} tokens a run, "
          f"median of {reps}; torch {torch.__version__}")
    print(f"{'path':<8} {'workers':>7} {'tokens/s':>12} {'vs disk':>8}")
    median = {key: statistics.median(figures) for key, figures in runs.items()}
    for (name, workers), value in median.items():
        print(f"{name:<8} {workers:>7} {value:>12,.0f} {value / median['disk', workers]:>8.2f}")
    return median


if __name__ == "__main__":
    main(*(int(word) for word in sys.argv[1:4]))
