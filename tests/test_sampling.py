"""Sampling: filters never emit a token outside their allowed set; penalties, min_tokens and
logprobs do what their names promise; bad parameters fail at creation."""

import pytest
import torch

from pagedllm.engine.sequence import Sequence
from pagedllm.layers.sampler import ARGMAX_BLOCK, Sampler, argmax_rows
from pagedllm.sampling_params import SAMPLING_OFF, SamplingParams

VOCAB = 50


def seqs_for(params_list, outputs=None):
    seqs = []
    for i, p in enumerate(params_list):
        s = Sequence(f"r{i}", [1, 2, 3], p.with_defaults(SAMPLING_OFF))  # unset fields: off
        s.output_token_ids = list(outputs[i]) if outputs else []
        if p.seed is not None:
            s.generator = torch.Generator().manual_seed(p.seed)
        seqs.append(s)
    return seqs


def random_logits(rows, seed=0):
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("k", [1, 3, 10])
def test_top_k_only_emits_the_k_most_likely(k):
    logits = random_logits(64)
    seqs = seqs_for([SamplingParams(temperature=1.5, top_k=k)] * 64)
    for _ in range(5):
        tokens = Sampler(())(logits, seqs).token_ids
        allowed = logits.topk(k).indices
        assert all(t in allowed[i].tolist() for i, t in enumerate(tokens))


@pytest.mark.parametrize("p", [0.05, 0.5, 0.9])
def test_top_p_only_emits_the_nucleus(p):
    logits = random_logits(64, seed=1)
    seqs = seqs_for([SamplingParams(temperature=1.0, top_p=p)] * 64)
    probs = logits.softmax(-1)
    for _ in range(5):
        tokens = Sampler(())(logits, seqs).token_ids
        for i, t in enumerate(tokens):
            sorted_p, order = probs[i].sort(descending=True)
            before = sorted_p.cumsum(0) - sorted_p  # mass ranked above each token
            nucleus = set(order[before < p].tolist())
            assert t in nucleus


@pytest.mark.parametrize("min_p", [0.1, 0.5])
def test_min_p_only_emits_tokens_near_the_top(min_p):
    logits = random_logits(64, seed=2)
    seqs = seqs_for([SamplingParams(temperature=1.0, min_p=min_p)] * 64)
    probs = logits.softmax(-1)
    for _ in range(5):
        tokens = Sampler(())(logits, seqs).token_ids
        assert all(probs[i, t] >= min_p * probs[i].max() for i, t in enumerate(tokens))


def test_mixed_batch_each_row_gets_its_own_rule():
    logits = random_logits(3, seed=3)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=2.0, top_k=2),
    ]
    tokens = Sampler(())(logits, seqs_for(params)).token_ids
    assert tokens[0] == int(logits[0].argmax()) and tokens[1] == int(logits[1].argmax())
    assert tokens[2] in logits[2].topk(2).indices.tolist()


def test_seeded_rows_repeat_and_unseeded_rows_vary():
    logits = random_logits(1, seed=4).repeat(2, 1)
    first = Sampler(())(logits, seqs_for([SamplingParams(seed=7)] * 2)).token_ids
    again = Sampler(())(logits, seqs_for([SamplingParams(seed=7)] * 2)).token_ids
    assert first == again and first[0] == first[1]
    draws = {
        tuple(Sampler(())(random_logits(4, seed=5), seqs_for([SamplingParams()] * 4)).token_ids) for _ in range(10)
    }
    assert len(draws) > 1


def test_penalties_push_seen_tokens_down():
    logits = torch.zeros(3, VOCAB)
    logits[:, 7] = 1.0
    logits[:, 8] = 0.9
    params = [
        SamplingParams(temperature=0, presence_penalty=0.5),
        SamplingParams(temperature=0, frequency_penalty=0.05),
        SamplingParams(temperature=0, repetition_penalty=2.0),
    ]
    tokens = Sampler(())(logits, seqs_for(params, outputs=[[7], [7, 7, 7], [7]])).token_ids
    assert tokens == [8, 8, 8]
    assert Sampler(())(logits[:1], seqs_for([SamplingParams(temperature=0)], outputs=[[7]])).token_ids == [7]


