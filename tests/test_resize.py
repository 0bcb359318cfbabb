"""A DDP job of train.py that comes back at another world size: a
snapshot taken at an epoch's end resumes with more ranks, and the
resumed run is the run that changed its world size at that epoch; one taken
inside an epoch goes on with the rest of that epoch's samples split over the
new ranks (the sampler's index sets here, in process; train.py end to end in
tests/test_fault_tolerance.py and tests/test_elastic.py)."""

import math
import re
import shutil
import signal
from collections import Counter


import pytest
import torch
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import train_utils
from common import ConfigError
from helpers import (FAULTY_TRAIN, REPO, PODS, check, epochs, error_lines, held_at_step, load_task, placements, run,
                     signal_when, snapshot_tensors, stdout_lines)

BATCH = 64
FLAGS = ["--total_epochs", "3", "--batch_size", str(BATCH), "--lr_schedule", "cosine",
         "--warmup_epochs", "0.5", "--save_every", "1"]


def steps_per_epoch(world_size: int) -> int:
    """DistributedSampler's share of the synthetic training split per rank,
    ceil(N / world_size), in whole batches (the loader drops a partial one)."""
    return math.ceil(len(load_task("synthetic").train_set) / world_size) // BATCH


def cosine_lr(lr: float, step: int, steps: int) -> float:
    """The learning rate of optimizer step ``step`` (0-based) of a run of 3
    epochs of ``steps`` steps, warm-up over half an epoch, then cosine to 0
    (docs/recipes.md), written out here on its own."""
    warmup, total = round(0.5 * steps), 3 * steps
    ramp = min(1.0, (step + 1) / warmup)
    return lr * ramp * 0.5 * (1 + math.cos(math.pi * max(0, step - warmup) / (total - warmup)))


def test_a_max_steps_run_trains_its_planned_samples_at_any_world_size(tmp_path):
    """--max_steps counts steps of the global batch the run started with. A
    map-style task recording the samples it serves (the synthetic one,
    tests/train_recording_samples.py): --max_steps 60 at 2 ranks of batch 8
    plans 960 samples. Stopped near step 20 and resumed at 1 rank, the two
    starts serve 960 together (at 1 rank the steps are 120; before, the
    resumed run stopped at its step 60, about 480), the resume line says
    the budget at both sizes, and the cosine reaches --min_lr at the end.
    The same command again at 2 ranks: nothing to train, exit 0, the
    snapshot's bytes unchanged (before, it trained again: 480 samples are
    30 of the 60 steps of 16); and so under FSDP, whose snapshots are
    folders, where a longer --max_steps is one line."""
    recording = REPO / "tests" / "train_recording_samples.py"
    flags = ["--batch_size", "8", "--max_steps", "60", "--lr", "0.05", "--lr_schedule", "cosine", "--min_lr", "0.001",
             "--metrics_path", "metrics.jsonl"]
    first, second = tmp_path / "first", tmp_path / "second"
    for folder in (first, second):
        folder.mkdir()
    hold_env, held = held_at_step(21)
    text = signal_when(PODS + ["--nproc_per_node=2", recording, *flags], tmp_path, held, signal.SIGTERM,
                       RECORD_SAMPLES_DIR=str(first), **hold_env)
    assert "stopped by SIGTERM" in text, text[-3000:]
    resumed = check(run(PODS + ["--nproc_per_node=1", recording, *flags], tmp_path, RECORD_SAMPLES_DIR=str(second)))
    assert "--max_steps 60 (steps of the first start's global batch 16) is 120 steps of 8" in resumed.stdout, \
        resumed.stdout[-3000:]
    served = {name: sum(len(path.read_text().splitlines()) for path in folder.glob("rank*.txt"))
              for name, folder in (("first", first), ("second", second))}
    assert served["first"] % 16 == 0 and 16 * 20 <= served["first"] <= 16 * 23, served
    assert served["first"] + served["second"] == 960, served
    # The last step's learning rate: the cosine's step 119 of 120 (0-based), just above --min_lr.
    last = 0.001 + (0.05 - 0.001) * 0.5 * (1 + math.cos(math.pi * 119 / 120))
    assert epochs(resumed.stdout)[-1]["lr"] == pytest.approx(last, rel=1e-4)

    snapshot = tmp_path / "snapshot_train.pt"
    saved = snapshot.read_bytes()
    again = check(run(PODS + ["--nproc_per_node=2", REPO / "train.py", *flags], tmp_path))
    assert "snapshot snapshot_train.pt already holds 960 samples of --max_steps 60 (steps of global batch 16: " \
           "960 samples): nothing to train" in again.stdout, again.stdout[-3000:]
    assert snapshot.read_bytes() == saved
    # At another strategy, whose snapshots are folders: finished still; a longer run is not its to go on.
    fsdp = [*flags, "--strategy", "fsdp", "--snapshot_path", "snapshot_train.pt"]
    again = check(run(PODS + ["--nproc_per_node=1", REPO / "train.py", *fsdp], tmp_path))
    assert "already holds 960 samples of --max_steps 60" in again.stdout, again.stdout[-3000:]
    longer = run(PODS + ["--nproc_per_node=1", REPO / "train.py", *fsdp, "--max_steps", "61"], tmp_path)
    assert longer.returncode == 2 and error_lines(longer.stderr) == [
        "error: --snapshot_path snapshot_train.pt holds a DDP snapshot (one file), where --strategy fsdp and hsdp "
        "keep a folder of sharded saves: resume it with --strategy ddp, or start a new run from its weights with "
        "--init_from snapshot_train.pt and another --snapshot_path"], longer.stderr[-3000:]
    assert snapshot.read_bytes() == saved


