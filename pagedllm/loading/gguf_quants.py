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
    codes   bits=4 as above, but each q is an index into a table of 16 values (``codebook``:
            ``layers/codebooks.py``), and value = table[q] * scale (+ zero).

    type   block bytes                          bits group   q            scale      zero
    Q4_0   d f16, qs[16]                           4    32   0..15        d          -8 * d
    Q4_1   d f16, m f16, qs[16]                    4    32   0..15        d          m
    Q8_0   d f16, qs int8[32]                      8    32   -128..127    d          None
    Q5_0   d f16, qh[4], qs[16]                    8    32   -16..15      d          None
    Q5_1   d f16, m f16, qh[4], qs[16]             8    32   0..31        d          m
    MXFP4  e uint8, qs[16]                      code    32   mxfp4        2^(e-128)  None
    IQ4_NL d f16, qs[16]                        code    32   iq4_nl       d          None
    IQ4_XS d f16, sc_h u16, sc_l[4], qs[128]    code    32   iq4_nl       d*(sc-32)  None
    Q4_K   d, dmin f16, 6-bit sc/m[12], qs[128]    4    32   0..15        d * sc     -(dmin * m)
    Q5_K   as Q4_K, then qh[32] before qs          8    32   0..31        d * sc     -(dmin * m)
    Q6_K   ql[128], qh[64], sc int8[16], d f16     8    16   -32..31      d * sc     None

