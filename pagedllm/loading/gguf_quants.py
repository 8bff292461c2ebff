"""Unpacks quantized GGUF tensors into the two group-wise formats our kernels read, keeping every
value exactly.

ggml stores each quantization type as its own block struct (ggml-common.h); our kernels read just
two layouts instead, so a new GGUF type costs one unpacker here and no kernel. Every supported
type is affine per group of ``group`` elements:

    value[r, k] = q[r, k] * scale[r, k // group] + zero[r, k // group]      (zero None: + 0)

    bits=4  qweight uint8 [rows, cols // 2], group 32. Within the group starting at column k0,
            byte k0 // 2 + j holds element k0 + j in its low nibble and k0 + 16 + j in its high
            nibble (the order Q4_0 and Q4_1 blocks already use); q is unsigned 0..15.
    bits=8  qweight int8 [rows, cols].
    bits=5  qweight uint8 [rows, cols // 32 * 20]: per 32 columns a Q5 block's qh (4 bytes, bit j
            of it as a little-endian uint32 is element j's fifth bit) then its qs (the low four
            bits, in 4-bit's nibble order), as the file stores them; q is 0..31, Q5_0's codebook
            q5_0 making it q - 16.
    codes   bits=4 as above, but each q is an index into a table of 16 values (``codebook``:
            ``layers/codebooks.py``), and value = table[q] * scale (+ zero).

    type   block bytes                          bits group   q            scale      zero
    Q4_0   d f16, qs[16]                        code    32   q4_0 (q-8)   d          None
    Q4_1   d f16, m f16, qs[16]                    4    32   0..15        d          m
    Q8_0   d f16, qs int8[32]                      8    32   -128..127    d          None
    Q5_0   d f16, qh[4], qs[16]                    5    32   q5_0 (q-16)  d          None
    Q5_1   d f16, m f16, qh[4], qs[16]             5    32   0..31        d          m
    MXFP4  e uint8, qs[16]                      code    32   mxfp4        e: 2^(e-128) None
    IQ4_NL d f16, qs[16]                        code    32   iq4_nl       d          None

Kept as the file stores them, byte for byte (``layers/superblocks.py``; the kernels decode them,
``kernels/csrc/quant_blocks.h``): Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and IQ4_XS, super-blocks of 256
columns whose sub-scales are packed in 4 or 6 bits (Q6_K: int8) under an f16 d. Their ``QuantizedTensor``
has ``block_type`` set and qweight the blocks, uint8 [rows, blocks, block bytes]. Widened to a
float32 scale and offset per 32 columns, as they were before, Q4_K took 6 bits a weight where the
file takes 4.5 (a Q4_K_M file 1.39x its bytes in RAM).

Q5_0 and Q5_1 keep their low four bits in qs in Q4_0's order and element j's fifth bit in bit j
of qh read as a little-endian uint32; Q5_0's q is q5 - 16. MXFP4 (OCP microscaling FP4) stores
a power-of-two scale byte e and 32 FP4 e2m1 codes in Q4_0's nibble order; an e2m1 value doubled
is one of 0, 1, 2, 3, 4, 6, 8, 12 with a sign, so q is that doubled value and the scale is half
of 2^(e-127). As in gguf (ggml's ggml_e8m0_to_fp32_half), e = 255 is a number (scale 2^127),
not the NaN the OCP spec makes it, and e = 0 and 1 give subnormal scales. IQ4_NL keeps 32 codes
of a non-linear grid (ggml's kvalues_iq4nl) in Q4_0's order under an f16 d; IQ4_XS is 256 of them
in 8 groups of 32 under one d, each group's 6-bit scale sc (low 4 bits in sc_l, nibble per group,
high 2 in sc_h) standing for sc - 32.

The 4-bit codes stay as stored (the codes layout, a byte shuffle in the kernels).

Scales in the file's bytes: where scale and zero are a block's own f16 d and m (Q4_0, Q4_1, Q8_0,
Q5_0, Q5_1, IQ4_NL: ``FLOAT16_SCALES``) they stay float16, so these take in RAM exactly the file's
bytes (float32 scales cost Q4_0 1.33x and Q8_0 1.06x; Q5_0 and Q5_1 took a byte a value, 1.64x
and 1.67x, until December 6). MXFP4 keeps its scale byte e (uint8 scale, read as 2^(e-128):
``E8M0_SCALES``; as float32 it cost 1.18x). IQ4_XS, whose d x (sc - 32) per 32 cost 1.18x as
float32 (a product float16 does not always hold), keeps its super-blocks as the K-quants do.

Exactness: scale and zero are the products gguf's ``dequantize`` forms, and q * scale is exact or
is gguf's own product, so ``dequantize(unpack(...))`` equals ``gguf.quants.dequantize`` bit for
bit, -0 and non-finite d included: every type forms gguf's very product, q * d (+ m) (Q4_0 with
its codes q - 8, as gguf's d * (q - 8)), and MXFP4's largest scales overflow to inf as gguf's do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..layers.codebooks import CODEBOOKS
from ..layers.superblocks import BLOCK_TYPES, SUPERBLOCK

KEPT_AS_STORED = frozenset(BLOCK_TYPES)
FLOAT16_SCALES = frozenset({"Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "IQ4_NL"})  # scale, zero: the file's f16
E8M0_SCALES = frozenset({"MXFP4"})  # scale: the file's byte e, standing for 2^(e - 128)
SUPPORTED = frozenset({"Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "MXFP4", "IQ4_NL", "IQ4_XS"}) | KEPT_AS_STORED


@dataclass
class QuantizedTensor:
    """A [rows, cols] weight as q * scale + zero per group of ``group`` columns (see the module
    docstring for the int4 nibble order), or a K-quant's blocks as stored (``block_type``)."""

    bits: int  # 4, 5 or 8
    group: int  # elements per scale
    # bits=4: uint8 [rows, cols // 2]; 5: uint8 [rows, cols // 32 * 20]; 8: int8 [rows, cols];
    # blocks: uint8 [rows, n, bytes]
    qweight: np.ndarray
    scale: np.ndarray  # float32, float16 or uint8 exponents [rows, cols // group]; blocks: [rows, 0]
    zero: np.ndarray | None  # like scale; None means 0
    codebook: str | None = None  # 4-bit codes into CODEBOOKS[codebook]; None: q is the value
    block_type: str | None = None  # a K-quant kept as stored: qweight its blocks

    @property
    def shape(self) -> tuple[int, int]:
        if self.block_type is not None:
            return self.qweight.shape[0], self.qweight.shape[1] * SUPERBLOCK
        rows, groups = self.scale.shape
        return rows, groups * self.group


