"""The prefix cache's disk tier (engine/disk_prefix_cache.py) across restarts: every measurement
below starts a new process, as a restarted server does, so nothing but the directory carries over.

    .venv/bin/python benchmarks/disk_prefix_cache.py [--model PATH] [--tokens 3000] [--turns 10]

1. restart: a ~3000-token prompt's first token in a new process, cold (an empty directory) and
   after a process that ran it (the directory kept); tokens compared.
2. chat: a 10-turn chat, each turn resending the whole history to a new process (a ~1500-token
   system prompt, ~60-token questions, 48-token answers), with the tier and without; mean TTFT.

Prints each figure and the ratios. The third target (64 prompts with nothing to reuse, tier on
against off) is `pagedllm bench --workload standard --num-prompts 64 [--prefix-cache-dir D]`.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile

CHILD = """
import json, sys
from pagedllm import LLM, SamplingParams
args = json.loads(sys.argv[1])
options = {"prefix_cache_dir": args["dir"]} if args["dir"] else {}
if args["model"]:
    options["model"] = args["model"]
llm = LLM(**options)
out = llm.generate([args["prompt"]], SamplingParams(max_tokens=args["max_tokens"], temperature=0, ignore_eos=True))[0]
llm.close()
m = out.metrics
print(json.dumps({"ttft": m.first_token_time - m.arrival_time, "text": out.text, "tokens": out.token_ids,
                  "prompt_tokens": len(out.prompt_token_ids), "disk_blocks": llm.stats.prefix_disk_hit_blocks}))
"""

WORDS = "the of and to in is was for on that with as by at from his her an be this are which".split()


def words(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


def run(model: str | None, directory: str | None, prompt: str, max_tokens: int) -> dict:
    args = json.dumps({"model": model, "dir": directory, "prompt": prompt, "max_tokens": max_tokens})
    done = subprocess.run([sys.executable, "-c", CHILD, args], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def restart(model: str | None, tokens: int) -> None:
    prompt = words(tokens, seed=0)
    with tempfile.TemporaryDirectory() as d:
        cold = run(model, d, prompt, 16)
        warm = run(model, d, prompt, 16)
    same = cold["tokens"] == warm["tokens"]
    print(
        f"restart: {cold['prompt_tokens']}-token prompt, first token cold {cold['ttft']:.3f} s, after a restart "
        f"{warm['ttft']:.3f} s ({warm['disk_blocks']} blocks read): {cold['ttft'] / warm['ttft']:.1f}x sooner; "
        f"tokens identical: {same}"
    )


def chat(model: str | None, turns: int) -> None:
    system = "You are a helpful assistant. " + words(1500, seed=1)
    results = {}
    for label, use_tier in (("without the tier", False), ("with the tier", True)):
        with tempfile.TemporaryDirectory() as d:
            history, ttfts, answers = system, [], []
            for turn in range(turns):
                history += "\nUser: " + words(60, seed=100 + turn) + "\nAssistant:"
                out = run(model, d if use_tier else None, history, 48)
                ttfts.append(out["ttft"])
                answers.append(out["tokens"])
                history += out["text"]
            results[label] = (ttfts, answers)
            per_turn = " ".join(f"{t:.2f}" for t in ttfts)
            print(f"chat, {label}: TTFT per turn {per_turn} s; mean {mean(ttfts):.3f}")
    off, on = results["without the tier"], results["with the tier"]
    ratio = mean(off[0]) / mean(on[0])
    print(f"chat: mean TTFT {ratio:.2f}x better with the tier; answers identical: {off[1] == on[1]}")


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, default=3000)
    parser.add_argument("--turns", type=int, default=10)
    args = parser.parse_args()
    restart(args.model, args.tokens)
    chat(args.model, args.turns)


if __name__ == "__main__":
    main()
