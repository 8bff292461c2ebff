"""Prints the measured-vs-predicted table of docs/memory.md: real engine steps of many shapes,
each measured (torch's allocator events, see pagedllm.memory_tracker) and predicted
(pagedllm.planner.step_transient_bytes). The same grid runs in the tests with the 10% bound.

    .venv/bin/python benchmarks/memory_grid.py [--model PATH] [--dtype float32 bfloat16]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from memory_grid import run_grid  # noqa: E402

from pagedllm import loading  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    args = ap.parse_args()
    print("| dtype | step | tokens | sampled | measured | predicted | predicted / measured | peak phase |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for dtype in args.dtype:
        for p in run_grid(loading.load(args.model, dtype), dtype):
            print(f"| {dtype} | {p.name} | {p.tokens} | {p.sampled} | {p.measured / 2**20:.3f} MiB | "
                  f"{p.predicted / 2**20:.3f} MiB | {p.ratio:.3f} | {p.peak_phase} |", flush=True)


if __name__ == "__main__":
    main()