def test_min_tokens_holds_back_eos_and_stop_ids():
    logits = torch.zeros(2, VOCAB)
    logits[:, 2] = 10.0  # eos is by far the most likely
    logits[:, 11] = 9.0
    params = [
        SamplingParams(temperature=0, min_tokens=3),
        SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[11]),
    ]
    tokens = Sampler((2,))(logits, seqs_for(params, outputs=[[5], [5]])).token_ids
    assert tokens[0] == 11 and tokens[1] not in (2, 11)
    done = Sampler((2,))(logits[:1], seqs_for(params[:1], outputs=[[5, 5, 5]])).token_ids
    assert done == [2]


def test_logprobs_report_the_chosen_token_and_top_n_of_the_model_distribution():
    logits = random_logits(2, seed=6)
    res = Sampler(())(logits, seqs_for([SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=0)]))
    lp = logits.log_softmax(-1)
    chosen, value = res.logprobs[0]["token"]
    assert chosen == res.token_ids[0] and value == pytest.approx(float(lp[0, chosen]), abs=1e-5)
    top = res.logprobs[0]["top"]
    assert [t for t, _ in top] == lp[0].topk(3).indices.tolist()
    assert res.logprobs[1] is None


@pytest.mark.parametrize(
    "bad",
    [
        dict(temperature=-1),
        dict(top_p=0),
        dict(top_k=-2),
        dict(max_tokens=0),
        dict(min_p=2),
        dict(min_tokens=99, max_tokens=5),
        dict(stop=[""]),
        dict(logprobs=50),
        dict(presence_penalty=3),
    ],
)
def test_bad_parameters_fail_at_creation_naming_the_field(bad):
    field = next(iter(bad))
    with pytest.raises(ValueError, match=field):
        SamplingParams(**bad)


def nucleus_probs(logits_row: torch.Tensor, top_p: float, min_p: float) -> torch.Tensor:
    """The oracle: sort the whole vocabulary, keep the nucleus and min-p, renormalize."""
    probs = logits_row.softmax(-1)
    sorted_p, order = probs.sort(descending=True)
    keep = (sorted_p.cumsum(0) - sorted_p < top_p) & (sorted_p >= min_p * sorted_p[0])
    kept = torch.zeros_like(probs)
    kept[order[keep]] = probs[order[keep]]
    return kept / kept.sum()


def test_a_nucleus_wider_than_the_candidates_is_drawn_from_whole():
    """Filtered rows are drawn from their most likely tokens without a sort (layers/sampler.py,
    CANDIDATES); a nucleus of thousands of tokens must still reach all of them."""
    vocab, rows = 4096, 64
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(5)) * 0.1  # nearly flat
    seqs = seqs_for([SamplingParams(temperature=1.0, top_p=0.95)] * rows)
    ranks = []
    for _ in range(10):
        tokens = Sampler(())(logits, seqs).token_ids
        for i, t in enumerate(tokens):
            assert nucleus_probs(logits[i], 0.95, 0.0)[t] > 0
            ranks.append(int((logits[i] > logits[i, t]).sum()))
    assert max(ranks) > 1000  # draws beyond the candidates: the whole nucleus is reachable


def test_filtered_draws_follow_the_renormalized_nucleus():
    vocab = 4096
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(6)) * 4  # peaked
    params = SamplingParams(temperature=1.0, top_p=0.9, min_p=0.01)
    expected = nucleus_probs(logits[0], 0.9, 0.01)
    draws = 4000
    seqs = seqs_for([params] * draws)
    tokens = torch.tensor(Sampler(())(logits.expand(draws, vocab).contiguous(), seqs).token_ids)
    counts = torch.bincount(tokens, minlength=vocab).double()
    assert counts[expected == 0].sum() == 0
    kept = expected > 0
    # every kept token's frequency within 5 standard deviations of its probability
    sd = (expected[kept] * (1 - expected[kept]) / draws).sqrt()
    assert ((counts[kept] / draws - expected[kept]).abs() <= 5 * sd + 1e-3).all()


