"""Weights kept quantized: int8 and int4 matrices, and the linear and embedding layers that read them.

A ``QuantizedWeight`` is one matrix in the layout the CPU kernels read (``kernels/csrc/quant.h``):
``value[n, k] = q[n, k] * scale[n, k // group] + zero[n, k // group]``, or with a ``codebook``
``CODEBOOKS[codebook][q[n, k]] * scale + zero`` (4-bit codes: Q4_0, MXFP4, IQ4_NL, IQ4_XS).
GGUF's Q4_1 maps onto 4-bit q, Q4_0/MXFP4/IQ4_NL/IQ4_XS onto 4-bit codes, Q5_0/Q5_1 onto 5-bit q
as their blocks store them and Q8_0 onto 8-bit q, exactly, their scales as the file has them
where it can (float16 d and m, MXFP4's exponent byte); Q2_K..Q6_K keep their super-blocks
(``block_type``; ``loading/gguf_quants.py``). ``quantize`` makes a matrix from a float checkpoint
tensor (int8: one scale per row, symmetric; int4: Q4_K blocks, or groups of 32 with scale and
offset where a width is not whole blocks of 256).

A ``QuantizedLinear`` multiplies through its backend (``Backend.quantized_matmul``): on the
compiled CPU kernels, few rows (a decode step of a few requests) run the kernel that reads each
packed weight once, so a step costs the bytes of the 4- or 8-bit weights; many rows dequantize
the layer into a transient float buffer and run the float GEMM (the dequantize is paid once for
all rows). No float copy is kept.

``quantization="w8a8"`` (``INT8_COMPUTE``) stores every layer as int8 per output channel and
computes in integers: each step's rows of x are rounded to int8 with one scale per row (a row's
absmax / 127) and multiplied by oneDNN's int8 GEMM (``torch._int_mm``, VNNI dot products), the
int32 sums scaled back to float by the row's and the channel's scales. An int8 GEMM runs at ~3x
oneDNN's float32 one here (docs/quantization.md), at the price of rounding the activations too.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from . import superblocks
from .codebooks import CODEBOOK_NUMBERS, CODEBOOKS
from .linear import StackedRows

if TYPE_CHECKING:
    from ..backends.base import Backend

SCHEMES = ("int8", "int4")  # how weights are stored
INT8_COMPUTE = "w8a8"  # int8 weights and int8 activations: stored as "int8", multiplied in integers
INT4_GROUP = 32
QUANTIZE_CHUNK_ELEMENTS = 4 * 1024 * 1024  # rows quantized at once when loading (float32 temporaries ~5x)


@dataclass
class QuantizedWeight:
    qweight: torch.Tensor  # 4-bit: uint8 [N, K // 2], two per byte; 5-bit: uint8 [N, K // 32 * 20]; 8-bit: int8 [N, K]
    # float32 [N, K // group]; as a GGUF stores it for groups of 32: float16, or MXFP4's uint8
    # exponent bytes e (2^(e - 128))
    scale: torch.Tensor
    zero: torch.Tensor | None  # float32 like scale, or None for 0
    bits: int
    group: int
    codebook: str | None = None  # 4-bit q are codes into CODEBOOKS[codebook]; None: q is the value
    # a K-quant kept as the file stores it (layers/superblocks.py): qweight its blocks' bytes,
    # scale empty [rows, 0], zero None, group 256
    block_type: str | None = None

    @property
    def layout(self) -> int:
        """What the kernels take as ``bits``: the bits, plus 256 x the codebook's number; for a
        K-quant as stored, ``RAW_LAYOUT`` + its ggml type number."""
        if self.block_type is not None:
            return superblocks.RAW_LAYOUT + superblocks.BLOCK_TYPES[self.block_type][0]
        return self.bits + (256 * CODEBOOK_NUMBERS[self.codebook] if self.codebook else 0)

    @property
    def shape(self) -> tuple[int, int]:
        rows, width = self.qweight.shape
        if self.block_type is not None:
            return rows, superblocks.columns(self.block_type, width)
        return rows, columns_of(self.bits, width)

    @property
    def int8_per_row(self) -> bool:
        """int8 with one scale per output row and no offsets: what w8a8's integer GEMM takes."""
        return self.block_type is None and self.bits == 8 and self.zero is None and self.group == self.shape[1]

    @property
    def format(self) -> tuple[int, int, bool, torch.dtype]:
        """What must agree for two weights to stack into one."""
        return self.layout, self.group, self.zero is not None, self.scale.dtype

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scale, self.zero) if t is not None)

    def __getitem__(self, rows: slice | list[int]) -> QuantizedWeight:
        """Rows of it, as a tensor's ``[lo:hi]`` or ``[[i, j, ...]]``: a fused checkpoint tensor's
        parts (``Family.unfuse``; Qwen3-Next's b and a, interleaved per key head, are a list).
        Each row is quantized on its own, so any rows of it are whole rows of the format."""
        if isinstance(rows, slice):
            start, stop, step = rows.indices(self.shape[0])
            if step != 1:
                raise ValueError("a quantized weight's rows are sliced in order only")
            return self.rows(start, stop)
        index = torch.as_tensor(rows, dtype=torch.long)
        return QuantizedWeight(
            self.qweight[index],
            self.scale[index],
            None if self.zero is None else self.zero[index],
            self.bits,
            self.group,
            self.codebook,
            self.block_type,
        )

    def rows(self, start: int, stop: int) -> QuantizedWeight:
        zero = None if self.zero is None else self.zero[start:stop]
        return QuantizedWeight(
            self.qweight[start:stop],
            self.scale[start:stop],
            zero,
            self.bits,
            self.group,
            self.codebook,
            self.block_type,
        )

    @staticmethod
    def stack(parts: list[QuantizedWeight]) -> QuantizedWeight:
        if len(parts) == 1:
            return parts[0]
        first = parts[0]
        zero = None if first.zero is None else torch.cat([p.zero for p in parts if p.zero is not None])
        return QuantizedWeight(
            torch.cat([p.qweight for p in parts]),
            torch.cat([p.scale for p in parts]),
            zero,
            first.bits,
            first.group,
            first.codebook,
            first.block_type,
        )

    @staticmethod
    def of_blocks(blocks: torch.Tensor, block_type: str) -> QuantizedWeight:
        """A K-quant matrix kept as stored: ``blocks`` uint8 [rows, blocks x block bytes]."""
        if block_type not in superblocks.BLOCK_TYPES:
            raise ValueError(f"{block_type} is not a K-quant kept as stored ({', '.join(superblocks.BLOCK_TYPES)})")
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] % superblocks.block_bytes(block_type):
            raise ValueError(f"{block_type} blocks must be uint8 [rows, a multiple of its block's bytes]")
        empty = torch.empty(blocks.shape[0], 0)
        bits = 8 if block_type in ("Q5_K", "Q6_K") else 4  # what its values need, for what reads bits
        return QuantizedWeight(blocks, empty, None, bits, superblocks.SUPERBLOCK, None, block_type)


