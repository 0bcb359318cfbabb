"""What makes the kit fast and honest on GPUs, tested on the CPU (the device's
answers mocked where the mechanism only acts on CUDA; the checks that need a
GPU run there, skipped elsewhere, and in benchmarks/gpu_check.py): TF32 for
fp32 matmuls unless --no_tf32, and MFU against the peak of the precision used;
--deterministic; the model's FLOPs counted once for every task; no read of a
device value in the steady-state step; FSDP's blocks compiled one by one,
without graph breaks; a snapshot's tied weight stored once, its CPU buffers
reused. In process, a few seconds each."""

import argparse
import os

import pytest
import torch
import torch.multiprocessing as mp

import common
import train
import train_utils
from common import ConfigError
from gpt import GPT, GPTConfig
from helpers import free_port, kit_trainer
from train_utils.loop import numerics
from train_utils.snapshots.writer import CpuStaging
from train_utils.snapshots.file import SnapshotFile
from train_utils.logs.throughput import GPU_PEAKS, counted_flops_per_sample, flops_per_sample
from train_utils.ending import end_process

GPU = torch.device("cuda", 0)
CUDA = torch.cuda.is_available()


@pytest.fixture
def torch_switches():
    """Restores the global numerics switches a test changes (torch keeps them per process)."""
    saved = (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32,
             torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
             torch.backends.cudnn.benchmark, os.environ.get(numerics.CUBLAS_WORKSPACE_VARIABLE))
    yield
    torch.set_float32_matmul_precision(saved[0])
    torch.backends.cudnn.allow_tf32 = saved[1]
    torch.use_deterministic_algorithms(saved[2])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[3], saved[4]
    if saved[5] is None:
        os.environ.pop(numerics.CUBLAS_WORKSPACE_VARIABLE, None)
    else:
        os.environ[numerics.CUBLAS_WORKSPACE_VARIABLE] = saved[5]


def show_gpu(monkeypatch, name: str = "NVIDIA H100 80GB HBM3", capability: tuple = (9, 0)) -> None:
    """torch.cuda answers as for one GPU called ``name``."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)


def flags(*argv: str) -> argparse.Namespace:
    """train.py's flags as its command line ``argv`` gives them."""
    return train_utils.parse_args(None, common.TASKS, argv=list(argv))


# --------------------------------------------------------------------------
# fp32 on a GPU: TF32 unless --no_tf32; MFU by the precision used
# --------------------------------------------------------------------------

def test_fp32_matmuls_run_on_tf32_on_a_gpu_unless_no_tf32(monkeypatch, torch_switches, one_process_group):
    """On CUDA the kit sets PyTorch's recommended training precision for fp32
    matmuls (TF32, "high") and cuDNN's TF32 convolutions; --no_tf32 keeps
    both in full fp32; the start-up line says which; the MFU's precision
    follows (tf32 or fp32; bf16 under --amp). A GPU before Ampere has no TF32;
    a CPU is left alone (there "high" would let oneDNN round)."""
    show_gpu(monkeypatch)
    config = train_utils.RunConfig(batch_size=32)
    torch.set_float32_matmul_precision("highest")
    train_utils.set_fp32_precision(torch.device("cpu"), False)
    assert torch.get_float32_matmul_precision() == "highest"

    train_utils.set_fp32_precision(GPU, False)
    assert torch.get_float32_matmul_precision() == "high" and torch.backends.cudnn.allow_tf32
    assert train_utils.compute_precision(GPU, None) == "tf32"
    assert train_utils.compute_precision(GPU, torch.bfloat16) == "bf16"
    assert train_utils.compute_precision(GPU, torch.float16) == "fp16"
    assert " | fp32 matmuls on TF32 (--no_tf32: full fp32)" in train_utils.describe_run(GPU, config)

    train_utils.set_fp32_precision(GPU, True)
    assert torch.get_float32_matmul_precision() == "highest" and not torch.backends.cudnn.allow_tf32
    assert train_utils.compute_precision(GPU, None) == "fp32"
    assert " | fp32 matmuls in full fp32 (--no_tf32)" in train_utils.describe_run(GPU, config)

    train_utils.set_fp32_precision(GPU, False)
    show_gpu(monkeypatch, "Tesla V100-SXM2-32GB", (7, 0))
    assert train_utils.compute_precision(GPU, None) == "fp32"
    assert "fp32 matmuls in full fp32 (no TF32 before Ampere)" in train_utils.describe_run(GPU, config)
    assert "fp32 matmuls" not in train_utils.describe_run(torch.device("cpu"), config)


