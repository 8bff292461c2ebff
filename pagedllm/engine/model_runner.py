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

from dataclasses import dataclass, field

import torch

from ..backends.base import Backend, KVCache, pool_tables
from ..layers.sampler import Sampler, argmax_rows, needs_full_path
from ..memory.footprint import StepShape
from ..models import DecoderLM
from ..sizes import SAMPLER_CHUNK_ROWS
from .sequence import Sequence
from .step import ScheduledRow, SchedulerOutput, StepInput


@dataclass
class RunResult:
    sampled: list[int]  # indices into out.rows that got a token
    token_ids: list[int]  # the token sampled for each (after its accepted guesses, if any)
    logprobs: list[dict | None]
    failed: list[int]  # indices into out.rows whose logits were not finite (NaN/inf)
    # row index -> the logprobs of its guesses that were accepted (one per guess, in order)
    accepted: dict[int, list[dict | None]] = field(default_factory=dict)
    # row index -> the prompt logprobs its prompt logits gave (one per position, in order)
    prompt_logprobs: dict[int, list[dict | None]] = field(default_factory=dict)
    # row index -> the sum of its pooled hidden states (an embedding request's)
    pooled: dict[int, torch.Tensor] = field(default_factory=dict)


class AfterGuesses:
    """A sequence as the sampler sees it with ``accepted`` guesses already appended."""

    def __init__(self, seq: Sequence, accepted: list[int]):
        self.params = seq.params
        self.prompt_token_ids = seq.prompt_token_ids
        self.output_token_ids = seq.output_token_ids + accepted
        self.generator = seq.generator
        self.matcher = None  # a grammar's masks are on every position already (``verify``)