def chi_square_bound(df: int, z: float = 3.72) -> float:
    """The chi-square value a fair draw exceeds with probability ~1e-4 (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


@pytest.mark.parametrize(
    "temperature, top_k, top_p, min_p",
    [(0.5, 0, 1.0, 0.0), (1.7, 0, 1.0, 0.0), (1.3, 12, 1.0, 0.0), (0.8, 0, 0.9, 0.0), (1.2, 20, 0.95, 0.02)],
)
def test_draws_follow_softmax_of_logits_over_temperature_after_the_filters(temperature, top_k, top_p, min_p):
    """A chi-square test of 20000 seeded draws against the oracle written here: softmax(logits / T),
    then top-k, top-p (on the whole distribution) and min-p, renormalized. A sampler that ignores
    the temperature, or a top_p that keeps only the most likely token, fails it."""
    torch.manual_seed(0)
    vocab, draws = 64, 20000
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(7)) * 2
    probs = (logits[0] / temperature).softmax(-1).double()
    sorted_p, order = probs.sort(descending=True)
    rank = torch.arange(vocab)
    keep = (sorted_p.cumsum(0) - sorted_p < top_p) & (sorted_p >= min_p * sorted_p[0])
    keep &= rank < (top_k if top_k > 0 else vocab)
    expected = torch.zeros_like(probs)
    expected[order[keep]] = sorted_p[keep]
    expected /= expected.sum()
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    tokens = torch.tensor(Sampler(())(logits.expand(draws, vocab).contiguous(), seqs_for([params] * draws)).token_ids)
    counts = torch.bincount(tokens, minlength=vocab).double()
    assert counts[expected == 0].sum() == 0, "a filtered-out token was drawn"
    kept = expected > 0
    assert kept.sum() > 1, "the case must leave a distribution to test"
    chi2 = ((counts[kept] - draws * expected[kept]) ** 2 / (draws * expected[kept])).sum().item()
    assert chi2 < chi_square_bound(int(kept.sum()) - 1), f"chi-square {chi2:.1f} over {int(kept.sum())} tokens"


@pytest.mark.parametrize("vocab", [7, ARGMAX_BLOCK, 3 * ARGMAX_BLOCK, 3 * ARGMAX_BLOCK + 77])
def test_greedy_argmax_is_pytorchs_on_ties_nan_and_infinities(vocab):
    """Greedy tokens come from argmax_rows, a faster argmax: it must pick what PyTorch's does,
    the first of equal maxima (in the same block, in different blocks, in the tail past the last
    whole block) and the first NaN, whatever the vocabulary's size against the block."""
    g = torch.Generator().manual_seed(vocab)
    rows = torch.randint(-5, 5, (12, vocab), generator=g).float()  # small integers: ties everywhere
    rows[1] = -float("inf")
    rows[2, -1] = float("nan")
    rows[3, vocab // 2] = float("nan")
    rows[3, -1] = float("nan")
    rows[4, 0] = rows[4, -1] = 9.0  # the max at both ends: the first
    rows[5, -1] = 9.0  # the max last: in the tail where there is one
    rows[6, :] = 1.0
    rows[7, -2:] = float("inf")
    assert argmax_rows(rows).tolist() == rows.argmax(dim=-1).tolist()
    assert argmax_rows(rows[:0]).shape == (0,)
    greedy = seqs_for([SamplingParams(temperature=0)] * 12)
    assert Sampler(())(rows, greedy).token_ids == rows.argmax(dim=-1).tolist()
