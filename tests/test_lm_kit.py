"""What the kit does for a language model: tokens/s, FLOPs per token and MFU
in the epoch record; text out (--sample_chars) after training and from a
finished run's snapshot; FSDP units per transformer block with the tied
embedding in the root, stopped and resumed exactly; activation checkpointing
with the same losses and gradients and fewer saved activations."""

import copy
import json
import os
import signal

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

import common
import train_utils
from train_utils.logs.throughput import model_flops_per_token
from common import ConfigError
from gpt import GPT, GPTConfig
from dataset_files import build_shakespeare_root, require_tinyshakespeare
from helpers import (EPOCH_LINE, FAULTY_TRAIN, REPO, PODS, assert_bitwise, check, free_port, full_state, run,
                     signal_when, snapshot_folder)

def test_flops_per_token_is_6n_plus_attention_with_nanogpts_n():
    """nanoGPT's CPU recipe model (4 layers, 4 heads, 128 wide, context 64, 65
    characters) has N = 0.80M without the position embedding (nanoGPT prints
    0.80M), so 6N + 12 x 4 x 128 x 64 FLOPs per token (nanoGPT's 12 L H Q T,
    H Q = n_embd), the GPT's own figure, which the kit reads; a model that
    gives none has none."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=65, block_size=64, n_layer=4, n_head=4, n_embd=128))
    n = sum(p.numel() for p in model.parameters()) - 64 * 128  # the tied output layer counted once
    assert n == 795_904
    assert model_flops_per_token(model) == 6 * n + 12 * 4 * 128 * 64 == 5_168_640
    small = GPT(GPTConfig(vocab_size=10, block_size=4, n_layer=2, n_head=3, n_embd=3))
    assert small.flops_per_token() == 6 * small.num_parameters(embeddings=False) + 12 * 2 * 3 * 4
    assert model_flops_per_token(torch.nn.Linear(3, 3)) is None


def test_tokens_flops_and_mfu_figures(monkeypatch, one_process_group):
    """tokens/s = samples/s x tokens per sample; FLOP/s = samples/s x FLOPs per
    sample (a task not counted in tokens too); MFU against the data-sheet peak
    of every rank's GPU in the step's precision: bf16 under --amp, tf32 or
    fp32 without; none on a CPU or an unknown GPU (here every rank is this
    one, in a group of one). The line shows them and the tests' parser reads them."""
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert train_utils.throughput_figures(100.0, 0, None, cpu, "fp32") == {}
    assert train_utils.throughput_figures(100.0, 0, 1000, cpu, "fp32") == {"flops_per_s": 1e5}
    assert train_utils.throughput_figures(100.0, 64, None, cpu, "fp32") == {"tokens_per_s": 6400.0}
    assert train_utils.throughput_figures(100.0, 64, 64000, cpu, "fp32") == {"tokens_per_s": 6400.0,
                                                                             "flops_per_s": 6.4e6}
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    bf16 = train_utils.throughput_figures(1e6, 256, 256 * 10**7, gpu, "bf16")
    assert bf16["mfu"] == pytest.approx(2.56e15 / 312e12) and bf16["mfu_precision"] == "bf16"
    for precision, peak in (("tf32", 156e12), ("fp32", 19.5e12)):
        mfu = train_utils.throughput_figures(1e6, 256, 256 * 10**7, gpu, precision)["mfu"]
        assert mfu == pytest.approx(2.56e15 / peak)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA L40S")
    assert "mfu" not in train_utils.throughput_figures(1e6, 256, 256 * 10**7, gpu, "bf16")

    record = {"epoch": 1, "total_epochs": 2, "train_loss": 2.5, "val_loss": 2.6, "samples_per_s": 100.0,
              "epoch_seconds": 3.0, "lr": 1e-3, **bf16}
    parsed = EPOCH_LINE.search(_line(record)).groupdict()
    assert float(parsed["tokens_per_s"]) == bf16["tokens_per_s"]
    assert float(parsed["mfu"]) == pytest.approx(bf16["mfu"], abs=1e-4)


def _line(record: dict) -> str:
    from train_utils.logs.metrics import metrics_line

    return metrics_line(record)


class Tied(torch.nn.Module):
    """Three children, the first and the last sharing one weight (an output layer tied to an embedding)."""

    def __init__(self):
        super().__init__()
        self.embed, self.hidden, self.out = torch.nn.Embedding(5, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 5)
        self.out.weight = self.embed.weight


