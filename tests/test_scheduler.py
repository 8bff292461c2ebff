"""Scheduler with real BlockPools (one pool) and real Sequences, no model: a fake step samples a fixed
token for every sequence whose last known token was computed. Covers admission (FCFS, slots,
token budget), chunked prefill, decode, preemption and recompute, prefix adoption, forks and
their copy-on-write copies, commits, failed rows, out-of-memory retries and aborts. The
scheduler's invariants are checked around every step, and every test ends with every block
free."""

from dataclasses import dataclass, field
from typing import NamedTuple

import pytest

from pagedllm.engine.block_pools import BlockPools
from pagedllm.engine.scheduler import Scheduler
from pagedllm.engine.sequence import Finish, Sequence, Status
from pagedllm.engine.step import SchedulerOutput
from pagedllm.sampling_params import SamplingParams

TOKEN = 7  # what the fake step samples


@dataclass
class FakeResult:
    sampled: list[int]
    token_ids: list[int]
    logprobs: list[dict | None]
    failed: list[int] = field(default_factory=list)
    accepted: dict[int, list[dict | None]] = field(default_factory=dict)  # no speculative guesses here
    prompt_logprobs: dict[int, list[dict | None]] = field(default_factory=dict)  # none asked for here
    pooled: dict = field(default_factory=dict)  # no embedding requests here


class Row(NamedTuple):
    """One entry of a batch as it was scheduled."""

    request_id: str
    index: int
    start: int
    num_tokens: int
    samples: bool


class Step(NamedTuple):
    batch: SchedulerOutput
    rows: list[Row]


def stop_at_max_tokens(seq: Sequence) -> Finish | None:
    return Finish("length") if len(seq.output_token_ids) >= seq.params.max_tokens else None


def make(num_blocks=32, block_size=4, max_batch_tokens=64, max_num_seqs=8, prefix_caching=True) -> Scheduler:
    blocks = BlockPools([num_blocks], block_size, (None,), prefix_caching)
    return Scheduler(blocks, max_batch_tokens, max_num_seqs, stop_at_max_tokens)


def add(sched: Scheduler, request_id: str, prompt: int | list[int], max_tokens=4, n=1) -> Sequence:
    """Adds a request; an int prompt is that many distinct tokens (distinct per request)."""
    if isinstance(prompt, int):
        base = 1000 * (1 + sum(map(ord, request_id)))
        prompt = list(range(base, base + prompt))
    seq = Sequence(request_id, prompt, SamplingParams(max_tokens=max_tokens, n=n))
    sched.add(seq)
    return seq


def rows_of(batch: SchedulerOutput) -> list[Row]:
    return [Row(e.request_id, e.index, e.start, e.num_tokens, e.samples) for e in batch.rows]


def step(sched: Scheduler, token: int = TOKEN, failed: tuple[int, ...] = ()) -> Step:
    """schedule -> fake run -> update_from_output, checking the invariants around it."""
    sched.check_invariants()
    batch = sched.schedule()
    sched.check_invariants()
    rows = rows_of(batch)
    sampled = [i for i, r in enumerate(rows) if r.samples and i not in failed]
    assert all(rows[i].samples for i in failed), "the fake step fails only rows that sample"
    sched.update_from_output(batch, FakeResult(sampled, [token] * len(sampled), [None] * len(sampled), list(failed)))
    sched.check_invariants()
    return Step(batch, rows)


def run_to_end(sched: Scheduler, max_steps: int = 200) -> None:
    for _ in range(max_steps):
        if not sched.has_unfinished():
            break
        step(sched)
    assert_all_free(sched)


def assert_all_free(sched: Scheduler) -> None:
    sched.check_invariants()
    blocks = sched.blocks
    assert not sched.has_unfinished() and sched.requests == {}
    assert blocks.num_free == blocks.num_blocks and blocks.tables == {}
    assert blocks.ref_counts == [0] * blocks.num_blocks


# ---- admission --------------------------------------------------------------------------------


