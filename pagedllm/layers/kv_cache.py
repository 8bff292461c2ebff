"""The paged KV cache: per layer, one K and one V tensor cut into fixed-size blocks.

::

    layer l, K:  block 0           block 1           ...  block N-1
                [slot 0..bs-1]    [slot 0..bs-1]         [slot 0..bs-1]
                 each slot = num_kv_heads x head_dim values

A token's K/V lives at *slot* ``block_id * block_size + offset``; a sequence's block table maps
its token positions to blocks. The tensors are allocated once at start-up and never grow: the
block manager hands blocks out and takes them back, the attention seam reads and writes slots.
"""

from __future__ import annotations

import mmap

import torch

from ..config import ModelConfig


class KVCache:
    """K/V storage for ``num_blocks`` blocks of ``block_size`` slots, for every layer.

    Tensors are kept head-major and flat as ``[num_kv_heads, num_blocks * block_size, head_dim]``:
    a write is one indexed copy by slot, a read one gather by slot, and each KV head's gathered
    keys are contiguous, which the bf16 matmul kernels need to avoid copying them again.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        resident: bool = False,
    ):
        """``resident``: commit every page now (the engine does when a budget is given, so the
        process's memory is what the plan says from the start and load cannot grow it); else
        pages are committed as blocks are first written."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        shape = (cfg.num_kv_heads, num_blocks * block_size, cfg.head_dim)
        self.k = [_zeros(shape, dtype, device, resident) for _ in range(cfg.num_layers)]
        self.v = [_zeros(shape, dtype, device, resident) for _ in range(cfg.num_layers)]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copies every layer's K/V of block ``src`` into block ``dst`` (copy-on-write of a
        shared block). Block by block and in place: no temporary larger than one block."""
        bs = self.block_size
        for src, dst in pairs:
            for cache in (*self.k, *self.v):
                cache[:, dst * bs : (dst + 1) * bs].copy_(cache[:, src * bs : (src + 1) * bs])

    def zero_blocks(self, blocks: list[int]) -> None:
        """Zeroes every layer's K/V of ``blocks``: stale values are read (masked) by a block's
        next owner, and a masked NaN still poisons ``probs @ V`` (0 x NaN is NaN)."""
        bs = self.block_size
        for block in blocks:
            for cache in (*self.k, *self.v):
                cache[:, block * bs : (block + 1) * bs].zero_()


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device, resident: bool) -> torch.Tensor:
    """Zeros in an anonymous memory map, whose pages the kernel zero-fills: on first touch, or
    all at once when ``resident`` (MAP_POPULATE). Masked keys past a context's end are read
    (gathers are whole blocks), so what they hold must be finite; zeros are, and so is any
    stale K/V."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = dtype.itemsize
    for d in shape:
        nbytes *= d
    flags = mmap.MAP_SHARED | mmap.MAP_ANONYMOUS | (mmap.MAP_POPULATE if resident else 0)
    buffer = mmap.mmap(-1, max(nbytes, 1), flags=flags)
    return torch.frombuffer(buffer, dtype=dtype, count=nbytes // dtype.itemsize).view(shape)
