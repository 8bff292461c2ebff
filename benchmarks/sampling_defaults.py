"""How often each candidate default sampling setting ends a chat answer in a repetition loop.

    PAGEDLLM_CACHE=/tmp/pcache .venv/bin/python benchmarks/sampling_defaults.py [--seeds 5] [--max-tokens 256]

Twenty everyday chat questions, through the chat template, with each candidate (greedy, greedy
with a repetition penalty, the SmolLM2 authors' recommendation, llama.cpp's interactive defaults,
...) and ``--seeds`` seeds. An answer *loops* when it runs to ``max_tokens`` and its last
``TAIL`` tokens repeat with a period of at most ``MAX_PERIOD`` tokens: the same n-gram over and
over. Also reported: answers that stop by themselves, and how varied an answer's words are
(distinct / total tokens, over answers that did not loop), so a setting that avoids loops by
saying little shows up.
"""

from __future__ import annotations

import argparse
import time

from pagedllm import LLM, SamplingParams
from pagedllm.sampling_params import SAMPLING_OFF

QUESTIONS = [
    "Give me two tips for sleeping better.",
    "What should I cook for dinner tonight?",
    "How do I make a good cup of coffee?",
    "What are some ways to save money each month?",
    "How can I stay focused while studying?",
    "Give me three ideas for a rainy weekend.",
    "How do I start running as a beginner?",
    "What is a healthy breakfast?",
    "How can I be more productive at work?",
    "What should I pack for a weekend trip?",
    "How do I keep my houseplants alive?",
    "Suggest a few good habits for the morning.",
    "How can I improve my handwriting?",
    "What are some tips for a job interview?",
    "How do I clean a cast iron pan?",
    "Give me some ideas for a birthday gift for my mother.",
    "How can I reduce stress?",
    "What is the best way to learn a new language?",
    "How do I write a polite email to my landlord?",
    "Explain how to boil an egg.",
]

# name -> sampling fields (max_tokens and seed are added per run)
CANDIDATES: dict[str, dict] = {
    "greedy": dict(temperature=0.0),
    "greedy, repetition_penalty 1.1": dict(temperature=0.0, repetition_penalty=1.1),
    "temperature 0.2, top_p 0.9 (SmolLM2 authors)": dict(temperature=0.2, top_p=0.9),
    "temperature 0.2, top_p 0.9, repetition_penalty 1.1": dict(temperature=0.2, top_p=0.9, repetition_penalty=1.1),
    "temperature 0.8, top_k 40, top_p 0.95, min_p 0.05 (llama.cpp)": dict(
        temperature=0.8, top_k=40, top_p=0.95, min_p=0.05
    ),
    "temperature 0.6, top_p 0.9, min_p 0.05, repetition_penalty 1.1": dict(
        temperature=0.6, top_p=0.9, min_p=0.05, repetition_penalty=1.1
    ),
}
TAIL, MAX_PERIOD = 48, 24


def loops(tokens: list[int], max_tokens: int) -> bool:
    """Ran to max_tokens with its last TAIL tokens one pattern of period <= MAX_PERIOD."""
    if len(tokens) < max_tokens or len(tokens) < TAIL + MAX_PERIOD:
        return False
    tail = tokens[-(TAIL + MAX_PERIOD) :]
    return any(all(tail[i] == tail[i + p] for i in range(TAIL)) for p in range(1, MAX_PERIOD + 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    llm = LLM(dtype=args.dtype)
    prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    rows = []
    for name, fields in CANDIDATES.items():
        start = time.perf_counter()
        looped = stopped = 0
        variety: list[float] = []
        seeds = 1 if fields.get("temperature", 1.0) == 0 else args.seeds  # greedy: one seed is all seeds
        for seed in range(seeds):
            every = {**SAMPLING_OFF, **fields}  # every field set: no default fills any
            params = [
                SamplingParams(max_tokens=args.max_tokens, seed=1000 * seed + i, **every) for i in range(len(prompts))
            ]
            for out in llm.generate(prompts, params):
                if loops(out.token_ids, args.max_tokens):
                    looped += 1
                    continue
                stopped += out.finish_reason == "stop"
                variety.append(len(set(out.token_ids)) / max(1, len(out.token_ids)))
        answers = seeds * len(prompts)
        rows.append((name, answers, looped, stopped, sum(variety) / max(1, len(variety))))
        print(f"# {name}: {time.perf_counter() - start:.0f}s", flush=True)
    print(f"\n{len(QUESTIONS)} questions, {args.seeds} seeds (greedy: 1), max_tokens {args.max_tokens}, {args.dtype}\n")
    print("| candidate | answers | loop to max_tokens | stop by themselves | distinct-token ratio |")
    print("|---|---:|---:|---:|---:|")
    for name, answers, looped, stopped, variety in rows:
        print(f"| {name} | {answers} | {looped / answers:.0%} | {stopped / answers:.0%} | {variety:.2f} |")


if __name__ == "__main__":
    main()
