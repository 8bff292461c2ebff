"""The paged KV cache: per layer, one K and one V tensor cut into fixed-size blocks.

::

    layer l, K:  block 0           block 1           ...  block N-1
                [slot 0..bs-1]    [slot 0..bs-1]         [slot 0..bs-1]
                 each slot = num_kv_heads x head_dim values

A token's K/V lives at *slot* ``block_id * block_size + offset``; a sequence's block table maps
its token positions to blocks. The tensors are allocated once at start-up and never grow: the
block manager hands blocks out and takes them back, the attention seam reads and writes slots.

An 8-bit cache (``int8``, or ``fp8``: float8 e4m3) stores each token's head_dim values in one
byte each with one float32 scale per token and head (absmax over the values mapped to the type's
largest): twice the tokens of bf16 per byte, four times fp32's. The compiled attention kernel
reads it in place; the PyTorch path dequantizes what it gathers.
"""

from __future__ import annotations

import mmap

import torch

from ..config import ModelConfig

# 8-bit cache dtypes: the torch dtype they are stored in, and the largest value a scale maps to.
EIGHT_BIT = {"int8": (torch.int8, 127.0), "fp8": (torch.float8_e4m3fn, 448.0)}


class KVCache:
    """K/V storage for ``num_blocks`` blocks of ``block_size`` slots, for every layer.

    The backend that reads it decides the layout (``Backend.kv_cache_shape``; the CPU backends'
    is head-major and flat, ``[num_kv_heads, num_blocks * block_size, head_dim]``, which the
    methods below assume) and allocates it (``Backend.allocate_kv_cache``).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype | str,
        device: torch.device | str = "cpu",
        resident: bool = False,
        shape: tuple[int, ...] | None = None,
    ):
        """``resident``: commit every page now (the engine does when a budget is given, so the
        process's memory is what the plan says from the start and load cannot grow it); else
        pages are committed as blocks are first written."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.quantized = isinstance(dtype, str) and dtype in EIGHT_BIT
        if isinstance(dtype, str) and not self.quantized:
            dtype = getattr(torch, dtype)
        self.dtype: torch.dtype = EIGHT_BIT[dtype][0] if isinstance(dtype, str) else dtype
        self.top = EIGHT_BIT[dtype][1] if isinstance(dtype, str) else 0.0
        shape = shape or (cfg.num_kv_heads, num_blocks * block_size, cfg.head_dim)
        self.k = [_zeros(shape, self.dtype, device, resident) for _ in range(cfg.num_layers)]
        self.v = [_zeros(shape, self.dtype, device, resident) for _ in range(cfg.num_layers)]
        layers = range(cfg.num_layers) if self.quantized else range(0)
        self.k_scale = [_zeros(shape[:2], torch.float32, device, resident) for _ in layers]
        self.v_scale = [_zeros(shape[:2], torch.float32, device, resident) for _ in layers]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """The step's K/V ([T, KVH, D]) into their slots (the PyTorch path; the kernel does its own)."""
        if not self.quantized:  # (in the cache's dtype, which may differ from the weights')
            self.k[layer].index_copy_(1, slots, k.transpose(0, 1).to(self.dtype))
            self.v[layer].index_copy_(1, slots, v.transpose(0, 1).to(self.dtype))
            return
        for new, cache, scales in ((k, self.k[layer], self.k_scale[layer]), (v, self.v[layer], self.v_scale[layer])):
            heads_first = new.transpose(0, 1).float()
            amax = heads_first.abs().amax(dim=-1)  # [KVH, T]
            q = heads_first * torch.where(amax > 0, self.top / amax, 0.0)[..., None]
            q = q.round_().to(self.dtype) if self.dtype == torch.int8 else q.to(self.dtype)
            cache.view(torch.uint8).index_copy_(1, slots, q.view(torch.uint8))  # CPU indexing lacks fp8
            scales.index_copy_(1, slots, amax / self.top)

    def gather(self, layer: int, blocks: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``blocks`` (any shape of block ids) as [KVH, *blocks.shape, block_size, D] in ``dtype``."""
        out = []
        for i, cache in enumerate((self.k[layer], self.v[layer])):
            kv_heads, _, d = cache.shape
            if self.quantized:  # indexed as bytes: CPU indexing lacks fp8
                values = cache.view(torch.uint8).view(kv_heads, -1, self.block_size, d)[:, blocks].view(self.dtype)
            else:
                values = cache.view(kv_heads, -1, self.block_size, d)[:, blocks].to(dtype)  # (a copy already)
            if self.quantized:
                scales = (self.k_scale, self.v_scale)[i][layer]
                scale = scales.view(kv_heads, -1, self.block_size)[:, blocks]
                values = (values.float() * scale[..., None]).to(dtype)
            out.append(values)
        return out[0], out[1]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copies every layer's K/V of block ``src`` into block ``dst`` (copy-on-write of a
        shared block). Block by block and in place: no temporary larger than one block."""
        bs = self.block_size
        for src, dst in pairs:
            for cache in self._tensors():
                cache[:, dst * bs : (dst + 1) * bs].copy_(cache[:, src * bs : (src + 1) * bs])

    def zero_blocks(self, blocks: list[int]) -> None:
        """Zeroes every layer's K/V of ``blocks``: stale values are read (masked) by a block's
        next owner, and a masked NaN still poisons ``probs @ V`` (0 x NaN is NaN)."""
        bs = self.block_size
        for block in blocks:
            for cache in self._tensors():
                cache[:, block * bs : (block + 1) * bs].zero_()

    def _tensors(self) -> list[torch.Tensor]:
        return [*self.k, *self.v, *self.k_scale, *self.v_scale]


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
