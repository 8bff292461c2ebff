"""The CPU's facts a plan depends on, read from /proc and the environment without torch: which
kind of bf16 GEMM kernel oneDNN will run (AMX, AVX-512 with or without bf16, AVX2), capped as
ONEDNN_MAX_CPU_ISA caps it, and which kernels an engine started now would run."""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

from ... import env
from .workspace import QUANT_FLOAT_AVX2_ROWS, QUANT_KERNEL_MAX_ROWS

# What oneDNN's bf16 GEMMs run on, best first; each takes its own scratch (footprint.gemm_scratch).
#   amx          AMX tiles (brg_matmul:avx10_1_512_amx)
#   avx512_bf16  AVX-512 with bf16 dot products, no AMX (brg_matmul:avx512_core_bf16)
#   avx512       AVX-512 without bf16: bf16 converted to fp32 (gemm:jit:bf16)
#   avx2         no oneDNN bf16 kernel at all: torch's own bf16 GEMM, and no weight packing
GEMM_ISAS = ("amx", "avx512_bf16", "avx512", "avx2")


# The flags each kind needs beyond the one below it, as /proc/cpuinfo spells them.
ISA_FLAGS = {
    "amx": ("amx_tile", "amx_bf16"),
    "avx512_bf16": ("avx512_bf16",),
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
    "avx2": (),
}


# oneDNN's ONEDNN_MAX_CPU_ISA values, lowest first (its dispatcher-control docs); each maps to
# the best kind it allows. DEFAULT and ALL cap nothing.
_ONEDNN_CAPS = {
    "SSE41": "avx2",
    "AVX": "avx2",
    "AVX2": "avx2",
    "AVX2_VNNI": "avx2",
    "AVX2_VNNI_2": "avx2",
    "AVX512_CORE": "avx512",
    "AVX512_CORE_VNNI": "avx512",
    "AVX512_CORE_BF16": "avx512_bf16",
    "AVX512_CORE_FP16": "avx512_bf16",
    "AVX10_1_512": "avx512_bf16",
    "AVX10_2_512": "avx512_bf16",
}


def _cpuinfo(field: str) -> str:
    """The value of /proc/cpuinfo's first line named ``field`` ("" where it or the file is absent)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(field):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_vendor() -> str:
    """The CPU's vendor ('vendor_id'; empty where it is absent)."""
    return _cpuinfo("vendor_id")


def cpu_family() -> int:
    """The CPU's family ('cpu family'; 0 where it is absent): AMD's Zen 4 is 25, Zen 5 26."""
    family = _cpuinfo("cpu family")
    return int(family) if family.isdigit() else 0


def l3_bytes() -> int:
    """The L3 cache's size in bytes as sysfs gives it for CPU 0 (0 where it is absent)."""
    root = Path("/sys/devices/system/cpu/cpu0/cache")
    for index in sorted(root.glob("index*")):
        try:
            if (index / "level").read_text().strip() != "3":
                continue
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        units = {"K": 1024, "M": 1024**2, "G": 1024**3}
        return int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
    return 0


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (the first 'flags' line; empty where it is absent)."""
    return frozenset(_cpuinfo("flags").split())


def kernel_float_max_rows() -> int:
    """The most float32 rows the compiled quantized kernel would take here (64 on AVX2, else as
    many as bf16 rows), as ``kernels.build`` targets it (``PAGEDLLM_KERNEL_TARGET``, else this
    CPU), for a plan made without loading the kernels (``pagedllm plan``); a backend tells it
    exactly. On AVX-512 the backend's rule follows the CPU's vendor (``float_rows_rule``: any
    count, or as many as bf16 rows); here the plan takes the latter, whose dequantized chunk is
    the larger."""
    target = env.KERNEL_TARGET.get().replace("native", "")
    flags = cpu_flags()
    avx512 = target == "x86-64-v4" or (not target and {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags)
    if not avx512 and (target == "x86-64-v3" or (not target and {"avx2", "fma"} <= flags)):
        return QUANT_FLOAT_AVX2_ROWS
    return QUANT_KERNEL_MAX_ROWS


def kernel_own_int8_sums() -> bool:
    """Whether the compiled w8a8 op would sum in its own AVX2 GEMM here (kernels built without
    VNNI: x86-64-v3 or -v4, or this CPU where it has neither AVX512-VNNI nor AVX-VNNI), as
    ``kernels.build`` targets it, for a plan made without loading the kernels; a backend tells it
    exactly (``w8a8_own_sums``)."""
    target = env.KERNEL_TARGET.get().replace("native", "")
    if target:
        return target in ("x86-64-v3", "x86-64-v4")
    flags = cpu_flags()
    return "avx2" in flags and not ({"avx512_vnni", "avx_vnni"} & flags)


def onednn_isa_cap() -> str | None:
    """The best kind ONEDNN_MAX_CPU_ISA (or its old name DNNL_MAX_CPU_ISA) lets oneDNN use, or
    None where it caps nothing. oneDNN reads it once, at its first use; pagedllm's own AMX
    kernels (kernels/csrc/amx.h) obey the same variable, so setting it runs a machine as
    one without AMX."""
    for var in (env.ONEDNN_MAX_CPU_ISA, env.DNNL_MAX_CPU_ISA):
        value = var.get().upper()
        if value:
            return None if "AMX" in value or value in ("ALL", "DEFAULT") else _ONEDNN_CAPS.get(value)
    return None


def _os_grants_amx() -> bool:
    """Linux hands out AMX tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM), and a
    sandbox may refuse it; oneDNN then falls back to AVX-512. Asking is what oneDNN and the
    compiled kernels do anyway, once per process."""
    import ctypes

    sys_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata = 158, 0x1023, 18  # x86_64
    try:
        return ctypes.CDLL(None, use_errno=True).syscall(sys_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata) == 0
    except (OSError, AttributeError):
        return False


@functools.cache
def gemm_isa() -> str:
    """The kind of bf16 GEMM kernel this process runs (one of ``GEMM_ISAS``), from the CPU's
    flags, the OS's AMX grant and ONEDNN_MAX_CPU_ISA, without importing torch: the best kind
    whose flags the CPU has, capped as oneDNN caps it. ``backends.cpu.onednn_probe`` asks oneDNN
    itself which kernel it ran; the engine plans with that answer where torch is loaded, and a
    test checks the two agree."""
    flags, best = cpu_flags(), "avx2"
    for kind in reversed(GEMM_ISAS[:-1]):  # avx512, then avx512_bf16, then amx: each needs the last
        if not all(flag in flags for flag in ISA_FLAGS[kind]):
            break
        best = kind
    if best == "amx" and not _os_grants_amx():
        best = "avx512_bf16"
    cap = onednn_isa_cap()
    return GEMM_ISAS[max(GEMM_ISAS.index(best), GEMM_ISAS.index(cap))] if cap else best


def missing_flags(kind: str) -> list[str]:
    """The CPU flags this machine lacks to run ``kind`` (a machine can be capped down to any kind
    it has the flags for, never up)."""
    flags = cpu_flags()
    needed = [f for k in GEMM_ISAS[GEMM_ISAS.index(kind) :] for f in ISA_FLAGS[k]]
    return [f for f in needed if f not in flags]


def expected_kernels() -> str:
    """The kernels an engine started now will run, without building or importing them:
    'compiled' where a C++ compiler is present (they build on first use), else 'torch'."""
    if env.KERNELS.get() == "torch":
        return "torch"
    return "compiled" if shutil.which(env.COMPILER.get()) else "torch"
