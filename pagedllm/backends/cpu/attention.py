"""The attention seam: how the model's attention layers read and write K/V.

The model hands each layer's new q, k, v for the flat token batch to its step's ``attend``
and gets the attention output back; it never sees blocks, slots or sequences. Where K/V live is
in ``StepLayout``, built once per step from the step's input and shared by all layers. The
backend picks the implementation (``Backend.attention``); a GPU kernel is one more class with
the same ``attend``.

Two CPU implementations, the same arithmetic (HF eager's order: scale after the dot product, float32
softmax, probabilities in the activation dtype before @ V):

- ``CompiledPagedAttention`` (``cpu-compiled``, the default where a C++ compiler is present):
  one op per layer writes the step's K/V into the cache and reads every context in place
  through the block table; work is split over sequences x KV heads x tiles of at most 32 query rows scoring at
  most ``pairs_budget`` pairs, dealt to threads by cost. Its scratch is per thread and bounded by
  the budget, or by one context's scores for a single decode row.
- ``TorchPagedAttention`` (``cpu-torch``): matmul / softmax / matmul over a gathered copy of
  each context. Decode rows are grouped so that a group gathers at most ``gather_budget`` key
  slots (rows x longest context, in whole blocks; padding keys are masked); a prefill chunk's
  queries are cut into tiles of at most ``pairs_budget // (group_size * ctx)`` rows, each with
  its causal mask built on the fly.

``pagedllm.memory.footprint`` accounts for either path's workspace term by term.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...sizes import ceil_div
from ..base import pool_tables
from .workspace import GATHER_BUDGET, PAIRS_BUDGET


@dataclass
class SequenceSlice:
    """One sequence's share of a step: ``query_len`` new tokens after ``context_len - query_len``
    cached ones, whose K/V live in ``block_table``."""

    query_start: int
    query_len: int
    context_len: int
    block_table: list[int] | tuple[list[int], ...]  # one table, or one per pool (``BlockPools.tables_of``)


@dataclass
class DecodeGroup:
    rows: torch.Tensor  # [B] rows of the flat batch
    blocks: torch.Tensor  # [B, n] block ids of each row's keys (padding repeats its first block)
    context_lens: torch.Tensor  # [B]
    masked: torch.Tensor  # [B, n * block_size] True where a key is padding
    # [B] the position of each row's first gathered key: past 0 where a window leaves the blocks
    # before it unread (``StepLayout.torch_path``)
    offsets: torch.Tensor | None = None
    _windowed: dict = field(default_factory=dict)

    @property
    def keys(self) -> int:
        return self.masked.shape[1]

    def mask(self, window: int | None) -> torch.Tensor:
        """[B, keys] True where a row may not look (padding, or outside the sliding window)."""
        if window is None or (window >= self.keys and self.offsets is None):
            return self.masked
        if window not in self._windowed:
            pos = torch.arange(self.keys, device=self.masked.device)[None, :]
            if self.offsets is not None:
                pos = pos + self.offsets[:, None]
            self._windowed[window] = self.masked | (pos <= self.context_lens[:, None] - 1 - window)
        return self._windowed[window]


@dataclass
class PrefillChunk:
    start: int  # first row in the flat batch
    length: int  # query rows
    context_len: int  # keys, including the rows themselves
    blocks: torch.Tensor  # block ids from the ``first_block``-th to the context's last
    first_block: int = 0  # past 0 where a window leaves the blocks before it unread


class StepLayout:
    """Where every token of one step reads and writes K/V. Built once, used by every layer.

    The compiled kernel reads three small tables: ``query_start`` [S+1] (each sequence's first
    row in the flat batch), ``context_lens`` [S] and a layer's pool's ``block_tables`` [S, max
    blocks], all int32 (the step's input carries them as they are, one table per pool:
    ``engine.step.StepInput``; a layer reads its pool's, ``KVCache.layer_pool``). The PyTorch path
    gathers contexts whole blocks at a time (one copy of block_size x head_dim values per index,
    not one per token); keys past a context's end are masked, and the cache is
    zero-initialised, so what they hold is always finite. Its structures (``slot_mapping``,
    ``decode_groups``, ``prefills``) are built on first use only.
    """

    def __init__(
        self,
        query_start: torch.Tensor,
        context_lens: torch.Tensor,
        block_tables: torch.Tensor,
        block_size: int,
        group_size: int,
        pairs_budget: int = PAIRS_BUDGET,
        gather_budget: int = GATHER_BUDGET,
        state_slots: torch.Tensor | None = None,
        checkpoints: torch.Tensor | None = None,
    ):
        self.query_start = query_start
        # [S] each sequence's state slot (the state-keeping layers', ``KVCache.states``); empty: none
        self.state_slots = state_slots if state_slots is not None else torch.zeros(0, dtype=torch.long)
        # [C, 3] (sequence, tokens of it computed, checkpoint slot): states copied out during the step
        self.checkpoints = checkpoints if checkpoints is not None else torch.zeros(0, 3, dtype=torch.long)
        self.context_lens = context_lens
        # one [S, max blocks] table per pool; given [S, max blocks], one pool
        self.pool_tables = list(block_tables) if block_tables.dim() == 3 else [block_tables]
        self.block_tables = self.pool_tables[0]
        self.block_size = block_size
        self.group_size = group_size  # query heads per KV head
        self.pairs_budget = pairs_budget
        self.gather_budget = gather_budget
        self._slots: dict[int, torch.Tensor] = {}  # the PyTorch path's, built on first use
        self._paths: dict[int, tuple[list[DecodeGroup], list[PrefillChunk]]] = {}
        # what the layers derive from the layout once per step, by name (``layers.recurrence``'s runs)
        self.derived: dict[str, object] = {}

    @classmethod
    def from_step(cls, step, group_size: int, **budgets) -> StepLayout:
        """The layout of a ``StepInput``; ``budgets``: the backend's ``pairs_budget`` and
        ``gather_budget`` (the same on every rank and every replay of a step)."""
        return cls(
            step.query_start,
            step.context_lens,
            step.block_tables,
            step.block_size,
            group_size,
            state_slots=step.state_slots,
            checkpoints=step.checkpoints,
            **budgets,
        )

    @classmethod
    def from_slices(cls, seqs: list[SequenceSlice], block_size: int, group_size: int, **budgets) -> StepLayout:
        """The layout of sequences given one by one (the tests' and benchmarks' way in)."""
        per_pool = [s.block_table if isinstance(s.block_table, tuple) else (s.block_table,) for s in seqs]
        tables = pool_tables(per_pool, [s.context_len for s in seqs], block_size)
        starts = [s.query_start for s in seqs] + [seqs[-1].query_start + seqs[-1].query_len if seqs else 0]
        return cls(
            torch.tensor(starts, dtype=torch.int32),
            torch.tensor([s.context_len for s in seqs], dtype=torch.int32),
            tables,
            block_size,
            group_size,
            **budgets,
        )

    def tables(self, pool: int) -> torch.Tensor:
        """[S, max blocks]: the pool's table (the one table when the step has one)."""
        return self.pool_tables[pool if len(self.pool_tables) > 1 else 0]

    def slot_mapping(self, pool: int = 0) -> torch.Tensor:
        """[T] the cache slot of every token of the step, in the pool's blocks."""
        pool = pool if len(self.pool_tables) > 1 else 0
        if pool not in self._slots:
            bs = self.block_size
            starts, lens, tables = self.query_start.tolist(), self.context_lens.tolist(), self.tables(pool).tolist()
            slots: list[int] = []
            for i, context_len in enumerate(lens):
                table = tables[i]
                for p in range(context_len - (starts[i + 1] - starts[i]), context_len):
                    slots.append(table[p // bs] * bs + p % bs)
            self._slots[pool] = torch.tensor(slots, dtype=torch.long, device=self.query_start.device)
        return self._slots[pool]

    def torch_path(self, pool: int = 0, window: int | None = None) -> tuple[list[DecodeGroup], list[PrefillChunk]]:
        """The PyTorch path's decode groups and prefill chunks over the pool's blocks; with the
        pool's ``window``, each context from the first block its queries can see (a window pool's
        blocks before it went back to the pool)."""
        pool = pool if len(self.pool_tables) > 1 else 0
        if pool not in self._paths:
            bs = self.block_size
            decodes, prefills = [], []
            starts, lens, tables = self.query_start.tolist(), self.context_lens.tolist(), self.tables(pool).tolist()
            device = self.query_start.device
            for i, context_len in enumerate(lens):
                start, query_len = starts[i], starts[i + 1] - starts[i]
                first = 0 if window is None else max(0, context_len - query_len - window + 1) // bs
                table = tables[i][first : ceil_div(context_len, bs)]
                if query_len == 1:
                    decodes.append((start, table, context_len, first))
                else:
                    blocks = torch.tensor(table, dtype=torch.long, device=device)
                    prefills.append(PrefillChunk(start, query_len, context_len, blocks, first))
            packed = _pack_decodes(decodes, self.gather_budget, bs)
            self._paths[pool] = ([_decode_group(g, bs, device) for g in packed], prefills)
        return self._paths[pool]

    @property
    def decode_groups(self) -> list[DecodeGroup]:
        return self.torch_path()[0]

    @property
    def prefills(self) -> list[PrefillChunk]:
        return self.torch_path()[1]

    def query_tile(self, context_len: int) -> int:
        """Rows of a prefill chunk scored at once against ``context_len`` keys."""
        return max(1, self.pairs_budget // (self.group_size * context_len))


def block_tables(tables: list[list[int]], context_lens: list[int], block_size: int, device=None) -> torch.Tensor:
    """[S, widest] int32: each sequence's blocks for its context, padded with block 0."""
    return pool_tables([(t,) for t in tables], context_lens, block_size, device)[0]


def _pack_decodes(decodes, max_keys: int, block_size: int):
    """Groups decode rows (sorted by gathered keys) so that rows x most gathered keys <= max_keys."""
    decodes = sorted(decodes, key=lambda d: len(d[1]))
    group: list = []
    for d in decodes:
        if group and (len(group) + 1) * len(d[1]) * block_size > max_keys:
            yield group
            group = []
        group.append(d)
    if group:
        yield group


def _decode_group(group, block_size: int, device) -> DecodeGroup:
    longest = len(group[-1][1])
    rows = torch.tensor([r for r, _, _, _ in group], dtype=torch.long, device=device)
    blocks = torch.tensor([t + [t[0]] * (longest - len(t)) for _, t, _, _ in group], dtype=torch.long, device=device)
    lens = torch.tensor([n for _, _, n, _ in group], dtype=torch.long, device=device)
    firsts = [f * block_size for _, _, _, f in group]
    offsets = torch.tensor(firsts, dtype=torch.long, device=device) if any(firsts) else None
    pos = torch.arange(longest * block_size, device=device)[None, :]
    masked = (pos if offsets is None else pos + offsets[:, None]) >= lens[:, None]
    return DecodeGroup(rows, blocks, lens, masked, offsets)


class CompiledPagedAttention:
    """The compiled kernel: one op per layer writes the step's K/V into the cache and reads
    every context in place through the block table."""

    def __init__(self, ops, kv_cache, layout: StepLayout):
        self.ops = ops
        self.cache = kv_cache
        self.layout = layout

    def sequence_states(self, layer: int) -> dict[str, torch.Tensor]:
        return self.cache.states[layer]

    def state_checkpoints(self, layer: int) -> dict[str, torch.Tensor]:
        return self.cache.checkpoints[layer]

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D] for the step's new tokens (each token's heads
        contiguous; views of one qkv row are fine). Returns [T, H, D]."""
        lay, cache = self.layout, self.cache
        eight_bit = cache.quantized
        step_dtype = q.dtype
        if not eight_bit and cache.dtype != step_dtype:  # e.g. fp32 weights, a bf16 cache: the
            q, k, v = (t.to(cache.dtype) for t in (q, k, v))  # kernel computes in the cache's dtype
        out = self.ops.paged_attention(
            q,
            k,
            v,
            cache.k[layer],  # [KVH, slots, D]
            cache.v[layer],
            lay.query_start,
            lay.context_lens,
            lay.tables(cache.layer_pool[layer]),
            lay.block_size,
            scale,
            window or 0,
            lay.pairs_budget,
            cache.k_scale[layer] if eight_bit else None,
            cache.v_scale[layer] if eight_bit else None,
            sinks,
        )
        return out.to(step_dtype)


class TorchPagedAttention:
    """matmul / softmax / matmul over a gathered copy of each context (see the module docstring)."""

    def __init__(self, kv_cache, layout: StepLayout):
        self.cache = kv_cache
        self.layout = layout

    def sequence_states(self, layer: int) -> dict[str, torch.Tensor]:
        return self.cache.states[layer]

    def state_checkpoints(self, layer: int) -> dict[str, torch.Tensor]:
        return self.cache.checkpoints[layer]

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """As ``CompiledPagedAttention.attend``."""
        pool = self.cache.layer_pool[layer]
        self.cache.write(layer, self.layout.slot_mapping(pool), k, v)
        out = torch.empty_like(q)
        decode_groups, prefills = self.layout.torch_path(pool, window)
        for g in decode_groups:
            self._decode(layer, g, q, out, scale, window, sinks)
        for p in prefills:
            self._prefill(layer, p, q, out, scale, window, sinks)
        return out

    def _decode(self, layer: int, g: DecodeGroup, q, out, scale: float, window: int | None, sinks) -> None:
        """Rows of one token each, grouped so a group gathers at most ``gather_budget`` keys."""
        kv_heads, d = self.cache.k[layer].shape[0], q.shape[2]
        group = q.shape[1] // kv_heads
        b = g.blocks.shape[0]
        keys, values = self.cache.gather(layer, g.blocks, q.dtype)
        keys = keys.view(kv_heads, b, g.keys, d)  # [KVH, B, L, D]
        values = values.view(kv_heads, b, g.keys, d)
        queries = q.index_select(0, g.rows)  # [B, H, D]
        mask = g.mask(window)
        for h in range(kv_heads):
            heads = slice(h * group, (h + 1) * group)
            scores = torch.bmm(queries[:, heads], keys[h].transpose(1, 2))  # [B, G, L]
            probs = _softmax(scores, scale, mask[:, None, :], None if sinks is None else sinks[heads])
            del scores
            out[g.rows, heads] = torch.bmm(probs, values[h])
            del probs

    def _prefill(self, layer: int, p: PrefillChunk, q, out, scale: float, window: int | None, sinks) -> None:
        """A prompt chunk, its queries in tiles of at most ``pairs_budget`` scored pairs."""
        lay = self.layout
        kv_heads, d = self.cache.k[layer].shape[0], q.shape[2]
        group = q.shape[1] // kv_heads
        n = p.blocks.shape[0] * lay.block_size
        offset = p.first_block * lay.block_size  # the position of the first key gathered
        keys, values = self.cache.gather(layer, p.blocks, q.dtype)
        keys = keys.view(kv_heads, n, d)[:, : p.context_len - offset]  # [KVH, keys, D]
        values = values.view(kv_heads, n, d)[:, : p.context_len - offset]
        tile = lay.query_tile(p.context_len - offset)
        first_pos = p.context_len - p.length
        for t0 in range(0, p.length, tile):
            t1 = min(t0 + tile, p.length)
            mask = _causal_mask(first_pos + t0, first_pos + t1, p.context_len, window, q.device, offset)
            rows = slice(p.start + t0, p.start + t1)
            for h in range(kv_heads):
                heads = slice(h * group, (h + 1) * group)
                queries = q[rows, heads].reshape(-1, d)  # [tile*G, D]
                scores = torch.mm(queries, keys[h].t()).view(t1 - t0, group, -1)
                del queries
                probs = _softmax(scores, scale, mask[:, None, :], None if sinks is None else sinks[heads])
                del scores
                out[rows, heads] = torch.mm(probs.view(-1, probs.shape[-1]), values[h]).view(t1 - t0, group, -1)
                del probs
            del mask


def _softmax(
    scores: torch.Tensor, scale: float, masked: torch.Tensor | None, sinks: torch.Tensor | None = None
) -> torch.Tensor:
    """HF eager's order: scale, mask, softmax in float32, back to the activation dtype. ``sinks``
    [G]: each head's sink logit joins its rows' softmax as one more column, then is dropped."""
    scores.mul_(scale)
    if masked is not None:
        scores.masked_fill_(masked, float("-inf"))
    if sinks is None:
        return torch.softmax(scores, dim=-1, dtype=torch.float32).to(scores.dtype)
    # the softmax over [scores, sink] written out, in the float32 copy softmax would make (in
    # place on scores when they are float32 already): no [rows, keys + 1] concatenation beside it
    sink = sinks.to(scores.dtype).float().view(1, -1, 1)
    probs = scores.float()
    top = torch.maximum(probs.amax(dim=-1, keepdim=True), sink)
    probs.sub_(top).exp_()
    probs.div_(probs.sum(dim=-1, keepdim=True).add_((sink - top).exp_()))
    return probs.to(scores.dtype)


def _causal_mask(first: int, end: int, context_len: int, window: int | None, device, offset: int = 0) -> torch.Tensor:
    """[end - first, context_len - offset] True where query position p may not see key position
    j (keys from position ``offset`` on)."""
    q_pos = torch.arange(first, end, device=device)[:, None]
    k_pos = torch.arange(offset, context_len, device=device)[None, :]
    masked = k_pos > q_pos
    if window is not None:
        masked |= k_pos <= q_pos - window
    return masked
