"""The speed features keep the results right: the fast input path (batched
device augmentation, whole uint8 batches through the same samplers), gradient
accumulation with DDP's no_sync(), --compile, --amp on a CPU, peak memory.
No test here measures or asserts a time; benchmarks/ does the measuring."""

import json
import os
import re

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import common
import fast_images
import train_utils
from common import ConfigError
from train_utils.distributed.devices import peak_memory_mib
from train_utils.loop.speed import check_amp
from train_utils.logs.throughput import GPU_PEAKS, gpu_peak
import vision_tasks
from dataset_files import build_cifar10_root, build_mnist_root
from helpers import (FAULTY_TRAIN, load_task, REPO, PODS, TORCHRUN, check, epochs, error_lines, free_port, one_process,
                     parse_test, run, kit_trainer, snapshot_tensors)

MD5_BYPASS = REPO / "tests" / "md5_bypass.py"
ONE_RANK = PODS + ["--nproc_per_node=1", REPO / "train.py"]


# --------------------------------------------------------------------------
# Batched augmentation: exactly RandomCrop(padding=4) + RandomHorizontalFlip
# --------------------------------------------------------------------------

def _match_crops(images, out, padding):
    """For each output image, the (dy, dx, flipped) of the zero-padded input
    it equals exactly; -1 where none does."""
    n, _, h, w = images.shape
    padded = F.pad(images, (padding,) * 4)
    found = torch.full((n, 3), -1)
    for dy in range(2 * padding + 1):
        for dx in range(2 * padding + 1):
            crop = padded[:, :, dy:dy + h, dx:dx + w]
            for flipped, candidate in ((0, crop), (1, crop.flip(-1))):
                hit = (out == candidate).flatten(1).all(1)
                assert not (hit & (found[:, 0] >= 0)).any(), "ambiguous match: images too plain"
                found[hit] = torch.tensor([dy, dx, flipped])
    return found


def test_batched_crop_and_flip_are_exact_crops_of_the_padded_image():
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (2000, 3, 32, 32), generator=g, dtype=torch.uint8)
    torch.manual_seed(1)
    out = fast_images.random_crop_flip(images, padding=4)
    assert out.shape == images.shape and out.dtype == torch.uint8
    found = _match_crops(images, out, padding=4)
    assert (found >= 0).all(), "some output is not a crop (or mirrored crop) of its padded input"
    # All 9 x 9 offsets occur, none rarely (expected 2000 / 81 = 24.7 each)...
    counts = torch.bincount(found[:, 0] * 9 + found[:, 1], minlength=81)
    assert (counts >= 5).all(), counts
    # ...and about half the images are mirrored (binomial sd 1.1%).
    assert abs(found[:, 2].float().mean().item() - 0.5) < 0.05
    # Deterministic under the seed of the device's generator; another seed differs.
    torch.manual_seed(1)
    assert torch.equal(fast_images.random_crop_flip(images, padding=4), out)
    torch.manual_seed(2)
    assert not torch.equal(fast_images.random_crop_flip(images, padding=4), out)


def test_device_transform_normalizes_exactly_like_torchvision():
    """Without augmentation, the fast path's floats are bit for bit those of
    ToTensor + Normalize on the same pixels."""
    from PIL import Image
    from torchvision import transforms

    images = torch.randint(0, 256, (16, 3, 32, 32), generator=torch.Generator().manual_seed(0),
                           dtype=torch.uint8)
    stats = (vision_tasks.CIFAR10_MEAN, vision_tasks.CIFAR10_STD)
    reference = transforms.Compose([transforms.ToTensor(), transforms.Normalize(*stats)])
    expected = torch.stack([reference(Image.fromarray(image.permute(1, 2, 0).numpy()))
                            for image in images])
    fast = fast_images.DeviceTransform(stats)
    assert torch.equal(fast(images), expected)


