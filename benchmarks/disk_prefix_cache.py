"""The prefix cache's disk tier (engine/disk_prefix_cache.py) across restarts: every measurement
below starts a new process, as a restarted server does, so nothing but the directory carries over.

    .venv/bin/python benchmarks/disk_prefix_cache.py [--model PATH] [--tokens 3000] [--turns 10]
        [--llama-python PEER_VENV/bin/python] [--chat-only | --restart-only]

1. restart: a ~3000-token prompt's first token in a new process, cold (an empty directory) and
   after a process that ran it (the directory kept); tokens compared.
2. chat: a 10-turn chat, each turn resending the whole history to a new process (a ~1500-token
   system prompt, ~60-token questions, 48-token answers), with the tier and without; mean TTFT.
   With --llama-python, llama.cpp the same way (each turn a new process, a GGUF: the model's or
   the default's) with llama-cpp-python's disk prompt cache (LlamaDiskCache) and without.

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

# llama.cpp's own disk prompt cache (llama-cpp-python's LlamaDiskCache: the whole state saved
# after each completion, the longest saved prefix loaded back), in the peer's venv
LLAMA_CHILD = """
import json, sys, time
from llama_cpp import Llama, LlamaDiskCache
args = json.loads(sys.argv[1])
llm = Llama(model_path=args["model"], n_ctx=8192, n_threads=2, verbose=False)
if args["dir"]:
    llm.set_cache(LlamaDiskCache(cache_dir=args["dir"], capacity_bytes=8 << 30))
start, first, text = time.perf_counter(), None, ""
for chunk in llm.create_completion(args["prompt"], max_tokens=args["max_tokens"], temperature=0, stream=True):
    first = first or time.perf_counter()
    text += chunk["choices"][0]["text"]
print(json.dumps({"ttft": first - start, "text": text, "tokens": [], "prompt_tokens": 0, "disk_blocks": 0}))
"""

WORDS = "the of and to in is was for on that with as by at from his her an be this are which".split()


def words(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


def run(model: str | None, directory: str | None, prompt: str, max_tokens: int, llama: str | None = None) -> dict:
    """One request in a new process: pagedllm's, or with ``llama`` (a Python with llama-cpp-python) llama.cpp's."""
    args = json.dumps({"model": model, "dir": directory, "prompt": prompt, "max_tokens": max_tokens})
    command = [llama, "-c", LLAMA_CHILD, args] if llama else [sys.executable, "-c", CHILD, args]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
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


def chat(model: str | None, turns: int, llama: str | None = None) -> None:
    """Each turn in a new process; with ``llama``, llama.cpp's turns (its disk prompt cache on
    and off) after pagedllm's."""
    system = "You are a helpful assistant. " + words(1500, seed=1)
    results = {}
    runs = [("without the tier", False, None), ("with the tier", True, None)]
    if llama:
        gguf = model or default_gguf()
        runs += [("llama.cpp without its cache", False, llama), ("llama.cpp with LlamaDiskCache", True, llama)]
    for label, use_tier, peer in runs:
        with tempfile.TemporaryDirectory() as d:
            history, ttfts, answers = system, [], []
            for turn in range(turns):
                history += "\nUser: " + words(60, seed=100 + turn) + "\nAssistant:"
                out = run(gguf if peer else model, d if use_tier else None, history, 48, peer)
                ttfts.append(out["ttft"])
                answers.append(out["tokens"])
                history += out["text"]
            results[label] = (ttfts, answers)
            per_turn = " ".join(f"{t:.2f}" for t in ttfts)
            print(f"chat, {label}: TTFT per turn {per_turn} s; mean {mean(ttfts):.3f}")
    off, on = results["without the tier"], results["with the tier"]
    ratio = mean(off[0]) / mean(on[0])
    print(f"chat: mean TTFT {ratio:.2f}x better with the tier; answers identical: {off[1] == on[1]}")
    if llama:
        peer = mean(results["llama.cpp with LlamaDiskCache"][0])
        print(f"chat: pagedllm with the tier {peer / mean(on[0]):.2f}x sooner than llama.cpp with its disk cache")


def default_gguf() -> str:
    from pagedllm.loading import default_gguf_path

    return str(default_gguf_path())


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, default=3000)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--llama-python", default=None, help="a Python with llama-cpp-python: its disk cache beside")
    parser.add_argument("--chat-only", action="store_true")
    parser.add_argument("--restart-only", action="store_true")
    args = parser.parse_args()
    if not args.chat_only:
        restart(args.model, args.tokens)
    if not args.restart_only:
        chat(args.model, args.turns, args.llama_python)


if __name__ == "__main__":
    main()