def unpack(type_name: str, raw: np.ndarray, rows: int, cols: int) -> QuantizedTensor:
    """The tensor whose GGUF bytes are ``raw`` (``GGUFReader``'s ``tensor.data``: any shape with
    rows * cols / block elements' worth of blocks, row-major) in our format."""
    unpacker = _UNPACKERS.get(type_name)
    if unpacker is None:
        raise ValueError(
            f"GGUF tensor type {type_name} cannot be loaded quantized (supported: {', '.join(sorted(SUPPORTED))}); "
            "dequantize it to float instead"
        )
    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    if cols % block:
        raise ValueError(f"{type_name} tensor has {cols} columns, not a multiple of its block size {block}")
    n_blocks = cols // block
    raw = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if raw.size != rows * n_blocks * type_size:
        raise ValueError(
            f"{type_name} tensor [{rows}, {cols}] needs {rows * n_blocks * type_size} bytes, got {raw.size}"
        )
    return unpacker(raw.reshape(rows, n_blocks, type_size))


def dequantize(qt: QuantizedTensor) -> np.ndarray:
    """float32 [rows, cols]: the reference for the kernels, computed as q * scale + zero (blocks
    kept as stored: as the gguf package dequantizes them)."""
    rows, cols = qt.shape
    if qt.block_type is not None:
        from gguf.quants import dequantize as gguf_dequantize

        values = gguf_dequantize(qt.qweight.reshape(rows, -1), GGMLQuantizationType[qt.block_type])
        return np.asarray(values, dtype=np.float32).reshape(rows, cols)
    q = _unpack_int4(qt.qweight) if qt.bits == 4 else _unpack_int5(qt.qweight) if qt.bits == 5 else qt.qweight
    if qt.codebook is not None:
        q = np.array(CODEBOOKS[qt.codebook], dtype=np.int8)[q]
    values = q.astype(np.float32).reshape(rows, -1, qt.group) * scale_values(qt.scale)[..., None]
    if qt.zero is not None:
        values = values + qt.zero.astype(np.float32)[..., None]
    return values.reshape(rows, cols)


def scale_values(scale: np.ndarray) -> np.ndarray:
    """float32 scales: float16 and float32 as they are, uint8 exponent bytes e as 2^(e - 128)."""
    if scale.dtype == np.uint8:
        return np.ldexp(np.float32(1), scale.astype(np.int32) - 128).astype(np.float32)  # exact
    return scale.astype(np.float32)


