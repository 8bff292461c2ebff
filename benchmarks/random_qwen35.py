"""A random-weight Qwen3.5 of a real model's shapes (``benchmarks/configs/qwen3.5-0.8b.json``:
Qwen3.5-0.8B's), as a checkpoint and as the GGUF file llama.cpp's converter makes of it, for the
speed of a hybrid model against llama.cpp on the same bytes (issue 67).

    python benchmarks/random_qwen35.py OUT_DIR --llama-cpp LLAMA_CPP_DIR [--outtype q8_0]

Writes OUT_DIR/qwen3.5-0.8b (transformers' own init under a fixed seed, bfloat16, the default
model's tokenizer beside it) and OUT_DIR/qwen3.5-0.8b.<outtype>.gguf (``convert_hf_to_gguf.py
--no-mtp``: the model has no multi-token-prediction head). LLAMA_CPP_DIR holds the converter;
``benchmarks/moe_qwen3_a3b.py``'s docstring says where to get it. Then, one engine at a time:

    pagedllm bench --model OUT_DIR/qwen3.5-0.8b.q8_0.gguf --workload single --dtype bfloat16 \\
        --compare llama.cpp --llama-python PEER/bin/python
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

CONFIG = Path(__file__).parent / "configs" / "qwen3.5-0.8b.json"
SEED = 0


def build(out: Path) -> None:
    import transformers

    cfg = json.loads(CONFIG.read_text())
    fields = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}
    config = transformers.Qwen3_5TextConfig(**fields)
    config.architectures = cfg["architectures"]
    torch.manual_seed(SEED)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # one bf16 copy, never a float32 one
    try:
        model = transformers.Qwen3_5ForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(previous)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(out, safe_serialization=True, max_shard_size="20GB")


def main() -> int:
    sys.path.insert(0, str(Path(__file__).parent))
    from moe_qwen3_a3b import convert

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--llama-cpp", type=Path, required=True, help="folder of llama.cpp's convert_hf_to_gguf.py")
    parser.add_argument("--outtype", default="q8_0")
    args = parser.parse_args()
    hf_dir = args.out / "qwen3.5-0.8b"
    if not (hf_dir / "config.json").is_file():
        build(hf_dir)
    gguf_path = args.out / f"qwen3.5-0.8b.{args.outtype}.gguf"
    convert(hf_dir, gguf_path, args.llama_cpp, args.outtype, extra=("--no-mtp",))
    print(gguf_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