def test_fast_path_gives_the_same_batches_through_distributed_sampler(mnist_root):
    """InMemoryImages hands the DataLoader whole batches via __getitems__, but
    DistributedSampler still decides which samples each rank gets: per rank,
    every batch equals the per-sample torchvision path's, exactly."""
    fast = load_task("mnist", mnist_root, "fast")
    slow = load_task("mnist", mnist_root, "torchvision")
    for rank in (0, 1):
        loaders = [DataLoader(task.train_set, batch_size=32, drop_last=True, collate_fn=common.collate,
                              sampler=DistributedSampler(task.train_set, 2, rank, seed=0))
                   for task in (fast, slow)]
        batches = 0
        for (x_fast, y_fast), (x_slow, y_slow) in zip(*loaders):
            assert x_fast.dtype == torch.uint8 and x_fast.shape == (32, 1, 28, 28)
            assert torch.equal(fast.train_transform(x_fast), x_slow) and torch.equal(y_fast, y_slow)
            batches += 1
        assert batches == len(loaders[1]) == 3600 // 32


def test_cifar10_fast_path_reads_the_real_format(tmp_path, monkeypatch):
    import torchvision.datasets.cifar as cifar

    monkeypatch.setattr(cifar, "check_integrity", lambda path, md5=None: os.path.isfile(path))
    root = build_cifar10_root(tmp_path / "cifar")
    fast = load_task("cifar10", root, "fast")
    slow = load_task("cifar10", root, "torchvision")
    assert (len(fast.train_set), len(fast.val_set), len(fast.test_set)) == (54, 6, 20)
    # Evaluation views: identical normalized images and labels.
    for a, b in ((fast.val_set, slow.val_set), (fast.test_set, slow.test_set)):
        x, y = common.collate(a.__getitems__(list(range(len(a)))))
        x_slow, y_slow = common.collate([b[i] for i in range(len(b))])
        assert torch.equal(fast.eval_transform(x), x_slow) and torch.equal(y, y_slow)
    # Training: the train transform crops and flips the uint8 pixels, then normalizes.
    x, _ = common.collate(fast.train_set.__getitems__(list(range(54))))
    torch.manual_seed(0)
    augmented = fast.train_transform(x)
    torch.manual_seed(0)
    stats = (vision_tasks.CIFAR10_MEAN, vision_tasks.CIFAR10_STD)
    assert torch.equal(augmented, fast_images.DeviceTransform(stats)(fast_images.random_crop_flip(x, 4)))


# --------------------------------------------------------------------------
# Same accuracy either way, on the real MNIST digits
# --------------------------------------------------------------------------

def test_fast_and_torchvision_paths_train_the_same_model_on_real_mnist(tmp_path):
    """1,350 real digits (1,500 minus the 10% validation split), one epoch, two
    ranks, scored on 500 held-out digits the model never saw.
    MNIST has no augmentation, and both paths make the same floats in the same
    order, so the runs agree to the last digit. (That the model learns MNIST
    to 95% is test_fsdp's and test_container's.)"""
    mnist_root = build_mnist_root(tmp_path / "data", n_train=1500, n_test=500)
    results = {}
    for path in ("fast", "torchvision"):
        (tmp_path / path).mkdir()
        result = check(run(PODS + ["--nproc_per_node=2", REPO / "train.py",
                                       "--dataset", "mnist", "--data_dir", mnist_root, "--total_epochs", "1",
                                       "--input_path", path, "--metrics_path", "metrics.jsonl"], tmp_path / path))
        results[path] = (epochs(result.stdout), parse_test(result.stdout))
    for path, (lines, test) in results.items():
        print(f"{path}: held-out accuracy {test['acc']:.4f}, samples/s {lines[-1]['samples_per_s']:.0f}")
        assert len(lines) == 1 and "val_acc" in lines[0]
        assert test["acc"] >= 0.5  # one epoch of few digits: it learns (chance is 0.1)
        record = json.loads((tmp_path / path / "metrics.jsonl").read_text().splitlines()[-1])
        assert record["test_accuracy"] == pytest.approx(test["acc"], abs=1e-4)
    assert results["fast"][1] == results["torchvision"][1]
    assert ([(e["train_loss"], e["val_loss"]) for e in results["fast"][0]]
            == [(e["train_loss"], e["val_loss"]) for e in results["torchvision"][0]])


# --------------------------------------------------------------------------
# Gradient accumulation
# --------------------------------------------------------------------------

