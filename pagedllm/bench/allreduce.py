"""The all-reduce micro-benchmark of tensor parallelism: what one sum over the ranks costs, through
shared memory and through gloo, at the sizes a step sends (16 KiB: a decode row or a few; 256 KiB:
a small batch; 4 MiB: a prefill chunk).

    pagedllm bench --allreduce [--tensor-parallel-size 2]

Each rank is a process of its own on this host, pinned to its share of the cores as an engine's
ranks are; rank 0 prints the median time of a call per size and path.
"""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import time

from .. import env

SIZES = (16 * 1024, 256 * 1024, 4 * 1024 * 1024)


def main(ranks: int, iterations: int = 200) -> int:
    print(f"# all-reduce of float32 over {ranks} ranks on this host (median of {iterations} calls, rank 0's clock)")
    print("| size | shared memory | gloo | gloo / shared memory |")
    print("|---:|---:|---:|---:|")
    times = {path: _run(ranks, iterations, path) for path in ("shm", "gloo")}
    for size in SIZES:
        shm, gloo = times["shm"].get(size), times["gloo"].get(size)
        cells = [f"{t * 1e6:.1f} us" if t else "n/a" for t in (shm, gloo)]
        ratio = f"{gloo / shm:.1f}x" if shm and gloo else ""
        print(f"| {size // 1024} KiB | {cells[0]} | {cells[1]} | {ratio} |")
    return 0


def _run(ranks: int, iterations: int, path: str) -> dict[int, float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    env = {**os.environ, "PAGEDLLM_TP_SHM": "1" if path == "shm" else "0"}
    cmd = [sys.executable, "-m", "pagedllm.bench.allreduce"]
    procs = [
        subprocess.Popen(
            [*cmd, str(r), str(ranks), address, str(iterations)], env=env, stdout=subprocess.PIPE, text=True
        )
        for r in range(ranks)
    ]
    out = [p.communicate()[0] for p in procs][0]
    result = {}
    for line in out.splitlines():
        if line.startswith("TIME "):
            _, size, seconds = line.split()
            result[int(size)] = float(seconds)
    return result


def _rank(rank: int, ranks: int, address: str, iterations: int) -> None:
    import torch

    from .. import backends
    from ..distributed.group import join
    from ..processes.driver_ranks import rank_cpus

    cpus = rank_cpus(rank, ranks)
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(len(cpus))
    group = join(rank, ranks, address, backends.get("auto").shared_memory_ops())
    if env.TP_SHM.get() and group.shm is None:
        group.close()
        return  # no shared memory here (no compiled kernels): nothing to time
    for size in SIZES:
        t = torch.ones(size // 4)
        for _ in range(10):
            group.all_reduce_(t)
        samples = []
        for _ in range(iterations):
            start = time.perf_counter()
            group.all_reduce_(t)
            samples.append(time.perf_counter() - start)
        if rank == 0:
            print(f"TIME {size} {statistics.median(samples)}", flush=True)
    group.close()


if __name__ == "__main__":
    _rank(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
