"""GGUF's K-quant types (and IQ4_XS, built the same way) kept in RAM as the file stores them: 256
columns a block, with their packed sub-scales, f16 d (and dmin) and high-bit planes
(``kernels/csrc/quant_blocks.h`` decodes them). A weight in one costs what it costs on disk:
Q4_K 4.5 bits, where the widened layout (a float32 scale and offset per 32 columns) took 6, and
Q6_K 6.5 bits where it took 10.

Torch-free: the GGUF converter and the memory planner read it too. A matrix in this layout is
``QuantizedWeight(block_type=...)``: qweight uint8 [rows, blocks x block bytes], scale an empty
[rows, 0] (the blocks hold the scales), no zero; the kernels take it as ``RAW_LAYOUT`` + the
type's ggml number."""

SUPERBLOCK = 256  # columns a block
RAW_LAYOUT = 4096  # the kernels' layout number for a raw type: RAW_LAYOUT + its ggml type number

# type -> (ggml's type number, bytes a block): ggml-common.h's block_q*_K structs
BLOCK_TYPES: dict[str, tuple[int, int]] = {
    "Q2_K": (10, 84),
    "Q3_K": (11, 110),
    "Q4_K": (12, 144),
    "Q5_K": (13, 176),
    "Q6_K": (14, 210),
    "IQ4_XS": (23, 136),  # not a K-quant, but a super-block of 256 under one d with 6-bit sub-scales
}
_BY_BYTES = {size: name for name, (_, size) in BLOCK_TYPES.items()}


def type_of_block(size: int) -> str | None:
    """The K-quant whose blocks are ``size`` bytes (each type's size is its own), or None."""
    return _BY_BYTES.get(size)


def block_bytes(block_type: str) -> int:
    return BLOCK_TYPES[block_type][1]


def columns(block_type: str, row_bytes: int) -> int:
    """The columns of a row of ``row_bytes`` bytes of ``block_type`` blocks."""
    return row_bytes // block_bytes(block_type) * SUPERBLOCK


def row_bytes(block_type: str, cols: int) -> int:
    return cols // SUPERBLOCK * block_bytes(block_type)


def int4_bytes(rows: int, cols: int) -> int:
    """What ``quantization="int4"`` holds a [rows, cols] matrix in: Q4_K blocks (4.5 bits a
    weight) where the columns are whole blocks, else 4 bits with a float32 scale and offset per
    32 columns (6 bits a weight: a row of 576 is no whole number of blocks)."""
    if cols % SUPERBLOCK == 0:
        return rows * row_bytes("Q4_K", cols)
    return rows * (cols // 2 + 8 * (cols // 32))
