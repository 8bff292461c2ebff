"""Sizes: the one table of supported dtypes and their byte widths, units, and block rounding.

Torch-free, so the planner and ``pagedllm plan`` start without importing torch; ``torch_dtype``
imports it only when asked.
"""

from __future__ import annotations

import re

GiB = 1024**3
INDEX_BYTES = 8  # int64 index tensors
# A checkpoint tensor stored in another dtype than the one loaded is converted through a buffer
# of this many bytes (pagedllm.loading.safetensors_io); the planner counts it in the loading peak.
CONVERT_CHUNK_BYTES = 8 * 1024 * 1024
# Structured output: compiled grammars kept for reuse, by their size as xgrammar reports it (a JSON
# schema: ~30 KB to a few MB; 64 of the benchmark's schemas: 18 MiB), the least recently used
# going first; xgrammar's own cache of what it builds inside compiles (shares most with ours).
CACHE_LIMIT_BYTES = 16 * 1024**2
XGRAMMAR_CACHE_LIMIT_BYTES = 8 * 1024**2
GRAMMAR_CACHE_BYTES = CACHE_LIMIT_BYTES + XGRAMMAR_CACHE_LIMIT_BYTES  # what the memory plan counts
# Sampler rows processed at once on the full sampling path (and prompt logprobs' chunks).
SAMPLER_CHUNK_ROWS = 8
SHM_SLOT_BYTES = 4 * 1024 * 1024  # tensor parallelism: a rank's slot of the shared-memory all-reduce

# Every accepted spelling -> (canonical name, bytes per element).
_DTYPES = {"float32": ("float32", 4), "fp32": ("float32", 4), "bfloat16": ("bfloat16", 2), "bf16": ("bfloat16", 2)}
SUPPORTED_DTYPES = ("float32", "bfloat16")
# Weights: None keeps a checkpoint's tensors as stored (a converted GGUF's stay quantized),
# "none" dequantizes everything, "int8"/"int4" quantize float linear weights at load, "w8a8" every
# matrix to int8 and multiplies in integers (layers/quantized.py).
QUANTIZATIONS = ("none", "int8", "int4", "w8a8")
QUANTIZED = QUANTIZATIONS[1:]  # those that quantize at load: their weights are the planner's arithmetic
# KV cache: the activation dtypes, or 8-bit values with one float32 scale per token and KV head.
KV_CACHE_DTYPES = ("float32", "bfloat16", "int8", "fp8")
_KV_BYTES = {"int8": 1, "fp8": 1}
KV_SCALE_BYTES = 4


def kv_dtype_name(dtype) -> str:
    """A KV cache dtype's canonical name ('fp8' is e4m3); ValueError for one not supported."""
    name = str(dtype).removeprefix("torch.")
    name = {"float8_e4m3fn": "fp8", "fp8_e4m3": "fp8"}.get(name, name)
    if name in _KV_BYTES:
        return name
    try:
        return dtype_name(name)
    except ValueError:
        raise ValueError(
            f"kv_cache_dtype {dtype!r} is not supported; use one of {', '.join(KV_CACHE_DTYPES)}"
        ) from None


def kv_element_bytes(dtype) -> int:
    """Bytes per cached K or V value, a quantized cache's scales included (per head_dim values)."""
    name = kv_dtype_name(dtype)
    return _KV_BYTES.get(name) or dtype_bytes(name)


def kv_is_quantized(dtype) -> bool:
    return kv_dtype_name(dtype) in _KV_BYTES


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


_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}


def parse_memory(text: str | int) -> int:
    """'6GiB', '512MiB', '8GB', '1.5 GiB' or a byte count."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"memory {text!r}: expected a size like '6GiB', '512MiB' or '8GB'")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
