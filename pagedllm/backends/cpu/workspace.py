"""Size limits the CPU kernels tile their work by, so their workspace never grows with the batch.

The kernels use them and the memory planner budgets by them: one place, torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...sizes import ceil_div, dtype_bytes
from ..facts import ANY_ROWS

if TYPE_CHECKING:
    from ...config import ModelConfig
    from ...memory.footprint import EngineSettings


# Query rows x keys scored at once per KV head (2^18 pairs = 1 MiB of fp32 scores).
PAIRS_BUDGET = 1 << 18
# Key slots gathered at once for a group of decode rows (a longer single context is gathered whole).
GATHER_BUDGET = 8192
# Quantized linear layers (layers/quantized.py): up to this many rows the packed-weight kernel
# beats dequantize + GEMM (measured, docs/quantization.md); above, a layer is dequantized at most
# this many weights at a time (32 MiB in fp32).
QUANT_KERNEL_MAX_ROWS = 8
# float32 rows: the kernel's AVX-512 path takes any count (the kernels' int64 maximum), its AVX2
# path up to 64 (kernels/csrc/quant_gemm.cpp: quant_float_max_rows)
QUANT_FLOAT_ANY_ROWS = ANY_ROWS
QUANT_FLOAT_AVX2_ROWS = 64
DEQUANT_CHUNK_ELEMENTS = 8 * 1024 * 1024


def packs_weights(isa: str, dtype: str) -> bool:
    """Whether the backend packs float weights for oneDNN (``torch_backend.pack_weight``): bf16
    from AVX-512 up, fp32 on any CPU."""
    return isa != "avx2" or dtype == "float32"


def tile_packable(out_features: int, in_features: int) -> bool:
    """Whether the compiled kernels' packed bf16 GEMM (kernels/csrc/dense_gemm.cpp) takes a layer
    of this shape: whole blocks of 16 output channels over whole steps of 32 columns. The backend
    packs such layers for it; the planner counts them as it runs them."""
    return out_features % 16 == 0 and in_features % 32 == 0


def padded_rows(rows: int) -> int:
    """Rows a prepacked bf16 GEMM runs on (``pagedllm.layers.linear``). oneDNN builds (JIT-compiles)
    a kernel for every new input shape, 2-6 ms each, measured here: a row count that changes
    every step would pay that every step. Rows are padded to a bucket instead (AMX computes
    16-row tiles, so padding to 16 costs little): up to 4 as they are, then multiples of 16, and
    of 64 above 512."""
    if rows <= 4:
        return rows
    step = 16 if rows <= 512 else 64
    return -(-rows // step) * step


def gemm_scratch(
    rows: int, k: int, n: int, dtype: str, isa: str = "avx512_bf16", packed: bool = True, threads: int = 1
) -> int:
    """oneDNN's GEMM scratch for a [rows, k] x [k, n] product (fp32: 640 bytes a thread on
    packed weights at every shape measured, none on plain ones, which MKL's sgemm multiplies),
    as measured on torch 2.13 for each kind of kernel (``machine.GEMM_ISAS``;
    docs/memory.md has the tables). ``packed``: the weights prepacked for oneDNN
    (``pagedllm.layers.linear``), else plain (``F.linear``); ``threads``: torch's threads.

    - ``amx``: a bound, not a fit: oneDNN picks among kernels by shape, some of which pack the
      input (rows x k x 4 bytes, more with more threads) and, on plain weights, the weights
      (k x n, blocked at 512 x 4096: only from 192 rows, or above 32 with k over 1024); per
      thread a few KiB of tiles up to 32 rows, then 128 bytes a row (measured on k in [64, 4096],
      n in [64, 49152], rows in [1, 512], 1-8 threads).
    - ``avx512_bf16`` (no AMX): each thread accumulates a block of rows x 64 columns in fp32,
      the rows cut into equal blocks of at most 256 (384 rows: two of 192); plain weights add
      each thread's copy of an input block (k up to 512 columns, up to 1024 above 1024)
      (measured on k in [64, 8192], n in [32, 49152], rows in [1, 513], 1-8 threads).
    - ``avx512`` (no bf16 instructions): the whole output in fp32, whatever the threads (and,
      for a few rows on plain weights, 256 bytes a thread).
    - ``avx2``: torch's own bf16 GEMM, no scratch."""
    if rows == 0:
        return 0
    if dtype_bytes(dtype) == 4:  # MKL's sgemm on plain weights; oneDNN's on packed ones: a few KiB
        return 640 * threads + 256 if packed else 0
    if isa == "avx2":
        return 0
    if isa == "avx512":  # few rows on plain weights: a reduction buffer per thread besides
        return 4 * rows * n + (128 * (2 * threads - 1) if rows < 16 and not packed else 128)
    if isa == "avx512_bf16":
        row_block = ceil_div(rows, ceil_div(rows, 256))
        scratch = threads * (256 * row_block + 640) + 384
        if not packed:
            scratch += threads * 128 * (min(k, 512) if k <= 1024 or rows == 1 else 1024)
        return scratch
    if isa != "amx":
        raise ValueError(f"gemm isa {isa!r}: choose one of amx, avx512_bf16, avx512, avx2")
    # AMX: a bound over every kernel oneDNN picked for the measured shapes (1, 2, 4, 8 threads)
    t = threads
    if rows <= 32:
        tiles = 128 * (3 + (21 if rows <= 16 and (packed or rows > 1) else 37) * t)
    else:
        tiles = 128 * (4 + 37 * t) + 128 * t * rows
    packs_input = rows > 32 or t >= 4  # ... sometimes, for these shapes
    input_copy = 4 * rows * k * ceil_div(t, 4) + (128 * t * rows if t > 4 else 0) if packs_input else 0
    if packed:
        return tiles + input_copy
    weight_copy = (64 if 1 < rows <= 32 else 128) * t * k  # plain weights are packed per call
    if rows >= 192 or (rows > 32 and k > 1024):  # ... in blocks, by the kernels of these shapes only
        weight_copy += 4 * min(n, 4096) * min(k, 512) * ceil_div(t, 2)
    return tiles + input_copy + weight_copy


