"""One step over several whole prompts, as the engine would lay it out: the flat batch of their
tokens, their positions, and the attention layout with each prompt in blocks of its own."""

from __future__ import annotations

from pagedllm.backends.cpu.attention import SequenceSlice, StepLayout


def flat_step(batch: list[list[int]], block_size: int, group_size: int) -> tuple[list[int], list[int], StepLayout]:
    slices, ids, positions, block = [], [], [], 0
    for p in batch:
        n_blocks = -(-len(p) // block_size)
        slices.append(SequenceSlice(len(ids), len(p), len(p), list(range(block, block + n_blocks))))
        block += n_blocks
        ids += p
        positions += range(len(p))
    return ids, positions, StepLayout.from_slices(slices, block_size, group_size)
