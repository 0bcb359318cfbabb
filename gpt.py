"""A GPT written for this project: the decoder-only transformer language model of
GPT-2 (Radford et al. 2019, "Language Models are Unsupervised Multitask
Learners"), laid out as nanoGPT lays it out (Karpathy, github.com/karpathy/nanoGPT,
model.py), with nanoGPT's names for its sizes: n_layer, n_head, n_embd,
block_size, dropout.

  tokens (B, T) int64 -> token embedding + learned position embedding (B, T, C)
  -> n_layer pre-LayerNorm ``Block``s: x + attn(ln_1(x)), then x + mlp(ln_2(x))
  -> final LayerNorm -> output layer, its weight the token embedding's (tied)
  -> logits (B, T, vocab_size)

B: sequences in the batch, T: tokens per sequence (<= block_size), C: n_embd.
Imports torch only, so a task module or a rung can use it alone.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: float (B, T, C) -> float (B, T, C).

    One linear layer makes queries, keys and values for all ``n_head`` heads
    (C / n_head wide each); ``F.scaled_dot_product_attention`` with
    ``is_causal=True`` lets position t attend to positions <= t (its fused
    kernels where the device has them); one linear layer projects the heads
    back. ``dropout`` applies to the attention weights and the output while
    training. Raises ValueError when ``n_embd`` is not a multiple of ``n_head``.
    """

    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd {n_embd} is not a multiple of n_head {n_head}")
        self.n_head, self.dropout = n_head, dropout
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.resid_dropout = nn.Dropout(dropout)

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

    def __init__(self, n_embd: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """One transformer block, pre-LayerNorm (GPT-2's order): float (B, T, C) -> (B, T, C),
    ``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``. The unit FSDP shards one by one."""

    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = MLP(n_embd, dropout, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A GPT language model: int64 token ids (B, T) -> float logits (B, T, vocab_size),
    the logits at position t scoring the token at t + 1 given tokens 0..t.

    ``vocab_size`` tokens; ``block_size`` the longest context (positions);
    ``n_layer`` blocks (``self.blocks``, an nn.ModuleList of ``Block``) of
    ``n_head`` heads, ``n_embd`` wide; ``dropout`` after the embeddings, on
    the attention weights and after each residual branch, while training;
    ``bias``: biases in the linear layers and LayerNorms (GPT-2 has them;
    nanoGPT's default, and this project's, is without: a little faster and
    no worse). The output layer's weight is the token embedding's (weight
    tying, Press & Wolf 2017, as GPT-2): one (vocab_size, n_embd) parameter.

    Initialisation as GPT-2 (and nanoGPT): every linear and embedding weight
    N(0, 0.02), biases zero, LayerNorms weight 1 and bias 0, and the
    projections that end a residual branch (``c_proj``) N(0, 0.02 /
    sqrt(2 n_layer)), so the residual stream's variance does not grow with
    depth (Radford et al. 2019, section 2.3). Drawn from the global torch RNG.
    Raises ValueError for a size < 1 or n_embd not a multiple of n_head.
    """

    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int,
                 dropout: float = 0.0, bias: bool = False) -> None:
        super().__init__()
        sizes = dict(vocab_size=vocab_size, block_size=block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd)
        small = [f"{name} {value}" for name, value in sizes.items() if value < 1]
        if small:
            raise ValueError(f"GPT sizes must be >= 1: {', '.join(small)}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.vocab_size, self.block_size = vocab_size, block_size
        self.n_layer, self.n_head, self.n_embd = n_layer, n_head, n_embd
        self.wte = nn.Embedding(vocab_size, n_embd)  # token embedding
        self.wpe = nn.Embedding(block_size, n_embd)  # learned position embedding
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout, bias) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one parameter, two uses
        self.apply(self._init_weights)
        for name, parameter in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(parameter, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

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

    def num_parameters(self, embeddings: bool = True) -> int:
        """Parameters, each counted once (the tied output layer is the token
        embedding); ``embeddings=False`` leaves out the position embedding,
        as nanoGPT reports it (its N for 6N FLOPs per token)."""
        total = sum(p.numel() for p in self.parameters())
        return total if embeddings else total - self.wpe.weight.numel()
