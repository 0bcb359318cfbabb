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


def _os_error(exc: BaseException) -> Optional[OSError]:
    """The OSError ``exc`` is or wraps (its cause or context, or one rank's
    failure inside a DCP CheckpointException), else None."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError):
            return exc
        for failure in getattr(exc, "failures", {}).values():  # DCP: rank -> (exception, stack)
            found = _os_error(failure[0] if isinstance(failure, tuple) else failure)
            if found:
                return found
        exc = exc.__cause__ or exc.__context__
    return None


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
    error = _os_error(exc)
    if not cause and error is not None and target.startswith("s3://"):  # s3fs's failure inside a sharded save
        cause = f"the store failed ({error.strerror or type(error).__name__}: {str(error)[:160]})"
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