def test_requests_are_admitted_in_arrival_order_up_to_max_num_seqs():
    sched = make(max_num_seqs=2)
    a, b, c = add(sched, "a", 3, max_tokens=1), add(sched, "b", 3, max_tokens=3), add(sched, "c", 3, max_tokens=1)
    assert step(sched).rows == [Row("a", 0, 0, 3, True), Row("b", 0, 0, 3, True)]
    assert list(sched.waiting) == [c] and c.status is Status.WAITING
    assert a.finish_reason == "length" and "a" not in sched.requests
    assert step(sched).rows == [Row("b", 0, 3, 1, True), Row("c", 0, 0, 3, True)]
    assert list(sched.running) == [b]  # c finished after one token
    run_to_end(sched)


def test_a_request_for_n_samples_holds_n_slots_and_later_requests_never_overtake_it():
    sched = make(max_num_seqs=3)
    add(sched, "a", 5, max_tokens=2, n=2)
    b, c = add(sched, "b", 3, max_tokens=1, n=2), add(sched, "c", 3, max_tokens=1)
    assert step(sched).rows == [Row("a", 0, 0, 4, False)]  # the prompt up to its last token
    assert sched.slots_used == 2 and list(sched.waiting) == [b, c]  # c would fit a slot, but b is first
    assert step(sched).rows == [Row("a", 0, 4, 1, True), Row("a", 1, 4, 1, True)]
    assert sched.slots_used == 2 and list(sched.waiting) == [b, c]
    step(sched)  # both samples of a finish
    assert step(sched).rows == [Row("b", 0, 0, 2, False), Row("c", 0, 0, 3, True)]
    run_to_end(sched)


def test_a_step_computes_at_most_max_batch_tokens_running_sequences_first():
    sched = make(max_batch_tokens=8)
    add(sched, "a", 4, max_tokens=3)
    assert step(sched).rows == [Row("a", 0, 0, 4, True)]
    add(sched, "b", 20, max_tokens=1)
    s = step(sched)
    assert s.rows == [Row("a", 0, 4, 1, True), Row("b", 0, 0, 7, False)] and s.batch.total_tokens == 8
    assert step(sched).rows == [Row("a", 0, 5, 1, True), Row("b", 0, 7, 7, False)]
    assert step(sched).rows == [Row("b", 0, 14, 6, True)]  # a finished: b alone, under the budget
    assert sched.counters.tokens_computed == 4 + 8 + 8 + 6
    run_to_end(sched)


def test_a_long_prompt_is_computed_in_chunks_and_only_the_last_chunk_samples():
    sched = make(max_batch_tokens=4, block_size=4)
    seq = add(sched, "a", 10, max_tokens=2)
    expected = [(Row("a", 0, 0, 4, False), 1), (Row("a", 0, 4, 4, False), 2), (Row("a", 0, 8, 2, True), 3)]
    for row, table_len in expected:
        s = step(sched)
        assert s.rows == [row] and len(s.batch.rows[0].block_table) == table_len
        assert seq.num_computed_tokens == row.start + row.num_tokens
        assert seq.output_token_ids == ([TOKEN] if row.samples else [])
    assert sched.counters.prompt_tokens_computed == 10 and sched.counters.tokens_generated == 1
    assert step(sched).rows == [Row("a", 0, 10, 1, True)]
    assert seq.output_token_ids == [TOKEN, TOKEN] and seq.finish_reason == "length"
    assert_all_free(sched)


def test_after_its_prompt_a_sequence_decodes_one_token_per_step():
    sched = make(block_size=4)
    seq = add(sched, "a", 3, max_tokens=5)
    assert step(sched, token=10).rows == [Row("a", 0, 0, 3, True)]
    for k, table_len in zip(range(1, 5), [1, 2, 2, 2]):
        s = step(sched, token=10 + k)
        assert s.rows == [Row("a", 0, 2 + k, 1, True)] and len(s.batch.rows[0].block_table) == table_len
    assert seq.output_token_ids == [10, 11, 12, 13, 14] and seq.num_computed_tokens == 7
    assert seq.finish_reason == "length" and sched.counters.requests_finished == 1
    assert_all_free(sched)  # freed in the step it finished, not later


