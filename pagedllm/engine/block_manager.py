"""BlockManager: owns the free list, per-block reference counts, every sequence's block table,
and the prefix cache.

A block is taken only when a sequence's next token needs one, and all of a sequence's blocks go
back the moment it finishes, is aborted or is preempted.

Prefix cache: a full block is known by a hash of (its parent block's hash, its token ids), so a
chain of hashes names a prefix. The hash is a digest of bytes (``chain_hash``), the same in every
process: the disk tier (``disk_prefix_cache``) names its files by it. A block whose tokens are
all computed is registered under its hash; a new request adopts the longest chain of registered
blocks of its tokens (reference counts go up, nothing is recomputed). A registered block whose
count drops to zero is not forgotten: it waits, least recently used first, and is evicted only
when a block is needed and none is plainly free. A block in use is never evicted, and a sequence
only ever writes past what it has computed, so shared (full, computed) blocks are never
overwritten.

Forks (parallel sampling): a forked sequence starts with its parent's table, every block's
count one higher. Full blocks are then read-only for both; the partially filled last block is
the one either would write next, so the first write into a block that others still hold goes
to a private copy (copy-on-write): ``prepare_write`` takes a fresh block and returns the
(source, destination) pair for the runner to copy before the step computes anything.

Windows: the pool of sliding-window layers (``window`` set; ``block_pools.BlockPools`` holds one
per kind of layer) gives a block back as soon as every query still to come is past its window
(``drop_out_of_window``); the table keeps its place with ``HOLE``, so a table's index is still a
block of positions. A dropped block that the prefix cache registered waits in it like any other.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ..sizes import ceil_div

HOLE = -1  # a table entry whose block went back to the pool (out of every query's window)


@dataclass
class PrefixCacheStats:
    queried_tokens: int = 0  # tokens looked up at admission
    hit_tokens: int = 0  # of which served from cached blocks
    evictions: int = 0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, window: int | None = None):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.window = window  # the layers' sliding window (tokens); None: they see the whole context
        self.enable_prefix_caching = enable_prefix_caching
        # A stack: the most recently freed block is reused first, so a cache allocated lazily
        # touches (and costs RAM for) only as many blocks as were ever in use at once.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unused; oldest first
        self.ref_counts = [0] * num_blocks
        self.tables: dict[int, list[int]] = {}  # sequence id -> its blocks, in order
        self._block_key: dict[int, tuple] = {}  # registered block -> (hash, parent hash, tokens)
        self._by_hash: dict[bytes, int] = {}  # hash -> registered block
        self._hashed: dict[int, tuple[int, bytes | None]] = {}  # seq -> (blocks registered, last hash)
        self.prefix_stats = PrefixCacheStats()

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now: plainly free, or cached and unused (evictable)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached_free(self) -> int:
        return len(self._evictable)

    def blocks_for(self, num_tokens: int) -> int:
        return ceil_div(num_tokens, self.block_size)

    def table(self, seq_id: int) -> list[int]:
        return self.tables.get(seq_id, [])

    def blocks_needed(self, seq_id: int, num_tokens: int) -> int:
        """Blocks ``seq_id`` still has to take to hold ``num_tokens`` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(self.table(seq_id)))

    def blocks_to_write(self, seq_id: int, start: int, end: int) -> int:
        """Blocks a sequence must take to write tokens [start, end): new ones past its table,
        plus a private copy of a shared block it would write into."""
        return self.blocks_needed(seq_id, end) + (self._shared_block_at(seq_id, start) is not None)

    def can_write(self, seq_id: int, start: int, end: int) -> bool:
        return self.blocks_to_write(seq_id, start, end) <= self.num_free

    def prepare_write(self, seq_id: int, start: int, end: int) -> list[tuple[int, int]]:
        """Makes tokens [start, end) writable: copies a shared block on first write, appends
        the blocks still missing. Returns the (source, destination) block copies to perform."""
        i, grow = self._shared_block_at(seq_id, start), self.blocks_needed(seq_id, end)
        if grow + (i is not None) > self.num_free:
            raise RuntimeError(f"prepare_write({seq_id}): needs {grow + (i is not None)} blocks, {self.num_free} free")
        copies = []
        table = self.tables.setdefault(seq_id, [])
        if i is not None:
            shared, private = table[i], self._take()
            self.ref_counts[shared] -= 1  # others still hold it: it stays owned
            self.ref_counts[private] = 1
            table[i] = private
            copies.append((shared, private))
        for _ in range(grow):
            block = self._take()
            self.ref_counts[block] = 1
            table.append(block)
        return copies

    def trim(self, seq_id: int, num_tokens: int) -> None:
        """Gives back the blocks past the first ``num_tokens`` tokens' (taken for speculative
        guesses that were rejected: private, never registered)."""
        table = self.tables.get(seq_id, [])
        keep = self.blocks_for(num_tokens)
        while len(table) > keep:
            block = table.pop()
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] == 0 and block not in self._block_key, "trimmed a shared block"
            self._free.append(block)

    def _shared_block_at(self, seq_id: int, position: int) -> int | None:
        """Index in the table of the block holding ``position`` if others hold it too."""
        table, i = self.table(seq_id), position // self.block_size
        return i if i < len(table) and table[i] != HOLE and self.ref_counts[table[i]] > 1 else None

    def fork(self, parent_id: int, child_id: int) -> None:
        """Gives ``child_id`` the parent's blocks (shared, counted), and its prefix-cache place."""
        table = list(self.table(parent_id))
        for block in table:
            if block != HOLE:
                self.ref_counts[block] += 1
        self.tables[child_id] = table
        if parent_id in self._hashed:
            self._hashed[child_id] = self._hashed[parent_id]

    def _take(self) -> int:
        if self._free:
            return self._free.pop()
        block, _ = self._evictable.popitem(last=False)  # least recently used
        key = self._block_key.pop(block)
        del self._by_hash[key[0]]
        self.prefix_stats.evictions += 1
        return block

    def free(self, seq_id: int) -> None:
        self._hashed.pop(seq_id, None)
        # Last block first: a prefix is looked up from its first block, so the tail of a cached
        # prompt must be evicted before its head, or one eviction would orphan the whole chain.
        for block in reversed(self.tables.pop(seq_id, [])):
            if block != HOLE:
                self._release(block)

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            if block in self._block_key:
                self._evictable[block] = None  # most recently used end
            else:
                self._free.append(block)

    def drop_out_of_window(self, seq_id: int, next_position: int) -> None:
        """Gives back the blocks no query from ``next_position`` on can see (a query at p sees
        keys after p - window); a no-op without a window."""
        if self.window is None:
            return
        table = self.tables.get(seq_id, [])
        # the holes are a prefix of the table: walk back from the last block to go until one
        i = min(len(table), self.first_visible_block(next_position)) - 1
        while i >= 0 and table[i] != HOLE:
            self._release(table[i])
            table[i] = HOLE
            i -= 1

    def first_visible_block(self, position: int) -> int:
        """The first block a query at ``position`` reads."""
        return 0 if self.window is None else max(0, position - self.window + 1) // self.block_size

    # ---- prefix cache -------------------------------------------------------------------------

    def adopt_prefix(self, seq_id: int, tokens: list[int]) -> int:
        """Gives a sequence with no blocks the longest chain of cached blocks of ``tokens``,
        leaving at least the last token to compute (its logits are needed). Returns the number
        of tokens covered. (One pool alone; ``BlockPools.adopt_prefix`` for several.)"""
        if not self.enable_prefix_caching or self.tables.get(seq_id):
            return 0
        keys = self.lookup_keys(tokens)
        found = self.cached_blocks(keys)
        n = self.longest_prefix(found, len(keys))
        self.adopt(seq_id, keys, found, n)
        return n * self.block_size

    def lookup_keys(self, tokens: list[int]) -> list[tuple]:
        """The keys of ``tokens``' blocks worth looking up here: for a full pool, up to its first
        miss (a prefix is a chain); a window's pool may hold a later run, so all of them."""
        keys = []
        for key in prefix_keys(tokens, self.block_size):
            if self.window is None and self.cached_blocks([key])[0] is None:
                break
            keys.append(key)
        return keys

    def cached_blocks(self, keys: list[tuple]) -> list[int | None]:
        """The registered block of each (hash, parent, tokens) key, None where there is none."""
        found: list[int | None] = []
        for key in keys:
            block = self._by_hash.get(key[0])
            found.append(block if block is not None and self._block_key[block][1:] == key[1:] else None)
        return found

    def longest_prefix(self, found: list[int | None], most: int) -> int:
        """The most blocks, at most ``most``, a sequence can adopt here: a window's pool needs only
        the blocks the first computed token's query reads."""
        n = min(most, found.index(None) if None in found else len(found))
        if self.window is None:
            return n
        n = min(most, len(found))
        while n and None in found[self.first_visible_block(n * self.block_size) : n]:
            n -= 1
        return n

    def adopt(self, seq_id: int, keys: list[tuple], found: list[int | None], n: int) -> None:
        """Gives ``seq_id`` the cached blocks of its first ``n`` blocks (``found``), holes where
        no query will read (a window's pool)."""
        if not n:
            return
        first = self.first_visible_block(n * self.block_size)
        table = [HOLE] * first
        for block in found[first:n]:
            assert block is not None
            if self.ref_counts[block] == 0:
                del self._evictable[block]
            self.ref_counts[block] += 1
            table.append(block)
        self.tables[seq_id] = table
        self._hashed[seq_id] = (n, keys[n - 1][0])

    def count_admission(self, num_tokens: int, reused: int) -> None:
        """Hit-rate bookkeeping, once per admitted request (a lookup that could not be admitted
        yet is repeated later and must not count twice)."""
        if self.enable_prefix_caching:
            self.prefix_stats.queried_tokens += num_tokens
            self.prefix_stats.hit_tokens += reused

    def register_computed(self, seq_id: int, tokens_between, num_computed: int) -> list[tuple[int, int, bytes]]:
        """Registers the sequence's blocks that became full and computed, so others can adopt
        them. ``tokens_between(start, end)`` gives the sequence's token ids (asked only when a
        block has filled up). Returns the (index in its table, block, hash) of each registered now."""
        if not self.enable_prefix_caching:
            return []
        bs, table = self.block_size, self.tables.get(seq_id, [])
        done, parent = self._hashed.get(seq_id, (0, None))
        full = min(num_computed // bs, len(table))
        registered = []
        for i in range(done, full):
            chunk = tuple(tokens_between(i * bs, (i + 1) * bs))
            h = chain_hash(parent, chunk)
            block = table[i]
            if block != HOLE and h not in self._by_hash and block not in self._block_key:
                self._by_hash[h] = block
                self._block_key[block] = (h, parent, chunk)
                registered.append((i, block, h))
            parent = h
        self._hashed[seq_id] = (max(done, full), parent)
        return registered

    def adopt_filled(self, seq_id: int, key: tuple, fill: Callable[[int], bool]) -> bool:
        """Appends to a sequence's table a block whose K/V ``fill(block)`` writes (read back from
        the disk tier), registered under ``key`` as a computed block is; the sequence's blocks so
        far must be the chain up to ``key``'s parent. False (and nothing taken) where no block is
        free or ``fill`` could not fill it."""
        if not self.num_free:
            return False
        block = self._take()
        if not fill(block):
            self._free.append(block)
            return False
        self.ref_counts[block] = 1
        table = self.tables.setdefault(seq_id, [])
        table.append(block)
        self._by_hash[key[0]] = block
        self._block_key[block] = key
        self._hashed[seq_id] = (len(table), key[0])
        return True

    def release_poisoned(self, seq_id: int) -> list[int]:
        """For a sequence whose K/V may hold NaN/inf: unregisters the blocks only it holds from
        the prefix cache (no one may adopt them) and returns them, for the caller to zero before
        they are freed. Stale values are read (masked) by the block's next owner, and a masked
        NaN still poisons ``probs @ V``: 0 x NaN is NaN."""
        own = [b for b in self.table(seq_id) if b != HOLE and self.ref_counts[b] == 1]
        for block in own:
            key = self._block_key.pop(block, None)
            if key is not None:
                del self._by_hash[key[0]]
        return own

    # ---- resizing -----------------------------------------------------------------------------

    def resize(self, num_blocks: int) -> list[tuple[int, int]]:
        """Blocks [0, num_blocks) from now on; returns the (source, destination) moves of live
        blocks that sat past the new end, for the caller to copy before anything reads them.

        Growing adds the new blocks under the free stack (handed out after the blocks that were
        already touched). Shrinking forgets the free blocks past the end, evicts the cached
        unused ones there from the prefix cache, and moves each live one into a block below the
        end: its reference count, its place in every table that holds it (forks share blocks)
        and its prefix-cache registration go with it. The caller must first have freed enough
        (``num_used <= num_blocks``): shrinking never preempts by itself."""
        old = self.num_blocks
        if num_blocks >= old:
            self._free[:0] = range(num_blocks - 1, old - 1, -1)
            self.ref_counts += [0] * (num_blocks - old)
            self.num_blocks = num_blocks
            return []
        if self.num_used > num_blocks:
            raise RuntimeError(f"resize to {num_blocks} blocks: {self.num_used} are in use")
        for block in [b for b in self._evictable if b >= num_blocks]:
            del self._evictable[block]
            del self._by_hash[self._block_key.pop(block)[0]]
            self.prefix_stats.evictions += 1
        self._free = [b for b in self._free if b < num_blocks]
        moved = {}
        for source in range(num_blocks, old):
            if self.ref_counts[source]:
                destination = self._take()  # below the end now: the free list and cache hold no other
                self.ref_counts[destination] = self.ref_counts[source]
                key = self._block_key.pop(source, None)
                if key is not None:
                    self._block_key[destination] = key
                    self._by_hash[key[0]] = destination
                moved[source] = destination
        for table in self.tables.values():
            table[:] = [moved.get(b, b) for b in table]
        del self.ref_counts[num_blocks:]
        self.num_blocks = num_blocks
        return list(moved.items())

    def compact(self, keep_cached: bool) -> tuple[list[tuple[int, int]], int]:
        """With no block held by a sequence: the prefix cache's blocks moved to the bottom of the
        cache (their order of eviction kept), or all evicted (``keep_cached=False``). Returns the
        (source, destination) moves and the number of blocks kept; the free stack then hands out
        the lowest block first."""
        if self.tables:
            raise RuntimeError(f"compact: {len(self.tables)} sequences hold blocks")
        if not keep_cached:
            self.prefix_stats.evictions += len(self._evictable)
            self._evictable.clear()
            self._block_key.clear()
            self._by_hash.clear()
        end = len(self._evictable)
        holes = [b for b in range(end) if b not in self._evictable]
        moved = {}
        for source in [b for b in self._evictable if b >= end]:
            destination = moved[source] = holes.pop()
            key = self._block_key.pop(source)
            self._block_key[destination] = key
            self._by_hash[key[0]] = destination
        self._evictable = OrderedDict((moved.get(b, b), None) for b in self._evictable)
        self._free = list(range(self.num_blocks - 1, end - 1, -1))
        return list(moved.items()), end

    # ---- checks -------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Every block is exactly one of: plainly free (count 0, unregistered), cached and unused
        (count 0, registered), or owned (count = number of tables holding it)."""
        owners = [0] * self.num_blocks
        for table in self.tables.values():
            for b in table:
                if b != HOLE:
                    owners[b] += 1
        free, evictable = set(self._free), set(self._evictable)
        if len(free) != len(self._free):
            raise AssertionError("a block is on the free list twice")
        if free & evictable:
            raise AssertionError(f"blocks both free and cached-free: {sorted(free & evictable)}")
        for b in range(self.num_blocks):
            idle = b in free or b in evictable
            if idle != (owners[b] == 0) or self.ref_counts[b] != owners[b]:
                raise AssertionError(
                    f"block {b}: free={b in free}, cached-free={b in evictable}, owners={owners[b]}, "
                    f"ref_count={self.ref_counts[b]}"
                )
            if b in free and b in self._block_key:
                raise AssertionError(f"block {b} is plainly free but still registered")
            if b in evictable and b not in self._block_key:
                raise AssertionError(f"block {b} is cached-free but not registered")
        for h, b in self._by_hash.items():
            if self._block_key.get(b, (None,))[0] != h:
                raise AssertionError(f"hash table and block {b} disagree")


def prefix_keys(tokens: list[int], block_size: int) -> Iterator[tuple]:
    """(hash, parent hash, tokens) of each full block of ``tokens`` but the last token's (its
    logits are needed, so it is always computed): the chain a prefix is looked up by. Made one
    at a time: a lookup stops at its first miss."""
    parent: bytes | None = None
    for i in range((len(tokens) - 1) // block_size):
        chunk = tuple(tokens[i * block_size : (i + 1) * block_size])
        h = chain_hash(parent, chunk)
        yield h, parent, chunk
        parent = h


def chain_hash(parent: bytes | None, chunk: tuple[int, ...]) -> bytes:
    """A block's hash: a digest of its parent's hash and its token ids, so a hash names the whole
    prefix up to the block. Bytes, not Python's ``hash``: that of None (a first block's parent)
    differs between processes before Python 3.12, and the disk tier's files outlive a process."""
    return hashlib.blake2b((parent or b"") + array("q", chunk).tobytes(), digest_size=16).digest()
