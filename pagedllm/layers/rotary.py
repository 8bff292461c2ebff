"""Rotary position embedding: the inverse frequencies with the checkpoint's scaling (default,
linear, llama3, YaRN), cos/sin tables computed once per step (every layer's backend rotates q and k by
them in place). Tables are float32 then cast, as in HF transformers."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..config import RopeConfig


def rope_inv_freq(rope: RopeConfig, dim: int, long: bool = False) -> torch.Tensor:
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
    if rope.type == "yarn":
        return _yarn_inv_freq(rope, dim, inv)
    if rope.type == "longrope":  # each pair's wavelength stretched by its own factor
        return inv / torch.tensor(rope.long_factor if long else rope.short_factor, dtype=torch.float32, device="cpu")
    return inv


def _yarn_inv_freq(rope: RopeConfig, dim: int, inv: torch.Tensor) -> torch.Tensor:
    """YaRN: the dimensions that turn fewer than ``beta_slow`` times over the original context
    are interpolated (divided by ``factor``), those that turn more than ``beta_fast`` times are
    kept, and a linear ramp blends the band between (in transformers' arithmetic)."""

    def dimension_turning(turns: float) -> float:
        return (
            dim * math.log(rope.original_max_position_embeddings / (turns * 2 * math.pi)) / (2 * math.log(rope.theta))
        )

    low, high = dimension_turning(rope.beta_fast), dimension_turning(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp
    return inv / rope.factor * (1 - kept) + inv * kept


def rope_attention_factor(rope: RopeConfig) -> float:
    """What cos and sin are multiplied by: YaRN's 0.1 ln(factor) + 1, LongRoPE's
    sqrt(1 + ln(factor) / ln(original context)) with its factor the ratio of the two contexts,
    unless the config says."""
    if rope.type == "longrope":
        if rope.attention_factor is not None:
            return rope.attention_factor
        original = rope.original_max_position_embeddings
        factor = rope.max_position_embeddings / original
        return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    if rope.type != "yarn":
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor
    return 1.0 if rope.factor <= 1 else 0.1 * math.log(rope.factor) + 1.0


class Rotary(nn.Module):
    """Computes cos/sin for the step's positions once; every layer applies them."""

    inv_freq: torch.Tensor

    def __init__(self, rope: RopeConfig, head_dim: int):
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(rope, head_dim), persistent=False)
        self.attention_factor = rope_attention_factor(rope)
        # LongRoPE: the long factors' frequencies, for a sequence longer than the original context
        self.long_inv_freq = rope_inv_freq(rope, head_dim, long=True) if rope.type == "longrope" else None
        self.original_context = rope.original_max_position_embeddings

    def long_rows(self, query_start: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor | None:
        """LongRoPE: which of the step's rows take the long factors: those of a sequence whose
        context is now longer than the original, as transformers and vLLM decide it (by the
        length so far: a sequence's keys cached before it grew keep the short rotation). None
        where no row does."""
        if self.long_inv_freq is None or not bool((context_lens > self.original_context).any()):
            return None
        per_sequence = context_lens > self.original_context
        return per_sequence.repeat_interleave((query_start[1:] - query_start[:-1]).long())

    def tables(
        self, positions: torch.Tensor, dtype: torch.dtype, long_rows: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [T, D] in ``dtype`` (HF computes them in float32, then casts); ``long_rows``
        [T]: LongRoPE's rows that take the long factors."""
        freqs = torch.outer(positions.float(), self.inv_freq)
        if long_rows is not None and self.long_inv_freq is not None:
            long = torch.outer(positions.float(), self.long_inv_freq)
            freqs = torch.where(long_rows[:, None], long, freqs)
        emb = torch.cat((freqs, freqs), dim=-1)
        del freqs
        if self.attention_factor != 1.0:
            return (emb.cos() * self.attention_factor).to(dtype), (emb.sin() * self.attention_factor).to(dtype)
        return emb.cos().to(dtype), emb.sin().to(dtype)