def test_accumulation_resumes_bitwise_after_a_kill_mid_epoch(tmp_path):
    """--grad_accum_steps 2 on 2 ranks: the start-up line gives the global
    batch (batch x accumulation x world size), once; --snapshot_every_steps
    counts optimizer steps, as --eval_every_steps and --log_every_steps do
    (every 2 is every 4 micro-batches: a snapshot's position counts the
    micro-batches trained in its epoch, "epoch 1 step 4"), so snapshots fall
    between optimizer steps; a worker killed in the middle of an
    accumulation resumes from the last one and ends bitwise equal to an
    uninterrupted run. (That 2 accumulated micro-batches make the step of
    their whole batch: in process, below.) On a CPU the epoch line and the
    metrics carry no GPU memory figure."""
    flags = ["--total_epochs", "2", "--snapshot_every_steps", "2", "--grad_accum_steps", "2",
             "--metrics_path", "m.jsonl"]
    (tmp_path / "clean").mkdir()
    (tmp_path / "killed").mkdir()
    clean = check(run(PODS + ["--nproc_per_node=2", REPO / "train.py"] + flags,
                      tmp_path / "clean"))
    assert clean.stdout.count("global batch size") == 1
    assert "global batch size 128 = batch_size 32 x grad_accum_steps 2 x world_size 2" in clean.stdout
    saved = re.findall(r"^(epoch .*) \| snapshot saved at snapshot_train.pt$", clean.stdout, re.M)
    # 28 micro-batches an epoch: every 4th, then the run's end (--save_every 5 saves no earlier epoch's)
    assert saved == [f"epoch {epoch} step {step}" for epoch in (1, 2) for step in range(4, 28, 4)] + ["epoch 2"], \
        saved
    record = json.loads((tmp_path / "clean" / "m.jsonl").read_text().splitlines()[1])  # epoch 1
    assert "peak_gpu_memory_mib" not in record and "peak_mem_mib" not in clean.stdout
    killed = check(run(TORCHRUN + ["--standalone", "--nproc_per_node=2", "--max-restarts=1",
                                   FAULTY_TRAIN] + flags, tmp_path / "killed",
                       DDP_TEST_FAULT="step:1:39:kill_once_saved"))  # epoch 2 (28 micro-batches each), its 11th
    assert "resuming from snapshot snapshot_train.pt in epoch 2 after step 8" in killed.stdout
    _, straight = snapshot_tensors(tmp_path / "clean" / "snapshot_train.pt")
    _, resumed = snapshot_tensors(tmp_path / "killed" / "snapshot_train.pt")
    assert [name for name in straight if not torch.equal(straight[name], resumed[name])] == []


