"""Parallel sampling: n samples of each prompt as one request (shared prompt blocks) against n
separate requests with the seeds those samples use, in one run on this machine.

The standard workload's first 16 prompts (16..256 tokens), 4 samples each, temperature 0.8,
64 new tokens, ignore_eos. Both ways produce the same 64 outputs (sample i of a request seeded s
draws from seed s + i); what differs is how many prompt tokens are computed and how many KV
blocks are held at the peak.

    .venv/bin/python benchmarks/parallel_sampling.py [--dtype float32] [--n 4] [--prompts 16]
"""

from __future__ import annotations

import argparse
import time

from pagedllm import LLM, SamplingParams
from pagedllm.bench.workloads import standard


def run(llm: LLM, prompts, params) -> tuple[float, int, list]:
    """Seconds, peak KV blocks in use, and every sample's tokens (prompt order, sample order)."""
    engine = llm.engine
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    done, peak = {}, 0
    start = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id, out.index] = out.token_ids
        peak = max(peak, engine.blocks.num_used)
    elapsed = time.perf_counter() - start
    return elapsed, peak, [done[key] for key in sorted(done, key=lambda k: (ids.index(k[0]), k[1]))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()
    rows = []
    for way in ("n samples, one request", "separate requests"):
        # a fresh engine each (no prefix cache carried over), the same budget
        llm = LLM(dtype=args.dtype, memory="2GiB", max_num_seqs=64, enable_prefix_caching=False)
        prompts = standard(llm.tokenizer).prompts[: args.prompts]
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0))  # warm-up
        base = dict(max_tokens=args.new_tokens, temperature=0.8, ignore_eos=True)
        if way.startswith("n"):
            todo = [(p, SamplingParams(seed=100 * i, n=args.n, **base)) for i, p in enumerate(prompts)]
        else:
            todo = [(p, SamplingParams(seed=100 * i + j, **base)) for i, p in enumerate(prompts) for j in range(args.n)]
        computed_before = llm.stats.prompt_tokens_computed
        elapsed, peak, samples = run(llm, [p for p, _ in todo], [sp for _, sp in todo])
        rows.append((way, elapsed, peak, llm.stats.prompt_tokens_computed - computed_before, samples))
    same = rows[0][4] == rows[1][4]
    print(
        f"{args.prompts} prompts x {args.n} samples, {args.new_tokens} new tokens, {args.dtype}, "
        f"prefix caching off; identical samples both ways: {same}"
    )
    print("| way | seconds | output tok/s | prompt tokens computed | peak KV blocks |")
    print("|---|---:|---:|---:|---:|")
    for way, elapsed, peak, computed, samples in rows:
        out = sum(len(s) for s in samples)
        print(f"| {way} | {elapsed:.1f} | {out / elapsed:.1f} | {computed} | {peak} |")


if __name__ == "__main__":
    main()
