"""Throughput against max_batch_tokens (M) on this machine: the evidence for the planner's auto M.

The standard workload of `pagedllm bench` (64 chat prompts of 16..256 tokens, 64 new tokens,
greedy, ignore_eos). For each M: output tokens/s, total tokens/s, and the planner's activation
reserve for that M.

    .venv/bin/python benchmarks/sweep_max_batch_tokens.py [--dtype float32] [--values 64,128,...]
"""

from __future__ import annotations

import argparse
import time

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.bench.workloads import standard


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--values", default="64,128,256,512,1024,2048")
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    prompts = None
    print(
        f"| max_batch_tokens | output tok/s | total tok/s | activation reserve | ({args.dtype}, "
        f"{torch.get_num_threads()} threads)"
    )
    print("|---:|---:|---:|---:|")
    for m in (int(v) for v in args.values.split(",")):
        llm = LLM(dtype=args.dtype, max_batch_tokens=m, memory="3GiB")
        prompts = prompts or standard(llm.tokenizer).prompts
        llm.generate(prompts[:4], SamplingParams(max_tokens=4, temperature=0))  # warm-up
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
        out_tokens = sum(len(o.token_ids) for o in outs)
        total = out_tokens + sum(len(p) for p in prompts)
        print(
            f"| {m} | {out_tokens / elapsed:.1f} | {total / elapsed:.1f} | "
            f"{llm.memory_plan.activation_bytes / 2**20:.1f} MiB |",
            flush=True,
        )


if __name__ == "__main__":
    main()
