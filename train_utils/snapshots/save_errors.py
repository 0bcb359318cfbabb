"""A save the system refused (a full disk, a quota, a read-only mount): the
one line that names the cause, the snapshot that is intact and what to do.
"""

from __future__ import annotations

import errno
import os
from typing import Optional

from ..output import RunFailed

# What to do about a save that the system refused, by its errno.
_SAVE_FIX = {errno.ENOSPC: "free space on that disk", errno.EDQUOT: "free space within your disk quota",
             errno.EROFS: "make that file system writable", errno.EACCES: "make that folder writable"}


def _wrapped(exc: BaseException, wanted) -> Optional[BaseException]:
    """The first exception for which ``wanted(exception)`` is true among
    ``exc``, its causes and contexts, and each rank's failure inside a DCP
    CheckpointException; else None."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if wanted(exc):
            return exc
        for failure in getattr(exc, "failures", {}).values():  # DCP: rank -> (exception, stack)
            found = _wrapped(failure[0] if isinstance(failure, tuple) else failure, wanted)
            if found:
                return found
        exc = exc.__cause__ or exc.__context__
    return None


def _os_error(exc: BaseException) -> Optional[OSError]:
    """The OSError ``exc`` is or wraps (its cause or context, or one rank's
    failure inside a DCP CheckpointException), else None."""
    return _wrapped(exc, lambda e: isinstance(e, OSError))


def _store_error(exc: BaseException) -> Optional[BaseException]:
    """The failure of a request to an object store that ``exc`` is or wraps
    (botocore's, aiobotocore's, aiohttp's or s3transfer's, as s3fs and boto3
    raise them, or a connection's OSError), else None."""
    return _wrapped(exc, lambda e: isinstance(e, OSError) or type(e).__module__.split(".")[0] in (
        "botocore", "aiobotocore", "aiohttp", "s3transfer", "urllib3"))


def _bucket_cause(exc: BaseException) -> str:
    """What a store's failure ``exc`` (a ``bucket.BucketError``, or an
    exception it caused) was, in a few words; '' for another exception."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if getattr(exc, "bucket_cause", ""):
            return exc.bucket_cause
        exc = exc.__cause__ or exc.__context__
    return ""


def save_failure(exc: BaseException, target: str, intact: str) -> Optional[RunFailed]:
    """The one line for a save of ``target`` that failed with ``exc`` when
    the system refused a write (an OSError: a full disk, a quota), or a
    bucket's store failed (``bucket.BucketError``), as a
    RunFailed naming the cause, which snapshot is intact (``intact``: its path
    and position, '' when none was saved yet) and what to do; None for any
    other exception. A DCP CheckpointException (a sharded save, raised on
    every rank) gives ``every_rank``."""
    cause = _bucket_cause(exc)
    if not cause and target.startswith("s3://"):  # s3fs's failure inside a sharded save (DCP's)
        failure = _store_error(exc)
        if failure is not None:
            from .bucket import describe  # a bucket's snapshots alone need it

            cause = describe(failure, target)
    error = _os_error(exc)
    if cause:  # a store that failed or refused (bucket.BucketError): the previous generation is intact
        kept = (f"snapshot {intact} is intact: fix that, then run the same command to resume from it" if intact
                else "no snapshot was saved before: fix that, or pass another --snapshot_path")
        return RunFailed(f"cannot save snapshot {target}: {cause}; {kept}", every_rank=hasattr(exc, "failures"))
    if error is None:
        return None
    cause = error.strerror or type(error).__name__
    where = os.path.dirname(os.path.abspath(error.filename or target))
    fix = _SAVE_FIX.get(error.errno, "fix that")
    kept = (f"snapshot {intact} is intact: {fix}, or pass a --snapshot_path on another disk after "
            f"moving it there; then run the same command to resume from it" if intact else
            f"no snapshot was saved before: {fix}, or pass a --snapshot_path on another disk")
    return RunFailed(f"cannot save snapshot {target}: {cause} (writing in {where}); {kept}",
                     every_rank=hasattr(exc, "failures"))
