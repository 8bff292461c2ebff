"""Speculative decoding with a draft model (``engine.drafter``): a smaller model of the same
tokenizer guesses (its argmax for greedy requests, a draw for sampled ones), the model
verifies. What a user relies on: greedy output is the model's own (every architecture, both
kernel paths), sampling follows the model's distribution (a chi-square test of first and later
tokens against transformers' probabilities; seeded: the same tokens run after run), the
draft's weights and cache are in the memory plan, and its cache gives every block back. The
draft here is the model with noise on its weights: it agrees often, not always, so guesses are
both accepted and rejected (each test checks the counters)."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from greedy import assert_greedy_matches, hf_greedy
from test_speculative import ENGINE, assert_all_blocks_back, repetitive_prompts
from tiny_models import ARCHS, build_hf_model

from pagedllm import LLM, SamplingParams
from pagedllm.engine_config import ConfigError, EngineConfig


def noisy_copy(arch: str, directory, noise: float, **overrides):
    """The tiny model of ``arch`` (seed 0, as ``tiny_checkpoints``) with Gaussian noise of
    ``noise`` added to every matrix: a draft that mostly agrees with it."""
    model = build_hf_model(arch, 0, **overrides)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=g) * noise)
    model.save_pretrained(directory, safe_serialization=True)
    return model


# Phi-3's LongRoPE sharpens its scores: at 0.03 its copy agreed with none of its guesses (0/40),
# at 0.01 with a third (45/135)
DRAFT_NOISE = {"phi3": 0.01}


@pytest.fixture(scope="module")
def drafts(tmp_path_factory):
    """{arch: directory of its noisy copy}."""
    out = {}
    for arch in ARCHS:
        out[arch] = tmp_path_factory.mktemp(f"draft-{arch}")
        noisy_copy(arch, out[arch], noise=DRAFT_NOISE.get(arch, 0.03))
    return out


def speculating(directory, draft, k: int = 3, **options) -> LLM:
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k}
    return LLM(directory, **{**ENGINE, **options}, speculative=spec)


def assert_some_accepted_some_rejected(llm: LLM) -> None:
    c = llm.engine.scheduler.counters
    assert c.speculative_rows > 0 and 0 < c.tokens_accepted < c.tokens_drafted, (c.tokens_accepted, c.tokens_drafted)


def assert_draft_blocks_back(llm: LLM) -> None:
    drafter = llm.engine.drafter
    drafter.blocks.check_invariants()
    assert drafter.blocks.num_free == drafter.blocks.num_blocks


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_output_is_the_models_on_every_architecture(tiny_checkpoints, drafts, arch, kernels):
    directory, hf = tiny_checkpoints[arch]
    llm = speculating(directory, drafts[arch])
    prompts = repetitive_prompts(hf.config.vocab_size)
    ours = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))]
    assert_greedy_matches(ours, [hf_greedy(hf, p, 40) for p in prompts])
    assert_some_accepted_some_rejected(llm)
    assert_all_blocks_back(llm)
    assert_draft_blocks_back(llm)


def _chi_square_critical(df: int, z: float = 3.09) -> float:
    """The chi-square value exceeded with probability ~0.001 (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def assert_follows(counts: Counter, probs: torch.Tensor) -> None:
    """Pearson's chi-square test of ``counts`` against ``probs``: tokens expected at least 5
    times are bins of their own, the rest one bin."""
    total = sum(counts.values())
    expected = probs.double() * total
    bins = [t for t in range(len(probs)) if expected[t] >= 5]
    observed = [counts[t] for t in bins] + [total - sum(counts[t] for t in bins)]
    wanted = [expected[t].item() for t in bins] + [total - sum(expected[t].item() for t in bins)]
    if wanted[-1] < 5:  # too little left for a bin of its own: join the last bin
        observed[-2:] = [observed[-2] + observed[-1]]
        wanted[-2:] = [wanted[-2] + wanted[-1]]
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, wanted))
    df = len(observed) - 1
    assert df >= 2, "the test needs a distribution with several likely tokens"
    assert stat < _chi_square_critical(df), f"chi-square {stat:.1f} with {df} degrees of freedom"


