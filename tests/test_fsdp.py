"""train.py --strategy fsdp and hsdp, the kit's FSDP2, on CPU with gloo, its ranks
started as pods (torchrun where it restarts them, or joins two agents): parity with one process, real MNIST, exact sharded evaluation, resume
(bitwise, across world sizes, after a kill during a save, after SIGUSR1, from
HSDP to FSDP and back), the gathered snapshot as a plain checkpoint of the
task's model, memory per rank, HSDP's mesh on two torchrun agents as two nodes.
(The FSDP rung, multinode_fsdp.py, is tested with the other rungs.)"""

import gc
import json
import os
import re
import signal

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from helpers import (FAULTY_TRAIN, REPO, PODS, TORCHRUN, assert_bitwise, check, epochs, free_port, full_state,
                     held_at_step, load_task, parse_test, run, run_together, script_env, snapshot_folder, signal_when,
                     stdout_lines)
from walk import walked_blocks

import common
import train_utils
from train_utils.distributed.devices import torch_version
from train_utils.distributed.fsdp import GLOO_AVG_REDUCE_SCATTER
from train_utils.ending import end_process
import vision_tasks

FSDP = REPO / "train.py"
SNAPSHOT = "snapshot_train_fsdp"  # train.py's default --snapshot_path under --strategy fsdp
# These tests run on the CPU, where train.py --strategy fsdp refuses gloo before torch 2.10 (it
# sums in reduce_scatter; tests/test_train_utils.py measures that and tests the refusal).
pytestmark = pytest.mark.skipif(torch_version() < GLOO_AVG_REDUCE_SCATTER,
                                reason=f"torch {torch.__version__}: FSDP on gloo needs torch 2.10")
MEMORY_LINE = re.compile(r"^state per rank: .* \((?P<bytes>\d+) bytes, rank (?P<rank>\d+) of "
                         r"(?P<world>\d+)\); DDP would hold .* \((?P<ddp>\d+) bytes\), (?P<ratio>\S+)x$",
                         re.M)


def fsdp(nproc: int, *flags, restarts: int = 0, script=FSDP) -> list:
    """The command for ``script`` (train.py; FAULTY_TRAIN for a run with
    DDP_TEST_FAULT) --strategy fsdp ``flags`` on ``nproc`` processes: started
    as pods, or by torchrun where it restarts failed workers (``restarts``)."""
    if restarts:
        launcher = TORCHRUN + ["--standalone", f"--max-restarts={restarts}"]
    else:
        launcher = PODS
    return launcher + [f"--nproc_per_node={nproc}", script, "--strategy", "fsdp", *map(str, flags)]


@torch.no_grad()
def one_process_evaluation(model: torch.nn.Module, dataset, task) -> tuple:
    """(mean loss, accuracy) of ``model`` over every sample of ``dataset`` in one
    process, in batches of 8: the reference a sharded evaluation must equal."""
    model.eval()
    loss_sum, correct, samples = 0.0, 0, 0
    for source, targets in torch.utils.data.DataLoader(dataset, batch_size=8, collate_fn=common.collate):
        output = model(task.eval_transform(source))
        loss_sum += task.loss_fn(output, targets, reduction="sum").item()
        correct += (output.argmax(dim=1) == targets).sum().item()
        samples += len(targets)
    return loss_sum / samples, correct / samples




def memory(stdout: str) -> dict:
    lines = [m.groupdict() for m in MEMORY_LINE.finditer(stdout)]
    assert len(lines) == 1, stdout[-2000:]
    return {k: float(v) for k, v in lines[0].items()}


