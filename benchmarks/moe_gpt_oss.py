"""A random-weight gpt-oss, smaller than gpt-oss-20b, with its experts in MXFP4 as OpenAI ships
them, converted by llama.cpp's own `convert_hf_to_gguf.py`: `pagedllm bench` then sets pagedllm
against llama.cpp on a GGUF whose experts both run as stored (MXFP4), the file ggml-org's
gpt-oss GGUFs are made the same way from.

    python benchmarks/moe_gpt_oss.py OUT --llama-cpp LLAMA_CPP_DIR
    pagedllm bench --model OUT/gpt-oss-small.gguf --workload single --compare llama.cpp --llama-python PY

LLAMA_CPP_DIR as for `benchmarks/moe_qwen3_a3b.py` (the llama-cpp-python sdist carries it).

llama.cpp's converter writes MXFP4 experts only from a checkpoint that holds them so
(``quantization_config.quant_method: mxfp4``, each projection as ``*_blocks`` and ``*_scales``);
from float experts it writes ``--outtype``. So the experts are quantized here, by the `gguf`
package's MXFP4 (a power-of-two scale per 32 values, each value the nearest e2m1), and stored in
OpenAI's layout: per output row, 32 values a block, byte b holding values 2b (low nibble) and
2b + 1 (high), the scale byte e standing for 2^(e - 127); gate and up interleaved by rows as
gpt-oss's ``gate_up_proj`` interleaves them. The converter repacks them into ggml's MXFP4
blocks (bits moved, no value changed); the other matrices it writes as Q8_0. The tokenizer is the
embedded default model's (SmolLM2), as `moe_qwen3_a3b.py` explains.

The shapes against gpt-oss-20b's (benchmarks/configs/gpt-oss-20b.json):

    |                        | gpt-oss-20b  | this        |
    | experts, per token     | 32, 4        | 32, 4       |
    | hidden, layers         | 2880, 24     | 1024, 8     |
    | expert width           | 2880         | 1024        |
    | heads, KV heads, dim   | 64, 8, 64    | 16, 4, 64   |
    | window (every 2nd)     | 128          | 128         |
    | vocabulary             | 201088       | 49152       |
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from moe_qwen3_a3b import ROUTER_STD, SEED, bf16_model, convert

GGUF_NAME = "gpt-oss-small.gguf"
CONFIG = dict(
    hidden_size=1024,
    intermediate_size=1024,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    num_local_experts=32,
    num_experts_per_tok=4,
    sliding_window=128,
    max_position_embeddings=131072,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    },
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def mxfp4_openai(weight: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """A [rows, cols] matrix in OpenAI's MXFP4 layout: blocks uint8 [rows, cols / 32, 16], scales
    uint8 [rows, cols / 32]. gguf's blocks are (e, 16 bytes: value j low, value j + 16 high)."""
    import gguf

    rows, cols = weight.shape
    blocks = gguf.quants.quantize(weight.float().numpy(), gguf.GGMLQuantizationType.MXFP4)
    blocks = blocks.reshape(rows, cols // 32, 17)
    scales, qs = blocks[..., 0], blocks[..., 1:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # value order 0..31
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8), scales.copy()


def write_checkpoint(out: Path, vocab_size: int) -> None:
    import transformers
    from safetensors.torch import load_file, save_file

    model = bf16_model(transformers.GptOssForCausalLM, transformers.GptOssConfig(**CONFIG, vocab_size=vocab_size))
    generator = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.router.weight"):
                p.copy_(torch.randn(p.shape, generator=generator) * ROUTER_STD)
            elif name.endswith("self_attn.sinks"):
                p.copy_(torch.randn(p.shape, generator=generator))
            elif name.endswith(("gate_up_proj", "down_proj")) and p.dim() == 3:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.02)  # transformers leaves them unset
    model.config.dtype = torch.bfloat16
    model.save_pretrained(out, safe_serialization=True, max_shard_size="20GB")
    for extra in out.glob("generation_config.json"):
        extra.unlink()
    (path,) = out.glob("*.safetensors")
    state = load_file(path)
    for name in [n for n in state if n.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]:
        stacked = state.pop(name)  # [experts, in, out]: each expert's [out, in] is its transpose
        per_expert = [mxfp4_openai(stacked[e].T.contiguous()) for e in range(stacked.shape[0])]
        state[f"{name}_blocks"] = torch.from_numpy(np.stack([b for b, _ in per_expert]))
        state[f"{name}_scales"] = torch.from_numpy(np.stack([s for _, s in per_expert]))
    save_file(state, path, metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--llama-cpp", type=Path, required=True, help="folder of llama.cpp's convert_hf_to_gguf.py")
    args = parser.parse_args()
    hf_dir = args.out / "gpt-oss-small-mxfp4"
    hf_dir.mkdir(parents=True, exist_ok=True)
    write_checkpoint(hf_dir, 49152)
    gguf_path = args.out / GGUF_NAME
    convert(hf_dir, gguf_path, args.llama_cpp)
    print(f"{gguf_path}: {gguf_path.stat().st_size / 1e9:.2f} GB, MXFP4 experts, Q8_0 otherwise")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
