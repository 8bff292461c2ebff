"""Sampler: turns one step's logits into one token per sequence, vectorized over the batch.

Order of operations (as in HF and vLLM): a grammar's mask on the rows with a structured output
(their forbidden tokens -inf, so logprobs and every later stage see only what the grammar allows),
then penalties on the raw logits, then min_tokens masking,
then temperature, then top-k / top-p / min-p filtering, then the draw. Greedy rows take the
argmax of the penalized logits. Seeded rows draw with their own generator, so a request with a
seed gets the same tokens whatever else shares the batch. Log-probabilities are reported from
the model's distribution before penalties and temperature, like the OpenAI API does; under a
grammar, the distribution it left (renormalised), whose top list holds allowed tokens only.

Memory: rows are processed in chunks of ``CHUNK_ROWS``. A chunk of plain greedy rows costs
nothing beyond the logits; any other chunk goes through one fixed pipeline whose peak is about
25 bytes per (row, vocab entry) (see ``pagedllm.memory.footprint``), whatever the batch size. Penalties
touch only the token ids a sequence has seen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..sampling_params import SamplingParams
from ..sizes import SAMPLER_CHUNK_ROWS as CHUNK_ROWS

# argmax_rows' block: PyTorch's argmax over a row compares one value at a time (a 262,144-token
# row: 0.33 ms), its amax over blocks is vectorized (the same row 0.03 ms in all).
ARGMAX_BLOCK = 1024

# How many of its most likely tokens a filtered row is drawn from without sorting its vocabulary,
# tried in turn (``_draw``): a top-k of 32 costs 0.06 ms a row, of 256 0.14 ms, a sort ~1 ms.
CANDIDATES = (32, 256)

if TYPE_CHECKING:
    from ..backends.base import Backend
    from ..structured import Grammars


class SamplingRow(Protocol):
    """What the sampler reads of a sequence (the engine's ``Sequence`` is one)."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None
    matcher: Any  # the grammar state of a constrained row (structured.Matcher), else None


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[dict | None]  # per row: {"token": (id, logprob), "top": [(id, logprob), ...]}


def needs_full_path(seq: SamplingRow) -> bool:
    p = seq.params
    return (
        not p.greedy
        or p.logprobs is not None
        or p.repetition_penalty != 1
        or bool(p.presence_penalty)
        or bool(p.frequency_penalty)
        or len(seq.output_token_ids) < p.min_tokens
    )


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` of a [rows, vocab] tensor, exactly (the first of equal maxima; a
    NaN counts as the largest, as PyTorch's does), ~10x faster on a large vocabulary: each block's
    max, the first block holding the row's max, the first max in it."""
    rows, vocab = logits.shape
    whole = vocab // ARGMAX_BLOCK * ARGMAX_BLOCK
    if whole == 0:
        return logits.argmax(dim=-1)
    blocks = logits[:, :whole].view(rows, whole // ARGMAX_BLOCK, ARGMAX_BLOCK)
    best_block = blocks.amax(dim=-1).argmax(dim=-1)
    best = best_block * ARGMAX_BLOCK + blocks[torch.arange(rows), best_block].argmax(dim=-1)
    if whole == vocab:
        return best
    tail = logits[:, whole:]
    in_tail = tail.argmax(dim=-1)
    value, tail_value = logits.gather(1, best[:, None])[:, 0], tail.gather(1, in_tail[:, None])[:, 0]
    later_wins = (tail_value > value) | (tail_value.isnan() & ~value.isnan())
    return torch.where(later_wins, in_tail + whole, best)


class Sampler:
    def __init__(
        self, eos_token_ids: tuple[int, ...], grammars: Grammars | None = None, backend: Backend | None = None
    ):
        """``backend`` applies a grammar's mask (needed once ``grammars`` is set)."""
        self.eos_token_ids = list(eos_token_ids)
        self.backend = backend
        self.grammars = grammars  # masks constrained rows; None when no request may have a grammar

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seqs: list[SamplingRow]) -> SampleResult:
        tokens: list[int] = []
        logprobs: list[dict | None] = []
        for c0 in range(0, len(seqs), CHUNK_ROWS):
            chunk, rows = logits[c0 : c0 + CHUNK_ROWS], seqs[c0 : c0 + CHUNK_ROWS]
            if self.grammars is not None and any(s.matcher is not None for s in rows):
                assert self.backend is not None, "a sampler with grammars needs a backend to mask logits"
                self.grammars.mask_logits(chunk, [s.matcher for s in rows], self.backend)
            if any(needs_full_path(s) for s in rows):
                t, lp = self._full(chunk, rows)
            else:
                t, lp = argmax_rows(chunk).tolist(), [None] * len(rows)
            tokens += t
            logprobs += lp
        return SampleResult(tokens, logprobs)

    @torch.inference_mode()
    def distribution(self, raw: torch.Tensor, seq: SamplingRow) -> torch.Tensor:
        """The probabilities [vocab] a sampled (not greedy) row's token is drawn from: penalties,
        min_tokens, temperature, then top-k, top-p and min-p, as ``__call__`` draws. Speculative
        sampling weighs a draft's guess by it (a grammar's mask is on ``raw`` already)."""
        temperature = seq.params.temperature
        assert temperature is not None and not seq.params.greedy, "a sampled row's settings, defaults filled"
        logits = raw.clone()[None]
        _penalize_row(logits[0], seq)
        self._block_stops(logits, [seq])
        logits.div_(temperature)
        return _filtered_probs(logits, [seq.params])[0]

    def logprob(self, raw: torch.Tensor, token: int, params: SamplingParams) -> dict | None:
        """The logprobs entry of ``token`` drawn from the row ``raw`` [vocab] (None unless asked)."""
        return _logprobs(raw[None], [token], [params])[0]

    def mask_guessed(self, logits: torch.Tensor, matcher: Any, guesses: list[int]) -> None:
        """A speculative row's positions masked by its grammar, each as it stands after the
        guesses before it (``Grammars.mask_guessed``)."""
        assert self.grammars is not None and self.backend is not None, "a grammar needs the sampler's grammars"
        self.grammars.mask_guessed(logits, matcher, guesses, self.backend)

    def _full(self, raw: torch.Tensor, seqs: list[SamplingRow]):
        params = [s.params for s in seqs]
        rows, vocab = raw.shape
        logits = raw.clone()
        for row, s in enumerate(seqs):
            _penalize_row(logits[row], s)
        self._block_stops(logits, seqs)
        device = raw.device
        greedy = torch.tensor([p.greedy for p in params], device=device)
        greedy_tokens = argmax_rows(logits) if any(p.greedy for p in params) else None
        temps = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=device)[:, None]
        logits.div_(temps)
        drawn = _draw(logits, params, [s.generator for s in seqs])
        del logits
        tokens = (drawn if greedy_tokens is None else torch.where(greedy, greedy_tokens, drawn)).tolist()
        return tokens, _logprobs(raw, tokens, params)

    def _block_stops(self, logits: torch.Tensor, seqs: list[SamplingRow]) -> None:
        for row, s in enumerate(seqs):
            if len(s.output_token_ids) < s.params.min_tokens:
                stops = s.params.stop_token_ids + ([] if s.params.ignore_eos else self.eos_token_ids)
                if stops:
                    logits[row, stops] = float("-inf")


def _draw(logits: torch.Tensor, params, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row from softmax(logits) after top-k, top-p and min-p.

    Each filter keeps a prefix of the tokens ranked by probability, so a row whose kept prefix ends
    within its ``CANDIDATES[i]`` most likely tokens is drawn from those alone (a top-k, not a sort of
    the vocabulary: ~20x less work per row); only a row that keeps more (no filter, or a flat
    distribution) takes the whole-vocabulary path. Both draw by the exponential race: argmax(p / E)
    with E ~ Exp(1) is a draw from p; seeded rows take their noise from their own generator."""
    rows, vocab = logits.shape
    filtered = [0 < p.top_k < vocab or p.top_p < 1 or p.min_p > 0 for p in params]
    drawn = torch.zeros(rows, dtype=torch.long, device=logits.device)  # (greedy rows: not drawn)
    wide = [i for i in range(rows) if not filtered[i] and not params[i].greedy]
    narrow = [i for i in range(rows) if filtered[i] and not params[i].greedy]
    for k in CANDIDATES:
        if not narrow:
            break
        tokens, overflow = _draw_candidates(
            _rows(logits, narrow), [params[i] for i in narrow], [generators[i] for i in narrow], min(k, vocab)
        )
        drawn[narrow] = tokens  # (an overflowing row is drawn again below)
        narrow = [narrow[i] for i in overflow]
    wide += narrow
    if wide:
        wide.sort()
        probs = _filtered_probs(_rows(logits, wide), [params[i] for i in wide])
        drawn[wide] = _race(probs, [generators[i] for i in wide])
    return drawn


def _rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``t[rows]``, without a copy when that is every row (the common case: one kind of request)."""
    return t if rows == list(range(t.shape[0])) else t[torch.tensor(rows, device=t.device)]


def _draw_candidates(logits: torch.Tensor, params, generators, k: int) -> tuple[torch.Tensor, list[int]]:
    """Draws among each row's ``k`` most likely tokens; returns the tokens and the rows whose kept
    prefix may reach past them (their draw must take the whole vocabulary)."""
    rows, vocab = logits.shape
    device = logits.device
    values, ids = logits.topk(k, dim=-1)  # sorted, most likely first
    probs = (values - logits.logsumexp(dim=-1, keepdim=True)).exp_()  # their true probabilities
    keep = _kept(probs, params, vocab)
    overflow = keep[:, -1].logical_and(torch.tensor(k < vocab, device=device)).nonzero().flatten().tolist()
    choice = _race(probs.masked_fill_(~keep, 0), generators)
    return ids.gather(1, choice[:, None]).squeeze(1), overflow


def _kept(probs: torch.Tensor, params, vocab: int) -> torch.Tensor:
    """Which of the ranked ``probs`` (descending; true probabilities) top-k, top-p and min-p keep."""
    device = probs.device
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    min_p = torch.tensor([p.min_p for p in params], device=device)
    # drop a token when the ones ranked above it already reach top_p (rows with top_p < 1 only)
    above = probs.cumsum(dim=-1).sub_(probs)
    drop = above.ge_(top_p[:, None]).logical_and_((top_p < 1)[:, None]).bool()
    del above
    drop[:, 0] = False
    drop |= torch.arange(probs.shape[1], device=device)[None, :] >= top_k[:, None]
    drop |= probs < (min_p[:, None] * probs[:, :1])
    return ~drop


def _race(probs: torch.Tensor, generators) -> torch.Tensor:
    """argmax(p / E), E ~ Exp(1): a draw from each row of ``probs`` (unnormalized is fine)."""
    noise = torch.empty_like(probs).exponential_()
    for row, generator in enumerate(generators):
        if generator is not None:
            noise[row].exponential_(generator=generator)
    return argmax_rows(probs.div_(noise))


def _filtered_probs(logits: torch.Tensor, params) -> torch.Tensor:
    """Softmax after top-k, top-p and min-p over the whole vocabulary (sorted: the rows whose
    filters keep more than ``CANDIDATES`` tokens, or none)."""
    if not any(0 < p.top_k < logits.shape[1] or p.top_p < 1 or p.min_p > 0 for p in params):
        return logits.softmax(dim=-1)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    keep = _kept(sorted_logits.softmax(dim=-1), params, logits.shape[1])
    sorted_logits.masked_fill_(~keep, float("-inf"))
    del keep
    logits.scatter_(1, order, sorted_logits)
    del sorted_logits, order
    return logits.softmax(dim=-1)


def _logprobs(raw: torch.Tensor, tokens: list[int], params) -> list[dict | None]:
    out: list[dict | None] = [None] * len(params)
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return out
    lp = raw.log_softmax(dim=-1)
    k = max(1, max(params[i].logprobs for i in rows))
    top_vals, top_ids = lp.topk(k, dim=-1)
    for i in rows:
        n = params[i].logprobs
        top = zip(top_ids[i, :n].tolist(), top_vals[i, :n].tolist())
        out[i] = {
            "token": (tokens[i], float(lp[i, tokens[i]])),
            # a grammar may allow fewer than n tokens: the forbidden ones (-inf) are not candidates
            "top": [(t, v) for t, v in top if v != float("-inf")],
        }
    return out


def _penalize_row(logits: torch.Tensor, seq: SamplingRow) -> None:
    """Penalties touch only the tokens a sequence has seen, so they cost O(its length)."""
    p = seq.params
    penalty = p.repetition_penalty  # filled by SamplingParams.with_defaults before a step
    if penalty is not None and penalty != 1:
        seen = torch.tensor(
            sorted(set(seq.prompt_token_ids) | set(seq.output_token_ids)), dtype=torch.long, device=logits.device
        )
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / penalty, values * penalty)
    if (p.presence_penalty or p.frequency_penalty) and seq.output_token_ids:
        ids, counts = torch.tensor(seq.output_token_ids, dtype=torch.long, device=logits.device).unique(
            return_counts=True
        )
        logits[ids] -= counts * p.frequency_penalty + p.presence_penalty
