"""Scheduler: decides, step by step, which tokens of which requests run, and commits the result.

Each step has a budget of ``max_batch_tokens`` tokens and at most ``max_num_seqs`` sequences.
Running sequences go first (decodes and unfinished prompt chunks, oldest admission first), then
waiting ones in arrival order (FCFS). A prompt that does not fit the remaining budget is chunked:
it gets what is left, and the rest next step. When a running sequence needs a block and none is
free, the most recently admitted sequence is preempted: its blocks are freed and it goes back to
the front of the queue, to be recomputed (prompt plus what it generated) when room frees up.

A request for n samples is admitted as one sequence holding n of the ``max_num_seqs`` slots;
its prompt is computed once, and it forks into n sequences just before its last prompt token
(see ``pagedllm.engine.sequence``). The blocks it shares are copied on first write (``copies``).

The step's shape (as in nano-vllm and vLLM; ``engine.step`` has the data that crosses)::

    out = scheduler.schedule()                 # plain data: tokens, block tables, copies, zeroing
    result = runner.run(out, scheduler.sequences(out))  # prepare -> execute -> sample; nothing committed
    scheduler.update_from_output(out, result)  # tokens appended, blocks registered, stops

Nothing changes state between ``schedule`` and ``update_from_output`` except the blocks the
batch took, so a step that runs out of memory is retried smaller (``recover_from_oom``).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ..structured import allowed_prefix
from .block_pools import BlockPools
from .sequence import Finish, Sequence, Status
from .speculative import NgramProposer, Proposer, Speculation
from .step import ScheduledRow, SchedulerOutput

log = logging.getLogger(__name__)

# With a draft model, a sequence whose guessed steps keep accepting nothing decodes 1, 3, 7, then
# 15 steps without guesses between tries (each guess costs a draft pass).
MAX_GUESS_PAUSE = 15

# Whether a sequence ends, decided after its token is appended (None: it goes on).
StopCheck = Callable[[Sequence], "Finish | None"]


class StepResult(Protocol):
    """What ``update_from_output`` needs of a step (``ModelRunner.run`` returns one)."""

    sampled: list[int]  # indices into out.rows that got a token
    token_ids: list[int]
    logprobs: list[dict | None]
    failed: list[int]  # indices into out.rows whose logits were not finite
    accepted: dict[int, list[dict | None]]  # row -> logprobs of its accepted guesses, in order
    prompt_logprobs: dict[int, list[dict | None]]  # row -> the prompt logprobs of its prompt logits
    pooled: dict[int, Any]  # row -> the sum of its pooled hidden states (a tensor)


@dataclass
class SchedulerCounters:
    steps: int = 0
    tokens_computed: int = 0
    prompt_tokens_computed: int = 0
    tokens_generated: int = 0
    preemptions: int = 0
    blocks_copied: int = 0  # copy-on-write copies of blocks shared by the samples of one request
    oom_recoveries: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    requests_failed: int = 0
    tokens_drafted: int = 0  # speculative guesses scheduled
    tokens_accepted: int = 0  # of which the model sampled the same token
    speculative_rows: int = 0  # decode rows that carried guesses


class Scheduler:
    def __init__(
        self,
        blocks: BlockPools,
        max_batch_tokens: int,
        max_num_seqs: int,
        stop_check: StopCheck,
        speculation: Speculation | None = None,
        max_model_len: int | None = None,
        proposer: Proposer | None = None,
    ):
        """``speculation``: guesses appended to decode rows (``engine.speculative``), made by
        ``proposer`` (default: n-gram lookup); ``max_model_len``: no guess goes past it."""
        if max_batch_tokens < 1 or max_num_seqs < 1:
            raise ValueError("max_batch_tokens and max_num_seqs must be >= 1")
        self.blocks = blocks
        self.max_batch_tokens = max_batch_tokens
        self.max_num_seqs = max_num_seqs
        self.stop_check = stop_check
        self.requests: dict[str, Sequence] = {}  # request id -> its first sample, until all finish
        self.live: dict[int, Sequence] = {}  # seq id -> every unfinished sample (the step names them by id)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.counters = SchedulerCounters()
        self._extra_rows = 0  # this step's (``_within_logits_rows``)
        self._to_zero: list[tuple[int, int]] = []  # (pool, block), carried by the next batch
        self._to_copy: list[tuple[int, int, int]] = []  # (pool, source, destination), re-carried after a failed step
        # blocks new admissions may fill (None: all); running sequences grow past it
        self.admission_limit: int | None = None
        self.speculation = speculation
        self.proposer = proposer or (NgramProposer(speculation) if speculation is not None else None)
        self.max_model_len = max_model_len

    # ---- requests ---------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        self.requests[seq.request_id] = seq
        self.live[seq.seq_id] = seq
        self.waiting.append(seq)
        if self.blocks.disk is not None:  # its blocks on disk start coming into the page cache
            self.blocks.read_ahead(seq.tokens(0, min(seq.num_tokens, seq.prefix_cache_limit + 1)))

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def blocks_to_finish(self) -> int:
        """The blocks (of pool 0) the running sequences hold once each has run to its max_tokens
        or the context: what a smaller cache must keep for none of them to be preempted. Each
        sample counts its prompt's blocks, shared or not (an upper bound)."""
        size, total = self.blocks.block_size, 0
        for seq in self.running:
            end = seq.num_prompt_tokens + seq.params.max_tokens
            if self.max_model_len is not None:
                end = min(end, self.max_model_len)
            total += -(-max(end, seq.num_tokens) // size) * seq.width
        return total

    @property
    def slots_used(self) -> int:
        return sum(s.width for s in self.running)

    def abort(self, request_id: str) -> list[Sequence]:
        """Ends every unfinished sample of a request; returns them ([] if none)."""
        first = self.requests.get(request_id)
        if first is None:
            return []
        live = [s for s in first.group if not s.is_finished]
        for seq in live:
            self.finish(seq, Finish("abort"))
        self.counters.requests_aborted += 1
        return live

    def finish(self, seq: Sequence, finish: Finish) -> None:
        """Ends one sample wherever it is and frees its blocks; the request is forgotten once
        every sample has ended. A sample that already ended keeps its first reason."""
        if seq.is_finished:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq.seq_id)
        self.live.pop(seq.seq_id, None)
        if self.proposer is not None:
            self.proposer.forget(seq.seq_id)
        seq.mark_finished(finish)
        if finish.reason == "error":
            self.counters.requests_failed += 1
        if seq.request_finished:
            del self.requests[seq.request_id]
            if finish.reason in ("stop", "length"):
                self.counters.requests_finished += 1

    # ---- the step ---------------------------------------------------------------------------

    def sequences(self, out: SchedulerOutput) -> list[Sequence]:
        """The live sequences of ``out``'s rows, in order (the driver's side of the step)."""
        return [self.live[r.seq_id] for r in out.rows]

    def schedule(self) -> SchedulerOutput:
        batch = SchedulerOutput()
        budget = self.max_batch_tokens
        spec = self.speculation
        allowed = spec is not None and spec.rows_allowed(sum(s.width for s in self.running), self.max_num_seqs)
        proposals = self._proposals() if allowed else {}
        self._extra_rows = 0  # logits rows prompt logprobs took beyond their sequences' own slots
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.ready_to_fork:
                self._fork(seq, at=i + 1)
            start = seq.num_computed_tokens
            n = self._within_logits_rows(seq, start, min(_compute_until(seq) - start, budget))
            guesses = proposals.get(seq.seq_id, [])[: budget - n] if n == 1 else []
            if guesses and not self.blocks.can_write(seq.seq_id, start, start + n + len(guesses)):
                guesses = []  # guesses never take a block someone else would have to give up
            n += len(guesses)
            while not self.blocks.can_write(seq.seq_id, start, start + n):
                victim = self.running[-1]
                self._preempt(victim)
                batch.preempted.append(victim.seq_id)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                break  # seq preempted itself: nothing after it is left either
            self._add(batch, seq, n - len(guesses), guesses)
            budget -= n
            i += 1
        if not batch.preempted:  # memory is tight after a preemption: admit nobody new this step
            self._admit(batch, budget)
        if batch:
            batch.zeros, self._to_zero = self._to_zero, []
            batch.copies, self._to_copy = self._to_copy + batch.copies, []
            batch.state_copies = self.blocks.take_state_copies()
            batch.state_restores = self.blocks.take_state_restores()
        self.counters.preemptions += len(batch.preempted)
        return batch

    def _admit(self, batch: SchedulerOutput, budget: int) -> None:
        slots = self.slots_used
        while self.waiting and budget > 0 and slots + self._extra_rows + self.waiting[0].width <= self.max_num_seqs:
            seq = self.waiting[0]
            # Reuse the longest cached prefix (prefix caching): those tokens are not recomputed
            # (nor do they give logits: a sequence owing prompt logprobs adopts only what it has).
            cacheable = min(seq.num_tokens, seq.prefix_cache_limit + 1)
            seq.num_computed_tokens = self.blocks.adopt_prefix(seq.seq_id, seq.tokens(0, cacheable))
            start = seq.num_computed_tokens
            n = 0 if seq.ready_to_fork else min(_compute_until(seq) - start, budget)
            n = self._within_logits_rows(seq, start, n, admitting=True)
            if not self.blocks.can_write(seq.seq_id, start, start + n) or self._over_admission_limit(seq, start, n):
                self.blocks.free(seq.seq_id)  # adopted blocks go back to the cache
                seq.num_computed_tokens = 0
                return
            self.waiting.popleft()
            self.blocks.count_admission(seq.num_tokens, seq.num_computed_tokens)
            seq.status = Status.RUNNING
            self.running.append(seq)
            slots += seq.width
            if n:  # (a sequence with nothing to compute before it forks runs from the next step)
                self._add(batch, seq, n)
                budget -= n

    def _within_logits_rows(self, seq: Sequence, start: int, n: int, admitting: bool = False) -> int:
        """``n`` cut so the step's logits rows stay within ``max_num_seqs``, what the memory plan
        allows for: a sequence owing prompt logprobs gets a logits row per prompt position, out of
        its own slots and the ones nobody holds this step; the rest of its prompt comes next step."""
        wanted = seq.prompt_logits_wanted(start, start + n)
        if not wanted:
            return n
        samples = start + n == seq.num_tokens
        spare = self.max_num_seqs - self.slots_used - self._extra_rows - (seq.width if admitting else 0)
        allowed = seq.width + max(0, spare) - (1 if samples else 0)
        if wanted > allowed:
            n -= wanted - max(1, allowed) + (1 if samples else 0)
            wanted = seq.prompt_logits_wanted(start, start + n)
        self._extra_rows += max(0, wanted + (1 if start + n == seq.num_tokens else 0) - seq.width)
        return n

    def _over_admission_limit(self, seq: Sequence, start: int, n: int) -> bool:
        limit = self.admission_limit
        return (
            limit is not None
            and self.blocks.num_used + self.blocks.blocks_to_write(seq.seq_id, start, start + n) > limit
        )

    def update_from_output(self, batch: SchedulerOutput, result: StepResult) -> list[Sequence]:
        """Commits a computed step: its tokens' K/V count as cached (full blocks become prefixes
        others can adopt), each sampled token is appended, and a sequence that is done (EOS, a
        stop token or string, max_tokens, the context) finishes. A sequence whose logits were
        not finite fails alone; its blocks are zeroed before anyone reuses them. Returns the
        sequences that got a token or finished, in batch order."""
        c = self.counters
        if self.blocks.checkpoints is not None:
            self.blocks.checkpoints.commit()  # the states this step copied out can be found
        c.steps += 1
        c.tokens_computed += batch.total_tokens
        c.blocks_copied += len(batch.copies)
        seqs = self.sequences(batch)
        for e, seq in zip(batch.rows, seqs):
            c.prompt_tokens_computed += max(0, min(seq.num_prompt_tokens, e.end) - e.start)
            seq.num_computed_tokens = e.end - e.guesses  # guesses count once accepted (below)
            self.blocks.register_computed(seq.seq_id, seq.tokens, seq.num_computed_tokens)
        for i, entries in result.prompt_logprobs.items():
            seq = seqs[i]
            if not seq.prompt_logprobs:
                seq.prompt_logprobs.append(None)  # the first token: nothing before it to predict it
            seq.prompt_logprobs.extend(entries)
        changed: dict[int, Sequence] = {}
        for i, summed in result.pooled.items():
            seq = seqs[i]
            seq.pool(summed, batch.rows[i].pooled)
            if seq.embedding is not None:
                self.finish(seq, Finish("stop"))
                changed[i] = seq
        for i in result.failed:
            seq = seqs[i]
            self._to_zero += self.blocks.release_poisoned(seq.seq_id)
            self.finish(
                seq, Finish("error", "the model produced non-finite logits (NaN/inf) for this request", "model")
            )
            changed[i] = seq
        for i, token, logprob in zip(result.sampled, result.token_ids, result.logprobs):
            row, seq = batch.rows[i], seqs[i]
            accepted = result.accepted.get(i, [])
            guesses = row.guessed_tokens[: len(accepted)]
            self._append(seq, [*zip(guesses, accepted), (token, logprob)])
            if row.guesses:
                seq.guess_probs = None
                seq.guess_limit = len(accepted) + 1
                seq.guess_misses = 0 if accepted else seq.guess_misses + 1
                if self.proposer is not None and self.proposer.pause_after_misses:
                    seq.guess_pause = min(MAX_GUESS_PAUSE, 2 ** max(0, seq.guess_misses - 1) - 1)
                c.speculative_rows += 1
                c.tokens_drafted += row.guesses
                c.tokens_accepted += len(accepted)
                if not seq.is_finished:  # the accepted guesses' K/V are now computed
                    self.blocks.register_computed(seq.seq_id, seq.tokens, seq.num_computed_tokens)
                    self.blocks.trim(seq.seq_id, seq.num_tokens)  # blocks taken for rejected guesses only
            changed[i] = seq
        return [changed[i] for i in sorted(changed)]

    def _append(self, seq: Sequence, tokens: list[tuple[int, dict | None]]) -> None:
        """Appends a row's new tokens in order (accepted guesses, then the sampled one), each
        checked for a stop as if it had been sampled alone; a stop drops the rest. A guess,
        once accepted, is a computed token (its K/V were written by the step)."""
        for j, (token, logprob) in enumerate(tokens):
            accepted = seq.append_token(token, logprob)
            self.counters.tokens_generated += 1
            stop = (
                self.stop_check(seq) if accepted else Finish("error", "the grammar refused a sampled token", "engine")
            )
            if stop is not None:
                self.finish(seq, stop)
                return
            if j < len(tokens) - 1:
                seq.num_computed_tokens += 1

    def recover_from_oom(self, batch: SchedulerOutput, error: BaseException) -> None:
        """Halves the step budget so the same work is retried as smaller steps next time.

        Nothing was committed: sequences keep their state and blocks, and the next schedule
        splits their tokens under the lower budget. The batch's cache maintenance is carried
        again by the next batch (copies and zeroing are idempotent). A one-token step that
        still fails re-raises. A model with states per sequence: the batch's sequences are
        preempted instead (they recompute from their first token), as a failed step may have
        moved some layers' states and not others.
        """
        if batch.total_tokens <= 1:
            raise error
        if self.blocks.checkpoints is not None:
            self.blocks.checkpoints.drop_pending()  # perhaps half written
        if self.blocks.state_slots:  # a failed step may have moved some layers' states: start them again
            for seq in [self.live[r.seq_id] for r in batch.rows if r.seq_id in self.live]:
                if seq.status is Status.RUNNING:
                    self._preempt(seq)
        self._to_copy = batch.copies + self._to_copy
        self._to_zero = batch.zeros + self._to_zero
        old = self.max_batch_tokens
        self.max_batch_tokens = max(1, min(old, batch.total_tokens // 2))
        self.counters.oom_recoveries += 1
        log.warning(
            "out of memory in a step of %d tokens (%s); max_batch_tokens %d -> %d",
            batch.total_tokens,
            type(error).__name__,
            old,
            self.max_batch_tokens,
        )

    def _add(self, batch: SchedulerOutput, seq: Sequence, n: int, guesses: list[int] | None = None) -> None:
        """``n`` of the sequence's own tokens, then ``guesses`` (speculative, after its last one)."""
        guesses = guesses or []
        start = seq.num_computed_tokens
        end = start + n + len(guesses)
        batch.copies += self.blocks.prepare_write(seq.seq_id, start, end)
        tables = self.blocks.tables_of(seq.seq_id)
        samples = start + n == seq.num_tokens and seq.params.pooling is None
        tokens = seq.tokens(start, start + n) + guesses
        prompt_logits = seq.prompt_logits_wanted(start, start + n)
        batch.rows.append(
            ScheduledRow(
                seq.seq_id,
                seq.request_id,
                seq.index,
                start,
                tokens,
                tables,
                samples,
                seq.params,
                len(guesses),
                prompt_logits,
                seq.pooled_positions(start, start + n),
                self.blocks.state_slot(seq.seq_id),
                tuple(
                    (b - start, slot)
                    for b, slot in self.blocks.checkpoints_between(
                        start, start + n, lambda k: seq.tokens(0, k), seq.num_prompt_tokens
                    )
                ),
            )
        )

    def _proposals(self) -> dict[int, list[int]]:
        """The proposer's guesses for every running sequence that may guess this step, by seq
        id (the step's budget trims them as it fills)."""
        seqs, limits = [], []
        for seq in self.running:
            seq.guess_probs = None  # a draft's distributions live for one step
            limit = self._guess_limit(seq)
            if limit > 0:
                seqs.append(seq)
                limits.append(limit)
        if not seqs:
            return {}
        assert self.proposer is not None
        proposals = {}
        for seq, guesses in zip(seqs, self.proposer.propose(seqs, limits)):
            if seq.matcher is not None:  # only what its grammar allows can be verified
                guesses = guesses[: allowed_prefix(seq.matcher, guesses)]
            if guesses:
                proposals[seq.seq_id] = guesses
        return proposals

    def _guess_limit(self, seq: Sequence) -> int:
        """How many guesses a sequence may carry: none unless it decodes, none past its
        max_tokens (the token sampled after them counts too) or the context."""
        assert self.speculation is not None
        if seq.pending_forks or seq.num_computed_tokens != seq.num_tokens - 1:
            return 0
        if seq.guess_pause:  # its guesses keep missing: a draft pass or a row is not worth it
            seq.guess_pause -= 1
            return 0
        left = seq.params.max_tokens - len(seq.output_token_ids) - 1
        limit = min(left, seq.guess_limit or self.speculation.num_tokens)
        if self.max_model_len is not None:
            limit = min(limit, self.max_model_len - seq.num_tokens - 1)
        return limit

    def _fork(self, seq: Sequence, at: int) -> None:
        """Splits a sequence into its n samples; they run right after it, sharing its blocks."""
        children = seq.fork()
        for child in children:
            self.blocks.fork(seq.seq_id, child.seq_id)
            self.live[child.seq_id] = child
            child.status = Status.RUNNING
        self.running[at:at] = children

    def set_step_budget(self, max_batch_tokens: int) -> None:
        """A new plan's step budget (``EngineMemory.resize``)."""
        self.max_batch_tokens = max_batch_tokens

    def limit_admissions(self, blocks: int | None) -> None:
        """New admissions may fill only the first ``blocks`` blocks (None: all of them)."""
        self.admission_limit = blocks

    def shrink_cache(self, sizes: list[int]) -> list[tuple[int, int, int]]:
        """Fits everything running into the first ``sizes[p]`` blocks of each pool: preempts the
        newest sequences (recomputed later, as when blocks run out) until the live blocks fit,
        then has the pools move what lives past their ends. Returns their (pool, source,
        destination) moves; the cache maintenance carried to the next step follows them."""
        while self.blocks.over(sizes) and self.running:
            victim = self.running[-1]
            self._preempt(victim)
            self.counters.preemptions += 1
        moves = self.blocks.resize(sizes)
        moved = {(p, a): b for p, a, b in moves}

        def kept(p: int, b: int) -> bool:
            return b < sizes[p] or (p, b) in moved

        self._to_zero = [(p, moved.get((p, b), b)) for p, b in self._to_zero if kept(p, b)]
        self._to_copy = [
            (p, moved.get((p, a), a), moved.get((p, b), b)) for p, a, b in self._to_copy if kept(p, a) and kept(p, b)
        ]
        return moves

    def compact_idle_cache(self, keep_cached: bool) -> tuple[list[tuple[int, int, int]], list[int]]:
        """With nothing queued: the pools' prefix-cache blocks moved to the bottom of each pool
        (or forgotten, ``keep_cached=False``). Returns the (pool, source, destination) moves, for
        the caller to copy now, and each pool's first block past what is kept: every block from
        there on is free, its pages can go back to the OS."""
        if self.running or self.waiting:
            raise RuntimeError("compact_idle_cache: requests are queued")
        self._to_copy = []  # a pending copy's destination belonged to a request: none is left
        moves, ends = self.blocks.compact(keep_cached)
        overwritten = {(p, dst) for p, _, dst in moves}  # by a clean copy: zeroing it would wipe that
        self._to_zero = [z for z in self._to_zero if z not in overwritten]
        return moves, ends

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq.seq_id)
        seq.status = Status.WAITING
        seq.num_computed_tokens = 0
        seq.pooled_sum, seq.pooled_count = None, 0  # an embedding request pools again from the start
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    # ---- checks -------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raises AssertionError if the block manager and the queues disagree: a block both free
        and owned, a leak, a request in two states or in none, a finished request still queued."""
        self.blocks.check_invariants()
        running = {s.seq_id for s in self.running}
        waiting = {s.seq_id for s in self.waiting}
        known = {s.seq_id for first in self.requests.values() for s in first.group if not s.is_finished}
        problems = []
        if len(running) != len(self.running) or len(waiting) != len(self.waiting):
            problems.append("a request is queued twice")
        if running & waiting:
            problems.append(f"requests both running and waiting: {sorted(running & waiting)}")
        if running | waiting != known:
            problems.append(f"queued sequences {sorted(running | waiting)} but live ones {sorted(known)}")
        if set(self.live) != known:
            problems.append(f"the step's id lookup holds {sorted(self.live)} but live sequences are {sorted(known)}")
        if self.slots_used > self.max_num_seqs:
            problems.append(f"{self.slots_used} running samples exceed max_num_seqs")
        if set(self.blocks.tables) - running:
            problems.append(f"blocks held by requests not running: {sorted(set(self.blocks.tables) - running)}")
        for seq in self.running:
            if seq.status is not Status.RUNNING:
                problems.append(f"{seq.request_id}[{seq.index}] is in the running queue with status {seq.status}")
            need, held = self.blocks.blocks_for(seq.num_computed_tokens), len(self.blocks.table(seq.seq_id))
            if held < need:
                problems.append(
                    f"{seq.request_id}[{seq.index}] computed {seq.num_computed_tokens} tokens but holds {held} blocks"
                )
            if held > self.blocks.blocks_for(seq.num_tokens):  # e.g. blocks of rejected guesses kept
                problems.append(f"{seq.request_id}[{seq.index}] has {seq.num_tokens} tokens but holds {held} blocks")
        for seq in self.waiting:
            if seq.status is not Status.WAITING or seq.num_computed_tokens:
                problems.append(
                    f"{seq.request_id}[{seq.index}] waits with status {seq.status} and "
                    f"{seq.num_computed_tokens} computed tokens"
                )
        if problems:
            raise AssertionError("engine invariants broken: " + "; ".join(problems))


def _compute_until(seq: Sequence) -> int:
    """A sequence that will fork stops before its last prompt token: each sample computes that."""
    return seq.num_prompt_tokens - 1 if seq.pending_forks else seq.num_tokens
