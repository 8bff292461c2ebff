"""Benchmark workloads, as token ids so every engine gets exactly the same prompts.

- standard: N chat-formatted prompts whose token counts spread evenly over 16..256, shuffled with
  a fixed seed, 64 new tokens each, ignore_eos;
- single: one request alone, a ~200-token chat prompt, 128 new tokens, ignore_eos;
- shared-prefix: N requests sharing one ~512-token system prompt, each with its own ~32-token
  question, 64 new tokens each;
- a JSONL file: one request per line, {"prompt": text} or {"messages": [...]} or
  {"prompt_token_ids": [...]}, with an optional "max_tokens".
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

WORDS = (
    "the of and to in a is that for it as was with be by on not he this are or his from at "
    "which but have an they you were their one all we can her has there been if more when will "
    "would who so no time river mountain city light music garden history number system"
).split()


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    max_tokens: list[int]
    one_at_a_time: bool = False  # each request alone, the next once it has finished

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "prompts": self.prompts,
            "max_tokens": self.max_tokens,
            "one_at_a_time": self.one_at_a_time,
        }

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def _chat_ids(tokenizer, content: str, system: str | None = None) -> list[int]:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def _words_to_length(tokenizer, target: int, rng: random.Random, system: str | None = None) -> list[int]:
    words: list[str] = []
    while True:
        ids = _chat_ids(tokenizer, " ".join(words), system)
        if len(ids) >= target:
            return ids
        words.extend(rng.choice(WORDS) for _ in range(max(1, (target - len(ids)) // 2)))


def standard(tokenizer, n: int = 64, new_tokens: int = 64, lo: int = 16, hi: int = 256, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    targets = [lo + (hi - lo) * i // max(1, n - 1) for i in range(n)]
    rng.shuffle(targets)
    return Workload("standard", [_words_to_length(tokenizer, t, rng) for t in targets], [new_tokens] * n)


def single(tokenizer, new_tokens: int = 128, prompt_tokens: int = 199, seed: int = 0) -> Workload:
    """One request alone: what a chat user waits for, bound by reading the weights once per token."""
    return Workload("single", [_words_to_length(tokenizer, prompt_tokens, random.Random(seed))], [new_tokens])


def shared_prefix(
    tokenizer, n: int = 64, new_tokens: int = 64, prefix_tokens: int = 512, question_tokens: int = 32, seed: int = 0
) -> Workload:
    rng = random.Random(seed)
    system = " ".join(rng.choice(WORDS) for _ in range(prefix_tokens))
    system = tokenizer.decode(tokenizer.encode(system, add_special_tokens=False)[:prefix_tokens])
    prompts = []
    for i in range(n):
        question = f"Question {i}: " + " ".join(rng.choice(WORDS) for _ in range(question_tokens))
        question = tokenizer.decode(tokenizer.encode(question, add_special_tokens=False)[:question_tokens])
        prompts.append(_chat_ids(tokenizer, question, system))
    return Workload("shared-prefix", prompts, [new_tokens] * n)


def from_jsonl(path: str, tokenizer, new_tokens: int = 64) -> Workload:
    prompts, max_tokens = [], []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if "prompt_token_ids" in row:
                prompts.append([int(t) for t in row["prompt_token_ids"]])
            elif "messages" in row:
                text = tokenizer.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=False)
                prompts.append(tokenizer.encode(text, add_special_tokens=False))
            elif "prompt" in row:
                prompts.append(tokenizer.encode(row["prompt"], add_special_tokens=False))
            else:
                raise ValueError(f"{path}:{n}: needs prompt, messages or prompt_token_ids")
            max_tokens.append(int(row.get("max_tokens", new_tokens)))
    if not prompts:
        raise ValueError(f"{path}: no requests")
    return Workload(path, prompts, max_tokens)
