"""Converts a GGUF file once into an HF-style directory in the user cache, so later starts read
plain safetensors in seconds instead of parsing GGUF blocks again.

The directory holds config.json, model.safetensors and the tokenizer (built by transformers from
the GGUF metadata, chat template included). Float tensors are stored as float32. Quantized ones
stay quantized: each supported type (``gguf_quants.SUPPORTED``) is unpacked, every value kept,
into ``<name>.qweight`` / ``<name>.scale`` / ``<name>.zero``, the layout the CPU kernels read
(``layers/quantized.py``); the loader decides whether to run them so or dequantize them. A type
not supported fails the conversion with an error naming it.

Mixtures of experts are read as llama.cpp's ``convert_hf_to_gguf.py`` writes them: a layer's
experts stacked in one 3-D tensor per projection (``blk.N.ffn_gate_exps.weight``, [experts,
rows, cols] once GGUF's reversed shape is turned round), split here into one 2-D tensor per
expert under the checkpoint's names, each expert's rows of a quantized tensor kept as stored.

Run as ``python -m pagedllm.loading.gguf_convert GGUF OUT`` by ``gguf_cache.converted_dir``,
which decides where the result lives and when to convert.
"""

from __future__ import annotations

import json
import logging
import re
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

_ARCHS = {
    "llama": "LlamaForCausalLM",  # MixtralForCausalLM when it has experts (llama.expert_count > 0)
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
}
_MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "MixtralForCausalLM": "mixtral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "OlmoeForCausalLM": "olmoe",
}
# Whether the chosen experts' router weights are renormalised to sum to 1: llama.cpp fixes it per
# architecture (the norm_w argument of build_moe_ffn in src/models/<arch>.cpp) and reads no key
# for these four; a file that carries {arch}.expert_weights_norm is taken at its word.
_RENORMALISED = {
    "MixtralForCausalLM": True,
    "Qwen3MoeForCausalLM": True,
    "Qwen2MoeForCausalLM": False,
    "OlmoeForCausalLM": False,
}
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
# A sparse layer's tensors -> the checkpoint's names under model.layers.N. (models/decoder.py
# _expert_names): stacked experts take one name per expert ({e}); Qwen2-MoE's shared expert and
# its gate are plain 2-D tensors.
_EXPERT_NAMES = {
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.{e}.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.{e}.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.{e}.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
}
_MIXTRAL_EXPERT_NAMES = {
    "ffn_gate_inp.weight": "block_sparse_moe.gate.weight",
    "ffn_gate_exps.weight": "block_sparse_moe.experts.{e}.w1.weight",
    "ffn_up_exps.weight": "block_sparse_moe.experts.{e}.w3.weight",
    "ffn_down_exps.weight": "block_sparse_moe.experts.{e}.w2.weight",
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
    config = _hf_config(meta, arch, tensors, path=gguf_path)
    config["vocab_size"] = int(tensors["token_embd.weight"].shape[1])
    names = _MIXTRAL_EXPERT_NAMES if config["architectures"] == ["MixtralForCausalLM"] else _EXPERT_NAMES
    specs: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
    sources: dict[str, tuple[object, int | None, tuple[int, ...]]] = {}  # (GGUF tensor, expert, shape)
    for name, t in tensors.items():
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        for hf, expert, part_shape in _hf_parts(name, shape, arch, names, config, gguf_path):
            _add_specs(specs, hf, t.tensor_type.name, part_shape, name, gguf_path)
            sources[hf] = (t, expert, part_shape)
    permute = arch == "llama"  # llama.cpp's converter permutes q/k rows for its rope layout
    unpacked: dict[str, gguf_quants.QuantizedTensor] = {}  # the one quantized tensor being written

    def produce(spec_name: str) -> torch.Tensor:
        for suffix, field in ((QWEIGHT, "qweight"), (SCALE, "scale"), (ZERO, "zero")):
            if spec_name.endswith(suffix):
                hf_name = spec_name.removesuffix(suffix)
                if hf_name not in unpacked:
                    unpacked.clear()
                    unpacked[hf_name] = _unpack(*sources[hf_name], hf_name, config, permute, gguf_path)
                return torch.from_numpy(np.ascontiguousarray(getattr(unpacked[hf_name], field)))
        return _dequantize(*sources[spec_name], spec_name, config, permute)

    write_streaming(out_dir / "model.safetensors", specs, produce, {"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    sampling = {hf: meta[key] for key, hf in GGUF_SAMPLING_KEYS.items() if isinstance(meta.get(key), (int, float))}
    if sampling:  # the file's own sampling defaults, read back by generation_config.py
        (out_dir / "generation_config.json").write_text(json.dumps(sampling, indent=2))
    _save_tokenizer(gguf_path, out_dir, arch)


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


def _hf_config(meta: dict, arch: str, tensors: dict, path: Path) -> dict:
    def get(name, default=None):
        v = meta.get(f"{arch}.{name}", default)
        if v is None:
            raise ModelLoadError(f"{path}: GGUF metadata lacks {arch}.{name}")
        return v

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    hf_arch = _ARCHS[arch]
    if arch == "llama" and int(get("expert_count", 0)) > 0:
        hf_arch = "MixtralForCausalLM"
    cfg = {
        "architectures": [hf_arch],
        "model_type": _MODEL_TYPES[hf_arch],
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(get("context_length")),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "torch_dtype": "float32",
    }
    if hf_arch in _RENORMALISED:
        cfg.update(_moe_config(get, hf_arch, int(get("block_count")), tensors, path, arch))
    for key, hf in (("tokenizer.ggml.bos_token_id", "bos_token_id"), ("tokenizer.ggml.eos_token_id", "eos_token_id")):
        if key in meta:
            cfg[hf] = int(meta[key])
    return cfg


def _moe_config(get, hf_arch: str, layers: int, tensors: dict, path: Path, arch: str) -> dict[str, object]:
    """The HF config fields ``config._moe_from_hf`` reads, from the GGUF keys llama.cpp's
    converter writes and the tensors themselves: a layer with a router (ffn_gate_inp) is sparse,
    one without is a dense MLP of feed_forward_length (Qwen-MoE's mlp_only_layers)."""
    experts, used = int(get("expert_count")), int(get("expert_used_count"))
    gating = get("expert_gating_func", 1)  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
    scale = float(get("expert_weights_scale", 1.0))
    if gating != 1 or scale not in (0.0, 1.0):
        raise UnsupportedModelError(
            f"{path}: {arch} GGUF routes its experts by gating function {gating} scaled by {scale}; "
            "pagedllm reads softmax routing, unscaled"
        )
    sparse = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in tensors]
    dense = [i for i in range(layers) if i not in sparse]
    if not sparse or (dense and hf_arch in ("MixtralForCausalLM", "OlmoeForCausalLM")):
        raise UnsupportedModelError(
            f"{path}: {arch} GGUF with {experts} experts has no router (ffn_gate_inp) in layer(s) "
            f"{', '.join(map(str, dense))}; {hf_arch} has one in every layer"
        )
    normalize = bool(get("expert_weights_norm", _RENORMALISED[hf_arch]))
    if hf_arch == "MixtralForCausalLM":
        if not normalize:
            raise UnsupportedModelError(f"{path}: a Mixtral GGUF whose expert weights are not renormalised")
        return {"num_local_experts": experts, "num_experts_per_tok": used}
    out: dict[str, object] = {"num_experts": experts, "num_experts_per_tok": used, "norm_topk_prob": normalize}
    if hf_arch == "OlmoeForCausalLM":
        return out

    def width(key: str, tensor: str) -> int:
        """A key's value, else the tensor's rows (llama.cpp's converter writes the key)."""
        value = get(key, -1)
        if isinstance(value, list):
            raise UnsupportedModelError(f"{path}: {arch}.{key} differs by layer, which pagedllm does not read")
        if value != -1:
            return int(value)
        t = tensors.get(f"blk.{sparse[0]}.{tensor}")
        return int(t.shape[1]) if t is not None else 0

    out["moe_intermediate_size"] = width("expert_feed_forward_length", "ffn_gate_exps.weight")
    out["decoder_sparse_step"], out["mlp_only_layers"] = 1, dense
    if hf_arch == "Qwen2MoeForCausalLM":
        out["shared_expert_intermediate_size"] = width("expert_shared_feed_forward_length", "ffn_gate_shexp.weight")
    return out


def _hf_name(name: str) -> str | None:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    if name.startswith("blk."):
        _, layer, rest = name.split(".", 2)
        if rest in _LAYER_NAMES:
            return f"model.layers.{int(layer)}.{_LAYER_NAMES[rest]}"
    return None


def _hf_parts(
    name: str, shape: tuple[int, ...], arch: str, expert_names: dict, config: dict, path: Path
) -> list[tuple[str, int | None, tuple[int, ...]]]:
    """The checkpoint tensors one GGUF tensor becomes: (name, the expert it is of a stacked
    tensor or None, shape). A stacked [experts, rows, cols] tensor becomes one [rows, cols]
    tensor per expert, in the order llama.cpp stacked them (expert 0 first)."""
    hf = _hf_name(name)
    if hf is not None:
        return [(hf, None, shape)]
    experts = config.get("num_local_experts") or config.get("num_experts") or 0
    layer, _, rest = name.removeprefix("blk.").partition(".")
    if experts and name.startswith("blk.") and rest in expert_names:
        hf = f"model.layers.{int(layer)}.{expert_names[rest]}"
        if "{e}" not in hf:
            # Qwen2-MoE's shared expert gate: [1, hidden] in the checkpoint, [hidden] in llama.cpp
            return [(hf, None, (1, *shape) if len(shape) == 1 else shape)]
        if len(shape) != 3 or shape[0] != experts:
            raise ModelLoadError(
                f"{path}: tensor {name!r} has shape {list(shape)}, not [{experts} experts, rows, cols]"
            )
        return [(hf.format(e=e), e, shape[1:]) for e in range(experts)]
    if re.fullmatch(r"blk\.\d+\.ffn_(gate|up|down)\.\d+\.weight", name):
        raise UnsupportedModelError(
            f"{path}: {arch} GGUF keeps each expert in a tensor of its own ({name!r}), the layout llama.cpp "
            "wrote before it stacked them; pagedllm reads stacked experts (ffn_gate_exps): convert it again"
        )
    raise UnsupportedModelError(f"{path}: unexpected tensor {name!r} for {arch}")


def _add_specs(specs: list, hf: str, kind: str, shape: tuple[int, ...], gguf_name: str, path: Path) -> None:
    """The checkpoint tensors (name, dtype, shape) ``hf`` is written as: one float32 tensor, or a
    quantized one's qweight, scale and (for types with offsets) zero."""
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
            f"{path}: tensor {gguf_name!r} is of GGUF type {kind}, which pagedllm does not load; supported: "
            f"{', '.join(sorted(_FLOAT_TYPES | gguf_quants.SUPPORTED))}"
        )


def _dequantize(t, expert: int | None, shape: tuple[int, ...], hf_name: str, config: dict, permute: bool):
    """A float GGUF tensor (or one expert of a stacked one) as float32, in HF's row order."""
    from gguf import quants

    data = t.data if expert is None else t.data[expert]  # a view of the memory-mapped file
    w = torch.from_numpy(np.array(quants.dequantize(data, t.tensor_type), dtype=np.float32))  # a writable copy
    w = w.reshape(shape)
    order = _rope_row_order(hf_name, w.shape[0], config, permute)
    return w if order is None else w[torch.from_numpy(order)]


def _unpack(
    t, expert: int | None, shape: tuple[int, ...], hf_name: str, config: dict, permute: bool, path: Path
) -> gguf_quants.QuantizedTensor:
    """A quantized GGUF tensor (or one expert's rows of a stacked one) in the kernels' layout,
    every value kept, in HF's row order."""
    rows, cols = shape
    data = t.data if expert is None else t.data[expert]  # the expert's blocks, as stored
    try:
        qt = gguf_quants.unpack(t.tensor_type.name, data, rows, cols)
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


# Architectures whose GGUF config transformers does not read: AutoTokenizer picks a GGUF's tokenizer
# class from that config, so these are built from the tokenizer metadata alone (the same
# tokenizers-library tokenizer, in transformers' generic class).
_TOKENIZER_WITHOUT_CONFIG = frozenset({"olmoe"})


def _save_tokenizer(gguf_path: Path, out_dir: Path, arch: str) -> None:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    builder = PreTrainedTokenizerFast if arch in _TOKENIZER_WITHOUT_CONFIG else AutoTokenizer
    try:
        tok = builder.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as e:
        raise ModelLoadError(f"{gguf_path}: cannot build a tokenizer from its metadata ({e})") from None
    tok.save_pretrained(out_dir)


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
