"""Snapshots: what a run writes so that any stop resumes exactly, and reads
back. Its face is the ``Checkpointer`` (``checkpointer.py``), given the run's
stateful parts; ``claim_snapshot_path``, the claim taken at start-up, and
``release_claim``, which gives it back; ``saved_budget_batch``, the
global batch a run's --max_steps counts in, read before the run's
configuration is resolved; ``position``, where a snapshot
stands in words; ``START_AFRESH``, how to start afresh; ``take_initial_sizes``
and ``load_initial_weights``, a new run's weights from elsewhere (--init_from); the two formats and
``read_snapshot``, for a plan that reads a snapshot without a run (``plan.resume_line``), and
for one in a bucket ``in_bucket``, ``newest_snapshot_url`` and ``read_newest``; and for the logs kept
beside a snapshot in a bucket (the goodput ledger, the timeline) ``BucketWriter``, ``read_bytes``,
``list_urls`` and their ``BucketError``.

  module        concern
  checkpointer  the Checkpointer: find, load, save, wait, close; the parts it is given
  bucket        snapshots in a bucket (s3://): generations committed by a manifest; the claim as a lease;
                objects PUT whole from memory (the logs beside the snapshot)
  file          the file format (DDP): atomic save; reading one, "same run?" checks
  sharded       the sharded format (FSDP): a folder of DCP shards per save, complete when meta.pt is
  writer        snapshots written in the background, one at a time; the CPU staging; the clock
  claims        one live run per snapshot: its claim file, whether a holder lives
  save_errors   a save the system refused: one line naming the intact snapshot
  position      where a snapshot stands, in words
  weights       a new run's starting weights (--init_from): kit snapshots, nanoGPT's ckpt.pt, Hugging Face GPT-2
"""

from .bucket import BucketError, BucketWriter, in_bucket, list_urls, newest_snapshot_url, read_bytes, read_newest
from .checkpointer import Checkpointer, Found, claim_snapshot_path, held_samples, saved_budget_batch
from .claims import release_claim
from .file import START_AFRESH, SnapshotFile, read_snapshot
from .position import position
from .sharded import ShardedSnapshots, mesh_name, newest_complete
from .weights import load_initial_weights, take_initial_sizes

__all__ = ["Checkpointer", "Found", "claim_snapshot_path", "release_claim", "held_samples", "saved_budget_batch",
           "START_AFRESH", "position", "load_initial_weights", "take_initial_sizes",
           "SnapshotFile", "ShardedSnapshots", "read_snapshot", "mesh_name", "newest_complete",
           "in_bucket", "newest_snapshot_url", "read_newest", "BucketError", "BucketWriter", "list_urls",
           "read_bytes"]
