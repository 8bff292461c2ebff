"""BlockManager alone, no model: blocks are taken only when a write needs them and all come
back, shared blocks are counted, prefixes are cached and adopted, cached blocks are evicted least
recently used and only when needed, forks copy a shared block on first write, and the invariant
checker notices a corrupted state. Every test that does not corrupt the state on purpose ends
with every block free."""

import pytest

from pagedllm.engine.block_manager import BlockManager

A, B, C, D, P, W, X, Y, Z = range(9)  # sequence ids


def compute(bm: BlockManager, seq_id: int, tokens: list[int], start: int = 0) -> list[tuple[int, int]]:
    """What one step does for a sequence: makes tokens [start, len) writable, then counts them as
    computed (full blocks become prefixes others can adopt). Returns the copies to perform."""
    copies = bm.prepare_write(seq_id, start, len(tokens))
    bm.register_computed(seq_id, lambda s, e: tokens[s:e], len(tokens))
    bm.check_invariants()
    return copies


def free_all(bm: BlockManager) -> None:
    for seq_id in list(bm.tables):
        bm.free(seq_id)
    bm.check_invariants()
    assert bm.num_free == bm.num_blocks and bm.num_used == 0
    assert bm.ref_counts == [0] * bm.num_blocks and bm.tables == {}


def test_a_block_is_taken_only_when_a_write_reaches_it():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.blocks_to_write(A, 0, 1) == 1 and bm.can_write(A, 0, 1)
    assert bm.prepare_write(A, 0, 1) == []
    assert len(bm.table(A)) == 1 and bm.num_free == 7
    # the rest of the first block is already there
    assert bm.blocks_to_write(A, 1, 4) == 0
    assert bm.prepare_write(A, 1, 4) == [] and len(bm.table(A)) == 1 and bm.num_free == 7
    # positions 4..8 reach two new blocks
    assert bm.blocks_to_write(A, 4, 9) == 2
    bm.prepare_write(A, 4, 9)
    assert len(bm.table(A)) == 3 and bm.num_free == 5 and bm.num_used == 3
    bm.check_invariants()
    # a write that does not fit is refused and takes nothing
    assert bm.blocks_to_write(B, 0, 21) == 6 and not bm.can_write(B, 0, 21)
    with pytest.raises(RuntimeError, match="needs 6 blocks, 5 free"):
        bm.prepare_write(B, 0, 21)
    assert B not in bm.tables and bm.num_free == 5
    free_all(bm)


def test_freeing_returns_every_block_and_the_last_freed_is_reused_first():
    bm = BlockManager(num_blocks=6, block_size=2, enable_prefix_caching=False)
    bm.prepare_write(A, 0, 4)
    bm.prepare_write(B, 0, 2)
    assert bm.table(A) == [0, 1] and bm.table(B) == [2]
    bm.free(A)
    bm.free(B)
    assert bm.num_free == 6 and bm.ref_counts == [0] * 6 and bm.table(A) == []
    bm.prepare_write(C, 0, 2)
    assert bm.table(C) == [2]  # b's: freed last, reused first
    bm.prepare_write(D, 0, 4)
    assert sorted(bm.table(D)) == [0, 1]  # then a's, before any never-used block
    free_all(bm)


def test_freeing_a_shared_block_only_drops_a_reference():
    bm = BlockManager(num_blocks=6, block_size=4)
    compute(bm, P, list(range(6)))
    bm.fork(P, C)
    blocks = bm.table(P)
    assert bm.table(C) == blocks and [bm.ref_counts[b] for b in blocks] == [2, 2]
    bm.free(P)
    bm.check_invariants()
    assert bm.table(C) == blocks and [bm.ref_counts[b] for b in blocks] == [1, 1]
    assert bm.num_free == 4
    free_all(bm)


def test_a_computed_prefix_is_adopted_by_a_request_that_starts_with_it():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = list(range(10))
    compute(bm, A, a)  # blocks 0 and 1 full, block 2 holds two tokens
    b = a[:8] + [100, 101, 102]
    assert bm.adopt_prefix(B, b) == 8
    bm.check_invariants()
    assert bm.table(B) == bm.table(A)[:2]
    assert [bm.ref_counts[x] for x in bm.table(A)] == [2, 2, 1]
    # adopting takes no new block, and a sequence that already has blocks adopts nothing
    assert bm.num_free == 5 and bm.adopt_prefix(B, b) == 0
    compute(bm, B, b, start=8)
    assert bm.table(B)[:2] == bm.table(A)[:2] and len(bm.table(B)) == 3
    free_all(bm)


