"""Grammars: a request's constraint compiled once (xgrammar), one matcher per sample, and the
token mask that keeps each constrained row of a step's logits inside its grammar.

Why xgrammar: measured on the default model's 49k-token vocabulary over eight JSON schemas
(docs/structured-output.md), it compiles a schema in 2-15 ms and fills a row's mask and advances
it in 4-13 µs per token; llguidance compiles lazily (~1 ms) but takes 30-160 µs per token. Both
are small next to a step (tens of ms); xgrammar is what vLLM and SGLang use by default.

The life of a constraint: ``compile`` (cached: the same schema from 64 requests is compiled
once; the cache is bounded in bytes) -> ``matcher`` for each sample (a fork for each of n) ->
each step, ``mask_logits`` sets every token the grammar forbids to -inf in the constrained rows
only -> the scheduler's commit advances the matcher by the token drawn. A preempted sequence
keeps its tokens (recompute re-reads them as prompt), so its matcher stays where it was; a step
that fails commits nothing, so no matcher moves.

xgrammar is imported here only: a process that never builds ``Grammars`` never loads it.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..errors import RequestRejected
from ..sampling_params import StructuredOutput
from ..sizes import CACHE_LIMIT_BYTES, XGRAMMAR_CACHE_LIMIT_BYTES
from .json_bounds import bounded_json_ebnf

if TYPE_CHECKING:
    import xgrammar

    from ..backends.base import Backend

INSTALL_HINT = (  # the extra as pyproject.toml names it; --no-deps skips the GPU compiler xgrammar asks for
    "structured output needs xgrammar: pip install 'pagedllm[structured]' (or, without triton: "
    "pip install --no-deps xgrammar==0.2.9 'apache-tvm-ffi>=0.1.11,<0.2')"
)


class Matcher(Protocol):
    """What the engine asks of one sample's grammar state (an ``xgrammar.GrammarMatcher``)."""

    def accept_token(self, token_id: int) -> bool: ...

    def fork(self) -> Matcher: ...

    def is_terminated(self) -> bool: ...

    def rollback(self, num_tokens: int) -> None: ...

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> Any: ...


def allowed_prefix(matcher: Matcher, tokens: list[int]) -> int:
    """How many of ``tokens``, in order, the grammar accepts from where ``matcher`` stands, not
    counting one that would end it (nothing can be checked after it); the matcher is left where
    it was. Speculative guesses are cut to this before they are verified."""
    n = 0
    for token in tokens:
        if not matcher.accept_token(token):
            break
        n += 1
        if matcher.is_terminated():
            n -= 1
            matcher.rollback(1)
            break
    if n:
        matcher.rollback(n)
    return n


def available() -> bool:
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        return False
    return True


