"""Converts a GGUF file once into an HF-style directory in the user cache, so later starts read
plain safetensors in seconds instead of parsing GGUF blocks again.

The directory holds config.json, model.safetensors and the tokenizer (built by transformers from
the GGUF metadata, chat template included). Float tensors are stored as float32. Quantized ones
stay quantized: each supported type (``gguf_quants.SUPPORTED``) is unpacked, every value kept,
into ``<name>.qweight`` / ``<name>.scale`` / ``<name>.zero`` (and ``<name>.codes``, the 16 values
of a coded type's codebook), the layout the CPU kernels read (``layers/quantized.py``); a K-quant
(Q2_K to Q6_K) is its blocks as the file has them, ``<name>.qweight`` uint8 [rows, blocks, block
bytes] alone, the block size naming the type (``layers/superblocks.py``); the
loader decides whether to run them so or dequantize them. A type not supported fails the
conversion with an error naming it.

Mixtures of experts are read as llama.cpp's ``convert_hf_to_gguf.py`` writes them: a layer's
experts stacked in one 3-D tensor per projection (``blk.N.ffn_gate_exps.weight``, [experts,
rows, cols] once GGUF's reversed shape is turned round), split here into one 2-D tensor per
expert under the checkpoint's names, each expert's rows of a quantized tensor kept as stored.

Run as ``python -m pagedllm.loading.gguf_convert GGUF OUT`` by ``gguf_cache.converted_dir``,
which decides where the result lives and when to convert.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from ..errors import ModelLoadError, UnsupportedModelError
from ..layers.codebooks import CODEBOOKS
from ..layers.superblocks import SUPERBLOCK, block_bytes
from ..models.family import Experts, Family
from ..models.registry import family_of_gguf
from . import gguf_quants
from .generation_config import GGUF_SAMPLING_KEYS
from .gguf_cache import ERROR_MARK, UNSUPPORTED_EXIT
from .safetensors_io import write_streaming

log = logging.getLogger(__name__)

# llama.cpp's names of a layer's tensors (``blk.N.<name>.weight``) -> their roles, which the
# family's spec names in the checkpoint (``models/family.py``). Stacked experts (``_exps``) hold
# every expert of the layer in one tensor; Qwen2-MoE's shared expert (``_shexp``) is plain 2-D.
_GGUF_ROLES = {
    "attn_norm": "attn_norm",
    "ffn_norm": "mlp_norm",
    "post_attention_norm": "attn_out_norm",
    "post_ffw_norm": "mlp_out_norm",
    "attn_q": "q",
    "attn_k": "k",
    "attn_v": "v",
    "attn_output": "o",
    "attn_q_norm": "q_norm",
    "attn_k_norm": "k_norm",
    "ffn_gate": "gate",
    "ffn_up": "up",
    "ffn_down": "down",
    "ffn_gate_inp": "router",
    "ffn_gate_exps": "expert_gate",
    "ffn_up_exps": "expert_up",
    "ffn_down_exps": "expert_down",
    "ffn_gate_inp_shexp": "shared_gate",
    "ffn_gate_shexp": "shared_expert_gate",
    "ffn_up_shexp": "shared_expert_up",
    "ffn_down_shexp": "shared_expert_down",
    "attn_sinks": "sinks",
    # a Gated DeltaNet layer's (Qwen3.5: ``kinds/gated_deltanet``)
    "attn_qkv": "linear_qkv",
    "attn_gate": "linear_z",
    "ssm_beta": "linear_b",
    "ssm_alpha": "linear_a",
    "ssm_out": "linear_out",
    "ssm_conv1d": "linear_conv",
    "ssm_norm": "linear_norm",
    "ssm_dt": "linear_dt_bias",
    "ssm_a": "linear_A_log",
    # a gated short convolution's (LFM2: ``kinds/short_conv``)
    "shortconv.in_proj": "conv_in",
    "shortconv.out_proj": "conv_out",
    "shortconv.conv": "conv_taps",
}
# Roles whose checkpoint tensor is a parameter of its own, named without ``.weight`` (gpt-oss's
# ``self_attn.sinks``, which llama.cpp names ``attn_sinks.weight``; Qwen3.5's ``linear_attn.A_log``
# and ``dt_bias``, llama.cpp's ``ssm_a`` and ``ssm_dt.bias``; Mamba-2's, and its ``D`` as ``ssm_d``)
_BARE_ROLES = frozenset({"sinks", "linear_dt_bias", "linear_A_log", "mamba_dt_bias", "mamba_A_log", "mamba_D"})
# The norms a family's ``norm_weight_offset`` applies to (its RMSNorms; not a delta rule's gated
# norm, ``linear_norm``, which llama.cpp's converter leaves as it is)
_OFFSET_NORM_ROLES = frozenset({"attn_norm", "mlp_norm", "attn_out_norm", "mlp_out_norm", "q_norm", "k_norm"})
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
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
    arch = str(meta.get("general.architecture"))
    tensors = {t.name: t for t in reader.tensors}
    family = family_of_gguf(arch, int(meta.get(f"{arch}.expert_count") or 0) > 0, str(gguf_path))
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if "rope_freqs.weight" in tensors or scaling not in ("none", *family.gguf_rope_scalings):
        raise UnsupportedModelError(f"{gguf_path}: GGUF rope scaling is not supported; load the HF checkpoint instead")
    if "token_embd.weight" not in tensors:
        raise ModelLoadError(f"{gguf_path}: GGUF file has no token_embd.weight tensor")
    config = _hf_config(meta, arch, family, tensors, path=gguf_path)
    config["vocab_size"] = int(tensors["token_embd.weight"].shape[1])
    plan = _TensorPlan.of(tensors, family, config, arch, gguf_path)
    specs, sources, undo, offset_norms = plan.specs, plan.sources, plan.undo, plan.offset_norms
    permute = family.gguf_permuted_qk
    unpacked: dict[str, gguf_quants.QuantizedTensor] = {}  # the one quantized tensor being written

    offset = family.norm_weight_offset

    def produce(spec_name: str) -> torch.Tensor:
        for suffix, field in ((QWEIGHT, "qweight"), (SCALE, "scale"), (ZERO, "zero"), (CODES, "codebook")):
            if spec_name.endswith(suffix):
                hf_name = spec_name.removesuffix(suffix)
                if hf_name not in unpacked:
                    unpacked.clear()
                    unpacked[hf_name] = _unpack(*sources[hf_name], hf_name, config, permute, gguf_path)
                value = getattr(unpacked[hf_name], field)
                if field == "codebook":
                    value = np.array(CODEBOOKS[value], dtype=np.int8)
                return torch.from_numpy(np.ascontiguousarray(value))
        if spec_name in undo:
            function, stored_shape = undo[spec_name]
            t, expert, _ = sources[spec_name]
            return function(_dequantize(t, expert, stored_shape, spec_name, config, permute))
        w = _dequantize(*sources[spec_name], spec_name, config, permute)
        # Gemma, Qwen3.5: llama.cpp stores each norm's (1 + weight); the checkpoint holds the weight
        return w - offset if offset and spec_name in offset_norms else w

    write_streaming(out_dir / "model.safetensors", specs, produce, {"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    sampling = {hf: meta[key] for key, hf in GGUF_SAMPLING_KEYS.items() if isinstance(meta.get(key), (int, float))}
    if sampling:  # the file's own sampling defaults, read back by generation_config.py
        (out_dir / "generation_config.json").write_text(json.dumps(sampling, indent=2))
    _save_tokenizer(gguf_path, out_dir, family)


@dataclasses.dataclass
class _TensorPlan:
    """What the converted checkpoint holds and where each tensor comes from."""

    # (name, dtype, shape) of each tensor written; where each comes from (GGUF tensor, expert, shape)
    specs: list[tuple[str, torch.dtype, tuple[int, ...]]] = dataclasses.field(default_factory=list)
    sources: dict[str, tuple[object, int | None, tuple[int, ...]]] = dataclasses.field(default_factory=dict)
    # checkpoint name -> Family.gguf_undo's function and the tensor's shape in the file
    undo: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], tuple[int, ...]]] = dataclasses.field(
        default_factory=dict
    )
    # the norms the family's norm offset applies to
    offset_norms: set[str] = dataclasses.field(default_factory=lambda: {"model.norm.weight"})

    @classmethod
    def of(cls, tensors: dict, family: Family, config: dict, arch: str, path: Path) -> _TensorPlan:
        plan, layers, skipped = cls(), config["num_hidden_layers"], []
        for name, t in tensors.items():
            if name in family.gguf_config_tensors:  # read into config.json
                continue
            if name.startswith("blk.") and int(name.split(".")[1]) >= layers:  # a multi-token-prediction layer
                skipped.append(name)
                continue
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            for hf, expert, part_shape, role in _hf_parts(name, shape, arch, family, config, path):
                if role in family.gguf_undo and not hf.endswith(".bias"):
                    if t.tensor_type.name not in _FLOAT_TYPES:
                        raise UnsupportedModelError(f"{path}: tensor {name!r} is quantized ({t.tensor_type.name})")
                    plan.undo[hf] = (family.gguf_undo[role], part_shape)
                    part_shape = tuple(family.gguf_undo[role](torch.empty(part_shape, device="meta")).shape)
                if role in _OFFSET_NORM_ROLES:
                    plan.offset_norms.add(hf)
                _add_specs(plan.specs, hf, t.tensor_type.name, part_shape, name, path)
                plan.sources[hf] = (t, expert, part_shape)
        if skipped:
            log.info("%s: %d tensors of its multi-token-prediction layers skipped (not run yet)", path, len(skipped))
        return plan


# Suffixes of a quantized weight's tensors in the converted checkpoint (layers/quantized.py reads
# them): codes are the int8 [16] values of 4-bit codes, where the type has a codebook.
QWEIGHT, SCALE, ZERO, CODES = ".qweight", ".scale", ".zero", ".codes"
QUANTIZED_FIELDS = (QWEIGHT, SCALE, ZERO, CODES)
_FLOAT_TYPES = frozenset({"F32", "F16", "BF16"})
_QUANT_FORMATS = {
    "Q4_0": (4, 32),
    "Q4_1": (4, 32),
    "Q8_0": (8, 32),
    "Q5_0": (5, 32),
    "Q5_1": (5, 32),
    "MXFP4": (4, 32),
    "IQ4_NL": (4, 32),
}
_NO_ZERO = frozenset({"Q4_0", "Q8_0", "Q5_0", "MXFP4", "IQ4_NL"})
_CODED = frozenset({"Q4_0", "Q5_0", "MXFP4", "IQ4_NL"})


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


def _hf_config(meta: dict, arch: str, family: Family, tensors: dict, path: Path) -> dict:
    def get(name, default=None):
        v = meta.get(f"{arch}.{name}", default)
        if v is None:
            raise ModelLoadError(f"{path}: GGUF metadata lacks {arch}.{name}")
        return v

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    # llama.cpp counts a multi-token-prediction head's layers as blocks after the model's
    layers = int(get("block_count")) - int(get("nextn_predict_layers", 0))
    cfg = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        # a list where layers differ (LFM2's: 0 for each convolution layer), the attention layers' then
        "num_key_value_heads": max(_as_list(get("attention.head_count_kv", heads))),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(get("context_length")),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "torch_dtype": "float32",
    }
    if family.gguf_config is not None:

        def tensor(name: str) -> list[float] | None:
            return [float(v) for v in np.asarray(tensors[name].data).ravel()] if name in tensors else None

        cfg.update(family.gguf_config(get, tensor))
    if family.experts is not None:
        cfg.update(_moe_config(get, family, family.experts, layers, tensors, path, arch))
    for key, hf in (("tokenizer.ggml.bos_token_id", "bos_token_id"), ("tokenizer.ggml.eos_token_id", "eos_token_id")):
        if key in meta:
            cfg[hf] = int(meta[key])
    return cfg


def _as_list(value) -> list[int]:
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _moe_config(
    get, family: Family, spec: Experts, layers: int, tensors: dict, path: Path, arch: str
) -> dict[str, object]:
    """The HF config fields ``config._moe_from_hf`` reads, from the GGUF keys llama.cpp's
    converter writes and the tensors themselves: a layer with a router (ffn_gate_inp) is sparse,
    one without is a dense MLP of feed_forward_length (Qwen-MoE's mlp_only_layers)."""
    if spec.optional and not int(get("expert_count", 0)):  # Granite-4.0-H-Micro: no experts, a dense model
        return {spec.count_key: 0}
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
    if not sparse or (dense and spec.every_layer):
        raise UnsupportedModelError(
            f"{path}: {arch} GGUF with {experts} experts has no router (ffn_gate_inp) in layer(s) "
            f"{', '.join(map(str, dense))}; {family.architecture} has one in every layer"
        )
    normalize = bool(get("expert_weights_norm", spec.gguf_renormalised))
    if spec.always_renormalise and not normalize:
        raise UnsupportedModelError(f"{path}: a {family.architecture} GGUF whose expert weights are not renormalised")
    out: dict[str, object] = {spec.count_key: experts, "num_experts_per_tok": used, "norm_topk_prob": normalize}
    if spec.every_layer:
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
    if spec.shared_expert:
        out["shared_expert_intermediate_size"] = width("expert_shared_feed_forward_length", "ffn_gate_shexp.weight")
    return out


def _hf_parts(
    name: str, shape: tuple[int, ...], arch: str, family: Family, config: dict, path: Path
) -> list[tuple[str, int | None, tuple[int, ...], str | None]]:
    """The checkpoint tensors one GGUF tensor becomes: (name, the expert it is of a stacked
    tensor or None, shape, its role). A stacked [experts, rows, cols] tensor becomes one [rows,
    cols] tensor per expert, in the order llama.cpp stacked them (expert 0 first), and a stacked
    bias [experts, rows] one [rows] per expert (gpt-oss). A name without a leaf (``ssm_a``) is a
    bare parameter's."""
    if name == f"{family.gguf_final_norm}.weight":
        return [(family.checkpoint_name("model.norm.weight"), None, shape, None)]
    if name in _GLOBAL_NAMES:
        return [(family.checkpoint_name(_GLOBAL_NAMES[name]), None, shape, None)]
    layer, _, rest = name.removeprefix("blk.").partition(".")
    gguf_role, _, leaf = rest.rpartition(".") if "." in rest else (rest, "", "")
    if name.startswith("blk.") and gguf_role in family.gguf_fused:  # split on loading (Family.unfuse)
        return [(f"model.layers.{int(layer)}.{family.gguf_fused[gguf_role]}.{leaf}", None, shape, None)]
    role = family.gguf_roles.get(gguf_role, _GGUF_ROLES.get(gguf_role))
    known_leaf = leaf in ("weight", "bias") or (leaf == "" and role in _BARE_ROLES)
    if not name.startswith("blk.") or role is None or role not in family.layer_names or not known_leaf:
        if re.fullmatch(r"blk\.\d+\.ffn_(gate|up|down)\.\d+\.weight", name):
            raise UnsupportedModelError(
                f"{path}: {arch} GGUF keeps each expert in a tensor of its own ({name!r}), the layout llama.cpp "
                "wrote before it stacked them; pagedllm reads stacked experts (ffn_gate_exps): convert it again"
            )
        raise UnsupportedModelError(f"{path}: unexpected tensor {name!r} for {arch}")
    if not role.startswith("expert_"):
        hf = family.checkpoint_name(family.name_of(role, int(layer)) + ("" if role in _BARE_ROLES else f".{leaf}"))
        if role == "shared_gate" and len(shape) == 1:  # [1, hidden] in the checkpoint, [hidden] in llama.cpp
            shape = (1, *shape)
        return [(hf, None, shape, role)]
    experts = int(config.get(family.experts.count_key, 0)) if family.experts is not None else 0
    dims = 2 if leaf == "bias" else 3  # gpt-oss's expert biases: [experts, rows]
    if len(shape) != dims or shape[0] != experts:
        wanted = "rows" if leaf == "bias" else "rows, cols"
        raise ModelLoadError(f"{path}: tensor {name!r} has shape {list(shape)}, not [{experts} experts, {wanted}]")
    return [(f"{family.name_of(role, int(layer), e)}.{leaf}", e, shape[1:], role) for e in range(experts)]


def _add_specs(specs: list, hf: str, kind: str, shape: tuple[int, ...], gguf_name: str, path: Path) -> None:
    """The checkpoint tensors (name, dtype, shape) ``hf`` is written as: one float32 tensor, or a
    quantized one's qweight, scale and (for types with offsets) zero."""
    if kind in _FLOAT_TYPES:
        specs.append((hf, torch.float32, shape))
    elif kind in gguf_quants.KEPT_AS_STORED and len(shape) == 2:  # the blocks, byte for byte: [rows, blocks, bytes]
        rows, cols = shape
        specs.append((f"{hf}{QWEIGHT}", torch.uint8, (rows, cols // SUPERBLOCK, block_bytes(kind))))
    elif kind in gguf_quants.SUPPORTED and len(shape) == 2:
        rows, cols = shape
        bits, group = _QUANT_FORMATS[kind]
        qbytes = cols // 32 * 20 if bits == 5 else cols * bits // 8  # 5-bit: a Q5 block's qh and qs per 32
        specs.append((f"{hf}{QWEIGHT}", torch.int8 if bits == 8 else torch.uint8, (rows, qbytes)))
        scale_dtype = torch.float32
        if kind in gguf_quants.FLOAT16_SCALES:
            scale_dtype = torch.float16
        elif kind in gguf_quants.E8M0_SCALES:
            scale_dtype = torch.uint8
        specs.append((f"{hf}{SCALE}", scale_dtype, (rows, cols // group)))
        if kind not in _NO_ZERO:
            specs.append((f"{hf}{ZERO}", scale_dtype, (rows, cols // group)))
        if kind in _CODED:
            specs.append((f"{hf}{CODES}", torch.int8, (32 if bits == 5 else 16,)))
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


def _save_tokenizer(gguf_path: Path, out_dir: Path, family: Family) -> None:
    """The tokenizer transformers builds from the file's metadata. AutoTokenizer picks its class
    from the GGUF's config, which transformers reads for some architectures only; the others
    are built from the tokenizer metadata alone (the same tokenizers-library tokenizer, in
    transformers' generic class)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    builder = AutoTokenizer if family.transformers_reads_gguf else PreTrainedTokenizerFast
    try:
        tok = builder.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as e:
        raise ModelLoadError(f"{gguf_path}: cannot build a tokenizer from its metadata ({e})") from None
    tok.save_pretrained(out_dir)


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
