"""The whole process under a budget: builds LLM(memory=..., dtype=...), runs the benchmark's
standard workload (64 prompts of 16-256 tokens, 64 new tokens each, greedy) and prints the
plan and the process's resident memory at each stage, ending with its peak (VmHWM).

    .venv/bin/python benchmarks/process_memory.py 1GiB float32
    .venv/bin/python benchmarks/process_memory.py 640MiB bfloat16

Run it in a fresh process (as here): the peak is the process's since it started.
"""

from __future__ import annotations

import argparse
import time


def status() -> str:
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")):
                key, value = line.split(":")
                fields[key] = int(value.split()[0]) / 1024
    return " ".join(f"{k}={v:7.1f}" for k, v in fields.items()) + " MiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("memory")
    ap.add_argument("dtype", choices=["float32", "bfloat16"])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()
    print(f"{'start':24s}{status()}", flush=True)
    from pagedllm import LLM, SamplingParams
    from pagedllm.bench import workloads

    print(f"{'imported':24s}{status()}", flush=True)
    llm = LLM(memory=args.memory, dtype=args.dtype)
    print(f"{'LLM built':24s}{status()}", flush=True)
    print(llm.memory_plan.table(), flush=True)
    workload = workloads.standard(llm.tokenizer, args.num_prompts, args.new_tokens)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(workload.prompts, params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    print(f"{'generated':24s}{status()}")
    print(
        f"{len(outs)} requests, {tokens} tokens in {elapsed:.0f} s ({tokens / elapsed:.1f} tok/s), "
        f"{llm.stats.preemptions} preemptions"
    )


if __name__ == "__main__":
    main()
