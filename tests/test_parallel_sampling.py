"""Parallel sampling (n > 1): the samples share the prompt's blocks, copy the partial block on
first write, each draws from its own seed stream, and nothing leaks whatever happens to them."""

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.engine import LLMEngine
from pagedllm.errors import RequestRejected


def prompt_of(length: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 300, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def sampled(seed: int, n: int = 1, max_tokens: int = 10) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, n=n, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_checkpoints):
    return LLM(
        tiny_checkpoints["llama"][0],
        block_size=8,
        num_blocks=64,
        max_batch_tokens=32,
        max_num_seqs=8,
        max_model_len=128,
    )


# prompt lengths: last prompt token mid-block, first in a new block, one token, whole blocks
@pytest.mark.parametrize("length", [13, 17, 1, 16])
def test_sample_i_equals_a_single_request_seeded_with_seed_plus_i(llm, length):
    """Would fail if the samples wrote into one shared block (copy-on-write broken) or drew
    from one noise stream."""
    prompt = prompt_of(length, seed=length)
    out = llm.generate([prompt], sampled(seed=40, n=4))[0]
    solo = [llm.generate([prompt], sampled(seed=40 + i))[0].token_ids for i in range(4)]
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    assert [o.token_ids for o in out.outputs] == solo
    assert out.token_ids == solo[0]
    assert len({tuple(t) for t in solo}) > 1  # the samples do differ
    assert llm.engine.blocks.num_used == 0


def test_greedy_samples_are_all_the_greedy_output(llm):
    prompt = prompt_of(21, seed=3)
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    one = llm.generate([prompt], greedy)[0].token_ids
    three = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, n=3))[0]
    assert [o.token_ids for o in three.outputs] == [one] * 3


def peak_blocks(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]]) -> tuple[int, list]:
    for prompt, params in requests:
        engine.add_request(prompt, params)
    peak, finished = 0, []
    while engine.has_unfinished():
        finished += [o for o in engine.step() if o.finished]
        peak = max(peak, engine.blocks.num_used)
    return peak, finished


def test_n_4_shares_the_prompt_blocks_instead_of_holding_4_copies(tiny_checkpoints):
    def engine():
        return LLM(
            tiny_checkpoints["llama"][0],
            block_size=8,
            num_blocks=64,
            max_batch_tokens=64,
            max_num_seqs=8,
            max_model_len=128,
            enable_prefix_caching=False,
        ).engine

    prompt = prompt_of(43, seed=1)  # 5 full blocks + 3 tokens
    shared = engine()
    peak_shared, outs = peak_blocks(shared, [(prompt, sampled(seed=1, n=4, max_tokens=4))])
    separate = engine()
    peak_separate, _ = peak_blocks(separate, [(prompt, sampled(seed=1 + i, max_tokens=4)) for i in range(4)])
    assert sorted(o.index for o in outs) == [0, 1, 2, 3] and all(len(o.token_ids) == 4 for o in outs)
    # 5 shared full blocks + one partial block each (3 of them copies) vs 4 x 6 blocks
    assert (peak_shared, peak_separate) == (5 + 4, 4 * 6)
    assert shared.stats.blocks_copied == 3 and shared.stats.prompt_tokens_computed == 43 + 3
    assert shared.blocks.num_used == 0 and all(c == 0 for c in shared.blocks.ref_counts)


def test_samples_survive_preemption_and_match_single_requests(tiny_checkpoints):
    tight = LLM(
        tiny_checkpoints["llama"][0],
        block_size=4,
        num_blocks=30,
        max_batch_tokens=16,
        max_num_seqs=8,
        max_model_len=100,
    )
    prompts = [prompt_of(n, seed=n) for n in (10, 23, 7)]
    outs = tight.generate(prompts, sampled(seed=9, n=3, max_tokens=24))
    assert tight.stats.preemptions > 0
    roomy = LLM(tiny_checkpoints["llama"][0], block_size=4, num_blocks=200, max_batch_tokens=64, max_model_len=100)
    for prompt, out in zip(prompts, outs):
        solo = [roomy.generate([prompt], sampled(seed=9 + i, max_tokens=24))[0].token_ids for i in range(3)]
        assert [o.token_ids for o in out.outputs] == solo
    assert tight.engine.blocks.num_free == tight.engine.blocks.num_blocks


def test_a_step_that_runs_out_of_memory_after_forking_loses_no_copy(llm):
    prompt = prompt_of(13, seed=13)
    expected = [o.token_ids for o in llm.generate([prompt], sampled(seed=5, n=3)).pop().outputs]
    real_run, failed = llm.engine.runner.run, []

    def fail_once_when_copying(batch, seqs):
        if batch.copies and not failed:
            failed.append(len(batch.copies))
            raise torch.OutOfMemoryError("injected")
        return real_run(batch, seqs)

    llm.engine.runner.run = fail_once_when_copying
    try:
        got = [o.token_ids for o in llm.generate([prompt], sampled(seed=5, n=3)).pop().outputs]
    finally:
        llm.engine.runner.run = real_run
    assert failed and got == expected and llm.stats.oom_recoveries >= 1


@pytest.mark.parametrize("steps_before_abort", [0, 1, 2, 4])
def test_abort_ends_every_sample_once_and_frees_every_block(llm, steps_before_abort):
    engine = llm.engine
    rid = engine.add_request(prompt_of(30, seed=7), sampled(seed=2, n=3, max_tokens=20))
    other = engine.add_request(prompt_of(9, seed=8), sampled(seed=2, max_tokens=20))
    ended = []
    for _ in range(steps_before_abort):
        ended += [(o.request_id, o.index) for o in engine.step() if o.finished]
    aborted = engine.abort(rid)
    assert all(o.finished and o.finish_reason == "abort" for o in aborted) and aborted[-1].request_finished
    ended += [(o.request_id, o.index) for o in aborted]
    while engine.has_unfinished():
        ended += [(o.request_id, o.index) for o in engine.step() if o.finished]
    assert sorted(ended) == sorted(set(ended)) and (other, 0) in ended
    assert engine.abort(rid) == [] and engine.blocks.num_used == 0


def test_n_beyond_max_num_seqs_is_rejected(llm):
    with pytest.raises(RequestRejected, match="max_num_seqs"):
        llm.engine.add_request([5, 6, 7], SamplingParams(n=9))
    with pytest.raises(ValueError, match="n must be"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match="n > 1"):
        next(llm.stream([5, 6, 7], SamplingParams(n=2)))


@pytest.mark.parametrize("abort", [False, True])  # ends by itself, or is aborted once forked
def test_when_samples_end_together_only_the_last_output_says_the_request_finished(llm, abort):
    """Readers (the server's mailbox, LLM.generate) stop at the first output marked
    request_finished: if every sample that ends in the same step carried it, the others' final
    outputs would be lost (a request for n samples would hang or lose samples)."""
    engine = llm.engine
    rid = engine.add_request(prompt_of(12, seed=3), sampled(seed=1, n=3, max_tokens=2))
    finals = []
    while engine.has_unfinished():
        if abort and len(engine.requests[rid].group) == 3:
            finals += [o for o in engine.abort(rid) if o.finished]
            break
        finals += [o for o in engine.step() if o.finished]
    assert sorted(o.index for o in finals) == [0, 1, 2]
    assert [o.request_finished for o in finals] == [False, False, True]