def test_mfu_divides_by_the_peak_of_the_precision_the_step_runs_in(monkeypatch, one_process_group):
    """fp32 without TF32 runs on the CUDA cores, at 67 TFLOP/s on an H100 SXM,
    not at the 495 of TF32 (NVIDIA's data sheet): dividing by the wrong one
    understates MFU 7x. The record names the precision whose peak it used."""
    show_gpu(monkeypatch)
    figures = {precision: train_utils.throughput_figures(1e3, 0, 1e10, GPU, precision)
               for precision in ("bf16", "fp16", "tf32", "fp32")}
    assert figures["fp32"]["mfu"] == pytest.approx(1e13 / 67e12)
    assert figures["tf32"]["mfu"] == pytest.approx(1e13 / 495e12)
    assert figures["bf16"]["mfu"] == figures["fp16"]["mfu"] == pytest.approx(1e13 / 989e12)
    assert {name: f["mfu_precision"] for name, f in figures.items()} == {p: p for p in figures}
    assert all(f["flops_per_s"] == 1e13 and "tokens_per_s" not in f for f in figures.values())
    for peaks in GPU_PEAKS.values():  # every GPU has every precision, and the tensor cores beat the CUDA cores
        assert peaks["bf16"] == peaks["fp16"] >= peaks["tf32"] > peaks["fp32"] > 0


# --------------------------------------------------------------------------
# --deterministic
# --------------------------------------------------------------------------

def test_deterministic_sets_torchs_switches_and_refuses_what_would_break_it(monkeypatch, torch_switches):
    """--deterministic turns on torch's deterministic algorithms and cuDNN's,
    without benchmarking, and on CUDA cuBLAS's fixed workspace; a
    CUBLAS_WORKSPACE_CONFIG of another value is refused in one line, one of
    the deterministic ones kept. Without the flag nothing changes. On a CPU
    the start-up line says that runs there are repeatable without it."""
    monkeypatch.delenv(numerics.CUBLAS_WORKSPACE_VARIABLE, raising=False)
    torch.use_deterministic_algorithms(False)
    numerics.set_deterministic(False)
    assert not torch.are_deterministic_algorithms_enabled()
    assert numerics.CUBLAS_WORKSPACE_VARIABLE not in os.environ

    numerics.set_deterministic(True)
    assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
    assert not torch.backends.cudnn.benchmark
    assert os.environ[numerics.CUBLAS_WORKSPACE_VARIABLE] == ":4096:8"

    monkeypatch.setenv(numerics.CUBLAS_WORKSPACE_VARIABLE, ":16:8")
    numerics.set_deterministic(True)
    assert os.environ[numerics.CUBLAS_WORKSPACE_VARIABLE] == ":16:8"
    monkeypatch.setenv(numerics.CUBLAS_WORKSPACE_VARIABLE, ":0:0")
    with pytest.raises(ConfigError, match=r"^--deterministic: CUBLAS_WORKSPACE_CONFIG=:0:0 lets cuBLAS"):
        numerics.set_deterministic(True)

    assert numerics.numerics_description(torch.device("cpu"), train_utils.RunConfig(deterministic=True)) == \
        " | deterministic (CPU runs are bitwise repeatable without it too)"


# --------------------------------------------------------------------------
# FLOPs for every task
# --------------------------------------------------------------------------