Q5_0 and Q5_1 keep their low four bits in qs in Q4_0's order and element j's fifth bit in bit j
of qh read as a little-endian uint32; Q5_0's q is q5 - 16. MXFP4 (OCP microscaling FP4) stores
a power-of-two scale byte e and 32 FP4 e2m1 codes in Q4_0's nibble order; an e2m1 value doubled
is one of 0, 1, 2, 3, 4, 6, 8, 12 with a sign, so q is that doubled value and the scale is half
of 2^(e-127). As in gguf (ggml's ggml_e8m0_to_fp32_half), e = 255 is a number (scale 2^127),
not the NaN the OCP spec makes it, and e = 0 and 1 give subnormal scales. IQ4_NL keeps 32 codes
of a non-linear grid (ggml's kvalues_iq4nl) in Q4_0's order under an f16 d; IQ4_XS is 256 of them
in 8 groups of 32 under one d, each group's 6-bit scale sc (low 4 bits in sc_l, nibble per group,
high 2 in sc_h) standing for sc - 32.

The 4-bit codes stay as stored (the codes layout, a byte shuffle in the kernels). Widened on
loading: Q5_0, Q5_1, Q5_K and Q6_K take one byte per value.

Exactness: scale and zero are the float32 products gguf's ``dequantize`` forms, and q * scale is
exact or is gguf's own product, so ``dequantize(unpack(...))`` equals ``gguf.quants.dequantize``
bit for bit, with one exception: a Q4_0 value that is zero may be +0 where gguf has -0 (gguf
computes d * (q - 8), which is -0 for q = 8 when d < 0 and for q < 8 when d = +0; q * d - 8 * d is
+0). The two are equal as numbers and in every sum. (Non-finite f16 d aside: Q4_0 then gives NaN
where gguf gives an infinity.) Q5_0, Q5_1 and the coded types form gguf's very product, q * d
(+ m), so they match it in every case: -0, non-finite d, and MXFP4's largest scales overflowing to
inf.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..layers.codebooks import CODEBOOKS

SUPPORTED = frozenset({"Q4_0", "Q4_1", "Q4_K", "Q8_0", "Q5_0", "Q5_1", "MXFP4", "IQ4_NL", "IQ4_XS", "Q5_K", "Q6_K"})


@dataclass
class QuantizedTensor:
    """A [rows, cols] weight as q * scale + zero per group of ``group`` columns (see the module
    docstring for the int4 nibble order)."""

    bits: int  # 4 or 8
    group: int  # elements per scale
    qweight: np.ndarray  # bits=4: uint8 [rows, cols // 2]; bits=8: int8 [rows, cols]
    scale: np.ndarray  # float32 [rows, cols // group]
    zero: np.ndarray | None  # float32 [rows, cols // group]; None means 0
    codebook: str | None = None  # 4-bit codes into CODEBOOKS[codebook]; None: q is the value

    @property
    def shape(self) -> tuple[int, int]:
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
    """float32 [rows, cols]: the reference for the kernels, computed as q * scale + zero."""
    rows, cols = qt.shape
    q = _unpack_int4(qt.qweight) if qt.bits == 4 else qt.qweight
    if qt.codebook is not None:
        q = np.array(CODEBOOKS[qt.codebook], dtype=np.int8)[q]
    values = q.astype(np.float32).reshape(rows, -1, qt.group) * qt.scale[..., None]
    if qt.zero is not None:
        values = values + qt.zero[..., None]
    return values.reshape(rows, cols)


def permute_rows(qt: QuantizedTensor, order: np.ndarray) -> QuantizedTensor:
    """The tensor with row i taken from row order[i] (undoes llama.cpp's q/k head permutation)."""
    rows = qt.scale.shape[0]
    if not np.array_equal(np.sort(order), np.arange(rows)):
        raise ValueError(f"row order must be a permutation of 0..{rows - 1}")
    zero = None if qt.zero is None else qt.zero[order]
    return replace(qt, qweight=qt.qweight[order], scale=qt.scale[order], zero=zero)


# --- the nibble order ------------------------------------------------------------------------


def _pack_int4(q: np.ndarray) -> np.ndarray:
    """uint8 [rows, cols] of 0..15 -> [rows, cols // 2]: element j and j + 16 of each 32 share a byte."""
    rows, cols = q.shape
    halves = q.reshape(rows, cols // 32, 2, 16)
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(rows, cols // 2)


def _unpack_int4(packed: np.ndarray) -> np.ndarray:
    """The inverse of _pack_int4."""
    rows, half = packed.shape
    groups = packed.reshape(rows, half // 16, 1, 16)
    return np.concatenate([groups & 0x0F, groups >> 4], axis=2).reshape(rows, half * 2)


# --- block fields ----------------------------------------------------------------------------


def _f16(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The f16 field at byte ``offset`` of every block, as float32 [rows, n_blocks]."""
    return np.ascontiguousarray(blocks[..., offset : offset + 2]).view(np.float16)[..., 0].astype(np.float32)


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins per super-block (ggml's
    get_scale_min_k4): bytes 0-3 hold sc[0..3] and the top bits of sc[4..7], bytes 4-7 hold
    m[0..3] and the top bits of m[4..7], bytes 8-11 the low nibbles of sc[4..7] | m[4..7] << 4."""
    lo, mid, hi = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([lo & 0x3F, (hi & 0x0F) | ((lo >> 6) << 4)], axis=-1)
    m = np.concatenate([mid & 0x3F, (hi >> 4) | ((mid >> 6) << 4)], axis=-1)
    return sc, m


def _per_group(d: np.ndarray, factor: np.ndarray) -> np.ndarray:
    """d [rows, n_blocks] times each block's per-group factors -> float32 [rows, groups]."""
    rows = d.shape[0]
    return (d[..., None] * factor.astype(np.float32)).reshape(rows, -1)


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's 128 qs bytes per super-block -> uint8 [rows, n_blocks, 8, 32] in element
    order: each 32 bytes hold one sub-block in low nibbles and the next in high nibbles."""
    rows, n_blocks, _ = qs.shape
    chunks = qs.reshape(rows, n_blocks, 4, 1, 32)
    return np.concatenate([chunks & 0x0F, chunks >> 4], axis=3).reshape(rows, n_blocks, 8, 32)


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
    d = _f16(b, 0)
    return QuantizedTensor(4, 32, np.ascontiguousarray(b[..., 2:]).reshape(rows, -1), d, np.float32(-8) * d)


def _q4_1(b: np.ndarray) -> QuantizedTensor:
    rows = b.shape[0]
    return QuantizedTensor(4, 32, np.ascontiguousarray(b[..., 4:]).reshape(rows, -1), _f16(b, 0), _f16(b, 2))


def _q8_0(b: np.ndarray) -> QuantizedTensor:
    rows = b.shape[0]
    q = np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(rows, -1)
    return QuantizedTensor(8, 32, q, _f16(b, 0), None)


def _q5_0(b: np.ndarray) -> QuantizedTensor:
    rows = b.shape[0]
    q = _five_bits(b[..., 2:6], b[..., 6:22]).astype(np.int8) - np.int8(16)
    return QuantizedTensor(8, 32, q.reshape(rows, -1), _f16(b, 0), None)


def _q5_1(b: np.ndarray) -> QuantizedTensor:
    rows = b.shape[0]
    q = _five_bits(b[..., 4:8], b[..., 8:24]).astype(np.int8)
    return QuantizedTensor(8, 32, q.reshape(rows, -1), _f16(b, 0), _f16(b, 2))


def _mxfp4(b: np.ndarray) -> QuantizedTensor:
    rows = b.shape[0]
    codes = np.ascontiguousarray(b[..., 1:17]).reshape(rows, -1)  # Q4_0's nibble order already
    scale = np.ldexp(np.float32(1), b[..., 0].astype(np.int32) - 128)  # 2^(e-127) / 2, exact
    return QuantizedTensor(4, 32, codes, scale.astype(np.float32), None, "mxfp4")


def _iq4_nl(b: np.ndarray) -> QuantizedTensor:
    rows = b.shape[0]
    return QuantizedTensor(4, 32, np.ascontiguousarray(b[..., 2:]).reshape(rows, -1), _f16(b, 0), None, "iq4_nl")


def _iq4_xs(b: np.ndarray) -> QuantizedTensor:
    rows = b.shape[0]
    high = np.ascontiguousarray(b[..., 2:4]).view(np.uint16)  # [rows, n_blocks, 1]
    low = b[..., 4:8, None] >> np.array([0, 4], dtype=np.uint8)  # [rows, n_blocks, 4, 2]: groups 2i, 2i+1
    sc = (low.reshape(*b.shape[:2], 8) & 0x0F) | (((high >> np.arange(0, 16, 2, dtype=np.uint16)) & 3) << 4)
    scale = _per_group(_f16(b, 0), sc.astype(np.int8) - np.int8(32))
    return QuantizedTensor(4, 32, np.ascontiguousarray(b[..., 8:]).reshape(rows, -1), scale, None, "iq4_nl")


def _q4_k(b: np.ndarray) -> QuantizedTensor:
    rows = b.shape[0]
    sc, m = _k_scales(b[..., 4:16])
    q = _k_nibbles(b[..., 16:144]).reshape(rows, -1)
    return QuantizedTensor(4, 32, _pack_int4(q), _per_group(_f16(b, 0), sc), -_per_group(_f16(b, 2), m))


def _q5_k(b: np.ndarray) -> QuantizedTensor:
    rows = b.shape[0]
    sc, m = _k_scales(b[..., 4:16])
    # Bit i of qh[j] is the fifth bit of element j of sub-block i.
    high = (b[..., 16:48, None] >> np.arange(8, dtype=np.uint8)) & 1
    q = _k_nibbles(b[..., 48:176]) | (high.swapaxes(-1, -2) << 4)
    return QuantizedTensor(
        8, 32, q.astype(np.int8).reshape(rows, -1), _per_group(_f16(b, 0), sc), -_per_group(_f16(b, 2), m)
    )


def _q6_k(b: np.ndarray) -> QuantizedTensor:
    rows, n_blocks, _ = b.shape
    # Each half (128 elements) has 64 ql bytes and 32 qh bytes. Its four groups of 32 take their
    # low four bits from ql[0:32] low, ql[32:64] low, ql[0:32] high, ql[32:64] high nibbles, and
    # their top two bits from qh[0:32] at bit shifts 0, 2, 4, 6.
    ql = b[..., 0:128].reshape(rows, n_blocks, 2, 1, 64)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=3).reshape(rows, n_blocks, 2, 4, 32)
    qh = b[..., 128:192].reshape(rows, n_blocks, 2, 1, 32)
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3
    q = (low | (high << 4)).astype(np.int8) - np.int8(32)
    sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8)
    return QuantizedTensor(8, 16, q.reshape(rows, -1), _per_group(_f16(b, 208), sc), None)


_UNPACKERS: dict[str, Callable[[np.ndarray], QuantizedTensor]] = {
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q8_0": _q8_0,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "MXFP4": _mxfp4,
    "IQ4_NL": _iq4_nl,
    "IQ4_XS": _iq4_xs,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
}
