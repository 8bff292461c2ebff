"""Reasoning content: a thinking model's ``<think> ... </think>`` block, apart from its answer.

With a parser on, a chat message carries the thinking as ``reasoning_content`` and the answer
after ``</think>`` as ``content`` (vLLM's field names); a stream sends ``delta.reasoning_content``
chunks, then ``delta.content`` ones. Tool calls and structured output read the content only.

When does an output think? The parsers (``pagedllm serve --reasoning-parser``) are vLLM's:

- ``qwen3``: when it starts with ``<think>``, or when the prompt left a think block open (a
  template whose generation prompt ends with ``<think>\\n``: the output starts inside the
  thinking). Otherwise it is all content.
- ``deepseek_r1``: always; R1 may write ``<think>`` first or start thinking at once.

Thinking ends at ``</think>``; output that never writes it was cut short while thinking and is
all reasoning. Except a constrained request (structured output, a required tool call): vLLM
starts its grammar after ``</think>``, pagedllm's engine holds the output to it from the first
token, so such an output thought only if its grammar let it close the block; otherwise it is all
content, as the grammar wrote it (a JSON answer is not taken for thinking).

The text is split by ``Reasoning.split``, a pure function of the text so far. What it settles
never moves as more text comes: the first characters wait while they may still be ``<think>``,
a tail that may be the start of ``</think>`` waits for the next token, so the streamed deltas add
up to the whole answer's split for any chunking of the text (tests/test_reasoning.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .served import ServedModel

THINK, END_THINK = "<think>", "</think>"
PARSERS = ("auto", "qwen3", "deepseek_r1", "none")


@dataclass(frozen=True)
class Split:
    """Where raw output text divides: ``text[reasoning[0]:reasoning[1]]`` is the thinking (None:
    there is none), ``text[content:settled]`` the answer (None: none yet); ``text[:settled]`` is
    decided, what follows may still be part of a tag."""

    reasoning: tuple[int, int] | None
    content: int | None
    settled: int

    def between(self, text: str, start: int, end: int) -> tuple[str, str]:
        """The (reasoning, content) in ``text[start:end]`` (``end`` at most ``settled``)."""
        reasoning = text[max(start, self.reasoning[0]) : min(end, self.reasoning[1])] if self.reasoning else ""
        content = text[max(start, self.content) : end] if self.content is not None else ""
        return reasoning, content


UNDECIDED = Split(None, None, 0)


def all_content(text: str) -> Split:
    """The text is all content, all of it settled (as it is with no parser)."""
    return Split(None, 0, len(text))


@dataclass(frozen=True)
class Reasoning:
    """How one chat request's outputs split. ``parser``: "qwen3" or "deepseek_r1"; ``opened``:
    its prompt ends inside a think block; ``constrained``: a grammar holds its output."""

    parser: str
    opened: bool = False
    constrained: bool = False

    def split(self, text: str, finished: bool) -> Split:
        """The split of the output ``text`` so far (``finished``: all of it)."""
        lead = len(text) - len(text.lstrip())
        if text.startswith(THINK, lead):
            start, thinking = lead + len(THINK), True
        elif not finished and THINK.startswith(text[lead:]):
            return UNDECIDED  # only whitespace, or a beginning of <think>, so far
        else:
            start, thinking = 0, self.opened or self.parser == "deepseek_r1"
        if not thinking:
            return all_content(text)
        end = text.find(END_THINK, start)
        if end >= 0:
            return Split((start, end), end + len(END_THINK), len(text))
        if self.constrained:  # the grammar wrote it all: it thought only if it closed the block
            return all_content(text) if finished else UNDECIDED
        settled = len(text) if finished else len(text) - partial_tag(text, END_THINK, start)
        return Split((start, settled), None, settled)

    def parse(self, text: str) -> tuple[str | None, str | None]:
        """A finished output's (reasoning, content); either None when it has none."""
        split = self.split(text, finished=True)
        reasoning, content = split.between(text, 0, split.settled)
        return (reasoning if split.reasoning else None), (content or None)


def partial_tag(text: str, tag: str, start: int = 0) -> int:
    """How many characters at the end of ``text[start:]`` may be the beginning of ``tag``."""
    for k in range(min(len(tag) - 1, len(text) - start), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def opens_thinking(prompt_tail: str) -> bool:
    """Whether a prompt ending in ``prompt_tail`` leaves a think block open for the output."""
    return prompt_tail.rfind(THINK) > prompt_tail.rfind(END_THINK)


def choose(name: str, model: ServedModel) -> str | None:
    """The parser ``--reasoning-parser name`` means for ``model``: "auto" is qwen3's when its chat
    template mentions ``<think>`` and its tokenizer has ``<think>`` and ``</think>`` as tokens,
    else none; "none" is None."""
    if name not in PARSERS:
        raise ValueError(f"reasoning parser must be one of {', '.join(PARSERS)}, not {name!r}")
    if name != "auto":
        return None if name == "none" else name
    tokenizer = model.tokenizer
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return None
    try:
        template = model.chat_template_source()
    except ValueError:  # several templates, none the default: chat requests are refused anyway
        return None
    one_token = all(len(tokenizer.encode(tag, add_special_tokens=False)) == 1 for tag in (THINK, END_THINK))
    return "qwen3" if THINK in template and one_token else None