# More ranks: the new rank starts from its seed. Fewer ranks (streams dropped) run end to end
# mid-epoch in tests/test_fault_tolerance.py and tests/test_fsdp.py (2 on 1).
@pytest.mark.parametrize("saved, resumed", [(2, 3)])
def test_a_snapshot_from_an_epochs_end_resumes_at_another_world_size(saved, resumed, tmp_path):
    """Epoch 1 of a 3-epoch run at ``saved`` ranks, stopped as it starts epoch 2;
    then the same command at ``resumed`` ranks. The reference for the second
    part does not go through the resize: the same snapshot, rewritten as if
    ``resumed`` ranks had saved it (its config's world size; the random
    streams of ranks both runs have, those of the others left out, as the
    resize does), resumed at that world size as any snapshot is. Both must
    end bitwise equal (weights, optimizer state, schedule step, every rank's
    RNG state); the learning rates must follow the cosine counted in the new
    steps per epoch to its end at epoch 3; the resume line says what changed."""
    name = "snapshot_train.pt"
    launch = PODS + [f"--nproc_per_node={resumed}", REPO / "train.py"] + FLAGS
    steps = {size: steps_per_epoch(size) for size in (saved, resumed)}
    stopped = run(PODS + [f"--nproc_per_node={saved}", FAULTY_TRAIN] + FLAGS,
                  tmp_path, DDP_TEST_FAULT=f"step:0:{steps[saved] + 1}:raise")  # epoch 2's first step
    assert stopped.returncode != 0
    first = epochs(stopped.stdout)
    snapshot = torch.load(tmp_path / name, weights_only=True)
    assert (snapshot["epochs_run"], snapshot["steps_run"], snapshot["config"]["world_size"]) == (1, 0, saved)
    assert len(snapshot["rng_states"]) == saved and snapshot["lr_schedule"]["last_epoch"] == steps[saved]

    (tmp_path / "resized").mkdir()
    shutil.copy(tmp_path / name, tmp_path / "resized" / name)
    (tmp_path / "reference").mkdir()
    snapshot["config"]["world_size"] = resumed
    snapshot["rng_states"] = snapshot["rng_states"][:resumed]
    torch.save(snapshot, tmp_path / "reference" / name)

    resized = check(run(launch + ["--rank_lines"], tmp_path / "resized"))  # every rank's epoch line
    reference = check(run(launch, tmp_path / "reference"))

    streams = f"random streams restored on ranks 0-{saved - 1}, rank {saved} starts from its seed"
    assert (f"resuming from snapshot {name} after epoch 1 (saved by world_size {saved}, resumed by {resumed}: "
            f"global batch size {BATCH * saved} -> {BATCH * resumed} at the same --lr, steps per epoch "
            f"{steps[saved]} -> {steps[resumed]}; the cosine lr schedule with warm-up, counted in epochs, "
            f"goes on at step {steps[resumed]} of {3 * steps[resumed]}; {streams})") in stdout_lines(resized.stdout)
    assert f"resuming from snapshot {name} after epoch 1" in stdout_lines(reference.stdout)  # no note
    # Rank 0 says once where the resized world's ranks run; the epoch line is rank 0's alone, and
    # every rank's, naming it, under --rank_lines.
    assert {(rank, local) for rank, local, _ in placements(resized.stdout)[-1]} == \
        {(rank, rank) for rank in range(resumed)}, resized.stdout
    epoch_2 = f"epoch 2 | batch_size {BATCH} | steps {steps[resumed]}"
    assert [line for line in stdout_lines(reference.stdout) if line.startswith("epoch 2 | batch_size")] == [epoch_2]
    assert "[rank " not in reference.stdout
    assert sorted(re.findall(rf"^\[rank (\d) \| local_rank (\d) \| host \S+\] {re.escape(epoch_2)}$",
                             resized.stdout, re.M)) == [(str(rank), str(rank)) for rank in range(resumed)]
    assert epoch_2 not in stdout_lines(resized.stdout)

    # Bitwise the run resumed without the resize path.
    epochs_a, a = snapshot_tensors(tmp_path / "resized" / name, rng=True)
    epochs_b, b = snapshot_tensors(tmp_path / "reference" / name, rng=True)
    assert epochs_a == epochs_b == 3
    assert a.keys() == b.keys() and f"rng.{resumed - 1}" in a and f"rng.{resumed}" not in a
    assert [key for key in a if not torch.equal(a[key], b[key])] == []
    later = epochs(resized.stdout)
    assert later == [dict(e, samples_per_s=r["samples_per_s"], flop_per_s=r["flop_per_s"], epoch_s=r["epoch_s"])
                     for e, r in zip(epochs(reference.stdout), later)]

    # The schedule, counted in each part's own steps per epoch, ends at epoch 3.
    lr = snapshot["config"]["lr"]
    assert first[0]["lr"] == pytest.approx(cosine_lr(lr, steps[saved] - 1, steps[saved]), rel=1e-5)
    for epoch, record in zip((2, 3), later):
        expected = cosine_lr(lr, epoch * steps[resumed] - 1, steps[resumed])
        assert record["lr"] == pytest.approx(expected, rel=1e-5), epoch
    assert a["lr_schedule.step"].item() == 3 * steps[resumed]
    # And the loss goes on falling from where epoch 1 left it.
    assert later[0]["train_loss"] < first[0]["train_loss"] and later[1]["val_loss"] < first[0]["val_loss"]


