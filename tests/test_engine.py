"""The engine's promises: batching, chunking and preemption never change greedy output; every
block comes back; a request that can never fit is refused and the others keep being served."""

import pytest
import torch
from greedy import assert_greedy_matches, hf_greedy

from pagedllm import LLM, SamplingParams
from pagedllm.errors import RequestRejected

GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


def mixed_prompts(vocab: int, n: int = 24, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [1 + (7 * i) % 60 for i in range(n)]
    return [torch.randint(1, vocab, (k,), generator=g).tolist() for k in lengths]


@pytest.fixture(scope="module")
def tight_llm(tiny_checkpoints):
    """Small step budget (forces chunked prefill) and few blocks (forces preemption)."""
    directory, _ = tiny_checkpoints["llama"]
    return LLM(directory, block_size=4, num_blocks=60, max_batch_tokens=24, max_num_seqs=16, max_model_len=240)


def test_batched_chunked_preempted_greedy_equals_transformers_and_solo_runs(tight_llm, tiny_checkpoints):
    _, hf = tiny_checkpoints["llama"]
    engine = tight_llm.engine
    prompts = mixed_prompts(engine.loaded.config.vocab_size)
    preemptions_before = engine.stats.preemptions
    outs = tight_llm.generate(prompts, GREEDY)
    assert engine.stats.preemptions > preemptions_before, "the test must exercise preemption"
    assert max(len(p) for p in prompts) > engine.scheduler.max_batch_tokens, "and chunked prefill"

    refs = [hf_greedy(hf, p, 32) for p in prompts]
    assert_greedy_matches([o.token_ids for o in outs], refs)

    solo = [tight_llm.generate([p], GREEDY)[0].token_ids for p in prompts]
    assert [o.token_ids for o in outs] == solo
    assert all(o.finish_reason == "length" and len(o.token_ids) == 32 for o in outs)


def test_every_block_is_free_after_finish_abort_and_preemption(tight_llm):
    engine = tight_llm.engine
    prompts = mixed_prompts(engine.loaded.config.vocab_size, n=20, seed=5)
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    aborted = set(ids[::3])
    for step in range(400):
        if step == 5:
            for rid in aborted:
                engine.abort(rid)
        engine.step()
        engine.blocks.check_invariants()
        if not engine.has_unfinished():
            break
    assert not engine.has_unfinished()
    assert engine.stats.preemptions > 0
    assert engine.blocks.num_free == engine.blocks.num_blocks
    assert all(c == 0 for c in engine.blocks.ref_counts)
    assert not engine.blocks.tables and not engine.requests


def test_request_that_can_never_fit_is_rejected_and_others_are_served(tiny_checkpoints):
    directory, _ = tiny_checkpoints["qwen2"]
    llm = LLM(directory, block_size=4, num_blocks=16, max_model_len=64)  # 64 tokens of cache
    engine = llm.engine
    ok = engine.add_request([5] * 10, GREEDY)
    with pytest.raises(
        RequestRejected,
        match=r"prompt \(40 tokens\) \+ max_tokens \(32\) = 72 tokens "
        r"exceeds max_model_len=64 \(the KV cache holds 64 tokens",
    ):
        engine.add_request([5] * 40, GREEDY)
    with pytest.raises(RequestRejected, match="empty"):
        engine.add_request([], GREEDY)
    with pytest.raises(RequestRejected, match="token ids"):
        engine.add_request([10**6], GREEDY)
    finished = []
    while engine.has_unfinished():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == [ok] and len(finished[0].token_ids) == 32


def test_generate_rejects_before_queueing_anything(tiny_checkpoints):
    directory, _ = tiny_checkpoints["qwen3"]
    llm = LLM(directory, block_size=4, num_blocks=16, max_model_len=64)
    with pytest.raises(RequestRejected):
        llm.generate([[1, 2, 3], [7] * 60], GREEDY)
    assert not llm.engine.has_unfinished()


def test_outputs_come_back_in_input_order_with_timings(tiny_checkpoints):
    directory, _ = tiny_checkpoints["mistral"]
    llm = LLM(directory, max_batch_tokens=64)
    prompts = [[3] * 50, [4], [5] * 20]
    outs = llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (3, 9, 5)])
    assert [len(o.token_ids) for o in outs] == [3, 9, 5]
    assert [o.prompt_token_ids for o in outs] == prompts
    for o in outs:
        assert 0 <= o.metrics.time_to_first_token <= o.metrics.latency


