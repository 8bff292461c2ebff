"""What crosses from the scheduler to the runner, and from the runner's driver to whatever
executes the model: plain data only (ints, strings, lists, int tensors, each row's
``SamplingParams``, a dataclass of values), so a step can be pickled, sent to another process
or device, and replayed.

::

    SchedulerOutput  (scheduler.schedule: which tokens of which sequences, the cache maintenance)
        -> ModelRunner.prepare -> StepInput  (the tensors every rank or device runs)
        -> ModelRunner.execute -> logits
        -> ModelRunner.sample (on the driver, with the live per-request state) -> RunResult
        -> scheduler.update_from_output

The live state of a request (its ``torch.Generator``, its grammar matcher, its detokenizer text)
never enters either: it stays with the driver's ``Sequence`` objects, which the scheduler finds
by ``seq_id``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..sampling_params import SamplingParams


@dataclass(frozen=True)
class ScheduledRow:
    """One sequence's share of a step: tokens [start, start + num_tokens) with their K/V going
    to ``block_tables``, one per pool (snapshots: the runner never asks the block pools)."""

    seq_id: int
    request_id: str
    index: int  # which of the request's samples
    start: int
    token_ids: list[int]  # the tokens this step computes
    block_tables: tuple[list[int], ...]  # pool 0's, then each window pool's (``block_pools``)
    samples: bool  # this step computes the sequence's last known token: a token is sampled for it
    params: SamplingParams
    guesses: int = 0  # speculative tokens after its last known one (the last of token_ids), each verified
    # prompt positions whose logits this row also returns, for the request's prompt logprobs:
    # the last ones of token_ids before the sampled one (``Sequence.prompt_logits_wanted``)
    prompt_logits: int = 0
    pooled: int = 0  # an embedding request's: its last positions whose hidden states are pooled
    state_slot: int = -1  # its slot in the state pool (layers that keep a state per sequence); -1: none
    # (position, checkpoint slot): where in [start, end) its state is copied out for later requests
    checkpoints: tuple[tuple[int, int], ...] = ()

    @property
    def block_table(self) -> list[int]:
        """Pool 0's table."""
        return self.block_tables[0]

    @property
    def guessed_tokens(self) -> list[int]:
        """Its speculative guesses: the last ``guesses`` of ``token_ids``."""
        return self.token_ids[len(self.token_ids) - self.guesses :]

    @property
    def logits_rows(self) -> int:
        """Logits rows this row gets: its prompt logits, its last known token's and one per guess."""
        return self.prompt_logits + ((1 + self.guesses) if self.samples else 0)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


@dataclass
class SchedulerOutput:
    """What one step computes, and the cache maintenance to do before it computes anything."""

    rows: list[ScheduledRow] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)  # seq ids sent back to the queue this step
    copies: list[tuple[int, int, int]] = field(default_factory=list)  # (pool, source, destination) blocks
    zeros: list[tuple[int, int]] = field(default_factory=list)  # (pool, block)s whose K/V may be non-finite
    # (source, destination) state slots: a forked sample's state, copied from its parent's
    state_copies: list[tuple[int, int]] = field(default_factory=list)
    # (checkpoint, state) slots: a sequence that adopted a cached prefix starts from its checkpoint
    state_restores: list[tuple[int, int]] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rows)

    @property
    def sampling_rows(self) -> list[int]:
        """Indices into ``rows`` that sample a token, in order."""
        return [i for i, r in enumerate(self.rows) if r.samples]

    @property
    def rows_with_logits(self) -> list[int]:
        """Indices into ``rows`` that get logits rows (a token to sample or prompt logprobs), in order."""
        return [i for i, r in enumerate(self.rows) if r.logits_rows]

    def __bool__(self) -> bool:
        return bool(self.rows)


@dataclass
class StepInput:
    """The tensors of one step, on the backend's device. T tokens of S sequences, R sampled.

    The flat batch is the sequences' new tokens one after another, no padding; sequence s owns
    rows ``query_start[s] : query_start[s + 1]`` and attends to ``context_lens[s]`` keys, whose
    K/V live in the blocks ``block_tables[p, s]`` of each pool p (block 0 past its context and
    where a window's pool gave a block back).
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    query_start: torch.Tensor  # [S + 1] int32
    context_lens: torch.Tensor  # [S] int32
    block_tables: torch.Tensor  # [pools, S, widest] int32
    logits_rows: torch.Tensor  # [R] int64: rows of the flat batch whose logits are sampled
    copies: torch.Tensor  # [C, 3] int64: (pool, source, destination) blocks, copied before the step
    zeros: torch.Tensor  # [Z, 2] int64: (pool, block)s zeroed before the step
    block_size: int
    # [P, 2] int64: (first, end) rows of the flat batch whose final hidden states are summed
    # (an embedding request's pooled positions; ``ModelRunner.pooled``)
    pool_ranges: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 2, dtype=torch.long))
    # [S] int64: each sequence's state slot (``ScheduledRow.state_slot``); [C, 2] int64: the
    # (source, destination) slots copied before the step
    state_slots: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    state_copies: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 2, dtype=torch.long))
    # [R, 2] int64: (checkpoint, state) slots restored before the step; [C, 3] int64: (sequence,
    # tokens of it computed, checkpoint slot) states copied out during the step
    state_restores: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 2, dtype=torch.long))
    checkpoints: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 3, dtype=torch.long))