def _no_sync_worker(rank, world_size, port, out_dir):
    """Train 4 micro-batches with train.py's Trainer and a DDP comm hook that
    counts the gradient all-reduces (and still does them), without and with
    accumulating 2 a step; then the same 64 samples of each rank in steps of
    16 (2 accumulated micro-batches of 8, 1 batch of 16, 1 batch of 8)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    counts = {}
    for accum in (1, 2):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        trainer = kit_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                              F.mse_loss, out_dir, rank, grad_accum_steps=accum)
        calls = []

        def counting_hook(state, bucket):
            calls.append(len(bucket.gradients()))
            return default_hooks.allreduce_hook(state, bucket)

        trainer.model.register_comm_hook(None, counting_hook)
        grads_after_first = None
        g = torch.Generator().manual_seed(rank)  # each rank its own data
        for step in range(4):
            trainer.train_step(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g))
            if step == 0:
                grads_after_first = model.weight.grad.clone()
        counts[accum] = {"calls": len(calls), "first_grad": grads_after_first,
                         "weight": model.weight.detach().clone()}
    g = torch.Generator().manual_seed(10 + rank)
    x, y = torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g)
    for name, batch, accum in (("8 x 2", 8, 2), ("16 x 1", 16, 1), ("8 x 1", 8, 1)):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        trainer = kit_trainer(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                              F.mse_loss, out_dir, rank, grad_accum_steps=accum)
        for start in range(0, 64 if batch * accum == 16 else 32, batch):  # 4 steps of 16, or of 8
            trainer.train_step(x[start:start + batch], y[start:start + batch])
        counts[name] = {key: value.detach().clone() for key, value in model.state_dict().items()}
    torch.save(counts, os.path.join(out_dir, f"{rank}.pt"))
    torch.distributed.destroy_process_group()


def test_no_sync_skips_the_all_reduce_of_all_but_the_last_micro_batch(tmp_path):
    """Under --grad_accum_steps the micro-batches before a step's last add up
    their gradients on each rank, with no all-reduce; and 2 accumulated
    micro-batches of 8 make the step of their batch of 16 (the mean loss
    over the same samples), which 2 steps of 8 do not."""
    mp.spawn(_no_sync_worker, args=(2, free_port(), str(tmp_path)), nprocs=2)
    ranks = [torch.load(tmp_path / f"{rank}.pt") for rank in (0, 1)]
    for r in ranks:
        assert r[1]["calls"] == 4  # one all-reduce per micro-batch without accumulation
        assert r[2]["calls"] == 2  # with 2 micro-batches per step: only the last one's
    # Without accumulation the first micro-batch's gradient is already the average
    # (equal on both ranks); under no_sync() each rank keeps its own.
    assert torch.equal(ranks[0][1]["first_grad"], ranks[1][1]["first_grad"])
    assert not torch.allclose(ranks[0][2]["first_grad"], ranks[1][2]["first_grad"])
    # After the synced micro-batch the ranks stepped alike: the weights still agree.
    assert torch.equal(ranks[0][2]["weight"], ranks[1][2]["weight"])
    accumulated, whole, half = ranks[0]["8 x 2"], ranks[0]["16 x 1"], ranks[0]["8 x 1"]
    assert max((accumulated[n] - whole[n]).abs().max().item() for n in whole) <= 1e-6
    assert max((accumulated[n] - half[n]).abs().max().item() for n in whole) > 1e-3


# --------------------------------------------------------------------------
# --compile and --amp
# --------------------------------------------------------------------------

def test_snapshot_written_with_compile_loads_without_it(tmp_path):
    launch = PODS + ["--nproc_per_node=1", REPO / "train.py"]
    check(run(launch + ["--total_epochs", "1", "--compile"], tmp_path))
    state = torch.load(tmp_path / "snapshot_train.pt", weights_only=True)["model"]
    assert not [key for key in state if "_orig_mod" in key or key.startswith("module.")]
    common.synthetic_model("mlp").load_state_dict(state)  # a plain model takes it
    resumed = check(run(launch + ["--total_epochs", "2"], tmp_path))  # no --compile
    assert "resuming from snapshot snapshot_train.pt after epoch 1" in resumed.stdout
    assert [int(e["epoch"]) for e in epochs(resumed.stdout)] == [2]


def test_amp_on_cpu_is_refused_in_one_line_where_it_does_not_help(tmp_path):
    result = one_process(["--amp"], tmp_path)
    assert result.returncode != 0
    assert error_lines(result.stderr) == [
        "error: --amp on a CPU: bf16 autocast does not speed up --model mlp on a CPU (measured, "
        "see docs/performance.md); --amp is for GPUs (--amp bf16 or fp16 forces it). Run without --amp"]
    assert not (tmp_path / "snapshot_train.pt").exists()


def test_amp_on_a_gpu_without_native_bf16_is_fp16_and_forced_bf16_is_refused(monkeypatch, one_process_group):
    """A T4 (compute capability 7.5) would emulate bf16: slower, so plain --amp is
    fp16 there (with a loss scaler) and a forced --amp bf16 is refused in one line;
    an Ampere or newer GPU gets bf16. (Faked here: no GPU on the test machines.)"""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    gpu = torch.device("cuda", 0)
    with pytest.raises(ConfigError) as info:
        check_amp("bf16", gpu, "resnet18")
    assert str(info.value) == ("--amp bf16: Tesla T4 (compute capability 7.5) has no native bf16, "
                               "which needs 8.0 (Ampere) or newer; bf16 autocast would be emulated "
                               "and slower. Use --amp (fp16 with a loss scaler on this GPU)")
    check_amp("auto", gpu, "resnet18")
    assert train_utils.RunConfig(amp=train_utils.resolve_amp("auto", gpu)).compute_dtype == torch.float16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    check_amp("bf16", gpu, "resnet18")  # e.g. an A100: accepted
    assert train_utils.RunConfig(amp=train_utils.resolve_amp("auto", gpu)).compute_dtype == torch.bfloat16


def _mixed_gpus_worker(rank, port, out_dir):
    """Rank 0 on an A100 (native bf16), rank 1 on a V100 (none): torch.cuda's
    answers faked, the process group real (gloo)."""
    import contextlib
    import io

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    torch.cuda.is_bf16_supported = lambda including_emulation=True: rank == 0
    torch.cuda.get_device_name = lambda device=None: ["NVIDIA A100-SXM4-80GB", "Tesla V100-SXM2-32GB"][rank]
    torch.cuda.get_device_capability = lambda device=None: [(8, 0), (7, 0)][rank]
    gpu = torch.device("cuda", 0)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        amp = train_utils.resolve_amp("auto", gpu)  # as train.py's main does, into the run's configuration
    train_utils.checks.check_same_settings(train_utils.RunConfig(amp=amp, batch_size=32))
    result = {"amp": amp, "dtype": str(train_utils.RunConfig(amp=amp).compute_dtype), "printed": printed.getvalue()}
    try:
        train_utils.resolve_amp("bf16", gpu)
        result["forced_bf16"] = "accepted"
    except ConfigError as exc:
        result["forced_bf16"] = str(exc)
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(result, f)
    torch.distributed.destroy_process_group()


def test_plain_amp_is_one_dtype_for_the_whole_job_on_mixed_gpus(tmp_path):
    """A job on an A100 and a V100: plain --amp is fp16 with a loss scaler on
    both ranks (per rank it was bf16 on one and fp16 on the other, which DDP
    averages together and FSDP's loss scaler hangs on), rank 0 says why in one
    note; a forced --amp bf16 is refused on every rank, naming the V100."""
    import socket

    mp.spawn(_mixed_gpus_worker, args=(free_port(), str(tmp_path)), nprocs=2)
    results = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(2)]
    assert [(r["amp"], r["dtype"]) for r in results] == [("fp16", "torch.float16")] * 2
    host = socket.gethostname()
    assert results[0]["printed"] == (
        f"note: --amp is fp16 with a loss scaler on every rank: rank 1 of 2 runs on a GPU without native bf16 "
        f"(Tesla V100-SXM2-32GB (compute capability 7.0) on {host}), and every rank must train in the same dtype\n")
    assert results[1]["printed"] == ""
    assert results[0]["forced_bf16"] == results[1]["forced_bf16"] == (
        f"--amp bf16: rank 1 of 2 runs on a GPU without native bf16 (Tesla V100-SXM2-32GB (compute capability "
        f"7.0) on {host}), which needs compute capability 8.0 (Ampere) or newer; bf16 autocast would be "
        f"emulated and slower there. Use --amp (fp16 with a loss scaler on every rank)")


def test_the_peak_table_matches_gpu_names_to_their_own_data_sheet():
    """'L4' must not give the L40S the L4's peak (1.5-3x off), nor 'A10' the A100's
    (the table the kit's MFU and the benchmark's fraction of peak use)."""
    peak, peaks = gpu_peak, GPU_PEAKS
    assert peak("NVIDIA L4") == peaks["L4"]
    assert peak("NVIDIA L40S") is None and peak("NVIDIA L40") is None
    assert peak("NVIDIA A10") == peaks["A10"]
    assert peak("NVIDIA A100-SXM4-80GB") == peaks["A100"]
    assert peak("NVIDIA H100 PCIe") == peaks["H100 PCIe"]


def test_the_peak_table_gives_h200_nvl_its_own_peak_and_a_mig_slice_none(monkeypatch):
    """The H200 NVL's dense bf16 peak is 835 TFLOP/s, not the SXM's 989; a MIG
    slice has a fraction of the GPU's units, so no whole-GPU peak (unknown)."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gpu_peak("NVIDIA H200 NVL") == {"bf16": 835e12, "fp16": 835e12, "tf32": 418e12, "fp32": 60e12}
    assert gpu_peak("NVIDIA H200") == GPU_PEAKS["H200"] == {"bf16": 989e12, "fp16": 989e12, "tf32": 495e12,
                                                             "fp32": 67e12}
    assert gpu_peak("NVIDIA H100 80GB HBM3 MIG 1g.10gb") is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-5c2b6a7e-0000-0000-0000-000000000000")
    assert gpu_peak("NVIDIA H100 80GB HBM3") is None


def test_benchmark_records_a_failing_section_and_skips_what_needs_two_gpus(monkeypatch, tmp_path):
    """One GPU: the sections of two processes are skipped with the reason; a section
    that raises is recorded with its error, and the sections after it still run."""
    from benchmarks import run as benchmark

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)

    def broken():
        raise RuntimeError("NCCL error: unhandled cuda error\nmore lines")

    def never():
        raise AssertionError("a section needing 2 GPUs was started on 1")

    report = {"sections": {}}
    out = tmp_path / "latest.json"
    benchmark.run_sections([("5", "gpu", broken, 1), ("6", "fsdp_vs_ddp", never, 2),
                            ("7", "after", lambda: {"table": "after ran"}, 1)], report, str(out))
    sections = json.loads(out.read_text())["sections"]
    assert sections["gpu"]["error"] == "RuntimeError: NCCL error: unhandled cuda error"
    assert sections["gpu"]["table"] == "**5. gpu**\n\nfailed: RuntimeError: NCCL error: unhandled cuda error"
    assert sections["fsdp_vs_ddp"]["skipped"] == "needs 2 GPUs (one per process), this machine has 1"
    assert sections["after"]["table"] == "after ran"


