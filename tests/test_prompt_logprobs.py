"""Prompt logprobs (``SamplingParams.prompt_logprobs``): the prompt's own tokens' logprobs,
computed in the prompt's own pass, equal transformers' log-softmax at every position, however
the prompt is computed: in one step or in chunks, after a prefix-cache hit (which must not skip
the positions asked for), with few logits rows to spare, or for several samples."""

import pytest
import torch

from pagedllm import LLM, SamplingParams

TOP = 3


def hf_prompt_logprobs(hf, prompt: list[int]) -> torch.Tensor:
    """[len - 1, vocab]: transformers' log-softmax at positions 0 .. len - 2 (the oracle)."""
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)


def assert_equal_to_transformers(entries, hf, prompt: list[int]) -> None:
    expected = hf_prompt_logprobs(hf, prompt)
    assert len(entries) == len(prompt) and entries[0] is None
    for p, entry in enumerate(entries[1:]):
        token, value = entry["token"]
        assert token == prompt[p + 1]
        assert value == pytest.approx(expected[p, token].item(), abs=1e-4)
        top_values, top_ids = expected[p].topk(TOP)
        assert [t for t, _ in entry["top"]] == top_ids.tolist()
        assert [v for _, v in entry["top"]] == pytest.approx(top_values.tolist(), abs=1e-4)


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in (2, 7, 40, 23)]


def params(**fields) -> SamplingParams:
    return SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=TOP, **fields)


@pytest.mark.parametrize(
    "engine",
    [
        {},  # each prompt in one step
        {"max_batch_tokens": 8},  # chunked: a prompt's logits come over several steps
        {"max_num_seqs": 2},  # two logits rows a step: a prompt's come a few at a time
    ],
    ids=["whole", "chunked", "few-rows"],
)
def test_prompt_logprobs_equal_transformers(tiny_checkpoints, engine):
    directory, hf = tiny_checkpoints["llama"]
    llm = LLM(str(directory), dtype="float32", block_size=4, **engine)
    scheduler, steps = llm.engine.scheduler, []
    schedule = scheduler.schedule
    scheduler.schedule = lambda: steps.append(schedule()) or steps[-1]
    batch = prompts(hf.config.vocab_size)
    outs = llm.generate(batch, params())
    # the plan allows max_num_seqs logits rows a step: prompt logits never take more
    assert max(sum(r.logits_rows for r in out.rows) for out in steps) <= scheduler.max_num_seqs
    for prompt, out in zip(batch, outs):
        assert_equal_to_transformers(out.prompt_logprobs, hf, prompt)
        assert len(out.token_ids) == 3  # and the request still generates


def test_a_prefix_cache_hit_still_gives_every_prompt_logprob(tiny_checkpoints):
    directory, hf = tiny_checkpoints["llama"]
    llm = LLM(str(directory), dtype="float32", block_size=4)
    prompt = prompts(hf.config.vocab_size)[2]
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))  # caches the prompt's blocks
    hits = llm.engine.stats.prefix_cache_hit_tokens
    plain = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))[0]
    assert llm.engine.stats.prefix_cache_hit_tokens > hits  # the cache does serve this prompt
    assert plain.prompt_logprobs is None  # (not asked for: none)
    out = llm.generate([prompt], params())[0]
    assert_equal_to_transformers(out.prompt_logprobs, hf, prompt)


def test_every_sample_of_n_gets_the_prompts_logprobs(tiny_checkpoints):
    directory, hf = tiny_checkpoints["llama"]
    llm = LLM(str(directory), dtype="float32", block_size=4)
    prompt = prompts(hf.config.vocab_size)[1]
    out = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=1.0, seed=0, n=2, prompt_logprobs=TOP))[0]
    assert len(out.outputs) == 2
    assert_equal_to_transformers(out.prompt_logprobs, hf, prompt)


def test_prompt_logprobs_out_of_range_is_refused():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