def _batches(sampler, batch: int, steps=None) -> list:
    """The samples of ``sampler``'s whole batches (a loader's drop_last), the
    first ``steps`` of them."""
    indices = list(sampler)
    whole = len(indices) // batch if steps is None else steps
    return indices[:whole * batch]


@pytest.mark.parametrize("size, batch, before, after, steps", [
    (96, 4, 2, 1, 5), (96, 4, 1, 2, 8), (96, 4, 2, 3, 3), (96, 4, 3, 2, 4), (96, 4, 2, 4, 2), (96, 4, 2, 2, 9)])
def test_an_epoch_resumed_at_another_world_size_trains_each_sample_once(size, batch, before, after, steps):
    """``steps`` batches on each of ``before`` ranks, then the rest of the epoch
    at ``after`` ranks (the sampler's offset: the samples trained): together
    every sample of the epoch, each once (sizes that leave no partial batch).
    At the same world size the rest is what each rank's sampler would have
    given next."""
    trained = []
    for rank in range(before):
        sampler = DistributedSampler(range(size), before, rank, seed=3)
        sampler.set_epoch(2)
        trained += _batches(sampler, batch, steps)
    rest = []
    for rank in range(after):
        sampler = train_utils.ResumableDistributedSampler(range(size), after, rank, seed=3)
        sampler.set_epoch(2, start=steps * batch * before)
        rest += _batches(sampler, batch)
        if after == before:
            plain = DistributedSampler(range(size), before, rank, seed=3)
            plain.set_epoch(2)
            assert list(sampler) == list(plain)[steps * batch:]
    assert sorted(trained + rest) == list(range(size))


