"""A mixture of experts larger than the budget: the routed experts stay in the checkpoint's files
and a fixed number of slots hold the ones in use (the planner's residency plan, ``plan.expert_slots``).

Everything a token always reads (embeddings, attention, norms, routers, shared experts, the head)
is loaded as usual; each routed expert's quantized matrices are read with ``os.preadv`` from the
converted checkpoint (``<name>.qweight`` / ``.scale`` / ``.zero``, the kernels' own layout) straight
into a slot when the router first chooses it, and stay there until the slot is needed for another
(``stored_reads``: no mapping, so the file's pages never count in the process's RSS).

Which expert leaves: a segmented LRU (SLRU). A new expert enters on probation; one chosen again
while resident is protected (up to ``PROTECTED_SHARE`` of the slots). A slot is taken from the
probation's least recently used first, so the experts a router keeps choosing (real routers are
skewed) survive a burst of rarely chosen ones.

Slots are shared by every layer whose experts have the same shapes and formats (one pool per
such kind: a Q4_K_M file keeps some layers' down projections in Q6_K). A step's layer makes all
its chosen experts resident at once when the pool holds them (the expert kernel then runs on
them as on loaded ones, in expert order: the same arithmetic), else runs them one at a time.

A file changed underneath or cut short is a ``ModelLoadError`` naming it, never wrong output.
"""

from __future__ import annotations

import mmap
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import env
from .linear import Linear
from .quantized import STORED_FIELDS, QuantizedWeight, stored_weight
from .stored_reads import StoredFiles, StoredTensor, anonymous_slots

# The share of a pool's slots that experts chosen more than once may hold (the rest is probation).
PROTECTED_SHARE = 0.8
# A checkpoint's expert roles (``Family.name_of``), by the slot matrix they fill: gate and up
# stacked by rows (the layer's gate_up_proj), down alone.
PROJECTIONS = {"gate_up": ("expert_gate", "expert_up"), "down": ("expert_down",)}
FIELDS = STORED_FIELDS  # a stored matrix's tensors (layers/quantized.py)


@dataclass
class _Pool:
    """Slots of one kind of expert: per matrix field, a [capacity, rows, cols] tensor over an
    anonymous mapping of its own, room for every expert of the kind, of which the first
    ``slots`` are in use: a page is resident only once written, and the pages of slots past a
    smaller ``slots`` go back to the OS (``ExpertCache.resize``)."""

    tensors: dict[str, torch.Tensor]
    owner: list[tuple[int, int] | None]  # per slot of the capacity
    slots: int
    maps: dict[str, mmap.mmap] = field(default_factory=dict)
    free: list[int] = field(default_factory=list)
    probation: OrderedDict = field(default_factory=OrderedDict)  # slot -> None, least recent first
    protected: OrderedDict = field(default_factory=OrderedDict)

    @property
    def slot_bytes(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in self.tensors.values())

    def victim(self, pinned: set[int]) -> int:
        """A free slot, else probation's least recently used unpinned one, else protected's."""
        if self.free:
            return self.free.pop()
        for segment in (self.probation, self.protected):
            for s in segment:
                if s not in pinned:
                    return s
        raise AssertionError("every slot is pinned: the caller asked for more experts than the pool holds")

    def touch(self, s: int, again: bool) -> None:
        """Slot s used now: protected if its expert was chosen while resident, else on probation."""
        if s in self.protected or again:
            self.probation.pop(s, None)
            self.protected[s] = None
            self.protected.move_to_end(s)
            while len(self.protected) > max(1, int(PROTECTED_SHARE * self.slots)):
                demoted, _ = self.protected.popitem(last=False)
                self.probation[demoted] = None
        else:
            self.probation[s] = None
            self.probation.move_to_end(s)

    def forget(self, s: int) -> None:
        self.probation.pop(s, None)
        self.protected.pop(s, None)


