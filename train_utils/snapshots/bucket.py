"""Snapshots in a bucket (``--snapshot_path s3://bucket/prefix/...``): S3 and
the stores that speak its interface (MinIO, Ceph, R2, GCS's XML API), reached
with boto3 through the standard AWS variables and files (AWS_ENDPOINT_URL,
AWS_PROFILE, the credentials' variables and files); ``SnapshotBucket``, the
Checkpointer's file format (DDP) in a bucket, and the claim held there.

A DDP snapshot ``s3://B/K`` is a series of generations, each under
``K/<generation, 8 digits>/``: the snapshot as one object (``snapshot.pt``,
what ``torch.save`` writes to a file) and, written last, ``manifest.json``,
which names the generation's objects with their sizes and SHA-256 digests.
The manifest is written with ``If-None-Match: *``, a conditional write that
fails where the object exists already: one request commits a generation,
and no two writers commit the same one. A generation is complete when its
manifest exists and its objects match it; a torn or unfinished upload (a
killed writer, a store failing mid-upload, a multipart upload never
completed) has no manifest, is never chosen, and is removed by the run that
holds the claim. The previous generation stays until the next one is
committed, then is removed: the bucket keeps what a disk keeps, one
snapshot.

The claim (two live runs never write one snapshot) is the object ``K.lease``,
created with ``If-None-Match: *`` and renewed every ``LEASE_RENEW_S`` with
``If-Match`` on its ETag; a lease of a dead run on this host, or one not
renewed for ``LEASE_TTL_S`` by the store's clock, is taken over (``If-Match``
again, so that of two runs taking it over one wins).
"""

from __future__ import annotations

import contextlib
import email.utils
import hashlib
import io
import json
import threading
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist

from common import ConfigError
from ..distributed import note_snapshot
from ..output import first_error, print_line
from .claims import _HELD, live_holder, this_jobs_processes
from .file import SnapshotFile, check_same_run, load_snapshot
from .position import position_tag, tag_position
from .writer import CpuStaging

SCHEME = "s3://"
INSTALL = "pip install boto3 s3fs"
SNAPSHOT_OBJECT = "snapshot.pt"
MANIFEST = "manifest.json"
LEASE_SUFFIX = ".lease"
LEASE_TTL_S = 60.0  # a lease not renewed for this long (store's clock) is a dead run's
LEASE_RENEW_S = 20.0
# The client's bounds, so that a store that does not answer ends the run within 90 s: a connection
# within 5 s, an answer within 20 s, 3 attempts in all (botocore's "standard" retries, with backoff).
CONNECT_TIMEOUT_S, READ_TIMEOUT_S, MAX_ATTEMPTS = 5, 20, 3
_PRECONDITION = ("PreconditionFailed", "412", "ConditionalRequestConflict", "409")


def in_bucket(path: Optional[str]) -> bool:
    """Whether --snapshot_path ``path`` names a bucket (``s3://``) rather than local storage."""
    return isinstance(path, str) and path.startswith(SCHEME)


def split_path(path: str) -> tuple[str, str]:
    """(bucket, key) of ``s3://bucket/key``; the key without a trailing slash.
    Raises ConfigError for a path without a bucket or a key."""
    bucket, _, key = path[len(SCHEME):].partition("/")
    key = key.strip("/")
    if not bucket or not key:
        raise ConfigError(f"--snapshot_path {path} names no object: give s3://BUCKET/PREFIX/NAME")
    return bucket, key


class BucketError(Exception):
    """A request to the store failed; ``cause`` says how in a few words
    (``describe``), for the one line of ``save_errors.save_failure``."""

    def __init__(self, cause: str) -> None:
        super().__init__(cause)
        self.bucket_cause = cause


_CLIENT: dict = {}
_LEASES: dict = {}  # --snapshot_path -> the Lease this process holds on it (rank 0's)


def client(path: str):
    """This process's boto3 S3 client (made once), its endpoint, region and
    credentials from the standard AWS variables and files only, its time-outs
    and retries bounded (``CONNECT_TIMEOUT_S``, ``READ_TIMEOUT_S``,
    ``MAX_ATTEMPTS``). Raises ConfigError (one line) when boto3 is not
    installed: ``path`` names the --snapshot_path that needs it."""
    if "client" not in _CLIENT:
        try:
            import boto3
            from botocore.config import Config
        except ImportError:
            raise ConfigError(f"--snapshot_path {path} is in a bucket, which needs boto3 and s3fs: "
                              f"{INSTALL}") from None
        config = Config(connect_timeout=CONNECT_TIMEOUT_S, read_timeout=READ_TIMEOUT_S,
                        retries={"max_attempts": MAX_ATTEMPTS, "mode": "standard"})
        _CLIENT["client"] = boto3.session.Session().client("s3", config=config)
    return _CLIENT["client"]


