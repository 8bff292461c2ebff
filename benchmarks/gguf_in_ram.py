"""What a GGUF file's weights cost in pagedllm's RAM against the file (issue 65): per GGUF type,
the file's tensor bytes and the bytes the loaded model holds for them, and the whole model's
ratio; then, with ``--llama-python``, llama.cpp's figures for one request on the same file.

    python benchmarks/gguf_in_ram.py FILE.gguf

The file's bytes are its tensors' (``GGUFReader``'s ``n_bytes``: the metadata and the padding
between tensors aside). pagedllm's are what the converted checkpoint holds for each tensor
(``QuantizedWeight.nbytes``, a float tensor at ``--dtype``), which is what the planner counts
(``checkpoint_weights``) and what the loaded model reports (``weight_bytes``); both are printed.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch
from gguf import GGUFReader

from pagedllm.loading.checkpoint import checkpoint_weights, load_decoder
from pagedllm.loading.gguf_cache import converted_dir


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("gguf", type=Path)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    file_bytes: dict[str, int] = defaultdict(int)
    for t in GGUFReader(args.gguf).tensors:
        file_bytes[t.tensor_type.name] += int(t.n_bytes)
    model_dir = converted_dir(args.gguf)
    planned, _ = checkpoint_weights(model_dir, args.dtype, None)
    model = load_decoder(model_dir, dtype, None)
    held = model.weight_bytes()
    total = sum(file_bytes.values())
    print("| GGUF type | file's bytes | share |")
    print("|---|---:|---:|")
    for kind, n in sorted(file_bytes.items(), key=lambda kv: -kv[1]):
        print(f"| {kind} | {n:,} | {n / total:.1%} |")
    print(f"\nfile's tensors {total:,} B; pagedllm holds {held:,} B ({held / total:.3f}x), plans {planned:,} B")
    print(json.dumps({"file_tensor_bytes": total, "held_bytes": held, "planned_bytes": planned, "ratio": held / total}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