def test_adoption_always_leaves_the_last_token_to_compute():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = list(range(8))
    compute(bm, A, a)
    bm.free(A)
    assert bm.adopt_prefix(X, a) == 4  # two cached blocks, but the 8th token's logits are needed
    assert bm.adopt_prefix(Y, a + [50]) == 8
    bm.check_invariants()
    free_all(bm)


def test_a_different_token_in_an_earlier_block_breaks_the_chain():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = list(range(12))
    compute(bm, A, a + [12])
    in_first_block = [99] + a[1:] + [12]
    in_second_block = a[:5] + [99] + a[6:] + [12]
    assert bm.adopt_prefix(X, in_first_block) == 0  # the third block alone matches, but its parent differs
    assert bm.adopt_prefix(Y, in_second_block) == 4
    assert bm.adopt_prefix(Z, a + [12]) == 12
    free_all(bm)


def test_only_blocks_that_are_full_and_computed_are_adopted():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = list(range(10))
    bm.prepare_write(A, 0, 10)
    bm.register_computed(A, lambda s, e: a[s:e], 6)  # tokens 6..10 written but not yet computed
    assert bm.adopt_prefix(B, a + [1]) == 4
    bm.free(B)
    bm.register_computed(A, lambda s, e: a[s:e], 10)
    assert bm.adopt_prefix(C, a + [1]) == 8
    free_all(bm)


def test_cached_blocks_count_as_free_and_are_evicted_only_when_no_plain_free_block_is_left():
    bm = BlockManager(num_blocks=4, block_size=2)
    compute(bm, A, [1, 2, 3, 4])
    bm.free(A)
    assert bm.num_free == 4 and bm.num_cached_free == 2 and bm.num_used == 0
    bm.prepare_write(X, 0, 4)  # the two plain free blocks
    assert bm.prefix_stats.evictions == 0 and bm.num_cached_free == 2
    assert set(bm.table(X)).isdisjoint({0, 1})
    bm.prepare_write(Y, 0, 2)
    assert bm.prefix_stats.evictions == 1 and bm.num_cached_free == 1
    bm.prepare_write(Z, 0, 2)
    assert bm.prefix_stats.evictions == 2 and bm.num_free == 0 and not bm.can_write(W, 0, 1)
    assert bm.adopt_prefix(W, [1, 2, 3, 4, 5]) == 0
    bm.check_invariants()
    free_all(bm)


def test_the_least_recently_used_cached_block_is_evicted_first():
    bm = BlockManager(num_blocks=4, block_size=2)
    for seq_id, prompt in ((A, [1, 2]), (B, [3, 4]), (C, [5, 6])):
        compute(bm, seq_id, prompt)
        bm.free(seq_id)
    # a was cached first, but is used again: b is now the least recently used
    assert bm.adopt_prefix(D, [1, 2, 9]) == 2
    bm.free(D)
    bm.prepare_write(X, 0, 4)  # the plain free block, then one eviction
    assert bm.prefix_stats.evictions == 1
    assert bm.adopt_prefix(A, [1, 2, 9]) == 2  # FIFO (oldest cached first) would evict this
    assert bm.adopt_prefix(B, [3, 4, 9]) == 0
    assert bm.adopt_prefix(C, [5, 6, 9]) == 2
    free_all(bm)


def test_evicting_one_block_of_a_cached_prompt_keeps_the_rest_of_its_prefix():
    bm = BlockManager(num_blocks=4, block_size=2)
    prompt = [1, 2, 3, 4, 5, 6, 7]
    compute(bm, A, prompt)  # three full cached blocks and a partial one
    bm.free(A)
    bm.prepare_write(X, 0, 3)  # the partial block's, then one eviction
    assert bm.prefix_stats.evictions == 1
    try:
        assert bm.adopt_prefix(B, prompt) == 4  # the first two blocks are still cached
    finally:
        free_all(bm)


def test_with_prefix_caching_off_nothing_is_kept_adopted_or_counted():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    prompt = [1, 2, 3, 4, 5]
    compute(bm, A, prompt)
    bm.free(A)
    assert bm.num_cached_free == 0 and bm.num_free == 4
    assert bm.adopt_prefix(B, prompt) == 0 and bm.table(B) == []
    bm.count_admission(5, 0)
    assert (bm.prefix_stats.queried_tokens, bm.prefix_stats.hit_tokens) == (0, 0)
    free_all(bm)


