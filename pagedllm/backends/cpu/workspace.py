"""Size limits the CPU kernels tile their work by, so their workspace never grows with the batch.

The kernels use them and the memory planner budgets by them: one place, torch-free.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING

from ...sizes import INDEX_BYTES as INDEX
from ...sizes import SHM_SLOT_BYTES, ceil_div, dtype_bytes, kv_element_bytes, kv_is_quantized
from ..facts import ANY_ROWS

if TYPE_CHECKING:
    from ...config import ModelConfig
    from ...memory.footprint import EngineSettings, StepShape

PAGE = 4096  # what a first write commits of a mapping


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
# float32 rows from which the compiled backend packs each dequantized chunk for oneDNN before its
# GEMM (the reorder pays for itself: on a Zen 5 EPYC a [1536, 576] chunk at 64 rows took 0.60 ms
# in F.linear's MKL sgemm, 0.21 + 0.24 reordered and packed; at 512 rows 4.36 against 0.21 + 1.83)
PACK_DEQUANTIZED_ROWS = 64


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
    pairs = max(PAIRS_BUDGET, g * max_model_len)
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


# ---- a step's tensors on this device, by path -----------------------------------------------
# The footprint (``memory.footprint.step_phases``) sums a step's phases from the model's shapes;
# what each phase holds beyond them depends on how the CPU runs it (the compiled kernels or
# PyTorch, oneDNN's GEMMs or the kernels' own), and is these terms. The planner asks them through
# the registry (``backends.workspace``).


def layout_buffers(s: EngineSettings, shape: StepShape, windows: AbstractSet[int], pools: int) -> int:
    """Index tensors the attention layout builds beyond the step's input (``StepLayout``): none
    for the compiled kernels, which read the step's tables as they are; the PyTorch path adds,
    per pool, a slot per token, the block ids of every context and the decode masks (padding;
    one per sliding window shorter than the group's context)."""
    if s.kernels == "compiled":
        return 0
    bs = s.block_size
    per_pool = INDEX * shape.tokens
    for rows, keys, _ in shape.decode_groups:
        per_pool += INDEX * (rows * (keys // bs) + 2 * rows) + rows * keys
    per_pool += sum(INDEX * ceil_div(ctx, bs) for _, ctx in shape.prefills)
    masks = sum(rows * keys * sum(1 for w in windows if w < keys) for rows, keys, _ in shape.decode_groups)
    return pools * per_pool + masks


def norm_transient(s: EngineSettings, rows: int, width: int) -> int:
    """An RMSNorm's tensors above its input and output: none from the compiled kernel."""
    return 0 if s.kernels == "compiled" else _norm_transient(rows, width, dtype_bytes(s.dtype))


def rotary_transient(s: EngineSettings, tokens: int, q_width: int) -> int:
    """Rotary's: the compiled kernel rotates in place; PyTorch's rotate_half copies q, then k."""
    return 0 if s.kernels == "compiled" else tokens * q_width * dtype_bytes(s.dtype)


def attention_transient(cfg: ModelConfig, s: EngineSettings, shape: StepShape, windowed: bool) -> int:
    """Attention's tensors beside its output: none from the compiled kernel (its scratch is
    ``kernel_scratch_bytes``); the PyTorch path's largest call (``_attention_workspace``)."""
    return 0 if s.kernels == "compiled" else _attention_workspace(cfg, s, shape, windowed)


def qk_norm_transient(cfg: ModelConfig, s: EngineSettings, tokens: int) -> int:
    """q's norm, then k's while q's result is alive (Qwen3, OLMoE, Gemma 3)."""
    t, e, d = tokens, dtype_bytes(s.dtype), cfg.head_dim
    dq, dk = cfg.num_heads * d, cfg.num_kv_heads * d
    whole = cfg.qk_norm_scope == "all"  # OLMoE: q and k normed over their whole rows
    if s.kernels == "compiled" and not whole:  # the kernel's output, after a contiguous copy of the heads' rows
        copies = 2 if t > 1 else 1  # one row's heads are contiguous already
        return max(copies * t * dq * e, t * dq * e + copies * t * dk * e)
    if whole:  # PyTorch's formulation on every backend: the rows are strided views of qkv's
        return max(_norm_transient(t, dq, e), t * dq * e + _norm_transient(t, dk, e))
    return max(  # PyTorch's formulation
        _norm_transient(t * cfg.num_heads, d, e), t * dq * e + _norm_transient(t * cfg.num_kv_heads, d, e)
    )


def worst_decode_groups(s: EngineSettings, seqs: int, context: int) -> list[tuple[int, int, bool]]:
    """The decode groups whose attention holds the most (``StepShape.decode_groups``): many short
    rows filling the gather budget, or one row of the longest context."""
    bs = s.block_size
    whole = ceil_div(context, bs) * bs  # gathers are whole blocks
    rows = max(1, min(seqs, GATHER_BUDGET // bs))
    return [(rows, max(bs, min(whole, GATHER_BUDGET // rows // bs * bs)), True), (1, whole, True)]


def _norm_transient(rows: int, width: int, e: int) -> int:
    """RMSNorm's temporaries above its input (HF's float32 formulation)."""
    return rows * width * (4 if e == 4 else 8) + 4 * rows


def _softmax_bytes(pairs: int, e: int) -> int:
    """scores (activation dtype) + float32 softmax output (+ float32 input copy on bf16)."""
    return pairs * (e + 4 + (0 if e == 4 else 4))


def _per_head(rows: int, keys: int, g: int, d: int, e: int, query_copy: bool) -> int:
    """Peak of one KV head's matmul / softmax / matmul over ``rows`` query rows of ``g`` heads."""
    pairs = rows * g * keys
    return max(
        pairs * e + (rows * g * d * e if query_copy else 0),  # q @ k^T
        _softmax_bytes(pairs, e),  # softmax in float32
        pairs * e + rows * g * d * e,
    )  # probs @ v


def _attention_workspace(cfg: ModelConfig, s: EngineSettings, shape: StepShape, windowed: bool) -> int:
    """Largest live workspace of one attention call (one decode group or one prefill tile)."""
    e = dtype_bytes(s.dtype)
    # an 8-bit cache is gathered as stored, then dequantized into the activation dtype
    kv_e = e + 1 if kv_is_quantized(s.kv) else kv_element_bytes(s.kv)
    g, d = cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
    dq, dk = cfg.num_heads * d, cfg.num_kv_heads * d
    worst = 0
    for rows, keys, _ in shape.decode_groups:  # keys: gathered slots per row, whole blocks
        gathered = 2 * rows * keys * dk * kv_e + rows * dq * e  # K, V, the group's queries
        mask = 2 * rows * keys + INDEX * (keys + rows) if windowed else 0  # a window's mask, built once
        worst = max(worst, gathered + mask + _per_head(rows, keys, g, d, e, query_copy=False))
    for q_rows, ctx in shape.prefills:
        tile = min(q_rows, max(1, PAIRS_BUDGET // (g * ctx)))
        padded = ceil_div(ctx, s.block_size) * s.block_size
        build = INDEX * (tile + ctx) + tile * ctx + (tile * ctx + INDEX * tile if windowed else 0)
        body = tile * ctx + _per_head(tile, ctx, g, d, e, query_copy=True)
        worst = max(worst, 2 * padded * dk * kv_e + max(build, body))
    return worst


class Gemms:
    """What one GEMM of a step holds, by how it runs. oneDNN's prepacked GEMMs run on rows
    padded to a bucket: a padded copy of the input while they run, and a padded output whose first
    rows are the result. With AMX tiles, a layer whose shape the compiled kernels' own packed GEMM
    takes (backends.cpu.compiled_backend.pack_weight) runs there instead: its output is its only tensor
    (kernel_scratch_bytes has the rest), on the rows as they are. Quantized weights: their
    kernels' outputs, or a dequantized chunk at a time and a plain GEMM."""

    def __init__(self, s: EngineSettings):
        self.s, self.e = s, dtype_bytes(s.dtype)
        self.pad = s.packed and not s.quantized_weights
        self.tiled = self.pad and self.e == 2 and s.amx_tiles and s.kernels == "compiled"

    def ours(self, k: int, out: int, packed: bool) -> bool:
        return self.tiled and packed and tile_packable(out, k)

    def rows_of(self, rows: int, k: int, out: int, packed: bool | None = None) -> int:
        """The rows of the GEMM's output tensor."""
        packed = self.s.packed if packed is None else packed
        return padded_rows(rows) if self.pad and packed and not self.ours(k, out, packed) else rows

    def bytes(self, rows: int, k: int, out: int, packed: bool | None = None) -> int:
        s, e = self.s, self.e
        packed = s.packed if packed is None else packed
        padded = self.rows_of(rows, k, out, packed)
        if self.ours(k, out, packed):
            return rows * out * e
        if s.quantization == "w8a8":  # x in int8, the int32 sums, their float result
            # int8_gemm.cpp: oneDNN's int32 sums beside x in int8, then the result beside the sums;
            # its own AVX2 sums: the result beside x in int8, then its copy in the activation dtype
            if s.kernels == "compiled" and s.own_int8_sums:
                return rows * k + rows * out * 4 if e == 4 else max(rows * k + rows * out * 4, rows * out * (4 + e))
            if s.kernels == "compiled":
                return max(rows * k + rows * out * 4, rows * out * 8)
            rounding = 2 * rows * k * 4  # backends.cpu.torch_backend.int8_matmul: x / step and its rounding
            return rows * k + rows * 4 + max(rounding, rows * out * 8)
        if s.quantized_weights:
            tiles = s.amx_tiles and e == 2 and rows > QUANT_KERNEL_MAX_ROWS
            float_rows = e == 4 and s.kernels == "compiled" and rows <= s.quant_float_max_rows
            kernel = rows <= QUANT_KERNEL_MAX_ROWS or tiles or float_rows
            if kernel:  # a float32 output; for bf16 the result in bf16,
                # and, off the tiles, x in fp32
                return rows * out * 4 + (rows * out * e + (0 if tiles else rows * k * 4) if e != 4 else 0)
            chunk = min(out, DEQUANT_CHUNK_ELEMENTS // k)  # one dequantized chunk, a plain GEMM
            if e == 4 and s.kernels == "compiled" and rows >= PACK_DEQUANTIZED_ROWS:
                return self._packed_chunks(rows, k, out, chunk)
            slices = rows * out * e + (rows * chunk * e if chunk < out else 0)  # output, a chunk's result
            return slices + chunk * k * e + gemm_scratch(rows, k, chunk, s.dtype, s.gemm_isa, False, s.threads)
        copy = (2 * padded - rows) * k * e if padded != rows else 0
        return padded * out * e + copy + gemm_scratch(padded, k, out, s.dtype, s.gemm_isa, packed, s.threads)

    def _packed_chunks(self, rows: int, k: int, out: int, chunk: int) -> int:
        """The compiled backend's float32 dequantize + GEMM from ``PACK_DEQUANTIZED_ROWS``: each
        chunk dequantized, then packed by oneDNN beside it (its rows to 64, its columns to 16),
        the plain copy freed, then the packed GEMM on x padded to its bucket; with several
        chunks, the output before them and each chunk's result."""
        padded = padded_rows(rows)
        plain = chunk * k * 4
        packed = ceil_div(chunk, 64) * 64 * ceil_div(k, 16) * 16 * 4
        copy = padded * k * 4 if padded != rows else 0
        gemm = packed + copy + padded * chunk * 4 + gemm_scratch(padded, k, chunk, "float32", "", True, self.s.threads)
        return (rows * out * 4 if chunk < out else 0) + max(plain + packed, gemm)

    def fewest_rows_alike(self, rows: int) -> int:
        """The fewest rows whose GEMM pads to the same bucket as ``rows`` (``padded_rows``): with
        ``rows``, the worst case of a GEMM whose rows vary (a sparse layer's expert)."""
        if rows <= 4:
            return rows
        step = 16 if rows <= 512 else 64
        return max(5 if step == 16 else 513, (rows - 1) // step * step + 1)


def shared_memory_bytes(cfg: ModelConfig, s: EngineSettings, max_batch_tokens: int, max_num_seqs: int) -> int:
    """The region every rank on one host maps (``distributed/shm.py``), as far as a step touches
    it: two banks of a slot per rank, each slot written up to the largest message (a step's
    hidden states, or a rank's logits rows), at most ``SHM_SLOT_BYTES``; every rank reads every
    slot, so each counts them all."""
    if s.tensor_parallel == 1 or s.kernels != "compiled":  # the compiled ops' (Backend.shared_memory_ops)
        return 0
    largest = max(max_batch_tokens * cfg.hidden_size * dtype_bytes(s.dtype), max_num_seqs * cfg.vocab_size * 4)
    return 2 * s.tensor_parallel * ceil_div(min(SHM_SLOT_BYTES, largest), PAGE) * PAGE
