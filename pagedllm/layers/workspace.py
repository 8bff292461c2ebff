"""Size limits the CPU kernels tile their work by, so their workspace never grows with the batch.

The kernels use them and the memory planner budgets by them: one place, torch-free.
"""

# Query rows x keys scored at once per KV head (2^18 pairs = 1 MiB of fp32 scores).
PAIRS_BUDGET = 1 << 18
# Key slots gathered at once for a group of decode rows (a longer single context is gathered whole).
GATHER_BUDGET = 8192
# Sampler rows processed at once on the full sampling path.
SAMPLER_CHUNK_ROWS = 8
# Quantized linear layers (layers/quantized.py): up to this many rows the packed-weight kernel
# beats dequantize + GEMM (measured, docs/quantization.md); above, a layer is dequantized at most
# this many weights at a time (32 MiB in fp32).
QUANT_KERNEL_MAX_ROWS = 8
# float32 rows: the kernel's AVX-512 path takes any count (the kernels' int64 maximum), its AVX2
# path up to 64 (kernels/csrc/quant_gemm.cpp: quant_float_max_rows)
QUANT_FLOAT_ANY_ROWS = 2**63 - 1
QUANT_FLOAT_AVX2_ROWS = 64
DEQUANT_CHUNK_ELEMENTS = 8 * 1024 * 1024


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
