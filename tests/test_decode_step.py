"""The compiled decode step (``backends.cpu.decode_program``) computes what the Python layer loop does.

It calls the same kernels in the same order, so a decode step's logits must be bit-identical to
the loop's, on every architecture (biases, Qwen3's q/k norms, Mistral's sliding window, tied and
untied heads), for every weight kind the loop runs (oneDNN-packed float32 and bf16, int8, int4,
w8a8, a GGUF's own blocks) and both kinds of KV cache (float and 8-bit with scales). The loop
itself is pinned to transformers by test_models_match_transformers.py.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import ARCHS, MOE_ARCHS

from pagedllm.backends.cpu.attention import SequenceSlice, StepLayout
from pagedllm.backends.cpu.kv_cache import KVCache
from pagedllm.loading import load

BLOCK = 8
PROMPTS = [5, 17, 30, 9]  # prompt lengths; the decode step adds one token to each

# (weights dtype, quantization, KV cache dtype)
CASES = [
    ("float32", None, "float32"),
    ("bfloat16", None, "bfloat16"),
    ("float32", "int4", "int8"),
    ("bfloat16", "int8", "float32"),
    ("float32", "w8a8", "bfloat16"),
]


def prefilled(model, cfg, kv_dtype, vocab):
    """A cache holding every prompt's K/V (one flat prefill step through the Python loop), and
    the decode step that follows: one new token per sequence."""
    g = torch.Generator().manual_seed(3)
    cache = KVCache(cfg, num_blocks=32, block_size=BLOCK, dtype=kv_dtype)
    prefill, decode, ids, positions, new_ids, block = [], [], [], [], [], 0
    for i, n in enumerate(PROMPTS):
        table = list(range(block, block + -(-(n + 1) // BLOCK)))
        block += len(table)
        prefill.append(SequenceSlice(len(ids), n, n, table))
        decode.append(SequenceSlice(i, 1, n + 1, table))
        ids += torch.randint(1, vocab, (n,), generator=g).tolist()
        positions += range(n)
        new_ids.append(int(torch.randint(1, vocab, (1,), generator=g)))
    group = cfg.num_heads // cfg.num_kv_heads
    layout = StepLayout.from_slices(prefill, BLOCK, group)
    model(
        torch.tensor(ids), torch.tensor(positions), model.backend.attention(cache, layout), torch.tensor([len(ids) - 1])
    )
    step = (torch.tensor(new_ids), torch.tensor(PROMPTS), StepLayout.from_slices(decode, BLOCK, group))
    return cache, step


def decode_logits(model, cache, step, program: bool) -> torch.Tensor:
    ids, positions, layout = step
    model.use_decode_program = program
    try:
        return model(ids, positions, model.backend.attention(cache, layout), torch.arange(len(ids)))
    finally:
        model.use_decode_program = True


def assert_program_equals_loop(loaded, kv_dtype):
    model, cfg = loaded.model, loaded.config
    cache, step = prefilled(model, cfg, kv_dtype, min(cfg.vocab_size, 300))
    assert model.decode_program() is not None, "the compiled decode step must take this model"
    ours = decode_logits(model, cache, step, program=True)
    reference = decode_logits(model, cache, step, program=False)
    assert torch.equal(ours, reference), f"largest difference {(ours - reference).abs().max():.3g}"


@pytest.mark.parametrize("dtype, quantization, kv_dtype", CASES)
@pytest.mark.parametrize("arch", [a for a in ARCHS if a not in MOE_ARCHS])
def test_decode_step_equals_the_layer_loop(tiny_checkpoints, arch, dtype, quantization, kv_dtype, ops):
    directory, _ = tiny_checkpoints[arch]
    assert_program_equals_loop(load(directory, dtype, quantization=quantization), kv_dtype)


@pytest.mark.parametrize("dtype, kv_dtype", [("float32", "float32"), ("bfloat16", "int8")])
def test_decode_step_equals_the_layer_loop_on_the_default_gguf_as_stored(dtype, kv_dtype, ops):
    """Q4_1 blocks with offsets, a Q8_0 tied head: the weights one request reads."""
    assert_program_equals_loop(load(None, dtype), kv_dtype)


def test_long_prefill_and_mixed_steps_take_the_layer_loop(tiny_checkpoints, ops):
    """The program runs steps whose every row decodes, or small ones (rows with speculative
    guesses); a longer prompt chunk keeps the Python loop."""
    from pagedllm.backends.cpu.decode_program import SMALL_STEP_TOKENS

    loaded = load(tiny_checkpoints["llama"][0], "float32")
    program = loaded.model.decode_program()
    assert program is not None
    assert program.takes(tokens=200, sequences=200, dtype=torch.float32)
    assert program.takes(tokens=SMALL_STEP_TOKENS, sequences=4, dtype=torch.float32)
    assert not program.takes(tokens=SMALL_STEP_TOKENS + 1, sequences=4, dtype=torch.float32)


# Mixtures whose sparse layers the program runs: a plain softmax router over top_k, no shared expert
PROGRAMMED_MOE = ["qwen3-moe", "mixtral", "gpt-oss", "olmoe", "qwen2-moe"]


QUANTIZED_EXPERTS = [("float32", "int4", "int8"), ("bfloat16", "int8", "float32")]


@pytest.mark.parametrize("dtype, quantization, kv_dtype", QUANTIZED_EXPERTS)
@pytest.mark.parametrize("arch", PROGRAMMED_MOE)
def test_decode_step_runs_quantized_experts_as_the_layer_loop(
    tiny_checkpoints, arch, dtype, quantization, kv_dtype, ops
):
    """Experts the expert kernel takes (quantized, one format a projection): the router's
    choice and weights (Mixtral renormalises its top 2, the tiny Qwen3-MoE as its config says;
    gpt-oss's biased router softmaxed over its top 2) and the experts' sum (gpt-oss's biased,
    clamped experts, and its attention sinks; OLMoE's q/k norm over the whole projection;
    Qwen2-MoE's gated shared expert, and its dense layers among the sparse ones), bit-identical
    to the loop's."""
    directory, _ = tiny_checkpoints[arch]
    assert_program_equals_loop(load(directory, dtype, quantization=quantization), kv_dtype)


LOOPED_MIXTURES = [(a, None) for a in MOE_ARCHS]


@pytest.mark.parametrize("arch, quantization", LOOPED_MIXTURES)
def test_other_mixtures_decode_in_the_python_layer_loop(tiny_checkpoints, arch, quantization, ops):
    """README: float experts keep the layer loop for every step (test_models_match_transformers
    pins its output on both kernel paths)."""
    loaded = load(tiny_checkpoints[arch][0], "float32", quantization=quantization)
    assert loaded.model.decode_program() is None


def test_the_pytorch_backend_has_no_decode_step(tiny_checkpoints):
    from kernel_paths import torch_backend

    loaded = load(tiny_checkpoints["llama"][0], "float32", backend=torch_backend())
    assert loaded.model.decode_program() is None


def test_the_environment_switch_keeps_the_layer_loop(tiny_checkpoints, ops, monkeypatch):
    """README: ``PAGEDLLM_DECODE_STEP=0`` runs the Python loop for every step (to compare)."""
    monkeypatch.setenv("PAGEDLLM_DECODE_STEP", "0")
    assert load(tiny_checkpoints["llama"][0], "float32").model.decode_program() is None