# ---- preemption -------------------------------------------------------------------------------


def test_the_newest_request_is_preempted_to_make_room_and_goes_back_to_the_front():
    # 4 blocks of 2: a and b fill them with their prompts; a's first decode needs a fifth
    sched = make(num_blocks=4, block_size=2, prefix_caching=False)
    a, b = add(sched, "a", 4, max_tokens=3), add(sched, "b", 4, max_tokens=3)
    step(sched)
    assert sched.blocks.num_free == 0
    c = add(sched, "c", 2, max_tokens=1)
    s = step(sched)
    assert s.batch.preempted == [b.seq_id] and s.rows == [Row("a", 0, 4, 1, True)]
    assert list(sched.waiting) == [b, c] and sched.running == [a]  # c was not admitted in this step
    assert b.status is Status.WAITING and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert sched.blocks.table(b.seq_id) == [] and b.output_token_ids == [TOKEN]  # its token is kept
    assert sched.counters.preemptions == 1 and sched.blocks.num_free == 1
    assert step(sched).rows == [Row("a", 0, 5, 1, True)]  # b needs 3 blocks, only 1 free: c waits behind
    run_to_end(sched)
    assert (a.finish_reason, b.finish_reason, c.finish_reason) == ("length", "length", "length")


def test_no_request_is_admitted_in_a_step_that_preempted_even_one_that_would_fit():
    sched = make(num_blocks=4, block_size=2, max_batch_tokens=3, prefix_caching=False)
    a = add(sched, "a", 2, max_tokens=5)
    step(sched)
    b = add(sched, "b", 4, max_tokens=3)
    assert step(sched).rows == [Row("a", 0, 2, 1, True), Row("b", 0, 0, 2, False)]
    assert step(sched).rows == [Row("a", 0, 3, 1, True), Row("b", 0, 2, 2, True)]
    assert sched.blocks.num_free == 0
    s = step(sched)  # a needs a block: b gives back two, a takes one
    assert s.batch.preempted == [b.seq_id] and s.rows == [Row("a", 0, 4, 1, True)]
    # a chunk of b's (2 tokens, 1 block) would fit the budget and the free block, but not now
    assert sched.blocks.num_free == 1 and list(sched.waiting) == [b] and sched.running == [a]
    assert step(sched).rows == [Row("a", 0, 5, 1, True), Row("b", 0, 0, 2, False)]
    run_to_end(sched)
    assert len(b.output_token_ids) == 3 and b.num_preemptions == 1


def test_a_preempted_request_recomputes_its_prompt_and_its_generated_tokens():
    sched = make(num_blocks=4, block_size=2, prefix_caching=False)
    a, b = add(sched, "a", 4, max_tokens=3), add(sched, "b", 4, max_tokens=3)
    step(sched, token=5)
    step(sched, token=6)  # b is preempted with one generated token
    step(sched, token=7)  # a finishes
    assert a.output_token_ids == [5, 6, 7] and sched.running == [] and list(sched.waiting) == [b]
    s = step(sched, token=8)
    assert s.rows == [Row("b", 0, 0, 5, True)]  # prompt plus the token it had, in one go
    assert b.num_computed_tokens == 5 and b.output_token_ids == [5, 8]
    run_to_end(sched)
    assert b.output_token_ids == [5, 8, TOKEN] and b.num_preemptions == 1
    assert sched.counters.prompt_tokens_computed == 4 + 4 + 4  # b's prompt twice


