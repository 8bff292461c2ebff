"""BlockPools: one ``BlockManager`` per kind of layer, moved together.

Gemma 3 reads a 512-token window in five layers of six, gpt-oss a 128-token one in every other
layer: if every layer kept every token, most of the cache would hold K/V no query reads again.
So each kind of layer (``ModelConfig.kv_pools``: full attention, then each window) has a pool of
its own, in tensors of their own (``KVCache``), and a sequence has a table in each. Pool 0 is
the one a context is planned against; a window's pool gives each block back once no query can
see it again (``BlockManager.drop_out_of_window``), so it needs only about a window per running
sequence (``memory.footprint.window_pool_blocks``).

Every operation the scheduler asks for happens in every pool or in none: a write is possible when
every pool has the blocks (``can_write``), a sequence is freed, forked, trimmed in all of them. A
cached prefix is adopted only as far as every pool still holds what its layers read (the full
pool: every block; a window's pool: the blocks the first recomputed token's window reaches).

Block copies and zeros name their pool: (pool, source, destination) and (pool, block).

State slots: a model whose layers keep a fixed state per sequence (``kinds.SequenceState``: a
Gated DeltaNet's) has ``state_slots`` of them, one per sequence that may run at once
(``max_num_seqs``). A sequence takes one with its first write and gives it back with its blocks
(finished, aborted, preempted: a preempted sequence recomputes from its first token, which starts
a fresh state); a forked sample takes its own and its parent's state is copied into it before the
next step (``take_state_copies``). Such a model reuses a prefix only as far as a checkpoint of
the state after it exists (``state_checkpoints``): a cached block holds K/V, not the state; the
sequence then starts from a copy of the checkpoint (``take_state_restores``).

The disk tier (``disk``, a ``DiskPrefixCache``; one full-attention pool and no states only): every
block registered is also written to disk, and a prefix's chain goes on from disk where the pool's
ends (``_adopt_from_disk``). Its files are evicted least recently used first, by the time each
was last used; a chain's blocks are stamped with its sequence's time less their index, so the
head of a chain is always evicted after its tail (a tail without its head is never looked up).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from itertools import islice
from typing import TYPE_CHECKING

from .block_manager import BlockManager, PrefixCacheStats, prefix_keys
from .state_checkpoints import StateCheckpoints

if TYPE_CHECKING:
    from .disk_prefix_cache import DiskPrefixCache


class BlockPools:
    def __init__(
        self,
        num_blocks: list[int],
        block_size: int,
        windows: tuple[int | None, ...],
        enable_prefix_caching: bool = True,
        state_slots: int = 0,
        checkpoint_slots: int = 0,
    ):
        if len(num_blocks) != len(windows):
            raise ValueError(f"{len(num_blocks)} pool sizes for {len(windows)} kinds of layer")
        enable_prefix_caching = enable_prefix_caching and (not state_slots or checkpoint_slots > 0)
        self.checkpoints = (
            StateCheckpoints(checkpoint_slots, block_size) if state_slots and enable_prefix_caching else None
        )
        self.state_restores: list[tuple[int, int]] = []  # (checkpoint, state) slots, for the next step
        self.pools = [BlockManager(n, block_size, enable_prefix_caching, w) for n, w in zip(num_blocks, windows)]
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.state_slots = state_slots
        self.free_states = list(range(state_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self.state_of: dict[int, int] = {}  # seq id -> its state slot
        self.state_copies: list[tuple[int, int]] = []  # (source, destination), for the next step
        self.disk: DiskPrefixCache | None = None  # the prefix cache's disk tier (``attach_disk``)
        self.chain_time: dict[int, int] = {}  # seq id -> when its chain was last used (ns; the disk's LRU)

    def attach_disk(self, disk: DiskPrefixCache) -> None:
        """Puts the disk tier beneath pool 0: one full-attention pool, no states (a window's
        blocks and a state's checkpoints are not kept on disk yet)."""
        if len(self.pools) > 1 or self.state_slots or self.main.window is not None:
            raise ValueError("the prefix cache's disk tier takes a model of full attention only")
        if not self.enable_prefix_caching:
            raise ValueError("the prefix cache's disk tier needs prefix caching on")
        self.disk = disk

    # ---- pool 0 speaks for the rest where one number is asked for ---------------------------

    @property
    def main(self) -> BlockManager:
        return self.pools[0]

    @property
    def num_blocks(self) -> int:
        return self.main.num_blocks

    @property
    def pool_sizes(self) -> list[int]:
        return [p.num_blocks for p in self.pools]

    @property
    def num_free(self) -> int:
        return self.main.num_free

    @property
    def num_used(self) -> int:
        return self.main.num_used

    @property
    def num_cached_free(self) -> int:
        return self.main.num_cached_free

    @property
    def ref_counts(self) -> list[int]:
        return self.main.ref_counts

    @property
    def tables(self) -> dict[int, list[int]]:
        return self.main.tables

    @property
    def prefix_stats(self) -> PrefixCacheStats:
        return self.main.prefix_stats

    def blocks_for(self, num_tokens: int) -> int:
        return self.main.blocks_for(num_tokens)

    def table(self, seq_id: int) -> list[int]:
        return self.main.table(seq_id)

    def tables_of(self, seq_id: int) -> tuple[list[int], ...]:
        """The sequence's table in each pool (copies)."""
        return tuple(list(p.table(seq_id)) for p in self.pools)

    # ---- writes, in every pool ---------------------------------------------------------------

    def blocks_to_write(self, seq_id: int, start: int, end: int) -> int:
        """Pool 0's blocks to take to write [start, end) (the admission limit counts those)."""
        return self.main.blocks_to_write(seq_id, start, end)

    def can_write(self, seq_id: int, start: int, end: int) -> bool:
        return all(p.can_write(seq_id, start, end) for p in self.pools)

    def prepare_write(self, seq_id: int, start: int, end: int) -> list[tuple[int, int, int]]:
        if not self.can_write(seq_id, start, end):
            raise RuntimeError(f"prepare_write({seq_id}): a pool has too few free blocks")
        if self.state_slots and seq_id not in self.state_of:
            self._take_state(seq_id)
        return [(i, *c) for i, p in enumerate(self.pools) for c in p.prepare_write(seq_id, start, end)]

    def state_slot(self, seq_id: int) -> int:
        """The sequence's state slot; -1 for a model without states."""
        return self.state_of.get(seq_id, -1)

    def take_state_restores(self) -> list[tuple[int, int]]:
        """The (checkpoint, state) slot copies the sequences that adopted a prefix since the last
        call owe, for the next step to make before it computes."""
        restores, self.state_restores = self.state_restores, []
        return restores

    def checkpoints_between(self, start: int, end: int, prompt: Callable[[int], list[int]], prompt_len: int):
        """The (boundary, checkpoint slot) pairs a sequence computing tokens [start, end) of a
        prompt of ``prompt_len`` tokens writes its state at (pending until the step commits);
        ``prompt(n)`` gives its first n tokens."""
        if self.checkpoints is None:
            return []
        out = []
        for b in self.checkpoints.boundaries(start, end, prompt_len):
            # the key of the block that ends at b: prefix_keys hashes every full block but the
            # last token's, so one token (never hashed) is put after the b tokens
            *_, key = prefix_keys(prompt(b) + [0], self.block_size)
            slot = self.checkpoints.take(key)
            if slot is not None:
                out.append((b, slot))
        return out

    def take_state_copies(self) -> list[tuple[int, int]]:
        """The state copies the forks since the last call owe, for the next step to make."""
        copies, self.state_copies = self.state_copies, []
        return copies

    def _take_state(self, seq_id: int) -> None:
        if not self.free_states:  # the scheduler runs at most max_num_seqs: a slot is always free
            raise RuntimeError(f"no free state slot for sequence {seq_id} ({self.state_slots} slots)")
        self.state_of[seq_id] = self.free_states.pop()

    def trim(self, seq_id: int, num_tokens: int) -> None:
        if self.state_slots:  # a state cannot be rolled back to a shorter sequence
            raise RuntimeError("a model that keeps states per sequence cannot take back tokens")
        for p in self.pools:
            p.trim(seq_id, num_tokens)

    def fork(self, parent_id: int, child_id: int) -> None:
        for p in self.pools:
            p.fork(parent_id, child_id)
        if parent_id in self.chain_time:
            self.chain_time[child_id] = self.chain_time[parent_id]
        if self.state_slots:
            self._take_state(child_id)
            self.state_copies.append((self.state_of[parent_id], self.state_of[child_id]))

    def free(self, seq_id: int) -> None:
        self.chain_time.pop(seq_id, None)
        for p in self.pools:
            p.free(seq_id)
        slot = self.state_of.pop(seq_id, None)
        if slot is not None:
            self.free_states.append(slot)
            self.state_restores = [r for r in self.state_restores if r[1] != slot]  # not owed any more

    def drop_out_of_window(self, seq_id: int, next_position: int) -> None:
        for p in self.pools:
            p.drop_out_of_window(seq_id, next_position)

    # ---- the prefix cache ----------------------------------------------------------------------

    def adopt_prefix(self, seq_id: int, tokens: list[int]) -> int:
        """The longest prefix of ``tokens`` every pool can serve: see the module docstring."""
        if not self.enable_prefix_caching or self.main.tables.get(seq_id):
            return 0
        keys = self.main.lookup_keys(tokens)  # pool 0's chain bounds every pool's prefix
        found = [p.cached_blocks(keys) for p in self.pools]
        n, checkpoint = len(keys), None
        while True:  # a shorter prefix may need window blocks another pool lacks: to a fixed point
            shorter = min(p.longest_prefix(f, n) for p, f in zip(self.pools, found))
            if self.checkpoints is not None:  # and a state after it
                while shorter and (checkpoint := self.checkpoints.find(keys[shorter - 1])) is None:
                    shorter -= 1
            if shorter == n:
                break
            n = shorter
        for p, f in zip(self.pools, found):
            p.adopt(seq_id, keys, f, n)
        if self.disk is not None:
            now = self.chain_time[seq_id] = time.time_ns()
            self.disk.touch([k[0] for k in keys[:n]], now)
            n = self._adopt_from_disk(seq_id, tokens, n, now)
        if n and checkpoint is not None and self.checkpoints is not None:
            self._take_state(seq_id)
            self.state_restores.append((checkpoint, self.state_of[seq_id]))
            self.checkpoints.stats.hits += 1
            self.checkpoints.stats.hit_tokens += n * self.block_size
        return n * self.block_size

    def read_ahead(self, tokens: list[int]) -> None:
        """A request entered the queue: the disk tier starts reading its prompt's blocks into the
        OS's page cache while steps run, so its admission reads them from RAM."""
        assert self.disk is not None
        self.disk.read_ahead([key[0] for key in prefix_keys(tokens, self.block_size)])

    def _adopt_from_disk(self, seq_id: int, tokens: list[int], n: int, now: int) -> int:
        """The chain of ``tokens``' blocks past the ``n`` the pool had, read from the disk tier
        while its next block is there, reads back whole and a block is free. Returns the blocks
        the sequence holds now."""
        assert self.disk is not None
        disk, first = self.disk, n
        for key in islice(prefix_keys(tokens, self.block_size), n, None):
            if self.main.cached_blocks([key])[0] is not None or not disk.contains(key[0]):
                break  # (a block the pool has past a miss: rare, the chain stops)
            if not self.main.adopt_filled(seq_id, key, partial(disk.load, key[0], used_ns=now - n)):
                break  # (stamped: the chain's head the most recently used, evicted last)
            n += 1
        if n == first and (len(tokens) - 1) // self.block_size > first:
            disk.stats.misses += 1
        return n

    def count_admission(self, num_tokens: int, reused: int) -> None:
        self.main.count_admission(num_tokens, reused)

    def register_computed(self, seq_id: int, tokens_between, num_computed: int) -> None:
        """Registers the blocks that filled up (and writes them to the disk tier), then gives
        back those out of every window."""
        for i, p in enumerate(self.pools):
            registered = p.register_computed(seq_id, tokens_between, num_computed)
            if i == 0 and self.disk is not None and registered:
                used = self.chain_time.setdefault(seq_id, time.time_ns())
                for index, block, block_hash in registered:
                    self.disk.store(block_hash, block, used - index)
            p.drop_out_of_window(seq_id, num_computed)

    def release_poisoned(self, seq_id: int) -> list[tuple[int, int]]:
        return [(i, b) for i, p in enumerate(self.pools) for b in p.release_poisoned(seq_id)]

    # ---- resizing ------------------------------------------------------------------------------

    def over(self, sizes: list[int]) -> bool:
        """Whether some pool uses more blocks than ``sizes`` allows it."""
        return any(p.num_used > n for p, n in zip(self.pools, sizes))

    def resize(self, sizes: list[int]) -> list[tuple[int, int, int]]:
        return [(i, *m) for i, (p, n) in enumerate(zip(self.pools, sizes)) for m in p.resize(n)]

    def compact(self, keep_cached: bool) -> tuple[list[tuple[int, int, int]], list[int]]:
        """Every pool's ``compact``: the moves, and the blocks each pool kept."""
        moves, kept = [], []
        for i, p in enumerate(self.pools):
            m, end = p.compact(keep_cached)
            moves += [(i, *x) for x in m]
            kept.append(end)
        return moves, kept

    def check_invariants(self) -> None:
        for p in self.pools:
            p.check_invariants()
        if len({frozenset(p.tables) for p in self.pools}) > 1:
            raise AssertionError("the pools' tables are for different sequences")
        if self.checkpoints is not None:
            self.checkpoints.check_invariants()
        held = list(self.state_of.values())
        if len(set(held)) != len(held) or set(held) & set(self.free_states):
            raise AssertionError(f"a state slot is held twice or held and free: {self.state_of}, {self.free_states}")
        if len(held) + len(self.free_states) != self.state_slots:
            raise AssertionError("state slots lost")
