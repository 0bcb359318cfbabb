"""Text out: what a language model trained by the kit writes (--sample_chars,
--temperature, --top_k), printed after training and on a rerun of a finished run.
"""

from __future__ import annotations

import argparse
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from common import ConfigError
from .output import print_line

# The sample's first token: a newline, as nanoGPT's sample.py starts, where the vocabulary has one.
SAMPLE_START = "\n"


@torch.no_grad()
def generate(model: torch.nn.Module, idx: torch.Tensor, new_tokens: int, temperature: float,
             top_k: Optional[int], generator: torch.Generator) -> torch.Tensor:
    """Extend the token ids ``idx`` (int64 (B, T) on the model's device) by
    ``new_tokens`` tokens drawn one at a time from ``model``, a causal language
    model: int64 (B, T') -> float logits (B, T', vocab_size), which sees at
    most ``model.block_size`` tokens (the last ones). Each next token is drawn
    from softmax(logits / ``temperature``) over the ``top_k`` most likely
    tokens (None: all), as in Radford et al. 2019's samples and nanoGPT's
    ``generate``. The draw uses ``generator`` (a CPU torch.Generator), so
    every rank that holds the same logits and the same generator state draws
    the same tokens: under FSDP, whose forward is a collective, every rank
    runs this together. The model is put in eval mode (no dropout) and back
    in the mode it had. Returns int64 (B, T + new_tokens) on ``idx``'s device."""
    was_training = model.training
    model.eval()
    try:
        for _ in range(new_tokens):
            logits = model(idx[:, -model.block_size:])[:, -1, :].float() / temperature  # (B, vocab_size)
            if top_k is not None and top_k < logits.size(-1):
                kth = torch.topk(logits, top_k).values[:, -1:]  # (B, 1): the k-th largest
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = F.softmax(logits, dim=-1).cpu()  # drawn on the CPU: one generator for every device
            idx = torch.cat([idx, torch.multinomial(probs, 1, generator=generator).to(idx.device)], dim=1)
    finally:
        model.train(was_training)
    return idx


def sample_text(model: torch.nn.Module, decode: Callable[[list], str], encode: Callable[[str], list],
                args: argparse.Namespace, device: torch.device) -> str:
    """--sample_chars tokens written by ``model`` (see ``generate``), decoded
    by ``decode`` (token ids -> text). The sample starts after a newline
    (``SAMPLE_START``, encoded by ``encode``; token 0 where the vocabulary has
    none) and is drawn from a generator seeded by --seed: the same text on
    every rank, and again for the same weights and flags."""
    try:
        start = encode(SAMPLE_START)
    except (KeyError, ValueError, ConfigError):  # no newline in the vocabulary
        start = [0]
    idx = torch.tensor([start], dtype=torch.long, device=device)
    generator = torch.Generator().manual_seed(args.seed)
    out = generate(model, idx, args.sample_chars, args.temperature, args.top_k, generator)
    return decode(out[0, len(start):].tolist())


def check_sampling(args: argparse.Namespace, task) -> None:
    """Raise ConfigError for --sample_chars on a task that writes no text:
    one without ``decode`` and ``encode`` (a language-model task's vocabulary)."""
    if args.sample_chars and not (callable(task.decode) and callable(task.encode)):
        raise ConfigError(f"--sample_chars: --dataset {args.dataset} writes no text (its task has no "
                          f"vocabulary to decode); use a language-model task with one (--dataset shakespeare_char, "
                          f"or --dataset tokens with a meta.pkl holding itos and stoi), or leave the flag out")


def print_sample(model: torch.nn.Module, task, args: argparse.Namespace, device: torch.device,
                 fsdp: bool) -> None:
    """Print --sample_chars characters ``model`` writes (``sample_text``) after a
    header line ``sample | 500 characters | temperature 0.8 | top_k 200``, from
    rank 0; nothing without --sample_chars. ``fsdp``: collective, every rank
    runs the sampling (each forward all-gathers); else rank 0 alone runs it
    (pass the plain model, not DDP's wrapper)."""
    if not args.sample_chars:
        return
    rank = dist.get_rank()
    if rank != 0 and not fsdp:
        return
    text = sample_text(model, task.decode, task.encode, args, device)
    if fsdp:
        model.reshard()  # the root stays gathered after a forward without backward: free it
    if rank == 0:
        print_line(f"sample | {args.sample_chars} characters | temperature {args.temperature:g} | "
                   f"top_k {args.top_k}\n{text}")
