"""Speculative decoding by n-gram lookup (``engine.speculative``): what a user relies on is that it
changes nothing but speed. Greedy output equals transformers' and the same engine's without
speculation, on every architecture and both kernel paths; seeded sampling (penalties, top-p,
logprobs) gives the same tokens and logprobs; stops and max_tokens that fall inside a run of
accepted guesses end the output where decoding one token at a time would; every block comes
back. The guesses must actually be made and accepted for any of this to mean something, so
each test checks the counters too."""

from __future__ import annotations

import json

import pytest
import torch
from greedy import assert_greedy_matches, hf_greedy
from tiny_models import ARCHS

from pagedllm import LLM, SamplingParams
from pagedllm.engine.speculative import Speculation, propose
from pagedllm.engine_config import ConfigError, EngineConfig

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
ENGINE = dict(block_size=4, num_blocks=96, max_num_seqs=40, max_model_len=200)


def repetitive_prompts(vocab: int, seed: int = 5) -> list[list[int]]:
    """Random patterns repeated: the n-grams a lookup finds, and tiny random models loop too."""
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for length, repeats in ((3, 6), (5, 4), (7, 3), (2, 9), (11, 2)):
        pattern = torch.randint(1, vocab, (length,), generator=g).tolist()
        prompts.append(pattern * repeats + pattern[:1])
    return prompts


def engines(directory, **options):
    return LLM(directory, **ENGINE, **options), LLM(directory, **ENGINE, speculative=NGRAM, **options)


def assert_guesses_were_accepted(llm) -> None:
    c = llm.engine.scheduler.counters
    assert c.speculative_rows > 0 and c.tokens_accepted > 0, "the test must exercise accepted guesses"
    assert c.tokens_accepted < c.tokens_drafted or c.tokens_drafted > 0


def assert_all_blocks_back(llm) -> None:
    blocks = llm.engine.blocks
    llm.engine.scheduler.check_invariants()
    assert blocks.num_free == blocks.num_blocks


def test_propose_takes_what_followed_the_latest_longest_match():
    spec = Speculation(num_tokens=3, lookup_min=1, lookup_max=3)
    #        0  1  2  3  4  5  6  7  8  9
    tokens = [7, 1, 2, 3, 9, 1, 2, 3, 4, 1, 2]
    assert propose(tokens, spec, limit=10) == [3, 4, 1]  # "1 2" last seen at 5: 3 4 1 followed
    assert propose(tokens, spec, limit=2) == [3, 4]
    assert propose([5, 6, 7], spec, limit=10) == []  # no earlier occurrence of 7
    assert propose([1, 2, 1, 2, 8], Speculation(2, 2, 2), limit=10) == []  # "2 8" never seen before
    assert propose([4, 4, 4], Speculation(5, 1, 1), limit=10) == [4]  # what follows, to the end


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_output_is_unchanged_on_every_architecture(tiny_checkpoints, arch, kernels):
    directory, hf = tiny_checkpoints[arch]
    plain, guessing = engines(directory)
    prompts = repetitive_prompts(plain.engine.loaded.config.vocab_size)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    ours = [o.token_ids for o in guessing.generate(prompts, params)]
    assert ours == [o.token_ids for o in plain.generate(prompts, params)]
    assert_greedy_matches(ours, [hf_greedy(hf, p, 40) for p in prompts])
    assert_guesses_were_accepted(guessing)
    assert_all_blocks_back(guessing)


def test_seeded_sampling_gives_the_same_tokens_and_logprobs(tiny_checkpoints):
    """Each position is sampled in order with the request's generator, penalties seeing the
    guesses accepted before it: the draws are the ones decoding one token at a time makes."""
    plain, guessing = engines(tiny_checkpoints["llama"][0])
    prompts = repetitive_prompts(plain.engine.loaded.config.vocab_size)
    params = [
        SamplingParams(
            max_tokens=40, temperature=0.5, top_p=0.9, frequency_penalty=0.05, seed=i, logprobs=2, ignore_eos=True
        )
        for i in range(len(prompts))
    ]
    a, b = plain.generate(prompts, params), guessing.generate(prompts, params)
    assert [o.token_ids for o in b] == [o.token_ids for o in a]
    for x, y in zip(a, b):  # a guessed position's logits come from a step of more rows: 1e-6 apart
        ours, theirs = [lp["token"] for lp in y.logprobs], [lp["token"] for lp in x.logprobs]
        assert [t for t, _ in ours] == [t for t, _ in theirs]
        assert [v for _, v in ours] == pytest.approx([v for _, v in theirs], abs=1e-4)
    assert_guesses_were_accepted(guessing)
    assert_all_blocks_back(guessing)


