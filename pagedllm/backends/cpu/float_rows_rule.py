"""How many float32 rows the packed-weight kernel should take, measured once per process where
the instruction set does not settle it.

With AVX-512 the kernel's float path beat dequantize + GEMM at every row count measured on a
2-core AMD EPYC (8 to 512 rows: docs/quantization.md), and the rule was "any count". On a
Sapphire Rapids Xeon (MKL's float GEMM fast there) the same 4-bit [1536, 576] layer at 64 rows
takes 2.2 ms in the kernel and 0.8 dequantized + GEMM (256 rows: 9.6 against 1.8), and the
default configuration (float32, Q4_1 as stored) ran the 64-prompt workload at 54.5 tok/s where
dequantize + GEMM gives 186. The same instruction set, opposite answers: so the compiled
backend times both once, at 64 rows of the default model's MLP shape, where either side's lead
was 2.5x or more, and takes the faster beyond ``QUANT_KERNEL_MAX_ROWS``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from .workspace import QUANT_FLOAT_ANY_ROWS, QUANT_KERNEL_MAX_ROWS

ROWS, OUT, IN = 64, 1536, 576  # the measured product: 64 rows of the default model's MLP shape
REPEATS = 5

_measured: dict[int, int] = {}  # the built rule -> the rule kept, once per process


def quant_float_max_rows(ops: Any) -> int:
    """The kernels' own rule (``quant_float_max_rows()``), or, where it says any count, the
    measured one: any count if the kernel is faster at ``ROWS`` rows, else
    ``QUANT_KERNEL_MAX_ROWS`` (more rows dequantize + GEMM)."""
    built = int(ops.quant_float_max_rows())
    if built != QUANT_FLOAT_ANY_ROWS:
        return built
    if built not in _measured:
        kernel, dequantized = _products(ops)
        _measured[built] = choose(_median_seconds(kernel), _median_seconds(dequantized))
    return _measured[built]


def choose(kernel_seconds: float, dequantized_seconds: float) -> int:
    """The rule from the two timings of ``ROWS`` rows."""
    return QUANT_FLOAT_ANY_ROWS if kernel_seconds <= dequantized_seconds else QUANT_KERNEL_MAX_ROWS


def _products(ops: Any) -> tuple[Callable[[], torch.Tensor], Callable[[], torch.Tensor]]:
    """The two ways of one product of a random 4-bit layer with offsets (Q4_1's format)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 256, (OUT, IN // 2), dtype=torch.uint8, generator=g)
    scale = (torch.rand(OUT, IN // 32, generator=g) / 50).half()
    zero = (torch.randn(OUT, IN // 32, generator=g) / 10).half()
    x = torch.randn(ROWS, IN, generator=g)
    layout, group = 4, 32
    return (
        lambda: ops.quant_linear(x, q, scale, zero, layout, group),
        lambda: x @ ops.dequantize(q, scale, zero, layout, group, None, torch.float32).T,
    )


def _median_seconds(run: Callable[[], torch.Tensor]) -> float:
    run()  # first touch
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
