"""ModelRunner: turns a scheduled batch into the model's flat inputs and runs one forward pass.

It owns the model and the KV cache; it knows blocks only through the tables the block manager
keeps. A sequence gets a logits row only when this step computes its last known token, i.e. when
a token is to be sampled for it; earlier prompt chunks produce none.
"""

from __future__ import annotations

import torch

from .attention import DEFAULT_GATHER_BUDGET, DEFAULT_PAIRS_BUDGET, PagedAttention, SequenceSlice, StepLayout
from .block_manager import BlockManager
from .kv_cache import KVCache
from .models import DecoderLM
from .scheduler import ScheduledBatch


class ModelRunner:
    def __init__(self, model: DecoderLM, kv_cache: KVCache, blocks: BlockManager,
                 pairs_budget: int = DEFAULT_PAIRS_BUDGET, gather_budget: int = DEFAULT_GATHER_BUDGET):
        self.pairs_budget = pairs_budget
        self.gather_budget = gather_budget
        self.model = model
        self.kv_cache = kv_cache
        self.blocks = blocks
        self.last_layout: StepLayout | None = None  # kept for step_shape() (memory accounting)

    def run(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[int]]:
        """Returns (logits [S, vocab], indices into batch.seqs of the S sampled sequences)."""
        input_ids: list[int] = []
        positions: list[int] = []
        slices: list[SequenceSlice] = []
        logits_rows: list[int] = []
        sampled: list[int] = []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
            start = seq.num_computed_tokens
            slices.append(SequenceSlice(len(input_ids), n, start + n, self.blocks.table(seq.seq_id)))
            input_ids.extend(seq.tokens(start, start + n))
            positions.extend(range(start, start + n))
            if start + n == seq.num_tokens:
                logits_rows.append(len(input_ids) - 1)
                sampled.append(i)
        cfg = self.model.config
        layout = StepLayout.build(slices, self.kv_cache.block_size, cfg.num_heads // cfg.num_kv_heads,
                                  self.pairs_budget, self.gather_budget)
        self.last_layout = layout
        logits = self.model(
            torch.tensor(input_ids, dtype=torch.long),
            torch.tensor(positions, dtype=torch.long),
            PagedAttention(self.kv_cache, layout),
            torch.tensor(logits_rows, dtype=torch.long),
        )
        return logits, sampled
