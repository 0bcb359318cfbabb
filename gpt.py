"""A GPT written for this project: the decoder-only transformer language model of
GPT-2 (Radford et al. 2019, "Language Models are Unsupervised Multitask
Learners"), laid out as nanoGPT lays it out (Karpathy, github.com/karpathy/nanoGPT,
model.py), its sizes a ``GPTConfig`` with nanoGPT's names: n_layer, n_head,
n_embd, block_size, vocab_size, dropout, bias.

  tokens (B, T) int64 -> token embedding + learned position embedding (B, T, C)
  -> n_layer pre-LayerNorm ``Block``s: x + attn(ln_1(x)), then x + mlp(ln_2(x))
  -> final LayerNorm -> output layer, its weight the token embedding's (tied)
  -> logits (B, T, vocab_size)

B: sequences in the batch, T: tokens per sequence (<= block_size), C: n_embd.
Imports torch and the task contract's ConfigError only, so a task module or a
rung can use it alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from common import ConfigError


@dataclass(frozen=True)
class GPTConfig:
    """A GPT's sizes: nanoGPT's ``GPTConfig`` (model.py), its fields in its
    order, with its defaults (GPT-2 small's shape, 124M parameters) but for
    ``bias``, False as in nanoGPT's train.py.

    ``block_size``: the longest context, in tokens (positions);
    ``vocab_size``: the tokens of the vocabulary (50304: GPT-2's 50,257
    padded up to a multiple of 64, as nanoGPT pads it); ``n_layer``
    transformer blocks of ``n_head`` heads, each n_embd / n_head wide;
    ``n_embd``: the width C of every position's vector; ``dropout``: the
    probability of dropping, while training, after the embeddings, on the
    attention weights and after each residual branch; ``bias``: biases in the
    linear layers and LayerNorms (GPT-2 has them; nanoGPT's training default,
    and this project's, is without: a little faster and no worse). Its field
    names are train.py's flags (--n_layer --n_head --n_embd --block_size --dropout).

    The one place a GPT's sizes are checked, when it is made: raises
    ConfigError (one line) for a size below 1, n_embd not a multiple of
    n_head, or a dropout outside [0, 1).
    """

    block_size: int = 1024
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = False

    def __post_init__(self) -> None:
        sizes = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size")
        small = [f"{name} {getattr(self, name)}" for name in sizes if getattr(self, name) < 1]
        if small:
            raise ConfigError(f"the GPT's sizes must be 1 or more: {', '.join(small)}; pass larger ones")
        if self.n_embd % self.n_head:
            raise ConfigError(f"n_embd {self.n_embd} is not a multiple of n_head {self.n_head}: each head is "
                              f"n_embd / n_head wide; pass an --n_embd that --n_head divides")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout {self.dropout} is outside [0, 1): it is the probability of dropping "
                              f"a value; pass a --dropout from 0 to below 1")


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: float (B, T, C) -> float (B, T, C).

    One linear layer makes queries, keys and values for all ``n_head`` heads
    (C / n_head wide each); ``F.scaled_dot_product_attention`` with
    ``is_causal=True`` lets position t attend to positions <= t (its fused
    kernels where the device has them); one linear layer projects the heads
    back. ``dropout`` applies to the attention weights and the output while
    training.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.dropout = config.n_head, config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        # (B, T, 3C) -> three (B, n_head, T, C / n_head)
        q, k, v = self.c_attn(x).view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                           is_causal=True)
        y = y.transpose(1, 2).reshape(B, T, C)  # the heads side by side again
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """The block's feed-forward part: float (B, T, C) -> (B, T, 4C) -> GELU -> (B, T, C), then dropout."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """One transformer block, pre-LayerNorm (GPT-2's order): float (B, T, C) -> (B, T, C),
    ``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``. The unit FSDP shards one by one."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A GPT language model: int64 token ids (B, T) -> float logits (B, T, vocab_size),
    the logits at position t scoring the token at t + 1 given tokens 0..t.

    Its sizes are ``config`` (``GPTConfig``, checked there): ``vocab_size``
    tokens, ``block_size`` the longest context, ``n_layer`` blocks
    (``self.blocks``, an nn.ModuleList of ``Block``: the task contract's
    name for a transformer's blocks, which FSDP shards one by one,
    ``common.fsdp_units``) of ``n_head`` heads, ``n_embd`` wide. The output
    layer's weight is the token embedding's (weight tying, Press & Wolf 2017,
    as GPT-2): one (vocab_size, n_embd) parameter.

    Initialisation as GPT-2 (and nanoGPT): every linear and embedding weight
    N(0, 0.02), biases zero, LayerNorms weight 1 and bias 0, and the
    projections that end a residual branch (``c_proj``) N(0, 0.02 /
    sqrt(2 n_layer)), so the residual stream's variance does not grow with
    depth (Radford et al. 2019, section 2.3). Drawn from the global torch RNG.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)  # token embedding
        self.wpe = nn.Embedding(config.block_size, config.n_embd)  # learned position embedding
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one parameter, two uses
        self.apply(self._init_weights)
        for name, parameter in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(parameter, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @property
    def block_size(self) -> int:
        """The longest context it reads, in tokens (``config.block_size``): a
        sampler crops its context to it (``generate``)."""
        return self.config.block_size

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """int64 (B, T) token ids, T <= block_size -> float (B, T, vocab_size) logits.
        Raises ValueError for a longer T."""
        T = idx.shape[1]
        if T > self.block_size:
            raise ValueError(f"a sequence of {T} tokens is longer than block_size {self.block_size}")
        positions = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(positions))  # (B, T, C) + (T, C)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, new_tokens: int, temperature: float, top_k: Optional[int],
                 generator: torch.Generator) -> torch.Tensor:
        """Extend the token ids ``idx`` (int64 (B, T) on the model's device) by
        ``new_tokens`` tokens drawn one at a time, each seeing at most
        ``block_size`` tokens (the last ones), from softmax(logits /
        ``temperature``) over the ``top_k`` likeliest tokens (None: all), as
        in Radford et al. 2019's samples and nanoGPT's ``generate``. The draw
        uses ``generator`` (a CPU torch.Generator), so every rank that holds
        the same logits and the same generator state draws the same tokens:
        under FSDP, whose forward is a collective, every rank runs this
        together. Runs in eval mode (no dropout), then puts back the mode the
        model had. Returns int64 (B, T + new_tokens) on ``idx``'s device."""
        was_training = self.training
        self.eval()
        try:
            for _ in range(new_tokens):
                logits = self(idx[:, -self.block_size:])[:, -1, :].float() / temperature  # (B, vocab_size)
                if top_k is not None and top_k < logits.size(-1):
                    kth = torch.topk(logits, top_k).values[:, -1:]  # (B, 1): the k-th largest
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = F.softmax(logits, dim=-1).cpu()  # drawn on the CPU: one generator for every device
                idx = torch.cat([idx, torch.multinomial(probs, 1, generator=generator).to(idx.device)], dim=1)
        finally:
            self.train(was_training)
        return idx

    def num_parameters(self, embeddings: bool = True) -> int:
        """Parameters, each counted once (the tied output layer is the token
        embedding); ``embeddings=False`` leaves out the position embedding,
        as nanoGPT's ``get_num_params`` reports it (its N for 6N FLOPs per
        token). The full count also when FSDP shards the parameters (a
        DTensor's ``numel`` is the whole tensor's)."""
        total = sum(p.numel() for p in self.parameters())
        return total if embeddings else total - self.wpe.weight.numel()

    def flops_per_token(self) -> int:
        """Training FLOPs per token, forward and backward, at the full context:
        6 N + 12 L H Q T, the formula of nanoGPT's ``estimate_mfu`` (model.py),
        which takes it from PaLM (Chowdhery et al. 2022, appendix B).

        N: ``num_parameters(embeddings=False)``, the parameters a token's matrix
        products use (the position embedding left out, the token embedding
        counted once, as the output layer tied to it); 6 N: a multiply-add (2
        FLOPs) per parameter and token in the forward pass, twice that in the
        backward pass (Kaplan et al. 2020, "Scaling Laws for Neural Language
        Models", section 2.1). 12 L H Q T: the attention scores and their
        weighted sum, which no parameter counts, with L = n_layer, H = n_head,
        Q = n_embd / n_head, T = block_size. Activation recomputation
        (--activation_checkpointing) is not counted: these are the model's
        FLOPs, not the machine's. train_utils.throughput makes FLOP/s and MFU of it."""
        config = self.config
        L, H, Q, T = config.n_layer, config.n_head, config.n_embd // config.n_head, config.block_size
        return 6 * self.num_parameters(embeddings=False) + 12 * L * H * Q * T
