"""Scheduler: decides, step by step, which tokens of which requests run.

Each step has a budget of ``max_batch_tokens`` tokens and at most ``max_num_seqs`` sequences.
Running sequences go first (decodes and unfinished prompt chunks, oldest admission first), then
waiting ones in arrival order (FCFS). A prompt that does not fit the remaining budget is chunked:
it gets what is left, and the rest next step. When a running sequence needs a block and none is
free, the most recently admitted sequence is preempted: its blocks are freed and it goes back to
the front of the queue, to be recomputed (prompt plus what it generated) when room frees up.

A request for n samples is admitted as one sequence holding n of the ``max_num_seqs`` slots;
its prompt is computed once, and it forks into n sequences just before its last prompt token
(see ``pagedllm.sequence``). The blocks it shares are copied on first write (``copies``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    """What one step computes: for each sequence, how many of its next tokens."""

    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (source, destination) blocks

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_batch_tokens: int, max_num_seqs: int):
        if max_batch_tokens < 1 or max_num_seqs < 1:
            raise ValueError("max_batch_tokens and max_num_seqs must be >= 1")
        self.blocks = blocks
        self.max_batch_tokens = max_batch_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self._admissions = 0
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Drops a sequence wherever it is and frees its blocks (finish or abort)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq.seq_id)

    @property
    def slots_used(self) -> int:
        return sum(s.width for s in self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_batch_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.ready_to_fork:
                self._fork(seq, at=i + 1)
            start = seq.num_computed_tokens
            n = min(_compute_until(seq) - start, budget)
            while not self.blocks.can_write(seq.seq_id, start, start + n):
                victim = self.running[-1]
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                break  # seq preempted itself: nothing after it is left either
            self._add(batch, seq, n)
            budget -= n
            i += 1
        if batch.preempted:
            return batch  # memory is tight: admit nobody new this step
        slots = self.slots_used
        while self.waiting and budget > 0 and slots + self.waiting[0].width <= self.max_num_seqs:
            seq = self.waiting[0]
            # Reuse the longest cached prefix (prefix caching): those tokens are not recomputed.
            seq.num_computed_tokens = self.blocks.adopt_prefix(seq.seq_id, seq.tokens(0, seq.num_tokens))
            start = seq.num_computed_tokens
            n = 0 if seq.ready_to_fork else min(_compute_until(seq) - start, budget)
            if not self.blocks.can_write(seq.seq_id, start, start + n):
                self.blocks.free(seq.seq_id)  # adopted blocks go back to the cache
                seq.num_computed_tokens = 0
                break
            self.waiting.popleft()
            self.blocks.count_admission(seq.num_tokens, seq.num_computed_tokens)
            seq.status = Status.RUNNING
            seq.admitted_at = self._admissions
            self._admissions += 1
            self.running.append(seq)
            slots += seq.width
            if n:  # (a sequence with nothing to compute before it forks runs from the next step)
                self._add(batch, seq, n)
                budget -= n
        return batch

    def _add(self, batch: ScheduledBatch, seq: Sequence, n: int) -> None:
        start = seq.num_computed_tokens
        batch.copies += self.blocks.prepare_write(seq.seq_id, start, start + n)
        batch.seqs.append(seq)
        batch.num_tokens.append(n)

    def _fork(self, seq: Sequence, at: int) -> None:
        """Splits a sequence into its n samples; they run right after it, sharing its blocks."""
        children = seq.fork()
        for child in children:
            self.blocks.fork(seq.seq_id, child.seq_id)
            child.status = Status.RUNNING
        self.running[at:at] = children

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq.seq_id)
        seq.status = Status.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)


def _compute_until(seq: Sequence) -> int:
    """A sequence that will fork stops before its last prompt token: each sample computes that."""
    return seq.num_prompt_tokens - 1 if seq.pending_forks else seq.num_tokens
