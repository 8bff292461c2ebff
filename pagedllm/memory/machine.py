"""The process facts a plan depends on (read from /proc, no torch), and the process settings that
keep a plan true: the allocator returns freed memory, kernel caches are capped. The CPU's own
facts (its GEMM kernels, its ISA) are the device's: ``backends.cpu.machine``."""

from __future__ import annotations

import os


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
