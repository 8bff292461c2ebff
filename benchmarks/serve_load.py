"""Streaming load against a running `pagedllm serve` (loopback only): requests/s and
time-to-first-token percentiles at several concurrency levels.

    .venv/bin/pagedllm serve --memory 2GiB &
    .venv/bin/python benchmarks/serve_load.py --url http://127.0.0.1:8000 --concurrency 1 8 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import httpx

QUESTIONS = [
    "What is the capital of France?",
    "Name three colours.",
    "Why is the sky blue?",
    "Write a haiku about rain.",
    "What is 12 times 12?",
    "Give me a fun fact about cats.",
]


async def one(http: httpx.AsyncClient, url: str, i: int, max_tokens: int) -> tuple[float, float, int]:
    body = {
        "messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    start = time.perf_counter()
    first, tokens = None, 0
    async with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                tokens += 1
                if first is None:
                    first = time.perf_counter() - start
    return first or 0.0, time.perf_counter() - start, tokens


async def level(url: str, concurrency: int, requests: int, max_tokens: int) -> dict:
    queue = list(range(requests))
    results = []

    async def worker(http):
        while queue:
            results.append(await one(http, url, queue.pop(), max_tokens))

    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as http:
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    ttft = sorted(r[0] for r in results)
    pct = lambda q: ttft[min(len(ttft) - 1, int(q * len(ttft)))]  # noqa: E731
    return {
        "concurrency": concurrency,
        "requests": requests,
        "req_per_s": requests / elapsed,
        "ttft_p50": statistics.median(ttft),
        "ttft_p99": pct(0.99),
        "output_tok_per_s": sum(r[2] for r in results) / elapsed,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--requests-per-level", type=int, default=None, help="default: 2 x concurrency, at least 8")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    print("| concurrent streams | requests | requests/s | output tok/s | TTFT p50 | TTFT p99 |")
    print("|---:|---:|---:|---:|---:|---:|")
    for c in args.concurrency:
        n = args.requests_per_level or max(8, 2 * c)
        r = asyncio.run(level(args.url, c, n, args.max_tokens))
        print(
            f"| {c} | {n} | {r['req_per_s']:.2f} | {r['output_tok_per_s']:.1f} | "
            f"{r['ttft_p50'] * 1000:.0f} ms | {r['ttft_p99'] * 1000:.0f} ms |",
            flush=True,
        )


if __name__ == "__main__":
    main()
