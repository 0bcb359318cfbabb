"""Weights in and out: --init_from starts a new run (step 0, optimizer and
schedule fresh) from a Hugging Face GPT-2 folder, a kit snapshot of either
strategy or nanoGPT's ckpt.pt; tools/export_hf.py writes the kit's GPT as a
Hugging Face folder that transformers loads. Nothing is downloaded: the
GPT-2 is a tiny one made and trained here with transformers, on the token
files of the corpus's first 20,000 characters (conftest's tiny_corpus,
whose meta.pkl gives the vocabulary). Every run scores the same held-out
windows at --lr 0, so equal weights give equal validation losses."""

from __future__ import annotations

import pickle
import shutil
import sys

import pytest
import torch
import torch.nn.functional as F

import common
from gpt import GPT, GPTConfig
from helpers import IN_CI, PODS, REPO, check, error_lines, evaluations, one_process, run, task_args, without_package
from train_utils.snapshots.weights import fit_to_model, read_weights



def transformers():
    """The transformers package, imported when a test first needs it (not at
    collection: its import costs every test process a second or two);
    absent, the test is skipped saying why, or failed under CI=true, where
    requirements-test.txt installs it."""
    try:
        import transformers as package
    except ImportError:
        if IN_CI:
            raise
        pytest.skip("transformers is not installed: pip install -r requirements-test.txt")
    return package

BLOCK = 16
# At --lr 0 the weights stay as loaded: one step, then one evaluation over every held-out window (124).
SCORE = ["--dataset", "tokens", "--lr", "0", "--max_steps", "1", "--eval_every_steps", "1", "--eval_windows", "0",
         "--batch_size", "8", "--log_every_steps", "0"]


def held_out_windows(data_dir) -> torch.Tensor:
    """The kit's held-out windows of ``data_dir``'s val.bin, as --dataset tokens
    cuts them (``token_tasks.TokenFileWindows``): int64 (N, 2, BLOCK), each a
    (context, next tokens) pair."""
    args = task_args("tokens", data_dir, n_layer=1, n_head=2, n_embd=32, block_size=BLOCK)
    val = common.load_task(args, download=False).val_set
    return torch.stack([torch.stack(val[i]) for i in range(len(val))])


def hf_loss(model, windows: torch.Tensor) -> float:
    """transformers' ``model``'s mean cross-entropy (nats per token) over ``windows``' next tokens."""
    model.eval()
    with torch.no_grad():
        logits = model(windows[:, 0]).logits
    return F.cross_entropy(logits.flatten(0, 1).double(), windows[:, 1].flatten()).item()


def val_loss(stdout: str) -> float:
    """The one evaluation's validation loss of a ``SCORE`` run."""
    (line,) = evaluations(stdout)
    return float(line["val_loss"])