def test_sampling_follows_the_models_distribution(tiny_checkpoints, drafts):
    """1200 seeded samples of 4 tokens at temperature 0.3 with the draft guessing: the first
    token (no guess), the second (the first guessed position) given the most frequent first,
    and the third given the most frequent first two follow transformers' softmax."""
    directory, hf = tiny_checkpoints["llama"]
    llm = speculating(directory, drafts["llama"], k=2)
    prompt = repetitive_prompts(hf.config.vocab_size)[3]  # top tokens of ~0.8, 0.9, 0.5: guesses miss too
    temperature, samples = 0.3, []
    plain_sampling = dict(temperature=temperature, top_p=1.0, min_p=0.0, repetition_penalty=1.0)  # no defaults
    for first in range(0, 1200, 12):  # 12 at a time: 12 x (1 + 2) rows fit max_num_seqs, so they guess
        seeds = range(first, first + 12)
        params = [SamplingParams(max_tokens=4, seed=s, ignore_eos=True, **plain_sampling) for s in seeds]
        samples += [o.token_ids for o in llm.generate([prompt] * 12, params)]

    def model_probs(prefix: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + prefix])).logits[0, -1].double()
        return torch.softmax(logits / temperature, dim=-1)

    firsts = Counter(s[0] for s in samples)
    assert_follows(firsts, model_probs([]))
    top = firsts.most_common(1)[0][0]
    seconds = Counter(s[1] for s in samples if s[0] == top)
    assert_follows(seconds, model_probs([top]))
    pair = Counter((s[0], s[1]) for s in samples).most_common(1)[0][0]
    assert_follows(Counter(s[2] for s in samples if (s[0], s[1]) == pair), model_probs(list(pair)))
    assert_some_accepted_some_rejected(llm)


def test_seeded_sampling_with_a_draft_repeats_itself(tiny_checkpoints, drafts):
    """The draft draws its guesses with the request's generator and the model accepts them with
    it too: the same seeds give the same tokens and logprobs run after run (not those of decoding
    without a draft: the draws are others, their distribution the same)."""
    directory, hf = tiny_checkpoints["qwen2"]
    prompts = repetitive_prompts(hf.config.vocab_size)
    params = [
        SamplingParams(max_tokens=30, temperature=0.4, top_p=0.95, seed=i, logprobs=1, ignore_eos=True)
        for i in range(len(prompts))
    ]
    runs = [speculating(directory, drafts["qwen2"], k=4).generate(prompts, params) for _ in range(2)]
    assert [o.token_ids for o in runs[0]] == [o.token_ids for o in runs[1]]
    assert [o.logprobs for o in runs[0]] == [o.logprobs for o in runs[1]]
    assert all(len(o.logprobs) == len(o.token_ids) for o in runs[0])


def test_the_plan_counts_the_draft_models_weights_and_cache(tiny_checkpoints, tmp_path):
    """A draft of 2 layers (vocabulary and widths the model's): its weights (every parameter,
    float32) join the plan's weights, its K/V (2 layers x K and V x 2 heads x 16 values x 4
    bytes a token) join each block's cost, the draft's cache holds as many blocks, and the
    step's peak holds its distributions."""
    directory, hf = tiny_checkpoints["llama"]
    draft = noisy_copy("llama", tmp_path, noise=0.03, num_hidden_layers=2)
    alone = LLM(directory, **ENGINE, max_batch_tokens=64).engine.memory_plan
    llm = speculating(directory, tmp_path, max_batch_tokens=64)
    plan = llm.engine.memory_plan
    draft_weights = sum(p.numel() * 4 for p in draft.parameters())
    assert plan.draft_weights_bytes == draft_weights
    assert plan.weights_bytes == alone.weights_bytes + draft_weights
    block_size = ENGINE["block_size"]
    assert plan.draft_kv_bytes_per_block == 2 * 2 * 2 * 16 * 4 * block_size
    assert plan.kv_bytes_per_block == alone.kv_bytes_per_block + plan.draft_kv_bytes_per_block
    assert plan.kv_cache_bytes == plan.num_blocks * plan.kv_bytes_per_block
    assert llm.engine.drafter.blocks.num_blocks == plan.num_blocks
    # the distributions a draft draws from, kept to the step's sampling: a float32 vocabulary row
    # for each of max_num_seqs (< max_batch_tokens) logits rows
    assert plan.activation_bytes == alone.activation_bytes + ENGINE["max_num_seqs"] * hf.config.vocab_size * 4
    assert "the draft model's" in plan.table()


