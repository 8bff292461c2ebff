"""A bf16 step's GEMMs: the compiled kernels' own packed GEMM (kernels/csrc/dense_gemm.cpp, AMX
tiles from two rows, dot products for one) against oneDNN's prepacked GEMM, the two taking turns
in one process on the same weights.

    .venv/bin/python benchmarks/dense_gemm.py [--layers 30] [--rows 1 8 16 64 208]

The default shapes are the default model's (SmolLM2-135M: hidden 576, MLP 1536, 9 + 2 x 3 heads
of 64) over 30 layers of distinct weights, so every step reads them from memory as the engine
does. Prints, per row count, each one's best time for all the layers' four GEMMs, the weight
bytes it read per second, and the ratio. Needs a CPU whose AMX the OS grants.
"""

from __future__ import annotations

import argparse
import time

import torch

from pagedllm.backends.cpu.compiled_backend import CPUCompiledBackend
from pagedllm.backends.cpu.torch_backend import CPUTorchBackend
from pagedllm.kernels import compiled_ops

SHAPES = {"q/k/v": (960, 576), "o": (576, 576), "gate/up": (3072, 576), "down": (576, 1536)}


def best_of_each(repeats: int, steps: list) -> list[float]:
    """Each step's best time, the steps taking turns (this box drifts within minutes)."""
    for step in steps:
        step()
    best = [float("inf")] * len(steps)
    for _ in range(repeats):
        for i, step in enumerate(steps):
            start = time.perf_counter()
            step()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 8, 16, 32, 64, 208])
    ap.add_argument("--repeats", type=int, default=8)
    args = ap.parse_args()
    ops = compiled_ops()
    if ops is None or not ops.amx_tiles():
        raise SystemExit("needs the compiled kernels with AMX tiles granted (amx_tiles)")
    ours, onednn = CPUCompiledBackend(ops), CPUTorchBackend()
    g = torch.Generator().manual_seed(0)
    plain = [
        {name: torch.randn(n, k, generator=g).bfloat16() for name, (n, k) in SHAPES.items()} for _ in range(args.layers)
    ]
    packed = {
        backend: [{name: backend.pack_weight(w, None) for name, w in layer.items()} for layer in plain]
        for backend in (ours, onednn)
    }
    assert all(w.dim() == 4 for layer in packed[ours] for w in layer.values()), "not packed for the kernels"
    weight_bytes = args.layers * sum(2 * n * k for n, k in SHAPES.values())
    print(f"{torch.get_num_threads()} threads, {args.layers} layers, {weight_bytes / 1e6:.0f} MB of weights")
    print("| rows | compiled kernels | oneDNN prepacked | oneDNN / compiled |")
    print("|---:|---:|---:|---:|")
    for rows in args.rows:
        xs = {name: torch.randn(rows, k, generator=g).bfloat16() for name, (n, k) in SHAPES.items()}

        def step(backend, xs=xs):
            layers = packed[backend]
            return lambda: [backend.linear(xs[name], w, None, True) for layer in layers for name, w in layer.items()]

        a, b = best_of_each(args.repeats, [step(ours), step(onednn)])
        cell = lambda s: f"{s * 1e3:.1f} ms ({weight_bytes / s / 1e9:.1f} GB/s)"  # noqa: E731
        print(f"| {rows} | {cell(a)} | {cell(b)} | {b / a:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
