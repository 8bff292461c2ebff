"""Quantized GGUF tensors unpack into our group-wise formats without changing a single value:
gguf's own dequantize is the oracle."""

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from pagedllm.loading.gguf_quants import (
    FLOAT16_SCALES,
    KEPT_AS_STORED,
    SUPPORTED,
    QuantizedTensor,
    dequantize,
    permute_rows,
    unpack,
)

# Byte offsets of each type's f16 fields (d, and dmin or m) inside its block.
_F16_FIELDS = {
    "Q4_0": [0],
    "Q4_1": [0, 2],
    "Q8_0": [0],
    "Q5_0": [0],
    "Q5_1": [0, 2],
    "MXFP4": [],
    "IQ4_NL": [0],
    "IQ4_XS": [0],
    "Q2_K": [80, 82],
    "Q3_K": [108],
    "Q4_K": [0, 2],
    "Q5_K": [0, 2],
    "Q6_K": [208],
}
# MXFP4's scale byte e (2^(e-127)) at the ends of its range, where gguf's scale is subnormal
# (0, 1), overflows a product to inf (253..255) or reads 255 as a number, and around 1.
_E8M0_EDGES = np.array([0, 1, 2, 126, 127, 128, 252, 253, 254, 255], dtype=np.uint8)
# bits, group, qweight dtype, qweight columns per weight column, has a zero (the coded types:
# their codebook in _CODEBOOK)
_CODEBOOK = {"Q4_0": "q4_0", "Q5_0": "q5_0", "MXFP4": "mxfp4", "IQ4_NL": "iq4_nl"}
_FORMAT = {
    "Q4_0": (4, 32, np.uint8, 0.5, False),
    "Q4_1": (4, 32, np.uint8, 0.5, True),
    "Q8_0": (8, 32, np.int8, 1, False),
    "Q5_0": (5, 32, np.uint8, 20 / 32, False),
    "Q5_1": (5, 32, np.uint8, 20 / 32, True),
    "MXFP4": (4, 32, np.uint8, 0.5, False),
    "IQ4_NL": (4, 32, np.uint8, 0.5, False),
}


