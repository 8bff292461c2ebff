"""A random-weight Qwen3-MoE shaped like Qwen3-30B-A3B but smaller, as an HF directory without a
tokenizer and as llama.cpp's own Q8_0 GGUF, so `pagedllm bench` sets pagedllm against llama.cpp
on a mixture of experts from the same command as a dense model (issue 49, item 6).

    python benchmarks/moe_qwen3_a3b.py OUT --llama-cpp LLAMA_CPP_DIR

LLAMA_CPP_DIR holds llama.cpp's ``convert_hf_to_gguf.py``; the llama-cpp-python sdist carries it:

    pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36 -d /tmp/lcp-sdist
    tar xzf /tmp/lcp-sdist/llama_cpp_python-0.3.36.tar.gz -C /tmp/lcp-sdist
    # LLAMA_CPP_DIR=/tmp/lcp-sdist/llama_cpp_python-0.3.36/vendor/llama.cpp

Writes OUT/qwen3-moe-a3b-small (config.json + model.safetensors in bfloat16, no tokenizer: `bench`
draws its prompts as token ids) and OUT/qwen3-moe-a3b-small.Q8_0.gguf. Then

    pagedllm bench --model OUT/qwen3-moe-a3b-small.Q8_0.gguf --compare llama.cpp --llama-python PY

runs both engines on the GGUF's Q8_0 weights as stored (``--gguf`` defaults to ``--model``'s file);
the GGUF carries SmolLM2's tokenizer, so there the prompts are the usual chat-formatted ones. In
either case both engines get the same token ids.

The shapes against Qwen3-30B-A3B's (benchmarks/configs/qwen3-30b-a3b.json):

    |                      | Qwen3-30B-A3B | this       |
    | experts, per token   | 128, 8        | 64, 8      |
    | hidden, layers       | 2048, 48      | 1024, 12   |
    | expert width         | 768           | 512        |
    | heads, KV heads, dim | 32, 4, 128    | 16, 4, 128 |
    | vocabulary           | 151936        | 49152      |

Parameters (printed when it runs), counted the way Qwen counts A3B's 3.3B active (embedding and
lm_head included; A3B by this sum: 30.5B total, 3.35B active):

    per layer: attention h*(16+2*4)*128 + 16*128*h = 5,242,880; router 64*h = 65,536;
               each expert 3*h*512 = 1,572,864 (gate, up, down); norms 2*h + 2*128
    total  = 12 * (5,242,880 + 65,536 + 64 * 1,572,864 + 2,304) + 2 * 49152 * h + h = 1,372,352,512
    active = 12 * (5,242,880 + 65,536 +  8 * 1,572,864 + 2,304) + 2 * 49152 * h + h =   315,387,904

(h = 1024.) The issue asks for ~1.3B total and ~0.23B active at hidden 1024, 12 layers, 64
experts, top-8: an expert width of 512 gives 1.37B and 0.215B without the embeddings and head
(A3B's own 768 would give 1.98B and 0.39B). The experts are 88% of the total and 48% of the
active weights (A3B: 95%, 54%).

The vocabulary is the embedded default model's (SmolLM2, 49152 tokens), not Qwen's 151936:
llama.cpp's converter refuses a directory without a tokenizer, and accepts only tokenizers whose
pre-tokenizer it recognises (by a hash of their output), which SmolLM2's is. Its files are linked
beside the weights in a folder made for the conversion only and removed after, so the checkpoint
stays tokenizer-free and the GGUF carries a real tokenizer. 49152 also keeps the lm_head's share
of the weights each output token reads (the active ones less the embedding table, of which a
token reads one row) near A3B's: here 50M of 265M, 19%; A3B 311M of 3.04B, 10%; Qwen's
vocabulary would make it 156M of 370M, 42%. ``--vocab-size`` above 49152 pads the GGUF's
vocabulary with llama.cpp's [PAD] tokens.

Weights: transformers' own init (normal(0, 0.02), unit norms) under ``torch.manual_seed(SEED)``;
the routers normal(0, 0.35), as tests/tiny_models.py draws them, so each token's experts win by
wide margins and every expert is chosen by some tokens. One bf16 copy of the model is in memory
(2.7 GB; with A3B's expert width, 4 GB and a 6.7 GB peak while saving), the conversion writes
the GGUF (1.5 GB) tensor by tensor: about 2 to 3 minutes in all on the 2-core box.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch

SEED = 0
ROUTER_STD = 0.35  # tests/tiny_models.py's router spread
GGUF_NAME = "qwen3-moe-a3b-small.Q8_0.gguf"
CONFIG = dict(
    architectures=["Qwen3MoeForCausalLM"],
    model_type="qwen3_moe",
    hidden_size=1024,
    intermediate_size=3072,  # a dense MLP's width: unused, every layer is sparse (A3B: 3x hidden too)
    moe_intermediate_size=512,
    num_hidden_layers=12,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=64,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    attention_bias=False,
    use_sliding_window=False,
    bos_token_id=1,  # SmolLM2's <|im_start|> and <|im_end|>, the tokenizer the GGUF carries
    eos_token_id=2,
)


def parameter_counts(cfg: dict) -> tuple[int, int]:
    """(total, active per token) from the config, written out as in the module's docstring."""
    h, d = cfg["hidden_size"], cfg["head_dim"]
    attention = (
        h * (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) * d + cfg["num_attention_heads"] * d * h
    )
    router = cfg["num_experts"] * h
    expert = 3 * h * cfg["moe_intermediate_size"]
    norms = 2 * h + 2 * d  # input and post-attention norms; q and k norms per head
    embeddings = 2 * cfg["vocab_size"] * h + h  # embed_tokens, lm_head, final norm
    layers = cfg["num_hidden_layers"]
    total = layers * (attention + router + cfg["num_experts"] * expert + norms) + embeddings
    active = layers * (attention + router + cfg["num_experts_per_tok"] * expert + norms) + embeddings
    return total, active