def expected_state_bytes(model: torch.nn.Module, world_size: int) -> tuple[int, int]:
    """(bytes on the largest rank, bytes DDP holds) of params + grads + SGD momentum:
    FSDP2 splits dim 0 in chunks of ceil(size / world_size), rank 0 holding a full one."""
    largest = full = 0
    for p in model.parameters():
        rows = -(-p.shape[0] // world_size)
        largest += rows * (p.numel() // p.shape[0]) * p.element_size() * 3
        full += p.numel() * p.element_size() * 3
    return largest, full


# --------------------------------------------------------------------------
# Parity: FSDP at world size W == one process with the global batch
# --------------------------------------------------------------------------

# World size 2 without accumulation: test_hsdp_on_two_nodes_shards_within_a_node_and_matches_one_process
# matches one process with 2-way shards.
# The one-process run both parity tests compare with: one epoch at a global batch of 24.
ONE_PROCESS_REFERENCE = ("ddp", "--total_epochs", 1, "--batch_size", 24)


@pytest.mark.parametrize("world_size, batch_size, accum", [(3, 4, 2)])
def test_fsdp_matches_one_process_with_the_global_batch(world_size, batch_size, accum, kit_run, tmp_path):
    """One epoch of SGD steps (76 at world size 3, each accumulating 2
    micro-batches through set_requires_gradient_sync). The MLP's last layer has 1
    output row and its first 64, which 3 does not divide: FSDP pads their
    shards. The reference is train.py's DDP with one process, which is plain
    training; the FSDP snapshot is gathered with DCP's converter."""
    global_batch = batch_size * accum * world_size
    (tmp_path / "fsdp").mkdir()
    one, _ = kit_run(*ONE_PROCESS_REFERENCE, processes=1)
    assert global_batch == ONE_PROCESS_REFERENCE[-1]
    result = check(run(fsdp(world_size, "--total_epochs", 1, "--batch_size", batch_size,
                            "--grad_accum_steps", accum, "--metrics_path", "m.jsonl"), tmp_path / "fsdp"))
    reference = torch.load(one / "snapshot_train.pt", weights_only=True)["model"]
    weights, _ = full_state(snapshot_folder(tmp_path / "fsdp" / "snapshot_train_fsdp"), tmp_path / "gathered")
    start = common.synthetic_model("mlp").state_dict()
    assert weights.keys() == reference.keys()
    worst = max((weights[name] - reference[name]).abs().max().item() for name in reference)
    print(f"world size {world_size}: max |FSDP - one process| = {worst:.2e}")
    assert worst <= 1e-5
    assert all(not torch.allclose(weights[n], start[n], atol=1e-3) for n in start)  # training moved them

    threads = os.environ.get("OMP_NUM_THREADS", "1")  # torchrun's 1 for several processes, unless set here
    assert stdout_lines(result.stdout)[0] == (
        f"device cpu | backend gloo | world_size {world_size} | global batch size {global_batch} = "
        f"batch_size {batch_size} x grad_accum_steps {accum} x world_size {world_size} | cpu threads {threads} "
        f"per process")
    assert len(epochs(result.stdout)) == 1 and parse_test(result.stdout)["loss"] < 0.1
    # Memory: exactly the bytes of rank 0's shards; DDP's, the full tensors.
    mem = memory(result.stdout)
    largest, full = expected_state_bytes(common.synthetic_model("mlp"), world_size)
    assert (mem["bytes"], mem["ddp"], mem["rank"], mem["world"]) == (largest, full, 0, world_size)
    print(f"world size {world_size}: state per rank {largest} bytes, DDP {full} bytes")


# --------------------------------------------------------------------------
# Real input: real MNIST digits; memory of a real model
# --------------------------------------------------------------------------

def test_mnist_cnn_reaches_95_percent_on_held_out_real_digits(mnist_root, tmp_path):
    """7,200 real digits, 2 epochs, 2 ranks; 2,000 held-out digits (0.976
    with torch 2.14). The CNN's 1.2 M parameters all have an even first
    dimension: exactly half of DDP's state. The sharded snapshot, gathered,
    is the task's plain model. (Stopped FSDP runs resume bitwise: below,
    test_recipes.py and test_token_files.py.)"""
    result = check(run(fsdp(2, "--dataset", "mnist", "--data_dir", mnist_root, "--total_epochs", 2),
                       tmp_path))
    lines = epochs(result.stdout)
    assert len(lines) == 2 and lines[-1]["train_loss"] < lines[0]["train_loss"]
    accuracy = parse_test(result.stdout)["acc"]
    mem = memory(result.stdout)
    print(f"FSDP real MNIST held-out accuracy: {accuracy:.4f}; state per rank {mem['bytes']:.0f} "
          f"bytes vs DDP {mem['ddp']:.0f} bytes")
    assert accuracy >= 0.95
    assert mem["bytes"] * 2 == mem["ddp"] == expected_state_bytes(vision_tasks.MnistCNN(), 2)[1]
    assert mem["ratio"] == 2.0

    # The gathered weights are a checkpoint of the task's plain model: loaded as they are
    # (strict) and scored in one process, they give the test loss the run printed.
    weights, _ = full_state(snapshot_folder(tmp_path / SNAPSHOT), tmp_path / "gathered")
    task = load_task("mnist", mnist_root, "fast")
    task.model.load_state_dict(weights)
    loss, _ = one_process_evaluation(task.model, task.test_set, task)
    assert abs(loss - parse_test(result.stdout)["loss"]) <= 1e-6


# --------------------------------------------------------------------------
# The bf16 policy; channels-last weights (exact evaluation with the FSDP model over
# uneven shards: tests/test_distributed_correctness.py, with the rungs' and the kit's)
# --------------------------------------------------------------------------

def _sharding_worker(rank, world_size, port, out_dir):
    """shard_model in a process group of ``world_size``: ResNet-18 trained one
    SGD step without and with the bf16 policy; a channels-last ResNet-18
    sharded and run. Saves what each gave, per rank."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)
    losses = {}
    for bf16 in (False, True):
        torch.manual_seed(0)
        model = train_utils.shard_model(vision_tasks.build_model("cifar10", "resnet18"),
                                        torch.device("cpu"), torch.bfloat16 if bf16 else None)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        g = torch.Generator().manual_seed(rank)
        x, y = torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 10, (4,), generator=g)
        output = model(x)
        loss = train_utils.training_loss(F.cross_entropy, compiled=False)(output, y)  # as train.py's step
        loss.backward()
        optimizer.step()
        losses[bf16] = (loss.item(), output.dtype, {p.dtype for p in model.parameters()},
                        {p.grad.dtype for p in model.parameters()})

    torch.manual_seed(0)
    model = vision_tasks.build_model("cifar10", "resnet18").to(memory_format=torch.channels_last)
    plain = vision_tasks.build_model("cifar10", "resnet18")
    plain.load_state_dict(model.state_dict())
    x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    expected = plain(x).sum().item()
    try:
        sharded = train_utils.shard_model(model, torch.device("cpu"), dtype=None)
        result = sharded(x.contiguous(memory_format=torch.channels_last)).sum().item()
    except NotImplementedError as exc:
        result = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    torch.save({"losses": losses, "channels_last": {"expected": expected, "result": result}},
               os.path.join(out_dir, f"{rank}.pt"))
    end_process(0)  # as train.py's runs end: the process group destroyed; FSDP: no interpreter teardown


@pytest.fixture(scope="module")
def sharded_resnets(tmp_path_factory) -> list:
    """What ``_sharding_worker`` gave on each of 2 ranks."""
    out = tmp_path_factory.mktemp("sharded_resnets")
    mp.spawn(_sharding_worker, args=(2, free_port(), str(out)), nprocs=2)
    return [torch.load(out / f"{rank}.pt") for rank in range(2)]


def test_bf16_mixed_precision_policy_trains_resnet_with_fp32_batchnorm(sharded_resnets):
    """--amp's MixedPrecisionPolicy on ResNet-18 (20 BatchNorm layers) on a CPU: an SGD
    step runs, the output stays in the compute dtype (bf16: the loss casts it,
    inside its compiled graph under --compile), the sharded weights and
    gradients stay fp32, and the loss, computed in fp32, is fp32's to bf16
    precision (1-2% apart here, through 18 bf16 layers)."""
    for rank, outcome in enumerate(sharded_resnets):
        (fp32_loss, *_), (bf16_loss, dtype, params, grads) = outcome["losses"][False], outcome["losses"][True]
        print(f"rank {rank}: loss fp32 {fp32_loss:.5f}, bf16 {bf16_loss:.5f}")
        assert dtype == torch.bfloat16 and params == grads == {torch.float32}
        assert abs(bf16_loss - fp32_loss) <= 0.03 * fp32_loss


def test_shard_model_takes_a_channels_last_resnet(sharded_resnets):
    """vision_tasks makes ResNets channels-last where CUDA is available (the GPU-only
    condition, applied here by hand): fully_shard refuses parameters with those strides,
    so shard_model makes them contiguous first, and the output is the unsharded model's."""
    for outcome in sharded_resnets:
        result, expected = outcome["channels_last"]["result"], outcome["channels_last"]["expected"]
        assert isinstance(result, float), result
        assert abs(result - expected) <= 1e-4 * abs(expected)


# --------------------------------------------------------------------------
# The model built on the meta device: each rank materialises its shards only
# --------------------------------------------------------------------------

TINY_GPT = ["--dataset", "shakespeare_char", "--n_layer", "2", "--n_head", "2", "--n_embd", "32", "--block_size", "16"]
# A GPT of 12.6 MB of fp32 parameters (4 blocks of 256 wide; 3 MiB a block): built whole, a rank's peak
# resident memory grows by all of it; built on the meta device, by its shard and the largest parameter.
WIDE_GPT = ["--n_layer", "4", "--n_head", "4", "--n_embd", "256"]


def _peak_rss_bytes() -> int:
    """This process's peak resident memory since the last ``_reset_peak_rss`` (VmHWM, Linux)."""
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmHWM:")).split()[1]) * 1024


def _reset_peak_rss() -> None:
    """Reset VmHWM to the current resident memory (Linux's /proc/PID/clear_refs, value 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _initial_weights_worker(rank, world_size, port, data_dir, out_dir):
    """train.py's ``build_task`` and ``build_model`` for the tiny GPT at ``world_size``
    ranks: --strategy fsdp; at 1 rank also ddp (the model built whole); at 4 also
    hsdp over 2 x 2 with --activation_checkpointing. Saves rank 0's gathered full
    weights of each; then, the wide GPT under fsdp, each rank's peak resident
    memory across ``build_task`` and ``build_model`` beside its parameter bytes."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    import train

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)
    runs = {"fsdp": ["--strategy", "fsdp"]}
    if world_size == 1:
        runs["ddp"] = ["--strategy", "ddp"]
    if world_size == 4:
        runs["hsdp"] = ["--strategy", "hsdp", "--shard_size", "2", "--activation_checkpointing"]
    out = {}
    for name, flags in runs.items():
        args = train_utils.parse_args(None, common.TASKS, argv=[*TINY_GPT, "--data_dir", data_dir, *flags])
        task, config = train.build_task(args, rank, None)
        factory = task.model_factory is not None
        train.build_model(task, config, rank, torch.device("cpu"))
        full = get_model_state_dict(task.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        out[name] = {"factory": factory, "weights": full}
    args = train_utils.parse_args(None, common.TASKS, argv=[*TINY_GPT, *WIDE_GPT, "--data_dir", data_dir,
                                                            "--strategy", "fsdp"])
    gc.collect()
    _reset_peak_rss()
    before = _peak_rss_bytes()
    task, config = train.build_task(args, rank, None)  # a task that gives a built model builds it here
    train.build_model(task, config, rank, torch.device("cpu"))
    growth = _peak_rss_bytes() - before
    whole = sum(p.numel() * p.element_size() for p in task.model.parameters())
    ranks: list = [None] * world_size
    torch.distributed.all_gather_object(ranks, growth)
    out["wide"] = {"peak_growth": ranks, "param_bytes": whole}
    if rank == 0:
        torch.save(out, os.path.join(out_dir, f"{world_size}.pt"))
    end_process(0)  # as train.py's runs end: the process group destroyed; FSDP: no interpreter teardown


def test_sharded_gpt_is_built_on_meta_with_the_weights_of_the_model_built_whole(tiny_corpus, tmp_path):
    """The built-in GPT task gives a model factory, so under FSDP and HSDP
    train.py's ``build_model`` builds it on the meta device and each rank
    materialises its shards only: the gathered initial weights are bitwise
    the same at 1, 2 and 4 ranks, under HSDP (2 x 2, activation checkpointing)
    and as DDP's (the model built whole from the same --seed); and at 4 ranks
    no rank's peak resident memory grows across ``build_task`` and ``build_model`` by the
    model's parameter bytes (a GPT of 12.6 MB: its shard, 3.2 MB, and the
    largest parameter, 1 MiB, are what it holds)."""
    results = {}
    for world_size in (1, 2, 4):
        mp.spawn(_initial_weights_worker, args=(world_size, free_port(), str(tiny_corpus["shakespeare_char"]),
                                                str(tmp_path)), nprocs=world_size)
        results[world_size] = torch.load(tmp_path / f"{world_size}.pt")
    reference = results[1]["ddp"]["weights"]
    assert results[1]["ddp"]["factory"] and len(reference) == 2 + 2 * 6 + 2  # wte, wpe, 6 a block, ln_f, lm_head
    for world_size, name in ((1, "fsdp"), (2, "fsdp"), (4, "fsdp"), (4, "hsdp")):
        assert_bitwise(results[world_size][name]["weights"], reference)
    wide = results[4]["wide"]
    print(f"peak resident memory growth across build_task and build_model at 4 ranks: {wide['peak_growth']} bytes; "
          f"parameters {wide['param_bytes']} bytes")
    assert max(wide["peak_growth"]) < 0.6 * wide["param_bytes"], wide


# --------------------------------------------------------------------------
# Resume
# --------------------------------------------------------------------------

def _resharded_load_worker(rank, world_size, port, snapshot_path, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from support.trainer import trainer_as_train_py_builds_it

    # Seeded, sharded and loaded as train.py does.
    trainer, _ = trainer_as_train_py_builds_it(["--strategy", "fsdp", "--snapshot_path", snapshot_path], rank)
    trainer.checkpointer.find()
    trainer.checkpointer.load()
    weights, optimizer_state = get_state_dict(trainer.model, trainer.optimizer,
                                              options=StateDictOptions(full_state_dict=True,
                                                                       cpu_offload=True))
    if rank == 0:
        torch.save({"weights": weights, "optimizer": optimizer_state, "epochs_run": trainer.progress.epochs_run}, out)
    trainer.stop.close()
    end_process(0)  # as train.py's runs end: the process group destroyed; FSDP: no interpreter teardown


def test_resume_with_another_world_size(newcomer_walk, tmp_path):
    """docs/fsdp.md's commands (the newcomer's walk): a world-size-2 run of one
    epoch resumed by 3 processes, each loading its new shard (DCP reshards),
    trains epoch 2, though an epoch now has 19 optimizer steps, not 28; the
    resume line says what changed. And the other way, the 3 processes'
    snapshot loaded by train.py's own Trainer in 2: gathered again, the
    weights and momentum buffers are bitwise the saved ones. (A snapshot
    taken inside an epoch: test_hsdp_stopped_mid_epoch_resumes_and_moves_to_fsdp_and_back.)"""
    number = next(number for doc, number, block in walked_blocks()
                  if doc == "docs/fsdp.md" and "--nproc_per_node=3" in block)
    block = newcomer_walk.block("docs/fsdp.md", number)
    more = block.stdout[block.stdout.index("resuming from snapshot"):]
    assert ("resuming from snapshot snapshot_train_fsdp/epoch-1 after epoch 1 (saved by world_size 2, "
            "resharded to 3: weights and optimizer state exact; global batch size 64 -> 96 at the same --lr, "
            "steps per epoch 28 -> 19; random streams restored on ranks 0-1, rank 2 starts from its "
            "seed)") in stdout_lines(more), more
    first, second = epochs(block.stdout)
    assert (first["epoch"], second["epoch"]) == (1, 2) and second["train_loss"] < first["train_loss"]
    assert "epoch 2 | batch_size 32 | steps 19" in stdout_lines(more)
    saved = newcomer_walk.saved("docs/fsdp.md", number, SNAPSHOT)
    assert sorted(os.listdir(saved)) == ["epoch-2"]
    weights, tensors = full_state(snapshot_folder(saved), tmp_path / "gathered")

    # Loaded by train.py's own Trainer in 2 processes, gathered again: bitwise.
    out = tmp_path / "loaded.pt"
    mp.spawn(_resharded_load_worker, args=(2, free_port(), str(saved), str(out)), nprocs=2)
    loaded = torch.load(out, weights_only=True)
    assert loaded["epochs_run"] == 2
    assert_bitwise(weights, loaded["weights"])
    assert_bitwise({k: v for k, v in tensors.items() if k.startswith("optimizer.")},
                   {f"optimizer.{k}": v["momentum_buffer"] for k, v in loaded["optimizer"]["state"].items()})


# --------------------------------------------------------------------------
# HSDP: sharded within a node, replicated across nodes
# --------------------------------------------------------------------------

def two_nodes(port: int, *flags) -> list:
    """The commands of two torchrun agents on this machine, two ranks each, as
    two nodes meeting through c10d rendezvous: train.py --strategy hsdp ``flags``."""
    return [TORCHRUN + ["--nnodes=2", "--nproc_per_node=2", "--rdzv-backend=c10d",
                        f"--rdzv-endpoint=localhost:{port}", f"--rdzv-id=hsdp{port}",
                        f"--rdzv-conf=is_host={int(node == 0)}", FSDP, "--strategy", "hsdp", *map(str, flags)]
            for node in range(2)]


def test_hsdp_on_two_nodes_shards_within_a_node_and_matches_one_process(kit_run, tmp_path):
    """4 ranks as 2 nodes x 2 (two torchrun agents): the default mesh is one
    replica per node (replicate 2 x shard 2), so each rank holds half of every
    parameter, not a quarter as FSDP over 4 ranks would; one epoch of 76 SGD
    steps ends at the weights of one process with the global batch of 24 within
    1e-5 (the float tolerance of the FSDP parity test: gradients summed in
    another order); the snapshot holds each shard once, not once per replica."""
    one, _ = kit_run(*ONE_PROCESS_REFERENCE, processes=1)
    outputs = run_together(two_nodes(free_port(), "--total_epochs", 1, "--batch_size", 6),
                           [tmp_path, tmp_path], script_env())
    assert all(code == 0 for code, _, _ in outputs), [err[-3000:] for _, _, err in outputs]
    stdout = "".join(out for _, out, _ in outputs)
    assert "| world_size 4 | global batch size 24 = batch_size 6 x grad_accum_steps 1 x world_size 4 | " \
           "HSDP mesh replicate 2 x shard 2 |" in stdout, stdout[-2000:]
    mem = memory(stdout)
    largest, full = expected_state_bytes(common.synthetic_model("mlp"), 2)  # shards of 2 ranks, not of 4
    assert (mem["bytes"], mem["ddp"], mem["world"]) == (largest, full, 4)

    folder = snapshot_folder(tmp_path / SNAPSHOT)
    weights, _ = full_state(folder, tmp_path / "gathered")
    reference = torch.load(one / "snapshot_train.pt", weights_only=True)["model"]
    worst = max((weights[name] - reference[name]).abs().max().item() for name in reference)
    print(f"HSDP 2 x 2: max |HSDP - one process| = {worst:.2e}")
    assert weights.keys() == reference.keys() and worst <= 1e-5
    # Each piece once: the shard files hold what the index lists, not a copy per replica, and
    # each parameter is listed in at most 2 pieces (the shards of a replica), not 4.
    from torch.distributed.checkpoint import FileSystemReader
    index = FileSystemReader(os.path.join(folder, "model")).read_metadata()
    listed = sum(info.length for info in index.storage_data.values())
    written = sum(f.stat().st_size for f in (tmp_path / SNAPSHOT).glob("*/model/*.distcp"))
    pieces = {name: len(entry.chunks) for name, entry in index.state_dict_metadata.items()}
    print(f"model shards: {written} bytes written, {listed} listed; pieces per parameter {pieces}")
    assert written == listed and max(pieces.values()) == 2


# Two epochs of 57 steps at 4 ranks (batch 8), a snapshot every 20 steps.
HSDP_FLAGS = ["--total_epochs", "2", "--batch_size", "8", "--snapshot_every_steps", "20"]


def hsdp(nproc: int, *flags, script=FSDP) -> list:
    """The command for ``script`` --strategy hsdp --shard_size 2 on ``nproc`` processes of one host, started as pods."""
    return PODS + [f"--nproc_per_node={nproc}", script, "--strategy", "hsdp", "--shard_size", "2", *map(str, flags)]


def test_hsdp_stopped_mid_epoch_resumes_and_moves_to_fsdp_and_back(tmp_path):
    """SIGUSR1 reaches every rank in epoch 2 of an HSDP run (replicate 2 x
    shard 2); every rank stops after the same step and a mid-epoch snapshot folder is
    saved. It goes on under FSDP on 2 ranks (DCP reshards the 2-D mesh's
    shards to a 1-D mesh of another size; the rest of epoch 2's permutation
    is split over 2 ranks) and trains each remaining sample once (counted),
    then HSDP on 4 ranks again trains epoch 3 from FSDP's snapshot. (The same
    mesh resumes bitwise from a stop on the Slurm test cluster:
    tests/test_stop_paths.py's preempted HSDP job; FSDP's snapshots resume
    bitwise in tests/test_check_resume.py and tests/test_recipes.py.)"""
    hold_env, held = held_at_step(57 + 13)  # epoch 2's 13th step
    text = signal_when(hsdp(4, *HSDP_FLAGS, script=FAULTY_TRAIN), tmp_path, held, signal.SIGUSR1, **hold_env)
    assert text.count("stopped by SIGUSR1") == 1 and "test | loss" not in text, text[-3000:]
    epoch, step = re.search(r"^epoch (\d+) step (\d+) \| snapshot saved at", text.split("stopped by SIGUSR1")[1],
                            re.M).groups()
    assert (epoch, step) == ("2", "14")

    moved = check(run(fsdp(2, *HSDP_FLAGS, "--metrics_path", "m.jsonl"), tmp_path))
    assert (f"resuming from snapshot {SNAPSHOT}/epoch-2-step-14 in epoch 2 after step 28 (saved by world_size 4 "
            f"as HSDP replicate 2 x shard 2, resharded to 2 as FSDP: weights and optimizer state exact; global "
            f"batch size 32 -> 16 at the same --lr, steps per epoch 57 -> 115; epoch 2 goes on after 448 of its "
            f"1844 samples") in moved.stdout, moved.stdout[-2000:]
    back = check(run(hsdp(4, *HSDP_FLAGS[2:], "--total_epochs", 3, "--metrics_path", "m.jsonl"), tmp_path))
    assert (f"resuming from snapshot {SNAPSHOT}/epoch-2 after epoch 2 (saved by world_size 2 as FSDP, "
            f"resharded to 4 as HSDP replicate 2 x shard 2:") in back.stdout, back.stdout[-2000:]
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    # epoch 2: 448 samples before the stop, the other 1396 in steps of 2 x 8; epoch 3: 57 steps of 32
    assert [(r["epoch"], r["samples"]) for r in records if "epoch" in r] == [(2, 448 + 1396 // 16 * 16),
                                                                            (3, 57 * 32)]