class Grammars:
    """Compiles constraints for one tokenizer and masks logits by them."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...]):
        try:
            import xgrammar as xgr
        except ImportError:
            raise RequestRejected(INSTALL_HINT, param="structured_output") from None
        self._xgr = xgr
        info = _tokenizer_info(xgr, tokenizer, vocab_size, list(stop_token_ids))
        # Two caches, for two things: ours maps a request's constraint (canonical JSON) to its
        # grammar; xgrammar's keeps what it builds inside a compile (the token masks of string,
        # number and other pieces every schema shares), which halves the time of a schema it has
        # not seen (64 distinct schemas: 0.7 s instead of 1.3 s). Both are bounded in bytes, and
        # the memory plan counts both bounds (GRAMMAR_CACHE_BYTES).
        self._compiler = xgr.GrammarCompiler(
            info, max_threads=1, cache_enabled=True, cache_limit_bytes=XGRAMMAR_CACHE_LIMIT_BYTES
        )
        self.vocab_size = vocab_size
        self._cache: OrderedDict[tuple, xgrammar.CompiledGrammar] = OrderedDict()
        self._cache_bytes = 0
        self._lock = threading.Lock()
        self.compiled = 0  # grammars compiled (cache misses), for tests and the bench
        self._bitmask: torch.Tensor | None = None  # reused step to step (the engine thread's only)

    # ---- compile ---------------------------------------------------------------------------------

    def compile(self, constraint: StructuredOutput) -> xgrammar.CompiledGrammar:
        """The constraint's compiled grammar; RequestRejected naming the field if it is invalid."""
        key = constraint.key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        try:
            compiled = self._compile(constraint)
        except Exception as e:  # whatever the compiler refuses is the request's fault
            raise RequestRejected(
                f"invalid {constraint.kind}: {_compiler_message(e)}", param=constraint.param, code="invalid_grammar"
            ) from None
        with self._lock:
            self.compiled += 1
            if key not in self._cache:
                self._cache[key] = compiled
                self._cache_bytes += compiled.memory_size_bytes
            while self._cache_bytes > CACHE_LIMIT_BYTES and len(self._cache) > 1:
                _, old = self._cache.popitem(last=False)
                self._cache_bytes -= old.memory_size_bytes
        return compiled

    def _compile(self, c: StructuredOutput) -> xgrammar.CompiledGrammar:
        compiler = self._compiler
        if c.json is not None or c.json_object:
            schema = '{"type": "object"}' if c.json is None else c.json
            return compiler.compile_grammar(_json_grammar(self._xgr, schema))
        if c.regex is not None:
            return compiler.compile_regex(c.regex)
        if c.choice is not None:
            return compiler.compile_grammar("root ::= " + " | ".join(_ebnf_literal(s) for s in c.choice))
        assert c.grammar is not None
        return compiler.compile_grammar(c.grammar)

    def matcher(self, constraint: StructuredOutput) -> Matcher:
        return self._xgr.GrammarMatcher(self.compile(constraint))

    # ---- mask ------------------------------------------------------------------------------------

    def mask_logits(self, logits: torch.Tensor, matchers: list[Matcher | None], backend: Backend) -> None:
        """Sets the tokens each constrained row's grammar forbids to -inf, in place (by
        ``backend``); rows without a matcher are untouched."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return
        xgr = self._xgr
        if self._bitmask is None or self._bitmask.shape[0] < logits.shape[0]:
            self._bitmask = xgr.allocate_token_bitmask(logits.shape[0], self.vocab_size)
        bitmask = self._bitmask[: logits.shape[0]]  # every row used is filled whole below
        for i in rows:
            matchers[i].fill_next_token_bitmask(bitmask, i)  # type: ignore[union-attr]
        backend.mask_logits(logits, bitmask, rows, self.vocab_size)

    def mask_guessed(self, logits: torch.Tensor, matcher: Matcher, guesses: list[int], backend: Backend) -> None:
        """Masks a speculative row's logits, one row per position: row j as the grammar stands
        after ``guesses[:j]`` (which it accepts: ``allowed_prefix``); the matcher is left where
        it was (the commit advances it by the tokens kept)."""
        rows = len(guesses) + 1
        assert logits.shape[0] == rows
        bitmask = self._xgr.allocate_token_bitmask(rows, self.vocab_size)
        for j in range(rows):
            matcher.fill_next_token_bitmask(bitmask, j)
            if j < len(guesses) and not matcher.accept_token(guesses[j]):
                if j:
                    matcher.rollback(j)
                raise AssertionError("a guess the grammar refuses reached verification")
        if guesses:
            matcher.rollback(len(guesses))
        backend.mask_logits(logits, bitmask, list(range(rows)), self.vocab_size)


def _tokenizer_info(xgr, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]):
    """xgrammar's view of the vocabulary: every token's text as the tokenizer stores it, and
    how to read it (byte-level BPE, SentencePiece-style, raw)."""
    backend = getattr(tokenizer, "backend", None)  # pagedllm's Tokenizer (tokenizers' Rust one inside)
    if backend is None:  # a transformers tokenizer
        return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
    vocab = backend.get_vocab(with_added_tokens=True)
    encoded: list[str] = [""] * vocab_size
    for text, token_id in vocab.items():
        if token_id < vocab_size:
            encoded[token_id] = text
    metadata = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
    return xgr.TokenizerInfo(
        encoded,
        metadata["vocab_type"],
        vocab_size=vocab_size,
        stop_token_ids=stop_token_ids,
        add_prefix_space=metadata["add_prefix_space"],
    )


def _json_grammar(xgr, schema: dict | str) -> str:
    """A JSON schema's grammar as EBNF text, compact (", " and ": ": free whitespace lets a small
    model pad forever) and with numbers and strings bounded (``json_bounds``: so it ends)."""
    import xgrammar as xgr

    text = schema if isinstance(schema, str) else json.dumps(schema)
    return bounded_json_ebnf(str(xgr.Grammar.from_json_schema(text, any_whitespace=False)))


def _ebnf_literal(text: str) -> str:
    """A string as an EBNF literal (JSON's escapes are the grammar's)."""
    return json.dumps(text, ensure_ascii=False)


def _compiler_message(error: Exception) -> str:
    """xgrammar's message without its timestamp and C++ source location."""
    text = str(error).strip()
    text = re.sub(r"^\[[0-9:]+\]\s*\S+:\d+:\s*", "", text)
    return text.replace("Check failed: (error.empty()) is false: ", "")