def bf16_model(model_class, config):
    """transformers' own init under ``torch.manual_seed(SEED)``, built in bfloat16: one bf16 copy,
    never a float32 one."""
    torch.manual_seed(SEED)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        return model_class(config).eval()
    finally:
        torch.set_default_dtype(previous)


def write_checkpoint(out: Path, vocab_size: int) -> dict:
    import transformers

    cfg = {**CONFIG, "vocab_size": vocab_size}
    config = transformers.Qwen3MoeConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    config.architectures = cfg["architectures"]
    model = bf16_model(transformers.Qwen3MoeForCausalLM, config)
    generator = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn(p.shape, generator=generator) * ROUTER_STD)
    counted = sum(p.numel() for p in model.parameters())
    total, active = parameter_counts(cfg)
    if counted != total:
        raise SystemExit(f"the model has {counted:,} parameters, the arithmetic says {total:,}: fix parameter_counts")
    model.config.dtype = torch.bfloat16
    model.save_pretrained(out, safe_serialization=True, max_shard_size="20GB")
    for extra in out.glob("generation_config.json"):  # no sampling defaults: bench decodes greedily anyway
        extra.unlink()
    return cfg


def convert(hf_dir: Path, gguf_path: Path, llama_cpp: Path, outtype: str = "q8_0", extra: tuple[str, ...] = ()) -> None:
    """llama.cpp's converter on the checkpoint plus the default model's tokenizer, linked into a
    folder of its own (removed after): the checkpoint itself stays without a tokenizer."""
    from pagedllm.loading import resolve_model_dir

    tokenizer_dir, _ = resolve_model_dir(None)  # the embedded SmolLM2, converted into the cache once
    staging = gguf_path.parent / ".with-tokenizer"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        for f in hf_dir.iterdir():
            (staging / f.name).symlink_to(f.resolve())
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            if (tokenizer_dir / name).is_file():
                (staging / name).symlink_to((tokenizer_dir / name).resolve())
        command = [
            sys.executable,
            str(llama_cpp / "convert_hf_to_gguf.py"),
            str(staging),
            "--outtype",
            outtype,
            "--outfile",
            str(gguf_path),
            *extra,
        ]
        print("#", " ".join(command), flush=True)
        subprocess.run(command, check=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--llama-cpp", type=Path, required=True, help="folder of llama.cpp's convert_hf_to_gguf.py")
    parser.add_argument("--vocab-size", type=int, default=49152, help="at least the tokenizer's 49152")
    parser.add_argument(
        "--layers", type=int, default=12, help="12: 1.37B parameters; 24 makes its Q4_K_M over twice a 480 MiB L3"
    )
    parser.add_argument(
        "--outtype", default="q8_0", help="the converter's; f16 to make Q4_K_M of (benchmarks/llama_quantize.py)"
    )
    args = parser.parse_args()
    CONFIG["num_hidden_layers"] = args.layers
    if not (args.llama_cpp / "convert_hf_to_gguf.py").is_file():
        parser.error(f"{args.llama_cpp}: no convert_hf_to_gguf.py there (see the docstring: the sdist carries it)")
    if args.vocab_size < 49152:
        parser.error("--vocab-size: at least 49152, the GGUF's tokenizer's (llama.cpp's converter asserts it)")
    hf_dir = args.out / "qwen3-moe-a3b-small"  # the name bench prints
    hf_dir.mkdir(parents=True, exist_ok=True)
    cfg = write_checkpoint(hf_dir, args.vocab_size)
    total, active = parameter_counts(cfg)
    read = active - cfg["vocab_size"] * cfg["hidden_size"]  # of the embedding table, a token reads one row
    print(f"{hf_dir}: Qwen3-MoE, {total:,} parameters ({total / 1e9:.3f}B)")
    print(f"active per token: {active:,} ({active / 1e9:.3f}B); less the embedding table: {read:,} ({read / 1e9:.3f}B)")
    print(json.dumps({k: cfg[k] for k in ("hidden_size", "num_hidden_layers", "num_experts", "vocab_size")}))
    gguf_path = args.out / GGUF_NAME.replace("Q8_0", args.outtype.upper())
    convert(hf_dir, gguf_path, args.llama_cpp, args.outtype)
    print(f"{gguf_path}: {gguf_path.stat().st_size / 1e9:.2f} GB, {args.outtype.upper()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
