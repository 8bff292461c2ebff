"""Measures the true peak of tensor memory over a block of code, relative to its start.

CUDA: the caching allocator's own peak counter. CPU: torch's profiler with ``profile_memory``
records every allocation and free made through torch's CPU allocator, including the internal
workspaces of ATen kernels (oneDNN scratch, softmax conversions); their running sum is the live
tensor memory, and its maximum is the peak. Memory that libraries allocate outside torch's
allocator (e.g. MKL's own packing buffers) is not tensor memory and is not counted.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import torch


@dataclass
class PeakMeasurement:
    peak_bytes: int = 0  # highest live tensor memory above the starting point
    net_bytes: int = 0  # allocated minus freed over the block


class track_peak:
    """``with track_peak() as m: ...`` then ``m.peak_bytes``."""

    def __init__(self, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        self.result = PeakMeasurement()

    def __enter__(self) -> PeakMeasurement:
        # Garbage collected mid-block would show up as frees of memory this block never allocated:
        # the collector is off inside it. Not collected before it (a full collection took 0.1-0.15 s
        # a block, most of a measured step's time): garbage left alive allocates nothing in the
        # block, and a free of memory the block never allocated is not counted (_peak_of).
        self._gc_was_enabled = gc.isenabled()
        gc.disable()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        else:
            from torch.profiler import ProfilerActivity, profile

            self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._prof.__enter__()
        return self.result

    def __exit__(self, *exc) -> None:
        if self._gc_was_enabled:
            gc.enable()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.result.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._start
            self.result.net_bytes = torch.cuda.memory_allocated(self.device) - self._start
            return
        self._prof.__exit__(*exc)
        self.result.peak_bytes, self.result.net_bytes = _peak_of(self._prof)


def _peak_of(prof) -> tuple[int, int]:
    """Replays the allocation events in time order. A free counts only if its block was allocated
    inside the block being measured: torch's CPU memory reporter keeps sizes across profiling
    sessions, so a reused address can otherwise produce a free of memory this block never had."""
    from torch._C._profiler import _EventType

    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
            events.append((e.start_time_ns, e.extra_fields.alloc_size, e.extra_fields.ptr))
    events.sort()
    sizes: dict[int, int] = {}
    live = peak = 0
    for _, size, ptr in events:
        if size > 0:
            sizes[ptr] = size
        elif ptr in sizes:
            size = -sizes.pop(ptr)
        else:
            continue
        live += size
        peak = max(peak, live)
    return peak, live
