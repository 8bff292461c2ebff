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
from tiny_models import ARCHS, MOE_ARCHS, save_tiny_model, save_tiny_qwen35_gguf

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
    the decode step that follows: one new token per sequence. A model with state layers: each
    sequence's state in a slot after the first (which holds noise no sequence reads)."""
    g = torch.Generator().manual_seed(3)
    cache = KVCache(cfg, num_blocks=32, block_size=BLOCK, dtype=kv_dtype, state_slots=len(PROMPTS) + 1)
    slots = torch.arange(len(PROMPTS)) + 1
    for tensors in cache.states.values():
        for t in tensors.values():
            t.normal_(generator=g)
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
    layout.state_slots = slots
    model(
        torch.tensor(ids), torch.tensor(positions), model.backend.attention(cache, layout), torch.tensor([len(ids) - 1])
    )
    layout = StepLayout.from_slices(decode, BLOCK, group)
    layout.state_slots = slots
    return cache, (torch.tensor(new_ids), torch.tensor(PROMPTS), layout)


def states_of(cache) -> list[torch.Tensor]:
    return [t.clone() for tensors in cache.states.values() for t in tensors.values()]


def decode_logits(model, cache, step, program: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The step's logits and the states it leaves, from the states the prefill left (put back after)."""
    ids, positions, layout = step
    before = states_of(cache)
    model.use_decode_program = program
    try:
        logits = model(ids, positions, model.backend.attention(cache, layout), torch.arange(len(ids)))
        return logits, states_of(cache)
    finally:
        model.use_decode_program = True
        for t, saved in zip((t for tensors in cache.states.values() for t in tensors.values()), before):
            t.copy_(saved)


def assert_program_equals_loop(loaded, kv_dtype):
    model, cfg = loaded.model, loaded.config
    cache, step = prefilled(model, cfg, kv_dtype, min(cfg.vocab_size, 300))
    assert model.decode_program() is not None, "the compiled decode step must take this model"
    ours, our_states = decode_logits(model, cache, step, program=True)
    reference, states = decode_logits(model, cache, step, program=False)
    assert torch.equal(ours, reference), f"largest difference {(ours - reference).abs().max():.3g}"
    assert len(states) == len(our_states) and all(torch.equal(a, b) for a, b in zip(our_states, states))
    if states:  # the step moved every sequence's states, and no other slot's
        moved = [not torch.equal(a[1:], b[1:]) for a, b in zip(states, states_of(cache))]
        assert all(moved) and all(torch.equal(a[0], b[0]) for a, b in zip(states, states_of(cache)))


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
    assert program.takes(tokens=200, sequences=200, dtype=torch.float32, layout=None)
    assert program.takes(tokens=SMALL_STEP_TOKENS, sequences=4, dtype=torch.float32, layout=None)
    assert not program.takes(tokens=SMALL_STEP_TOKENS + 1, sequences=4, dtype=torch.float32, layout=None)


# Qwen3.5 and its mixtures: Gated DeltaNet layers beside gated attention with partial rotary
DELTA_RULE_CASES = [
    ("qwen3_5", "float32", None, "float32"),
    ("qwen3_5", "bfloat16", "int8", "bfloat16"),
    ("qwen3_5", "float32", "w8a8", "int8"),
    ("qwen3_5-moe", "float32", "int4", "float32"),
    ("qwen3-next", "bfloat16", "int8", "float32"),
]


@pytest.mark.parametrize("arch, dtype, quantization, kv_dtype", DELTA_RULE_CASES)
def test_decode_step_runs_delta_rule_layers_as_the_layer_loop(tmp_path, arch, dtype, quantization, kv_dtype, ops):
    """A decode step of Qwen3.5's layers in the program: each delta-rule layer's state updated
    in its own slot (the slot before, dirty, untouched), the attention layers' output gate and
    quarter rotary; logits and states bit-identical to the loop's."""
    save_tiny_model(arch, tmp_path)
    assert_program_equals_loop(load(tmp_path, dtype, quantization=quantization), kv_dtype)


def test_decode_step_runs_a_qwen35_gguf_as_stored(tmp_path, ops):
    """Q8_0 blocks, and the value heads regrouped by llama.cpp's converter (value head j is key
    head j mod key_heads's)."""
    save_tiny_qwen35_gguf("qwen3_5", tmp_path / "q.gguf", weights="Q8_0")
    loaded = load(tmp_path / "q.gguf", "float32")
    assert loaded.config.delta_rule is not None and loaded.config.delta_rule.value_heads_tiled
    assert_program_equals_loop(loaded, "float32")


def test_a_step_with_a_state_to_start_or_copy_takes_the_layer_loop(tmp_path, ops):
    """With state layers the program runs only steps whose every row decodes a state it continues;
    a prompt's step (its state started, checkpoints copied) keeps the loop."""
    save_tiny_model("qwen3_5", tmp_path)
    model = load(tmp_path, "float32").model
    program = model.decode_program()
    assert program is not None

    def layout(*slices, checkpoints=None):
        lay = StepLayout.from_slices([SequenceSlice(*s) for s in slices], BLOCK, 1)
        lay.state_slots = torch.tensor([3, 1])
        if checkpoints is not None:
            lay.checkpoints = torch.tensor(checkpoints)
        return lay

    assert program.takes(2, 2, torch.float32, layout((0, 1, 6, [0]), (1, 1, 3, [1])))
    assert not program.takes(4, 2, torch.float32, layout((0, 1, 6, [0]), (1, 3, 3, [1])))
    # a one-token prompt starts its state
    assert not program.takes(2, 2, torch.float32, layout((0, 1, 6, [0]), (1, 1, 1, [1])))
    copied = layout((0, 1, 6, [0]), (1, 1, 3, [1]), checkpoints=[[1, 3, 0]])
    assert not program.takes(2, 2, torch.float32, copied)


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