def test_stops_and_max_tokens_inside_accepted_guesses(tiny_checkpoints):
    """A stop token, a max_tokens or a stop string reached by an accepted guess ends the output
    there, as decoding one token at a time would; the guesses after it are dropped."""
    plain, guessing = engines(tiny_checkpoints["llama"][0])
    prompts = repetitive_prompts(plain.engine.loaded.config.vocab_size)
    free = [o.token_ids for o in guessing.generate(prompts, SamplingParams(max_tokens=40, temperature=0))]
    for prompt, tokens in zip(prompts, free):
        stop = tokens[len(tokens) // 2]  # a token the output reaches mid-way
        for params in (
            SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[stop]),
            SamplingParams(max_tokens=len(tokens) // 2 + 1, temperature=0, ignore_eos=True),
        ):
            want = plain.generate([prompt], params)[0]
            got = guessing.generate([prompt], params)[0]
            assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
    assert_guesses_were_accepted(guessing)
    assert_all_blocks_back(guessing)


def test_a_full_batch_does_not_guess(tiny_checkpoints):
    """Guesses add logits rows: a step guesses only while its rows with guesses stay within
    max_num_seqs (what the memory plan counts), so a loaded batch runs as without them."""
    directory, _ = tiny_checkpoints["llama"]
    llm = LLM(directory, **{**ENGINE, "max_num_seqs": 8}, speculative=NGRAM)  # 2 rows x (1 + 4) > 8
    prompts = repetitive_prompts(llm.engine.loaded.config.vocab_size)[:2]
    llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    assert llm.engine.scheduler.counters.tokens_drafted == 0
    llm.generate(prompts[:1], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    assert llm.engine.scheduler.counters.tokens_drafted > 0


def test_speculative_settings_are_checked():
    with pytest.raises(ConfigError, match="not implemented yet"):
        EngineConfig.from_options(None, speculative={"method": "draft_model", "model": "small"}, tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="unknown key"):
        EngineConfig.from_options(None, speculative={"method": "ngram", "lookahead": 3})
    with pytest.raises(ConfigError, match="prompt_lookup_min"):
        EngineConfig.from_options(None, speculative={"method": "ngram", "prompt_lookup_min": 5})
    with pytest.raises(ConfigError, match="method"):
        EngineConfig.from_options(None, speculative={"num_speculative_tokens": 3})
    config = EngineConfig.from_options(None, speculative={"method": "ngram", "num_speculative_tokens": 2})
    assert (config.speculative_method, config.num_speculative_tokens) == ("ngram", 2)


def test_each_guessed_position_is_sampled_seeing_the_guesses_accepted_before_it():
    """Penalties and min_tokens read the output so far: position j of a guessed row must be
    sampled with the j guesses before it appended, and sampling stops at the first mismatch
    (no generator draw is spent past it)."""
    from types import SimpleNamespace

    from pagedllm.engine.model_runner import ModelRunner
    from pagedllm.engine.step import ScheduledRow

    seen, script = [], [11, 12, 99, 13]  # the model agrees with two guesses, then samples 99

    def sampler(logits, rows):
        seen.append(list(rows[0].output_token_ids))
        return SimpleNamespace(token_ids=[script[len(seen) - 1]], logprobs=[{"token": (0, 0.0)}])

    runner = object.__new__(ModelRunner)
    runner.sampler = sampler
    params = SamplingParams(temperature=0.8, seed=1)
    seq = SimpleNamespace(
        params=params, prompt_token_ids=[1, 2], output_token_ids=[5], generator=None, matcher=None, guess_probs=None
    )
    row = ScheduledRow(0, "r", 0, 2, [5, 11, 12, 13], ([0],), True, params, guesses=3)
    accepted, (token, _) = runner.verify(torch.zeros(4, 8), row, seq)
    assert (len(accepted), token) == (2, 99)
    assert seen == [[5], [5, 11], [5, 11, 12]]


def test_blocks_taken_for_rejected_guesses_go_back_at_once(tiny_checkpoints):
    """Between steps a sequence holds no block past its tokens (check_invariants), though its
    guesses may have needed one: with 4-token blocks, four guesses cross a block edge often."""
    _, guessing = engines(tiny_checkpoints["llama"][0])
    engine = guessing.engine
    for i, prompt in enumerate(repetitive_prompts(engine.loaded.config.vocab_size)):
        temperature = 0 if i % 2 else 1.0  # greedy ones loop (accepted), sampled ones wander (rejected)
        engine.add_request(prompt, SamplingParams(max_tokens=40, temperature=temperature, seed=3, ignore_eos=True))
    while engine.scheduler.has_unfinished():
        engine.step()
        engine.scheduler.check_invariants()
    c = engine.scheduler.counters
    assert 0 < c.tokens_accepted < c.tokens_drafted, "the test must see guesses accepted and rejected"
    assert_all_blocks_back(guessing)


def test_the_server_speculates_with_its_flags_and_counts_guesses_in_its_metrics(default_llm):
    """`pagedllm serve --speculative-method ngram ...` (the engine in its own process, the default
    model): the same greedy completion as without, and /metrics counts the guesses."""
    import httpx
    from server_process import ServerProcess, parse_metrics

    passage = "The old mill by the river grinds wheat on Mondays and barley on Thursdays."
    prompt = f"Repeat this sentence three times: {passage}\n{passage}\n"
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    want = default_llm.generate([prompt], greedy)[0].text
    flags = ["--speculative-method", "ngram", "--num-speculative-tokens", "4"]
    server = ServerProcess("--max-num-seqs", "8", "--max-model-len", "512", *flags)
    try:
        body = {"prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        metrics = parse_metrics(httpx.get(server.url + "/metrics", timeout=10).text)
    finally:
        server.stop()
    assert r.json()["choices"][0]["text"] == want
    drafted = metrics["pagedllm_spec_decode_num_draft_tokens_total"]
    accepted = metrics["pagedllm_spec_decode_num_accepted_tokens_total"]
    drafts = metrics["pagedllm_spec_decode_num_drafts_total"]
    assert 0 < accepted <= drafted and drafts > 0
    assert metrics["pagedllm_spec_decode_mean_acceptance_length"] == pytest.approx(1 + accepted / drafts)


def test_blocks_registered_for_the_prefix_cache_hold_only_accepted_tokens(tiny_checkpoints):
    """A request whose prompt continues an earlier one's output adopts that output's cached
    blocks; had a block been registered with a rejected guess's K/V in it, its continuation would
    part from the plain engine's."""
    plain, guessing = engines(tiny_checkpoints["llama"][0])
    prompts = repetitive_prompts(plain.engine.loaded.config.vocab_size)
    first = SamplingParams(max_tokens=30, temperature=1.0, seed=7, ignore_eos=True)  # guesses get rejected
    outs = guessing.generate(prompts, first)
    continued = [p + o.token_ids for p, o in zip(prompts, outs)]
    hits = guessing.engine.blocks.prefix_stats.hit_tokens
    then = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    got = [o.token_ids for o in guessing.generate(continued, then)]
    assert guessing.engine.blocks.prefix_stats.hit_tokens - hits > sum(len(o.token_ids) for o in outs) // 2
    assert got == [o.token_ids for o in plain.generate(continued, then)]
    c = guessing.engine.scheduler.counters
    assert c.tokens_accepted < c.tokens_drafted, "the test must see rejected guesses"


def test_guesses_under_a_grammar_give_the_tokens_decoding_one_at_a_time_gives(default_llm):
    """A constrained request guesses too: its guesses are cut to what the grammar accepts, and
    each guessed position is masked as the grammar stands after the guesses before it. The
    regex forbids what the prompt (and the model) would continue with ("mat"), so an unmasked
    or wrongly masked position changes the output or breaks the grammar."""
    from pagedllm.sampling_params import StructuredOutput

    guessing = LLM(speculative={**NGRAM, "prompt_lookup_min": 2})
    text = "The cat sat on the mat. The dog sat on the log. " * 3
    record = '{"name": "Ada Lovelace", "born": 1815, "field": "mathematics", "known_for": "the first algorithm"}'
    schema = {
        "type": "object",
        "properties": {k: {"type": "integer" if k == "born" else "string"} for k in json.loads(record)},
        "required": list(json.loads(record)),
    }
    cases = [
        ("Repeat this text: " + text, StructuredOutput(regex=r"(The cat sat on the log\. ){3}")),
        ("Copy this JSON exactly: " + record, StructuredOutput(json=schema)),
    ]
    prompts, params = [], []
    for question, constraint in cases:
        for sampling in (dict(temperature=0), dict(temperature=0.7, seed=3, logprobs=2)):
            prompts.append(default_llm.apply_chat_template([{"role": "user", "content": question}]))
            params.append(SamplingParams(max_tokens=80, structured_output=constraint, **sampling))
    texts = []
    for prompt, p in zip(prompts, params):  # one at a time: every step may guess
        want, got = default_llm.generate([prompt], p)[0], guessing.generate([prompt], p)[0]
        assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason == "stop"
        if p.logprobs:
            ours, theirs = [lp["token"][1] for lp in got.logprobs], [lp["token"][1] for lp in want.logprobs]
            assert ours == pytest.approx(theirs, abs=1e-4)
        texts.append(got.text)
    assert texts[0] == "The cat sat on the log. " * 3
    assert json.loads(texts[2]) == json.loads(record)
    c = guessing.engine.scheduler.counters
    assert c.tokens_accepted > 20, "the test must exercise accepted guesses under a grammar"
    assert_all_blocks_back(guessing)


def test_guesses_are_cut_where_the_grammar_refuses_or_ends(default_llm):
    from pagedllm.sampling_params import StructuredOutput
    from pagedllm.structured import allowed_prefix

    grammars = default_llm.engine.grammars
    matcher = grammars.matcher(StructuredOutput(choice=["yes indeed", "no"]))
    yes = default_llm.engine.encode("yes indeed")
    eos = default_llm.engine.eos_token_ids[0]
    assert len(yes) > 1
    assert allowed_prefix(matcher, yes + [eos]) == len(yes)  # the stop that ends it is not guessed
    assert allowed_prefix(matcher, yes[:1] + default_llm.engine.encode(" maybe")) == 1
    assert allowed_prefix(matcher, default_llm.engine.encode("maybe")) == 0
    assert all(matcher.accept_token(t) for t in yes), "the matcher must be left where it was"
