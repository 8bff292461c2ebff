"""Facts about this machine and process that a plan depends on, read from /proc (no torch)."""

from __future__ import annotations


def cpu_has_amx() -> bool:
    """Whether the CPU has AMX bf16 tiles, which oneDNN uses for bf16 GEMMs (other scratch)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return "amx_bf16" in line.split()
    except OSError:
        pass
    return False


def resident_bytes() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process in bytes: resident now, and the peak so far."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, value = line.split(":")
                fields[key] = int(value.split()[0]) * 1024
    return fields["VmRSS"], fields["VmHWM"]
