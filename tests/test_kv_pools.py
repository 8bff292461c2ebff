"""A KV pool per kind of layer (engine/block_pools.py): sliding-window layers keep only their
window, full layers everything; the planner solves for both; prefix caching, preemption and
forks stay correct across them.

Oracles: transformers' greedy (the tiny Gemma 3 and gpt-oss models, windows shorter than the
prompts, Gemma's shorter than a block), arithmetic in the test (which blocks a window reaches,
bytes per token per layer), and the invariants of every pool checked after every step.
"""

from __future__ import annotations

import random

import pytest
import torch
from greedy import assert_greedy_matches, hf_greedy, reference_step_logits

from pagedllm import LLM, SamplingParams
from pagedllm.config import ModelConfig
from pagedllm.engine.block_manager import HOLE
from pagedllm.engine.block_pools import BlockPools
from pagedllm.memory.footprint import EngineSettings, window_pool_blocks
from pagedllm.memory.planner import plan

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)


def prompt_of(n: int, seed: int, vocab: int = 200) -> list[int]:
    g = random.Random(seed)
    return [g.randrange(3, vocab) for _ in range(n)]


def run_checked(llm: LLM, prompts: list[list[int]], hf, params=GREEDY) -> tuple[list[list[int]], list[list[int]]]:
    """Runs prompts to the end, step by step, checking every pool's invariants after each step
    and each sampled token's log-probability against transformers' (fp32: within 1e-4; a wrong
    block read for one key of one window moves it further, greedy may not notice); returns each
    request's tokens and the blocks each pool held after each step."""
    engine = llm.engine
    ids = [engine.add_request(p, params) for p in prompts]
    held: list[list[int]] = []
    out: dict[str, tuple[list[int], list]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = (o.token_ids, o.logprobs)
        engine.scheduler.check_invariants()
        held.append([p.num_used for p in engine.blocks.pools])
    for prompt, rid in zip(prompts, ids):
        assert_logprobs_match(hf, prompt, *out[rid])
    return [out[i][0] for i in ids], held


def assert_logprobs_match(hf, prompt: list[int], tokens: list[int], logprobs: list[dict]) -> None:
    reference = torch.log_softmax(reference_step_logits(hf, prompt, tokens), dim=-1)
    for step, (token, entry) in enumerate(zip(tokens, logprobs)):
        assert entry["token"][0] == token
        assert abs(entry["token"][1] - float(reference[step, token])) < 1e-4, step


# ---- the engine over tiny models ---------------------------------------------------------------


@pytest.mark.parametrize("arch", ["gemma3", "gpt-oss"])
def test_window_layers_keep_only_their_window_and_answer_as_transformers(tiny_checkpoints, arch, kernels):
    """Prompts several windows long, fed in chunks: the window pool never holds more than the
    bound the planner reserves, far fewer blocks than the full pool, and greedy equals
    transformers'."""
    d, hf = tiny_checkpoints[arch]
    window = hf.config.sliding_window
    llm = LLM(d, dtype="float32", block_size=4, num_blocks=200, max_batch_tokens=16, max_num_seqs=4)
    engine = llm.engine
    assert engine.blocks.pools[1].window == window and engine.blocks.pools[0].window is None
    full_layers = [i for i, w in enumerate(engine.loaded.config.sliding_windows) if w is None]
    window_layer = engine.loaded.config.sliding_windows.index(window)
    cache = engine.kv_cache
    assert cache.k[window_layer].shape[1] < cache.k[full_layers[0]].shape[1]  # a smaller tensor
    prompts = [prompt_of(n, seed=n) for n in (50, 37, 9)]
    ours, held = run_checked(llm, prompts, hf)
    bound = window_pool_blocks(window, 4, 16, 3)
    assert max(w for _, w in held) <= bound < max(f for f, _ in held)
    refs = [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]
    assert_greedy_matches(ours, refs)


@pytest.mark.parametrize("decode_step", [True, False])
def test_each_layer_reads_its_own_pools_blocks(tiny_checkpoints, decode_step):
    """Without a prefix cache a window block goes straight back to the free list and is taken
    again by the next chunk of the same prompt, so the two pools' block ids part ways. Chunks of
    80 tokens run the layer loop, the last chunk of 40 and the decode steps the compiled decode
    step (``SMALL_STEP_TOKENS``): if either read the window layers through pool 0's table, K/V
    written by one would be looked for by the other where they never went."""
    d, hf = tiny_checkpoints["gemma3"]
    llm = LLM(d, dtype="float32", block_size=4, num_blocks=200, max_batch_tokens=80, enable_prefix_caching=False)
    llm.engine.loaded.model.use_decode_program = decode_step
    run_checked(llm, [prompt_of(200, seed=8)], hf)


def test_a_cached_prefix_is_reused_across_pools_and_answers_as_transformers(tiny_checkpoints):
    """The second prompt extends the first: its prefix is adopted from both pools (hit tokens),
    and each token's log-probability is transformers'. Adopting a hole where one of the window's
    blocks should be reads zeros for one key of one query: greedy may not notice, the log-
    probabilities do."""
    d, hf = tiny_checkpoints["gemma3"]
    llm = LLM(d, dtype="float32", block_size=4, num_blocks=200, max_batch_tokens=64)
    first = prompt_of(39, seed=1)
    second = first + prompt_of(7, seed=2)
    run_checked(llm, [first], hf)
    run_checked(llm, [second], hf)
    assert llm.engine.blocks.prefix_stats.hit_tokens == 36  # the first prompt's full blocks


def test_a_prefix_whose_window_blocks_were_evicted_is_recomputed(tiny_checkpoints):
    """Evicting the window pool's cached blocks (only them) leaves the full pool's chain intact;
    the next request must not adopt it past what the window pool still holds."""
    d, hf = tiny_checkpoints["gemma3"]
    llm = LLM(d, dtype="float32", block_size=4, num_blocks=200, max_batch_tokens=64)
    first = prompt_of(41, seed=3)
    run_checked(llm, [first], hf)
    window_pool = llm.engine.blocks.pools[1]
    while window_pool.num_cached_free:  # take every cached block of the window pool
        window_pool._take()
    window_pool.__init__(window_pool.num_blocks, 4, True, window_pool.window)  # and forget them
    run_checked(llm, [first + [5, 6]], hf)
    assert llm.engine.blocks.prefix_stats.hit_tokens == 0


def test_preemption_and_forks_across_pools_answer_as_transformers(tiny_checkpoints):
    """Few blocks: requests are preempted and recomputed; n=2 forks share both pools' blocks.
    Every sample of every request is transformers' greedy."""
    d, hf = tiny_checkpoints["gpt-oss"]
    llm = LLM(d, dtype="float32", block_size=4, num_blocks=24, max_batch_tokens=16, max_num_seqs=4)
    prompts = [prompt_of(n, seed=10 + n) for n in (30, 22, 14, 26)]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, n=2, logprobs=1)
    engine = llm.engine
    ids = [engine.add_request(p, params) for p in prompts]
    done: dict[str, dict[int, list[int]]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                done.setdefault(o.request_id, {})[o.index] = (o.token_ids, o.logprobs)
        engine.scheduler.check_invariants()
    assert engine.scheduler.counters.preemptions > 0
    refs = [hf_greedy(hf, p, 20) for p in prompts]
    for prompt, rid, ref in zip(prompts, ids, refs):
        assert_greedy_matches([done[rid][0][0], done[rid][1][0]], [ref, ref])
        for sample in (0, 1):
            assert_logprobs_match(hf, prompt, *done[rid][sample])


# ---- the pools alone ---------------------------------------------------------------------------


def test_a_window_pool_gives_back_blocks_no_query_can_see():
    """Window 6, blocks of 4: before computing position p, the blocks of positions <= p - 6 are
    gone (a query at p sees p - 5 .. p)."""
    pools = BlockPools([16, 16], 4, (None, 6))
    pools.prepare_write(0, 0, 20)  # 5 blocks in each pool
    tokens = list(range(20))
    pools.register_computed(0, lambda a, b: tokens[a:b], 20)
    full, window = pools.tables_of(0)
    assert HOLE not in full and window[:3] == [HOLE] * 3 and HOLE not in window[3:]  # 15 - 5 = 10: block 2 out
    assert pools.pools[1].num_used == 2 and pools.pools[0].num_used == 5
    pools.free(0)
    pools.check_invariants()
    assert pools.pools[1].num_free == 16


def test_a_prefix_is_adopted_only_as_far_as_every_pool_holds_it():
    pools = BlockPools([32, 32], 4, (None, 6))
    tokens = list(range(100, 141))  # 41 tokens: 10 full blocks before the last token
    pools.prepare_write(0, 0, 41)
    pools.register_computed(0, lambda a, b: tokens[a:b], 41)
    pools.free(0)
    assert pools.adopt_prefix(1, tokens) == 40
    full, window = pools.tables_of(1)
    assert len(full) == 10 and window[:8] == [HOLE] * 8  # position 40 sees 35..40: blocks 8 and 9
    pools.free(1)
    # the window pool loses block 9's cached copy: a hit of 10 blocks needs it, 9 blocks need 7 and 8
    lost = pools.pools[1].cached_blocks(_keys(tokens))[9]
    pools.pools[1]._evictable.pop(lost)
    key = pools.pools[1]._block_key.pop(lost)
    del pools.pools[1]._by_hash[key[0]]
    pools.pools[1]._free.append(lost)
    assert pools.adopt_prefix(2, tokens) == 36
    pools.check_invariants()


def _keys(tokens):
    from pagedllm.engine.block_manager import prefix_keys

    return list(prefix_keys(tokens, 4))


# ---- the planner -------------------------------------------------------------------------------

GEMMA3_270M = dict(  # Gemma 3 270M's shapes (its GGUF's metadata)
    architectures=["Gemma3ForCausalLM"],
    model_type="gemma3_text",
    hidden_size=640,
    intermediate_size=2048,
    num_hidden_layers=18,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=256,
    vocab_size=262144,
    max_position_embeddings=32768,
    sliding_window=512,
    layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)],
    query_pre_attn_scalar=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)


