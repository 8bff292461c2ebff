"""Tiny, randomly initialised checkpoints of each supported architecture, built in the test run.

Weights are drawn with a larger spread than a real init so that the logits are peaked and greedy
decoding rarely meets a near-tie; the maths under test is the same.
"""

from __future__ import annotations

from pathlib import Path

import torch

COMMON = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=0,
    rms_norm_eps=1e-6,
)

ARCHS = {
    "llama": ("LlamaConfig", dict(tie_word_embeddings=False)),
    "llama3-rope-tied": (
        "LlamaConfig",
        dict(
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    "mistral": ("MistralConfig", dict(sliding_window=24, head_dim=16)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=False, attention_bias=False)),
}


def build_hf_model(name: str, seed: int = 0):
    import transformers

    class_name, extra = ARCHS[name]
    config = getattr(transformers, class_name)(**{**COMMON, **extra})
    config._attn_implementation = "eager"  # the plainest formulation as the oracle
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for p_name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15)
            elif "bias" in p_name:
                p.normal_(0.0, 0.1)
            else:  # norm weights
                p.uniform_(0.8, 1.2)
    return model.eval()


def save_tiny_model(name: str, directory: Path, seed: int = 0):
    model = build_hf_model(name, seed)
    model.save_pretrained(directory, safe_serialization=True)
    return model
