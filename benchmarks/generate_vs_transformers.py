"""pagedllm's offline throughput against transformers' `generate`, same prompts, same run.

Workload: 64 chat-formatted prompts whose token counts spread evenly over 16..256 (shuffled with a
fixed seed), 64 new tokens each, greedy, ignore_eos so both sides generate the same count.

    .venv/bin/python benchmarks/generate_vs_transformers.py [--hf-batch 32] [--dtype float32]
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from pagedllm import LLM, SamplingParams

WORDS = ("the of and to in a is that for it as was with be by on not he this are or his from at "
         "which but have an they you were their one all we can her has there been if more when will "
         "would who so no time river mountain city light music garden history number system").split()


def workload(tokenizer, n: int = 64, lo: int = 16, hi: int = 256, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    targets = [lo + (hi - lo) * i // (n - 1) for i in range(n)]
    rng.shuffle(targets)
    prompts = []
    for target in targets:
        words = []
        while True:
            msg = [{"role": "user", "content": " ".join(words)}]
            ids = tokenizer.apply_chat_template(msg, add_generation_prompt=True, tokenize=False)
            ids = tokenizer.encode(ids, add_special_tokens=False)
            if len(ids) >= target:
                break
            words.append(rng.choice(WORDS))
        prompts.append(ids)
    return prompts


def run_pagedllm(llm: LLM, prompts, new_tokens: int) -> float:
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert all(len(o.token_ids) == new_tokens for o in outs)
    return len(prompts) * new_tokens / elapsed


@torch.inference_mode()
def run_transformers(path, dtype, prompts, new_tokens: int, batch: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=False, pad_token_id=0)
    return len(prompts) * new_tokens / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--hf-batch", type=int, default=32)
    ap.add_argument("--max-batch-tokens", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=None)
    args = ap.parse_args()
    llm = LLM(args.model, dtype=args.dtype, max_batch_tokens=args.max_batch_tokens,
              max_num_seqs=args.max_num_seqs)
    prompts = workload(llm.tokenizer)
    ours = run_pagedllm(llm, prompts, args.new_tokens)
    theirs = run_transformers(llm.loaded.path, getattr(torch, args.dtype), prompts, args.new_tokens, args.hf_batch)
    print(f"64 prompts of 16..256 tokens, {args.new_tokens} new tokens each, greedy, {args.dtype}, "
          f"{torch.get_num_threads()} threads")
    print(f"pagedllm:                         {ours:7.1f} output tokens/s")
    print(f"transformers generate (batch {args.hf_batch:>2}): {theirs:7.1f} output tokens/s")
    print(f"ratio: {ours / theirs:.2f}x")


if __name__ == "__main__":
    main()