STORED_FIELDS = ("qweight", "scale", "zero")  # a stored matrix's tensors, as <name>.<field>
FIVE_BIT_GROUP_BYTES = 20  # a Q5 block's qh (4) and qs (16): 32 columns of 5-bit q


def columns_of(bits: int, width: int) -> int:
    """The columns of a ``bits`` matrix whose qweight rows are ``width`` wide."""
    return width * 2 if bits == 4 else width // FIVE_BIT_GROUP_BYTES * 32 if bits == 5 else width


def stored_bits(q_dtype: torch.dtype, width: int, groups: int) -> int:
    """A stored matrix's bits, by its qweight's dtype and row width against its count of scales
    per row: int8 is 8-bit; uint8 is 5-bit where each group of 32 has 20 bytes, else 4-bit."""
    if q_dtype == torch.int8:
        return 8
    return 5 if groups and width == groups * FIVE_BIT_GROUP_BYTES else 4


def stored_weight(
    q: torch.Tensor, scale: torch.Tensor | None, zero: torch.Tensor | None, codebook: str | None = None
) -> QuantizedWeight:
    """A matrix from the tensors a converted checkpoint stores for it (``loading/gguf_convert.py``):
    qweight uint8 [rows, blocks, block bytes] is a K-quant's blocks, their size naming the type;
    else qweight and scale (and zero) give bits and group by their shapes. The loader, the expert
    cache and layer streaming all read stored matrices through this one function."""
    if q.dim() == 3:
        block_type = superblocks.type_of_block(q.shape[2])
        if block_type is None or q.dtype != torch.uint8:
            raise ValueError(f"qweight {list(q.shape)} {q.dtype}: {q.shape[2]}-byte blocks are no K-quant's")
        return QuantizedWeight.of_blocks(q.reshape(q.shape[0], -1), block_type)
    if scale is None:
        raise ValueError("a quantized matrix that is not a K-quant's blocks needs its scale")
    bits = stored_bits(q.dtype, q.shape[1], scale.shape[1])
    return QuantizedWeight(q, scale, zero, bits, columns_of(bits, q.shape[1]) // max(1, scale.shape[1]), codebook)


def empty_quantized(rows: int, columns: int, scheme: str) -> QuantizedWeight:
    """Uninitialised storage for a [rows, columns] matrix in ``scheme``."""
    if scheme not in SCHEMES:
        raise ValueError(f"quantization {scheme!r}: choose one of {', '.join(SCHEMES)}")
    multiple = 16 if scheme == "int8" else INT4_GROUP
    if columns % multiple:
        raise ValueError(f"{scheme} needs a multiple of {multiple} columns, this matrix has {columns}")
    if scheme == "int8":
        return QuantizedWeight(torch.empty(rows, columns, dtype=torch.int8), torch.empty(rows, 1), None, 8, columns)
    if columns % superblocks.SUPERBLOCK == 0:  # Q4_K's blocks: 4.5 bits a weight
        blocks = torch.empty(rows, superblocks.row_bytes("Q4_K", columns), dtype=torch.uint8)
        return QuantizedWeight.of_blocks(blocks, "Q4_K")
    groups = columns // INT4_GROUP
    q = torch.empty(rows, columns // 2, dtype=torch.uint8)
    return QuantizedWeight(q, torch.empty(rows, groups), torch.empty(rows, groups), 4, INT4_GROUP)


def quantize(weight: torch.Tensor, scheme: str, out: QuantizedWeight | None = None) -> QuantizedWeight:
    """A float matrix [N, K] in ``scheme`` ('int8': per-row symmetric; 'int4': GGUF's Q4_K blocks
    where K is a multiple of 256, else groups of 32 with a float32 scale and offset, the layout of
    GGUF's Q4_1), into ``out`` if given (rows of a stacked layer).
    Rows are quantized ``QUANTIZE_CHUNK_ELEMENTS`` at a time: the float32 temporaries stay small
    next to an 8B model's 2 GB embedding matrix."""
    n, k = weight.shape
    out = out if out is not None else empty_quantized(n, k, scheme)
    step = max(1, QUANTIZE_CHUNK_ELEMENTS // k)
    for i in range(0, n, step):
        part = _quantize_rows(weight[i : i + step], scheme)
        for name in ("qweight", "scale", "zero"):
            target = getattr(out, name)
            if target is not None:
                target[i : i + step] = getattr(part, name)
    return out


def _quantize_rows(weight: torch.Tensor, scheme: str) -> QuantizedWeight:
    w = weight.detach().float()
    n, k = w.shape
    if scheme == "int8":
        scale = (w.abs().amax(dim=1, keepdim=True) / 127).clamp_min(1e-12)
        q = torch.round(w / scale).clamp_(-127, 127).to(torch.int8)
        return QuantizedWeight(q, scale, None, 8, k)
    if k % superblocks.SUPERBLOCK == 0:
        return QuantizedWeight.of_blocks(q4_k_blocks(w), "Q4_K")
    groups = w.view(n, k // INT4_GROUP, INT4_GROUP)
    low, high = groups.amin(dim=2), groups.amax(dim=2)
    scale = ((high - low) / 15).clamp_min(1e-12)
    q = torch.round((groups - low[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.uint8)
    q = q.view(n, k // INT4_GROUP, 2, 16)  # per group: columns 0-15 low nibbles, 16-31 high
    packed = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, k // 2)
    return QuantizedWeight(packed.contiguous(), scale.contiguous(), low.contiguous(), 4, INT4_GROUP)


def q4_k_blocks(w: torch.Tensor) -> torch.Tensor:
    """float32 [N, K] (K a multiple of 256) as GGUF Q4_K blocks, uint8 [N, K / 256 x 144].

    Each 32 columns get value = d * sc * q - dmin * m, q in 0..15, sc and m 6-bit multiples of
    the block's f16 d and dmin (d: the largest group step / 63; dmin: the deepest group minimum
    below 0 / 63). A group's step and offset rarely fall on those grids: of the four (sc, m)
    around them (each rounded down and up), the group takes the one with the least squared error,
    which may clip its extremes. The layout (ggml-common.h's block_q4_K): d, dmin, 12 bytes of
    sub-scales (bytes 0-3 sc[0..3] | the top bits of sc[4..7] << 6, bytes 4-7 the same for m,
    bytes 8-11 the low nibbles of sc[4..7] | m[4..7] << 4), then 128 bytes holding groups 2c and
    2c + 1 in the low and high nibbles of bytes 32c .. 32c + 31."""
    n, k = w.shape
    groups = w.reshape(n, k // 256, 8, 32)
    below = (-groups.amin(dim=3)).clamp(min=0)  # how far the offset reaches down (it is never above 0)
    step = (groups.amax(dim=3) + below).clamp(min=0) / 15
    dmin = (below.amax(dim=2) / 63).half().float()
    d = (step.amax(dim=2) / 63).half().float()

    def units(value: torch.Tensor, unit: torch.Tensor) -> torch.Tensor:
        return torch.where(unit[..., None] > 0, value / unit[..., None], 0).floor().clamp(0, 63)

    candidates = []
    for sc in (units(step, d), (units(step, d) + 1).clamp(max=63)):
        for m in (units(below, dmin), (units(below, dmin) + 1).clamp(max=63)):
            scale, offset = (d[..., None] * sc)[..., None], (dmin[..., None] * m)[..., None]
            q = torch.where(scale > 0, (groups + offset) / scale, 0).round().clamp(0, 15)
            candidates.append(((q * scale - offset - groups).square().sum(dim=3), q, sc, m))
    best_error, best_q, best_sc, best_m = candidates[0]
    for error, q, sc, m in candidates[1:]:
        better = error < best_error
        best_error = torch.where(better, error, best_error)
        best_q = torch.where(better[..., None], q, best_q)
        best_sc, best_m = torch.where(better, sc, best_sc), torch.where(better, m, best_m)
    q, sc, m = best_q.to(torch.uint8), best_sc.to(torch.uint8), best_m.to(torch.uint8)
    packed = torch.cat(
        [
            sc[..., :4] | ((sc[..., 4:] >> 4) << 6),
            m[..., :4] | ((m[..., 4:] >> 4) << 6),
            (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4),
        ],
        dim=2,
    )
    pairs = q.view(n, k // 256, 4, 2, 32)
    qs = (pairs[:, :, :, 0] | (pairs[:, :, :, 1] << 4)).reshape(n, k // 256, 128)
    header = torch.stack([d.half(), dmin.half()], dim=2).view(torch.uint8).reshape(n, k // 256, 4)
    return torch.cat([header, packed, qs], dim=2).reshape(n, -1).contiguous()


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of x as int8 steps of the row's absmax / 127, and that step ([rows, 1], float32)."""
    x = x.float()
    step = x.abs().amax(dim=1, keepdim=True).clamp_min_(1e-30).div_(127)
    return torch.round(x / step).to(torch.int8), step


def scale_values(scale: torch.Tensor) -> torch.Tensor:
    """float32 scales: float32 and float16 as they are; MXFP4's uint8 exponent bytes e as
    2^(e - 128), built from their bits (2^-128 and 2^-127 are subnormal)."""
    if scale.dtype != torch.uint8:
        return scale.float()
    e = scale.int()
    bits = torch.where(e >= 2, (e - 1) << 23, torch.bitwise_left_shift(torch.ones_like(e), 21 + e.clamp(max=1)))
    return bits.view(torch.float32)


@functools.cache
def _codebook_values(codebook: str) -> torch.Tensor:
    """A codebook's 16 values as a float32 tensor, made once (the reference path runs per call)."""
    return torch.tensor(CODEBOOKS[codebook], dtype=torch.float32)


def dequantize_reference(w: QuantizedWeight, dtype: torch.dtype, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The float values of ``w`` (or of its ``rows``), in ``dtype``, in plain PyTorch."""
    if rows is not None:
        zero = None if w.zero is None else w.zero[rows]
        w = QuantizedWeight(w.qweight[rows], w.scale[rows], zero, w.bits, w.group, w.codebook, w.block_type)
    if w.block_type is not None:  # the gguf package's own dequantize (numpy) reads the blocks
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        stored = dequantize(w.qweight.numpy(), GGMLQuantizationType[w.block_type])
        return torch.from_numpy(stored).to(dtype)
    n, k = w.shape
    if w.bits in (4, 5):
        groups = w.qweight.view(n, k // 32, -1)
        packed = groups[..., -16:].unsqueeze(2)  # 5-bit: qs after the 4 bytes of qh
        q = torch.cat([packed & 15, packed >> 4], dim=2).view(n, k // 32, 32)
        if w.bits == 5:  # bit j of qh (little-endian) is element j's fifth bit
            qh = groups[..., :4].long()
            word = qh[..., 0] | qh[..., 1] << 8 | qh[..., 2] << 16 | qh[..., 3] << 24
            q = q | (((word[..., None] >> torch.arange(32)) & 1) << 4).to(torch.uint8)
        q = q.view(n, k)
        q = _codebook_values(w.codebook)[q.long()] if w.codebook else q.float()
    else:
        q = w.qweight.float()
    values = q.view(n, k // w.group, w.group) * scale_values(w.scale)[..., None]
    if w.zero is not None:
        values += w.zero.float()[..., None]
    return values.view(n, k).to(dtype)


class QuantizedLinear(StackedRows):
    """A linear layer on quantized weights, stacked by rows like ``Linear`` (q/k/v, gate/up).

    Checkpoint tensors arrive one by one. A float one (``load_part``) is quantized straight into
    its rows of the stacked matrix. One stored quantized (``load_quantized_part``) is kept as it
    is, and ``pack`` stacks those by runs of parts that share a format (a GGUF file may store v in
    6 bits next to q and k in 4).
    """

    def __init__(self, in_features: int, parts: list[int], bias: bool, scheme: str | None, backend: Backend):
        super().__init__(in_features, parts)
        self.backend = backend
        # w8a8: the GEMM runs in integers, so every part is int8 per channel, whatever the file holds
        self.int8_activations = scheme == INT8_COMPUTE
        self.requantize = self.int8_activations  # a part stored quantized is dequantized and quantized again
        self.scheme = "int8" if self.int8_activations else scheme  # how float tensors are quantized; None: as stored
        # made in the checkpoint's dtype by the first part loaded (a layer is swapped in for a float
        # one after the model is built, off the meta device)
        self.bias = nn.Parameter(torch.empty(sum(parts), device="meta"), requires_grad=False) if bias else None
        self.pending: dict[int, QuantizedWeight] = {}
        self.segments: list[QuantizedWeight] = []
        self.packed = False
        self.streamed = False  # a routed expert's: its segments are an expert cache's slot while resident

    def load_part(self, name: str, index: int, tensor: torch.Tensor) -> None:
        if name == "bias":
            if self.bias is None or self.bias.is_meta:
                self.bias = nn.Parameter(torch.empty(sum(self.parts), dtype=tensor.dtype), requires_grad=False)
            self.bias.data[self.part_rows(index)].copy_(tensor)
            return
        if self.scheme is None:
            raise ValueError("this layer's weights must come quantized")
        if not self.segments:
            self.segments = [empty_quantized(sum(self.parts), self.in_features, self.scheme)]
        rows = self.part_rows(index)
        quantize(tensor, self.scheme, out=self.segments[0].rows(rows.start, rows.stop))

    def load_quantized_part(self, index: int, weight: QuantizedWeight) -> None:
        self.pending[index] = weight

    def pack(self) -> None:
        if self.packed or not self.pending:  # quantized at load: stacked already
            self.packed = True
            return
        parts = [self.pending.pop(i) for i in range(len(self.parts))]
        runs: list[list[QuantizedWeight]] = []
        for part in parts:
            if runs and runs[-1][0].format == part.format:
                runs[-1].append(part)
            else:
                runs.append([part])
        self.segments = [QuantizedWeight.stack(run) for run in runs]
        self.packed = True

    def quantized_weights(self) -> list[QuantizedWeight]:
        return [*self.segments, *self.pending.values()]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        matmul = self.backend.int8_matmul if self.int8_activations else self.backend.quantized_matmul
        outs = [matmul(x, s) for s in self.segments]
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        if self.bias is not None:
            y += self.bias
        return y


class QuantizedEmbedding(StackedRows):
    """Token embeddings kept quantized: a lookup dequantizes only the rows it reads. A tied
    lm_head multiplies by the same weight (``DecoderLM.tie_embeddings``)."""

    def __init__(
        self, num_embeddings: int, embedding_dim: int, scheme: str | None, dtype: torch.dtype, backend: Backend
    ):
        super().__init__(embedding_dim, [num_embeddings])
        self.backend = backend
        self.scheme = scheme  # how a float checkpoint tensor is quantized; None: it comes quantized
        self.dtype = dtype  # of the activations a lookup returns
        self.weight_q: QuantizedWeight | None = None
        self.requantize = False  # set under w8a8, whose tied lm_head needs int8 per row

    def load_part(self, name: str, index: int, tensor: torch.Tensor) -> None:
        if self.scheme is None:
            raise ValueError("these embeddings must come quantized")
        self.load_quantized_part(index, quantize(tensor, self.scheme))

    def load_quantized_part(self, index: int, weight: QuantizedWeight) -> None:
        self.weight_q = weight

    def quantized_weights(self) -> list[QuantizedWeight]:
        return [] if self.weight_q is None else [self.weight_q]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        assert self.weight_q is not None, "embeddings not loaded"
        return self.backend.dequantize(self.weight_q, self.dtype, rows=ids)
