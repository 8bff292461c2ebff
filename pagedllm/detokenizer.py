"""Incremental detokenization and stop strings.

Text is re-decoded from the output ids each step (cheap for the fast tokenizers) and only the part
that can no longer change is released: a trailing U+FFFD means a multi-byte character is still
incomplete, and the last ``len(longest stop) - 1`` characters could still turn out to be the start
of a stop string, so both are held back until the next token settles them.
"""

from __future__ import annotations

from .sequence import Sequence


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

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
            seq.text = seq.text[:min(hits)]
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
