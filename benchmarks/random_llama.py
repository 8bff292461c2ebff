"""A random-weight Llama of a realistic size, for speed and memory figures where no larger
checkpoint can be downloaded (quality is measured on the real default model only).

    python benchmarks/random_llama.py OUT_DIR [--config tinyllama|llama-2b|qwen2.5-0.5b] [--dtype bfloat16]

Writes config.json, model.safetensors (normal(0, 0.02) weights, unit norms: one tensor in memory
at a time) and the default model's tokenizer, so ``pagedllm bench --model OUT_DIR`` runs its
usual workloads. The vocabulary is the tokenizer's (49152), not TinyLlama's own 32000: the
prompts are tokenized by it (+35M parameters, 3% of the model).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

from pagedllm.loading import resolve_model_dir
from pagedllm.loading.safetensors_io import write_streaming

CONFIGS = {
    # TinyLlama-1.1B's shapes
    "tinyllama": dict(
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
    ),
    # A 1.9B Llama (Llama-3.2-1B's width, 28 layers): its Q4_K_M file is 1.1 GB, over twice the
    # 480 MiB L3 of the AMX Xeon, so a decode step reads it from memory (issue 65)
    "llama-2b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=28,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=4096,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
    ),
    # Qwen2.5-0.5B's shapes (as a Llama: no q/k/v bias): 14 heads and 2 KV heads split over 2
    # ranks, where the default model's 9 and 3 split only over 3 (tensor parallelism's benchmark)
    "qwen2.5-0.5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
    ),
}


def tensor_shapes(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * d
    shapes = [("model.embed_tokens.weight", (v, h)), ("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes += [
            (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (h, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, h)),
            (p + "mlp.gate_proj.weight", (i, h)),
            (p + "mlp.up_proj.weight", (i, h)),
            (p + "mlp.down_proj.weight", (h, i)),
        ]
    return shapes


def build(out: Path, name: str, dtype: torch.dtype) -> None:
    tokenizer_dir, _ = resolve_model_dir(None)  # the default model's converted directory
    vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **CONFIGS[name],
        "vocab_size": vocab,
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    out.mkdir(parents=True, exist_ok=True)
    shapes = tensor_shapes(cfg)
    shape_of = dict(shapes)
    generator = torch.Generator().manual_seed(0)

    def produce(tensor_name: str) -> torch.Tensor:
        shape = shape_of[tensor_name]
        if len(shape) == 1:
            return torch.ones(shape)
        return torch.randn(shape, generator=generator) * 0.02

    write_streaming(out / "model.safetensors", [(n, dtype, s) for n, s in shapes], produce, {"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in tokenizer_dir.iterdir():  # the tokenizer, its chat template, generation config
        if f.is_file() and f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, out / f.name)
    params = sum(torch.Size(s).numel() for _, s in shapes)
    print(f"{out}: {name}, {params / 1e9:.2f}B parameters, {dtype}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--config", default="tinyllama", choices=sorted(CONFIGS))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args()
    build(args.out, args.config, getattr(torch, args.dtype))
