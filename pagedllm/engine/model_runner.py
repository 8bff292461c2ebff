"""ModelRunner: runs one scheduled batch through the model and the sampler. Commits nothing.

It gets everything from the batch: the tokens to compute, each sequence's block table, and the
cache maintenance to do first (zeroing blocks whose K/V may be non-finite, copy-on-write
copies). It never sees the block manager. A sequence gets a logits row only when this step
computes its last known token, i.e. when a token is to be sampled for it; earlier prompt chunks
produce none.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..layers.attention import PagedAttention, SequenceSlice, StepLayout
from ..layers.kv_cache import KVCache
from ..layers.sampler import Sampler, needs_full_path
from ..layers.workspace import GATHER_BUDGET, PAIRS_BUDGET, SAMPLER_CHUNK_ROWS
from ..memory.footprint import StepShape
from ..models import DecoderLM
from .scheduler import ScheduledBatch


@dataclass
class RunResult:
    sampled: list[int]  # indices into batch.entries that got a token
    token_ids: list[int]
    logprobs: list[dict | None]
    failed: list[int]  # indices into batch.entries whose logits were not finite (NaN/inf)
    layout: StepLayout


class ModelRunner:
    def __init__(
        self,
        model: DecoderLM,
        kv_cache: KVCache,
        sampler: Sampler,
        pairs_budget: int = PAIRS_BUDGET,
        gather_budget: int = GATHER_BUDGET,
    ):
        self.model = model
        self.kv_cache = kv_cache
        self.sampler = sampler
        self.pairs_budget = pairs_budget
        self.gather_budget = gather_budget

    def run(self, batch: ScheduledBatch) -> RunResult:
        # Before anything computes: a source block may be rewritten by its new owner this step.
        self.kv_cache.zero_blocks(batch.zeros)
        self.kv_cache.copy_blocks(batch.copies)
        input_ids: list[int] = []
        positions: list[int] = []
        slices: list[SequenceSlice] = []
        logits_rows: list[int] = []
        rows_of: list[int] = []  # entry index of each logits row
        for i, e in enumerate(batch.entries):
            slices.append(SequenceSlice(len(input_ids), e.num_tokens, e.end, e.block_table))
            input_ids.extend(e.seq.tokens(e.start, e.end))
            positions.extend(range(e.start, e.end))
            if e.samples:
                logits_rows.append(len(input_ids) - 1)
                rows_of.append(i)
        cfg = self.model.config
        layout = StepLayout(
            slices, self.kv_cache.block_size, cfg.num_heads // cfg.num_kv_heads, self.pairs_budget, self.gather_budget
        )
        logits = self.model(
            torch.tensor(input_ids, dtype=torch.long),
            torch.tensor(positions, dtype=torch.long),
            PagedAttention(self.kv_cache, layout),
            torch.tensor(logits_rows, dtype=torch.long),
        )
        # a row is finite iff its max and min are (NaN propagates): no [S, vocab] temporaries
        finite = (torch.isfinite(logits.amax(dim=-1)) & torch.isfinite(logits.amin(dim=-1))).tolist()
        good = [i for i, ok in zip(rows_of, finite) if ok]
        failed = [i for i, ok in zip(rows_of, finite) if not ok]
        if failed:
            logits = logits[[r for r, ok in enumerate(finite) if ok]]
        tokens, logprobs = [], []
        if good:
            sampled = self.sampler(logits, [batch.entries[i].seq for i in good])
            tokens, logprobs = sampled.token_ids, sampled.logprobs
        return RunResult(good, tokens, logprobs, failed, layout)

    @staticmethod
    def step_shape(batch: ScheduledBatch, result: RunResult) -> StepShape:
        """This step as the memory planner sees it (checked against measured peaks in tests)."""
        sampled = [batch.entries[i].seq for i in sorted(result.sampled + result.failed)]
        full, penalized = [], []
        for c0 in range(0, len(sampled), SAMPLER_CHUNK_ROWS):
            chunk = sampled[c0 : c0 + SAMPLER_CHUNK_ROWS]
            if any(needs_full_path(s) for s in chunk):
                full.append(len(chunk))
            penalized += [
                s.num_tokens
                for s in chunk
                if s.params.repetition_penalty != 1 or s.params.presence_penalty or s.params.frequency_penalty
            ]
        layout = result.layout
        return StepShape(
            tokens=batch.total_tokens,
            sampled=len(sampled),
            decode_groups=[(g.blocks.shape[0], g.keys, True) for g in layout.decode_groups],
            prefills=[(p.length, p.context_len) for p in layout.prefills],
            full_sampler_rows=full,
            penalized_lengths=penalized,
        )
