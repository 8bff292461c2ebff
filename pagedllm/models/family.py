"""What one model family is, said once: how its config.json and GGUF metadata read, what its
checkpoint's tensors are called, and whether it splits over ranks.

Torch-free (the API process reads configs and holds no torch). Each family's ``spec.py`` in its
own folder (``models/qwen3/spec.py``) builds one ``Family``; ``models/registry.py`` lists them.
The config reader (``config.py``), the loader (``decoder.checkpoint_slots``), the GGUF converter
and the tensor-parallel split ask the family; the planner reads the ``ModelConfig`` it produced,
whose fields (MoE layers, sliding windows, q/k norms) are what its phases are made of.

A family whose layers are kinds that exist (``pagedllm/kinds/``: attention, a SwiGLU MLP, a
mixture of experts) has only a ``spec.py``: the shared decoder (``models/decoder.py``) stacks
them. A new mechanism is a new kind, not a family's module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# Roles of a layer's tensors -> their checkpoint names under ``model.layers.N.``; ``{e}`` is an
# expert's index. The dense families all use these.
DENSE_LAYER_NAMES = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "q_norm": "self_attn.q_norm",
    "k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "mlp_norm": "post_attention_layernorm",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}
# A sparse layer's (Qwen-MoE, OLMoE; Mixtral names its own): the router, each expert's SwiGLU, and Qwen2-MoE's shared
# expert with its sigmoid gate.
EXPERT_NAMES = {
    "router": "mlp.gate",
    "expert_gate": "mlp.experts.{e}.gate_proj",
    "expert_up": "mlp.experts.{e}.up_proj",
    "expert_down": "mlp.experts.{e}.down_proj",
    "shared_gate": "mlp.shared_expert_gate",
    "shared_expert_gate": "mlp.shared_expert.gate_proj",
    "shared_expert_up": "mlp.shared_expert.up_proj",
    "shared_expert_down": "mlp.shared_expert.down_proj",
}


@dataclass(frozen=True)
class Experts:
    """How a mixture of experts' config reads. ``every_layer``: every layer is sparse, its
    experts ``intermediate_size`` wide (Mixtral, OLMoE); else sparse every
    ``decoder_sparse_step``-th layer but ``mlp_only_layers``, experts ``moe_intermediate_size``
    wide (Qwen-MoE). ``always_renormalise``: the chosen experts' probabilities always sum to 1
    (Mixtral), else as ``norm_topk_prob`` says. ``count_key``: the config field of the number of
    experts its own checkpoints carry (transformers 5 writes ``num_local_experts`` for all;
    either is read). ``gguf_renormalised``: what llama.cpp assumes when a GGUF file carries no
    ``expert_weights_norm`` (the ``norm_w`` its ``build_moe_ffn`` gets for the architecture)."""

    every_layer: bool
    always_renormalise: bool
    count_key: str
    gguf_renormalised: bool
    shared_expert: bool = False  # Qwen2-MoE: a dense expert on every token, gated by a sigmoid
    shared_expert_gated: bool = True  # Granite: the shared expert's output added as it is
    optional: bool = False  # Granite: a config with no experts (num_local_experts 0) is a dense model
    # gpt-oss: router and experts biased, the top_k logits softmaxed among themselves, each
    # expert's SwiGLU clamped (``config.MoeConfig``)
    biased: bool = False
    softmax_after_topk: bool = False
    clamped_swiglu: bool = False


# config.json's key, pagedllm's own, for a delta rule's value heads in llama.cpp's order (the
# conversion of a ``qwen35`` GGUF file writes it: ``models/qwen3_5/spec.py``)
VALUE_HEADS_TILED_KEY = "linear_value_heads_tiled"


@dataclass(frozen=True)
class Family:
    architecture: str  # HF ``architectures[0]``
    model_type: str  # HF ``model_type``
    # GGUF ``general.architecture`` its files carry (None: written as another family's, as
    # llama.cpp writes Mistral as ``llama``); a family with experts that shares it with a dense
    # one is what a file of it is when it has experts (``llama`` with experts is Mixtral)
    gguf_architecture: str | None = None
    # "always": q/k/v biased and o not, whatever ``attention_bias`` says (Qwen2); else as it says
    qkv_bias: str = "attention_bias"
    qk_norm: str | None = None  # "head": q and k normed per head (Qwen3); "all": over the whole projection (OLMoE)
    # "every layer": ``sliding_window`` applies to every layer (Mistral); else per ``layer_types``
    # or Qwen2's ``max_window_layers``
    sliding: str = "per layer"
    experts: Experts | None = None
    layer_names: dict[str, str] = field(default_factory=lambda: dict(DENSE_LAYER_NAMES))
    gguf_permuted_qk: bool = False  # llama.cpp's converter permutes q/k rows for its rope layout
    attention_sinks: bool = False  # gpt-oss: a learned logit per head (``self_attn.sinks``)
    # checkpoint tensors that hold several of the model's (gpt-oss's fused experts, Phi-3's q/k/v)
    # -> those, by their names, given the ``ModelConfig``; None (or a function returning None for a
    # tensor): every tensor is one of its own
    unfuse: Callable[[str, object, object], list[tuple[str, object]] | None] | None = None
    # the one run a rank of a split reads of a fused checkpoint tensor, ``(dim, start, stop)``
    # (None: all of it), given its name, stored shape and the rank's range of each split width
    # (``RankShard.range_of``), so that ``unfuse`` makes the rank's parts; None: fused tensors do
    # not split (the family is refused over ranks)
    fused_rank_part: Callable[[str, tuple[int, ...], Callable[[str], range]], tuple[int, int, int] | None] | None = None
    transformers_reads_gguf: bool = True  # whether transformers reads its GGUF config (for the tokenizer's class)
    # Gemma: every RMSNorm multiplies by (1 + weight): the loader adds this to each norm's
    # checkpoint weight once, so the norms compute as Llama's do
    norm_weight_offset: float = 0.0
    embedding_scaled: bool = False  # Gemma: the token embeddings times sqrt(hidden_size), in the activation dtype
    # Gemma: the attention's and the MLP's outputs normed before their residual adds, the MLP's
    # input by a norm of its own (``mlp_norm`` then names it, ``attn_out_norm``/``mlp_out_norm`` the others)
    sandwich_norms: bool = False
    # the HF config fields a GGUF file of it implies beyond the common ones, from its metadata
    # (``get(key, default)`` reads ``<arch>.<key>``) and the ``gguf_config_tensors`` it carries
    # (``tensor(name)``: a float list, or None where the file has none): what llama.cpp
    # hard-codes for the architecture, or writes as tensors (Phi-3's LongRoPE factors)
    gguf_config: Callable[[Callable, Callable], dict] | None = None
    gguf_config_tensors: tuple[str, ...] = ()
    # llama.cpp's names of a layer's fused tensors -> the checkpoint's (``unfuse`` splits them)
    gguf_fused: dict[str, str] = field(default_factory=dict)
    gguf_rope_scalings: tuple[str, ...] = ()  # the GGUF rope scaling types its gguf_config reads
    # llama.cpp's names of a layer's tensors whose role differs for this family from the common
    # reading (``gguf_convert._GGUF_ROLES``): gpt-oss's ``post_attention_norm`` is the MLP's input norm
    gguf_roles: dict[str, str] = field(default_factory=dict)
    # roles whose values llama.cpp's converter changed -> what gives the checkpoint's back from a
    # float tensor of the file (Qwen3.5's ``ssm_a``, written as -exp(A_log)); the shape follows
    gguf_undo: dict[str, Callable[[Any], Any]] = field(default_factory=dict)
    gguf_final_norm: str = "output_norm"  # llama.cpp's name of the final norm (LFM2's is ``token_embd_norm``)
    # a family whose layers' mixers differ: each ``layer_types`` entry -> its mixer's kind
    # (``kinds.MIXERS``; Qwen3.5's "linear_attention" -> "gated_deltanet"); {}: every layer attention
    layer_type_mixers: dict[str, str] = field(default_factory=dict)
    partial_rotary: bool = False  # rotary on part of each head (``partial_rotary_factor``) is read, not refused
    attention_output_gate: bool = False  # Qwen3.5: q_proj gives a gate per head beside q (``ModelConfig``)
    # checkpoint tensors read past, logged once (Qwen3.5's multi-token-prediction head: ``mtp.``)
    skipped_prefixes: tuple[str, ...] = ()
    # config.json -> the same with the common fields under their usual names and values (LFM2's
    # ``norm_eps``, its MLP width as its blocks compute it); None: read as it is
    normalise_config: Callable[[dict], dict] | None = None
    # module names (a path's dotted part) the checkpoint spells its own way: ours -> its
    # (LFM2's ``input_layernorm`` is its ``operator_norm``); the loader asks ``checkpoint_name``
    module_names: dict[str, str] = field(default_factory=dict)

    @property
    def not_split_because(self) -> str | None:
        """Why ``distributed.shards`` cannot split it over ranks, or None where it can: not where
        the checkpoint fuses tensors that no one run per rank reads (Phi-3's q/k/v: its q rows
        and its k and v rows), nor where q and k are normed over the whole projection (OLMoE: each
        rank holds only its heads' share of the sum of squares)."""
        if self.unfuse is not None and self.fused_rank_part is None:
            return "checkpoints fuse several weights in one tensor (q/k/v)"
        if self.qk_norm == "all":
            return "q and k are normed over all heads at once"
        if self.layer_type_mixers:
            return "layers that keep a state per sequence do not split yet"
        return None

    def checkpoint_name(self, name: str) -> str:
        """Our parameter's name as the checkpoint spells it (``module_names``)."""
        if not self.module_names:
            return name
        return ".".join(self.module_names.get(part, part) for part in name.split("."))

    def name_of(self, role: str, layer: int, expert: int | None = None) -> str:
        """The checkpoint name (without ``.weight``) of a layer's tensor by its role."""
        name = self.layer_names[role]
        return f"model.layers.{layer}." + (name.format(e=expert) if expert is not None else name)