@dataclass
class ExpertCacheStats:
    hits: int = 0  # chosen experts found resident (read ahead included)
    misses: int = 0  # chosen experts read from the file when chosen
    bytes_read: int = 0  # of every read, the misses' and the reads ahead
    prefetched: int = 0  # experts read ahead, while the layer before computed
    prefetch_unused: int = 0  # of those, the ones their layer then did not choose


class ExpertCache:
    """``stored``: (layer, expert) -> {"gate_up.qweight": [StoredTensor of gate, of up], ...} for
    every routed expert; ``slots``: how many experts stay resident, all pools together (each
    pool at least ``floor`` of them: what one step's layer may choose at once on the kernel path)."""

    def __init__(self, stored: dict[tuple[int, int], dict[str, list[StoredTensor]]], slots: int, floor: int):
        self.stored = stored
        self.stats = ExpertCacheStats()
        self.frequency: dict[int, torch.Tensor] = {}  # layer -> how often the router chose each expert
        self.where: dict[tuple[int, int], int] = {}  # resident (layer, expert) -> its slot
        self._files = StoredFiles()
        self._watchers: dict[int, Callable[[int, int | None], None]] = {}
        # reads started ahead: (layer, expert) -> (its slot, the read); one reader thread, whose
        # preadv releases the GIL while the layer before computes
        self._ahead: dict[tuple[int, int], tuple[int, Future]] = {}
        self._reader = (
            ThreadPoolExecutor(1, thread_name_prefix="pagedllm-experts") if env.EXPERT_PREFETCH.get() else None
        )
        self.routers: dict[int, Linear] = {}  # layer -> its router, for guesses
        self.facts: Any = None  # the checkpoint's RoutedExperts (the loader's), for a new plan
        self.top_k = 0
        kinds: dict[tuple, set[int]] = {}
        for (layer, _), fields in stored.items():
            kinds.setdefault(kind_of(fields), set()).add(layer)
        if slots < floor * len(kinds):
            raise ValueError(f"{slots} expert slots: each of the {len(kinds)} kinds of expert needs {floor}")
        self.floor = floor
        self.pools: list[_Pool] = []
        self.pool_of: dict[int, _Pool] = {}
        self._layers_of: list[int] = []  # per pool, how many layers share it
        for kind, its_layers in sorted(kinds.items(), key=lambda kv: -len(kv[1])):
            capacity = sum(1 for (layer, _) in stored if layer in its_layers)
            mapped = {name: anonymous_slots(capacity, shape, dtype) for name, dtype, shape in kind}
            tensors = {name: tensor for name, (_, tensor) in mapped.items()}
            pool = _Pool(tensors, [None] * capacity, 0, {name: buffer for name, (buffer, _) in mapped.items()})
            self.pools.append(pool)
            self._layers_of.append(len(its_layers))
            for layer in its_layers:
                self.pool_of[layer] = pool
        for pool, count in zip(self.pools, self._shares(slots)):
            pool.slots, pool.free = count, list(range(count - 1, -1, -1))
        for fields in stored.values():
            for parts in fields.values():
                for part in parts:
                    self._files.open(part.file)

    # -- what the model sees -------------------------------------------------------------------

    def nbytes(self) -> int:
        """The slots in use (the planned ones), whatever the pools could grow to."""
        return sum(pool.slots * pool.slot_bytes for pool in self.pools)

    @property
    def slots(self) -> int:
        return sum(pool.slots for pool in self.pools)

    @property
    def capacity(self) -> int:
        """Every routed expert: the most slots the pools can grow to."""
        return sum(len(pool.owner) for pool in self.pools)

    def resize(self, slots: int) -> None:
        """A new number of slots (a new budget): fewer, the experts in slots past each pool's new
        end move down into the least recently used slots below it (their experts leave), then
        the pages past the end go back to the OS; more, the new slots are free (read into as
        chosen). Between two steps only."""
        for key in list(self._ahead):
            self._finish_ahead(key, self.pool_of[key[0]])
        for pool, count in zip(self.pools, self._shares(slots)):
            if count > pool.slots:
                pool.free += range(count - 1, pool.slots - 1, -1)
            elif count < pool.slots:
                self._shrink(pool, count)
            pool.slots = count

    def _shares(self, slots: int) -> list[int]:
        """Each pool's slots: its floor, and of the rest a share as its layers' (at most its capacity)."""
        kinds, floor = len(self.pools), self.floor
        if slots < floor * kinds:
            raise ValueError(f"{slots} expert slots: each of the {kinds} kinds of expert needs {floor}")
        layers, spare = sum(self._layers_of), slots - floor * kinds
        shares = [floor + spare * n // layers for n in self._layers_of]
        shares[0] += slots - sum(shares)
        return [min(count, len(pool.owner)) for count, pool in zip(shares, self.pools)]

    def _shrink(self, pool: _Pool, count: int) -> None:
        pool.free = [s for s in pool.free if s < count]
        outside = set(range(count, len(pool.owner)))
        for s in range(count, pool.slots):
            owner = pool.owner[s]
            if owner is None:
                continue
            t = pool.victim(outside)  # a free slot below the end, else the least recently used there
            if pool.owner[t] is not None:
                self._evict(pool, t)
            for tensor in pool.tensors.values():
                tensor[t].copy_(tensor[s])
            protected = s in pool.protected
            self._evict(pool, s)
            self._install(owner[0], owner[1], pool, t)
            pool.touch(t, again=protected)
        for name, tensor in pool.tensors.items():
            stride = tensor[0].numel() * tensor.element_size()
            start = -(-count * stride // mmap.PAGESIZE) * mmap.PAGESIZE
            end = len(pool.owner) * stride // mmap.PAGESIZE * mmap.PAGESIZE
            if end > start:
                pool.maps[name].madvise(mmap.MADV_DONTNEED, start, end - start)

    def slots_of(self, layer: int) -> int:
        return self.pool_of[layer].slots

    def watch(self, layer: int, listener: Callable[[int, int | None], None]) -> None:
        """``listener(expert, slot)`` after one of the layer's experts enters a slot (None: it left)."""
        self._watchers[layer] = listener

    def weights(self, layer: int, expert: int) -> tuple[QuantizedWeight, QuantizedWeight]:
        """(gate_up, down) of a resident expert: views of its slot."""
        pool, s = self.pool_of[layer], self.where[(layer, expert)]

        def matrix(projection: str) -> QuantizedWeight:
            fields = {f: pool.tensors[f"{projection}.{f}"][s] for f in FIELDS if f"{projection}.{f}" in pool.tensors}
            return stored_weight(fields["qweight"], fields.get("scale"), fields.get("zero"))

        return matrix("gate_up"), matrix("down")

    def make_resident(self, layer: int, experts: list[int]) -> None:
        """Every expert in ``experts`` resident at once (a miss read from the file), each read once."""
        pool = self.pool_of[layer]
        if len(experts) > pool.slots:
            raise ValueError(f"{len(experts)} experts at once; layer {layer}'s pool holds {pool.slots}")
        counts = self.frequency.get(layer)
        if counts is None:
            counts = self.frequency[layer] = torch.zeros(max(e for (_, e) in self.stored) + 1, dtype=torch.int64)
        chosen = set(experts)
        for key in [k for k in self._ahead if k[0] == layer]:  # this layer's reads ahead: done by now
            self._finish_ahead(key, pool)
            if key[1] not in chosen:
                self.stats.prefetch_unused += 1
        pinned = {self.where[(layer, e)] for e in experts if (layer, e) in self.where}
        for e in experts:
            counts[e] += 1
            s = self.where.get((layer, e))
            if s is not None:
                self.stats.hits += 1
                pool.touch(s, again=True)
                continue
            s = self._victim(pool, pinned)
            try:
                self.stats.bytes_read += self._fill(layer, e, pool, s)
            except BaseException:
                pool.free.append(s)  # half written, owned by no one
                raise
            self._install(layer, e, pool, s)
            self.stats.misses += 1
            pinned.add(s)
            pool.touch(s, again=False)

    def read_ahead(self, layer: int, x: torch.Tensor, chosen: list[int]) -> None:
        """Starts reading the experts the next sparse layer would choose for ``x`` (this layer's
        input: the residual stream moves little from one layer to the next) that are not
        resident, into slots no one uses (never those of this layer's ``chosen``, about to be
        computed with), while this layer computes."""
        following = min((i for i in self.routers if i > layer), default=None)
        if self._reader is None or following is None:
            return
        router, pool = self.routers[following], self.pool_of[following]
        bias = router.bias.float() if router.bias is not None else None
        logits = torch.nn.functional.linear(x.float(), router.weight.float(), bias)
        guesses = torch.unique(torch.topk(logits, self.top_k, dim=-1).indices).tolist()
        busy = self._busy(pool) | {self.where[(following, e)] for e in guesses if (following, e) in self.where}
        busy |= {self.where[(layer, e)] for e in chosen if self.pool_of[layer] is pool}
        for e in guesses:
            key = (following, e)
            if key in self.where or key in self._ahead or len(busy) >= pool.slots - self.top_k:
                continue
            s = pool.victim(busy)
            if pool.owner[s] is not None:
                self._evict(pool, s)
            busy.add(s)
            self._ahead[key] = (s, self._reader.submit(self._fill, following, e, pool, s))

    def close(self) -> None:
        if self._reader is not None:
            self._reader.shutdown(wait=True)
        self._files.close()

    # -- reading -------------------------------------------------------------------------------

    def _busy(self, pool: _Pool) -> set[int]:
        """The pool's slots being read ahead."""
        return {s for (layer, _), (s, _) in self._ahead.items() if self.pool_of[layer] is pool}

    def _victim(self, pool: _Pool, pinned: set[int]) -> int:
        """A slot for a read now: never a pinned one nor one being read ahead (those finish first
        if nothing else is left)."""
        busy = self._busy(pool)
        if len(pinned | busy) >= pool.slots:
            for key in [k for k in self._ahead if self.pool_of[k[0]] is pool]:
                self._finish_ahead(key, pool)
                self.stats.prefetch_unused += 1
            busy = set()
        s = pool.victim(pinned | busy)
        if pool.owner[s] is not None:
            self._evict(pool, s)
        return s

    def _finish_ahead(self, key: tuple[int, int], pool: _Pool) -> None:
        """A read started ahead, waited for and made resident (an error is raised here)."""
        s, read = self._ahead.pop(key)
        try:
            self.stats.bytes_read += read.result()
        except BaseException:
            pool.free.append(s)
            raise
        self._install(key[0], key[1], pool, s)
        self.stats.prefetched += 1
        pool.touch(s, again=False)

    def _install(self, layer: int, expert: int, pool: _Pool, s: int) -> None:
        self.where[(layer, expert)] = s
        pool.owner[s] = (layer, expert)
        if layer in self._watchers:
            self._watchers[layer](expert, s)

    def _fill(self, layer: int, expert: int, pool: _Pool, s: int) -> int:
        """The expert's bytes from the file into slot s; returns how many (the reader thread runs
        this too: it touches nothing but the slot's memory)."""
        done = 0
        for name, parts in self.stored[(layer, expert)].items():
            rows = 0
            for part in parts:
                target = pool.tensors[name][s, rows : rows + part.shape[0]]
                rows += part.shape[0]
                done += self._files.read_into(part, target, f"layer {layer}'s expert {expert}")
        return done

    def _evict(self, pool: _Pool, s: int) -> None:
        owner = pool.owner[s]
        assert owner is not None
        del self.where[owner]
        pool.owner[s] = None
        pool.forget(s)
        if owner[0] in self._watchers:
            self._watchers[owner[0]](owner[1], None)


def kind_of(fields: dict[str, list[StoredTensor]]) -> tuple:
    """(field, dtype, shape of one slot) for every field of an expert: experts of one kind share a pool."""
    out = []
    for name in sorted(fields):
        parts = fields[name]
        rows = sum(p.shape[0] for p in parts)
        out.append((name, parts[0].dtype, (rows, *parts[0].shape[1:])))
    return tuple(out)