def test_count_admission_reports_the_share_of_prompt_tokens_served_from_the_cache():
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.count_admission(10, 8)
    bm.count_admission(6, 0)
    assert (bm.prefix_stats.queried_tokens, bm.prefix_stats.hit_tokens) == (16, 8)
    free_all(bm)


def test_a_fork_shares_every_block_and_the_first_write_into_the_partial_one_copies_it():
    bm = BlockManager(num_blocks=8, block_size=4)
    prompt = list(range(7))
    compute(bm, P, prompt[:6])  # blocks [full, partial (2 of 4)]
    full, partial = bm.table(P)
    bm.fork(P, C)
    assert bm.table(C) == [full, partial] and bm.ref_counts[full] == bm.ref_counts[partial] == 2
    assert bm.blocks_to_write(C, 6, 7) == 1
    copies = bm.prepare_write(C, 6, 7)
    bm.check_invariants()
    private = bm.table(C)[1]
    assert copies == [(partial, private)] and private not in (full, partial)
    assert bm.table(C) == [full, private]
    assert (bm.ref_counts[full], bm.ref_counts[partial], bm.ref_counts[private]) == (2, 1, 1)
    # the parent now holds the partial block alone: it writes in place
    assert bm.blocks_to_write(P, 6, 7) == 0 and bm.prepare_write(P, 6, 7) == []
    assert bm.table(P) == [full, partial]
    free_all(bm)


def test_a_write_into_a_shared_partial_block_and_beyond_copies_it_and_grows():
    bm = BlockManager(num_blocks=8, block_size=4)
    compute(bm, P, list(range(6)))
    bm.fork(P, C)
    assert bm.blocks_to_write(C, 6, 13) == 3  # a copy plus two new blocks
    copies = bm.prepare_write(C, 6, 13)
    assert len(copies) == 1 and copies[0][0] == bm.table(P)[1] and copies[0][1] == bm.table(C)[1]
    assert len(bm.table(C)) == 4 and bm.num_free == 8 - 2 - 3
    bm.check_invariants()
    free_all(bm)


def test_full_shared_blocks_are_never_copied():
    bm = BlockManager(num_blocks=8, block_size=4)
    compute(bm, P, list(range(8)))
    bm.fork(P, C)
    assert bm.blocks_to_write(C, 8, 9) == 1  # a new block, not a copy
    assert bm.prepare_write(C, 8, 9) == []
    assert bm.table(C)[:2] == bm.table(P) and [bm.ref_counts[b] for b in bm.table(P)] == [2, 2]
    free_all(bm)


def test_a_poisoned_sequence_unregisters_only_the_blocks_it_holds_alone():
    bm = BlockManager(num_blocks=8, block_size=2)
    tokens = [1, 2, 3, 4, 5, 6]
    compute(bm, P, tokens[:4])  # two full cached blocks
    bm.fork(P, C)
    compute(bm, C, tokens, start=4)  # c's own third block, full and cached
    own = bm.table(C)[2]
    assert bm.release_poisoned(C) == [own]
    bm.free(C)
    bm.check_invariants()
    # the shared blocks stay cached; c's own block went to the plain free list, not the cache
    assert bm.num_cached_free == 0 and own in bm._free
    assert bm.adopt_prefix(X, tokens + [7]) == 4
    free_all(bm)


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda bm: bm._free.append(bm.table(A)[0]), "free=True, cached-free=False, owners=1"),
        (lambda bm: bm._free.append(bm._free[-1]), "free list twice"),
        (lambda bm: bm.ref_counts.__setitem__(bm.table(A)[0], 2), "ref_count=2"),
        (lambda bm: bm.tables.pop(A), "owners=0"),  # a leak: counted but held by no one
        (lambda bm: bm._evictable.__setitem__(bm._free[-1], None), "both free and cached-free"),
    ],
    ids=["free-and-owned", "free-twice", "wrong-count", "leak", "free-and-cached"],
)
def test_check_invariants_catches_a_corrupted_state(corrupt, message):
    bm = BlockManager(num_blocks=4, block_size=2)
    compute(bm, A, [1, 2, 3])
    corrupt(bm)
    with pytest.raises(AssertionError, match=message):
        bm.check_invariants()