def permute_rows(qt: QuantizedTensor, order: np.ndarray) -> QuantizedTensor:
    """The tensor with row i taken from row order[i] (undoes llama.cpp's q/k head permutation)."""
    rows = qt.scale.shape[0]
    if not np.array_equal(np.sort(order), np.arange(rows)):
        raise ValueError(f"row order must be a permutation of 0..{rows - 1}")
    zero = None if qt.zero is None else qt.zero[order]
    return replace(qt, qweight=qt.qweight[order], scale=qt.scale[order], zero=zero)


def _kept_as_stored(type_name: str) -> Callable[[np.ndarray], QuantizedTensor]:
    """The unpacker of a K-quant: its blocks as they are, no value touched."""

    def blocks(b: np.ndarray) -> QuantizedTensor:
        empty = np.empty((b.shape[0], 0), dtype=np.float32)
        return QuantizedTensor(4, SUPERBLOCK, b.copy(), empty, None, None, type_name)  # a copy: b maps the file

    return blocks


# --- the nibble order ------------------------------------------------------------------------


def _unpack_int4(packed: np.ndarray) -> np.ndarray:
    """uint8 [rows, cols // 2] -> [rows, cols] of 0..15: element j and j + 16 of each 32 share a byte."""
    rows, half = packed.shape
    groups = packed.reshape(rows, half // 16, 1, 16)
    return np.concatenate([groups & 0x0F, groups >> 4], axis=2).reshape(rows, half * 2)


def _unpack_int5(packed: np.ndarray) -> np.ndarray:
    """uint8 [rows, cols // 32 * 20] (qh then qs per 32) -> [rows, cols] of 0..31."""
    rows = packed.shape[0]
    groups = packed.reshape(rows, -1, 20)
    return _five_bits(groups[..., :4], groups[..., 4:]).reshape(rows, -1)


# --- block fields ----------------------------------------------------------------------------


def _f16(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The f16 field at byte ``offset`` of every block, float16 [rows, n_blocks] as stored."""
    return np.ascontiguousarray(blocks[..., offset : offset + 2]).view(np.float16)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes per block -> uint8 [..., 32] in element order: byte j holds element j in its low
    nibble and j + 16 in its high one (Q4_0's order)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _five_bits(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's 4 qh and 16 qs bytes per block -> uint8 [..., 32] of 0..31: bit j of qh as a
    little-endian uint32 (bit j % 8 of byte j // 8) is element j's fifth bit."""
    return _nibbles(qs) | (np.unpackbits(qh, axis=-1, bitorder="little") << 4)


# --- one unpacker per type: uint8 [rows, n_blocks, type_size] -> QuantizedTensor --------------


def _q4_0(b: np.ndarray) -> QuantizedTensor:
    rows = b.shape[0]
    return QuantizedTensor(4, 32, np.ascontiguousarray(b[..., 2:]).reshape(rows, -1), _f16(b, 0), None, "q4_0")


def _q4_1(b: np.ndarray) -> QuantizedTensor:
    rows = b.shape[0]
    return QuantizedTensor(4, 32, np.ascontiguousarray(b[..., 4:]).reshape(rows, -1), _f16(b, 0), _f16(b, 2))


def _q8_0(b: np.ndarray) -> QuantizedTensor:
    rows = b.shape[0]
    q = np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(rows, -1)
    return QuantizedTensor(8, 32, q, _f16(b, 0), None)


def _q5_0(b: np.ndarray) -> QuantizedTensor:  # the block less d: qh and qs as stored
    rows = b.shape[0]
    return QuantizedTensor(5, 32, np.ascontiguousarray(b[..., 2:]).reshape(rows, -1), _f16(b, 0), None, "q5_0")


def _q5_1(b: np.ndarray) -> QuantizedTensor:  # the block less d and m
    rows = b.shape[0]
    return QuantizedTensor(5, 32, np.ascontiguousarray(b[..., 4:]).reshape(rows, -1), _f16(b, 0), _f16(b, 2))


def _mxfp4(b: np.ndarray) -> QuantizedTensor:
    rows = b.shape[0]
    codes = np.ascontiguousarray(b[..., 1:17]).reshape(rows, -1)  # Q4_0's nibble order already
    return QuantizedTensor(4, 32, codes, np.ascontiguousarray(b[..., 0]), None, "mxfp4")  # e: 2^(e-127) / 2


def _iq4_nl(b: np.ndarray) -> QuantizedTensor:
    rows = b.shape[0]
    return QuantizedTensor(4, 32, np.ascontiguousarray(b[..., 2:]).reshape(rows, -1), _f16(b, 0), None, "iq4_nl")


_UNPACKERS: dict[str, Callable[[np.ndarray], QuantizedTensor]] = {
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q8_0": _q8_0,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "MXFP4": _mxfp4,
    "IQ4_NL": _iq4_nl,
    **{name: _kept_as_stored(name) for name in KEPT_AS_STORED},
}