def test_seeded_sampling_is_the_same_whatever_shares_the_batch(tiny_checkpoints):
    directory, _ = tiny_checkpoints["llama"]
    llm = LLM(directory)
    seeded = SamplingParams(max_tokens=24, temperature=1.0, seed=1234, ignore_eos=True)
    alone = llm.generate([[9, 8, 7]], seeded)[0].token_ids
    others = [SamplingParams(max_tokens=24, temperature=1.0, ignore_eos=True)] * 5
    crowd = llm.generate([[1, 2], [9, 8, 7], [4] * 30, [5, 6], [7], [8] * 9], [others[0], seeded, *others[1:]])
    assert crowd[1].token_ids == alone
    other_seed = llm.generate([[9, 8, 7]], SamplingParams(max_tokens=24, temperature=1.0, seed=99, ignore_eos=True))[
        0
    ].token_ids
    assert other_seed != alone


def test_engine_stats_track_blocks_and_queues(tiny_checkpoints):
    directory, _ = tiny_checkpoints["llama"]
    llm = LLM(directory, block_size=4, num_blocks=32, max_num_seqs=2, max_model_len=128)
    engine = llm.engine
    for p in ([1] * 9, [2] * 5, [3] * 3):
        engine.add_request(p, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    engine.step()
    s = engine.stats
    assert (s.running, s.waiting) == (2, 1)
    assert s.blocks_used == 3 + 2 and s.blocks_free == 32 - 5
    assert s.last_step_tokens == 14
    while engine.has_unfinished():
        engine.step()
    assert engine.stats.blocks_used == 0 and engine.stats.tokens_generated == 12


def test_invariant_checker_catches_a_leaked_block(tiny_checkpoints):
    engine = LLM(tiny_checkpoints["llama"][0], block_size=4, num_blocks=32, max_model_len=128).engine
    engine.add_request([1, 2, 3], GREEDY)
    engine.step()
    engine.check_invariants()
    engine.blocks.tables["ghost"] = [engine.blocks.main._free.pop()]  # a block owned by nobody running
    engine.blocks.ref_counts[engine.blocks.tables["ghost"][0]] = 1
    with pytest.raises(AssertionError, match="ghost"):
        engine.check_invariants()


def test_sliding_window_under_chunked_prefill_prefix_hits_and_preemption_equals_transformers(tiny_checkpoints):
    """Masks at chunk boundaries and over adopted blocks: mistral's window is 24 tokens, the
    step budget 10 (chunks end inside and across windows), prompts share a 28-token prefix."""
    directory, hf = tiny_checkpoints["mistral"]
    llm = LLM(directory, block_size=4, num_blocks=40, max_batch_tokens=10, max_num_seqs=6, max_model_len=120)
    g = torch.Generator().manual_seed(11)
    shared = torch.randint(1, 300, (28,), generator=g).tolist()
    prompts = [shared + torch.randint(1, 300, (n,), generator=g).tolist() for n in (3, 17, 30, 9, 41, 22)]
    outs = llm.generate(prompts, GREEDY)
    stats = llm.stats
    assert stats.preemptions > 0 and stats.prefix_cache_hit_tokens > 0, stats
    assert max(len(p) for p in prompts) > 2 * 24, "prompts longer than two windows"
    assert_greedy_matches([o.token_ids for o in outs], [hf_greedy(hf, p, 32) for p in prompts])


def test_a_dropped_engine_goes_at_once_without_the_garbage_collector(tiny_checkpoints):
    """Nothing an engine hands its parts refers back to it (the memory's replanning holds the
    model, the elastic policy holds the memory): the last reference dropped frees its KV cache
    at once, before any collection, so the next engine's plan does not count the old one.
    (Planted: a part given the engine, `engine.elastic.engine = engine`, keeps it alive: fails.)"""
    import gc
    import weakref

    llm = LLM(tiny_checkpoints["llama"][0], block_size=4, num_blocks=32, max_model_len=128)
    llm.generate([[1, 2, 3]], GREEDY)
    gone = weakref.ref(llm.engine)
    cache = weakref.ref(llm.engine.kv_cache)
    gc.disable()
    try:
        del llm
        assert gone() is None and cache() is None
    finally:
        gc.enable()
