"""Where every rank is when a collective times out: each live rank writes
its Python stack (every thread) to a file beside the snapshot and answers
with its host, the file:line its main thread is at in the kit's or the
task's code, and the collectives it ran last (torch's flight recorder), for
the one line the job ends with (``timeouts.timeout_diagnosis``).

A rank stuck in its own code (a task's loss that never returns) is in no
collective and cannot be asked through one. So a thread of each rank waits
in the launcher's key-value store for a request, which a rank whose
collective timed out makes. Until then the thread sleeps in the store: the
training loop pays nothing for it.

The module's state (this rank's answering thread, its stack file's folder,
whether a request came) is per process, as torch.distributed's own default
group is; only the calls below set it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import sysconfig
import threading
import time
import traceback
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from .launch import store_prefix

DONE = "done"  # the request that ends every answering thread: the run ends normally
STORE_TIMEOUT = timedelta(seconds=5)  # a store that does not answer in 5 s is gone (its host stopped)
ANSWER_WAIT_S = 5.0  # the longest a report waits for the live ranks' answers


class _Answering:
    """This process's part in the report."""

    thread: Optional[threading.Thread] = None
    folder = ""  # where the stack files go (stack_folder)
    requested = threading.Event()  # set once a request came: the job is ending on a time-out
    answered = threading.Event()  # set once this rank's stack file is written and its answer given
    reporting = False  # this rank asked for the stacks (request_stacks): it writes the job's one line
    failed_at: Optional[list] = None  # where this rank's own collective timed out (note_timed_out)


_STATE = _Answering()


def run_store(name: str) -> Optional[dist.Store]:
    """A client of the launcher's store (MASTER_ADDR:MASTER_PORT), its keys under
    this attempt's prefix and ``name``/ ("hang", "straggler"); None where the
    process group has no such store (one made on a HashStore). A client of
    its own for each caller: a TCPStore client serves one request at a time,
    and the answering thread holds its own in a wait."""
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=STORE_TIMEOUT, wait_for_workers=False)
    return dist.PrefixStore(f"{store_prefix()}/{name}", store)


def _store() -> Optional[dist.Store]:
    """``run_store`` of the hang report's keys."""
    return run_store("hang")


def answer_stack_requests(folder: str) -> None:
    """Collective-free, right after ``init_process_group`` (it needs the rank):
    start this rank's answering thread, which notes this rank's host and
    process id in the store, then waits there for ``request_stacks``. On a
    request it writes this rank's stack file in ``folder`` (``write_stack_file``)
    and answers (``collect_answers`` reads it); on ``DONE`` it ends. A daemon
    thread: it never holds the process up. Does nothing without a launcher's
    store (MASTER_ADDR, MASTER_PORT unset) or when started already."""
    if _STATE.thread is not None:
        return
    store = _store()
    if store is None:
        return
    _STATE.folder = folder
    _STATE.thread = threading.Thread(target=_answer, args=(store, dist.get_rank()), daemon=True,
                                     name="hang report")
    _STATE.thread.start()


