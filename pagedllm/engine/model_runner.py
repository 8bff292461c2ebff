"""ModelRunner: turns a scheduled step into tensors, runs the model, samples. Commits nothing.

Three parts, so a step can be split across processes or devices (``engine.step``):

- ``prepare(out) -> StepInput``: the scheduler's plain rows as the step's tensors, on the
  backend's device (token ids, positions, query starts, context lengths, block tables, the rows
  to sample, the blocks to copy and zero);
- ``execute(step) -> logits``: the part every rank or device runs: the cache maintenance
  (zeroing blocks whose K/V may be non-finite, copy-on-write copies), the attention metadata
  and the forward pass. It reads nothing but ``step`` and its own weights and cache;
- ``sample(logits, out, seqs) -> RunResult``: on the driver, which holds each request's live
  state (seeded generators, grammar matchers) in its ``Sequence``.

A sequence gets a logits row only when this step computes its last known token, i.e. when a
token is to be sampled for it; earlier prompt chunks produce none. The runner never sees the
block manager.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..backends import Backend
from ..layers.attention import StepLayout, block_tables
from ..layers.kv_cache import KVCache
from ..layers.sampler import Sampler, needs_full_path
from ..layers.workspace import GATHER_BUDGET, PAIRS_BUDGET, SAMPLER_CHUNK_ROWS
from ..memory.footprint import StepShape
from ..models import DecoderLM
from .sequence import Sequence
from .step import SchedulerOutput, StepInput


@dataclass
class RunResult:
    sampled: list[int]  # indices into out.rows that got a token
    token_ids: list[int]
    logprobs: list[dict | None]
    failed: list[int]  # indices into out.rows whose logits were not finite (NaN/inf)


class ModelRunner:
    def __init__(
        self,
        model: DecoderLM,
        kv_cache: KVCache,
        sampler: Sampler | None,  # None on a worker rank of a split model: it never samples
        backend: Backend,
        pairs_budget: int = PAIRS_BUDGET,
        gather_budget: int = GATHER_BUDGET,
    ):
        self.model = model
        self.kv_cache = kv_cache
        self.sampler = sampler
        self.backend = backend
        self.pairs_budget = pairs_budget
        self.gather_budget = gather_budget
        cfg = model.config
        self.group_size = cfg.num_heads // cfg.num_kv_heads

    def run(self, out: SchedulerOutput, seqs: list[Sequence]) -> RunResult:
        """prepare -> execute -> sample: one step on this process (and, for a split model, the
        step input sent to every other rank first). ``seqs``: the live sequences of
        ``out.rows``, in order."""
        step = self.prepare(out)
        if self.model.tensor_parallel is not None:
            self.model.tensor_parallel.broadcast(step)
        return self.sample(self.execute(step), out, seqs)

    def prepare(self, out: SchedulerOutput) -> StepInput:
        device = self.backend.device
        input_ids: list[int] = []
        positions: list[int] = []
        starts: list[int] = []
        logits_rows: list[int] = []
        for row in out.rows:
            starts.append(len(input_ids))
            input_ids.extend(row.token_ids)
            positions.extend(range(row.start, row.end))
            if row.samples:
                logits_rows.append(len(input_ids) - 1)
        starts.append(len(input_ids))
        ends = [r.end for r in out.rows]

        def longs(values: list) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        return StepInput(
            input_ids=longs(input_ids),
            positions=longs(positions),
            query_start=torch.tensor(starts, dtype=torch.int32, device=device),
            context_lens=torch.tensor(ends, dtype=torch.int32, device=device),
            block_tables=block_tables([r.block_table for r in out.rows], ends, self.kv_cache.block_size, device),
            logits_rows=longs(logits_rows),
            copies=longs(out.copies).view(-1, 2),
            zeros=longs(out.zeros),
            block_size=self.kv_cache.block_size,
            pairs_budget=self.pairs_budget,
            gather_budget=self.gather_budget,
        )

    def execute(self, step: StepInput) -> torch.Tensor:
        """Float32 logits [R, vocab] of the step's sampled rows (on a worker rank of a split model:
        none). A split model's ranks fail a step together: a rank that runs out of memory still
        takes part in the step's remaining collectives, then every rank raises MemoryError."""
        tp = self.model.tensor_parallel
        if tp is None:
            return self._execute(step)
        tp.new_step()
        try:
            logits, failed = self._execute(step), False
        except (torch.OutOfMemoryError, MemoryError):
            self.model.finish_collectives(step.input_ids.numel(), step.logits_rows.numel())
            logits, failed = None, True
        if tp.any_failed(failed):
            raise MemoryError(
                f"a rank of the split model ran out of memory in a step of {step.input_ids.numel()} tokens"
            )
        assert logits is not None
        return logits

    def _execute(self, step: StepInput) -> torch.Tensor:
        # Before anything computes: a source block may be rewritten by its new owner this step.
        self.kv_cache.zero_blocks(step.zeros.tolist())
        self.kv_cache.copy_blocks(step.copies.tolist())  # [source, destination] pairs
        layout = self.backend.attention_metadata(step, self.group_size)
        return self.model(
            step.input_ids, step.positions, self.backend.attention(self.kv_cache, layout), step.logits_rows
        )

    def sample(self, logits: torch.Tensor, out: SchedulerOutput, seqs: list[Sequence]) -> RunResult:
        """A token for every sampled row whose logits are finite; the others fail alone."""
        rows_of = out.sampling_rows  # row index of each logits row
        # a row is finite iff its max and min are (NaN propagates): no [S, vocab] temporaries
        finite = (torch.isfinite(logits.amax(dim=-1)) & torch.isfinite(logits.amin(dim=-1))).tolist()
        good = [i for i, ok in zip(rows_of, finite) if ok]
        failed = [i for i, ok in zip(rows_of, finite) if not ok]
        if failed:
            logits = logits[[r for r, ok in enumerate(finite) if ok]]
        tokens, logprobs = [], []
        if good:
            assert self.sampler is not None, "only the driver samples"
            sampled = self.sampler(logits, [seqs[i] for i in good])
            tokens, logprobs = sampled.token_ids, sampled.logprobs
        return RunResult(good, tokens, logprobs, failed)

    def step_shape(self, out: SchedulerOutput, seqs: list[Sequence]) -> StepShape:
        """This step as the memory planner sees it (checked against measured peaks in tests)."""
        sampled = [seqs[i] for i in out.sampling_rows]
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
        layout = StepLayout.from_step(self.prepare(out), self.group_size)
        return StepShape(
            tokens=out.total_tokens,
            sampled=len(sampled),
            decode_groups=[(g.blocks.shape[0], g.keys, True) for g in layout.decode_groups],
            prefills=[(p.length, p.context_len) for p in layout.prefills],
            full_sampler_rows=full,
            penalized_lengths=penalized,
        )
