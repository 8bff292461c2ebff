"""Rotary position embedding: the inverse frequencies with the checkpoint's scaling (default,
linear, llama3), cos/sin tables computed once per step (every layer's backend rotates q and k by
them in place). Tables are float32 then cast, as in HF transformers."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..config import ModelConfig, RopeConfig


def rope_inv_freq(rope: RopeConfig, dim: int) -> torch.Tensor:
    """Inverse frequencies for ``dim`` rotary dims, with the checkpoint's scaling applied.

    Always on the CPU, even while a model is built on the meta device: arithmetic on meta
    tensors imports ~70 MB of torch's symbolic-shape machinery into the process."""
    inv = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    if rope.type == "linear":
        return inv / rope.factor
    if rope.type == "llama3":
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        old = rope.original_max_position_embeddings
        low_wavelen = old / rope.low_freq_factor
        high_wavelen = old / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, blended, scaled)
    return inv


class Rotary(nn.Module):
    """Computes cos/sin for the step's positions once; every layer applies them."""

    inv_freq: torch.Tensor

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(cfg.rope, cfg.head_dim), persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [T, D] in ``dtype`` (HF computes them in float32, then casts)."""
        freqs = torch.outer(positions.float(), self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        del freqs
        return emb.cos().to(dtype), emb.sin().to(dtype)
