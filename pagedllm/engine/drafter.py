"""DraftModel: speculative guesses from a smaller model of the same tokenizer.

Before the scheduler fills a step, the draft model proposes, for every decoding sequence that
may guess, its greedy continuation of up to ``limit`` tokens: one pass over what it has not
seen yet of the sequence (the whole prompt the first time, then the tokens the target accepted
since), whose last position gives the first guess, then one pass per further guess, each
feeding the guess before. All sequences go through each pass together.

The draft model keeps its own paged KV cache with its own block manager: as many blocks as the
target's cache (the memory plan counts a draft block beside each target block), no prefix
sharing. A sequence's draft K/V are valid up to the tokens it has seen (``_seen``); the K/V of
fed guesses sit past that and are overwritten when those positions come round again. They are
kept while the sequence lives (a preempted one resumes with them) and freed when it ends; a
sequence the draft cache has no room for decodes without guesses.

For a greedy request (or one with a grammar) the draft proposes its argmax: a deterministic
proposal, for which the model's verification (``ModelRunner.verify``: a guess stands when the
model samples that very token) is exact rejection sampling. For a sampled request it draws each
guess from its own distribution under the request's settings (temperature, top-k/p, min-p,
penalties) and keeps that distribution on the sequence (``guess_probs``); the model accepts a
guess with probability min(1, p/q) and replaces the first it refuses by a draw from
max(0, p - q) (``ModelRunner._verify_drawn``): outputs follow the model's distribution, and
accept more often than a greedy guess at higher temperatures.
"""

from __future__ import annotations

import torch

from .. import loading
from ..backends.base import Backend, KVCache
from ..config import ModelConfig
from ..engine_config import ConfigError, EngineConfig
from ..layers.sampler import Sampler
from ..loading import LoadedModel
from ..models import DecoderLM
from ..sampling_params import SamplingParams
from .block_manager import BlockManager
from .model_runner import AfterGuesses, ModelRunner
from .sequence import Sequence
from .step import ScheduledRow, SchedulerOutput

_GREEDY = SamplingParams(temperature=0)
# Text both tokenizers must turn into the same ids (words, digits, code, accents, a space run).
_PROBE = "The draft model's tokenizer, 12345 + 0.5; def f(x): return x  # café, naïve"


def draft_facts(config: EngineConfig) -> tuple[ModelConfig, int] | None:
    """The draft model's config and weights' bytes, for the memory plan (None: no draft)."""
    if config.speculative_method != "draft_model" or not config.draft_model:
        return None
    model_dir, _ = loading.resolve_model_dir(config.draft_model)
    weights, _ = loading.checkpoint_weights(model_dir, config.dtype, None)
    return ModelConfig.from_file(model_dir), weights


def load_draft(config: EngineConfig, target: LoadedModel, backend: Backend) -> LoadedModel:
    """The draft model, in the engine's dtype, as stored; ConfigError if its tokenizer is not the
    target's (the ids it guesses would mean other text) or, without tokenizers to compare, its
    vocabulary differs."""
    assert config.draft_model
    model_dir, name = loading.resolve_model_dir(config.draft_model)
    draft = loading.load_dir(model_dir, name, config.dtype, backend=backend)
    mine, theirs = draft.tokenizer, target.tokenizer
    if mine is not None and theirs is not None:
        same = mine.encode(_PROBE) == theirs.encode(_PROBE) and mine.eos_token_id == theirs.eos_token_id
    else:
        same = draft.config.vocab_size == target.config.vocab_size
    if not same:
        raise ConfigError("draft_model", f"{config.draft_model}: its tokenizer is not the model's")
    return draft


