"""The paged KV cache: per layer, one K and one V tensor cut into fixed-size blocks.

::

    layer l, K:  block 0           block 1           ...  block N-1
                [slot 0..bs-1]    [slot 0..bs-1]         [slot 0..bs-1]
                 each slot = num_kv_heads x head_dim values

A token's K/V lives at *slot* ``block_id * block_size + offset``; a sequence's block table maps
its token positions to blocks. The tensors are allocated once at start-up and never move: the
block manager hands blocks out and takes them back, the attention seam reads and writes slots.

The budget may change at run time (``LLMEngine.set_memory``), so each tensor's mapping reserves
address space for ``capacity_blocks`` (no memory: pages exist only once written) and only the
first ``num_blocks`` are in use. ``resize`` moves that line: shrinking gives the pages of each
head's tail back to the OS (the layout is head-major, so a head's blocks from ``num_blocks`` on
are one contiguous range), growing lets more blocks be handed out (their pages faulted in as they
are first written).

Pools: a model whose layers attend differently (Gemma 3's sliding and full layers) keeps one
pool of blocks per kind of layer (``ModelConfig.kv_pools``; ``engine.block_pools``): the layers of
pool p have tensors of that pool's size, and block ids of pool p index only them. Given one
number of blocks, every layer is in one shared pool (the tests' way; one block table for all).

An 8-bit cache (``int8``, or ``fp8``: float8 e4m3) stores each token's head_dim values in one
byte each with one float32 scale per token and head (absmax over the values mapped to the type's
largest): twice the tokens of bf16 per byte, four times fp32's. The compiled attention kernel
reads it in place; the PyTorch path dequantizes what it gathers.
"""

from __future__ import annotations

import mmap

import torch