def random_blocks(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Every bit pattern of the quantized fields, with finite f16 scales (signs, zeros,
    subnormals and the largest magnitude included) and MXFP4's scale byte at its edges."""
    rng = np.random.default_rng(seed)
    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    raw = rng.integers(0, 256, (rows, cols // block * type_size), dtype=np.uint8)
    blocks = raw.reshape(rows, cols // block, type_size)
    for offset in _F16_FIELDS[type_name]:
        d = (rng.standard_normal(blocks.shape[:2]) * 10.0 ** rng.integers(-7, 1, blocks.shape[:2])).astype(np.float16)
        d[0, 0], d[-1, -1] = 0.0, -65504.0
        blocks[..., offset : offset + 2] = d[..., None].view(np.uint8)
    if type_name == "MXFP4":
        blocks[..., 0].flat[: len(_E8M0_EDGES)] = _E8M0_EDGES
    return raw


def assert_exact(type_name: str, ours: np.ndarray, raw: np.ndarray) -> None:
    expected = gguf_dequantize(raw, GGMLQuantizationType[type_name])
    assert ours.dtype == np.float32 and ours.shape == expected.shape
    np.testing.assert_array_equal(ours.view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("type_name", sorted(SUPPORTED))
def test_every_supported_type_unpacks_to_gguf_values_bit_for_bit(type_name):
    rows, cols = 5, 512
    raw = random_blocks(type_name, rows, cols)
    qt = unpack(type_name, raw, rows, cols)
    with np.errstate(over="ignore"):  # MXFP4's largest scales times 12: inf, as gguf has it
        assert_exact(type_name, dequantize(qt), raw)

    if type_name in KEPT_AS_STORED:  # the file's blocks, byte for byte
        assert qt.block_type == type_name and qt.shape == (rows, cols) and qt.zero is None
        np.testing.assert_array_equal(qt.qweight.reshape(rows, -1), raw)
        return
    bits, group, dtype, per_col, has_zero = _FORMAT[type_name]
    assert (qt.bits, qt.group, qt.shape, qt.codebook) == (bits, group, (rows, cols), _CODEBOOK.get(type_name))
    assert qt.qweight.dtype == dtype and qt.qweight.shape == (rows, int(cols * per_col))
    # a block's own f16 d (and m) kept as float16, as the file has them; products as float32
    scale_dtype = np.float16 if type_name in ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "IQ4_NL") else np.float32
    if type_name == "MXFP4":  # its scale byte e as stored
        scale_dtype = np.uint8
    assert FLOAT16_SCALES == {"Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "IQ4_NL"}
    assert qt.scale.dtype == scale_dtype and qt.scale.shape == (rows, cols // group)
    assert (qt.zero is not None) == has_zero
    if qt.zero is not None:
        assert qt.zero.dtype == scale_dtype and qt.zero.shape == qt.scale.shape
    assert all(a.flags.c_contiguous for a in (qt.qweight, qt.scale, qt.zero) if a is not None)


@pytest.mark.parametrize("type_name", sorted(SUPPORTED - KEPT_AS_STORED))
def test_q_stays_in_its_range(type_name):
    qt = unpack(type_name, random_blocks(type_name, 3, 256), 3, 256)
    lo, hi = {
        "Q4_0": (0, 15),
        "Q4_1": (0, 15),
        "Q8_0": (-128, 127),
        "Q5_0": (0, 31),  # codes: q5_0's table makes them q - 16
        "Q5_1": (0, 31),
        "MXFP4": (0, 15),  # codes
        "IQ4_NL": (0, 15),
    }[type_name]
    q = qt.qweight
    if qt.bits == 4:
        q = np.concatenate([q & 0x0F, q >> 4])
    if qt.bits == 5:  # per 32 columns: qh (bit j of the little-endian word: element j's fifth bit), qs
        groups = q.reshape(3, -1, 20)
        qh = groups[..., :4].copy().view("<u4")  # [3, groups, 1]
        qs = groups[..., 4:]
        low = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
        q = low | (((qh >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.uint8)
    assert q.min() == lo and q.max() == hi


def test_the_codebooks_are_the_gguf_packages_and_the_kernels_read_the_same(ops):
    """layers/codebooks.py against gguf's kvalues, and the kernels' own tables (quant.h) against
    those: each code's value comes out of the compiled dequantize as the table says."""
    import torch
    from gguf.quants import IQ4_NL, MXFP4

    from pagedllm.layers.codebooks import CODEBOOKS
    from pagedllm.layers.quantized import QuantizedWeight

    # Q4_0 and Q5_0: gguf's values are d x (q - 8) and d x (q - 16) (ggml-common.h's block_q4_0
    # and block_q5_0), arithmetic written here
    assert CODEBOOKS == {
        "mxfp4": tuple(MXFP4.kvalues),
        "iq4_nl": tuple(IQ4_NL.kvalues),
        "q4_0": tuple(q - 8 for q in range(16)),
        "q5_0": tuple(q - 16 for q in range(32)),
    }
    codes = torch.tensor([j | ((15 - j) << 4) for j in range(16)], dtype=torch.uint8)[None, :]
    five = torch.tensor([[0, 0, 0xFF, 0xFF] + [j | ((15 - j) << 4) for j in range(16)]], dtype=torch.uint8)
    w = QuantizedWeight(five, torch.ones(1, 1), None, 5, 32, "q5_0")  # q: 0..15, then 16 + (15..0)
    got = ops.dequantize(w.qweight, w.scale, w.zero, w.layout, w.group, None, torch.float32)
    assert got[0].tolist() == [float(v) for v in CODEBOOKS["q5_0"][:16] + CODEBOOKS["q5_0"][16:][::-1]]
    for name, table in CODEBOOKS.items():
        if len(table) != 16:
            continue
        w = QuantizedWeight(codes, torch.ones(1, 1), None, 4, 32, name)
        got = ops.dequantize(w.qweight, w.scale, w.zero, w.layout, w.group, None, torch.float32)
        assert got[0].tolist() == [float(v) for v in table + table[::-1]]


@pytest.mark.parametrize("type_name", ["Q4_0", "Q5_0", "Q5_1"])
def test_q4_0_and_q5_types_match_gguf_for_non_finite_scales_too(type_name):
    # These form gguf's own product even for inf and NaN d or m (Q4_0: its codes q - 8 times d).
    raw = random_blocks(type_name, 2, 256)
    blocks = raw.reshape(2, 8, -1)
    special = np.array([np.inf, -np.inf, np.nan, 1.0], dtype=np.float16)[:, None].view(np.uint8)
    for offset, first in zip(_F16_FIELDS[type_name], [0, 2]):  # d in blocks 0-3, m in 2-5
        blocks[0, first : first + 4, offset : offset + 2] = special
    with np.errstate(invalid="ignore"):  # inf * 0
        assert_exact(type_name, dequantize(unpack(type_name, raw, 2, 256)), raw)


# the types the gguf package quantizes
@pytest.mark.parametrize("type_name", sorted(SUPPORTED & {"Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "MXFP4"}))
def test_weights_quantized_by_gguf_unpack_exactly(type_name):
    weights = np.random.default_rng(1).standard_normal((4, 96)).astype(np.float32)
    raw = gguf_quantize(weights, GGMLQuantizationType[type_name])
    assert_exact(type_name, dequantize(unpack(type_name, raw, 4, 96)), raw)


def test_int4_nibble_order_low_is_element_j_high_is_element_j_plus_16():
    # One Q4_1 block, d = 1, m = 0.5: byte j holds j in its low nibble and 15 - j in its high one.
    qs = np.array([j | ((15 - j) << 4) for j in range(16)], dtype=np.uint8)
    header = np.array([1.0, 0.5], dtype=np.float16).view(np.uint8)
    raw = np.concatenate([header, qs])[None, :]
    qt = unpack("Q4_1", raw, 1, 32)
    np.testing.assert_array_equal(qt.qweight[0], qs)
    expected = [j + 0.5 for j in range(16)] + [15 - j + 0.5 for j in range(16)]
    np.testing.assert_array_equal(dequantize(qt)[0], np.array(expected, dtype=np.float32))


def test_a_q4_k_block_reads_as_ggml_lays_it_out():
    # A Q4_K super-block with d = 1, dmin = 0.5, sub-block j's scale j + 1 and min 1 except
    # sub-block 5's 40 (its 6 bits split: low nibble in byte 9, top 2 bits in byte 5's top bits)
    # and every q 3: element k of sub-block j is 3 (j + 1) - 0.5 m_j. qs byte c*32 + i holds
    # element c*64 + i (low) and c*64 + 32 + i (high).
    sc, m = list(range(1, 9)), [1] * 8
    m[5] = 40
    packed = [sc[i] | ((sc[4 + i] >> 4) << 6) for i in range(4)] + [m[i] | ((m[4 + i] >> 4) << 6) for i in range(4)]
    packed += [(sc[4 + i] & 15) | ((m[4 + i] & 15) << 4) for i in range(4)]
    header = np.array([1.0, 0.5], dtype=np.float16).view(np.uint8)
    raw = np.concatenate([header, np.array(packed, dtype=np.uint8), np.full(128, 0x33, dtype=np.uint8)])[None, :]
    expected = np.repeat([3.0 * sc[j] - 0.5 * m[j] for j in range(8)], 32).astype(np.float32)
    np.testing.assert_array_equal(dequantize(unpack("Q4_K", raw, 1, 256))[0], expected)
    assert_exact("Q4_K", dequantize(unpack("Q4_K", raw, 1, 256)), raw)


def test_mxfp4_reads_e2m1_codes_scaled_by_2_to_the_e_minus_127():
    # e = 127 is a scale of 1: the values are the OCP spec's e2m1 table itself (code 8, -0, reads
    # as +0 as in gguf). Byte j holds code j in its low nibble (element j), 15 - j in its high one.
    e2m1 = [0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6]
    codes = np.array([j | ((15 - j) << 4) for j in range(16)], dtype=np.uint8)
    for e, scale in [(127, 1.0), (130, 8.0), (1, 2.0**-126)]:
        qt = unpack("MXFP4", np.concatenate([[e], codes]).astype(np.uint8)[None, :], 1, 32)
        expected = np.array(e2m1 + e2m1[::-1], dtype=np.float32) * np.float32(scale)
        np.testing.assert_array_equal(dequantize(qt)[0].view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("type_name", ["Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_permute_rows_moves_every_array_with_its_row(type_name):
    rows, cols = 6, 256
    qt = unpack(type_name, random_blocks(type_name, rows, cols), rows, cols)
    order = np.array([3, 0, 5, 1, 4, 2])
    moved = permute_rows(qt, order)
    assert isinstance(moved, QuantizedTensor) and (moved.bits, moved.group) == (qt.bits, qt.group)
    np.testing.assert_array_equal(dequantize(moved), dequantize(qt)[order])
    with pytest.raises(ValueError, match="permutation"):
        permute_rows(qt, np.array([0, 0, 1, 2, 3, 4]))


@pytest.mark.parametrize("type_name", ["IQ3_S", "F16", "IQ2_XS", "Q8_K"])
def test_an_unsupported_type_is_refused_by_name(type_name):
    with pytest.raises(ValueError, match=type_name):
        unpack(type_name, np.zeros((1, 256), dtype=np.uint8), 1, 256)


def test_a_size_that_does_not_match_the_type_is_refused():
    with pytest.raises(ValueError, match="block size 256"):
        unpack("Q4_K", np.zeros((1, 144), dtype=np.uint8), 1, 128)
    with pytest.raises(ValueError, match="needs 36 bytes"):
        unpack("Q4_0", np.zeros((1, 40), dtype=np.uint8), 1, 64)


@pytest.mark.slow  # reading the file's metadata takes ~3 s
def test_the_default_model_tensors_unpack_exactly():
    from pagedllm.errors import ModelLoadError
    from pagedllm.loading.default_model import default_gguf_path

    try:
        path = default_gguf_path()
    except ModelLoadError as e:
        pytest.skip(str(e))
    tensors = {t.name: t for t in GGUFReader(path).tensors}
    for name in ["token_embd.weight", "blk.0.attn_q.weight"]:  # Q8_0 and Q4_1
        tensor = tensors[name]
        raw = tensor.data[:8192]  # all of attn_q; enough of the 49152 embedding rows
        type_name = tensor.tensor_type.name
        assert type_name in SUPPORTED
        assert_exact(type_name, dequantize(unpack(type_name, raw, raw.shape[0], int(tensor.shape[0]))), raw)


# README's and docs/quantization.md's table: what a type costs in RAM against the file's bytes.
_RAM_PER_FILE = {
    **{name: 1.0 for name in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")},
    "Q8_0": 1.0,  # its f16 d kept as float16 (float32: 36 / 34)
    "IQ4_NL": 1.0,
    "IQ4_XS": 1.0,  # its super-blocks (as d x (sc - 32) a float32 per 32: 20 * 8 / 136)
    "MXFP4": 1.0,  # its byte e kept (as a float32 2^(e - 128): 20 / 17)
    "Q4_0": 1.0,  # codes q - 8 under its f16 d (was 24 / 18: a float32 scale and offset)
    "Q4_1": 1.0,
    "Q5_0": 1.0,  # qh and qs as stored (was a byte a value and a float32 d: 36 / 22)
    "Q5_1": 1.0,
}


@pytest.mark.parametrize("type_name", sorted(SUPPORTED))
def test_what_each_type_costs_in_ram_against_the_file(type_name):
    rows, cols = 4, 1024
    raw = random_blocks(type_name, rows, cols)
    qt = unpack(type_name, raw, rows, cols)
    held = sum(a.nbytes for a in (qt.qweight, qt.scale, qt.zero) if a is not None)
    assert held / raw.nbytes == pytest.approx(_RAM_PER_FILE[type_name], rel=1e-9)