def test_preempted_requests_resume_in_their_admission_order_before_newer_ones():
    sched = make(num_blocks=8, block_size=2, prefix_caching=False)
    a, b, c, d = (add(sched, r, 4, max_tokens=2) for r in "abcd")
    step(sched)
    assert sched.blocks.num_free == 0
    s = step(sched)  # a takes d's blocks; b takes the one a left; c then preempts itself
    assert s.batch.preempted == [d.seq_id, c.seq_id] and s.rows == [Row("a", 0, 4, 1, True), Row("b", 0, 4, 1, True)]
    assert sched.counters.preemptions == 2
    e = add(sched, "e", 4, max_tokens=1)
    assert list(sched.waiting) == [c, d, e]
    assert step(sched).rows == [Row("c", 0, 0, 5, True), Row("d", 0, 0, 5, True), Row("e", 0, 0, 4, True)]
    run_to_end(sched)
    assert all(s.finish_reason == "length" for s in (a, b, c, d, e))


# ---- prefix cache -----------------------------------------------------------------------------


def test_a_request_starts_after_the_cached_prefix_it_shares_with_an_earlier_one():
    sched = make(block_size=4)
    prompt = list(range(10))
    add(sched, "a", prompt, max_tokens=1)
    first = step(sched).batch.rows[0].block_table
    b = add(sched, "b", prompt[:8] + [100, 101, 102], max_tokens=1)
    s = step(sched)
    assert s.rows == [Row("b", 0, 8, 3, True)]
    assert s.batch.rows[0].block_table[:2] == first[:2]
    assert b.num_computed_tokens == 11
    stats = sched.blocks.prefix_stats
    assert (stats.queried_tokens, stats.hit_tokens) == (10 + 11, 8)
    assert sched.counters.prompt_tokens_computed == 10 + 3
    assert_all_free(sched)


def test_a_request_adopts_blocks_another_running_request_still_holds():
    sched = make(block_size=4)
    prompt = list(range(9))
    a = add(sched, "a", prompt, max_tokens=3)
    step(sched)
    b = add(sched, "b", prompt, max_tokens=1)
    s = step(sched)
    assert s.rows == [Row("a", 0, 9, 1, True), Row("b", 0, 8, 1, True)]
    shared = sched.blocks.table(a.seq_id)[:2]
    assert s.batch.rows[1].block_table[:2] == shared and b.is_finished
    assert [sched.blocks.ref_counts[x] for x in shared] == [1, 1]  # b gave them back when it finished
    run_to_end(sched)


# ---- forks (n > 1) ----------------------------------------------------------------------------


def test_n_samples_fork_before_the_last_prompt_token_and_copy_the_shared_partial_block():
    sched = make(block_size=4)
    first = add(sched, "r", 6, max_tokens=2, n=3)
    s = step(sched)
    assert s.rows == [Row("r", 0, 0, 5, False)] and s.batch.copies == []
    full, partial = sched.blocks.table(first.seq_id)
    s = step(sched)
    assert s.rows == [Row("r", i, 5, 1, True) for i in range(3)]
    tables = [e.block_table for e in s.batch.rows]
    # the first two samples copy the shared partial block; the last holds it alone and writes in place
    assert s.batch.copies == [(0, partial, tables[0][1]), (0, partial, tables[1][1])]
    assert tables[2] == [full, partial] and all(t[0] == full for t in tables)
    assert len({t[1] for t in tables}) == 3 and sched.blocks.ref_counts[full] == 3
    assert sched.counters.blocks_copied == 2 and sched.slots_used == 3
    assert list(sched.requests) == ["r"] and [s.output_token_ids for s in first.group] == [[TOKEN]] * 3
    run_to_end(sched)
    assert [s.finish_reason for s in first.group] == ["length"] * 3
    assert sched.counters.requests_finished == 1


def test_forking_at_a_block_boundary_copies_nothing():
    sched = make(block_size=4)
    first = add(sched, "r", 5, max_tokens=1, n=2)
    step(sched)
    (full,) = sched.blocks.table(first.seq_id)
    s = step(sched)
    assert s.rows == [Row("r", 0, 4, 1, True), Row("r", 1, 4, 1, True)] and s.batch.copies == []
    tables = [e.block_table for e in s.batch.rows]
    assert tables[0][0] == tables[1][0] == full and tables[0][1] != tables[1][1]
    assert sched.counters.blocks_copied == 0
    assert_all_free(sched)


