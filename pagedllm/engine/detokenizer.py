"""Incremental detokenization, and the rules that end a sequence after each token.

Text is re-decoded from the output ids each step (cheap for the fast tokenizers) and only the part
that can no longer change is released: a trailing U+FFFD means a multi-byte character is still
incomplete, and the last ``len(longest stop) - 1`` characters could still turn out to be the start
of a stop string, so both are held back until the next token settles them.
"""

from __future__ import annotations

import logging

from .sequence import Finish, Sequence

log = logging.getLogger(__name__)


class Detokenizer:
    def __init__(self, tokenizer, eos_token_ids: tuple[int, ...], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def check_stop(self, seq: Sequence) -> Finish | None:
        """After a token was appended: refreshes the text and says whether the sequence ends,
        and why. A stop token or string ends it with "stop" (the stop token's
        text and the stop string are not part of the text); max_tokens or the context with
        "length"; a tokenizer that fails on this output fails this request alone."""
        p = seq.params
        token = seq.output_token_ids[-1]
        by_token = token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids)
        try:
            by_string = self.update(seq, drop_last=by_token)
        except Exception as e:  # this request's text is lost; nobody else's is
            log.warning("detokenizing %s failed: %r", seq.request_id, e)
            return Finish("error", f"the tokenizer cannot decode this output: {type(e).__name__}: {e}", "detokenize")
        if by_token or by_string:
            return Finish("stop")
        if len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return Finish("length")
        return None

    def update(self, seq: Sequence, drop_last: bool) -> bool:
        """Refreshes ``seq.text``; returns True if a stop string ended it (text cut before it)."""
        if self.tokenizer is None:
            return False
        ids = seq.output_token_ids[:-1] if drop_last else seq.output_token_ids
        seq.text = self.tokenizer.decode(ids, skip_special_tokens=True)
        stops = seq.params.stop
        if not stops:
            return False
        search_from = max(0, seq.emitted_chars - max(len(s) for s in stops))
        hits = [i for i in (seq.text.find(s, search_from) for s in stops) if i >= 0]
        if hits:
            seq.text = seq.text[: min(hits)]
            return True
        return False

    @staticmethod
    def releasable(seq: Sequence) -> int:
        """How many characters of ``seq.text`` are final."""
        if seq.is_finished:
            return len(seq.text)
        end = len(seq.text)
        while end > 0 and seq.text[end - 1] == "\ufffd":
            end -= 1
        if seq.params.stop:
            end = min(end, len(seq.text) - (max(len(s) for s in seq.params.stop) - 1))
        return max(end, seq.emitted_chars)
