"""The result every bench runner prints, in one shape. Standard library only: the vLLM and
llama.cpp runners import it from their own venvs, where pagedllm is not installed (a script
run by path finds its sibling modules)."""

from __future__ import annotations

import json


def throughput(engine: str, prompts: list[list[int]], elapsed: float, output_tokens: int, peak_rss_bytes: int) -> dict:
    n = len(prompts)
    prompt_tokens = sum(len(p) for p in prompts)
    return {
        "engine": engine,
        "requests": n,
        "elapsed_s": elapsed,
        "requests_per_s": n / elapsed,
        "output_tokens_per_s": output_tokens / elapsed,
        "total_tokens_per_s": (output_tokens + prompt_tokens) / elapsed,
        "output_tokens": output_tokens,
        "peak_rss_bytes": peak_rss_bytes,
    }


def print_result(result: dict) -> None:
    """The line ``pagedllm bench`` reads back from the runner's stdout."""
    print("BENCH_RESULT " + json.dumps(result), flush=True)
