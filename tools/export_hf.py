"""The kit's GPT as a Hugging Face GPT-2 folder, which transformers loads:

    python tools/export_hf.py --snapshot_path snapshot_train.pt --out gpt2-mine
    # then, in Python: GPT2LMHeadModel.from_pretrained("gpt2-mine")

--snapshot_path: a snapshot of train.py on a GPT task (--dataset tokens or
shakespeare_char), of any strategy: a DDP file, or an FSDP/HSDP snapshot
folder (its newest save), read whole on the CPU, no process group needed;
also nanoGPT's ckpt.pt, or a Hugging Face GPT-2 folder. --out: a folder
that does not exist yet, or an empty one; it gets config.json and
model.safetensors (``save_pretrained``), nothing else (no tokenizer: the
kit has none; for a corpus of GPT-2's tokens, use GPT-2's).

The weights keep their values: the kit's linear layers' (out, in) weights
become GPT-2's Conv1D (in, out) ones, the tied output layer stays tied, and
a GPT trained without biases (the kit's default) gets zero biases, which
add nothing. The config gives GPT-2 the kit's activation, the exact GELU
(activation_function "gelu"; GPT-2's own is its tanh approximation), and
the run's dropout, so that transformers computes the kit's outputs.
The vocabulary is the model's, padding included (50,304 for GPT-2's tokens
padded as nanoGPT pads them). Bad input: one line, exit status 2, nothing
written. Needs transformers (pip install transformers).
"""

from __future__ import annotations

import argparse
import os
import sys

PROJECT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if PROJECT not in sys.path:  # run as a file: the project folder on the path
    sys.path.insert(0, PROJECT)

from common import ConfigError  # noqa: E402 - after the path above
from train_utils.snapshots.weights import HF_PACKAGES, read_weights, to_hf_state  # noqa: E402


def hf_config(sizes: dict, dropout: float):
    """transformers' ``GPT2Config`` of a kit GPT's ``sizes`` (n_layer, n_head,
    n_embd, block_size as n_positions, vocab_size) with the kit's exact GELU
    and ``dropout`` after the embeddings, on the attention weights and after
    each residual branch (GPT-2's three dropout rates); no bos/eos token id
    outside the vocabulary."""
    from transformers import GPT2Config

    # GPT-2's <|endoftext|> (50256) where the vocabulary holds it; a vocabulary of one's own has none.
    special = 50256 if sizes["vocab_size"] > 50256 else None
    return GPT2Config(vocab_size=sizes["vocab_size"], n_positions=sizes["block_size"], n_embd=sizes["n_embd"],
                      n_layer=sizes["n_layer"], n_head=sizes["n_head"], activation_function="gelu",
                      resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, tie_word_embeddings=True,
                      bos_token_id=special, eos_token_id=special)


def export(snapshot_path: str, out: str) -> str:
    """Write the GPT of ``snapshot_path`` (``weights.read_weights``) to ``out`` as
    transformers' ``GPT2LMHeadModel.save_pretrained`` writes it; return the
    line saying so. Raises ConfigError (one line, nothing written) for a
    snapshot that holds no GPT, an ``out`` that holds files, or no
    transformers."""
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ConfigError(f"--out {out} exists and is not an empty folder: export_hf.py writes nothing over "
                          f"what is there; pass a new folder")
    weights = read_weights(snapshot_path)
    if not weights.sizes:
        raise ConfigError(f"--snapshot_path {snapshot_path} holds no GPT's weights (its task is another): "
                          f"export_hf.py writes the kit's GPT (--dataset tokens or shakespeare_char)")
    try:
        from transformers import GPT2LMHeadModel
    except ImportError:
        raise ConfigError(f"export_hf.py writes with transformers, which is not installed: {HF_PACKAGES}") from None

    model = GPT2LMHeadModel(hf_config(weights.sizes, weights.dropout))
    state = to_hf_state({name: tensor.float() for name, tensor in weights.state.items()})
    # strict: every weight of GPT-2 is given, and nothing else; buffers transformers keeps out of
    # its state_dict (the causal mask) are its own.
    model.load_state_dict(state, strict=True)
    model.save_pretrained(out)
    return (f"{weights.kind} {snapshot_path} written as a Hugging Face GPT-2 folder {out} ({weights.sizes['n_layer']} "
            f"layer{'s' if weights.sizes['n_layer'] > 1 else ''}, {weights.sizes['n_embd']} wide, vocabulary {weights.sizes['vocab_size']:,}): "
            f"GPT2LMHeadModel.from_pretrained({out!r}) loads it")


def main(argv: list) -> int:
    """Parse ``argv``, export; 0, or 2 with one ``error:`` line for bad input."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--snapshot_path", required=True, help="train.py's snapshot: a file (DDP) or a folder "
                        "(FSDP, HSDP); also nanoGPT's ckpt.pt")
    parser.add_argument("--out", required=True, help="the Hugging Face folder to write (new, or empty)")
    args = parser.parse_args(argv)
    try:
        line = export(args.snapshot_path, args.out)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
