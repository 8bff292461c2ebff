"""Prefix caching: reused blocks change nothing in the output, are counted, are evicted least
recently used only when needed, and the block manager's invariants hold under any interleaving."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedllm import LLM, SamplingParams
from pagedllm.engine import LLMEngine

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def shared_prompts(prefix_len: int, n: int = 6, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, 300, (prefix_len,), generator=g).tolist()
    return [prefix + torch.randint(3, 300, (3 + i,), generator=g).tolist() for i in range(n)]


@pytest.fixture(scope="module")
def llms(tiny_checkpoints):
    d = tiny_checkpoints["qwen3"][0]
    sizes = dict(block_size=8, num_blocks=48, max_batch_tokens=40, max_model_len=128)
    return LLM(d, enable_prefix_caching=True, **sizes), LLM(d, enable_prefix_caching=False, **sizes)


@pytest.mark.parametrize("prefix_len", [5, 8, 12, 24, 33])
def test_outputs_are_identical_with_and_without_the_cache(llms, prefix_len):
    cached, plain = llms
    prompts = shared_prompts(prefix_len, seed=prefix_len)
    expected = [o.token_ids for o in plain.generate(prompts, GREEDY)]
    together = [o.token_ids for o in cached.generate(prompts, GREEDY)]
    one_by_one = [cached.generate([p], GREEDY)[0].token_ids for p in prompts]
    assert together == expected and one_by_one == expected


def test_a_repeated_prompt_is_not_recomputed(llms):
    cached, _ = llms
    prompt = shared_prompts(40, n=1, seed=99)[0]
    cached.generate([prompt], GREEDY)
    before_hits, before_computed = cached.stats.prefix_cache_hit_tokens, cached.stats.prompt_tokens_computed
    cached.generate([prompt], GREEDY)
    assert cached.stats.prefix_cache_hit_tokens - before_hits == 40  # 5 full blocks of 8
    assert cached.stats.prompt_tokens_computed - before_computed == len(prompt) - 40


def test_preemption_and_eviction_keep_outputs_exact(tiny_checkpoints):
    d = tiny_checkpoints["llama"][0]
    sizes = dict(block_size=4, num_blocks=40, max_batch_tokens=24, max_model_len=160)
    prompts = [p for k in (6, 9, 13) for p in shared_prompts(k, n=5, seed=k)]
    expected = [o.token_ids for o in LLM(d, enable_prefix_caching=False, **sizes).generate(prompts, GREEDY)]
    llm = LLM(d, **sizes)
    got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    again = [o.token_ids for o in llm.generate(prompts[::-1], GREEDY)][::-1]
    assert got == expected and again == expected
    assert llm.stats.preemptions > 0 and llm.stats.prefix_cache_evictions > 0
    assert llm.stats.prefix_cache_hit_tokens > 0
    assert llm.engine.blocks.num_free == llm.engine.blocks.num_blocks
    assert all(c == 0 for c in llm.engine.blocks.ref_counts)


def test_turning_it_off_means_no_hits(llms):
    _, plain = llms
    p = shared_prompts(30, n=1)[0]
    plain.generate([p, p], GREEDY)
    assert plain.stats.prefix_cache_hit_tokens == 0 and plain.engine.blocks.num_cached_free == 0


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["add", "add", "abort", "step", "step", "step"]), st.integers(0, 4), st.integers(1, 30)
        ),
        min_size=1,
        max_size=40,
    )
)
def test_any_interleaving_keeps_the_invariants_and_ends_every_request_once(tiny_checkpoints, ops):

    loaded = _loaded(tiny_checkpoints)
    engine = LLMEngine.of(loaded, block_size=4, num_blocks=24, max_batch_tokens=16, max_num_seqs=4, max_model_len=96)
    prefixes = [[7] * 9, [8, 9] * 6, [10] * 3, [11] * 17, [12]]
    ended: dict[tuple[str, int], int] = {}
    finals: dict[tuple[str, int], object] = {}
    asked: dict[str, tuple[list[int], SamplingParams]] = {}
    ids = []

    def record(outs):
        for out in outs:
            if out.finished:
                ended[out.request_id, out.index] = ended.get((out.request_id, out.index), 0) + 1
                finals[out.request_id, out.index] = out

    for op, which, length in ops:
        if op == "add":
            prompt = prefixes[which] + [13] * (length % 7)
            params = SamplingParams(
                max_tokens=1 + length % 9, temperature=length % 2, ignore_eos=True, n=1 + length % 3
            )
            ids.append(engine.add_request(prompt, params))
            asked[ids[-1]] = (prompt, params)
        elif op == "abort" and ids:
            record(engine.abort(ids[which % len(ids)]))
        else:
            record(engine.step())
        engine.check_invariants()
    while engine.has_unfinished():
        record(engine.step())
        engine.check_invariants()
    # what it computed from adopted blocks is what it computes from scratch: every greedy sample
    # that was not aborted equals the request run alone without the cache
    for (rid, _), out in finals.items():
        prompt, params = asked[rid]
        if params.greedy and out.finish_reason != "abort":
            assert out.token_ids == _alone(loaded, prompt, params.max_tokens), rid
    # every sample ends exactly once; each request's samples are 0..k-1 (fewer than n only if
    # it was aborted before its prompt was computed)
    assert {rid for rid, _ in ended} == set(ids) and set(ended.values()) <= {1}
    for rid in ids:
        indices = sorted(i for r, i in ended if r == rid)
        assert indices == list(range(len(indices)))
    assert engine.blocks.num_free == engine.blocks.num_blocks


_cache: dict = {}


def _alone(loaded, prompt: list[int], max_tokens: int) -> list[int]:
    key = (tuple(prompt), max_tokens)
    if key not in _cache:
        solo = LLMEngine.of(loaded, block_size=4, num_blocks=64, max_model_len=96, enable_prefix_caching=False)
        solo.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        while solo.has_unfinished():
            for out in solo.step():
                if out.finished:
                    _cache[key] = out.token_ids
    return _cache[key]


def _loaded(tiny_checkpoints):
    from pagedllm import loading

    if "m" not in _cache:
        _cache["m"] = loading.load(tiny_checkpoints["mistral"][0])
    return _cache["m"]


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_an_8_bit_cache_shares_blocks_and_preempts_without_changing_a_token(tiny_checkpoints, kv):
    """int8 and fp8 caches keep a scale beside each row: prefix hits, n > 1 copy-on-write and
    preemption by recompute must carry both. Each run equals the same requests on an 8-bit cache
    that shares nothing and has room for all (every request alone, no prefix caching)."""
    d = tiny_checkpoints["llama"][0]
    tight = LLM(d, kv_cache_dtype=kv, block_size=4, num_blocks=40, max_batch_tokens=24, max_model_len=160)
    roomy = LLM(d, kv_cache_dtype=kv, enable_prefix_caching=False, block_size=4, num_blocks=200, max_model_len=160)
    prompts = [p for k in (6, 9, 13) for p in shared_prompts(k, n=5, seed=k)]
    expected = [roomy.generate([p], GREEDY)[0].token_ids for p in prompts]
    assert [o.token_ids for o in tight.generate(prompts, GREEDY)] == expected
    assert [o.token_ids for o in tight.generate(prompts[::-1], GREEDY)][::-1] == expected
    assert tight.stats.prefix_cache_hit_tokens > 0 and tight.stats.preemptions > 0
    # three samples of a 10-token prompt fork before its last token, sharing a block that holds one
    # (copy on first write): each equals a request seeded seed + i
    assert len(prompts[1]) == 10
    sampled = SamplingParams(max_tokens=12, temperature=0.8, seed=7, n=3)
    forked = tight.generate([prompts[1]], sampled)[0].outputs
    solo = [
        roomy.generate([prompts[1]], SamplingParams(max_tokens=12, temperature=0.8, seed=7 + i))[0] for i in range(3)
    ]
    assert [o.token_ids for o in forked] == [o.token_ids for o in solo]
    assert tight.stats.blocks_copied > 0
    assert tight.engine.blocks.num_free == tight.engine.blocks.num_blocks
