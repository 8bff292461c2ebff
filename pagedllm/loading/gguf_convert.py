"""Converts a GGUF file once into an HF-style directory in the user cache, so later starts read
plain safetensors in seconds instead of parsing GGUF blocks again.

The directory holds config.json, model.safetensors and the tokenizer (built by transformers from
the GGUF metadata, chat template included). Float tensors are stored as float32. Quantized ones
stay quantized: each supported type (``gguf_quants.SUPPORTED``) is unpacked, every value kept,
into ``<name>.qweight`` / ``<name>.scale`` / ``<name>.zero``, the layout the CPU kernels read
(``layers/quantized.py``); the loader decides whether to run them so or dequantize them. A type
not supported fails the conversion with an error naming it.

Run as ``python -m pagedllm.loading.gguf_convert GGUF OUT`` by ``gguf_cache.converted_dir``,
which decides where the result lives and when to convert.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import numpy as np
import torch

from ..errors import ModelLoadError, UnsupportedModelError
from . import gguf_quants
from .generation_config import GGUF_SAMPLING_KEYS
from .gguf_cache import ERROR_MARK, UNSUPPORTED_EXIT
from .safetensors_io import write_streaming

log = logging.getLogger(__name__)

_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _main(argv: list[str]) -> int:
    try:
        convert(Path(argv[0]), Path(argv[1]))
    except ModelLoadError as e:
        print(f"{ERROR_MARK}{e}", file=sys.stderr)
        return UNSUPPORTED_EXIT if isinstance(e, UnsupportedModelError) else 2
    return 0


def convert(gguf_path: Path, out_dir: Path) -> None:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(gguf_path)
    except Exception as e:  # the gguf package raises bare ValueError/struct/mmap errors
        raise ModelLoadError(
            f"{gguf_path}: not a readable GGUF file: corrupt or truncated ({type(e).__name__}: {e})"
        ) from None
    meta = _metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in _ARCHS:
        raise UnsupportedModelError(
            f"{gguf_path}: GGUF architecture {arch!r} is not supported; supported: {', '.join(sorted(_ARCHS))}"
        )
    tensors = {t.name: t for t in reader.tensors}
    if "rope_freqs.weight" in tensors or meta.get(f"{arch}.rope.scaling.type", "none") not in ("none",):
        raise UnsupportedModelError(f"{gguf_path}: GGUF rope scaling is not supported; load the HF checkpoint instead")
    if "token_embd.weight" not in tensors:
        raise ModelLoadError(f"{gguf_path}: GGUF file has no token_embd.weight tensor")
    config = _hf_config(meta, arch, tie="output.weight" not in tensors, path=gguf_path)
    config["vocab_size"] = int(tensors["token_embd.weight"].shape[1])
    specs: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
    sources = {}
    for name, t in tensors.items():
        hf = _hf_name(name)
        if hf is None:
            raise UnsupportedModelError(f"{gguf_path}: unexpected tensor {name!r} for {arch}")
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        kind = t.tensor_type.name
        if kind in _FLOAT_TYPES:
            specs.append((hf, torch.float32, shape))
        elif kind in gguf_quants.SUPPORTED and len(shape) == 2:
            rows, cols = shape
            bits, group = _QUANT_FORMATS[kind]
            specs.append((f"{hf}{QWEIGHT}", torch.uint8 if bits == 4 else torch.int8, (rows, cols * bits // 8)))
            specs.append((f"{hf}{SCALE}", torch.float32, (rows, cols // group)))
            if kind not in _NO_ZERO:
                specs.append((f"{hf}{ZERO}", torch.float32, (rows, cols // group)))
        else:
            raise UnsupportedModelError(
                f"{gguf_path}: tensor {name!r} is of GGUF type {kind}, which pagedllm does not load; supported: "
                f"{', '.join(sorted(_FLOAT_TYPES | gguf_quants.SUPPORTED))}"
            )
        sources[hf] = t
    permute = arch == "llama"  # llama.cpp's converter permutes q/k rows for its rope layout
    unpacked: dict[str, gguf_quants.QuantizedTensor] = {}  # the one quantized tensor being written

    def produce(spec_name: str) -> torch.Tensor:
        for suffix, field in ((QWEIGHT, "qweight"), (SCALE, "scale"), (ZERO, "zero")):
            if spec_name.endswith(suffix):
                hf_name = spec_name.removesuffix(suffix)
                if hf_name not in unpacked:
                    unpacked.clear()
                    unpacked[hf_name] = _unpack(sources[hf_name], hf_name, config, permute, gguf_path)
                return torch.from_numpy(np.ascontiguousarray(getattr(unpacked[hf_name], field)))
        return _dequantize(sources[spec_name], spec_name, config, permute, gguf_path)

    write_streaming(out_dir / "model.safetensors", specs, produce, {"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    sampling = {hf: meta[key] for key, hf in GGUF_SAMPLING_KEYS.items() if isinstance(meta.get(key), (int, float))}
    if sampling:  # the file's own sampling defaults, read back by generation_config.py
        (out_dir / "generation_config.json").write_text(json.dumps(sampling, indent=2))
    _save_tokenizer(gguf_path, out_dir)


# Suffixes of a quantized weight's tensors in the converted checkpoint (layers/quantized.py reads them).
QWEIGHT, SCALE, ZERO = ".qweight", ".scale", ".zero"
_FLOAT_TYPES = frozenset({"F32", "F16", "BF16"})
_QUANT_FORMATS = {
    "Q4_0": (4, 32),
    "Q4_1": (4, 32),
    "Q4_K": (4, 32),
    "Q8_0": (8, 32),
    "Q5_0": (8, 32),
    "Q5_1": (8, 32),
    "MXFP4": (8, 32),
    "Q5_K": (8, 32),
    "Q6_K": (8, 16),
}
_NO_ZERO = frozenset({"Q8_0", "Q5_0", "MXFP4", "Q6_K"})


def _metadata(reader) -> dict:
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml."):
            continue  # large arrays; the tokenizer converter reads them itself
        try:
            out[key] = field.contents()
        except Exception:
            continue
    return out


def _hf_config(meta: dict, arch: str, tie: bool, path: Path) -> dict:
    def get(name, default=None):
        v = meta.get(f"{arch}.{name}", default)
        if v is None:
            raise ModelLoadError(f"{path}: GGUF metadata lacks {arch}.{name}")
        return v

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    cfg = {
        "architectures": [_ARCHS[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(get("context_length")),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "tie_word_embeddings": tie,
        "torch_dtype": "float32",
    }
    for key, hf in (("tokenizer.ggml.bos_token_id", "bos_token_id"), ("tokenizer.ggml.eos_token_id", "eos_token_id")):
        if key in meta:
            cfg[hf] = int(meta[key])
    return cfg


def _hf_name(name: str) -> str | None:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    if name.startswith("blk."):
        _, layer, rest = name.split(".", 2)
        if rest in _LAYER_NAMES:
            return f"model.layers.{int(layer)}.{_LAYER_NAMES[rest]}"
    return None


def _dequantize(t, hf_name: str, config: dict, permute: bool, path: Path) -> torch.Tensor:
    """A float GGUF tensor as float32, in HF's row order."""
    from gguf import quants

    w = torch.from_numpy(np.array(quants.dequantize(t.data, t.tensor_type), dtype=np.float32))  # a writable copy
    w = w.reshape(tuple(int(d) for d in reversed(t.shape.tolist())))
    order = _rope_row_order(hf_name, w.shape[0], config, permute)
    return w if order is None else w[torch.from_numpy(order)]