def test_flops_are_counted_once_for_every_task_and_leave_the_model_as_it_was():
    """A model without its own formula gets FLOPs counted by FlopCounterMode
    on a forward, the loss and a backward of two samples, per sample: for the
    synthetic task's linear model 2 x 20 FLOPs forward and 2 x 20 backward
    (the weight's gradient; the input needs none). Counting leaves the
    weights, BatchNorm's running statistics, the gradients (none), the
    training flag and the random state as they were. The GPT keeps its own
    formula (x the tokens of a sample)."""
    from helpers import task_args

    linear = common.load_task(task_args("synthetic", model="linear"), download=False)
    assert flops_per_sample(linear, torch.device("cpu")) == 2 * 20 + 2 * 20

    mlp = common.load_task(task_args("synthetic"), download=False)  # 20-64-1
    forward = 2 * 20 * 64 + 2 * 64 * 1
    assert flops_per_sample(mlp, torch.device("cpu")) == 3 * forward - 2 * 20 * 64  # no input gradient at layer 1

    import vision_tasks

    resnet = vision_tasks.build_model("cifar10", "resnet18")
    task = common.Task(torch.utils.data.TensorDataset(torch.rand(4, 3, 32, 32), torch.tensor([0, 1, 2, 3])),
                       None, None, resnet, torch.nn.functional.cross_entropy, True)
    before = {key: value.clone() for key, value in resnet.state_dict().items()}
    rng = torch.get_rng_state()
    per_sample = flops_per_sample(task, torch.device("cpu"))
    # 3 x the CIFAR-stem ResNet-18's forward (0.56 G multiply-adds, 1.11 GFLOPs), less conv1's input gradient
    assert 3.2e9 < per_sample < 3.4e9
    assert all(torch.equal(before[key], value) for key, value in resnet.state_dict().items())
    assert all(p.grad is None for p in resnet.parameters()) and resnet.training
    assert torch.equal(torch.get_rng_state(), rng)
    assert counted_flops_per_sample(task, torch.device("cpu"), samples=4) == per_sample  # linear in the batch

    gpt = GPT(GPTConfig(vocab_size=65, block_size=16, n_layer=2, n_head=2, n_embd=32))
    lm = common.Task(None, None, None, gpt, None, False, tokens_per_sample=16)
    assert flops_per_sample(lm, torch.device("cpu")) == gpt.flops_per_token() * 16


# --------------------------------------------------------------------------
# The steady-state step: nothing read from the device
# --------------------------------------------------------------------------

class SteadyState:
    """A training loader wrapped so that a test runs code only around the
    steady-state steps of ``Trainer.run_epoch``: from the start of the
    ``first``-th step (0-based) to the start of the last, whose work after it,
    the epoch's end, is left out. ``on``/``off`` are called there."""

    def __init__(self, loader, on, off, first: int = 2) -> None:
        self.loader, self.on, self.off, self.first = loader, on, off, first
        self.batch_size, self.sampler, self.dataset = loader.batch_size, loader.sampler, loader.dataset

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        last = len(self.loader) - 1
        for index, batch in enumerate(self.loader):
            if index == self.first:
                self.on()
            if index == last:
                self.off()
            yield batch