# ---- committing a step ------------------------------------------------------------------------


def test_update_from_output_commits_tokens_frees_finished_sequences_and_counts():
    sched = make(block_size=4)
    a, b = add(sched, "a", 6, max_tokens=1), add(sched, "b", 3, max_tokens=3)
    batch = sched.schedule()
    assert [e.seq_id for e in batch.rows] == [a.seq_id, b.seq_id] and sched.blocks.num_used == 3
    assert a.num_computed_tokens == 0  # nothing is committed by schedule
    changed = sched.update_from_output(batch, FakeResult([0, 1], [11, 12], [{"lp": 1}, None]))
    sched.check_invariants()
    assert changed == [a, b]
    assert (a.num_computed_tokens, a.output_token_ids, a.logprobs) == (6, [11], [{"lp": 1}])
    assert (b.num_computed_tokens, b.output_token_ids, b.logprobs) == (3, [12], [])
    assert a.is_finished and list(sched.requests) == ["b"] and sched.running == [b]
    assert sched.blocks.num_used == 1 and sched.blocks.table(a.seq_id) == []
    c = sched.counters
    assert (c.steps, c.tokens_computed, c.prompt_tokens_computed, c.tokens_generated) == (1, 9, 9, 2)
    assert (c.requests_finished, c.requests_failed, c.requests_aborted) == (1, 0, 0)
    run_to_end(sched)


def test_update_from_output_returns_the_changed_sequences_in_batch_order():
    sched = make()
    a, b = add(sched, "a", 3, max_tokens=1), add(sched, "b", 3, max_tokens=1)
    batch = sched.schedule()
    try:
        assert sched.update_from_output(batch, FakeResult([0], [TOKEN], [None], failed=[1])) == [a, b]
    finally:
        assert_all_free(sched)


def test_a_row_with_non_finite_logits_fails_only_its_sequence_and_its_blocks_are_zeroed_next_step():
    sched = make(block_size=4)
    a, b = add(sched, "a", 5, max_tokens=3), add(sched, "b", 6, max_tokens=3)
    s = step(sched, failed=(1,))
    poisoned = s.batch.rows[1].block_table
    assert (b.finish_reason, b.error_kind) == ("error", "model") and "non-finite" in b.error
    assert b.output_token_ids == [] and "b" not in sched.requests and sched.counters.requests_failed == 1
    assert a.output_token_ids == [TOKEN] and sched.running == [a]
    assert sched.blocks.num_used == 2  # only a's
    # b's full block was cached by the commit, then withdrawn: nobody adopts it
    c = add(sched, "c", b.prompt_token_ids + [1], max_tokens=1)
    s = step(sched)
    assert sorted(s.batch.zeros) == sorted((0, b) for b in poisoned)
    assert s.rows == [Row("a", 0, 5, 1, True), Row("c", 0, 0, 7, True)] and c.is_finished
    assert step(sched).batch.zeros == []
    run_to_end(sched)


# ---- out of memory ----------------------------------------------------------------------------


def test_a_step_that_runs_out_of_memory_is_retried_with_half_the_tokens():
    sched = make(max_batch_tokens=16, block_size=4)
    seq = add(sched, "a", 20, max_tokens=1)
    batch = sched.schedule()
    assert rows_of(batch) == [Row("a", 0, 0, 16, False)]
    sched.recover_from_oom(batch, MemoryError("injected"))
    sched.check_invariants()
    assert sched.max_batch_tokens == 8 and sched.counters.oom_recoveries == 1
    assert seq.num_computed_tokens == 0 and len(sched.blocks.table(seq.seq_id)) == 4  # it keeps its blocks
    assert [step(sched).rows for _ in range(3)] == [
        [Row("a", 0, 0, 8, False)],
        [Row("a", 0, 8, 8, False)],
        [Row("a", 0, 16, 4, True)],
    ]
    assert sched.counters.prompt_tokens_computed == 20  # the failed step counted nothing
    assert_all_free(sched)