class ModelRunner:
    def __init__(
        self,
        model: DecoderLM,
        kv_cache: KVCache,
        sampler: Sampler | None,  # None on a worker rank of a split model: it never samples
        backend: Backend,
    ):
        self.model = model
        self.kv_cache = kv_cache
        self.sampler = sampler
        self.backend = backend
        backend.hold_weights(model)
        cfg = model.config
        self.group_size = cfg.num_heads // cfg.num_kv_heads
        # [P, hidden] float32: the sums of the pooled hidden states of the step ``execute`` ran
        # last, one per row that pools, in row order (what ``sample`` hands to the scheduler)
        self.pooled: torch.Tensor | None = None

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
        plain_rows: list[int] = []  # rows of one logits row first, so the sampler reads them in place
        multi_rows: list[int] = []  # then rows with guesses or prompt logits (several each)
        pool_ranges: list[tuple[int, int]] = []
        for row in out.rows:
            starts.append(len(input_ids))
            input_ids.extend(row.token_ids)
            positions.extend(range(row.start, row.end))
            end = len(input_ids)
            (multi_rows if _several(row) else plain_rows).extend(range(end - row.logits_rows, end))
            if row.pooled:
                pool_ranges.append((end - row.pooled, end))
        logits_rows = plain_rows + multi_rows
        starts.append(len(input_ids))
        ends = [r.end for r in out.rows]

        def longs(values: list) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        return StepInput(
            input_ids=longs(input_ids),
            positions=longs(positions),
            query_start=torch.tensor(starts, dtype=torch.int32, device=device),
            context_lens=torch.tensor(ends, dtype=torch.int32, device=device),
            block_tables=pool_tables([r.block_tables for r in out.rows], ends, self.kv_cache.block_size, device),
            logits_rows=longs(logits_rows),
            copies=longs(out.copies).view(-1, 3),
            zeros=longs(out.zeros).view(-1, 2),
            block_size=self.kv_cache.block_size,
            pool_ranges=longs(pool_ranges).view(-1, 2),
            # (none for a model without states: its step holds no more than before)
            state_slots=longs([r.state_slot for r in out.rows] if any(r.state_slot >= 0 for r in out.rows) else []),
            state_copies=longs(out.state_copies).view(-1, 2),
            state_restores=longs(out.state_restores).view(-1, 2),
            checkpoints=longs([(i, at, slot) for i, r in enumerate(out.rows) for at, slot in r.checkpoints]).view(
                -1, 3
            ),
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
        self.kv_cache.copy_blocks(step.copies.tolist())  # (pool, source, destination)
        self.kv_cache.copy_states(step.state_copies.tolist())  # (source, destination) slots
        self.kv_cache.restore_states(step.state_restores.tolist())  # (checkpoint, state) slots
        layout = self.backend.attention_metadata(step, self.group_size)
        attention = self.backend.attention(self.kv_cache, layout)
        if not step.pool_ranges.numel():
            return self.model(step.input_ids, step.positions, attention, step.logits_rows)
        x = self.model.hidden_states(step.input_ids, step.positions, attention)
        self.pooled = torch.stack([x[a:b].float().sum(dim=0) for a, b in step.pool_ranges.tolist()])
        return self.model.logits(x, step.logits_rows)

    def sample(self, logits: torch.Tensor, out: SchedulerOutput, seqs: list[Sequence]) -> RunResult:
        """A token for every sampled row whose logits are finite; the others fail alone. A row
        with speculative guesses has one logits row per position: its guesses are checked in
        order (``verify``)."""
        # a row is finite iff its max and min are (NaN propagates): no [S, vocab] temporaries
        finite = (torch.isfinite(logits.amax(dim=-1)) & torch.isfinite(logits.amin(dim=-1))).tolist()
        with_logits = out.rows_with_logits  # plain rows first, then the others (``prepare``)
        order = [i for i in with_logits if not _several(out.rows[i])] + [
            i for i in with_logits if _several(out.rows[i])
        ]
        plain: list[tuple[int, int]] = []  # (row, its logits row)
        guessed: list[tuple[int, int]] = []
        failed: list[int] = []
        prompt: dict[int, list[dict | None]] = {}
        offset = 0
        for i in order:
            row = out.rows[i]
            if not all(finite[offset : offset + row.logits_rows]):
                failed.append(i)
            elif row.guesses:
                guessed.append((i, offset))
            else:
                if row.prompt_logits:
                    prompt[i] = prompt_logprobs(logits[offset : offset + row.prompt_logits], row, seqs[i])
                if row.samples:
                    plain.append((i, offset + row.prompt_logits))
            offset += row.logits_rows
        tokens: dict[int, tuple[int, dict | None]] = {}
        if plain:
            assert self.sampler is not None, "only the driver samples"
            # in place when every plain row is there (the common case); else a copy of those kept
            kept = [r for _, r in plain]
            rows = logits[: len(kept)] if kept == list(range(len(kept))) else logits[kept]
            sampled = self.sampler(rows, [seqs[i] for i, _ in plain])
            tokens.update(zip([i for i, _ in plain], zip(sampled.token_ids, sampled.logprobs)))
        accepted: dict[int, list[dict | None]] = {}
        for i, first in guessed:
            row = out.rows[i]
            accepted[i], tokens[i] = self.verify(logits[first : first + 1 + row.guesses], row, seqs[i])
        pooling = [i for i, r in enumerate(out.rows) if r.pooled]
        pooled = dict(zip(pooling, self.pooled)) if pooling and self.pooled is not None else {}
        good = sorted(tokens)
        failed.sort()
        return RunResult(
            good, [tokens[i][0] for i in good], [tokens[i][1] for i in good], failed, accepted, prompt, pooled
        )

    def verify(
        self, logits: torch.Tensor, row: ScheduledRow, seq: Sequence
    ) -> tuple[list[dict | None], tuple[int, dict | None]]:
        """Samples each position of a guessed row in order, as decoding one token at a time would
        (the same sampler and generator; penalties, min_tokens and a grammar's mask see the
        guesses accepted before); a guess stands while it equals the token sampled at its place.
        Returns the accepted guesses' logprobs and the first token that differs (or follows the
        last). Guesses a draft drew from its own distribution go to ``_verify_drawn``."""
        assert self.sampler is not None, "only the driver samples"
        guesses = row.guessed_tokens
        if seq.matcher is not None:
            self.sampler.mask_guessed(logits, seq.matcher, guesses)
        if seq.guess_probs is not None:
            return self._verify_drawn(logits, seq, guesses, seq.guess_probs)
        if not needs_full_path(seq):  # greedy: every position's argmax at once
            best = argmax_rows(logits).tolist()
            n = next((j for j, g in enumerate(guesses) if best[j] != g), len(guesses))
            return [None] * n, (best[n], None)
        logprobs: list[dict | None] = []
        for j in range(len(guesses) + 1):
            view = AfterGuesses(seq, guesses[:j])
            sampled = self.sampler(logits[j : j + 1], [view])
            token, logprob = sampled.token_ids[0], sampled.logprobs[0]
            if j == len(guesses) or token != guesses[j]:
                return logprobs, (token, logprob)
            logprobs.append(logprob)
        raise AssertionError("unreachable")

    def _verify_drawn(
        self, logits: torch.Tensor, seq: Sequence, guesses: list[int], draft_probs: torch.Tensor
    ) -> tuple[list[dict | None], tuple[int, dict | None]]:
        """Speculative sampling for guesses a draft drew from ``draft_probs`` (q): guess x at
        its place stands with probability min(1, p(x) / q(x)), p the distribution the model
        draws from there; the first that does not is replaced by a draw from max(0, p - q),
        renormalised. Each token then follows p exactly (Leviathan et al., 2023), and accepts
        sum(min(p, q)) of the time, not just p(x) of a deterministic guess."""
        assert self.sampler is not None
        generator, logprobs = seq.generator, []
        for j, guess in enumerate(guesses):
            view = AfterGuesses(seq, guesses[:j])
            p, q = self.sampler.distribution(logits[j], view), draft_probs[j]
            if torch.rand((), generator=generator).item() * q[guess].item() <= p[guess].item():
                logprobs.append(self.sampler.logprob(logits[j], guess, seq.params))
                continue
            residual = (p - q).clamp_(min=0)
            if residual.sum().item() <= 0:  # p within q's rounding of it: p itself
                residual = p
            token = int(torch.multinomial(residual, 1, generator=generator).item())
            return logprobs, (token, self.sampler.logprob(logits[j], token, seq.params))
        sampled = self.sampler(logits[len(guesses) :], [AfterGuesses(seq, guesses)])
        return logprobs, (sampled.token_ids[0], sampled.logprobs[0])

    def step_shape(self, out: SchedulerOutput, seqs: list[Sequence]) -> StepShape:
        """This step as the memory planner sees it (checked against measured peaks in tests)."""
        sampled = [seqs[i] for i in out.sampling_rows]
        full, penalized = [], []
        prompt = [  # prompt logprobs: a log-softmax of SAMPLER_CHUNK_ROWS rows at a time
            min(SAMPLER_CHUNK_ROWS, r.prompt_logits - c0)
            for r in out.rows
            for c0 in range(0, r.prompt_logits, SAMPLER_CHUNK_ROWS)
        ]
        for c0 in range(0, len(sampled), SAMPLER_CHUNK_ROWS):
            chunk = sampled[c0 : c0 + SAMPLER_CHUNK_ROWS]
            if any(needs_full_path(s) for s in chunk):
                full.append(len(chunk))
            penalized += [
                s.num_tokens
                for s in chunk
                if s.params.repetition_penalty != 1 or s.params.presence_penalty or s.params.frequency_penalty
            ]
        layout = self.backend.attention_metadata(self.prepare(out), self.group_size)
        return StepShape(
            tokens=out.total_tokens,
            sampled=sum(r.logits_rows for r in out.rows),  # a guessed row has one per position
            decode_groups=[(g.blocks.shape[0], g.keys, True) for g in layout.decode_groups],
            prefills=[(p.length, p.context_len) for p in layout.prefills],
            full_sampler_rows=full,
            penalized_lengths=penalized,
            prompt_logprob_rows=prompt,
        )


def _several(row: ScheduledRow) -> bool:
    """Whether a row gets more than its one sampled logits row (guesses or prompt logits)."""
    return bool(row.guesses or row.prompt_logits)


def prompt_logprobs(logits: torch.Tensor, row: ScheduledRow, seq: Sequence) -> list[dict | None]:
    """The prompt logprobs of a row's prompt logits: position p's raw log-softmax at token p + 1
    (the model's own distribution, before any sampling setting, as vLLM reports them) with
    its top ``prompt_logprobs`` and its rank; SAMPLER_CHUNK_ROWS rows at a time, as the plan
    counts them."""
    top_n = row.params.prompt_logprobs or 0
    first = row.end - row.logits_rows  # the position of the first prompt-logits row
    out: list[dict | None] = []
    for c0 in range(0, logits.shape[0], SAMPLER_CHUNK_ROWS):
        lp = logits[c0 : c0 + SAMPLER_CHUNK_ROWS].log_softmax(dim=-1)
        top_vals, top_ids = lp.topk(max(1, top_n), dim=-1)
        ids, values = top_ids[:, :top_n].tolist(), top_vals[:, :top_n].tolist()
        for j in range(lp.shape[0]):
            token = seq.prompt_token_ids[first + c0 + j + 1]
            value = float(lp[j, token])  # (a number: a view would keep the chunk alive)
            rank = 1 + int(torch.count_nonzero(lp[j] > value))  # vLLM's: 1 + the tokens more likely
            out.append({"token": (token, value), "top": list(zip(ids[j], values[j])), "rank": rank})
        del lp, top_vals, top_ids  # before the next chunk's: one alive at a time, as the plan counts
    return out
