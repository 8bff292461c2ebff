"""Measures the true peak of tensor memory over a block of code, relative to its start.

CUDA: the caching allocator's own peak counter. CPU: torch's profiler with ``profile_memory``
records every allocation and free made through torch's CPU allocator, including the internal
workspaces of ATen kernels (oneDNN scratch, softmax conversions); their running sum is the live
tensor memory, and its maximum is the peak. Memory that libraries allocate outside torch's
allocator (e.g. MKL's own packing buffers) is not tensor memory and is not counted.
"""

from __future__ import annotations

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
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.result.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._start
            self.result.net_bytes = torch.cuda.memory_allocated(self.device) - self._start
            return
        self._prof.__exit__(*exc)
        events = sorted((e.start_ns(), e.nbytes()) for e in self._prof.profiler.kineto_results.events()
                        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
        live = peak = 0
        for _, nbytes in events:
            live += nbytes
            peak = max(peak, live)
        self.result.peak_bytes, self.result.net_bytes = peak, live