def _gpt_epoch(tmp_path, device: torch.device, amp, on, off, steps: int = 8) -> dict:
    """One epoch of ``steps`` steps of train.py's Trainer (the real loop) on a
    small GPT, AdamW (fused on CUDA, as build_optimizer makes it on a GPU; an
    fp16 run's loss scaler then needs no read either), clipping, the cosine
    schedule, a loader of pinned batches on CUDA; ``on``/``off`` around the
    steady-state steps (``SteadyState``). Returns the epoch's record."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=65, block_size=16, n_layer=2, n_head=2, n_embd=32)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    tokens = torch.randint(0, 65, (steps * 4, 17))
    data = train.prepare_dataloader(torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:]), 4, 0, True,
                                    0, torch.utils.data.default_collate)
    from text_tasks import lm_loss

    val_data = train.prepare_dataloader(torch.utils.data.TensorDataset(tokens[:4, :-1], tokens[:4, 1:]), 4, 0,
                                        False, 0, torch.utils.data.default_collate)
    trainer = kit_trainer(model, optimizer, lm_loss, str(tmp_path), device=device, amp=amp,
                          train_data=SteadyState(data, on, off), val_data=val_data, clip_grad_norm=1.0,
                          lr_schedule="cosine", log_every_steps=0)
    try:
        return trainer.run_epoch(0)[-1]
    finally:
        trainer.stop.close()


def test_the_steady_state_step_reads_no_value_from_the_device(tmp_path, one_process_group):
    """A read of a tensor's value on the host (``.item()``, ``bool()``,
    ``float()``: ``aten._local_scalar_dense``; ``.tolist()``) makes the CPU
    wait for the GPU: in the steady-state step the queue of GPU work would
    run dry. Counted here on the CPU, where the same code runs, over the
    real loop's steps (the loader, the step, the loss sum, the stop poll, the
    snapshot clock, the schedule), fp32 and fp16 with its loss scaler: none.
    (The epoch's end reads its totals once.) The same on CUDA, under
    torch.cuda.set_sync_debug_mode("error"): the next test."""
    from torch.utils._python_dispatch import TorchDispatchMode

    reads, counting = [], [False]

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if counting[0] and func is torch.ops.aten._local_scalar_dense.default:
                reads.append(func)
            return func(*args, **(kwargs or {}))

    tolist = torch.Tensor.tolist

    def counted_tolist(tensor):
        if counting[0]:
            reads.append("tolist")
        return tolist(tensor)

    torch.Tensor.tolist = counted_tolist
    try:
        for amp in (None, "fp16"):
            with Reads():
                record = _gpt_epoch(tmp_path / str(amp), torch.device("cpu"), amp,
                                    lambda: counting.__setitem__(0, True), lambda: counting.__setitem__(0, False))
            assert reads == [], (amp, reads)
            assert record["samples"] == 32 and record.get("skipped_steps", 0) == 0
    finally:
        torch.Tensor.tolist = tolist


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (runs in benchmarks/gpu_check.py)")
def test_the_steady_state_step_never_waits_for_the_gpu(tmp_path, one_process_group):
    """On CUDA, under torch.cuda.set_sync_debug_mode("error"), which raises at
    every operation that makes the host wait for the GPU: the steady-state
    steps of the real loop, fp32 (TF32), bf16 and fp16 with its loss scaler."""
    for amp in (None, "bf16", "fp16"):
        _gpt_epoch(tmp_path / str(amp), GPU, amp, lambda: torch.cuda.set_sync_debug_mode("error"),
                   lambda: torch.cuda.set_sync_debug_mode("default"))


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (runs in benchmarks/gpu_check.py)")
@pytest.mark.parametrize("dataset", ["shakespeare_char", "tokens"])
def test_on_a_gpu_the_kits_loader_gives_pinned_dense_batches(dataset, tmp_path, one_process_group):
    """On CUDA the kit's training loader (``train.prepare_dataloader``: the
    task's batches made dense, pinned by the loader) gives batches whose
    copy to the GPU starts from pinned memory: every tensor pinned and
    contiguous, with and without loader workers, for the language-model
    tasks, whose windows are cut from one gather."""
    from dataset_files import build_shakespeare_root, build_token_files

    data_dir = (build_shakespeare_root(tmp_path, chars=20000) if dataset == "shakespeare_char"
                else build_token_files(tmp_path, chars=20000))
    args = flags("--dataset", dataset, "--data_dir", str(data_dir), "--block_size", "32")
    task = common.load_task(args, download=False)
    for workers in (0, 2):
        loader = train.prepare_dataloader(task.train_set, 8, workers, True, 0, task.collate_fn)
        for _, batch in zip(range(3), loader):
            assert all(part.is_pinned() and part.is_contiguous() for part in batch), \
                [(part.is_pinned(), part.stride()) for part in batch]


# --------------------------------------------------------------------------
# --compile: the loss in a graph; FSDP's blocks compiled, then sharded
# --------------------------------------------------------------------------

class CompileRecorder:
    """What --compile does in this process, recorded: torch.compile with a
    backend that keeps each graph dynamo traces and runs it as traced (graph
    breaks and recompiles are dynamo's; inductor adds none), and
    ``F.cross_entropy`` counted where it runs eagerly, outside every compiled
    graph, by phase: "training", or "evaluating" while ``train.evaluate``
    runs. ``graphs``: the graphs compiled so far; ``eager``: {phase: calls}."""

    def __init__(self) -> None:
        import functools

        import torch.nn.functional as F
        from torch._inductor import config as inductor_config

        inductor_config.compile_threads = 1  # no compile workers: this backend needs none
        self.graphs, self.running, self.phase = [], 0, "training"
        self.eager = {"training": 0, "evaluating": 0}
        torch.compile = functools.partial(torch.compile, backend=self.backend)
        cross_entropy, evaluate = F.cross_entropy, train.evaluate

        def counted_cross_entropy(*args, **kwargs):
            if not torch.compiler.is_compiling() and not self.running:
                self.eager[self.phase] += 1
            return cross_entropy(*args, **kwargs)

        def evaluating(*args, **kwargs):
            self.phase = "evaluating"
            try:
                return evaluate(*args, **kwargs)
            finally:
                self.phase = "training"

        F.cross_entropy, train.evaluate = counted_cross_entropy, evaluating

    def backend(self, graph_module, example_inputs):
        """A dynamo backend: the graph kept, and run as it was traced, counted as running."""
        self.graphs.append(graph_module)

        def run(*inputs):
            self.running += 1
            try:
                return graph_module.forward(*inputs)
            finally:
                self.running -= 1

        return run

    def loss_graphs(self) -> int:
        """How many of the graphs compute a cross-entropy."""
        return sum(any("cross_entropy" in str(node.target) for node in graph.graph.nodes) for graph in self.graphs)


def _compiled_run_worker(rank, port, out_dir, data_dir, strategy):
    """One process: train.py's Trainer for --strategy ``strategy`` --compile on
    a GPT of 12 blocks, built as train.py builds it, two epochs with their
    evaluations, what dynamo does recorded (``CompileRecorder``). Saved: the
    graph breaks; the frames compiled; the graphs after the first epoch and
    its evaluation, and after the second; the eager cross-entropies, in
    training and in evaluation; the warnings dynamo logged."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=1)
    import logging

    from support.trainer import trainer_as_train_py_builds_it
    from torch._dynamo.utils import counters

    recorder = CompileRecorder()
    warnings = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("torch._dynamo").addHandler(handler)
    trainer, _ = trainer_as_train_py_builds_it(
        ["--dataset", "shakespeare_char", "--data_dir", data_dir, "--strategy", strategy, "--compile", "--n_layer",
         "12", "--n_head", "2", "--n_embd", "32", "--block_size", "16", "--batch_size", "4", "--snapshot_path",
         os.path.join(out_dir, "snapshot"), "--total_epochs", "2"], rank)
    counters.clear()
    trainer.run_epoch(0)
    after_first = len(recorder.graphs)
    trainer.run_epoch(1)
    # A graph break's reason lands in "graph_break" or, from torch 2.9 on, in "unimplemented".
    breaks = {**counters["graph_break"], **counters["unimplemented"]}
    torch.save({"graph_breaks": {reason.splitlines()[0]: count for reason, count in breaks.items()},
                "frames": dict(counters["frames"]), "graphs": (after_first, len(recorder.graphs)),
                "eager": recorder.eager, "loss_graphs": recorder.loss_graphs(), "warnings": warnings},
               os.path.join(out_dir, "counts.pt"))
    trainer.stop.close()
    end_process(0)  # as train.py's runs end: the process group destroyed; FSDP: no interpreter teardown


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_compile_runs_the_loss_in_a_graph_without_breaks_or_recompiles(strategy, tmp_path):
    """--compile over two epochs with their evaluations, on a GPT of 12 blocks:
    the training loss (its fp32 cast, log-softmax and likelihood) runs in a
    compiled graph, never eagerly (at GPT-2's vocabulary an eager loss reads
    and writes the whole logits several times a step); evaluation computes
    its own, eagerly, with its own reduction. Dynamo breaks no graph and
    compiles nothing after the first epoch and its evaluation, and no
    recompile limit is hit: under FSDP each block is compiled, then sharded
    (torchtitan's order), the twelve blocks sharing one graph, and FSDP's
    hooks run eagerly between them; compiling the whole sharded model would
    break its graph at the first unit's hooks instead (FSDP disables dynamo
    in them), where dynamo gives up on the model's forward and runs it eagerly."""
    from dataset_files import build_shakespeare_root

    data_dir = build_shakespeare_root(tmp_path / "data", chars=600)
    mp.spawn(_compiled_run_worker, args=(free_port(), str(tmp_path), str(data_dir), strategy), nprocs=1)
    counts = torch.load(tmp_path / "counts.pt")
    print({key: counts[key] for key in ("frames", "graphs", "eager", "loss_graphs")})
    assert counts["graph_breaks"] == {}, counts
    assert counts["frames"]["ok"] == counts["frames"]["total"] >= 2, counts  # no frame skipped
    assert counts["eager"]["training"] == 0 and counts["eager"]["evaluating"] > 0, counts
    assert counts["loss_graphs"] == 1, counts
    after_first, after_second = counts["graphs"]
    assert after_first == after_second, counts  # nothing compiled after the first epoch and its evaluation
    assert not [w for w in counts["warnings"] if "recompile" in w or "cache_size" in w], counts


# --------------------------------------------------------------------------
# Snapshots: a tied weight stored once; the CPU buffers reused
# --------------------------------------------------------------------------

def test_a_tied_weight_is_stored_once_and_tied_again_at_load(tmp_path, one_process_group):
    """The GPT's output layer is its token embedding (one parameter, two
    state_dict keys). The background snapshot's CPU copy keeps them one
    storage, so the file holds the weight once (a copy per tensor held it
    twice); loaded into a fresh GPT, the tie is intact and the values are the
    saved ones. A second snapshot reuses the first one's CPU buffers."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=512, block_size=16, n_layer=1, n_head=2, n_embd=64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, 512, (2, 16))).sum().backward()
    optimizer.step()
    store = SnapshotFile(str(tmp_path / "snapshot.pt"))
    write, _ = store.save(model, optimizer, {"epochs_run": 1, "steps_run": 0}, asynchronous=True)
    buffers = {key: buffer.data_ptr() for key, buffer in store.staging._buffers.items()}
    write()
    saved = torch.load(tmp_path / "snapshot.pt", weights_only=True)
    weights = saved["model"]
    assert weights["wte.weight"].untyped_storage().data_ptr() == weights["lm_head.weight"].untyped_storage().data_ptr()
    embedding_bytes = 512 * 64 * 4
    import zipfile

    with zipfile.ZipFile(tmp_path / "snapshot.pt") as archive:
        stored = sum(info.file_size for info in archive.infolist() if "/data/" in info.filename)
    state_bytes = sum(t.numel() * 4 for t in model.parameters()) * 3  # weights, AdamW's two moments
    assert stored < state_bytes + embedding_bytes // 2  # the embedding once, not twice

    fresh = GPT(GPTConfig(vocab_size=512, block_size=16, n_layer=1, n_head=2, n_embd=64))
    fresh.load_state_dict(weights)
    assert fresh.lm_head.weight is fresh.wte.weight and torch.equal(fresh.wte.weight, model.wte.weight)

    write, _ = store.save(model, optimizer, {"epochs_run": 2, "steps_run": 0}, asynchronous=True)
    write()
    assert {key: buffer.data_ptr() for key, buffer in store.staging._buffers.items()} == buffers


def test_fsdp_background_snapshots_stage_into_buffers_kept_from_one_save_to_the_next(tmp_path, one_process_group):
    """FSDP's background saves (DCP's async_save) stage the shards through one
    stager kept for the run: the second save's CPU copies are the first's
    buffers, refilled (on a GPU pinned, the copies non-blocking); each save
    holds its own values, training having changed them in between; close
    frees the buffers."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from train_utils.snapshots.sharded import ShardedSnapshots

    torch.manual_seed(0)
    model = train_utils.shard_model(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)),
                                    torch.device("cpu"), dtype=None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    store = ShardedSnapshots(str(tmp_path / "snapshots"), asynchronous=True)
    staged_memory, saved = [], []
    for steps_run in (1, 2):
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
        saved.append({key: value.full_tensor().clone() for key, value in model.state_dict().items()})
        complete, folder = store.save(model, optimizer, {"epochs_run": 0, "steps_run": steps_run}, True)
        if store.staging.stager is not None:  # torch 2.9 and newer: DCP's DefaultStager
            cached = store.staging.stager._state_dict_stager._cached_storage_mapping
            staged_memory.append(sorted(storage.data_ptr() for storage in cached.values()))
        complete()
        dcp_to_torch_save(os.path.join(folder, "model"), tmp_path / f"model-{steps_run}.pt")
    for steps_run, weights in zip((1, 2), saved):
        read = torch.load(tmp_path / f"model-{steps_run}.pt", weights_only=True)
        assert all(torch.equal(read[key], value) for key, value in weights.items())
    assert not torch.equal(saved[0]["0.weight"], saved[1]["0.weight"])
    if staged_memory:
        assert staged_memory[0] and staged_memory[0] == staged_memory[1]
    store.close()
    assert store.staging is None


def test_the_staged_copy_keeps_views_of_one_storage_as_views():
    """Tensors that share memory share it in the copy; the copy's values are
    the originals' when copied, whatever training does after."""
    base = torch.arange(12.0)
    state = {"a": base, "view": base[2:8].view(2, 3), "b": torch.ones(3)}
    staging = CpuStaging()
    copy = staging.copy(state)
    staging.wait()
    base.add_(100)
    assert torch.equal(copy["view"], torch.arange(2.0, 8.0).view(2, 3))
    assert copy["view"].untyped_storage().data_ptr() == copy["a"].untyped_storage().data_ptr()
    assert copy["b"].untyped_storage().data_ptr() != copy["a"].untyped_storage().data_ptr()
