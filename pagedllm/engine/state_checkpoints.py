"""Where a prefix's recurrent state is kept, so that a later request can start after the prefix.

A model whose layers keep a state per sequence (Qwen3.5's Gated DeltaNet) cannot reuse cached
K/V blocks alone: the state after the prefix is needed too, and it cannot be rebuilt from the
blocks. So while a prompt is computed, its state is copied at some block boundaries into
checkpoint slots (a pool of its own, planned beside the states: ``memory.costs``), each slot
known by the prefix-cache key of the block that ends there (``block_manager.prefix_keys``: the
chain of hashes and tokens up to it). Which boundaries (``boundaries``): every
``INTERVAL_TOKENS`` of the prompt (a request sharing a long system prompt with another finds one
within that many tokens of where they part) and the prompt's last boundaries (a request that
repeats or extends the prompt, as a conversation's next turn does). No block is inflated: the
attention layers keep their 16-token blocks, and a hit reuses the longest prefix for which both
the blocks and a checkpoint exist.

A checkpoint is written during the step that computes its boundary, so it is *pending* until that
step succeeds (``commit``); a failed step's are dropped (``drop_pending``). The pool is evicted
least recently used first when a new checkpoint needs a slot.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

INTERVAL_TOKENS = 256  # a checkpoint every this many prompt tokens (rounded down to whole blocks)


@dataclass
class CheckpointStats:
    taken: int = 0  # checkpoints written
    hits: int = 0  # requests that started from one
    hit_tokens: int = 0  # prompt tokens those requests did not compute
    evicted: int = 0


class StateCheckpoints:
    def __init__(self, slots: int, block_size: int):
        self.slots, self.block_size = slots, block_size
        self.interval = max(1, INTERVAL_TOKENS // block_size) * block_size
        self.free = list(range(slots - 1, -1, -1))
        self.by_key: OrderedDict[tuple, int] = OrderedDict()  # committed, least recently used first
        self.pending: dict[tuple, int] = {}  # written by the step in flight
        self.stats = CheckpointStats()

    def boundaries(self, start: int, end: int, prompt_len: int) -> list[int]:
        """The block boundaries in (start, end] of a prompt of ``prompt_len`` tokens to keep the
        state at: every ``interval``, the last one a repeat of the prompt can adopt (its last token
        is always computed) and the prompt's end where it is a boundary (an extended prompt)."""
        bs = self.block_size
        last = {(prompt_len - 1) // bs * bs, prompt_len // bs * bs}
        return [
            b for b in range(start // bs * bs + bs, min(end, prompt_len) + 1, bs) if b % self.interval == 0 or b in last
        ]

    def find(self, key: tuple) -> int | None:
        """The committed checkpoint at the prefix ``key``, marked recently used."""
        slot = self.by_key.get(key)
        if slot is not None:
            self.by_key.move_to_end(key)
        return slot

    def take(self, key: tuple) -> int | None:
        """A slot for the state at ``key``, pending until ``commit``; None where one exists or is
        being written already, or no slot is free or evictable."""
        if key in self.by_key or key in self.pending:
            return None
        if not self.free:
            if not self.by_key:
                return None
            self.free.append(self.by_key.popitem(last=False)[1])
            self.stats.evicted += 1
        slot = self.free.pop()
        self.pending[key] = slot
        return slot

    def commit(self) -> None:
        """The step in flight wrote its checkpoints: they can be found."""
        self.stats.taken += len(self.pending)
        self.by_key.update(self.pending)
        self.pending = {}

    def drop_pending(self) -> None:
        """The step in flight failed: what it may have half written goes back."""
        self.free += list(self.pending.values())
        self.pending = {}

    def resize(self, slots: int) -> list[tuple[int, int]]:
        """To ``slots`` slots (a new budget, between steps): the most recently used checkpoints
        that fit stay, renumbered into the first slots; the others are evicted. Returns the
        (old, new) slot of each kept one, which the cache's checkpoint tensors must follow."""
        assert not self.pending, "resized while a step writes checkpoints"
        kept = list(self.by_key.items())[-slots:] if slots else []
        self.stats.evicted += len(self.by_key) - len(kept)
        self.by_key = OrderedDict((key, new) for new, (key, _) in enumerate(kept))
        self.slots = slots
        self.free = list(range(slots - 1, len(kept) - 1, -1))
        return [(old, new) for new, (_, old) in enumerate(kept)]

    def clear(self) -> None:
        self.free += list(self.by_key.values()) + list(self.pending.values())
        self.by_key, self.pending = OrderedDict(), {}

    def check_invariants(self) -> None:
        held = list(self.by_key.values()) + list(self.pending.values())
        if len(set(held)) != len(held) or set(held) & set(self.free) or len(held) + len(self.free) != self.slots:
            raise AssertionError(f"checkpoint slots inconsistent: {held} held, {self.free} free of {self.slots}")
