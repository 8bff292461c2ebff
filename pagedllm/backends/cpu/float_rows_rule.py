"""How many float32 rows the packed-weight kernel should take where the instruction set does not
settle it (AVX-512).

With AVX-512 the kernel's float path beat dequantize + GEMM at every row count measured on a
2-core AMD EPYC (8 to 512 rows: docs/quantization.md), and the rule was "any count". On a
Sapphire Rapids Xeon (MKL's float GEMM is fast on Intel CPUs) the same 4-bit [1536, 576] layer at
64 rows takes 2.2 ms in the kernel and 0.8 dequantized + GEMM (256 rows: 9.6 against 1.8), and
the default configuration (float32, Q4_1 as stored) ran the 64-prompt workload at 54.5 tok/s
where dequantize + GEMM gives 186-188. The same instruction set, opposite answers, each side
ahead 2.5x or more: the rule follows the CPU's vendor, as measured on each. (Timing both ways in
the process, tried first, ran MKL's GEMM before the model loaded and moved the whole-process
memory test's peak by ~10 MiB below its plan.)
"""

from __future__ import annotations

from typing import Any

from . import machine
from .workspace import QUANT_FLOAT_ANY_ROWS, QUANT_KERNEL_MAX_ROWS

# CPU vendors (/proc/cpuinfo's vendor_id) where dequantize + GEMM was measured faster beyond a few rows
DEQUANTIZE_FASTER = frozenset({"GenuineIntel"})


def quant_float_max_rows(ops: Any, vendor: str | None = None) -> int:
    """The kernels' own rule (``quant_float_max_rows()``), or, where it says any count, the
    vendor's: as many as bf16 rows (``QUANT_KERNEL_MAX_ROWS``) on a vendor in
    ``DEQUANTIZE_FASTER``, else any count."""
    built = int(ops.quant_float_max_rows())
    if built != QUANT_FLOAT_ANY_ROWS:
        return built
    return QUANT_KERNEL_MAX_ROWS if (vendor or machine.cpu_vendor()) in DEQUANTIZE_FASTER else built
