"""Every random draw of the training data keyed by (seed, epoch, sample): the
loader's worker count never changes a run, and a run stopped and resumed with
another worker count ends bitwise as the uninterrupted one.

The language-model tasks key their windows' random offsets themselves
(text_tasks.TokenWindows, and token_tasks.TokenFileWindows for token files;
common.draw_key); a task of the user's that draws from torch's default
generator while loading (torchvision's RandomCrop in ``__getitem__``) gets
that generator seeded around each fetch by the kit
(train_utils.SeededFetches)."""

from __future__ import annotations

import signal
from collections import Counter

import pytest
import torch

import common
import text_tasks
import token_tasks
from dataset_files import build_token_files
from helpers import FAULTY_TRAIN, REPO, PODS, check, evaluations, held_at_step, run, signal_when, \
    snapshot_tensors

from train_utils import SeededFetches


# --------------------------------------------------------------------------
# In process: the keys, the windows, a dataset's own draws
# --------------------------------------------------------------------------

def test_a_windows_offset_is_its_own_whatever_batch_fetches_it(tmp_path):
    """TokenWindows, once given an epoch: window i's offset is a function of
    (seed, epoch, i), the same fetched alone or in any batch, from a tensor or
    from nanoGPT's token file; another epoch or seed draws others; torch's
    default generator is not drawn from."""
    data = build_token_files(tmp_path / "tokens", chars=20000)
    file = token_tasks.TokenFile(str(data / "train.bin"))
    tokens = file.rows(torch.zeros(1, dtype=torch.int64), len(file))[0]
    in_memory = text_tasks.TokenWindows(tokens, 16, shift=True, seed=7)
    on_disk = token_tasks.TokenFileWindows(file, 16, shift=True, seed=7)
    for windows in (in_memory, on_disk):
        windows.set_epoch(3)
    before = torch.random.get_rng_state()
    batch = on_disk.windows([5, 900, 17, 5])
    assert torch.equal(torch.random.get_rng_state(), before)
    assert torch.equal(batch, in_memory.windows([5, 900, 17, 5]))
    assert torch.equal(batch[0], batch[3]) and torch.equal(batch[1], in_memory.windows([900])[0])
    starts = [(common.draw_key(7, 3, i) % 16) + i * 16 for i in (5, 900, 17)]
    assert [int(row[0]) for row in batch[:3]] == [int(tokens[s]) for s in starts]
    first = in_memory.windows(list(range(64)))
    in_memory.set_epoch(4)
    other_seed = text_tasks.TokenWindows(tokens, 16, shift=True, seed=8)
    other_seed.set_epoch(3)
    assert not torch.equal(in_memory.windows(list(range(64))), first)
    assert not torch.equal(other_seed.windows(list(range(64))), first)


class Crops(torch.utils.data.Dataset):
    """Each item a draw from torch's default generator, as RandomCrop draws its crop."""

    def __len__(self) -> int:
        return 100

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return torch.randint(1000, (3,)), index


def test_a_task_drawing_from_torchs_generator_draws_per_sample_keys():
    """SeededFetches: an item's draws depend on (seed, epoch, index) only (not
    on the order, the batch, or what was drawn before), and the training's
    own stream (dropout's) is left where it was."""
    fetches = SeededFetches(Crops(), seed=3)
    fetches.set_epoch(1)
    torch.manual_seed(0)
    before = torch.random.get_rng_state()
    batch = fetches.__getitems__([4, 9, 4])
    assert torch.equal(torch.random.get_rng_state(), before)
    assert torch.equal(batch[0][0], batch[2][0]) and torch.equal(batch[1][0], fetches[9][0])
    torch.manual_seed(123)
    assert torch.equal(fetches[4][0], batch[0][0])
    fetches.set_epoch(2)
    assert not torch.equal(fetches[4][0], batch[0][0])


# --------------------------------------------------------------------------
# train.py: 0 loader workers straight through = 2 workers stopped, resumed with 4
# --------------------------------------------------------------------------

CROP_TASK = '''"""A task of the user's that augments inside its dataset, the usual way."""
import torch
import torch.nn as nn
import torch.nn.functional as F
from torchvision import transforms

import common


class NoisyImages(torch.utils.data.Dataset):
    def __init__(self, n, seed):
        generator = torch.Generator().manual_seed(seed)
        self.images = torch.rand(n, 1, 8, 8, generator=generator)
        self.labels = (self.images[:, 0, 2:6, 2:6].mean((1, 2)) > 0.5).long()
        self.crop = transforms.RandomCrop(8, padding=2)  # draws from torch's default generator

    def __len__(self):
        return len(self.images)

    def __getitem__(self, index):
        return self.crop(self.images[index]), self.labels[index]


def build_task(args, download):
    model = nn.Sequential(nn.Flatten(), nn.Dropout(0.1), nn.Linear(64, 2))
    return common.Task(NoisyImages(512, args.seed), NoisyImages(128, args.seed + 1), None, model,
                       F.cross_entropy, classification=True)
'''