def test_a_budget_counts_the_draft(tiny_checkpoints, tmp_path):
    """Under a memory budget, the cache is what is left after the weights of both models,
    divided by a block of each: the draft's weights (every parameter) and its K/V (3 layers x K
    and V x 2 heads x 16 values x 4 bytes a token) as the test counts them."""
    directory, _ = tiny_checkpoints["llama"]
    draft = noisy_copy("llama", tmp_path, noise=0.03)
    budget = {"memory": "3GiB", "max_batch_tokens": 64, "max_num_seqs": 8, "block_size": 4}
    alone = LLM(directory, **budget).engine.memory_plan
    spec = {"method": "draft_model", "model": str(tmp_path)}
    plan = LLM(directory, **budget, speculative=spec).engine.memory_plan
    weights = alone.weights_bytes + sum(p.numel() * 4 for p in draft.parameters())
    room = plan.budget_bytes - plan.baseline_bytes - weights - plan.activation_bytes - plan.overhead_bytes
    per_block = alone.kv_bytes_per_block + 2 * 3 * 2 * 16 * 4 * 4
    assert plan.num_blocks == room // per_block
    assert plan.total_bytes <= plan.budget_bytes


def test_a_draft_cache_too_small_for_everyone_still_gives_the_models_output(tiny_checkpoints, drafts):
    """With 5 requests and a cache for about 3 (the model's preempts, the draft's runs out of
    blocks), the sequences the draft has no room for decode without guesses; the output is the
    model's and every draft block comes back."""
    directory, hf = tiny_checkpoints["llama"]
    small = {"num_blocks": 70, "max_num_seqs": 40}
    plain, guessing = LLM(directory, **{**ENGINE, **small}), speculating(directory, drafts["llama"], **small)
    prompts = repetitive_prompts(hf.config.vocab_size)
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    assert [o.token_ids for o in guessing.generate(prompts, params)] == [
        o.token_ids for o in plain.generate(prompts, params)
    ]
    assert_some_accepted_some_rejected(guessing)
    assert_all_blocks_back(guessing)
    assert_draft_blocks_back(guessing)


def test_draft_settings_are_checked(tiny_checkpoints, tmp_path):
    directory, _ = tiny_checkpoints["llama"]
    with pytest.raises(ConfigError, match="needs the draft model's path"):
        LLM(directory, **ENGINE, speculative={"method": "draft_model"})
    other = tmp_path / "other-vocabulary"
    noisy_copy("llama", other, noise=0.0, vocab_size=300)
    with pytest.raises(ConfigError, match="tokenizer is not the model's"):
        speculating(directory, other)
    wide = tmp_path / "wide"
    noisy_copy("llama", wide, noise=0.0, intermediate_size=200)
    with pytest.raises(ConfigError, match="wider than the model: intermediate_size 200 > 160"):
        speculating(directory, wide)
    llm = speculating(directory, tiny_checkpoints["llama"][0])
    with pytest.raises(ConfigError, match="draft model"):
        llm.engine.set_memory("2GiB")


@pytest.mark.parametrize("command", ["serve", "chat", "bench"])
def test_the_command_line_takes_a_draft_model(command):
    from pagedllm.cli import build_parser

    flags = ["--speculative-method", "draft_model", "--draft-model", "/models/small", "--num-speculative-tokens", "3"]
    config = EngineConfig.from_args(build_parser().parse_args([command, *flags]))
    assert (config.speculative_method, config.draft_model, config.num_speculative_tokens) == (
        "draft_model",
        "/models/small",
        3,
    )


def test_a_request_whose_guesses_keep_missing_stops_paying_for_them(tiny_checkpoints, tmp_path):
    """A draft that never agrees (another random model) costs a pass per guess: after guessed
    steps that accept nothing the request decodes 1, 3, 7, 15 steps without guesses between
    tries, so 60 tokens carry guesses in about 7 steps, not 59. The output is the model's."""
    directory, hf = tiny_checkpoints["llama"]
    noisy_copy("llama", tmp_path, noise=1.0)
    llm = speculating(directory, tmp_path)
    prompt = repetitive_prompts(hf.config.vocab_size)[0]
    out = llm.generate([prompt], SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))[0]
    assert_greedy_matches([out.token_ids], [hf_greedy(hf, prompt, 60)])
    c = llm.engine.scheduler.counters
    assert c.tokens_accepted == 0, "the test needs a draft that never agrees"
    assert 3 <= c.speculative_rows <= 9, c.speculative_rows
