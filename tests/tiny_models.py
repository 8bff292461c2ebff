"""Tiny, randomly initialised checkpoints of each supported architecture, built in the test run.

Weights are drawn with a larger spread than a real init so that the logits are peaked and greedy
decoding rarely meets a near-tie; the maths under test is the same.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
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
    # sliding and full layers with rope bases of their own, the window shorter than a cache block
    # (8) and than the prompts; linear rope scaling on the full layers only. Untied: tied, the
    # scaled embeddings make a random model repeat its last token (the tied head is pinned by
    # the GGUF copies, tied as Google's are: test_gguf_families.py)
    "gemma3": (
        "Gemma3TextConfig",
        dict(
            tie_word_embeddings=False,
            head_dim=16,
            sliding_window=6,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            query_pre_attn_scalar=24,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        ),
    ),
    "smollm3": ("SmolLM3Config", dict(no_rope_layers=[1, 0, 1], tie_word_embeddings=True)),
    # q/k/v and gate/up fused in the checkpoint; LongRoPE (the short factors within the original
    # context), a sliding window on every layer
    "phi3": (
        "Phi3Config",
        dict(
            sliding_window=20,
            original_max_position_embeddings=128,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0 + 0.25 * i for i in range(8)],
                "long_factor": [2.0 + i for i in range(8)],
            },
        ),
    ),
}
# Each expert is a shared matrix plus its own N(0, EXPERT_SPREAD) part: every expert differs from
# every other by far more than fp32 rounding (a wrong expert or a dropped router weight moves
# the logits by 1000x the fp32 tolerance), yet a token whose top experts nearly tie (bf16 rounds
# the hidden states, then the router picks the other) changes its output by about as little as
# bf16 rounding does in a dense layer.
EXPERT_SPREAD = 0.05
# Mixtures of experts: more experts than a step's tokens choose, so some go unused; a dense layer
# among the sparse ones (Qwen3-MoE's mlp_only_layers, Qwen2-MoE's decoder_sparse_step).
MOE_ARCHS = {
    "qwen3-moe": (
        "Qwen3MoeConfig",
        dict(
            head_dim=32,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            norm_topk_prob=True,
            mlp_only_layers=[1],
            tie_word_embeddings=False,
        ),
    ),
    "mixtral": ("MixtralConfig", dict(num_local_experts=6, num_experts_per_tok=2, intermediate_size=96)),
    "olmoe": (
        "OlmoeConfig",
        dict(num_experts=8, num_experts_per_tok=3, intermediate_size=64, norm_topk_prob=False, clip_qkv=None),
    ),
    "qwen2-moe": (
        "Qwen2MoeConfig",
        dict(
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=96,
            decoder_sparse_step=2,
            norm_topk_prob=False,
        ),
    ),
    # attention sinks, sliding and full layers alternating (a window shorter than the prompts),
    # YaRN rope, a biased router softmaxed over its top-k, biased clamped-SwiGLU experts
    "gpt-oss": (
        "GptOssConfig",
        dict(
            head_dim=16,
            num_local_experts=6,
            num_experts_per_tok=2,
            intermediate_size=64,
            sliding_window=8,
            swiglu_limit=1.0,  # well inside the activations' spread, so the clamps act (the real: 7)
            attention_bias=True,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 128,
            },
        ),
    ),
}
ARCHS.update(MOE_ARCHS)
# Layers that keep a state per sequence beside attention layers (``kinds/gated_deltanet``): built
# like the others, tested on their own (test_hybrid_models.py), since a step of theirs needs
# state slots the other architectures' tests do not give. Qwen3.5: three Gated DeltaNet layers to
# one gated full-attention layer with a quarter of each head rotated; two value heads per key head.
QWEN3_5 = dict(
    head_dim=32,
    num_hidden_layers=4,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    tie_word_embeddings=False,
)
GRANITE_H = dict(
    num_hidden_layers=4,
    layer_types=["mamba", "mamba", "attention", "mamba"],
    mamba_n_heads=8,
    mamba_d_head=16,
    mamba_d_state=16,
    mamba_n_groups=2,
    mamba_d_conv=4,
    mamba_expand=2,
    mamba_chunk_size=16,
    num_local_experts=6,
    num_experts_per_tok=2,
    intermediate_size=64,
    shared_intermediate_size=96,
    embedding_multiplier=4.0,
    residual_multiplier=0.5,
    attention_multiplier=0.1,
    logits_scaling=2.0,
    position_embedding_type="nope",
    tie_word_embeddings=True,
)
HYBRID_ARCHS = {
    "qwen3_5": ("Qwen3_5TextConfig", QWEN3_5),
    # LFM2: short convolutions (3 taps, biased here) and attention layers; its MLP width derived
    "lfm2": (
        "Lfm2Config",
        dict(
            num_hidden_layers=4,
            layer_types=["conv", "full_attention", "conv", "conv"],
            conv_L_cache=3,
            conv_bias=True,
            intermediate_size=240,
            block_multiple_of=32,
            block_ffn_dim_multiplier=1.0,
            block_auto_adjust_ff_dim=True,
            norm_eps=1e-5,
            tie_word_embeddings=True,
        ),
    ),
    # Qwen3-Next: Qwen3.5's mixture, its checkpoint fusing q/k/v/z and b/a per key head; one dense layer
    "qwen3-next": (
        "Qwen3NextConfig",
        dict(
            QWEN3_5,
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=96,
            mlp_only_layers=[1],
        ),
    ),
    # Granite-4.0-H: Mamba-2 layers (two groups of B and C, a biased convolution) and one attention
    # layer without positions, every layer a mixture (softmax over the top-k logits) plus an
    # ungated shared expert, Granite's four multipliers; "granite-h-dense": no experts (-H-Micro)
    "granite-h": ("GraniteMoeHybridConfig", GRANITE_H),
    "granite-h-dense": ("GraniteMoeHybridConfig", dict(GRANITE_H, num_local_experts=0)),
    # and Qwen3.5's mixture: every layer sparse, the top-k renormalised, a sigmoid-gated shared expert
    "qwen3_5-moe": (
        "Qwen3_5MoeTextConfig",
        dict(
            QWEN3_5, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=96
        ),
    ),
}


def build_hf_model(name: str, seed: int = 0, **overrides):
    """``overrides``: config fields over the architecture's (another vocabulary, KV heads...)."""
    import transformers

    class_name, extra = {**ARCHS, **HYBRID_ARCHS}[name]
    config = getattr(transformers, class_name)(**{**COMMON, **extra, **overrides})
    config._attn_implementation = "eager"  # the plainest formulation as the oracle
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for p_name, p in model.named_parameters():
            if p_name.endswith(
                ("mlp.gate.weight", "block_sparse_moe.gate.weight", "mlp.router.weight", "router.layer.weight")
            ):
                p.normal_(0.0, 0.35)  # a router: wide margins between experts, so rounding picks the same
            elif p_name.endswith("self_attn.sinks"):
                p.normal_(0.0, 1.0)  # gpt-oss: each head's sink takes a share of its attention
            elif p.dim() == 3:  # experts stacked: one shared matrix and each expert's own part
                p.copy_(torch.randn(p.shape[1:]) * 0.15 + torch.randn(p.shape) * EXPERT_SPREAD)
            elif p.dim() == 2:
                p.normal_(0.0, 0.15)
            elif "bias" in p_name:
                p.normal_(0.0, 0.1)
            elif p_name.endswith(("A_log", "dt_bias", "linear_attn.norm.weight")):
                continue  # a delta rule's decay rates and its gated norm's scale: transformers' own init
            elif model.config.model_type.startswith(
                ("gemma", "qwen3_5", "qwen3_next")
            ):  # norms multiply by (1 + weight)
                p.uniform_(-0.2, 0.2)
            else:  # norm weights
                p.uniform_(0.8, 1.2)
    return model.eval()


