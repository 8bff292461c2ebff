"""BlockManager: owns the free list, per-block reference counts and every sequence's block table.

A block is taken only when a sequence's next token needs one, and all of a sequence's blocks go
back the moment it finishes, is aborted or is preempted. Reference counts let blocks be shared
later (prefix caching, parallel sampling) without changing this contract.
"""

from __future__ import annotations


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        # A stack: the most recently freed block is reused first, so a cache allocated lazily
        # touches (and costs RAM for) only as many blocks as were ever in use at once.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.ref_counts = [0] * num_blocks
        self.tables: dict[str, list[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def table(self, seq_id: str) -> list[int]:
        return self.tables.get(seq_id, [])

    def blocks_needed(self, seq_id: str, num_tokens: int) -> int:
        """Blocks ``seq_id`` still has to take to hold ``num_tokens`` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(self.table(seq_id)))

    def can_grow(self, seq_id: str, num_tokens: int) -> bool:
        return self.blocks_needed(seq_id, num_tokens) <= len(self._free)

    def grow(self, seq_id: str, num_tokens: int) -> None:
        need = self.blocks_needed(seq_id, num_tokens)
        if need > len(self._free):
            raise RuntimeError(f"grow({seq_id}): needs {need} blocks, {len(self._free)} free")
        table = self.tables.setdefault(seq_id, [])
        for _ in range(need):
            block = self._free.pop()
            self.ref_counts[block] = 1
            table.append(block)

    def free(self, seq_id: str) -> None:
        for block in self.tables.pop(seq_id, []):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self._free.append(block)

    def check_invariants(self) -> None:
        """Every block is either free with count 0 or owned with count = number of owners."""
        owners = [0] * self.num_blocks
        for table in self.tables.values():
            for b in table:
                owners[b] += 1
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a block is on the free list twice")
        for b in range(self.num_blocks):
            if (b in free) != (owners[b] == 0) or self.ref_counts[b] != owners[b]:
                raise AssertionError(
                    f"block {b}: free={b in free}, owners={owners[b]}, ref_count={self.ref_counts[b]}"
                )