@pytest.mark.parametrize("size, before, after, steps", [(97, 2, 3, 5), (96, 3, 1, 4), (101, 1, 4, 20)])
def test_the_keyed_order_of_a_large_dataset_resumes_at_another_world_size_each_sample_once(size, before, after,
                                                                                           steps):
    """The order a dataset of more than KEYED_ORDER_FROM samples takes
    (``keyed_order``, asked for here on a small one): a permutation of the
    samples, another each epoch and seed, the same on every call; rank r takes
    positions r, r + W, ... of it as of torch.randperm's order, padded with
    its first positions; an epoch of ``steps`` batches of 4 on each of
    ``before`` ranks, resumed on ``after`` ranks, trains every sample, only
    the padding twice."""
    from train_utils.loop.sampler import keyed_order

    order = keyed_order(torch.arange(size), size, 3, 2)
    assert sorted(order.tolist()) == list(range(size))
    assert torch.equal(order, keyed_order(torch.arange(size), size, 3, 2))
    assert not torch.equal(order, keyed_order(torch.arange(size), size, 3, 1))
    assert not torch.equal(order, keyed_order(torch.arange(size), size, 4, 2))

    def sampler(world_size, rank, start=0):
        one = train_utils.ResumableDistributedSampler(range(size), world_size, rank, seed=3)
        one.set_epoch(2, start=start, order="keyed")
        assert one.order == "keyed"
        return one

    first = [list(sampler(before, rank)) for rank in range(before)]
    padded = math.ceil(size / before) * before
    assert [i for position in range(padded) for i in [first[position % before][position // before]]] == \
        (order.tolist() + order.tolist())[:padded]
    trained = [i for rank in range(before) for i in first[rank][:steps * 4]]
    rest = [i for rank in range(after) for i in sampler(after, rank, start=steps * 4 * before)]
    counts = Counter(trained + rest)
    assert set(counts) == set(range(size))
    assert sum(counts.values()) - size == math.ceil((size - steps * 4 * before) / after) * after - \
        (size - steps * 4 * before)  # the padding of the resumed part, no more


def test_an_epoch_of_billions_of_samples_starts_at_once_in_constant_memory():
    """A dataset of 2**33 samples (a corpus of 275 billion tokens in windows
    of 32): the sampler takes the keyed order, whose first indices come at
    once, where torch.randperm's order would need 64 GiB in every rank; up to
    KEYED_ORDER_FROM samples the order stays DistributedSampler's (the
    rungs'); a snapshot's order, recorded for its epoch, holds for the rest
    of it (one from before the keyed order: randperm's)."""
    from train_utils.loop.sampler import KEYED_ORDER_FROM, keyed_order, order_kind

    assert (order_kind(KEYED_ORDER_FROM), order_kind(KEYED_ORDER_FROM + 1)) == ("randperm", "keyed")
    huge = range(1 << 33)
    sampler = train_utils.ResumableDistributedSampler(huge, 8, 5, seed=1)
    sampler.set_epoch(4, start=1 << 20)
    assert sampler.order == "keyed" and len(sampler) == ((1 << 33) - (1 << 20)) // 8
    taken = [index for index, _ in zip(sampler, range(1000))]
    positions = (1 << 20) + 5 + 8 * torch.arange(1000)
    assert taken == keyed_order(positions, 1 << 33, 1, 4).tolist()
    assert len(set(taken)) == 1000
    small = train_utils.ResumableDistributedSampler(range(1000), 2, 0, seed=1)
    small.set_epoch(1)
    plain = DistributedSampler(range(1000), 2, 0, seed=1)
    plain.set_epoch(1)
    assert small.order == "randperm" and list(small) == list(plain)
    # A snapshot inside an epoch: its order goes on; one without the record is randperm's.
    loader = DataLoader(huge, batch_size=16, sampler=sampler)
    progress = train_utils.Progress(torch.device("cpu"), loader, 0, 1)
    state = {"epochs_run": 4, "steps_run": 3, "epoch_samples": 3 * 16 * 8, "rng_states": [],
             "config": {"world_size": 8, "batch_size": 16}}
    progress.load_state_dict(state)
    assert progress.start_order == "randperm"
    progress.load_state_dict({**state, "epoch_order": "keyed"})
    assert progress.start_order == "keyed"
    progress.end_epoch(4)
    assert progress.start_order is None


def test_a_resumed_epoch_repeats_only_its_padding():
    """101 samples, 10 batches of 1 on each of 2 ranks, then the other 81 over
    4 ranks: padded to 84 with the epoch's first 3 samples, as
    DistributedSampler pads an uninterrupted epoch: every sample trained, only
    those 3 twice."""
    order = torch.randperm(101, generator=torch.Generator().manual_seed(0)).tolist()
    trained = [i for rank in range(2) for i in list(DistributedSampler(range(101), 2, rank, seed=0))[:10]]
    rest = []
    for rank in range(4):
        sampler = train_utils.ResumableDistributedSampler(range(101), 4, rank, seed=0)
        sampler.set_epoch(0, start=20)
        rest += list(sampler)
        assert len(sampler) == len(list(sampler)) == 21  # ceil(81 / 4)
    counts = Counter(trained + rest)
    assert set(counts) == set(range(101))
    assert {i for i, n in counts.items() if n > 1} == set(order[:3])


def test_the_steps_of_a_resumed_epoch_are_counted_at_the_new_world_size():
    """A snapshot inside an epoch, step 20 of 2 ranks of batch 16 (640 samples
    trained), loaded by 1 rank: step 40 there; by 3 ranks with 2
    micro-batches per optimizer step: 640 // 96 = 6 optimizer steps, step 12.
    The sampler goes on after the 640 samples, whatever the size."""
    dataset = range(2400)
    state = {"epochs_run": 1, "steps_run": 20, "epoch_samples": 640, "epoch_totals": None,
             "rng_states": [], "config": {"world_size": 2, "batch_size": 16}}
    for world_size, accum, step in ((1, 1, 40), (3, 2, 12), (2, 1, 20)):
        loader = DataLoader(dataset, batch_size=16, sampler=train_utils.ResumableDistributedSampler(dataset, world_size,
                                                                                                     0))
        progress = train_utils.Progress(torch.device("cpu"), loader, 0, accum)
        progress.load_state_dict(state)
        assert (progress.steps_run, progress.start_samples, progress.samples_trained()) == (step, 640, 640)
        progress.steps_run += 2  # two more batches on each rank
        assert progress.samples_trained() == 640 + 2 * 16 * world_size


def test_global_batch_size_sets_the_accumulation_for_each_world_size():
    """--global_batch_size 96 of --batch_size 16: 3 micro-batches per step at
    2 ranks, 6 at 1, 2 at 3; at 4 ranks (64 per micro-batch step) one line
    naming the numbers. Without the flag --grad_accum_steps stays."""
    from train_utils.config import accumulation_steps

    for world_size, accum in ((1, 6), (2, 3), (3, 2), (6, 1)):
        assert accumulation_steps(96, 16, 1, world_size) == accum
    with pytest.raises(ConfigError, match=r"^--global_batch_size 96 is not a multiple of --batch_size "
                                          r"16 x world_size 4 = 64; "):
        accumulation_steps(96, 16, 1, 4)
    assert accumulation_steps(None, 16, 5, 2) == 5
