"""The machine and process facts a plan depends on (read from /proc, no torch), and the process
settings that keep a plan true: the allocator returns freed memory, kernel caches are capped."""

from __future__ import annotations

import functools
import os
import shutil

from ..layers.workspace import QUANT_FLOAT_ANY_ROWS, QUANT_FLOAT_AVX2_ROWS, QUANT_KERNEL_MAX_ROWS

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


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (/proc/cpuinfo's first 'flags' line; empty where it is absent)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def kernel_float_max_rows() -> int:
    """The most float32 rows the compiled quantized kernel would take here (any on its AVX-512
    path, 64 on AVX2, else as many as bf16 rows), as ``kernels.build`` targets it
    (``PAGEDLLM_KERNEL_TARGET``, else this CPU), for a plan made without loading the kernels
    (``pagedllm plan``); a backend tells it exactly."""
    target = os.environ.get("PAGEDLLM_KERNEL_TARGET", "").strip()
    flags = cpu_flags()
    if target == "x86-64-v4" or (not target and {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags):
        return QUANT_FLOAT_ANY_ROWS
    if target == "x86-64-v3" or (not target and {"avx2", "fma"} <= flags):
        return QUANT_FLOAT_AVX2_ROWS
    return QUANT_KERNEL_MAX_ROWS


def onednn_isa_cap() -> str | None:
    """The best kind ONEDNN_MAX_CPU_ISA (or its old name DNNL_MAX_CPU_ISA) lets oneDNN use, or
    None where it caps nothing. oneDNN reads it once, at its first use; pagedllm's own AMX
    kernels (kernels/csrc/amx.h) obey the same variable, so setting it runs a machine as
    one without AMX."""
    for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        value = os.environ.get(name, "").strip().upper()
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
    whose flags the CPU has, capped as oneDNN caps it. ``layers.onednn_probe`` asks oneDNN
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
    if os.environ.get("PAGEDLLM_KERNELS", "").strip().lower() == "torch":
        return "torch"
    return "compiled" if shutil.which(os.environ.get("CXX", "c++")) else "torch"


def usable_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def resident_bytes(pid: int | str = "self") -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process (or ``pid``) in bytes: resident now, and the peak so far."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, value = line.split(":")
                fields[key] = int(value.split()[0]) * 1024
    return fields["VmRSS"], fields["VmHWM"]


# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8
MMAP_THRESHOLD_BYTES = 256 * 1024


def bound_allocator_slack() -> bool:
    """Makes glibc give freed memory back instead of keeping it, so resident memory follows the
    live tensors the plan counts. By default glibc raises its mmap threshold to 32 MiB after the
    first large free, after which a step's activations come from heaps it rarely returns, and
    it keeps up to 8 arenas per core for the engine's and libraries' threads. Here: every block
    of 256 KiB or more is its own mapping, unmapped when freed; heaps are trimmed beyond 1 MiB
    of free top; two arenas. Process-wide, set once when a budget is given; returns False
    where the C library is not glibc (nothing is changed there)."""
    try:
        mallopt = _libc().mallopt
    except (OSError, AttributeError):
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    ok &= mallopt(_M_TRIM_THRESHOLD, 1024 * 1024) == 1
    ok &= mallopt(_M_ARENA_MAX, 2) == 1
    return bool(ok)


def _libc():
    """The C library already loaded in this process. Not ``ctypes.util.find_library``: that runs
    ``ldconfig`` in a forked child, which counts the whole parent as its resident memory."""
    import ctypes

    return ctypes.CDLL(None)


def return_freed_heap() -> None:
    """Gives the C heap's free memory back to the system (glibc's malloc_trim); a no-op elsewhere.
    After a burst of large frees (a parsed tokenizer.json, weights replaced by their packed
    copies) glibc would keep it."""
    try:
        _libc().malloc_trim(0)
    except (OSError, AttributeError):
        pass


KERNEL_CACHE_ENTRIES = 16


def bound_kernel_caches(entries: int = KERNEL_CACHE_ENTRIES) -> None:
    """Caps the two caches of compiled GEMM kernels that bf16 matmuls fill, one entry per input
    shape: oneDNN's primitive cache and ideep's (PyTorch's oneDNN wrapper) LRU cache, 1024
    entries each by default. A serving engine's steps have ever new row counts, and measured
    here each entry holds ~0.5 MB, so uncapped they grew a bf16 process by ~250 MB over the
    64-prompt benchmark (fp32 matmuls do not use them). 16 entries cover the shapes of the
    last few steps; the run was faster, not slower. Both libraries read these variables once,
    at their first use: a value the user set wins, and a process that ran bf16 matmuls before
    keeps its caches as they are."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(entries))
    os.environ.setdefault("LRU_CACHE_CAPACITY", str(entries))


_MADV_PAGEOUT = 21  # linux/mman.h, Linux >= 5.4


def release_library_pages() -> int:
    """Hands back the resident pages of read-only library mappings (torch's shared objects are
    ~0.5 GB of code and data, of which importing maps 75-135 MiB depending on how the kernel
    cached the files); the ones a step uses fault back in, and only those. MADV_PAGEOUT is a
    reclaim hint: contents are preserved, so it is safe for any mapping. Done just before the
    baseline is measured, it makes the baseline the libraries' working set rather than
    whatever the import happened to touch. Returns the mappings advised (0 where unsupported)."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return 0
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    advised = 0
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) < 6 or "w" in fields[1] or not fields[5].startswith("/"):
                continue
            start, end = (int(x, 16) for x in fields[0].split("-"))
            advised += madvise(start, end - start, _MADV_PAGEOUT) == 0
    return advised