@pytest.fixture(scope="module")
def gpt2(tiny_corpus, tmp_path_factory):
    """A tiny GPT-2 (transformers' GPT2LMHeadModel: 1 layer, 2 heads, 32 wide,
    16 positions, the corpus's vocabulary) trained here 30 AdamW steps on
    train.bin, saved with ``save_pretrained``; and a run of train.py that
    starts from it (--init_from, ``SCORE``; one process, DDP's snapshot
    file). Returns {"hf": its folder, "windows": ``held_out_windows``,
    "run": the run's folder, "stdout": its stdout}."""
    data = tiny_corpus["tokens"]
    with open(data / "meta.pkl", "rb") as f:
        vocab_size = pickle.load(f)["vocab_size"]
    tokens = torch.from_file(str(data / "train.bin"), size=(data / "train.bin").stat().st_size // 2,
                             dtype=torch.uint16).to(torch.int64)
    torch.manual_seed(0)
    config = transformers().GPT2Config(vocab_size=vocab_size, n_positions=BLOCK, n_embd=32, n_layer=1, n_head=2,
                                     bos_token_id=None, eos_token_id=None)
    model = transformers().GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(30):
        starts = torch.randint(0, len(tokens) - BLOCK - 1, (16,))
        rows = tokens[starts[:, None] + torch.arange(BLOCK + 1)]
        loss = F.cross_entropy(model(rows[:, :-1]).logits.flatten(0, 1), rows[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    root = tmp_path_factory.mktemp("init_from")
    model.save_pretrained(root / "gpt2")
    (root / "run").mkdir()
    result = check(one_process([*SCORE, "--data_dir", data, "--init_from", root / "gpt2"], root / "run"))
    return {"hf": root / "gpt2", "windows": held_out_windows(data), "run": root / "run", "stdout": result.stdout,
            "data": data, "root": root}


def test_a_hugging_face_gpt2_starts_a_run_at_transformers_own_loss(gpt2):
    """A GPT-2 trained with transformers, loaded by --init_from: config.json
    gives the sizes (no size flag passed), the Conv1D weights are transposed
    into the kit's nn.Linear layers, and at --lr 0 the kit's validation loss
    is transformers' own on the same windows, within 0.05 (measured: 1e-5;
    the kit's GELU is the exact one, GPT-2's its tanh approximation)."""
    assert f"weights from --init_from {gpt2['hf']} (Hugging Face GPT-2 folder): step 0, optimizer and schedule " \
           f"fresh" in gpt2["stdout"]
    assert "model GPT, 15,136 parameters" in gpt2["stdout"]  # with GPT-2's biases: the kit's default has none
    reference = hf_loss(transformers().GPT2LMHeadModel.from_pretrained(gpt2["hf"]), gpt2["windows"])
    assert reference < 3.6  # trained: the uniform guess over 58 tokens scores ln 58 = 4.06
    assert abs(val_loss(gpt2["stdout"]) - reference) < 0.05, (val_loss(gpt2["stdout"]), reference)


def test_the_kits_gpt_exported_loads_in_transformers_with_the_same_loss(gpt2, tmp_path):
    """tools/export_hf.py writes the run's DDP snapshot as a Hugging Face
    folder; transformers' from_pretrained loads it and scores the held-out
    windows as the kit did (exact GELU written into its config: within
    1e-4). A second export to the same folder is refused in one line, the
    folder left as it is; so is an export without transformers installed."""
    out = tmp_path / "exported"
    check(run([sys.executable, REPO / "tools" / "export_hf.py", "--snapshot_path", gpt2["run"] / "snapshot_train.pt",
               "--out", out], tmp_path))
    model = transformers().GPT2LMHeadModel.from_pretrained(out)
    assert model.config.activation_function == "gelu" and model.config.n_positions == BLOCK
    assert abs(hf_loss(model, gpt2["windows"]) - val_loss(gpt2["stdout"])) < 1e-4
    written = (out / "model.safetensors").read_bytes()
    again = run([sys.executable, REPO / "tools" / "export_hf.py", "--snapshot_path", gpt2["run"] / "snapshot_train.pt",
                 "--out", out], tmp_path)
    assert again.returncode == 2 and error_lines(again.stderr) == [
        f"error: --out {out} exists and is not an empty folder: export_hf.py writes nothing over what is there; "
        f"pass a new folder"]
    assert (out / "model.safetensors").read_bytes() == written
    missing = run([sys.executable, REPO / "tools" / "export_hf.py", "--snapshot_path",
                   gpt2["run"] / "snapshot_train.pt", "--out", tmp_path / "new"], tmp_path,
                  **without_package(tmp_path, "transformers"))
    assert missing.returncode == 2 and error_lines(missing.stderr) == [
        "error: export_hf.py writes with transformers, which is not installed: pip install transformers (it brings "
        "safetensors)"], missing.stderr
    assert not (tmp_path / "new").exists()


def test_a_ddp_snapshot_starts_an_fsdp_run(gpt2, tmp_path):
    """--init_from the DDP run's snapshot file into a 2-rank FSDP run: the
    full weights are sharded as they load, and the validation loss at --lr 0
    is the DDP run's. The other way, the FSDP run's snapshot folder read
    as --init_from reads it (each shard file, no process group) gives the
    DDP snapshot's weights bitwise."""
    ddp_snapshot = gpt2["run"] / "snapshot_train.pt"
    fsdp = [*SCORE, "--data_dir", gpt2["data"], "--init_from", ddp_snapshot, "--strategy", "fsdp"]
    result = check(run(PODS + ["--nproc_per_node=2", REPO / "train.py", *fsdp], tmp_path, OMP_NUM_THREADS="1"))
    assert f"weights from --init_from {ddp_snapshot} (kit DDP snapshot)" in result.stdout
    assert val_loss(result.stdout) == pytest.approx(val_loss(gpt2["stdout"]), abs=2e-6)
    sharded = read_weights(str(tmp_path / "snapshot_train_fsdp"))
    ddp = torch.load(ddp_snapshot, weights_only=True)["model"]
    assert sharded.kind == "kit FSDP snapshot" and sorted(sharded.state) == sorted(ddp)
    assert all(torch.equal(sharded.state[name], ddp[name]) for name in ddp)
    assert sharded.sizes == {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": BLOCK, "vocab_size": 58,
                             "bias": True}


def test_a_shorter_block_size_crops_the_position_embedding(gpt2):
    """--block_size below the weights' context: the position embedding's
    first rows, as nanoGPT's crop_block_size keeps them, and the start line
    says so; every other weight as stored (GPT-2's Conv1D ones transposed)."""
    weights = read_weights(str(gpt2["hf"]))
    model = GPT(GPTConfig(block_size=8, vocab_size=58, n_layer=1, n_head=2, n_embd=32, bias=True))
    state, note = fit_to_model(weights, {name: t.shape for name, t in model.state_dict().items()})
    assert note == "; position embedding cropped from 16 to --block_size 8"
    stored = transformers().GPT2LMHeadModel.from_pretrained(gpt2["hf"]).state_dict()
    assert torch.equal(state["wpe.weight"], stored["transformer.wpe.weight"][:8])
    assert torch.equal(state["blocks.0.attn.c_attn.weight"], stored["transformer.h.0.attn.c_attn.weight"].t())
    model.load_state_dict(state)  # every name and shape fits


def test_a_requeued_run_resumes_from_its_snapshot_not_from_init_from(gpt2, tmp_path):
    """The run's command again, with its snapshot (a copy) at --snapshot_path,
    as a requeued job finds it, and a longer --max_steps: the snapshot wins,
    one line says --init_from is not read, and the run goes on after step 1."""
    shutil.copy(gpt2["run"] / "snapshot_train.pt", tmp_path / "snapshot_train.pt")
    longer = [*SCORE[:SCORE.index("--max_steps")], "--max_steps", "2", *SCORE[SCORE.index("--max_steps") + 2:]]
    again = check(one_process([*longer, "--data_dir", gpt2["data"], "--init_from", gpt2["hf"]], tmp_path))
    assert (f"--init_from {gpt2['hf']} not read: this run resumes from its snapshot snapshot_train.pt; delete it "
            f"or pass another --snapshot_path to start afresh from --init_from") in again.stdout
    assert "resuming from snapshot snapshot_train.pt in epoch 1 after step 1" in again.stdout
    assert "weights from --init_from" not in again.stdout
    assert [line["step"] for line in evaluations(again.stdout)] == ["2"]


def test_a_nanogpt_checkpoint_starts_a_run(gpt2, tmp_path):
    """nanoGPT's ckpt.pt (its train.py's dict: "model" with a compiled model's
    "_orig_mod." names and nn.Linear's (out, in) weights, "model_args",
    "optimizer", "iter_num"), made here of the GPT-2's weights as nanoGPT's
    ``from_pretrained`` makes them: the run's loss at --lr 0 is the one the
    Hugging Face folder gave."""
    from safetensors.torch import load_file

    conv1d = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
    hf = load_file(gpt2["hf"] / "model.safetensors")
    model = {"_orig_mod." + name: tensor.t() if name.endswith(conv1d) else tensor for name, tensor in hf.items()}
    model["_orig_mod.lm_head.weight"] = hf["transformer.wte.weight"]
    model_args = dict(n_layer=1, n_head=2, n_embd=32, block_size=BLOCK, bias=True,
                      vocab_size=hf["transformer.wte.weight"].shape[0], dropout=0.0)
    torch.save({"model": model, "model_args": model_args, "optimizer": {}, "iter_num": 30, "best_val_loss": 3.0,
                "config": {"dataset": "shakespeare_char"}}, tmp_path / "ckpt.pt")
    result = check(one_process([*SCORE, "--data_dir", gpt2["data"], "--init_from", tmp_path / "ckpt.pt"], tmp_path))
    assert f"weights from --init_from {tmp_path / 'ckpt.pt'} (nanoGPT's ckpt.pt)" in result.stdout
    assert val_loss(result.stdout) == val_loss(gpt2["stdout"])


def test_weights_that_do_not_fit_are_one_line_each_and_nothing_is_written(gpt2, tmp_path):
    """A size flag that differs from the weights' names the parameter and
    both shapes; a corpus of another vocabulary (GPT-2's tokens: no meta.pkl)
    than the weights' says so; each in one line, exit status 2, before any
    snapshot is written."""
    result = one_process([*SCORE, "--data_dir", gpt2["data"], "--init_from", gpt2["hf"], "--n_embd", "64"], tmp_path)
    assert result.returncode == 2 and error_lines(result.stderr) == [
        f"error: --init_from {gpt2['hf']} (Hugging Face GPT-2 folder): wte.weight is 58 x 32 in the weights but "
        f"58 x 64 in this run's model; leave out the size flags (--n_layer, --n_head, --n_embd, --block_size): the "
        f"weights give them"], result.stderr
    bpe = tmp_path / "bpe"
    bpe.mkdir()
    for name in ("train.bin", "val.bin"):
        shutil.copy(gpt2["data"] / name, bpe / name)
    result = one_process([*SCORE, "--data_dir", bpe, "--init_from", gpt2["hf"]], tmp_path)
    assert result.returncode == 2 and error_lines(result.stderr) == [
        f"error: --init_from {gpt2['hf']}: its vocabulary has 58 tokens, the corpus's 50,257 (GPT-2's, as no "
        f"{bpe / 'meta.pkl'} gives another): the same ids would be other tokens; train on token files of the "
        f"weights' tokenizer (and its meta.pkl), or start without --init_from"], result.stderr
    assert not list(tmp_path.glob("snapshot_train*"))