def save_tiny_model(name: str, directory: Path, seed: int = 0, **overrides):
    model = build_hf_model(name, seed, **overrides)
    model.save_pretrained(directory, safe_serialization=True)
    return model


def _byte_level_vocab(size: int) -> tuple[list[str], list[str]]:
    """A GPT-2-style byte-level vocabulary of ``size`` tokens: the 256 bytes, then merges of
    letter pairs (each merge's result is a token, as a BPE tokenizer requires)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, n = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + n)
            n += 1
    tokens = [chars[b] for b in range(256)]
    letters = "etaoinshrdlucmfw"
    merges = []
    for a in letters:
        for b in letters:
            if len(tokens) == size:
                return tokens, merges
            merges.append(f"{a} {b}")
            tokens.append(a + b)
    return tokens, merges


# GGUF architecture of each tiny model save_tiny_gguf writes (Mixtral is llama.cpp's "llama").
GGUF_ARCHS = {
    "qwen2": "QWEN2",
    "qwen3": "QWEN3",
    "qwen2-moe": "QWEN2MOE",
    "qwen3-moe": "QWEN3MOE",
    "olmoe": "OLMOE",
    "mixtral": "LLAMA",
    "gemma3": "GEMMA3",
    "smollm3": "SMOLLM3",
    "phi3": "PHI3",
    "gpt-oss": "GPT_OSS",
}
# What llama.cpp assumes of a gemma3 file and its metadata does not say (one full layer in six,
# the sliding layers' rope base 10k, scores scaled by 1/sqrt(head_dim)): a tiny Gemma 3 written
# as GGUF is built so (``save_tiny_gguf``), six layers, the full one last.
GGUF_OVERRIDES = {
    "gemma3": dict(
        num_hidden_layers=6,
        layer_types=None,
        query_pre_attn_scalar=16,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    ),
    # llama.cpp's smollm3: every fourth layer without positions
    "smollm3": dict(num_hidden_layers=4, no_rope_layers=None),
    # llama.cpp's gpt-oss: its clamp and alpha (7, 1.702), the sliding layers first (the tiny
    # model's own order); save_tiny_gguf scales the experts' input up so that the clamp acts
    "gpt-oss": dict(swiglu_limit=7.0),
}
GPT_OSS_GGUF_MLP_INPUT_SCALE = 8.0


def save_tiny_gguf(name: str, path: Path, seed: int = 0, experts: str = "F32", weights: str = "F32", **overrides):
    """A tiny model of ``name`` (a key of GGUF_ARCHS) as a GGUF file, named and laid out the way
    llama.cpp's converter writes that architecture, with a byte-level BPE tokenizer; returns the
    transformers model, holding the values the file does.

    The gguf package's tensor name map names each tensor; llama-arch q/k rows are permuted as
    llama.cpp's converter permutes them (its rope pairs interleaved per head). A mixture of
    experts' stacked experts are its 3-D ffn_{gate,up,down}_exps tensors (transformers' fused
    gate_up_proj split in two), quantized to ``experts`` ("Q8_0": with ``gguf.quants.quantize``;
    the transformers model then holds the values ``gguf.quants.dequantize`` gives back), its
    router float32 as llama.cpp keeps it, and its keys llama.cpp's: expert_count,
    expert_used_count, expert_feed_forward_length and expert_shared_feed_forward_length (Qwen).
    ``weights``: the type of every layer's 2-D weight (its attention's and MLP's), so too.
    Phi-3 is written as llama.cpp's phi3: q/k/v and gate/up fused as the checkpoint fuses them,
    the LongRoPE factors as two tensors, the original context and the window in its metadata.
    Two liberties: a dense layer of a Qwen mixture (mlp_only_layers) is written under the dense
    names (ffn_gate/up/down), which llama.cpp's qwen2moe/qwen3moe maps lack (its converter
    refuses such a model); OLMoE's eps is the model's, where llama.cpp writes 1e-5."""
    import gguf

    model = build_hf_model(name, seed, **{**GGUF_OVERRIDES.get(name, {}), **overrides})
    cfg = model.config
    if name == "gpt-oss":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.post_attention_layernorm.weight.mul_(GPT_OSS_GGUF_MLP_INPUT_SCALE)
    arch = getattr(gguf.MODEL_ARCH, GGUF_ARCHS[name])
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    dense_names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    writer = _gguf_writer(path, arch, cfg)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    if getattr(cfg, "sliding_window", None) and name in ("gemma3", "phi3", "gpt-oss"):
        writer.add_sliding_window(cfg.sliding_window)
    if rope.get("rope_type") == "yarn":  # as llama.cpp's converter writes it
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    if name == "phi3":
        writer.add_rope_dimension_count(head_dim)
        if rope.get("long_factor"):
            writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
            writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
            writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    moe = name in MOE_ARCHS
    if moe:
        writer.add_expert_count(getattr(cfg, "num_local_experts", None) or cfg.num_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        if getattr(cfg, "moe_intermediate_size", None) or name == "gpt-oss":
            writer.add_expert_feed_forward_length(getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size)
        if getattr(cfg, "shared_expert_intermediate_size", None):
            writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    _add_byte_level_tokenizer(writer, cfg.vocab_size, name if not moe else "qwen2")
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        base, _, suffix = hf_name.rpartition(".")
        if suffix in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias") and base.endswith(
            "mlp.experts"
        ):
            layer = int(hf_name.split(".")[2])
            parts = _stacked_experts(name, suffix, tensor)
            for kind, stacked in parts.items():
                leaf = "bias" if suffix.endswith("_bias") else "weight"
                gguf_name = gguf.TENSOR_NAMES[getattr(gguf.MODEL_TENSOR, kind)].format(bid=layer) + "." + leaf
                values = np.ascontiguousarray(stacked.to(torch.float32).numpy())
                if leaf == "bias":  # llama.cpp keeps them float32
                    writer.add_tensor(gguf_name, values)
                    continue
                if experts != "F32":
                    quant = gguf.GGMLQuantizationType[experts]
                    blocks = gguf.quants.quantize(values, quant)
                    writer.add_tensor(gguf_name, blocks, raw_dtype=quant)
                    with torch.no_grad():  # transformers runs on what the file holds
                        stacked.copy_(torch.from_numpy(gguf.quants.dequantize(blocks, quant)))
                else:
                    writer.add_tensor(gguf_name, values)
            continue
        if suffix == "sinks":  # gpt-oss: a parameter of its own, attn_sinks.weight to llama.cpp
            base, suffix = hf_name, "weight"
        gguf_base = names.get_name(base) or dense_names.get_name(base)
        values = tensor.to(torch.float32).numpy()
        if weights != "F32" and base.startswith("model.layers.") and values.ndim == 2:
            quant = gguf.GGMLQuantizationType[weights]
            blocks = gguf.quants.quantize(values, quant)
            writer.add_tensor(f"{gguf_base}.{suffix}", blocks, raw_dtype=quant)
            with torch.no_grad():  # transformers runs on what the file holds
                tensor.copy_(torch.from_numpy(gguf.quants.dequantize(blocks, quant)))
            continue
        if name == "gemma3" and suffix == "weight" and base.endswith("norm"):
            values = values + 1  # llama.cpp's converter stores Gemma's (1 + weight)
        if arch in (gguf.MODEL_ARCH.LLAMA, gguf.MODEL_ARCH.SMOLLM3) and base.endswith(("q_proj", "k_proj")):
            heads = cfg.num_attention_heads if base.endswith("q_proj") else cfg.num_key_value_heads
            values = _llama_cpp_rope_rows(values, heads)
        writer.add_tensor(f"{gguf_base}.{suffix}", values)
    _finish(writer)
    return model


def _stacked_experts(name: str, suffix: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """A layer's fused expert tensor as llama.cpp's stacked ones ([experts, rows, cols], biases
    [experts, rows]), by gguf tensor kind. Views of ``tensor``: a copy into one reaches it.
    transformers keeps gate and up in halves of gate_up_proj [experts, 2 x width, hidden], and
    gpt-oss in alternate columns of [experts, hidden, 2 x width] with down [experts, width, hidden]."""
    if name != "gpt-oss":
        width = tensor.shape[1] // 2
        if suffix == "gate_up_proj":
            return {"FFN_GATE_EXP": tensor[:, :width], "FFN_UP_EXP": tensor[:, width:]}
        return {"FFN_DOWN_EXP": tensor}
    if suffix == "gate_up_proj":
        return {"FFN_GATE_EXP": tensor[:, :, 0::2].transpose(1, 2), "FFN_UP_EXP": tensor[:, :, 1::2].transpose(1, 2)}
    if suffix == "gate_up_proj_bias":
        return {"FFN_GATE_EXP": tensor[:, 0::2], "FFN_UP_EXP": tensor[:, 1::2]}
    if suffix == "down_proj":
        return {"FFN_DOWN_EXP": tensor.transpose(1, 2)}
    return {"FFN_DOWN_EXP": tensor}


def _llama_cpp_rope_rows(w, heads: int):
    """q/k rows in the order llama.cpp's converter writes them for llama: within each head, the
    first and second halves (HF's rotary pairs) interleaved."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def save_tiny_qwen35_gguf(name: str, path: Path, weights: str = "F32", seed: int = 0, **overrides):
    """A tiny Qwen3.5 (``name``: "qwen3_5" or "qwen3_5-moe") as llama.cpp's converter writes it
    (``qwen35``/``qwen35moe``; checked against its convert_hf_to_gguf.py of llama-cpp-python
    0.3.36): A_log stored as -exp(A_log), dt_bias as ``ssm_dt.bias``, the convolution [channels,
    taps], every norm but the delta rule's gated one plus one, and, with more value heads than
    key heads, the value heads regrouped so that value head j is key head j mod key_heads's (the
    rows of v in q/k/v, of z, b and a, A_log and dt_bias, the convolution's v channels, and the
    columns of out_proj). ``weights``: the type of the layers' 2-D projections. Returns the
    transformers model, holding the values the file does.

    Or Qwen3-Next ("qwen3-next", ``qwen3next``; every layer sparse, as that converter requires):
    the value heads as the checkpoint has them, its fused q/k/v/z written apart as ``attn_qkv``
    and ``attn_gate`` (``_qkvz_apart``), its fused b/a as it is (``ssm_ba``)."""
    import gguf

    next_ = name == "qwen3-next"
    model = build_hf_model(name, seed, **({"mlp_only_layers": []} if next_ else {}), **overrides)
    cfg = model.config
    moe = name.endswith("-moe") or next_
    arch = gguf.MODEL_ARCH.QWEN3NEXT if next_ else gguf.MODEL_ARCH.QWEN35MOE if moe else gguf.MODEL_ARCH.QWEN35
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    writer = _gguf_writer(path, arch, cfg)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
    writer.add_ssm_state_size(cfg.linear_key_head_dim)
    writer.add_ssm_group_count(cfg.linear_num_key_heads)
    writer.add_ssm_time_step_rank(cfg.linear_num_value_heads)
    writer.add_ssm_inner_size(cfg.linear_value_head_dim * cfg.linear_num_value_heads)
    # the gguf package on PyPI (0.19) has no add_recurrent_layers yet: the key llama.cpp writes
    writer.add_array(f"{writer.arch}.attention.recurrent_layers", [t == "linear_attention" for t in cfg.layer_types])
    writer.add_full_attention_interval(4)
    writer.add_rope_dimension_count(int(cfg.head_dim * cfg.rope_parameters["partial_rotary_factor"]))
    if not next_:
        writer.add_rope_dimension_sections([11, 11, 10, 0])
    if moe:
        writer.add_expert_count(cfg.num_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    _add_byte_level_tokenizer(writer, cfg.vocab_size, "qwen2")
    keys, width = cfg.linear_num_key_heads * cfg.linear_key_head_dim, cfg.linear_value_head_dim

    def regroup(base: str, t: torch.Tensor, tiled: bool) -> torch.Tensor:
        """A delta-rule tensor's value heads tiled (as the file has them) or grouped back."""
        if next_:  # (Qwen3-Next's converter keeps the checkpoint's order)
            return t
        move = functools.partial(_value_heads, key_heads=cfg.linear_num_key_heads, heads=cfg.linear_num_value_heads)
        if base.endswith(("in_proj_qkv", "conv1d")):  # q and k channels first, then v's
            return torch.cat([t[: 2 * keys], move(t[2 * keys :], 0, width, tiled)])
        if base.endswith("in_proj_z"):
            return move(t, 0, width, tiled)
        if base.endswith(("in_proj_b", "in_proj_a", "A_log", "dt_bias")):
            return move(t, 0, 1, tiled)
        if base.endswith("out_proj"):
            return move(t, 1, width, tiled)
        return t

    for hf_name, tensor in model.state_dict().items():
        base, _, suffix = hf_name.rpartition(".")
        layer = int(hf_name.split(".")[2]) if hf_name.startswith("model.layers.") else None
        values = tensor.to(torch.float32)
        if base.endswith("in_proj_qkvz"):
            _write_qkvz(writer, gguf, weights, layer, tensor, cfg)
            continue
        if suffix in ("gate_up_proj", "down_proj") and base.endswith("mlp.experts"):
            for kind, stacked in _stacked_experts(name, suffix, tensor).items():
                gguf_name = gguf.TENSOR_NAMES[getattr(gguf.MODEL_TENSOR, kind)].format(bid=layer) + ".weight"
                writer.add_tensor(gguf_name, np.ascontiguousarray(stacked.to(torch.float32).numpy()))
            continue
        if base.endswith("linear_attn"):  # the bare parameters A_log and dt_bias
            values = regroup(suffix, values, tiled=True)
            if suffix == "A_log":
                values = -values.exp()
                with torch.no_grad():  # the model runs on what the file holds: log(-(-exp(A_log)))
                    tensor.copy_(regroup(suffix, (-values).log(), tiled=False))
                writer.add_tensor(names.get_name(hf_name), np.ascontiguousarray(values.numpy()))
            else:
                writer.add_tensor(names.get_name(f"{base}.dt_proj") + ".bias", np.ascontiguousarray(values.numpy()))
            continue
        shared = {"gate_proj": "FFN_GATE_SHEXP", "up_proj": "FFN_UP_SHEXP", "down_proj": "FFN_DOWN_SHEXP"}
        if base.endswith("mlp.gate"):
            gguf_base = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.FFN_GATE_INP].format(bid=layer)
        elif base.endswith("mlp.shared_expert_gate"):
            gguf_base = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.FFN_GATE_INP_SHEXP].format(bid=layer)
        elif ".mlp.shared_expert." in base:
            kind = shared[base.rpartition(".")[2]]
            gguf_base = gguf.TENSOR_NAMES[getattr(gguf.MODEL_TENSOR, kind)].format(bid=layer)
        else:
            gguf_base = names.get_name(base)
        if "linear_attn." in base:
            values = regroup(base, values.squeeze(1) if base.endswith("conv1d") else values, tiled=True)
        elif suffix == "weight" and base.endswith("norm"):
            values = values + 1  # Qwen3.5's zero-centred norms, stored as (1 + weight)
        values = np.ascontiguousarray(values.numpy())
        router = base.endswith(("mlp.gate", "shared_expert_gate"))  # float in the converter's files too
        if weights != "F32" and layer is not None and values.ndim == 2 and not base.endswith("conv1d") and not router:
            quant = gguf.GGMLQuantizationType[weights]
            blocks = gguf.quants.quantize(values, quant)
            writer.add_tensor(f"{gguf_base}.{suffix}", blocks, raw_dtype=quant)
            held = torch.from_numpy(gguf.quants.dequantize(blocks, quant))
            with torch.no_grad():  # transformers runs on what the file holds, in the checkpoint's order
                tensor.copy_(regroup(base, held, tiled=False))
            continue
        writer.add_tensor(f"{gguf_base}.{suffix}", values)
    _finish(writer)
    return model