from ...config import ModelConfig
from ...kinds import SequenceState

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
        num_blocks: int | list[int],
        block_size: int,
        dtype: torch.dtype | str,
        device: torch.device | str = "cpu",
        resident: bool = False,
        shape=None,
        capacity_blocks: int | list[int] | None = None,
        state_slots: int = 0,
        checkpoint_slots: int = 0,
    ):
        """``num_blocks``: one number (every layer in one pool), or one per pool of
        ``cfg.kv_pools``. ``resident``: commit every page of the blocks in use now (the engine does
        when a budget is given, so the process's memory is what the plan says from the start and
        load cannot grow it); else pages are committed as blocks are first written.
        ``capacity_blocks``: the most blocks a later ``resize`` may grow each pool to (default:
        ``num_blocks``); ``shape(blocks)`` is the layout of a tensor of that many (default: the CPU's).
        ``state_slots``: the sequences whose states each state-keeping layer holds (``states``);
        ``checkpoint_slots``: the states it keeps for prefixes (``checkpoints``)."""
        pooled = not isinstance(num_blocks, int)
        sizes: list[int] = [num_blocks] if isinstance(num_blocks, int) else list(num_blocks)
        capacity: list[int] = sizes
        if capacity_blocks is not None:
            capacity = [capacity_blocks] if isinstance(capacity_blocks, int) else list(capacity_blocks)
        if len(capacity) != len(sizes) or (pooled and len(sizes) != len(cfg.kv_pools)):
            raise ValueError(f"{len(sizes)} pool sizes, {len(capacity)} capacities for pools {cfg.kv_pools}")
        if min(sizes) < 1 or block_size < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1")
        self.pool_capacity = [max(n, c) for n, c in zip(sizes, capacity)]
        self.pool_blocks = sizes
        # each layer's pool: its kind's, or 0 for all when one shared pool was asked for; None for
        # a layer that keeps a state per sequence instead (no K/V of its own: ``states``)
        # (asked of the config only where pools or states were: the kernel tests' bare configs have neither)
        self.layer_pool: list[int | None] = [0] * cfg.num_layers
        if pooled or state_slots:
            pools = [cfg.kv_pool_of_layer(i) for i in range(cfg.num_layers)]
            self.layer_pool = [None if p is None else p if pooled else 0 for p in pools]
        self.resident = resident
        self.block_size = block_size
        self.quantized = isinstance(dtype, str) and dtype in EIGHT_BIT
        if isinstance(dtype, str) and not self.quantized:
            dtype = getattr(torch, dtype)
        self.dtype: torch.dtype = EIGHT_BIT[dtype][0] if isinstance(dtype, str) else dtype
        self.top = EIGHT_BIT[dtype][1] if isinstance(dtype, str) else 0.0
        shape = shape or (lambda blocks: (cfg.num_kv_heads, blocks * block_size, cfg.head_dim))
        self._maps: dict[int, mmap.mmap] = {}  # data_ptr of a tensor -> its mapping (CPU only)
        # (a state-keeping layer's K/V: an empty tensor, so that layer indices stay the model's)
        shapes = [shape(self.pool_capacity[p]) if p is not None else (0, 0, 0) for p in self.layer_pool]
        self.k = [self._zeros(sh, self.dtype, device) for sh in shapes]
        self.v = [self._zeros(sh, self.dtype, device) for sh in shapes]
        scaled = shapes if self.quantized else []
        self.k_scale = [self._zeros(sh[:2], torch.float32, device) for sh in scaled]
        self.v_scale = [self._zeros(sh[:2], torch.float32, device) for sh in scaled]
        self._state_layout = (cfg, device)  # what the state pools are made of (a resized one too)
        self.states, self.checkpoints = (_state_pool(cfg, device, n) for n in (state_slots, checkpoint_slots))
        if resident:
            for p, n in enumerate(sizes):
                self._commit(p, 0, n)

    @property
    def num_blocks(self) -> int:
        """Pool 0's blocks in use (the pool every context is planned against)."""
        return self.pool_blocks[0]

    @property
    def capacity_blocks(self) -> int:
        return self.pool_capacity[0]

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

    def copy_blocks(self, moves: list[tuple[int, int, int]]) -> None:
        """Copies the K/V of block ``src`` into block ``dst`` in every layer of pool ``pool`` for
        each (pool, src, dst) (copy-on-write of a shared block, a block moved down). Block by
        block and in place: no temporary larger than one block."""
        bs = self.block_size
        for pool, src, dst in moves:
            for cache in self._tensors(pool):
                cache[:, dst * bs : (dst + 1) * bs].copy_(cache[:, src * bs : (src + 1) * bs])

    def block_nbytes(self, pool: int) -> int:
        """Bytes of one block of the pool in every layer (K, V and 8-bit scales): a disk entry's."""
        return sum(_block_slice(t, 0, self.block_size).numel() for t in self._tensors(pool))

    def read_block(self, pool: int, block: int) -> bytes:
        """One block of every layer of the pool as stored (the disk tier's entry), tensor after
        tensor in ``_tensors``' order."""
        parts = [_block_slice(t, block, self.block_size).reshape(-1) for t in self._tensors(pool)]
        return torch.cat(parts).cpu().numpy().tobytes()

    def write_block(self, pool: int, block: int, data: bytes | bytearray | memoryview) -> None:
        """``read_block``'s bytes back into a block (of a cache of the same layout)."""
        flat = torch.frombuffer(bytearray(data) if isinstance(data, bytes) else data, dtype=torch.uint8)  # (no copy)
        at = 0
        for t in self._tensors(pool):
            target = _block_slice(t, block, self.block_size)
            target.copy_(flat[at : at + target.numel()].view(target.shape))
            at += target.numel()
        if at != flat.numel():
            raise ValueError(f"{flat.numel()} bytes for a block of {at}")

    def copy_states(self, copies: list[tuple[int, int]]) -> None:
        """Every state-keeping layer's state of slot ``src`` into slot ``dst`` (a forked sample's)."""
        for src, dst in copies:
            for tensors in self.states.values():
                for t in tensors.values():
                    t[dst].copy_(t[src])

    def resize_checkpoints(self, slots: int, moves: list[tuple[int, int]]) -> None:
        """The checkpoint pool to ``slots`` slots, each (old, new) slot of ``moves`` carried over;
        the old tensors go (their pages back to the OS with them: a shed checkpoint frees its
        state's bytes)."""
        old = self.checkpoints
        self.checkpoints = _state_pool(*self._state_layout, slots)
        for layer, tensors in self.checkpoints.items():
            for name, t in tensors.items():
                for src, dst in moves:
                    t[dst].copy_(old[layer][name][src])

    def restore_states(self, restores: list[tuple[int, int]]) -> None:
        """Every state-keeping layer's checkpoint ``src`` into state slot ``dst`` (a prefix adopted)."""
        for src, dst in restores:
            for layer, tensors in self.states.items():
                for name, t in tensors.items():
                    t[dst].copy_(self.checkpoints[layer][name][src])

    def zero_blocks(self, blocks: list[tuple[int, int]]) -> None:
        """Zeroes the K/V of each (pool, block): stale values are read (masked) by a block's
        next owner, and a masked NaN still poisons ``probs @ V`` (0 x NaN is NaN)."""
        bs = self.block_size
        for pool, block in blocks:
            for cache in self._tensors(pool):
                cache[:, block * bs : (block + 1) * bs].zero_()

    def resize(self, sizes: int | list[int]) -> None:
        """Blocks [0, sizes[p]) of each pool in use from now on. Shrinking releases every page that
        holds only blocks past the new end (they read as zeros if used again); the caller has moved
        what lived there. Growing commits nothing: the new blocks' pages fault in as they are first
        written (the plan counts them either way), so a grow that a shrink soon undoes (a budget
        that follows a neighbour) costs only the blocks it lent out, not a pass over the new room."""
        sizes = [sizes] if isinstance(sizes, int) else list(sizes)
        assert isinstance(sizes, list)
        for p, n in enumerate(sizes):
            if not 1 <= n <= self.pool_capacity[p]:
                raise ValueError(f"{n} blocks: pool {p} of this cache holds 1 to {self.pool_capacity[p]}")
        old, self.pool_blocks = self.pool_blocks, sizes
        for p, (n, was) in enumerate(zip(sizes, old)):
            if n < was:
                self.release_pages(p, n)

    def _commit(self, pool: int, first: int, end: int) -> None:
        """Writes zeros over blocks [first, end) of every head of the pool, so their pages are
        resident now."""
        bs = self.block_size
        for cache in self._tensors(pool):
            writable = cache.view(torch.uint8) if cache.element_size() == 1 else cache  # CPU fills lack fp8
            writable[:, first * bs : end * bs].zero_()

    def release_pages(self, pool: int, first: int) -> None:
        """Gives back the pages of the pool's blocks [first, capacity) of every head (MADV_REMOVE
        frees the shared anonymous pages themselves, not only this process's view of them). Blocks
        still in use past ``first`` (an idle engine's free ones) read as zeros and fault back in as
        written."""
        for cache in self._tensors(pool):
            buffer = self._maps.get(cache.data_ptr())
            if buffer is None:
                continue  # not a mapping of ours (a device tensor): nothing to give back
            head_bytes = cache.stride(0) * cache.element_size()  # the [KVH, slots, ...] layout
            slot_bytes = head_bytes // cache.shape[1]
            for h in range(cache.shape[0]):
                start = _page_up(h * head_bytes + first * self.block_size * slot_bytes)
                end = (h + 1) * head_bytes // mmap.PAGESIZE * mmap.PAGESIZE
                if end > start:
                    buffer.madvise(mmap.MADV_REMOVE, start, end - start)

    def _tensors(self, pool: int) -> list[torch.Tensor]:
        """Every tensor of the pool's layers: K, V and 8-bit scales."""
        layers = [i for i, p in enumerate(self.layer_pool) if p == pool]
        out = [self.k[i] for i in layers] + [self.v[i] for i in layers]
        if self.quantized:
            out += [self.k_scale[i] for i in layers] + [self.v_scale[i] for i in layers]
        return out

    def _zeros(self, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
        """Zeros in a shared anonymous memory map, whose pages the kernel zero-fills on first
        touch (only the blocks in use are, see ``_commit``); its address space is reserved, not
        its memory (MAP_NORESERVE). Masked keys past a context's end are read (gathers are whole
        blocks), so what they hold must be finite; zeros are, and so is any stale K/V."""
        nbytes = dtype.itemsize
        for d in shape:
            nbytes *= d
        if torch.device(device).type != "cpu" or not nbytes:  # (a state-keeping layer's empty K/V)
            return torch.zeros(shape, dtype=dtype, device=device)
        buffer = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS | _MAP_NORESERVE)
        tensor = torch.frombuffer(buffer, dtype=dtype, count=nbytes // dtype.itemsize).view(shape)
        self._maps[tensor.data_ptr()] = buffer
        return tensor


def _block_slice(cache: torch.Tensor, block: int, block_size: int) -> torch.Tensor:
    """A block's slots of one head-major tensor ([KVH, slots, D] values or [KVH, slots] scales),
    as bytes: [KVH, block_size, bytes per slot] (fp8 has no CPU copy of its own; bytes do)."""
    as_bytes = (cache if cache.dim() == 3 else cache.unsqueeze(-1)).view(torch.uint8)
    return as_bytes[:, block * block_size : (block + 1) * block_size]


def _state_pool(cfg: ModelConfig, device, slots: int) -> dict[int, dict[str, torch.Tensor]]:
    """Each state-keeping layer's tensors by name, [slots, ...] each, float32 (``kinds.SequenceState``).
    Left unwritten (``empty``): a sequence zeroes its slot when it starts and a checkpoint is
    written before it is read, so a slot's pages become resident only once a sequence uses it
    (64 slots of Qwen3.5-0.8B's 20 MB, zeroed here, held 2.4 GB of RSS before a request came)."""
    if not slots:
        return {}
    return {
        i: {name: torch.empty((slots, *dims), device=device) for name, dims in kind.cache.tensors}
        for i, kind in enumerate(cfg.layer_kinds)
        if isinstance(kind.cache, SequenceState)
    }


_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)  # Linux's value; Python 3.11's mmap lacks the name


def _page_up(offset: int) -> int:
    return -(-offset // mmap.PAGESIZE) * mmap.PAGESIZE
