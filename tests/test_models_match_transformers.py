"""Greedy output and logits equal transformers', for every supported architecture."""

import copy

import pytest
import torch
from greedy import assert_greedy_matches, hf_greedy
from tiny_models import ARCHS

from pagedllm import LLM, SamplingParams
from pagedllm.layers.attention import PagedAttention, SequenceSlice, StepLayout
from pagedllm.layers.kv_cache import KVCache
from pagedllm.loading import load

PROMPT_LENGTHS = [1, 5, 17, 40, 64, 3, 29]


def prompts(vocab: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def our_logits(directory, dtype: str = "float32", kv_dtype="float32") -> tuple[list[list[int]], torch.Tensor]:
    """(the prompts, float32 logits at every position of every prompt), all in one flat step."""
    loaded = load(directory, dtype)
    batch = prompts(loaded.config.vocab_size)
    cache = KVCache(loaded.config, num_blocks=64, block_size=8, dtype=kv_dtype)
    slices, ids, positions, block = [], [], [], 0
    for p in batch:
        n_blocks = -(-len(p) // 8)
        slices.append(SequenceSlice(len(ids), len(p), len(p), list(range(block, block + n_blocks))))
        block += n_blocks
        ids += p
        positions += range(len(p))
    layout = StepLayout(slices, 8, loaded.config.num_heads // loaded.config.num_kv_heads)
    logits = loaded.model(
        torch.tensor(ids), torch.tensor(positions), PagedAttention(cache, layout), torch.arange(len(ids))
    )
    return batch, logits.float()


def hf_logits(hf, batch) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([hf(torch.tensor([p])).logits[0].float() for p in batch])


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_equal_transformers_in_fp32(tiny_checkpoints, arch, kernels):
    directory, hf = tiny_checkpoints[arch]
    batch, logits = our_logits(directory)
    torch.testing.assert_close(logits, hf_logits(hf, batch), atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_logits_are_as_close_to_fp32_as_transformers_bf16(tiny_checkpoints, arch, kernels):
    """bf16 rounds differently in any two implementations; ours may be no further from the fp32
    logits than transformers' own bf16 run is (measured: 0.67-1.31x of it over these models)."""
    directory, hf = tiny_checkpoints[arch]
    batch, ours = our_logits(directory, "bfloat16", "bfloat16")
    truth = hf_logits(hf, batch)
    theirs = hf_logits(copy.deepcopy(hf).to(torch.bfloat16), batch)
    assert (ours - truth).abs().max() <= 1.5 * (theirs - truth).abs().max()


# Largest logit error allowed, as a share of the largest logit, for a KV cache in another dtype
# than the fp32 weights (measured on these models: bf16 1.7%, int8 3.4%, fp8 e4m3 12.8%).
KV_TOLERANCE = {"bfloat16": 0.03, "int8": 0.05, "fp8": 0.16}


@pytest.mark.parametrize("kv_dtype", sorted(KV_TOLERANCE))
@pytest.mark.parametrize("arch", ARCHS)
def test_a_kv_cache_in_another_dtype_stays_close_to_transformers_fp32(tiny_checkpoints, arch, kv_dtype, kernels):
    directory, hf = tiny_checkpoints[arch]
    batch, ours = our_logits(directory, "float32", kv_dtype)
    truth = hf_logits(hf, batch)
    assert (ours - truth).abs().max() <= KV_TOLERANCE[kv_dtype] * truth.abs().max()
    # and bf16 weights over an fp32 cache run too (the kernel computes in the cache's dtype)
    _, mixed = our_logits(directory, "bfloat16", "float32")
    assert torch.isfinite(mixed).all()


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_32_tokens_equal_transformers_generate(tiny_checkpoints, arch, kernels):
    directory, hf = tiny_checkpoints[arch]
    llm = LLM(directory, block_size=8, num_blocks=128)
    batch = prompts(llm.loaded.config.vocab_size, seed=2)
    outs = llm.generate(batch, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    refs = [hf_greedy(hf, p, 32) for p in batch]
    report = assert_greedy_matches([o.token_ids for o in outs], refs)
    print(arch, report)


def test_logits_are_computed_only_for_sampled_rows(tiny_checkpoints):
    directory, _ = tiny_checkpoints["llama"]
    loaded = load(directory)
    cache = KVCache(loaded.config, num_blocks=8, block_size=8, dtype=torch.float32)
    layout = StepLayout([SequenceSlice(0, 20, 20, [0, 1, 2])], 8, 2)
    rows = torch.tensor([19])
    logits = loaded.model(torch.arange(1, 21), torch.arange(20), PagedAttention(cache, layout), rows)
    assert logits.shape == (1, loaded.config.vocab_size)


def test_bfloat16_loads_and_generates_close_to_fp32(tiny_checkpoints):
    """bf16 is not bit-equal to fp32; it must load as bf16 and mostly agree on the first tokens."""
    directory, _ = tiny_checkpoints["qwen3"]
    llm = LLM(directory, dtype="bfloat16")
    assert {p.dtype for p in llm.loaded.model.parameters()} == {torch.bfloat16}
    assert llm.engine.kv_cache.dtype == torch.bfloat16
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    batch = prompts(llm.loaded.config.vocab_size, seed=4)
    bf16 = [o.token_ids[0] for o in llm.generate(batch, params)]
    fp32 = [o.token_ids[0] for o in LLM(directory).generate(batch, params)]
    assert sum(a == b for a, b in zip(bf16, fp32)) >= len(batch) - 2
