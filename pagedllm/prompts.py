"""Text to prompt token ids: encoding and chat templating with a model's tokenizer.

Torch-free, because the server's API process does this work (the engine process never sees text
it has to tokenize) and holds no torch. ``LLM`` and ``LLMEngine`` use the same functions.
"""

from __future__ import annotations

from typing import Any

from .errors import RequestRejected


def encode(tokenizer: Any, text: str, special: bool = False) -> list[int]:
    """Text to token ids; a prompt the tokenizer fails on is rejected, like any bad input.
    ``special``: with the tokenizer's own special tokens (its post-processor's: Gemma's and
    Llama 3's <bos>), as a plain prompt is encoded (``encode_prompt``); a chat template's text
    already holds them."""
    if tokenizer is None:
        raise RequestRejected("this model directory has no tokenizer: pass token ids instead of text")
    try:
        return tokenizer.encode(text, add_special_tokens=special)
    except Exception as e:
        raise RequestRejected(f"the tokenizer cannot encode this prompt: {type(e).__name__}: {e}") from None


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """A plain prompt's ids, the tokenizer's special tokens added as vLLM and transformers add
    them (Gemma answers nonsense without its <bos>); none where the tokenizer adds none."""
    return encode(tokenizer, text, special=True)


def apply_chat_template(tokenizer: Any, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """The prompt ids of a conversation, with the generation prompt; ``tools`` (OpenAI's
    function definitions) go to a template that renders them (``server.tool_calls`` for
    one that does not). Whatever the template raises on the messages is their fault:
    RequestRejected naming ``messages`` (a ValueError; the server answers 400); nothing
    else is caught, so a bug is not mistaken for bad input."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise RequestRejected("this model has no chat template: send a plain prompt", param="messages")
    if not messages:
        raise RequestRejected("messages must not be empty", param="messages")
    try:  # in jinja2's immutable sandbox (loading/tokenizer.py): no attribute escapes, no I/O
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **({"tools": tools} if tools else {})
        )
    except Exception as e:
        message = f"the chat template cannot render these messages: {type(e).__name__}: {e}"
        raise RequestRejected(message, param="messages") from None
    return encode(tokenizer, text)


def chat_template_source(tokenizer: Any, tools: list[dict] | None = None) -> str:
    """The template text ``apply_chat_template`` would use (its tool-use one, given tools)."""
    pick = getattr(tokenizer, "pick_template", None)
    if pick is not None:
        return pick(None, tools)
    template = getattr(tokenizer, "chat_template", None) or ""
    return template if isinstance(template, str) else template.get("default", "")


def decode_one(tokenizer: Any):
    """token id -> its text, for logprobs (``str`` of the id when there is no tokenizer)."""
    if tokenizer is None:
        return str
    return lambda token_id: tokenizer.decode([token_id])