def test_fsdp_units_are_the_transformer_blocks_and_a_tied_weight_stays_in_the_root():
    """A GPT: one unit per block; the token embedding and the output layer,
    one shared weight, stay in the root (two units holding it are refused by
    fully_shard). Another model with tied children: they stay in the root."""
    model = GPT(GPTConfig(vocab_size=65, block_size=16, n_layer=3, n_head=2, n_embd=32))
    assert common.fsdp_units(model) == list(model.blocks)
    tied = Tied()
    assert common.fsdp_units(tied) == [tied.hidden]


def _sharded_units_worker(rank, port, out_dir):
    """One process: the FSDP rung's shard_model and train.py's, each on a GPT and on
    ``Tied``; the names of the modules each made an FSDP unit (the root as "")."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=1)
    from torch.distributed.fsdp import FSDPModule

    import multinode_fsdp

    cpu, units = torch.device("cpu"), {}
    for name, shard in (("rung", lambda m: multinode_fsdp.shard_model(m, cpu)),
                        ("kit", lambda m: train_utils.shard_model(m, cpu, dtype=None))):
        gpt = GPT(GPTConfig(vocab_size=65, block_size=16, n_layer=3, n_head=2, n_embd=32))
        for label, model in (("GPT", gpt), ("Tied", Tied())):
            sharded = shard(model)  # fully_shard changes the class of each unit, the root too
            units[name, label] = [n for n, m in sharded.named_modules() if isinstance(m, FSDPModule)]
    torch.save(units, os.path.join(out_dir, "units.pt"))
    torch.distributed.destroy_process_group()


def test_the_fsdp_rung_and_the_kit_shard_the_same_units(tmp_path):
    """multinode_fsdp.py and train.py shard by the one rule, common.fsdp_units:
    the same units of a GPT (its blocks, then the root) and of a model with a
    tied weight (the tied children stay in the root)."""
    mp.spawn(_sharded_units_worker, args=(free_port(), str(tmp_path)), nprocs=1)
    units = torch.load(tmp_path / "units.pt")
    assert units["rung", "GPT"] == units["kit", "GPT"] == ["", "blocks.0", "blocks.1", "blocks.2"]
    assert units["rung", "Tied"] == units["kit", "Tied"] == ["", "hidden"]


def _step_figures(model, x, y):
    """Loss, gradients and the bytes of tensors autograd saved for backward, of one step."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t,
                                                  lambda t: t):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    return loss.item(), [p.grad for p in model.parameters()], sum(saved)


