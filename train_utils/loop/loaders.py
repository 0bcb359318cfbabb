"""DataLoader workers started by a fork server, never forked from a rank; dense
batches, and their copy to the device.

A DataLoader without persistent workers starts new worker processes at every
epoch and every evaluation. Forked from a rank, which runs other threads by
then (gloo's, the previous epoch's queue feeders), a new worker can deadlock
inside the fork itself (docs/pitfalls.md). Here they come from
multiprocessing's fork server instead: one process per rank, started once by a
fork and exec (no threads inherited), which has imported torch, the scripts'
modules and the dataset's module, and which forks each worker from its own
single thread. The workers' seeds are drawn from the loader's generator in the
rank as before, so snapshots still restore them.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import pickle
import signal
import sys
import threading
from typing import Callable, Optional

import torch
from torch.utils.data import Dataset

from common import TASK_FILE_FOLDERS, ConfigError, draw_key
from ..ending import end_process
from ..output import print_line
from .stop import STOP_SIGNALS, ignore_stop_signal
from .stragglers import WorkerStacks

# The project folder: where train.py, common.py and the train_utils package are.
PROJECT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The fork server's context, once started. Module-level on purpose: one fork
# server serves every DataLoader of the process, as a process has one.
_CONTEXT: Optional[multiprocessing.context.BaseContext] = None


def loader_workers(num_workers: int, dataset: Dataset, sample_stacks: bool = False) -> dict:
    """DataLoader keyword arguments for ``num_workers`` worker processes
    loading ``dataset``: ``num_workers``, and with workers the fork server's
    ``multiprocessing_context`` (where the platform has one: Linux, macOS;
    elsewhere the platform's own start method, spawn) and ``worker_init_fn``
    (``worker_started``; with ``sample_stacks``, ``SampledWorkerStart``:
    each worker also samples its stack for the straggler watch, into the
    ``WorkerStacks`` that ``worker_stacks(loader)`` returns).

    The first call with workers starts this process's fork server, with the
    stop signals (``STOP_SIGNALS``) blocked: they stay blocked in the server
    and in every worker it forks, so a SIGTERM or Ctrl-C sent to the whole
    process group reaches the ranks, which decide when to stop (as
    ``ignore_stop_signal`` does once a worker runs), and no worker dies of it
    while it starts. The server preloads torch, the scripts' modules and the
    module of ``dataset``'s class; a worker then costs a fork and unpickling
    the dataset. A fork server or spawn pickles the dataset for every worker
    (its tensors go to shared memory, once): raises ConfigError when it
    cannot be pickled. A dataset of more separate tensors than a fork server
    can pass a worker as file descriptors (``MOST_STORAGES``: a list of
    per-sample tensors, say) makes torch pass them by the names of their
    shared-memory files instead (the "file_system" sharing strategy, for the
    whole process; torch's ``torch_shm_manager`` removes the files once no
    process uses them).
    """
    if num_workers == 0:
        return {"num_workers": 0}
    if _storages(dataset) > MOST_STORAGES:
        torch.multiprocessing.set_sharing_strategy("file_system")
    return {"num_workers": num_workers, "multiprocessing_context": _fork_server(dataset),
            "worker_init_fn": SampledWorkerStart(WorkerStacks()) if sample_stacks else worker_started}


def worker_stacks(loader) -> Optional[WorkerStacks]:
    """The ``WorkerStacks`` that ``loader``'s workers sample their stacks
    into (a DataLoader made with ``loader_workers(..., sample_stacks=True)``);
    None for any other loader."""
    start = getattr(loader, "worker_init_fn", None)
    return start.stacks if isinstance(start, SampledWorkerStart) else None


def worker_started(worker_id: int) -> None:
    """DataLoader ``worker_init_fn``: the worker ignores the stop signals
    (``ignore_stop_signal``: the rank decides when to stop) and ends when its
    rank does. torch's own check watches the worker's parent, which is the
    fork server here, and the server lives as long as any of its workers: a
    rank killed or ended by a time-out would leave its workers and server
    behind for good. A daemon thread waits on the pipe from the rank instead
    (``multiprocessing.parent_process().sentinel``, ready once the rank is gone
    or has let go of this worker) and then ends the process."""
    ignore_stop_signal(worker_id)
    parent = multiprocessing.parent_process()
    if parent is not None:
        threading.Thread(target=_exit_when_ready, args=(parent.sentinel,), daemon=True).start()


class SampledWorkerStart:
    """DataLoader ``worker_init_fn``: ``worker_started``, then the worker
    samples its own stack into ``stacks`` while the rank wants it
    (``WorkerStacks.start_in_worker``). Sent to every worker with the
    loader's other arguments (pickled under a fork server or spawn: the
    ``WorkerStacks`` travels as its flag and pipe, ``WorkerStacks.__getstate__``);
    what the workers load is unchanged."""

    def __init__(self, stacks: WorkerStacks) -> None:
        self.stacks = stacks

    def __call__(self, worker_id: int) -> None:
        worker_started(worker_id)
        self.stacks.start_in_worker()


def _exit_when_ready(sentinel: int) -> None:
    """The worker's watcher thread: once ``sentinel`` is ready (the rank is
    gone, or let go of this worker), the worker ends at once."""
    multiprocessing.connection.wait([sentinel])
    end_process(0, at_once=True)


def _fork_server(dataset: Dataset) -> Optional[multiprocessing.context.BaseContext]:
    """This process's fork server context, started at the first call; None
    where the platform has no fork server."""
    global _CONTEXT
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return None
    if _CONTEXT is None:
        context = multiprocessing.get_context("forkserver")
        # "__main__" alone is the default, but CPython up to 3.13 at least never
        # passes the main script's path to the server, so that preloads nothing.
        # Yet every worker runs the main script again (as __mp_main__): the server
        # imports it by name, so the modules it imports (train.py: DCP, FSDP) are
        # loaded once there, not once per worker (0.3 s a worker on 2 cores).
        context.set_forkserver_preload(["__main__", "torch", "common", "train_utils", *_main_module(),
                                        _module_of(dataset)])
        # The resource tracker first: starting it unblocks SIGINT and SIGTERM.
        multiprocessing.resource_tracker.ensure_running()
        # CPython up to 3.13 at least also ignores the sys.path it passes the
        # server: it finds the scripts' modules through PYTHONPATH.
        pythonpath = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join(_import_folders())
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            multiprocessing.forkserver.ensure_running()  # a blocked signal arriving now waits, is not lost
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            if pythonpath is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = pythonpath
        _CONTEXT = context
    return _CONTEXT


def _import_folders() -> list:
    """Where this process imports the scripts' and the task's modules from
    (``common.task_function``'s order): the folders of task files named by
    their path (``--dataset dir/my_task.py:build_task``, ``TASK_FILE_FOLDERS``),
    the main script's folder, the project folder that holds the kit (the
    main script may be a program in tools/), PYTHONPATH, the current folder."""
    folders = list(TASK_FILE_FOLDERS)
    main = getattr(sys.modules["__main__"], "__file__", None)
    folders += [os.path.dirname(os.path.abspath(main))] if main else []
    folders.append(PROJECT)
    folders += [path for path in os.environ.get("PYTHONPATH", "").split(os.pathsep) if path]
    return folders + [os.getcwd()]


def _main_module() -> list:
    """[the main script's module name] (train.py: "train"), found first in
    ``_import_folders``; [] where the main module has no file (an interactive
    session) or no importable name."""
    main = getattr(sys.modules["__main__"], "__file__", None)
    name = os.path.splitext(os.path.basename(main))[0] if main else ""
    return [name] if name.isidentifier() else []


def _module_of(dataset: Dataset) -> str:
    """The module of ``dataset``'s class, looking through the kit's wrappers."""
    return type(_task_dataset(dataset)).__module__


def _task_dataset(dataset: Dataset) -> Dataset:
    """The task's own dataset inside ``dataset``: looking through Subsets and ``SeededFetches``."""
    while isinstance(dataset, (torch.utils.data.Subset, SeededFetches)):
        dataset = dataset.dataset
    return dataset


# A fork server sends a new worker one file descriptor per tensor storage of
# its dataset, with its own and the loader's queues', at most
# multiprocessing.forkserver.MAXFDS_TO_SEND (256) in all; 200 leaves room.
MOST_STORAGES = 200


class _Probe(pickle.Pickler):
    """Pickles everything but array data (tensors, numpy arrays), into nothing:
    whether an object can be sent to a worker, without copying its data.
    ``storages`` collects the tensors' distinct storages (a slice shares its
    tensor's)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.storages: set = set()

    def reducer_override(self, obj):
        numpy = sys.modules.get("numpy")
        if isinstance(obj, torch.Tensor):
            self.storages.add(obj.untyped_storage().data_ptr())
            return tuple, ()
        if numpy is not None and isinstance(obj, numpy.ndarray):
            return tuple, ()
        return NotImplemented


class _Discard:
    def write(self, data) -> int:
        return len(data)


def _storages(dataset: Dataset) -> int:
    """The separate tensors (storages) ``dataset`` holds, found by pickling
    it without its data; raises ConfigError (one line) when it cannot be
    pickled."""
    probe = _Probe(_Discard(), protocol=pickle.HIGHEST_PROTOCOL)
    try:
        probe.dump(dataset)
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise ConfigError(f"--num_workers starts DataLoader workers by a fork server (docs/pitfalls.md), "
                          f"which must pickle the dataset, and {type(_task_dataset(dataset)).__name__} cannot be "
                          f"pickled ({exc}): define its classes and functions at the top level of a "
                          f"module (no lambdas or local functions), or use --num_workers 0") from None
    return len(probe.storages)


# --------------------------------------------------------------------------
# Dense batches, copied to the device without waiting for it
# --------------------------------------------------------------------------

def is_dense(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s elements fill its memory in one of the layouts a
    pinned copy to a GPU keeps (contiguous, or channels-last for a 4-D image
    batch): a view with gaps (``rows[:, 1:]`` of a (B, T + 1) tensor) is not."""
    return tensor.is_contiguous() or (tensor.dim() == 4 and tensor.is_contiguous(memory_format=torch.channels_last))


class SeededFetches(Dataset):
    """The training dataset ``dataset`` with torch's default generator seeded
    around each fetch from the key of what is fetched, so that the random
    draws a task makes while loading (torchvision's RandomCrop in
    ``__getitem__``, the usual place) are the same in the main process or
    any loader worker, at any worker count, and after a resume at any world
    size, as the uninterrupted run's.

    Before each ``dataset[i]``: torch's default (CPU) generator seeded with
    ``draw_key(seed, epoch, i)`` (``common.draw_key``); before a
    ``dataset.__getitems__(indices)`` (a task that cuts whole batches, where
    the batch is the unit): once, from the key of ``indices[0]``. The
    generator's state is put back after each fetch, so the draws of the
    training itself (dropout) never see the data's. The CPU generator only:
    a task that draws on a GPU while loading is not seeded. A dataset that
    has ``set_epoch`` keys its own draws (``text_tasks.TokenWindows``): it
    is given the epoch and fetched as it is, unseeded. Python's ``random``
    and NumPy's global generator are not seeded: a task that draws from them
    in a worker gets the worker's stream (docs/custom-task.md).

    ``set_epoch(epoch)`` (0-based) before each epoch's iterator starts: the
    kit's loaders start their workers anew each epoch, so every worker gets
    it. An evaluation's dataset is never given one: epoch 0's keys, so each
    evaluation of the same weights draws the same. ``len()`` and items are
    ``dataset``'s. Cost: a copy of the generator's state and a seeding per
    item, a few microseconds (benchmarks/run.py's section 2b prints it).
    """

    def __init__(self, dataset: Dataset, seed: int) -> None:
        self.dataset, self.seed, self.epoch = dataset, seed, 0
        self.keys_own_draws = callable(getattr(dataset, "set_epoch", None))

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if self.keys_own_draws:
            self.dataset.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        if self.keys_own_draws:
            return self.dataset[index]
        return self._seeded(index, self.dataset.__getitem__, index)

    def __getitems__(self, indices: list):
        batched = getattr(self.dataset, "__getitems__", None)
        if self.keys_own_draws:
            return batched(indices) if batched else [self.dataset[index] for index in indices]
        if batched is None:
            return [self._seeded(index, self.dataset.__getitem__, index) for index in indices]
        return self._seeded(indices[0], batched, indices)

    def _seeded(self, index: int, fetch: Callable, argument):
        """``fetch(argument)`` with torch's default (CPU) generator seeded from
        sample ``index``'s key, its state put back after. The generator's own
        methods: ``torch.manual_seed`` would also queue the seeding of every
        CUDA device's generator, a hundred times the cost."""
        generator = torch.default_generator
        state = generator.get_state()
        generator.manual_seed(draw_key(self.seed, self.epoch, index))
        try:
            return fetch(argument)
        finally:
            generator.set_state(state)


class DenseBatches:
    """A DataLoader's ``collate_fn``: the batch ``collate_fn`` makes (the
    task's, ``common.Task.collate_fn``), each of its tensors made dense
    (``is_dense``; a copy only where one is not). The loader pins what the
    collate function returns, and pinning keeps a tensor's strides: a
    strided view pinned is still copied to a GPU through a pageable
    temporary, a copy that waits for the GPU (ATen's copy makes a contiguous
    temporary when source and destination strides differ; CUDA's pageable
    copies are synchronous), so the host can no longer run ahead of it. A
    top-level class, so that loader workers can be sent it."""

    def __init__(self, collate_fn: Callable[[list], tuple]) -> None:
        self.collate_fn = collate_fn

    def __call__(self, items) -> tuple:
        return tuple(part if not isinstance(part, torch.Tensor) or is_dense(part) else part.contiguous()
                     for part in self.collate_fn(items))


class HostToDevice:
    """The training batch's copy to ``device``: ``(source, targets) ->`` the
    same on the device, queued (``non_blocking``: from pinned memory the host
    goes on at once). On CUDA, where the kit's loaders pin their batches
    (``train.prepare_dataloader``), the first batch is looked at once: a
    tensor that is not pinned, or not dense, is named in one warning line
    (rank ``rank`` 0), since its copy makes the host wait for the GPU at
    every step."""

    def __init__(self, device: torch.device, rank: int) -> None:
        self.device, self.rank = device, rank
        self.looked = device.type != "cuda"

    def __call__(self, source: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.looked:
            self.looked = True
            problem = host_batch_problem({"inputs": source, "targets": targets}, pinned=True)
            if problem and self.rank == 0:
                print_line(f"warning: the training batch's {problem}: its copy to the GPU waits for the GPU "
                           f"at every step; make the task's collate_fn return dense tensors that the loader "
                           f"can pin (docs/performance.md)")
        return source.to(self.device, non_blocking=True), targets.to(self.device, non_blocking=True)


def host_batch_problem(tensors: dict, pinned: bool) -> str:
    """'' when each of ``tensors`` ({name: tensor} of one batch on the host)
    is dense (``is_dense``) and, where ``pinned`` (the loader pins), pinned;
    else what is not, in a few words ("targets are not pinned")."""
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
            continue
        if not is_dense(tensor):
            return f"{name} are a strided view (strides {tuple(tensor.stride())}, shape {tuple(tensor.shape)})"
        if pinned and not tensor.is_pinned():
            return f"{name} are not pinned"
    return ""
