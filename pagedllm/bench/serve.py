"""``pagedllm bench --serve URL``: the workload sent to a running OpenAI-compatible server (ours
or a peer's), as clients would: streamed ``/v1/completions`` requests of token ids, arriving all
at once (``--request-rate inf``) or as a Poisson process at a fixed rate (a seeded schedule, so
two servers get the same arrivals). Greedy, ``ignore_eos``: every server generates the same
count.

Per request it records when it was sent, when its first token arrived and when it finished; it
reports output tokens/s over the whole run, TTFT (send to first token) and TPOT (time per output
token after the first: (finish - first token) / (tokens - 1)), p50 and p99. Tokens are counted
from the server's ``usage`` (one streamed chunk may carry several). A request that fails counts
in ``failed`` and in no figure.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field


@dataclass
class RequestTiming:
    sent: float
    first_token: float | None = None
    done: float | None = None
    output_tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float:
        assert self.first_token is not None
        return self.first_token - self.sent

    @property
    def tpot(self) -> float | None:
        if self.first_token is None or self.done is None or self.output_tokens < 2:
            return None
        return (self.done - self.first_token) / (self.output_tokens - 1)


@dataclass
class LoadResult:
    rate: float  # requests/s; inf: all at once
    timings: list[RequestTiming] = field(default_factory=list)
    elapsed: float = 0.0

    def summary(self) -> dict:
        done = [t for t in self.timings if t.error is None and t.first_token is not None]
        tokens = sum(t.output_tokens for t in done)
        ttft = [t.ttft for t in done]
        tpot = [p for p in (t.tpot for t in done) if p is not None]
        return {
            "request_rate": self.rate,
            "requests": len(self.timings),
            "failed": len(self.timings) - len(done),
            "output_tokens": tokens,
            "elapsed_s": self.elapsed,
            "output_tokens_per_s": tokens / self.elapsed if self.elapsed else 0.0,
            "ttft_ms": _percentiles(ttft),
            "tpot_ms": _percentiles(tpot),
        }


def arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """Send times (seconds from the start): all 0 at rate inf, else exponential gaps of mean 1/rate."""
    if rate == float("inf"):
        return [0.0] * n
    rng = random.Random(seed)
    t, times = 0.0, []
    for _ in range(n):
        times.append(t)
        t += rng.expovariate(rate)
    return times


async def run_load(
    url: str,
    prompts: list[list[int]],
    max_tokens: list[int],
    rate: float,
    api_key: str | None = None,
    seed: int = 0,
    timeout: float = 3600,
) -> LoadResult:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=len(prompts) + 1, max_keepalive_connections=len(prompts) + 1)
    async with httpx.AsyncClient(base_url=url.rstrip("/"), headers=headers, timeout=timeout, limits=limits) as client:
        model = (await client.get("/v1/models")).raise_for_status().json()["data"][0]["id"]
        start = time.perf_counter()
        schedule = arrivals(len(prompts), rate, seed)

        async def one(ids: list[int], n: int, at: float) -> RequestTiming:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            timing = RequestTiming(sent=time.perf_counter())
            body = {
                "model": model,
                "prompt": ids,
                "max_tokens": n,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            try:
                await _stream(client, body, timing)
            except Exception as e:  # a server that drops or refuses it: counted, not fatal
                timing.error = f"{type(e).__name__}: {e}"
            return timing

        timings = await asyncio.gather(*(one(p, n, at) for p, n, at in zip(prompts, max_tokens, schedule)))
        elapsed = max((t.done or 0.0) for t in timings) - start
    return LoadResult(rate, list(timings), elapsed)


async def _stream(client, body: dict, timing: RequestTiming) -> None:
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and timing.first_token is None:  # (a model without a tokenizer sends no text)
                timing.first_token = time.perf_counter()
            if chunk.get("usage"):
                timing.output_tokens = chunk["usage"]["completion_tokens"]
    timing.done = time.perf_counter()


def _percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p99": None, "mean": None}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return {"p50": 1000 * statistics.median(ordered), "p99": 1000 * p99, "mean": 1000 * statistics.fmean(ordered)}


def table(rows: list[dict]) -> str:
    lines = [
        "| request rate | requests | failed | output tok/s | TTFT p50 / p99 | TPOT p50 / p99 |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ttft, tpot = r["ttft_ms"], r["tpot_ms"]
        lines.append(
            f"| {r['request_rate']:g} | {r['requests']} | {r['failed']} | {r['output_tokens_per_s']:.1f} | "
            f"{_ms(ttft['p50'])} / {_ms(ttft['p99'])} ms | {_ms(tpot['p50'])} / {_ms(tpot['p99'])} ms |"
        )
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def parse_rates(text: str) -> list[float]:
    """'inf' or '2' or '1,2,4,inf': the rates to run, one after another."""
    try:
        return [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--request-rate {text!r}: numbers (requests/s) or inf, comma-separated") from None


def main(args, workload) -> int:
    """Runs ``workload`` against ``args.serve`` at every ``--request-rate``; prints the table."""
    rows = []
    for rate in parse_rates(args.request_rate):
        result = asyncio.run(
            run_load(args.serve, workload.prompts, workload.max_tokens, rate, args.api_key, timeout=args.timeout)
        )
        rows.append(result.summary())
        print(f"# rate {rate:g}: done", flush=True)
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"url": args.serve, "workload": workload.name, "rows": rows}, f, indent=2)
    return 0 if all(r["failed"] == 0 for r in rows) else 1