def _unpack(t, hf_name: str, config: dict, permute: bool, path: Path) -> gguf_quants.QuantizedTensor:
    """A quantized GGUF tensor in the kernels' layout, every value kept, in HF's row order."""
    rows, cols = (int(d) for d in reversed(t.shape.tolist()))
    try:
        qt = gguf_quants.unpack(t.tensor_type.name, t.data, rows, cols)
    except ValueError as e:
        raise ModelLoadError(f"{path}: tensor {t.name}: {e}") from None
    order = _rope_row_order(hf_name, rows, config, permute)
    return qt if order is None else gguf_quants.permute_rows(qt, order)


def _rope_row_order(hf_name: str, rows: int, config: dict, permute: bool) -> np.ndarray | None:
    """Where each HF q/k row is in llama.cpp's order (it interleaves each head's rotary pairs;
    HF keeps halves); None for every other tensor."""
    if not (permute and hf_name.endswith(("q_proj.weight", "k_proj.weight"))):
        return None
    heads = config["num_attention_heads"] if "q_proj" in hf_name else config["num_key_value_heads"]
    return _unpermute_rope_rows(torch.arange(rows), heads).numpy()


def _unpermute_rope_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order (pairs interleaved per head) back to HF's (halves)."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _save_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as e:
        raise ModelLoadError(f"{gguf_path}: cannot build a tokenizer from its metadata ({e})") from None
    tok.save_pretrained(out_dir)


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
