"""The attention seam: how the model's attention layers read and write K/V.

The model hands each layer's new q, k, v for the flat token batch to ``PagedAttention.attend``
and gets the attention output back; it never sees blocks, slots or sequences. Everything about
where K/V live is in ``StepLayout``, built once per step and shared by all layers.

CPU formulation (torch SDPA, no padded prefills):

- decode rows (one new token per sequence) are batched into one SDPA call: their contexts are
  gathered into ``[B, max_ctx]`` and padding keys are masked out;
- each prefill chunk is one SDPA call over its own context; a chunk whose earlier part is already
  cached gets an explicit causal mask with an offset.

A GPU kernel replaces ``PagedAttention.attend`` and keeps the same inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class SequenceSlice:
    """One sequence's share of a step: ``query_len`` new tokens after ``context_len - query_len``
    cached ones, whose K/V live in ``block_table``."""

    query_start: int
    query_len: int
    context_len: int
    block_table: list[int]


@dataclass
class _Prefill:
    start: int
    length: int
    context_len: int
    gather: torch.Tensor  # [context_len] slots


@dataclass
class StepLayout:
    """Where every token of one step reads and writes K/V. Built once, used by every layer."""

    slot_mapping: torch.Tensor  # [T]: slot each new token's K/V is written to
    decode_rows: torch.Tensor | None  # [B]: row in the flat batch of each decode token
    decode_gather: torch.Tensor | None  # [B, max_ctx]: slots of each decode row's context
    decode_context_lens: torch.Tensor | None  # [B]
    prefills: list[_Prefill]
    _masks: dict = field(default_factory=dict)

    @classmethod
    def build(cls, seqs: list[SequenceSlice], block_size: int) -> "StepLayout":
        slot_mapping: list[int] = []
        decode, prefills = [], []
        for s in seqs:
            first = s.context_len - s.query_len
            slots = _slots(s.block_table, block_size, s.context_len)
            slot_mapping.extend(slots[first:])
            if s.query_len == 1:
                decode.append((s.query_start, slots))
            else:
                prefills.append(_Prefill(s.query_start, s.query_len, s.context_len,
                                         torch.tensor(slots, dtype=torch.long)))
        rows = gather = lens = None
        if decode:
            max_ctx = max(len(sl) for _, sl in decode)
            rows = torch.tensor([r for r, _ in decode], dtype=torch.long)
            gather = torch.tensor([sl + [0] * (max_ctx - len(sl)) for _, sl in decode],
                                  dtype=torch.long)
            lens = torch.tensor([len(sl) for _, sl in decode], dtype=torch.long)
        return cls(torch.tensor(slot_mapping, dtype=torch.long), rows, gather, lens, prefills)

    def decode_mask(self, window: int | None) -> torch.Tensor:
        """[B, 1, 1, max_ctx] True where a decode row may attend."""
        key = ("decode", window)
        if key not in self._masks:
            idx = torch.arange(self.decode_gather.shape[1])
            lens = self.decode_context_lens[:, None]
            mask = idx[None, :] < lens
            if window is not None:
                mask &= idx[None, :] > lens - 1 - window
            self._masks[key] = mask[:, None, None, :]
        return self._masks[key]

    def prefill_mask(self, i: int, window: int | None) -> torch.Tensor | None:
        """[q, ctx] causal mask for prefill ``i`` (None when plain ``is_causal`` suffices)."""
        p = self.prefills[i]
        offset = p.context_len - p.length
        if offset == 0 and (window is None or window >= p.context_len):
            return None
        key = (i, window)
        if key not in self._masks:
            q_pos = torch.arange(offset, p.context_len)[:, None]
            k_pos = torch.arange(p.context_len)[None, :]
            mask = k_pos <= q_pos
            if window is not None:
                mask &= k_pos > q_pos - window
            self._masks[key] = mask
        return self._masks[key]


def _slots(block_table: list[int], block_size: int, n: int) -> list[int]:
    return [block_table[p // block_size] * block_size + p % block_size for p in range(n)]


class PagedAttention:
    """Attention over the paged cache for one step: writes the step's K/V, then attends."""

    def __init__(self, kv_cache, layout: StepLayout):
        self.cache = kv_cache
        self.layout = layout

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float, window: int | None = None) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D] for the step's new tokens. Returns [T, H, D]."""
        lay = self.layout
        k_cache, v_cache = self.cache.k[layer], self.cache.v[layer]
        k_cache.index_copy_(0, lay.slot_mapping, k.to(k_cache.dtype))
        v_cache.index_copy_(0, lay.slot_mapping, v.to(v_cache.dtype))
        out = torch.empty_like(q)
        if lay.decode_rows is not None:
            qd = q.index_select(0, lay.decode_rows)[:, :, None, :]  # [B, H, 1, D]
            kd = k_cache[lay.decode_gather].transpose(1, 2).to(q.dtype)  # [B, KVH, L, D]
            vd = v_cache[lay.decode_gather].transpose(1, 2).to(q.dtype)
            o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=lay.decode_mask(window),
                                               scale=scale, enable_gqa=True)
            out.index_copy_(0, lay.decode_rows, o[:, :, 0, :])
        for i, p in enumerate(lay.prefills):
            qp = q[p.start:p.start + p.length].transpose(0, 1)[None]  # [1, H, q, D]
            kp = k_cache[p.gather].transpose(0, 1)[None].to(q.dtype)  # [1, KVH, ctx, D]
            vp = v_cache[p.gather].transpose(0, 1)[None].to(q.dtype)
            mask = lay.prefill_mask(i, window)
            o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, is_causal=mask is None,
                                               scale=scale, enable_gqa=True)
            out[p.start:p.start + p.length] = o[0].transpose(0, 1)
        return out