def _answer(store: dist.Store, rank: int) -> None:
    """The answering thread's body (``answer_stack_requests``)."""
    try:
        store.set(f"host/{rank}", json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
        while True:
            try:  # the store releases the GIL while it waits
                store.wait(["request"], timedelta(days=1))
                break
            except dist.DistStoreError as exc:
                if "timeout" not in str(exc).lower():
                    return  # the store is gone: the run ended
        reason = store.get("request").decode()
        if reason == DONE:
            return
        _STATE.requested.set()
        store.set(f"answer/{rank}", json.dumps(write_stack_file(rank, reason)))
        _STATE.answered.set()
    except Exception:  # noqa: BLE001 - the store went away with the run: nothing left to answer
        return


def stop_answering() -> None:
    """The run ends normally: end every rank's answering thread (a ``DONE``
    request; each rank may call it, the first one counts) and wait a moment
    for this rank's."""
    thread = _STATE.thread
    if thread is None:
        return
    try:
        store = _store()
        store.compare_set("request", "", DONE)
    except Exception:  # noqa: BLE001 - no store left: the threads end with it
        return
    thread.join(timeout=1)
    _STATE.thread = None


def hang_requested() -> bool:
    """Whether a rank asked for every rank's stack: a collective timed out
    and the job is ending. A stop signal then ends this rank at once
    (``loop.stop``'s handler): no snapshot can be saved over broken collectives;
    except on the rank making the report (``making_report``), which ends
    once its line is out."""
    return _STATE.requested.is_set()


def making_report() -> bool:
    """Whether this rank asked for the stacks (``request_stacks``) and so
    writes, or may write, the job's one line: a stop signal then must not end
    it before the line is out (``loop.stop``'s handler). torchrun sends SIGTERM to
    every rank as soon as one of them exits, and a rank that leaves the
    report to rank 0 exits while rank 0 still reads the answers."""
    return _STATE.reporting


def note_timed_out(exc: BaseException) -> None:
    """Before ``request_stacks`` on a rank whose collective timed out: its
    main thread is in the report now, so its answer names where the
    collective was called, from ``exc``'s traceback."""
    _STATE.failed_at = traceback.extract_tb(exc.__traceback__)


def finish_answer(timeout_s: float) -> None:
    """Before this rank ends on a time-out: give a request that may still come
    (another rank reports) up to ``timeout_s`` seconds, and this rank's
    answer the time to be written. Returns at once where there is no
    answering thread."""
    if _STATE.thread is None:
        return
    deadline = time.monotonic() + timeout_s
    if _STATE.requested.wait(timeout_s):
        _STATE.answered.wait(max(0.0, deadline - time.monotonic()))


def request_stacks(reason: str) -> Optional[dist.Store]:
    """Ask every rank's answering thread for its stack and answer (the first
    request counts; ``reason`` goes into each stack file). Returns the store
    client to read the answers with (``collect_answers``), or None where
    there is none (no launcher's store, or it does not answer). From now on
    this rank is the one writing the report (``making_report``)."""
    _STATE.reporting = True
    try:
        store = _store()
        if store is not None:
            store.compare_set("request", "", reason)
        return store
    except Exception:  # noqa: BLE001 - the store's host is stopped or gone: no answers to read
        return None


def collect_answers(store: Optional[dist.Store], world_size: int, deadline: float) -> dict:
    """The answers of the ranks that gave one by ``deadline`` (``time.monotonic``
    seconds): {rank: answer}, each a dict of ``write_stack_file``, or for a
    rank that noted its host but did not answer, ``{"host", "pid"}`` only."""
    found: dict = {}
    if store is None:
        return found
    pending = set(range(world_size))
    try:
        while pending:
            for rank in sorted(pending):
                if store.check([f"answer/{rank}"]):
                    found[rank] = json.loads(store.get(f"answer/{rank}"))
                    pending.discard(rank)
            if not pending or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        for rank in pending:
            if store.check([f"host/{rank}"]):
                found[rank] = json.loads(store.get(f"host/{rank}"))
    except Exception:  # noqa: BLE001 - what was read so far is the answer
        pass
    return found


# How long the report waits for a rank it continued (SIGCONT) to write its stack and answer: a
# process continued on a busy machine waits for a core first (2 s were too few on a loaded 2-core
# CI machine, and the report said "where unknown"). Only a report with a stopped rank waits.
CONTINUED_ANSWER_S = 15.0


def gather_answers(store: Optional[dist.Store], world_size: int, deadline: float) -> dict:
    """``collect_answers``, then each rank found stopped on this host
    continued (``continue_stopped``) and its answer read once it runs again
    (``CONTINUED_ANSWER_S`` at most), marked ``"continued"``."""
    answers = collect_answers(store, world_size, deadline)
    continued = continue_stopped(answers)
    if continued:
        later = collect_answers(store, world_size, time.monotonic() + CONTINUED_ANSWER_S)
        answers.update({rank: later[rank] | {"continued": True} for rank in continued if rank in later})
    return answers


def stack_folder(snapshot_path: str) -> str:
    """The folder of the stack files (and of NCCL's flight-recorder dumps):
    the one ``snapshot_path`` (--snapshot_path, a file or a folder) is in,
    as an absolute path; the working folder for a snapshot in a bucket (s3://)."""
    if snapshot_path.startswith("s3://"):
        return os.getcwd()
    return os.path.dirname(os.path.abspath(snapshot_path))


def stacks_glob() -> str:
    """The stack files of every rank, as a glob the report names: in the
    folder ``answer_stack_requests`` was given (the working folder before)."""
    return os.path.join(_STATE.folder or os.getcwd(), stack_file_name("*", "*"))


def stack_file_name(rank: int, host: str) -> str:
    """``stacks_<job id>_rank<rank>_<host>.txt`` in a Slurm job (SLURM_JOB_ID),
    else ``stacks_rank<rank>_<host>.txt``: named by rank and host, as NCCL's
    dumps are (``devices.nccl_trace_prefix``)."""
    job = os.environ.get("SLURM_JOB_ID")
    return f"stacks_{job + '_' if job else ''}rank{rank}_{host}.txt"


# Frames in these folders are Python's or an installed package's (torch's);
# the first frame outside them, from the innermost out, is the kit's or the task's.
_LIBRARY_FOLDERS = tuple(os.path.join(os.path.realpath(path), "") for path in
                         {sysconfig.get_paths()[name] for name in ("stdlib", "platstdlib", "purelib", "platlib")})


def where_in_code(frames: list) -> str:
    """``file:line in function`` of the innermost of ``frames`` (a
    ``traceback.StackSummary``, outermost first) in the kit's or the task's
    code, not Python's or an installed package's; the path relative to the
    working folder where it is inside it. '' when every frame is a library's."""
    for frame in reversed(frames):
        shown = _code_path(frame.filename)
        if shown:
            return f"{shown}:{frame.lineno} in {frame.name}"
    return ""


def frame_in_code(frame) -> str:
    """``where_in_code`` of a live frame (``sys._current_frames()``' value for
    a thread) and the frames that called it: walked from the innermost out
    without reading any source line, cheap enough for a sampling thread."""
    while frame is not None:
        shown = _code_path(frame.f_code.co_filename)
        if shown:
            return f"{shown}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return ""


def _code_path(filename: str) -> str:
    """``filename`` as the report shows it (relative to the working folder
    where it is inside it), or '' for Python's or an installed package's
    file, or a frame without a file ("<string>")."""
    if filename.startswith("<"):
        return ""
    path = _REAL_PATHS.get(filename)
    if path is None:
        path = _REAL_PATHS[filename] = os.path.realpath(filename)
    if path.startswith(_LIBRARY_FOLDERS):
        return ""
    return os.path.relpath(path) if path.startswith(os.path.join(os.getcwd(), "")) else path


_REAL_PATHS: dict = {}  # a frame's file name -> its real path: a sampler asks for the same few files again


def recent_collectives(limit: int = 20) -> list:
    """The last ``limit`` collectives this process started, oldest first, from
    torch's flight recorder (TORCH_FR_BUFFER_SIZE > 0; gloo and NCCL): each
    a dict of ``group`` (its description: "default_pg", or the kit's names),
    ``seq`` (its number within the group, the same on every rank for the
    same call), ``op`` (e.g. "gloo:all_reduce"), ``sizes`` (the input
    tensors' shapes), ``dtypes``, ``state`` (NCCL: scheduled, started,
    completed; gloo: scheduled) and ``created_ns``. [] where the recorder is
    off or this torch has none."""
    try:
        from torch._C._distributed_c10d import _dump_fr_trace_json

        entries = json.loads(_dump_fr_trace_json(includeCollectives=True)).get("entries", [])
    except Exception:  # noqa: BLE001 - no recorder: the report names no collective
        return []
    out = [{"group": (entry.get("process_group") or ["", "?"])[-1], "seq": entry.get("collective_seq_id", 0),
            "op": entry.get("profiling_name", "?"), "sizes": entry.get("input_sizes", []),
            "dtypes": entry.get("input_dtypes", []), "state": entry.get("state", ""),
            "created_ns": entry.get("time_created_ns", 0)}
           for entry in entries if not entry.get("is_p2p")]
    return sorted(out, key=lambda entry: entry["created_ns"])[-limit:]


def describe_collective(entry: dict) -> str:
    """One collective of ``recent_collectives`` in a few words:
    ``#57 gloo:all_reduce Float[1234] (default group)``."""
    tensors = ", ".join(f"{dtype}{list(size)}" for dtype, size in zip(entry["dtypes"], entry["sizes"]))
    return f"#{entry['seq']} {entry['op']}{' ' + tensors if tensors else ''} ({_group(entry['group'])})"


def write_stack_file(rank: int, reason: str) -> dict:
    """Write this rank's stack file (``stack_file_name`` in the folder of
    ``answer_stack_requests``): the reason, every thread's Python stack
    (innermost frame last, as in a traceback) and the collectives this rank
    ran last. Returns the answer for the report: ``host``, ``pid``,
    ``where`` (``where_in_code`` of the main thread), ``collectives`` (the
    last of ``recent_collectives`` per group: {group: entry}), ``newest``
    (the one started last, or None) and ``file`` (its path, '' where it
    could not be written)."""
    host = socket.gethostname()
    frames = sys._current_frames()
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    main = threading.main_thread().ident
    if _STATE.failed_at is not None:  # the main thread is reporting: where its collective timed out
        where = where_in_code(_STATE.failed_at)
    else:
        where = where_in_code(traceback.extract_stack(frames[main])) if main in frames else ""
    collectives = recent_collectives()
    lines = [f"rank {rank}, host {host}, pid {os.getpid()}, {time.strftime('%Y-%m-%d %H:%M:%S %z')}",
             f"asked by: {reason}",
             f"main thread at: {where or 'no frame of the kit or the task'}"
             f"{' (where its collective timed out)' if _STATE.failed_at is not None else ''}", "",
             "collectives started last (torch's flight recorder), oldest first:"]
    lines += [f"  {describe_collective(entry)} {entry['state']}" for entry in collectives] or ["  none recorded"]
    if _STATE.failed_at is not None:
        lines += ["", "main thread where its collective timed out, innermost last:"]
        lines += [line.rstrip("\n") for line in traceback.format_list(_STATE.failed_at)]
    for ident, frame in sorted(frames.items(), key=lambda item: item[0] != main):  # the main thread first
        if ident == threading.get_ident():
            continue  # this thread, the one writing
        lines += ["", f"thread {names.get(ident, ident)}{' (main)' if ident == main else ''}, innermost last:"]
        lines += [line.rstrip("\n") for line in traceback.format_stack(frame)]
    path = os.path.join(_STATE.folder, stack_file_name(rank, host))
    try:
        os.makedirs(_STATE.folder, exist_ok=True)
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
    except OSError:
        path = ""
    newest = collectives[-1] if collectives else None
    last = {entry["group"]: entry for entry in collectives}
    return {"host": host, "pid": os.getpid(), "where": where, "collectives": last, "newest": newest,
            "file": path}


def process_state(pid: int) -> str:
    """This host's process ``pid``'s state letter from /proc (``T``: stopped,
    ``t``: stopped by a debugger, ``D``: in uninterruptible I/O, ...); ''
    where it is gone or there is no /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def continue_stopped(answers: dict) -> list:
    """Send SIGCONT to each rank of ``answers`` that noted its host and pid
    but did not answer, runs on this host and is stopped (SIGSTOP: state
    ``T``; one stopped by a debugger, ``t``, is left alone), as Slurm
    continues a stopped task before it signals it: the job is ending on a
    time-out, and a stopped process could end only by the launcher's SIGKILL
    after its grace period (torchrun's 30 s). Continued, it writes its stack
    and ends at the launcher's SIGTERM. Returns the ranks continued."""
    continued = []
    for rank, answer in sorted(answers.items()):
        if "where" in answer or answer.get("host") != socket.gethostname() or process_state(answer["pid"]) != "T":
            continue
        try:
            os.kill(answer["pid"], signal.SIGCONT)
            continued.append(rank)
        except OSError:
            pass
    return continued


def describe_ranks(answers: dict, waiting: Optional[dict], stuck: list) -> str:
    """The report's account of the ranks that did not arrive (``stuck``),
    from ``answers`` (``collect_answers``) and ``waiting`` (the collective
    this rank timed out in, a ``recent_collectives`` entry, or None): each
    one's host and file:line, and how its collectives stand against
    ``waiting``; a rank that did not answer as stopped or dead."""
    return "; ".join(_describe_rank(rank, answers.get(rank), waiting) for rank in stuck)


def describe_mismatch(answers: dict) -> str:
    """Where every rank arrived but each from another collective (the last
    each started differs in group, number or op): that mismatch, each rank's
    collective and file:line; '' otherwise."""
    places = {rank: answer["newest"] for rank, answer in sorted(answers.items()) if answer.get("newest")}
    if len({(entry["group"], entry["seq"], entry["op"]) for entry in places.values()}) < 2:
        return ""
    return ("the ranks timed out in different collectives (a mismatch: a rank skipped or added one): " +
            "; ".join(f"rank {rank} in {describe_collective(entry)} at {answers[rank].get('where') or '?'}"
                      for rank, entry in places.items()))


def _describe_rank(rank: int, answer: Optional[dict], waiting: Optional[dict]) -> str:
    """One stuck rank, for ``describe_ranks``."""
    if answer and answer.get("continued"):  # stopped, then continued here (continue_stopped)
        where = answer.get("where")
        return (f"rank {rank} (host {answer['host']}, pid {answer['pid']}) was stopped (SIGSTOP), "
                f"{'at ' + where if where else 'where unknown'}; continued now so that it can end")
    if answer is None:
        return f"rank {rank} (host unknown) did not answer: it is stopped or dead"
    host = answer["host"]
    if "where" not in answer:  # it noted its host at start-up, then did not answer
        state = process_state(answer["pid"]) if host == socket.gethostname() else ""
        how = {"T": "it is stopped (SIGSTOP)", "t": "it is stopped by a debugger"}.get(
            state, "it is stopped (SIGSTOP), frozen inside native code, or dead")
        return f"rank {rank} (host {host}, pid {answer['pid']}) did not answer: {how}"
    text = f"rank {rank} (host {host}) is at {answer['where'] or 'no frame of the kit or the task'}"
    if waiting is not None:
        own = answer["collectives"].get(waiting["group"])
        if own is None or own["seq"] < waiting["seq"]:
            text += (f", not in collective #{waiting['seq']} (it ran the {_group(waiting['group'])}'s to "
                     f"#{own['seq'] if own else 0})")
        elif own["seq"] == waiting["seq"] and (own["op"], own["sizes"]) != (waiting["op"], waiting["sizes"]):
            text += f", in {describe_collective(own)} (a mismatch)"
    return text


def _group(description: str) -> str:
    """A group's name in the report: "default group", "stop signal group"."""
    return "default group" if description in ("default_pg", "") else f"{description} group"
