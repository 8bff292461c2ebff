"""The facts a benchmark's figures depend on, printed beside every table."""

from __future__ import annotations

import os
import platform


def machine() -> str:
    """The facts a figure depends on: bf16 runs on other kernels with and without AMX."""
    import torch
    import transformers

    from ..backends.cpu.machine import cpu_flags
    from ..backends.cpu.onednn_probe import dispatched_gemm_isa

    simd = sorted(f for f in cpu_flags() if f.startswith(("avx512_bf16", "avx512_vnni", "amx_", "avx2")))
    return (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{torch.get_num_threads()} torch threads, CPU flags {' '.join(simd) or 'none of avx2/avx512/amx'}, "
        f"bf16 GEMMs on {dispatched_gemm_isa()}"
    )