@pytest.mark.parametrize("memory_gib, seqs", [(2.0, 16), (3.0, 64)])
def test_gemma3_plans_over_4x_the_context_of_one_shared_pool(memory_gib, seqs):
    """Each token costs 2 x 1 KV head x 256 x 2 bytes = 1 KiB per layer in bf16: 18 KiB in one
    shared pool, 3 KiB in the full pool; the window pool holds a window per running sequence."""
    cfg = ModelConfig.from_hf_dict(GEMMA3_270M)
    s = EngineSettings(dtype="bfloat16", block_size=16, weights_bytes=300 * 2**20)
    p = plan(cfg, int(memory_gib * 2**30), settings=s, max_num_seqs=seqs, baseline_bytes=400 * 2**20)
    ((window, blocks, per_block),) = p.window_pools
    assert window == 512 and per_block == 15 * 1024 * 16 and p.kv_bytes_per_block == 3 * 1024 * 16
    assert blocks == window_pool_blocks(512, 16, p.max_batch_tokens, seqs)
    assert p.kv_cache_bytes == p.num_blocks * 3 * 1024 * 16 + blocks * 15 * 1024 * 16 <= p.budget_bytes
    shared = (p.kv_cache_bytes // (18 * 1024 * 16)) * 16
    assert abs(p.shared_pool_tokens - shared) <= 16 * 2  # (the one shared pool's own rounding)
    assert p.cache_tokens >= 4 * p.shared_pool_tokens
    assert "one shared pool" in p.table() and str(p.shared_pool_tokens) in p.table()


def test_the_cache_allocated_is_the_planned_cache(tiny_checkpoints):
    """The K/V tensors the engine holds, pool by pool, are the bytes the plan counted."""
    d, _ = tiny_checkpoints["gemma3"]
    llm = LLM(d, dtype="bfloat16", num_blocks=300, max_num_seqs=4, max_batch_tokens=32)
    plan_, cache = llm.memory_plan, llm.engine.kv_cache
    assert plan_.window_pools and cache.pool_blocks == plan_.pool_blocks
    used = sum(
        t.element_size() * t.stride(0) * t.shape[0] * cache.pool_blocks[p] // cache.pool_capacity[p]
        for layer, p in enumerate(cache.layer_pool)
        for t in (cache.k[layer], cache.v[layer])
    )
    assert used == plan_.kv_cache_bytes
    ours = llm.generate([prompt_of(40, seed=5)], GREEDY)[0].outputs[0].token_ids
    assert len(ours) == GREEDY.max_tokens
    assert torch.isfinite(cache.k[0]).all()
