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

AMD's Zen 5 (family 26) runs AVX-512 at full width, which doubles a float GEMM's rate and not the
kernel's: on a 2-core EPYC of it that layer takes 0.15 / 0.62 ms at 8 rows (kernel / dequantize +
GEMM), 1.17 / 1.15 at 64, 4.72 / 2.85 at 256 and 9.75 / 5.29 at 512, and the default
configuration ran 64 prompts at 142.7 tok/s against 367.2 for float32 dense weights (bench
--matrix, December 7). There the kernel takes what it takes on AVX2: up to 64 rows.
"""

from __future__ import annotations

from typing import Any

from . import machine
from .workspace import QUANT_FLOAT_ANY_ROWS, QUANT_FLOAT_AVX2_ROWS, QUANT_KERNEL_MAX_ROWS

# (vendor, first CPU family, rows): from that family on, dequantize + GEMM was measured faster
# beyond that many float32 rows (/proc/cpuinfo's vendor_id and cpu family)
DEQUANTIZE_FASTER = (("GenuineIntel", 0, QUANT_KERNEL_MAX_ROWS), ("AuthenticAMD", 26, QUANT_FLOAT_AVX2_ROWS))


def quant_float_max_rows(ops: Any, vendor: str | None = None, family: int | None = None) -> int:
    """The kernels' own rule (``quant_float_max_rows()``), or, where it says any count, the CPU's
    as measured (``DEQUANTIZE_FASTER``): Intel's as many as bf16 rows, Zen 5's 64, else any count."""
    built = int(ops.quant_float_max_rows())
    if built != QUANT_FLOAT_ANY_ROWS:
        return built
    vendor = machine.cpu_vendor() if vendor is None else vendor
    family = machine.cpu_family() if family is None else family
    return next((rows for v, first, rows in DEQUANTIZE_FASTER if v == vendor and family >= first), built)