def _qkvz_apart(w: torch.Tensor, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-Next's in_proj_qkvz ([q, k, v, z] of key head 0, then of key head 1 ...) as its
    converter writes it: q/k/v (every head's q, then k, then v) and z."""
    per_key = cfg.linear_num_value_heads // cfg.linear_num_key_heads
    widths = [cfg.linear_key_head_dim] * 2 + [per_key * cfg.linear_value_head_dim] * 2
    grouped = w.T.reshape(w.shape[1], cfg.linear_num_key_heads, sum(widths))
    q, k, v, z = (part.reshape(w.shape[1], -1) for part in grouped.split(widths, dim=-1))
    return torch.cat([q, k, v], dim=-1).T.contiguous(), z.T.contiguous()


def _qkvz_together(qkv: torch.Tensor, z: torch.Tensor, cfg) -> torch.Tensor:
    """``_qkvz_apart`` undone."""
    hidden, heads = qkv.shape[1], cfg.linear_num_key_heads
    keys = heads * cfg.linear_key_head_dim
    q, k, v = qkv.T.split([keys, keys, qkv.shape[0] - 2 * keys], dim=-1)
    parts = [t.reshape(hidden, heads, -1) for t in (q, k, v, z.T)]
    return torch.cat(parts, dim=-1).reshape(hidden, -1).T


def _write_qkvz(writer, gguf, weights: str, layer: int, tensor: torch.Tensor, cfg) -> None:
    """Qwen3-Next's fused q/k/v/z as ``attn_qkv`` and ``attn_gate``, quantized where asked (the
    model then holds what the file does)."""
    held = []
    for kind, part in zip(("ATTN_QKV", "ATTN_GATE"), _qkvz_apart(tensor.float(), cfg)):
        name = gguf.TENSOR_NAMES[getattr(gguf.MODEL_TENSOR, kind)].format(bid=layer) + ".weight"
        array = np.ascontiguousarray(part.numpy())
        if weights == "F32":
            writer.add_tensor(name, array)
            held.append(part)
            continue
        quant = gguf.GGMLQuantizationType[weights]
        blocks = gguf.quants.quantize(array, quant)
        writer.add_tensor(name, blocks, raw_dtype=quant)
        held.append(torch.from_numpy(gguf.quants.dequantize(blocks, quant)))
    with torch.no_grad():
        tensor.copy_(_qkvz_together(*held, cfg))


def _value_heads(t: torch.Tensor, dim: int, width: int, tiled: bool, key_heads: int, heads: int) -> torch.Tensor:
    """``heads`` value heads (each ``width`` along ``dim``) grouped by key head (the checkpoint's
    order: key head i's are i x r ... i x r + r - 1, r = heads / key_heads) to tiled (value head j
    is key head j mod key_heads's: llama.cpp's), or back where ``tiled`` is False."""
    shape, per_key = list(t.shape), heads // key_heads
    split = (key_heads, per_key) if tiled else (per_key, key_heads)
    t = t.reshape(*shape[:dim], *split, width, *shape[dim + 1 :])
    return t.transpose(dim, dim + 1).reshape(shape)


def save_tiny_lfm2_gguf(path: Path, seed: int = 0, **overrides):
    """A tiny LFM2 as llama.cpp's converter writes it (``lfm2``; its tensors and metadata checked
    byte for byte against convert_hf_to_gguf.py of llama-cpp-python 0.3.36): the KV heads per layer
    (0 for a convolution layer), the MLP's width as derived, the convolution's taps [channels,
    taps], the final norm as ``token_embd_norm``. Without convolution biases, which that
    converter cannot write. Returns the transformers model."""
    import gguf

    model = build_hf_model("lfm2", seed, **{"conv_bias": False, **overrides})
    cfg = model.config
    arch = gguf.MODEL_ARCH.LFM2
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    writer = _gguf_writer(path, arch, cfg)
    writer.add_head_count_kv([cfg.num_key_value_heads if t != "conv" else 0 for t in cfg.layer_types])
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_shortconv_l_cache(cfg.conv_L_cache)
    width = int(2 * cfg.intermediate_size / 3)  # block_auto_adjust_ff_dim, as the converter derives it
    width = int(cfg.block_ffn_dim_multiplier * width)
    writer.add_feed_forward_length(cfg.block_multiple_of * -(-width // cfg.block_multiple_of))
    _add_byte_level_tokenizer(writer, cfg.vocab_size, "lfm2")
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        base, _, suffix = hf_name.rpartition(".")
        values = tensor.to(torch.float32)
        if base.endswith("conv.conv"):
            values = values.squeeze(1)
        writer.add_tensor(f"{names.get_name(base)}.{suffix}", np.ascontiguousarray(values.numpy()))
    _finish(writer)
    return model


def save_tiny_granite_gguf(name: str, path: Path, weights: str = "F32", seed: int = 0, **overrides):
    """A tiny Granite-4.0-H (``name``: "granite-h" or "granite-h-dense") as llama.cpp's converter
    writes it (``granitehybrid``; its tensors and metadata checked byte for byte against
    convert_hf_to_gguf.py of llama-cpp-python 0.3.36, given the config's layer types as IBM's
    checkpoints spell them): the KV heads per layer (0 for a Mamba-2 layer), A_log as -exp(A_log)
    and D, each [heads, 1], dt_bias as ``ssm_dt.bias``, the convolution's taps [channels, taps],
    the gated norm's scale [groups, channels / groups], q and k rows in llama.cpp's rope order,
    the experts' and the shared MLP's gate and up apart. ``weights``: the type of the layers' 2-D
    projections. Returns the transformers model, holding the values the file does."""
    import gguf

    model = build_hf_model(name, seed, **overrides)
    cfg = model.config
    arch = gguf.MODEL_ARCH.GRANITE_HYBRID
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    experts = cfg.num_local_experts > 0
    writer = _gguf_writer(path, arch, cfg)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count_kv([cfg.num_key_value_heads if t == "full_attention" else 0 for t in cfg.layer_types])
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_expert_count(cfg.num_local_experts)  # (0 and a count used, without experts, as the converter)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_attention_scale(cfg.attention_multiplier)
    writer.add_embedding_scale(cfg.embedding_multiplier)
    writer.add_residual_scale(cfg.residual_multiplier)
    writer.add_logit_scale(cfg.logits_scaling)
    writer.add_expert_shared_feed_forward_length(cfg.shared_intermediate_size)
    writer.add_ssm_conv_kernel(cfg.mamba_d_conv)
    writer.add_ssm_state_size(cfg.mamba_d_state)
    writer.add_ssm_group_count(cfg.mamba_n_groups)
    writer.add_ssm_inner_size(cfg.mamba_n_heads * cfg.mamba_d_head)
    writer.add_ssm_time_step_rank(cfg.mamba_n_heads)
    writer.add_rope_scaling_finetuned(False)
    writer.add_context_length(2**20)  # the converter's, for a model without positions (over the common key)
    _add_byte_level_tokenizer(writer, cfg.vocab_size, "smollm")

    def tensor_name(kind: str, layer: int) -> str:
        return gguf.TENSOR_NAMES[getattr(gguf.MODEL_TENSOR, kind)].format(bid=layer) + ".weight"

    def add(gguf_name: str, values: torch.Tensor, tensor: torch.Tensor | None = None, rows=None) -> None:
        """``values`` into the file, quantized where asked; ``tensor`` (the model's) then holds
        what the file does (``rows``: the part of it ``values`` is, in the checkpoint's order)."""
        array = np.ascontiguousarray(values.to(torch.float32).numpy())
        if weights == "F32" or array.ndim < 2 or tensor is None:
            writer.add_tensor(gguf_name, array)
            return
        quant = gguf.GGMLQuantizationType[weights]
        blocks = gguf.quants.quantize(array, quant)
        writer.add_tensor(gguf_name, blocks, raw_dtype=quant)
        held = torch.from_numpy(gguf.quants.dequantize(blocks, quant)).reshape(values.shape)
        with torch.no_grad():
            (tensor if rows is None else tensor[rows]).copy_(held)

    heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        base, _, suffix = hf_name.rpartition(".")
        layer = int(hf_name.split(".")[2]) if hf_name.startswith("model.layers.") else -1
        part = base.rpartition(".")[2]
        # (transformers holds the experts as experts.gate_up_proj/down_proj, the router as router.weight)
        if base.endswith("shared_mlp.input_linear") or suffix == "gate_up_proj":
            half = tensor.shape[-2] // 2
            kinds = ("FFN_GATE_SHEXP", "FFN_UP_SHEXP") if experts else ("FFN_GATE", "FFN_UP")
            if suffix == "gate_up_proj":
                kinds = ("FFN_GATE_EXP", "FFN_UP_EXP")
            for kind, rows in zip(kinds, (slice(0, half), slice(half, None))):
                add(tensor_name(kind, layer), tensor[..., rows, :], tensor, (Ellipsis, rows, slice(None)))
        elif base.endswith("shared_mlp.output_linear"):
            add(tensor_name("FFN_DOWN_SHEXP" if experts else "FFN_DOWN", layer), tensor, tensor)
        elif suffix == "down_proj":
            add(tensor_name("FFN_DOWN_EXP", layer), tensor, tensor)
        elif base.endswith("block_sparse_moe.router"):
            add(tensor_name("FFN_GATE_INP", layer), tensor)
        elif suffix == "A_log":
            values = -tensor.float().exp()
            with torch.no_grad():  # the model runs on what the file holds: log(-(-exp(A_log)))
                tensor.copy_((-values).log())
            add(names.get_name(hf_name), values[:, None])
        elif suffix == "D":
            add(names.get_name(hf_name), tensor[:, None])
        elif suffix == "dt_bias":
            add(names.get_name(f"{base}.dt_proj") + ".bias", tensor)
        elif base.endswith("mamba.conv1d"):
            add(f"{names.get_name(base)}.{suffix}", tensor.squeeze(1) if suffix == "weight" else tensor)
        elif base.endswith("mamba.norm"):
            add(f"{names.get_name(base)}.{suffix}", tensor.view(cfg.mamba_n_groups, -1))
        elif part in heads:
            add(f"{names.get_name(base)}.{suffix}", _llama_cpp_rope_rows(tensor, heads[part]), tensor)
            if weights != "F32":  # (the model's rows back in the checkpoint's order)
                with torch.no_grad():
                    tensor.copy_(_hf_rope_rows(tensor, heads[part]))
        else:
            add(f"{names.get_name(base)}.{suffix}", tensor, tensor if layer >= 0 and tensor.dim() == 2 else None)
    _finish(writer)
    return model


def _hf_rope_rows(w, heads: int):
    """``_llama_cpp_rope_rows`` undone."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_writer(path: Path, arch, cfg):
    """A GGUF writer for ``arch`` with the keys every file here carries (context, widths, layers, heads)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_head_count(cfg.num_attention_heads)
    return writer


def _add_byte_level_tokenizer(writer, vocab_size: int, pre: str) -> None:
    """``_byte_level_vocab`` as a GGUF's BPE tokenizer (bos 1, eos 2)."""
    tokens, merges = _byte_level_vocab(vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([1] * len(tokens))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def _finish(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
