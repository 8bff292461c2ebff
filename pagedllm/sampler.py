"""Sampler: turns one step's logits into one token per sequence, vectorized over the batch.

Order of operations (as in HF and vLLM): penalties on the raw logits, then min_tokens masking,
then temperature, then top-k / top-p / min-p filtering, then the draw. Greedy rows take the
argmax of the penalized logits. Seeded rows draw with their own generator, so a request with a
seed gets the same tokens whatever else shares the batch. Log-probabilities are reported from
the model's raw distribution, like the OpenAI API does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sequence import Sequence


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[dict | None]  # per row: {"token": (id, logprob), "top": [(id, logprob), ...]}


class Sampler:
    def __init__(self, eos_token_ids: tuple[int, ...]):
        self.eos_token_ids = list(eos_token_ids)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampleResult:
        logits = logits.float()
        raw = logits
        params = [s.params for s in seqs]
        if any(p.repetition_penalty != 1 or p.presence_penalty or p.frequency_penalty for p in params):
            logits = self._penalize(logits.clone(), seqs)
        if any(len(s.output_token_ids) < s.params.min_tokens for s in seqs):
            logits = self._block_stops(logits if logits is not raw else logits.clone(), seqs)
        greedy = torch.tensor([p.greedy for p in params])
        tokens = logits.argmax(dim=-1)
        if not bool(greedy.all()):
            temps = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params])
            probs = self._filter(logits / temps[:, None], params).softmax(dim=-1)
            drawn = self._draw(probs, seqs)
            tokens = torch.where(greedy, tokens, drawn)
        token_list = tokens.tolist()
        return SampleResult(token_list, self._logprobs(raw, token_list, params))

    def _penalize(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        b, vocab = logits.shape
        rep = torch.tensor([s.params.repetition_penalty for s in seqs])[:, None]
        pres = torch.tensor([s.params.presence_penalty for s in seqs])[:, None]
        freq = torch.tensor([s.params.frequency_penalty for s in seqs])[:, None]
        out_counts = _counts([s.output_token_ids for s in seqs], b, vocab)
        seen = (out_counts + _counts([s.prompt_token_ids for s in seqs], b, vocab)) > 0
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalized, logits)
        return logits - pres * (out_counts > 0) - freq * out_counts

    def _block_stops(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        for row, s in enumerate(seqs):
            if len(s.output_token_ids) < s.params.min_tokens:
                stops = s.params.stop_token_ids + ([] if s.params.ignore_eos else self.eos_token_ids)
                if stops:
                    logits[row, stops] = float("-inf")
        return logits

    @staticmethod
    def _filter(logits: torch.Tensor, params) -> torch.Tensor:
        vocab = logits.shape[-1]
        top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params])
        top_p = torch.tensor([p.top_p for p in params])
        min_p = torch.tensor([p.min_p for p in params])
        if bool((top_k < vocab).any()) or bool((top_p < 1).any()):
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            rank = torch.arange(vocab)[None, :]
            drop = rank >= top_k[:, None]
            probs = sorted_logits.softmax(dim=-1)
            # drop a token when the ones ranked above it already reach top_p
            drop |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
            drop[:, 0] = False
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
        if bool((min_p > 0).any()):
            probs = logits.softmax(dim=-1)
            threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
            logits = logits.masked_fill(probs < threshold, float("-inf"))
        return logits

    @staticmethod
    def _draw(probs: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        # Exponential race: argmax(p / E) with E ~ Exp(1) is a draw from p. Each seeded row
        # draws its noise from its own generator; the rest share one batched draw.
        noise = torch.empty_like(probs).exponential_()
        for row, s in enumerate(seqs):
            if s.generator is not None:
                noise[row].exponential_(generator=s.generator)
        return (probs / noise).argmax(dim=-1)

    @staticmethod
    def _logprobs(raw: torch.Tensor, tokens: list[int], params) -> list[dict | None]:
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        out: list[dict | None] = [None] * len(params)
        if not rows:
            return out
        lp = raw[rows].log_softmax(dim=-1)
        k = max(params[i].logprobs for i in rows)
        top_vals, top_ids = lp.topk(max(k, 1), dim=-1)
        for j, i in enumerate(rows):
            n = params[i].logprobs
            out[i] = {
                "token": (tokens[i], float(lp[j, tokens[i]])),
                "top": list(zip(top_ids[j, :n].tolist(), top_vals[j, :n].tolist())),
            }
        return out


def _counts(token_lists: list[list[int]], rows: int, vocab: int) -> torch.Tensor:
    counts = torch.zeros(rows, vocab)
    longest = max((len(t) for t in token_lists), default=0)
    if longest:
        ids = torch.tensor([t + [0] * (longest - len(t)) for t in token_lists])
        ones = torch.tensor([[1.0] * len(t) + [0.0] * (longest - len(t)) for t in token_lists])
        counts.scatter_add_(1, ids, ones)
    return counts