def error_code(exc: BaseException) -> str:
    """The S3 error code of a botocore ClientError ("NoSuchBucket", "412"...), '' for another exception."""
    return str(((getattr(exc, "response", None) or {}).get("Error") or {}).get("Code", ""))


def describe(exc: BaseException, path: str) -> str:
    """What went wrong with a request for --snapshot_path ``path``, and what
    to do, in a few words: a bucket that does not exist, denied credentials,
    an endpoint that does not answer, or the store's own error."""
    bucket = path[len(SCHEME):].split("/", 1)[0]
    endpoint = getattr(getattr(_CLIENT.get("client"), "meta", None), "endpoint_url", "the store")
    code, name = error_code(exc), type(exc).__name__
    if code in ("NoSuchBucket", "404") and "Key" not in str((getattr(exc, "response", None) or {}).get("Error")):
        return f"bucket {bucket} does not exist at {endpoint}: create it, or pass another --snapshot_path"
    if code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
                "InvalidToken") or name in ("NoCredentialsError", "PartialCredentialsError"):
        return (f"{endpoint} denies access to bucket {bucket} ({code or name}): check the credentials "
                f"(AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE) and the bucket's policy")
    if isinstance(exc, OSError) or name in ("EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError",
                                             "ConnectionClosedError", "ProxyConnectionError",
                                             "ResponseStreamingError", "IncompleteReadError"):
        return (f"the store at {endpoint} does not answer ({name} after {MAX_ATTEMPTS} attempts): check "
                f"AWS_ENDPOINT_URL and that the store is up")
    detail = str(exc).splitlines()[0][:200] if str(exc) else name
    return f"the store at {endpoint} failed ({detail})"


def configure_fsspec() -> None:
    """Give s3fs (through which DCP writes and reads sharded saves) the
    bounds of this module's boto3 client (``client``), where the user's
    fsspec configuration sets none: time-outs and attempts. Its endpoint and
    credentials come from the same AWS variables and files."""
    import fsspec

    conf = fsspec.config.conf.setdefault("s3", {})
    conf.setdefault("config_kwargs", {"connect_timeout": CONNECT_TIMEOUT_S, "read_timeout": READ_TIMEOUT_S,
                                      "retries": {"max_attempts": MAX_ATTEMPTS, "mode": "standard"}})


def _request(path: str, call: Callable, *args, **kwargs):
    """``call(*args, **kwargs)`` (a client's method), its failure raised as a
    BucketError that says what is wrong (``describe``)."""
    try:
        return call(*args, **kwargs)
    except Exception as exc:  # botocore's errors, or a connection's (OSError) that s3transfer passes on
        if isinstance(exc, OSError) or type(exc).__module__.startswith(("botocore", "boto3", "s3transfer",
                                                                         "urllib3")):
            raise BucketError(describe(exc, path)) from exc
        raise


# --------------------------------------------------------------------------
# Generations and their manifests
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class Generation:
    """A committed generation: its name (a DDP snapshot's number, 8 digits;
    a sharded save's position tag, "epoch-3-step-40"), its key prefix
    (``K/<name>``) and its manifest (a dict: "format", "objects" {name
    relative to the prefix: {"size": bytes, and "sha256" (hex) or "etag"}},
    "position", "budget_batch")."""

    name: str
    prefix: str
    manifest: dict


def generation_order(name: str) -> Optional[tuple]:
    """Where generation ``name`` stands among others (the larger, the newer):
    (n,) for a DDP snapshot's number, (epochs_run, steps_run) for a sharded
    save's position tag; None for a name that is neither."""
    if name.isdigit():
        return (int(name),)
    return tag_position(name)


def generation_name(key: str, root: str) -> Optional[str]:
    """The generation of object ``key`` under ``root`` (``root/<name>/...``), None for another key."""
    rest = key[len(root) + 1:] if key.startswith(root + "/") else ""
    name = rest.split("/", 1)[0]
    return name if "/" in rest and generation_order(name) is not None else None


