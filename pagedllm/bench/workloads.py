"""Benchmark workloads, as token ids so every engine gets exactly the same prompts.

- standard: N chat-formatted prompts whose token counts spread evenly over 16..256, shuffled with
  a fixed seed, 64 new tokens each, ignore_eos;
- single: one request alone, a ~200-token chat prompt, 128 new tokens, ignore_eos;
- shared-prefix: N requests sharing one ~512-token system prompt, each with its own ~32-token
  question, 64 new tokens each;
- a JSONL file: one request per line, {"prompt": text} or {"messages": [...]} or
  {"prompt_token_ids": [...]}, with an optional "max_tokens".

A checkpoint without a tokenizer (random weights written for a benchmark: config.json and
safetensors alone) gets the same three workloads with the same token counts, drawn instead as
token ids from a seeded ``random.Random`` over the model's vocabulary less the ids its config
names special (bos, eos): ``Vocab``. Its standard prompts are exactly 16..256 tokens, its single
prompt 199, its shared-prefix prompts one 512-token prefix plus 32 tokens of their own. A JSONL
file's text prompts (prompt, messages) need a tokenizer; without one only prompt_token_ids serve.
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


@dataclass(frozen=True)
class Vocab:
    """The token ids a tokenizer-free workload draws from: 0 .. size - 1, less ``special``."""

    size: int
    special: frozenset[int] = frozenset()

    @classmethod
    def of(cls, cfg) -> Vocab:
        """A ``ModelConfig``'s vocabulary, less its bos and eos ids."""
        return cls(cfg.vocab_size, frozenset(i for i in (cfg.bos_token_id, *cfg.eos_token_ids) if i is not None))

    def draw(self, n: int, rng: random.Random) -> list[int]:
        ids: list[int] = []
        while len(ids) < n:
            token = rng.randrange(self.size)
            if token not in self.special:
                ids.append(token)
        return ids


def _needs(vocab: Vocab | None) -> Vocab:
    if vocab is None:
        raise ValueError("a workload without a tokenizer draws token ids: give the model's Vocab")
    return vocab


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
    """A chat turn's prompt; for a base model (a tokenizer without a chat template) the text
    itself, system text first, with the tokenizer's special tokens as a plain prompt has them."""
    if not getattr(tokenizer, "chat_template", None):
        return tokenizer.encode(f"{system}\n\n{content}" if system else content, add_special_tokens=True)
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


def standard(
    tokenizer,
    n: int = 64,
    new_tokens: int = 64,
    lo: int = 16,
    hi: int = 256,
    seed: int = 0,
    vocab: Vocab | None = None,
) -> Workload:
    """``tokenizer`` None: token ids drawn from ``vocab``, the same lengths."""
    rng = random.Random(seed)
    targets = [lo + (hi - lo) * i // max(1, n - 1) for i in range(n)]
    rng.shuffle(targets)
    if tokenizer is None:
        return Workload("standard", [_needs(vocab).draw(t, rng) for t in targets], [new_tokens] * n)
    return Workload("standard", [_words_to_length(tokenizer, t, rng) for t in targets], [new_tokens] * n)


def single(
    tokenizer, new_tokens: int = 128, prompt_tokens: int = 199, seed: int = 0, vocab: Vocab | None = None
) -> Workload:
    """One request alone: what a chat user waits for, bound by reading the weights once per token."""
    rng = random.Random(seed)
    if tokenizer is None:
        return Workload("single", [_needs(vocab).draw(prompt_tokens, rng)], [new_tokens])
    return Workload("single", [_words_to_length(tokenizer, prompt_tokens, rng)], [new_tokens])


def shared_prefix(
    tokenizer,
    n: int = 64,
    new_tokens: int = 64,
    prefix_tokens: int = 512,
    question_tokens: int = 32,
    seed: int = 0,
    vocab: Vocab | None = None,
) -> Workload:
    rng = random.Random(seed)
    if tokenizer is None:
        ids = _needs(vocab)
        prefix = ids.draw(prefix_tokens, rng)
        return Workload("shared-prefix", [prefix + ids.draw(question_tokens, rng) for _ in range(n)], [new_tokens] * n)
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
            if tokenizer is None and "prompt_token_ids" not in row:
                raise ValueError(
                    f"{path}:{n}: a text prompt (prompt, messages) needs the model's tokenizer, and this "
                    "model has none; give its tokens as prompt_token_ids"
                )
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