def test_a_retried_step_carries_the_failed_steps_copies_and_zeros_again():
    sched = make(block_size=4)
    add(sched, "bad", 5, max_tokens=2)
    add(sched, "r", 6, max_tokens=2, n=2)
    s = step(sched, failed=(0,))  # bad fails; r computes its prompt up to the last token
    poisoned = s.batch.rows[0].block_table
    failed = sched.schedule()  # r forks: one copy-on-write copy, plus bad's blocks to zero
    assert len(failed.copies) == 1 and sorted(failed.zeros) == sorted((0, b) for b in poisoned)
    assert failed.total_tokens == 2
    sched.recover_from_oom(failed, MemoryError("injected"))
    sched.check_invariants()
    assert sched.max_batch_tokens == 1
    s = step(sched)
    assert s.rows == [Row("r", 0, 5, 1, True)]
    assert s.batch.copies == failed.copies and s.batch.zeros == failed.zeros
    s = step(sched)  # carried once: the next step has neither
    assert s.rows == [Row("r", 0, 6, 1, True)] and s.batch.copies == [] and s.batch.zeros == []
    assert step(sched).rows == [Row("r", 1, 5, 1, True)]  # (a budget of 1: oldest first)
    assert sched.counters.blocks_copied == 1  # counted once, by the step that committed
    run_to_end(sched)


def test_a_one_token_step_that_runs_out_of_memory_raises():
    sched = make()
    add(sched, "a", 3, max_tokens=4)
    step(sched)
    batch = sched.schedule()
    assert batch.total_tokens == 1
    error = MemoryError("injected")
    with pytest.raises(MemoryError) as raised:
        sched.recover_from_oom(batch, error)
    assert raised.value is error
    assert sched.max_batch_tokens == 64 and sched.counters.oom_recoveries == 0
    assert sched.abort("a") and sched.counters.requests_aborted == 1
    assert_all_free(sched)


# ---- abort ------------------------------------------------------------------------------------


def test_abort_ends_every_sample_wherever_it_is_and_frees_every_block():
    sched = make(max_num_seqs=3, block_size=4)
    first = add(sched, "r", 6, max_tokens=5, n=3)
    waiting = add(sched, "w", 3)
    step(sched)
    step(sched)  # forked; w waits for a slot
    assert len(first.group) == 3 and sched.blocks.num_used == 4
    ended = sched.abort("r")
    sched.check_invariants()
    assert ended == first.group and [s.finish_reason for s in ended] == ["abort"] * 3
    assert "r" not in sched.requests and sched.running == [] and sched.blocks.num_used == 0
    assert sched.abort("r") == [] and sched.abort("unknown") == []
    assert sched.abort("w") == [waiting] and waiting.finish_reason == "abort" and not sched.waiting
    assert sched.counters.requests_aborted == 2 and sched.counters.requests_finished == 0
    assert_all_free(sched)


def test_abort_before_a_request_forks_frees_all_of_its_slots():
    sched = make(max_num_seqs=3, max_batch_tokens=4)
    first = add(sched, "r", 10, max_tokens=2, n=3)
    step(sched)  # a first chunk of its prompt
    assert sched.slots_used == 3 and first.num_computed_tokens == 4
    assert sched.abort("r") == [first] and first.group == [first]
    assert sched.slots_used == 0 and "r" not in sched.requests
    assert_all_free(sched)


# ---- invariants -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda s: s.waiting.append(s.running[0]), "both running and waiting"),
        (lambda s: s.running.append(s.running[0]), "queued twice"),
        (lambda s: s.running.pop(), "blocks held by requests not running"),
        (lambda s: setattr(s.running[0], "num_computed_tokens", 9), "computed 9 tokens but holds 1 blocks"),
    ],
    ids=["running-and-waiting", "running-twice", "lost", "computed-beyond-its-blocks"],
)
def test_check_invariants_catches_a_broken_queue(corrupt, message):
    sched = make(block_size=4)
    add(sched, "a", 3)
    step(sched)
    corrupt(sched)
    with pytest.raises(AssertionError, match=message):
        sched.check_invariants()