def choose_generation(root: str, sizes: dict, read_manifest: Callable[[str], Optional[dict]]) -> Optional[Generation]:
    """The newest complete generation under ``root`` (``generation_order``):
    ``sizes`` is every object under it, {key: size in bytes};
    ``read_manifest(key)`` the parsed manifest at ``key`` (None where it
    cannot be read). Complete: its manifest exists and every object it names
    exists with the size it gives. None when no generation is complete.
    (Contents are checked when read: a DDP snapshot's SHA-256,
    ``SnapshotBucket.read``; a sharded save's CRC-32s, ``sharded.shard_damage``.)"""
    names = {name for key in sizes for name in [generation_name(key, root)] if name is not None}
    for name in sorted(names, key=generation_order, reverse=True):
        prefix = f"{root}/{name}"
        if f"{prefix}/{MANIFEST}" not in sizes:
            continue
        manifest = read_manifest(f"{prefix}/{MANIFEST}")
        objects = (manifest or {}).get("objects")
        if not isinstance(objects, dict) or not objects:
            continue
        if all(sizes.get(f"{prefix}/{obj}") == entry.get("size") for obj, entry in objects.items()):
            return Generation(name, prefix, manifest)
    return None


def list_sizes(s3, bucket: str, root: str, path: str) -> dict:
    """{key: size} of every object under ``root/`` in ``bucket``."""
    pages = _request(path, lambda: list(s3.get_paginator("list_objects_v2").paginate(Bucket=bucket,
                                                                                     Prefix=root + "/")))
    return {item["Key"]: item["Size"] for page in pages for item in page.get("Contents", [])}


def delete_keys(s3, bucket: str, keys: Iterable[str], path: str) -> None:
    """Delete ``keys`` from ``bucket``, up to 1000 a request."""
    keys = sorted(keys)
    for start in range(0, len(keys), 1000):
        _request(path, s3.delete_objects, Bucket=bucket,
                 Delete={"Objects": [{"Key": key} for key in keys[start:start + 1000]], "Quiet": True})