# (A language model's windows and dropout: tests/test_language_model.py stops its run with 2
# workers and resumes it with 4, bitwise the run without; --dataset tokens cuts the same
# windows from files, and resumes with other workers at another world size below.)
def test_the_worker_count_never_changes_a_run_nor_a_resume_with_another(tmp_path):
    """A task whose random crops are drawn while loading, 2 ranks. Straight
    through with 0 loader workers; then with 2 workers, stopped by SIGTERM
    after step 21 (rank 0 held before step 20) and resumed with 4: the
    weights, optimizer state, schedule and every rank's RNG state at the end
    are bitwise the same. (Before the draws were keyed, each worker count
    drew other crops, and a resume others again.)"""
    flags = ["--dataset", "crop_task.py:build_task", "--total_epochs", "2", "--batch_size", "16"]  # 16 steps an epoch
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    for folder in (straight, stopped):
        folder.mkdir()
        (folder / "crop_task.py").write_text(CROP_TASK)
    two = PODS + ["--nproc_per_node=2"]
    check(run(two + [REPO / "train.py", *flags, "--num_workers", "0"], straight))
    hold_env, held = held_at_step(20)
    text = signal_when(two + [FAULTY_TRAIN, *flags, "--num_workers", "2"], stopped, held, signal.SIGTERM,
                       **hold_env)
    assert "stopped by SIGTERM" in text, text[-3000:]
    resumed = check(run(two + [REPO / "train.py", *flags, "--num_workers", "4"], stopped))
    assert "resuming from snapshot snapshot_train.pt in epoch" in resumed.stdout, resumed.stdout
    epochs_a, a = snapshot_tensors(straight / "snapshot_train.pt", rng=True)
    epochs_b, b = snapshot_tensors(stopped / "snapshot_train.pt", rng=True)
    assert epochs_a == epochs_b and a.keys() == b.keys()
    assert [name for name in a if not torch.equal(a[name], b[name])] == []


# --------------------------------------------------------------------------
# A token run stopped mid-epoch, resumed at another world size and worker count
# --------------------------------------------------------------------------

RECORDING = REPO / "tests" / "train_recording_samples.py"


@pytest.mark.parametrize("ranks,workers", [(1, 4), (4, 0)])
def test_a_token_run_resumed_at_another_world_size_trains_each_window_once(ranks, workers, tmp_path):
    """--dataset tokens on 2 shards in llm.c's format (1,124 windows of 16),
    2 ranks with 2 loader workers, evaluated every 20 steps: SIGTERM while
    rank 0 is held before step 25, the run stops after step 26; resumed by
    ``ranks`` ranks with ``workers`` workers, it trains the rest of the epoch.
    Every window the two runs train (recorded as each rank's loop takes its
    batch: tests/train_recording_samples.py) is trained once; those never
    trained are only the epoch's last partial batches (fewer than a global
    batch and its padding); the evaluations by steps go on, the best
    validation loss carried over the stop."""
    from test_token_files import shard_folder

    tokens = build_token_files(tmp_path / "nanogpt", chars=20000)
    ids = torch.frombuffer(bytearray((tokens / "train.bin").read_bytes()), dtype=torch.int16).tolist()
    val = torch.frombuffer(bytearray((tokens / "val.bin").read_bytes()), dtype=torch.int16).tolist()
    shard_folder(tmp_path / "shards", ids, 2, True, val)
    (tmp_path / "shards" / "meta.pkl").write_bytes((tokens / "meta.pkl").read_bytes())
    flags = ["--dataset", "tokens", "--data_dir", tmp_path / "shards", "--n_layer", "1", "--n_head", "2",
             "--n_embd", "32", "--block_size", "16", "--batch_size", "8", "--total_epochs", "1", "--max_steps", "0",
             "--eval_every_steps", "20", "--eval_windows", "32", "--log_every_steps", "0"]
    first, second = tmp_path / "first", tmp_path / "second"
    for folder in (first, second):
        folder.mkdir()
    hold_env, held = held_at_step(25)
    launch = PODS + ["--nproc_per_node=2", RECORDING, *flags, "--num_workers", "2"]
    text = signal_when(launch, tmp_path, held, signal.SIGTERM, RECORD_SAMPLES_DIR=str(first), **hold_env)
    assert "epoch 1 step 26 | snapshot saved at snapshot_train.pt" in text, text[-3000:]
    resumed = check(run(PODS + [f"--nproc_per_node={ranks}", RECORDING, *flags,
                                    "--num_workers", str(workers)], tmp_path, RECORD_SAMPLES_DIR=str(second)))
    assert f"resuming from snapshot snapshot_train.pt in epoch 1 after step {26 * 2 // ranks} (saved by " \
           f"world_size 2, resumed by {ranks}:" in resumed.stdout, resumed.stdout[-3000:]
    trained = Counter(line for folder in (first, second) for path in folder.glob("rank*.txt")
                      for line in path.read_text().splitlines())
    windows = len(token_tasks.TokenFileWindows([token_tasks.TokenFile(str(p)) for p in
                                                sorted((tmp_path / "shards").glob("*train*.bin"))], 16, shift=True))
    assert max(trained.values()) == 1, [line for line, n in trained.items() if n > 1][:5]
    assert {line.split()[0] for line in trained} == {"0"}  # epoch 1 (0-based)
    never = windows - len(trained)
    print(f"{windows} windows: {len(trained)} trained once, {never} in the last partial batches")
    assert 0 <= never < ranks * 8 + ranks
    before, after = evaluations(text), evaluations(resumed.stdout)
    assert before and after, resumed.stdout[-2000:]
    best = min(float(before[-1]["best_val_loss"]), float(after[0]["val_loss"]))
    assert float(after[0]["best_val_loss"]) == best
