"""Issue 54's switching time: a model's own cold start (``pagedllm serve`` started, to its first
token) against a request that makes a fleet switch models (unload, load, first token), two copies
of the default model under a budget that holds one at a time; and the naive way beside it (each
model its own server given the whole budget, as counting models instead of bytes does): the two
servers' peak RSS together, and the fleet's whole process tree's, against the budget.

    python benchmarks/fleet_switch.py [--budget 1.1GiB] [--repeats 2]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
from server_process import ServerProcess, tree_rss

from pagedllm.loading import default_gguf_path
from pagedllm.sizes import parse_memory


def first_token(url: str, model: str | None) -> None:
    body = {"prompt": "The capital of France is", "max_tokens": 1, "temperature": 0}
    answer = httpx.post(url + "/v1/completions", json={**body, **({"model": model} if model else {})}, timeout=300)
    answer.raise_for_status()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", default="1.1GiB")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    colds = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        server = ServerProcess("--model", str(default_gguf_path()), "--memory", args.budget)
        first_token(server.url, None)
        colds.append(time.perf_counter() - started)
        server.stop()
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "b.gguf"
        shutil.copy(default_gguf_path(), copy)
        fleet = ServerProcess("--model", f"a={default_gguf_path()}", "--model", f"b={copy}", "--memory", args.budget)
        switches, fleet_peak = [], 0
        for model in ["a"] + ["b", "a"] * args.repeats:
            started = time.perf_counter()
            first_token(fleet.url, model)
            switches.append(time.perf_counter() - started)
            fleet_peak = max(fleet_peak, tree_rss(fleet.pid))
        listed = httpx.get(fleet.url + "/v1/models").json()["data"]
        fleet.stop()
        naive = [
            ServerProcess("--model", path, "--memory", args.budget) for path in (str(default_gguf_path()), str(copy))
        ]
        for server in naive:
            first_token(server.url, None)
        naive_peak = sum(tree_rss(server.pid) for server in naive)
        for server in naive:
            server.stop()
    switched = switches[1:]  # the first request loads without unloading anything
    print(f"cold start to first token: {', '.join(f'{c:.2f}' for c in colds)} s")
    print(f"a request that switches (unload, load, first token): {', '.join(f'{s:.2f}' for s in switched)} s")
    print(f"last_switch_seconds: {[m['last_switch_seconds'] for m in listed]}")
    ratio = statistics.median(switched) / statistics.median(colds)
    print(f"median switch / median cold start: {ratio:.2f}x; worst / best: {max(switched) / min(colds):.2f}x")
    budget = parse_memory(args.budget) / 2**20
    print(
        f"budget {budget:.0f} MiB: the fleet's tree at most {fleet_peak / 2**20:.0f} MiB (sampled after each request);"
    )
    print(f"  two servers given the budget each, after a request each: {naive_peak / 2**20:.0f} MiB together")
    return 0


if __name__ == "__main__":
    sys.exit(main())