def abort_uploads(s3, bucket: str, root: str, path: str) -> int:
    """Abort every multipart upload under ``root/`` that was never completed
    (a killed writer's: their parts take space until aborted); the number aborted."""
    pages = _request(path, lambda: list(s3.get_paginator("list_multipart_uploads").paginate(Bucket=bucket,
                                                                                            Prefix=root + "/")))
    uploads = [upload for page in pages for upload in page.get("Uploads", [])]
    for upload in uploads:
        with contextlib.suppress(Exception):  # completed or aborted meanwhile
            s3.abort_multipart_upload(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
    return len(uploads)


def remove_uncommitted(path: str) -> list:
    """For the holder of ``path``'s claim: remove what no complete generation
    holds, the objects of torn or unfinished uploads (those of generations
    newer than the newest complete one, and any without a manifest) and the
    multipart uploads never completed; the newest complete generation and
    older complete ones stay (the next commit removes those). Returns the
    keys removed."""
    s3, (bucket, root) = client(path), split_path(path)
    abort_uploads(s3, bucket, root, path)
    sizes = list_sizes(s3, bucket, root, path)
    chosen = choose_generation(root, sizes, lambda key: read_json(s3, bucket, key, path))
    names = {generation_name(key, root) for key in sizes} - {None}
    kept = {name for name in names if chosen is not None and f"{root}/{name}/{MANIFEST}" in sizes
            and generation_order(name) <= generation_order(chosen.name)}
    stale = [key for key in sizes if generation_name(key, root) in names - kept]
    delete_keys(s3, bucket, stale, path)
    return stale


def remove_others(s3, path: str, bucket: str, root: str, name: str) -> None:
    """Remove every generation under ``root`` but ``name`` (the one just committed): retention,
    one snapshot, as on a disk. Other objects under ``root`` stay."""
    sizes = list_sizes(s3, bucket, root, path)
    delete_keys(s3, bucket, [key for key in sizes if generation_name(key, root) not in (None, name)], path)


def read_object(path: str, url: str) -> io.BytesIO:
    """The object at ``url`` (s3://bucket/key), read whole into memory. Raises
    ConfigError (one line) naming --snapshot_path ``path`` when the store fails."""
    bucket, key = url[len(SCHEME):].split("/", 1)
    try:
        return io.BytesIO(_request(path, lambda: client(path).get_object(Bucket=bucket, Key=key)["Body"].read()))
    except BucketError as exc:
        raise ConfigError(f"cannot read snapshot {path}: {exc.bucket_cause}") from None


def commit_sharded(path: str, folder: str, meta: dict, tag: str, meta_name: str) -> None:
    """Complete a sharded save (every rank's DCP shards and index written
    under ``folder``, s3://BUCKET/ROOT/<tag>): ``meta`` written there as
    ``meta_name`` (``ShardedSnapshots.META``, serialized in memory), then the manifest naming every object of
    the save with its size and ETag, written only if absent (the commit);
    then every other generation removed. Raises BucketError as
    ``SnapshotBucket.write_generation`` does."""
    s3, (bucket, root) = client(path), split_path(path)
    prefix, name = folder[len(SCHEME) + len(bucket) + 1:], folder.rstrip("/").rsplit("/", 1)[1]
    buffer = io.BytesIO()
    torch.save(meta, buffer)
    put_object(s3, path, bucket, f"{prefix}/{meta_name}", buffer.getbuffer(), 64 * 2**20)
    pages = _request(path, lambda: list(s3.get_paginator("list_objects_v2").paginate(Bucket=bucket,
                                                                                     Prefix=prefix + "/")))
    objects = {item["Key"][len(prefix) + 1:]: {"size": item["Size"], "etag": item["ETag"].strip('"')}
               for page in pages for item in page.get("Contents", []) if not item["Key"].endswith("/" + MANIFEST)}
    manifest = {"format": "sharded", "generation": name, "position": tag,
                "budget_batch": budget_batch_of(dict(meta["config"], world_size=meta.get("world_size"))),
                "objects": objects}
    commit(s3, path, bucket, f"{prefix}/{MANIFEST}", manifest)
    remove_others(s3, path, bucket, root, name)


def read_json(s3, bucket: str, key: str, path: str) -> Optional[dict]:
    """The JSON object at ``key``, None where it is missing or not JSON."""
    try:
        body = _request(path, s3.get_object, Bucket=bucket, Key=key)["Body"].read()
        return json.loads(body)
    except BucketError:
        raise
    except Exception:  # not JSON, or gone meanwhile
        return None


def newest_generation(path: str) -> Optional[Generation]:
    """The newest complete generation of the snapshot at ``path`` (``choose_generation``); reads only."""
    s3, (bucket, root) = client(path), split_path(path)
    return choose_generation(root, list_sizes(s3, bucket, root, path), lambda key: read_json(s3, bucket, key, path))


def newest_snapshot_url(path: str, sharded: bool) -> Optional[str]:
    """What a run of --snapshot_path ``path`` would resume, read only and in
    this process alone: ``path`` for a DDP snapshot, the save's s3:// folder
    for a sharded one; None where no generation is complete."""
    generation = newest_generation(path)
    if generation is None:
        return None
    return f"{SCHEME}{split_path(path)[0]}/{generation.prefix}" if sharded else path


def read_newest(path: str, sharded: bool, config: dict, meta_name: str = "meta.pt") -> dict:
    """The newest complete snapshot at ``path`` read and checked as a run
    reads it (a DDP snapshot's SHA-256, then the file's checks; a sharded
    save's ``meta_name``, ``ShardedSnapshots.META``), in this process alone,
    for a plan. Raises ConfigError as ``SnapshotBucket.read`` does, or when
    there is none."""
    generation = newest_generation(path)
    if generation is None:
        raise ConfigError(f"no snapshot at --snapshot_path {path}")
    if sharded:
        folder = newest_snapshot_url(path, True)
        snapshot = load_snapshot(read_object(path, f"{folder}/{meta_name}"), folder)
        check_same_run(snapshot, folder, config)
        return snapshot
    store = SnapshotBucket(path)
    store.chosen = generation
    return store.read(path, config)


def saved_budget_batch(path: str) -> Optional[int]:
    """The global batch size the run at ``path`` started with, as its newest
    complete generation's manifest records it; None where there is none."""
    generation = newest_generation(path)
    budget = generation.manifest.get("budget_batch") if generation else None
    return int(budget) if budget else None


def put_object(s3, path: str, bucket: str, key: str, data, part_bytes: int) -> None:
    """Upload ``data`` (bytes-like) to ``key``: one request, or a multipart
    upload of ``part_bytes`` parts from that size on (boto3's transfer manager,
    which aborts its own upload when it fails)."""
    from boto3.s3.transfer import TransferConfig

    config = TransferConfig(multipart_threshold=part_bytes, multipart_chunksize=part_bytes)
    _request(path, s3.upload_fileobj, io.BytesIO(data), bucket, key, Config=config)


def commit(s3, path: str, bucket: str, key: str, manifest: dict) -> None:
    """Write ``manifest`` at ``key`` if no object is there (If-None-Match: *):
    the commit. Raises BucketError when the store refuses (another writer
    committed that generation: precondition failed), or when this process's
    lease on ``path`` was taken over by another run (``Lease.lost``)."""
    lease = _LEASES.get(path)
    if lease is not None and lease.lost:
        raise BucketError(f"the lease {lease.bucket}/{lease.key} was taken over by another run (this one could not "
                          f"renew it within {LEASE_TTL_S:.0f} s): two runs must not write one snapshot")
    try:
        s3.put_object(Bucket=bucket, Key=key, Body=json.dumps(manifest, indent=1).encode(), IfNoneMatch="*",
                      ContentType="application/json")
    except Exception as exc:
        if error_code(exc) in _PRECONDITION:
            raise BucketError(f"{key} was committed by another writer meanwhile: two runs write this "
                              f"snapshot") from exc
        raise BucketError(describe(exc, path)) from exc


def newest_number(sizes: dict, root: str) -> int:
    """The largest DDP generation number among the keys of ``sizes`` under ``root``, committed or not; 0 for none."""
    return max([int(name) for key in sizes for name in [generation_name(key, root)] if name and name.isdigit()],
               default=0)


def budget_batch_of(config: dict) -> Optional[int]:
    """The global batch size --max_steps counts in, of a run's ``config``
    (``RunConfig.as_dict`` with its world size): "budget_batch", else
    --batch_size x --grad_accum_steps x the world size."""
    with contextlib.suppress(KeyError, TypeError):
        return int(config.get("budget_batch") or
                   config["batch_size"] * config["grad_accum_steps"] * config["world_size"])
    return None


class SnapshotBucket(SnapshotFile):
    """The Checkpointer's file format (DDP) in a bucket: ``path`` is
    ``s3://BUCKET/KEY``; each save a generation of one object, committed by
    its manifest (see the module). Rank 0 writes, every rank reads.
    ``latest``, ``read``, ``load``, ``load_model``, ``resume_note``,
    ``save`` and ``close`` are the calls ``checkpointer.Checkpointer`` makes
    of either format (``load`` and ``resume_note`` are the file's own). ``part_bytes``: the multipart upload's part size (and
    the size from which an upload is multipart), at least 5 MiB (S3's least
    part but the last)."""

    def __init__(self, path: str, part_bytes: int = 64 * 2**20) -> None:
        self.path, self.part_bytes = path, part_bytes
        self.bucket, self.root = split_path(path)
        self.staging = CpuStaging()  # the background write's CPU buffers, reused by every snapshot
        self.chosen: Optional[Generation] = None  # the generation ``latest`` found
        self.generation: Optional[int] = None  # rank 0: the newest generation number seen or written

    def latest(self) -> Optional[str]:
        """Collective: ``path`` when it holds a complete generation (rank 0
        lists the bucket and tells the others which), None for a fresh start.
        Raises ConfigError (one line, on every rank) when the store cannot be
        read."""
        message: list = [None, ""]
        if dist.get_rank() == 0:
            try:
                s3 = client(self.path)
                sizes = list_sizes(s3, self.bucket, self.root, self.path)
                self.generation = newest_number(sizes, self.root)
                message[0] = choose_generation(self.root, sizes,
                                               lambda key: read_json(s3, self.bucket, key, self.path))
            except BucketError as exc:
                message[1] = f"cannot read snapshot {self.path}: {exc.bucket_cause}"
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(message, src=0)
        error = first_error(message[1])
        if error:
            raise ConfigError(error)
        self.chosen = message[0]
        if self.chosen is not None and self.chosen.manifest.get("format") != "file":
            raise ConfigError(f"--snapshot_path {self.path} holds FSDP/HSDP snapshots (sharded saves), where "
                              f"--strategy ddp keeps one object: resume it with --strategy fsdp (or hsdp), or "
                              f"pass another --snapshot_path")
        return self.path if self.chosen is not None else None

    def _download(self) -> io.BytesIO:
        """The chosen generation's snapshot object, its size and SHA-256
        checked against the manifest. Raises ConfigError (one line, the
        snapshot kept) when they do not match, or the store fails."""
        entry = self.chosen.manifest["objects"][SNAPSHOT_OBJECT]
        key = f"{self.chosen.prefix}/{SNAPSHOT_OBJECT}"
        try:
            data = _request(self.path, lambda: client(self.path).get_object(Bucket=self.bucket,
                                                                            Key=key)["Body"].read())
        except BucketError as exc:
            raise ConfigError(f"cannot read snapshot {self.path}: {exc.bucket_cause}") from None
        if len(data) != entry["size"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise ConfigError(f"cannot read snapshot {self.path} (s3://{self.bucket}/{key} does not match its "
                              f"manifest's size and SHA-256: damaged in the store); delete that generation "
                              f"(s3://{self.bucket}/{self.chosen.prefix}/) to resume from an older one, or "
                              f"pass another --snapshot_path")
        return io.BytesIO(data)

    def read(self, path: str, config: dict) -> dict:
        """The chosen generation's snapshot, checked as a file is
        (``file.read_snapshot``: its digest first, then the zip archive's
        CRC-32s, torch's weights-only unpickler, "same run?" against ``config``)."""
        snapshot = load_snapshot(self._download(), path)
        check_same_run(snapshot, path, config)
        return snapshot

    def load_model(self, path: str, model: torch.nn.Module) -> None:
        """The model weights alone of the chosen generation (checked as ``read`` checks them)."""
        model.load_state_dict(load_snapshot(self._download(), path)["model"])

    def save(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict,
             asynchronous: bool) -> tuple[Optional[Callable[[], None]], str]:
        """(the write, ``path``): on rank 0 a function that serializes
        ``state`` with the model's and the optimizer's state dicts in memory
        (``torch.save``: no file on local disk), uploads it as the next
        generation, commits it (its manifest, written last and only if
        absent) and removes every other generation, then prints the save
        line; None on the other ranks. ``asynchronous``: as ``SnapshotFile.save``,
        the write runs in the writer's thread from a CPU copy taken now. It
        raises BucketError when the store fails: the generation before stays
        the one a resume chooses."""
        if dist.get_rank() != 0:
            return None, self.path
        state = dict(state, model=model.state_dict(), optimizer=optimizer.state_dict())
        state = self.staging.copy(state) if asynchronous else state
        tag = position_tag(state["epochs_run"], state["steps_run"])
        if self.generation is None:  # no ``latest`` before: a new number must still pass every one in the bucket
            self.generation = newest_number(list_sizes(client(self.path), self.bucket, self.root, self.path),
                                            self.root)
        self.generation += 1
        number, budget = self.generation, budget_batch_of(state["config"])

        def write() -> None:
            self.staging.wait()  # the copies from GPUs are in CPU memory
            buffer = io.BytesIO()
            torch.save(state, buffer)
            data = buffer.getbuffer()
            self.write_generation(number, data, tag, budget)
            note_snapshot(self.path, tag)
            print_line(f"{tag} | snapshot saved at {self.path}")

        return write, self.path

    def write_generation(self, number: int, data, tag: str, budget: Optional[int]) -> None:
        """Upload ``data`` (a serialized snapshot) as generation ``number``,
        commit it, then remove every other generation (retention: one
        snapshot, as on a disk). Raises BucketError when the store fails
        before the commit (the previous generation stays) or refuses it."""
        s3, prefix = client(self.path), f"{self.root}/{number:08d}"
        put_object(s3, self.path, self.bucket, f"{prefix}/{SNAPSHOT_OBJECT}", data, self.part_bytes)
        manifest = {"format": "file", "generation": number, "position": tag, "budget_batch": budget,
                    "objects": {SNAPSHOT_OBJECT: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}}}
        commit(s3, self.path, self.bucket, f"{prefix}/{MANIFEST}", manifest)
        remove_others(s3, self.path, self.bucket, self.root, f"{number:08d}")

    def close(self) -> None:
        """The run's end, its last save written: the staging buffers freed."""
        self.staging = CpuStaging()


# --------------------------------------------------------------------------
# Objects beside the snapshot: the goodput ledger, the timeline's tracks
# --------------------------------------------------------------------------

# How often a ``BucketWriter`` PUTs what changed since its last PUT, at most (seconds): an object store has
# no append and no in-place write, so a log kept there is PUT whole; once a training step would cost more.
PUT_EVERY_S = 10.0


def read_bytes(url: str) -> Optional[bytes]:
    """The object at ``url`` (``s3://bucket/key``) whole, None where there is
    none. Raises BucketError (``describe``) when the store fails, and
    ConfigError (one line) when boto3 is not installed."""
    bucket, key = split_path(url)
    try:
        return _request(url, lambda: client(url).get_object(Bucket=bucket, Key=key)["Body"].read())
    except BucketError as exc:
        if error_code(exc.__cause__) in ("NoSuchKey", "404"):
            return None
        raise


def list_urls(url: str) -> list:
    """The ``s3://`` URLs of every object under ``url`` (its key followed by
    "/"), sorted. Raises BucketError as ``read_bytes`` does."""
    bucket, key = split_path(url)
    return [f"{SCHEME}{bucket}/{name}" for name in sorted(list_sizes(client(url), bucket, key, url))]


class BucketWriter:
    """Objects that this process keeps in memory and PUTs whole, each time
    it changes (``put``): in the caller's thread when ``now``, else by a
    daemon thread at most every ``every_s`` seconds (the latest contents
    only), so that a caller that changes an object at every training step
    costs a PUT per ``every_s`` (``PUT_EVERY_S`` unless given), not one per
    step. A process killed outright loses what changed after the last PUT:
    at most ``every_s`` seconds of it.
    The first failure (``describe``'s cause, in ``error``) stops every
    write after it; ``put`` and ``close`` then raise it as BucketError."""

    def __init__(self, every_s: Optional[float] = None) -> None:
        self.every_s = PUT_EVERY_S if every_s is None else every_s
        self.error = ""
        self._pending: dict = {}  # url -> the parts (bytes) of its newest contents, not yet PUT
        self._state = threading.Lock()  # guards _pending
        self._putting = threading.Lock()  # one PUT round at a time, so that older contents never land last
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bucket-writer", daemon=True)
        self._thread.start()

    def put(self, url: str, parts: Iterable[bytes], now: bool = False) -> None:
        """``url``'s contents are now ``parts`` joined; PUT before returning
        when ``now``, else within ``every_s``. Raises BucketError when the
        store refused this or an earlier PUT."""
        with self._state:
            self._pending[url] = tuple(parts)
        if now:
            self.flush()
        elif self.error:
            raise BucketError(self.error)

    def flush(self) -> None:
        """PUT every object changed since its last PUT, now. Raises BucketError
        as ``put`` does."""
        with self._putting:
            with self._state:
                pending, self._pending = self._pending, {}
            for url, parts in pending.items():
                if self.error:
                    break
                bucket, key = split_path(url)
                try:
                    _request(url, client(url).put_object, Bucket=bucket, Key=key, Body=b"".join(parts))
                except BucketError as exc:
                    self.error = exc.bucket_cause
        if self.error:
            raise BucketError(self.error)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            with contextlib.suppress(BucketError):  # kept in ``error``: the caller's next put raises it
                self.flush()

    def close(self) -> None:
        """PUT what changed, now, and stop the thread. Raises BucketError as ``put`` does."""
        self._stop.set()
        self.flush()

    def stop(self) -> None:
        """Stop the thread, dropping what changed since the last PUT (its owner gave up writing)."""
        self._stop.set()
        with self._state:
            self._pending.clear()


# --------------------------------------------------------------------------
# The claim: a lease object in the bucket
# --------------------------------------------------------------------------

def lease_key(path: str) -> tuple[str, str]:
    """(bucket, key) of the lease of the snapshot at ``path``: its key plus ``LEASE_SUFFIX``."""
    bucket, key = split_path(path)
    return bucket, key + LEASE_SUFFIX


def _lease_age_s(response: dict) -> float:
    """Seconds since the lease in a GetObject ``response`` was last written, by the store's clock
    (its Date header against the object's LastModified)."""
    now = email.utils.parsedate_to_datetime(response["ResponseMetadata"]["HTTPHeaders"]["date"])
    return (now - response["LastModified"]).total_seconds()


def take_lease(path: str, me: dict, ours: set) -> tuple[str, str]:
    """Take the lease of the snapshot at ``path`` for ``me`` (``claims.this_run``;
    ``ours``: every rank's (host, pid, pidns)): create it if absent
    (If-None-Match: *), else take it over with If-Match on its ETag when its
    holder is this run, is dead on this host, or has not renewed it for
    ``LEASE_TTL_S``. Returns ('', the lease's ETag) when taken, else (the
    one-line refusal, '')."""
    s3, (bucket, key) = client(path), lease_key(path)
    body = json.dumps(me).encode()
    try:
        return "", s3.put_object(Bucket=bucket, Key=key, Body=body, IfNoneMatch="*")["ETag"]
    except Exception as exc:
        if error_code(exc) not in _PRECONDITION:
            return f"cannot claim --snapshot_path {path}: {describe(exc, path)}", ""
    try:
        held = s3.get_object(Bucket=bucket, Key=key)
        claim, age = json.loads(held["Body"].read() or b"{}"), _lease_age_s(held)
    except Exception as exc:
        if error_code(exc) in ("NoSuchKey", "404"):  # released meanwhile: try once more
            return take_lease(path, me, ours)
        if isinstance(exc, ValueError):  # not a lease of the kit's: taken over
            claim, age = {}, LEASE_TTL_S
        else:
            return f"cannot claim --snapshot_path {path}: {describe(exc, path)}", ""
    holder = live_holder(claim, me, ours)
    if "cannot be checked" in holder:  # another host's run: alive while it renews its lease
        holder = f"pid {claim.get('pid')} on host {claim.get('host')}" if age < LEASE_TTL_S else ""
        holder += f", whose lease {bucket}/{key} was renewed {age:.0f} s ago" if holder else ""
    if holder:
        return (f"snapshot {path} is in use by {holder}: two live runs must not write one snapshot; wait "
                f"for that run to end (or stop it), or pass another --snapshot_path"), ""
    try:
        return "", s3.put_object(Bucket=bucket, Key=key, Body=body, IfMatch=held["ETag"])["ETag"]
    except Exception as exc:
        if error_code(exc) in _PRECONDITION:
            return (f"snapshot {path} was just claimed by another run: two live runs must not write one "
                    f"snapshot; wait for that run to end (or stop it), or pass another --snapshot_path"), ""
        return f"cannot claim --snapshot_path {path}: {describe(exc, path)}", ""


class Lease:
    """The lease this process holds on the snapshot at ``path`` (``take_lease``
    gave ``etag``), renewed every ``LEASE_RENEW_S`` by a daemon thread with
    If-Match on its ETag; ``release`` stops renewing and deletes it if it is
    still this run's. A renewal the store refuses (another run took the lease
    over) ends the renewals; ``lost`` then says so."""

    def __init__(self, path: str, me: dict, etag: str) -> None:
        self.path, self.body, self.etag = path, json.dumps(me).encode(), etag
        self.bucket, self.key = lease_key(path)
        self.lost = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, name="snapshot-lease", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        while not self._stop.wait(LEASE_RENEW_S):
            try:
                self.etag = client(self.path).put_object(Bucket=self.bucket, Key=self.key, Body=self.body,
                                                         IfMatch=self.etag)["ETag"]
            except Exception as exc:
                if error_code(exc) in _PRECONDITION:
                    self.lost = True
                    print_line(f"warning: the lease on snapshot {self.path} was taken over by another run")
                    return  # a store that does not answer: tried again at the next renewal

    def release(self) -> None:
        """Stop renewing; delete the lease if it is still this run's (its ETag unchanged)."""
        self._stop.set()
        if self.lost:
            return
        with contextlib.suppress(Exception):
            s3 = client(self.path)
            if s3.head_object(Bucket=self.bucket, Key=self.key)["ETag"] == self.etag:
                s3.delete_object(Bucket=self.bucket, Key=self.key)


def check_bucket(path: str) -> str:
    """'' when the bucket of ``path`` exists and these credentials reach it
    (HeadBucket), else the one line that says what is wrong and what to do."""
    try:
        bucket, _ = split_path(path)
        client(path).head_bucket(Bucket=bucket)
    except ConfigError as exc:
        return str(exc)
    except Exception as exc:
        return f"cannot use --snapshot_path {path}: {describe(exc, path)}"
    return ""


def claim_bucket_snapshot(path: str) -> None:
    """Collective: rank 0 checks the bucket (``check_bucket``), takes the
    snapshot's lease for this run (``take_lease``; ``Lease`` renews it, and
    ``claims.release_claim`` gives it back at the process's end) and, holding
    it, removes what torn or unfinished uploads left (``remove_uncommitted``).
    Raises ConfigError (one line, on every rank) for a bucket that cannot be
    used or a snapshot another live run holds."""
    me, ours = this_jobs_processes()
    error = ""
    if dist.get_rank() == 0:
        error = check_bucket(path)
        if not error:
            error, etag = take_lease(path, me, ours)
            if not error:
                _LEASES[path] = Lease(path, me, etag)
                _HELD.update(release=_LEASES[path].release)
                try:
                    remove_uncommitted(path)
                except BucketError as exc:
                    error = f"cannot use --snapshot_path {path}: {exc.bucket_cause}"
    error = first_error(error)
    if error:
        raise ConfigError(error)
