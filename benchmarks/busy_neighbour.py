"""One short request while other processes keep every core busy: the engine's thread governor
(backends/cpu_threads.py) against a fixed thread count, each in its own process, one after another.

    .venv/bin/python benchmarks/busy_neighbour.py [--dtype float32] [--busy N]

Prints, for each setting, the seconds a 24-token greedy answer takes alone and next to N busy
processes (default: one per CPU), best of 3.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

REQUEST = """
import sys, time
from pagedllm import LLM, SamplingParams
llm = LLM(dtype=sys.argv[1])
params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
llm.generate(["Hello"], SamplingParams(max_tokens=2, temperature=0))
for _ in range(int(sys.argv[2])):
    if sys.stdin.readline().strip() != "go":
        break
    start = time.perf_counter()
    llm.generate(["Give me two tips for sleeping better."], params)
    print(f"{time.perf_counter() - start:.3f}", flush=True)
"""


def measure(env: dict, dtype: str, busy: int, runs: int = 3) -> tuple[float, float]:
    proc = subprocess.Popen(
        [sys.executable, "-c", REQUEST, dtype, str(2 * runs)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )

    def one() -> float:
        proc.stdin.write("go\n")
        proc.stdin.flush()
        return float(proc.stdout.readline())

    alone = min(one() for _ in range(runs))
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
    try:
        time.sleep(1.5)  # the governor reads the load every 0.5 s
        crowded = min(one() for _ in range(runs))
    finally:
        for p in spinners:
            p.kill()
        proc.stdin.close()
        proc.wait()
    return alone, crowded


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--busy", type=int, default=len(os.sched_getaffinity(0)))
    args = ap.parse_args()
    settings = {
        "default (adapts)": {},
        "fixed threads, pinned": {"PAGEDLLM_ADAPT_THREADS": "0"},
        "fixed threads, not pinned": {"PAGEDLLM_ADAPT_THREADS": "0", "PAGEDLLM_PIN_THREADS": "0"},
        "one thread": {"PAGEDLLM_THREADS": "1"},
    }
    print(f"| threads | alone (s) | next to {args.busy} busy processes (s) |")
    print("|---|---:|---:|")
    for name, extra in settings.items():
        alone, crowded = measure({**os.environ, **extra}, args.dtype, args.busy)
        print(f"| {name} | {alone:.2f} | {crowded:.2f} |", flush=True)


if __name__ == "__main__":
    main()