def test_the_gpu_checks_first_pair_runs_however_little_of_its_budget_is_left():
    """benchmarks/gpu_check.py's timed pairs (the kit against nanoGPT): a
    lent GPU's cold compile in the warm runs may take most of the budget;
    the first pair still runs (each run stays bounded by the check's end),
    so the check always comes back with a timed pair. A later pair starts
    only where the last one's time fits; the sides alternate who goes first."""
    import time

    from benchmarks.gpu_pairs import alternating_pairs, pair_summary
    from benchmarks.gpu_runs import Budget

    order = []

    def side(name: str, ms: float):
        def run(budget: Budget) -> dict:
            order.append(name)
            assert budget.timeout(600) > 500  # bounded by the check's end, not by its soft end
            time.sleep(0.05)
            return {"ms_per_step": ms}
        return run

    sides = {"kit": side("kit", 2.0), "nanoGPT": side("nanoGPT", 3.0)}
    now = time.monotonic()
    spent = Budget(now + 600, soft=now - 1)  # the warm compile outlasted the part's share
    summary = pair_summary(alternating_pairs(3, sides, spent))
    assert order == ["kit", "nanoGPT"] and summary["median"] == 1.5
    order.clear()
    assert len(alternating_pairs(3, sides, Budget(time.monotonic() + 600))) == 3
    assert order == ["kit", "nanoGPT", "nanoGPT", "kit", "kit", "nanoGPT"]


