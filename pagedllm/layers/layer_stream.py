"""A dense model whose decoder layers do not all fit the budget: the first ``resident`` layers
load as usual, the others stay in the converted checkpoint and are read, every step, into one of
a few slots just before they run (the planner's ``streamed_layers`` and ``layer_slots``).

Every step reads every layer in order, so no eviction policy helps (with fewer slots than
streamed layers, least-recently-used evicts each layer just before it is needed again): the
budget instead keeps as many whole layers resident as fit, and the streamed ones take turns in
the slots, the k-th streamed layer always in slot ``k % slots``. Its linear layers' weights are
views of that slot, set once at load, in the kernels' own layout (the file's: ``<name>.qweight``
/ ``.scale`` / ``.zero``), so the layer computes exactly as a loaded one does. With two slots, a
thread of its own (its ``preadv`` releases the GIL) reads the next streamed layer while this
one computes, and the first one again while the head and the sampler finish the step.

Reads go through ``stored_reads`` (no mapping: the file's pages stay in the page cache, outside
the process's RSS); a file changed or cut short is a ``ModelLoadError`` at the next read.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from torch import nn

from ..sizes import ceil_div
from .quantized import STORED_FIELDS, QuantizedLinear, QuantizedWeight, stored_weight
from .stored_reads import StoredFiles, StoredTensor, anonymous

# Each field's bytes start on a cache line within a slot (float32 scales need 4-byte alignment).
ALIGN = 64
# A decoder layer's quantized linear layers (their module paths in the layer) and the checkpoint
# roles of their parts, stacked by rows (``Family.name_of``).
MATRICES = {
    "self_attn.qkv_proj": ("q", "k", "v"),
    "self_attn.o_proj": ("o",),
    "mlp.gate_up_proj": ("gate", "up"),
    "mlp.down_proj": ("down",),
}
FIELDS = STORED_FIELDS  # a stored matrix's tensors (layers/quantized.py)


@dataclass(frozen=True)
class StoredSegment:
    """Parts of one linear layer that share a format, stacked by rows as ``QuantizedLinear.pack``
    stacks them: per field, each part's tensor in the file; ``codebook`` as the file's codes say."""

    fields: dict[str, list[StoredTensor]]
    codebook: str | None = None


# A decoder layer as stored: module path -> its segments.
StoredLayer = dict[str, list[StoredSegment]]


@dataclass(frozen=True)
class _Placed:
    """One field of one segment in a slot: byte offset, dtype, shape."""

    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def slot_layout(layer: StoredLayer) -> tuple[dict[str, list[dict[str, _Placed]]], int]:
    """Where each field of each segment lies in a slot, and the bytes the layer takes there."""
    end = 0
    placed: dict[str, list[dict[str, _Placed]]] = {}
    for path, segments in layer.items():
        placed[path] = []
        for segment in segments:
            fields = {}
            for name, parts in segment.fields.items():
                shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
                fields[name] = _Placed(end, parts[0].dtype, shape)
                end += ceil_div(sum(p.nbytes for p in parts), ALIGN) * ALIGN
            placed[path].append(fields)
    return placed, end


def layer_bytes(layer: StoredLayer) -> int:
    return slot_layout(layer)[1]


@dataclass
class LayerStreamStats:
    reads: int = 0  # layers read from the file
    bytes_read: int = 0
    waited_s: float = 0.0  # time steps spent waiting for a read, read ahead or not


@dataclass
class _Slot:
    buffer: torch.Tensor  # uint8, over an anonymous mapping of its own
    holds: int | None = None  # the layer whose bytes it holds (None: being read, or nothing yet)
    reading: tuple[int, Future] | None = field(default=None)


class LayerStream:
    """``stored``: layer index -> how it is stored, for every streamed layer (the last ones);
    ``slots``: 1 (each read in the step's path) or 2 (the next read while this layer computes);
    ``layers``: the model's decoder layers, whose streamed ones compute on slot views from now on."""

    def __init__(self, stored: dict[int, StoredLayer], slots: int, layers: Sequence[nn.Module]):
        if not stored or slots < 1:
            raise ValueError("a layer stream needs a layer to stream and a slot")
        self.stored = stored
        self.order = sorted(stored)
        self.stats = LayerStreamStats()
        self._files = StoredFiles()
        self._layouts = {i: slot_layout(layer) for i, layer in stored.items()}
        self.slot_bytes = max(size for _, size in self._layouts.values())
        self._mapping = anonymous(slots * self.slot_bytes)
        whole = torch.frombuffer(self._mapping, dtype=torch.uint8)
        self._slots = [_Slot(whole[s * self.slot_bytes : (s + 1) * self.slot_bytes]) for s in range(slots)]
        self._slot_of = {layer: k % slots for k, layer in enumerate(self.order)}
        self._next = {layer: self.order[(k + 1) % len(self.order)] for k, layer in enumerate(self.order)}
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="pagedllm-layers")
        for layer in stored.values():
            for segments in layer.values():
                for segment in segments:
                    for parts in segment.fields.values():
                        for part in parts:
                            self._files.open(part.file)
        self._attach(layers)

    @property
    def slots(self) -> int:
        return len(self._slots)

    def nbytes(self) -> int:
        return self.slots * self.slot_bytes

    def _attach(self, layers: Sequence[nn.Module]) -> None:
        """Each streamed layer's quantized linear layers compute on views of its slot from now on."""
        for i in self.order:
            placed, _ = self._layouts[i]
            buffer = self._slots[self._slot_of[i]].buffer
            for path, segments in placed.items():
                linear = layers[i].get_submodule(path)
                assert isinstance(linear, QuantizedLinear)
                linear.segments = [
                    _weight(buffer, fields, stored.codebook) for fields, stored in zip(segments, self.stored[i][path])
                ]
                linear.pending, linear.packed, linear.streamed = {}, True, True

    def before(self, layer: int) -> None:
        """Layer ``layer``'s weights in its slot (waiting for a read ahead, or reading now), then
        the next streamed layer's read started where its slot is free."""
        k = self._slot_of.get(layer)
        if k is None:
            return
        slot = self._slots[k]
        if slot.holds != layer:
            started = time.perf_counter()
            if slot.reading is None or slot.reading[0] != layer:
                self._finish(slot)
                self._start(layer)
            self._finish(slot)
            self.stats.waited_s += time.perf_counter() - started
        following = self._next[layer]
        if self._slot_of[following] != k:
            self._start(following)

    def after_step(self) -> None:
        """The step's layers are done: the first streamed layer's read starts (its slot is free now)."""
        self._start(self.order[0])

    def held(self) -> list[int | None]:
        """The layer each slot holds, once the reads in flight are done."""
        for slot in self._slots:
            self._finish(slot)
        return [slot.holds for slot in self._slots]

    def close(self) -> None:
        self._reader.shutdown(wait=True)
        self._files.close()

    def _start(self, layer: int) -> None:
        slot = self._slots[self._slot_of[layer]]
        if slot.holds == layer or (slot.reading is not None and slot.reading[0] == layer):
            return
        self._finish(slot)  # (another layer's read into it: never the case in step order)
        slot.holds = None
        slot.reading = (layer, self._reader.submit(self._fill, layer, slot.buffer))

    def _finish(self, slot: _Slot) -> None:
        if slot.reading is None:
            return
        layer, read = slot.reading
        slot.reading = None
        self.stats.bytes_read += read.result()  # a read's error is raised here, the slot holding nothing
        self.stats.reads += 1
        slot.holds = layer

    def _fill(self, layer: int, buffer: torch.Tensor) -> int:
        """The layer's bytes from the file into its slot; returns how many (on the reader thread:
        it touches nothing but the slot's memory)."""
        done = 0
        placed, _ = self._layouts[layer]
        for path, segments in placed.items():
            for fields, stored in zip(segments, self.stored[layer][path]):
                for name, where in fields.items():
                    offset = where.offset
                    for part in stored.fields[name]:
                        target = buffer[offset : offset + part.nbytes]
                        done += self._files.read_into(part, target, f"layer {layer}'s {path}")
                        offset += part.nbytes
        return done


def _weight(buffer: torch.Tensor, fields: dict[str, _Placed], codebook: str | None) -> QuantizedWeight:
    def view(name: str) -> torch.Tensor | None:
        where = fields.get(name)
        if where is None:
            return None
        count = where.dtype.itemsize * int(torch.Size(where.shape).numel())
        return buffer[where.offset : where.offset + count].view(where.dtype).view(where.shape)

    q = view("qweight")
    assert q is not None
    return stored_weight(q, view("scale"), view("zero"), codebook)