def test_activation_checkpointing_gives_the_same_losses_and_gradients_and_keeps_less():
    """With dropout (the recomputation must draw the same masks): bitwise the
    same loss and gradients, under a quarter of the saved activations, the
    same state_dict keys (snapshots load either way)."""
    torch.manual_seed(0)
    plain = GPT(GPTConfig(vocab_size=65, block_size=32, n_layer=2, n_head=2, n_embd=32, dropout=0.1))
    recomputed = train_utils.checkpoint_activations(copy.deepcopy(plain))
    x, y = torch.randint(0, 65, (4, 32)), torch.randint(0, 65, (4, 32))
    torch.manual_seed(1)
    loss, grads, kept = _step_figures(plain, x, y)
    torch.manual_seed(1)
    loss_ac, grads_ac, kept_ac = _step_figures(recomputed, x, y)
    assert loss_ac == loss
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_ac))
    assert kept_ac < kept / 4, (kept_ac, kept)
    assert list(recomputed.state_dict()) == list(plain.state_dict())
    with pytest.raises(ConfigError, match="--activation_checkpointing.*has none"):
        train_utils.checkpoint_activations(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_generate_is_seeded_and_top_k_1_is_greedy():
    """The same generator seed draws the same tokens; top_k 1 takes the most likely token each time."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=1, n_embd=16))
    start = torch.zeros(1, 1, dtype=torch.long)
    draws = [model.generate(start, 20, 1.0, None, torch.Generator().manual_seed(3)) for _ in range(2)]
    assert draws[0].shape == (1, 21) and torch.equal(draws[0], draws[1])
    greedy = model.generate(start, 12, 1.0, 1, torch.Generator().manual_seed(4))
    assert model.training  # back in the mode it had
    idx = start
    for _ in range(12):
        idx = torch.cat([idx, model.eval()(idx[:, -8:])[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(greedy, idx)


def test_an_lm_run_reports_tokens_and_writes_text_after_training_and_from_its_snapshot(tmp_path):
    """train.py, 2 processes, FSDP, a tiny GPT with dropout and the task's
    recipe, 6 steps. With activation checkpointing: the JSON record carries
    tokens_per_s = samples_per_s x block_size and flops_per_s = tokens_per_s x
    the model's FLOPs per token; every rank runs the sampling's forwards (FSDP),
    rank 0 prints --sample_chars characters once. Without it, stopped by SIGTERM
    before step 4 and resumed: the same losses (the held-out one; no test line: the
    task has no test split) and text, and
    bitwise the same weights, AdamW state, schedule and RNG states. Rerun on its finished snapshot as HSDP
    with a loader worker, the first prints the same text again, then says nothing to train, its snapshot
    untouched."""
    data = build_shakespeare_root(tmp_path / "data", 12_000)
    gpt = ["--n_layer", "2", "--n_head", "2", "--n_embd", "32", "--block_size", "32", "--dropout", "0.1"]
    flags = ["--dataset", "shakespeare_char", "--data_dir", data, *gpt, "--batch_size", "8", "--max_steps", "6",
             "--warmup_steps", "2", "--strategy", "fsdp", "--sample_chars", "80"]
    cmd = PODS + ["--nproc_per_node=2", REPO / "train.py", *flags]
    ac = cmd + ["--activation_checkpointing", "--metrics_path", "ac.jsonl", "--snapshot_path", "ac"]
    plain = cmd + ["--metrics_path", "plain.jsonl", "--snapshot_path", "plain"]
    held = PODS + ["--nproc_per_node=2", FAULTY_TRAIN, *flags,  # held by DDP_TEST_FAULT
                       "--metrics_path", "plain.jsonl", "--snapshot_path", "plain"]
    outputs = {"ac": check(run(ac, tmp_path)).stdout}
    stopped = signal_when(held, tmp_path, "DDP_TEST_FAULT: wait_signal at step 4", signal.SIGTERM,
                          DDP_TEST_FAULT="step:*:4:wait_signal")
    assert "stopped by SIGTERM" in stopped and "sample |" not in stopped, stopped
    outputs["plain"] = check(run(plain, tmp_path)).stdout
    assert "resuming from snapshot plain/" in outputs["plain"]
    records, texts = {}, {}
    for name, out in outputs.items():
        lines = [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        records[name] = [r for r in lines if "epoch" in r][-1]
        sample = out.split("sample | 80 characters | temperature 0.8 | top_k 200\n")
        assert len(sample) == 2, out
        texts[name] = sample[1][:80]
    record, text = records["ac"], texts["ac"]
    assert [records["plain"][key] for key in ("train_loss", "val_loss")] == [record["train_loss"], record["val_loss"]]
    assert "test | loss" not in outputs["plain"] + outputs["ac"] and texts["plain"] == text  # no test split
    # bitwise: weights, AdamW's moments, the cosine's step, every rank's RNG state
    assert_bitwise(*(full_state(snapshot_folder(tmp_path / name), tmp_path / f"{name}-full")[1] for name in ("ac", "plain")))
    characters = sorted(set(require_tinyshakespeare().read_text(encoding="utf-8")[:12_000]))  # the vocabulary
    assert len(text) == 80 and set(text) <= set(characters)
    assert record["tokens_per_s"] == pytest.approx(record["samples_per_s"] * 32)  # x --block_size
    model = GPT(GPTConfig(vocab_size=len(characters), block_size=32, n_layer=2, n_head=2, n_embd=32))
    flops_per_token = model_flops_per_token(model)
    assert record["flops_per_s"] == pytest.approx(record["tokens_per_s"] * flops_per_token)
    assert "mfu" not in record  # a CPU
    # Finished under FSDP, finished at any strategy and worker count: run again as HSDP with a loader worker.
    saved = {path: path.read_bytes() for path in (tmp_path / "ac").rglob("*") if path.is_file()}
    again = check(run(cmd + ["--snapshot_path", "ac", "--strategy", "hsdp", "--shard_size", "1",
                             "--num_workers", "1"], tmp_path))
    assert f"top_k 200\n{text}" in again.stdout
    assert "samples of --max_steps 6 (steps of global batch 16: 96 samples): nothing to train" in again.stdout
    assert {path: path.read_bytes() for path in (tmp_path / "ac").rglob("*") if path.is_file()} == saved