def test_amp_on_cpu_follows_the_measurement_for_the_cnn(tmp_path):
    cpu = torch.device("cpu")
    check_amp(None, cpu, "resnet18")  # no --amp: nothing to check
    check_amp("fp16", cpu, "resnet18")  # forced: runs anyway
    with pytest.raises(ConfigError, match=r"does not speed up this task's model \(measured: only"):
        check_amp("auto", cpu, None)  # a task of yours that names no --model
    with pytest.raises(ConfigError, match="does not speed up --model resnet18"):
        check_amp("auto", cpu, "resnet18")
    if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        with pytest.raises(ConfigError, match="no native bf16 instructions"):
            check_amp("auto", cpu, "cnn")
        return
    check_amp("auto", cpu, "cnn")  # measured faster on a CPU with native bf16
    # ...and it trains: one epoch of bf16 autocast on 2,250 real digits (0.75 held-out accuracy
    # with torch 2.14 on a CPU; chance is 0.1).
    data = build_mnist_root(tmp_path / "data", n_train=2500, n_test=500)
    result = check(one_process(["--dataset", "mnist", "--data_dir", data, "--total_epochs", "1", "--amp"],
                       tmp_path))
    assert parse_test(result.stdout)["acc"] >= 0.6


def test_epoch_line_shows_peak_gpu_memory_when_given(capsys):
    from helpers import EPOCH_LINE

    train_utils.RunLog().log(
        {"epoch": 1, "total_epochs": 1, "train_loss": 0.5, "samples_per_s": 10.0, "epoch_seconds": 1.0,
         "val_loss": 0.5, "val_accuracy": None, "peak_gpu_memory_mib": 1536.25})
    line = capsys.readouterr().out.strip()
    assert line.endswith("| epoch_s 1.00 | peak_mem_mib 1536.2")
    assert EPOCH_LINE.match(line).group("peak_mem_mib") == "1536.2"
    assert peak_memory_mib(torch.device("cpu")) == {}
