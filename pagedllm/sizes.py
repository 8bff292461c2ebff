"""Sizes: the one table of supported dtypes and their byte widths, units, and block rounding.

Torch-free, so the planner and ``pagedllm plan`` start without importing torch; ``torch_dtype``
imports it only when asked.
"""

from __future__ import annotations

GiB = 1024**3
INDEX_BYTES = 8  # int64 index tensors
# A checkpoint tensor stored in another dtype than the one loaded is converted through a buffer
# of this many bytes (pagedllm.loading.safetensors_io); the planner counts it in the loading peak.
CONVERT_CHUNK_BYTES = 8 * 1024 * 1024

# Every accepted spelling -> (canonical name, bytes per element).
_DTYPES = {"float32": ("float32", 4), "fp32": ("float32", 4), "bfloat16": ("bfloat16", 2), "bf16": ("bfloat16", 2)}
SUPPORTED_DTYPES = ("float32", "bfloat16")


def dtype_name(dtype) -> str:
    """'float32' or 'bfloat16' for any accepted spelling or torch dtype; ValueError otherwise."""
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use {' or '.join(SUPPORTED_DTYPES)}")
    return _DTYPES[name][0]


def dtype_bytes(dtype) -> int:
    return _DTYPES[dtype_name(dtype)][1]


def torch_dtype(dtype):
    """The torch dtype for any accepted spelling (imports torch)."""
    import torch

    return getattr(torch, dtype_name(dtype))


def gib(nbytes: int | float, width: int = 0) -> str:
    """Bytes as GiB with three decimals, e.g. '1.250 GiB' (right-aligned to ``width``)."""
    return f"{nbytes / GiB:{width}.3f} GiB"


def ceil_div(n: int, d: int) -> int:
    """Blocks of ``d`` needed for ``n`` items (rounding up)."""
    return -(-n // d)