def kernel_scratch_bytes(cfg: ModelConfig, s: EngineSettings, threads: int, max_model_len: int) -> int:
    """What the compiled attention keeps per thread, outside torch's allocator, at most: the
    scores of one tile (``pairs_budget`` pairs, or one decode row's whole context), and its
    queries and accumulators (32 query rows of a KV head's query heads). A bf16 prefill tile on
    AMX (``amx_tiles``: the tiles are usable) pads its rows to 16 and its keys to 32, and also
    holds its queries, probabilities and values in bf16 (kernels/csrc/attention.cpp). Their
    packed bf16 GEMM on tiles copies a partial last tile of rows, zero-padded (16 x K bf16)."""
    if s.kernels != "compiled":
        return 0
    g, d = cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
    pairs = max(s.pairs_budget, g * max_model_len)
    per_thread = 4 * pairs + 4 * 2 * 32 * g * d + 4 * 16 * d
    if s.amx_tiles and s.dtype == "bfloat16" and s.kv == "bfloat16":
        rows = 32 * g + 15  # a tile's query rows, padded to whole tiles
        padded = pairs + 31 * rows + 15 * max_model_len  # (rows + 15) x (keys + 31), rows x keys <= pairs
        per_thread += 4 * (padded - pairs) + 2 * padded  # float scores, bf16 probabilities
        per_thread += 2 * d * (rows + 16 + max_model_len + 31) + 4 * rows * d  # q, k, v in bf16; accumulators
    tail = 0
    if s.amx_tiles and s.dtype == "bfloat16" and s.packed and not s.quantized_weights:  # any layer may be ours
        tail = 2 * 16 * max(cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim)
    return threads * per_thread + tail
