"""Embeddings (``LLM.embed``, ``SamplingParams.pooling``): the prompt's last hidden states after
the final norm, pooled (the last token's, or the mean of all) and L2-normalised, equal
transformers' ``last_hidden_state`` pooled the same way, however the engine computes the prompt:
whole, in chunks, beside generating requests, after a prefix-cache hit."""

import pytest
import torch

from pagedllm import LLM, SamplingParams


def hf_embedding(hf, prompt: list[int], pooling: str) -> torch.Tensor:
    with torch.no_grad():
        hidden = hf.model(torch.tensor([prompt])).last_hidden_state[0].float()
    pooled = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
    return torch.nn.functional.normalize(pooled, dim=0)


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in (1, 9, 37)]


@pytest.mark.parametrize("pooling", ["last", "mean"])
@pytest.mark.parametrize("engine", [{}, {"max_batch_tokens": 8}], ids=["whole", "chunked"])
def test_embeddings_equal_transformers_pooled(tiny_checkpoints, pooling, engine):
    directory, hf = tiny_checkpoints["llama"]
    llm = LLM(str(directory), dtype="float32", block_size=4, **engine)
    batch = prompts(hf.config.vocab_size)
    for prompt, vector in zip(batch, llm.embed(batch, pooling=pooling)):
        torch.testing.assert_close(torch.tensor(vector), hf_embedding(hf, prompt, pooling), atol=1e-4, rtol=0)


def test_embedding_requests_run_beside_generation_and_after_a_cache_hit(tiny_checkpoints):
    directory, hf = tiny_checkpoints["llama"]
    llm = LLM(str(directory), dtype="float32", block_size=4, max_batch_tokens=16)
    prompt = prompts(hf.config.vocab_size)[2]
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))  # the prompt's blocks cached
    mixed = [SamplingParams(max_tokens=5, temperature=0), SamplingParams(max_tokens=1, pooling="mean")]
    generated, embedded = llm.generate([prompt, prompt], mixed)
    assert len(generated.token_ids) == 5 and embedded.token_ids == []
    assert embedded.finish_reason == "stop"
    torch.testing.assert_close(torch.tensor(embedded.embedding), hf_embedding(hf, prompt, "mean"), atol=1e-4, rtol=0)
    torch.testing.assert_close(
        torch.tensor(llm.embed([prompt])[0]), hf_embedding(hf, prompt, "last"), atol=1e-4, rtol=0
    )


def test_bad_pooling_is_refused():
    with pytest.raises(ValueError, match="pooling"):
        SamplingParams(pooling="max")
    with pytest.raises(ValueError, match="n=1"):
        SamplingParams(pooling="mean", n=2)