class DraftModel:
    """A ``speculative.Proposer`` running ``model`` over its own ``kv_cache``."""

    pause_after_misses = True  # every guess costs a draft pass

    def __init__(
        self,
        model: DecoderLM,
        kv_cache: KVCache,
        backend: Backend,
        max_step_tokens: int,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
    ):
        """``max_step_tokens``: the most tokens one draft pass computes (the target's step budget,
        which the memory plan's activation peak covers); ``vocab_size``: the target's (a guess
        past it, from a draft with a larger padded vocabulary, ends the proposal);
        ``eos_token_ids``: the model's (min_tokens keeps them out of a draw)."""
        self.runner = ModelRunner(model, kv_cache, None, backend)
        self.sampler = Sampler(eos_token_ids)
        self.blocks = BlockManager(kv_cache.num_blocks, kv_cache.block_size, enable_prefix_caching=False)
        self.max_step_tokens = max_step_tokens
        self.vocab_size = vocab_size
        self._seen: dict[int, int] = {}  # seq id -> its tokens whose K/V the draft cache holds

    def forget(self, seq_id: int) -> None:
        self.blocks.free(seq_id)
        self._seen.pop(seq_id, None)

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        guesses: list[list[int]] = [[] for _ in seqs]
        drawn: dict[int, list[torch.Tensor]] = {}  # a sampled request's draft distributions
        going = [i for i, limit in enumerate(limits) if limit > 0 and self._make_room(seqs[i], limit)]
        if not going:
            return guesses
        # pass 1: everything the draft has not seen, the last position giving the first guess
        pieces = [(i, self._seen.get(seqs[i].seq_id, 0), seqs[i].num_tokens) for i in going]
        self._choose(seqs, going, self._catch_up(seqs, pieces), guesses, drawn)
        for seq in (seqs[i] for i in going):
            self._seen[seq.seq_id] = seq.num_tokens
        # then one pass per further guess, feeding the one before
        for j in range(1, max(limits[i] for i in going)):
            going = [i for i in going if len(guesses[i]) == j and limits[i] > j and guesses[i][-1] < self.vocab_size]
            if not going:
                break
            rows = [self._row(seqs[i], seqs[i].num_tokens + j - 1, [guesses[i][-1]], True) for i in going]
            self._choose(seqs, going, self._logits(rows), guesses, drawn)
        for i, probs in drawn.items():
            seqs[i].guess_probs = torch.stack(probs)
        return [_within(g, self.vocab_size) for g in guesses]

    def _choose(
        self,
        seqs: list[Sequence],
        going: list[int],
        logits: torch.Tensor,
        guesses: list[list[int]],
        drawn: dict[int, list[torch.Tensor]],
    ) -> None:
        """The next guess of each ``seqs[i]``, i in ``going``, from its row of ``logits``: the
        argmax for a greedy request or one with a grammar (a deterministic guess: the model's
        verification by equality is exact for it), else a draw from the draft's distribution
        under the request's sampling settings, kept for the model's speculative sampling."""
        for r, i in enumerate(going):
            seq, row = seqs[i], logits[r]
            if seq.params.greedy or seq.matcher is not None:
                guesses[i].append(int(row.argmax().item()))
                continue
            q = self.sampler.distribution(_as_vocab(row, self.vocab_size), AfterGuesses(seq, guesses[i]))
            guesses[i].append(int(torch.multinomial(q, 1, generator=seq.generator).item()))
            drawn.setdefault(i, []).append(q)

    def _make_room(self, seq: Sequence, limit: int) -> bool:
        """Blocks for what a proposal of ``limit`` tokens writes (the sequence's unseen tokens
        and the guesses fed back); False, and no guesses, when the draft cache has none."""
        start, end = min(self._seen.get(seq.seq_id, 0), seq.num_tokens - 1), seq.num_tokens + limit - 1
        if not self.blocks.can_write(seq.seq_id, start, end):
            return False
        self.blocks.prepare_write(seq.seq_id, start, end)  # no prefix sharing: no copies
        self._seen[seq.seq_id] = start
        return True

    def _catch_up(self, seqs: list[Sequence], pieces: list[tuple[int, int, int]]) -> torch.Tensor:
        """The logits after each sequence's tokens [start, end), computed in passes of at most
        ``max_step_tokens`` tokens (a long prompt is cut into chunks); one row per piece."""
        found: dict[int, torch.Tensor] = {}
        todo = list(pieces)
        while todo:
            rows, room, rest = [], self.max_step_tokens, []
            for i, start, end in todo:
                take = min(end - start, room)
                if take == 0:
                    rest.append((i, start, end))
                    continue
                seq = seqs[i]
                rows.append((i, self._row(seq, start, seq.tokens(start, start + take), start + take == end)))
                room -= take
                if start + take < end:
                    rest.append((i, start + take, end))
            sampled = [i for i, row in rows if row.samples]
            found.update(zip(sampled, self._logits([row for _, row in rows])))
            todo = rest
        return torch.stack([found[i] for i, _, _ in pieces])

    def _row(self, seq: Sequence, start: int, tokens: list[int], samples: bool) -> ScheduledRow:
        table = list(self.blocks.table(seq.seq_id))  # one pool: the draft's cache is shared by all its layers
        return ScheduledRow(seq.seq_id, seq.request_id, seq.index, start, tokens, (table,), samples, _GREEDY)

    def _logits(self, rows: list[ScheduledRow]) -> torch.Tensor:
        """One draft pass; the logits of each sampling row, in order."""
        return self.runner.execute(self.runner.prepare(SchedulerOutput(rows=rows)))


def _as_vocab(row: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A draft's logits row as wide as the model's vocabulary (cut, or -inf past the draft's)."""
    if row.shape[0] >= vocab_size:
        return row[:vocab_size]
    return torch.cat([row, row.new_full((vocab_size - row.shape[0],), float("-inf"))])


def _within(guesses: list[int], vocab_size: int) -> list[int]:
    """The guesses up to the first the target's vocabulary does not have."""
    for j, token in enumerate(guesses):
        if token >= vocab_size:
            return guesses[:j]
    return guesses
