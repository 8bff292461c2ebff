"""ModelConfig: the one description of a decoder that the model, the loaders and the cache share.

HF configs spell the same thing several ways (``rope_theta`` vs ``rope_parameters``, ``head_dim``
present or derived, bias flags). We normalise them once here, as the model's family
(``models/<family>/spec.py``) says its config reads, so the model code reads plain fields and
never sees a raw config dict.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from . import kinds
from .errors import ModelLoadError, UnsupportedModelError
from .kinds import LayerKind, PagedKV, SequenceState
from .models.family import VALUE_HEADS_TILED_KEY
from .models.registry import family_of_config

if TYPE_CHECKING:
    from .models.family import Family

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    # llama3-style frequency-dependent scaling only
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # YaRN only (gpt-oss): the band of dimensions blended between kept and interpolated, whether
    # its ends are rounded to whole dimensions, and cos/sin's scale (None: from ``factor``)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None
    # LongRoPE only (Phi-3/3.5): each rotary pair's wavelength stretched by its factor, the
    # short ones for a context within ``original_max_position_embeddings``, the long beyond
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    max_position_embeddings: int = 0  # the config's, whose ratio to the original sets LongRoPE's scale
    # the share of each head's dimensions rotated (the first ones; Qwen3.5: a quarter), the rest left as they are
    partial_rotary_factor: float = 1.0


@dataclass(frozen=True)
class MoeConfig:
    """A sparse MLP: each token's ``top_k`` experts of ``num_experts`` (by the router's softmax),
    their outputs summed with the router's probabilities (renormalised over the chosen when
    ``normalize``); Qwen2-MoE adds a dense shared expert gated by a sigmoid."""

    num_experts: int
    top_k: int
    expert_size: int  # each expert's intermediate width
    normalize: bool
    layers: tuple[bool, ...]  # per layer: sparse (True) or the dense MLP of ``intermediate_size``
    shared_expert_size: int = 0  # Qwen2-MoE's shared expert's width; 0: none
    shared_expert_gated: bool = True  # its output times a sigmoid gate (Qwen2-MoE), or added as it is (Granite)
    # gpt-oss: the router biased, its top_k logits chosen first and softmaxed among themselves,
    # and each expert's SwiGLU clamped (gate below ``swiglu_limit``, up within it, the gate's
    # sigmoid sharpened by ``swiglu_alpha``, up offset by 1)
    router_bias: bool = False
    softmax_after_topk: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.0


@dataclass(frozen=True)
class DeltaRuleConfig:
    """A Gated DeltaNet layer's sizes (Qwen3.5/3.6's ``linear_attention`` layers, ``kinds/gated_deltanet``):
    q and k in ``key_heads`` heads of ``key_head_dim``, v in ``value_heads`` heads of
    ``value_head_dim`` (each key head serves value_heads / key_heads of them), and the causal
    convolution over q/k/v of ``conv_kernel`` taps. ``value_heads_tiled``: value head j is served
    by key head j mod key_heads (llama.cpp's GGUF order, its converter having regrouped the value
    heads so), not by key head j // (value_heads / key_heads) (the checkpoint's)."""

    key_heads: int
    value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    value_heads_tiled: bool = False

    @property
    def conv_channels(self) -> int:
        return 2 * self.key_heads * self.key_head_dim + self.value_heads * self.value_head_dim


@dataclass(frozen=True)
class Mamba2Config:
    """A Mamba-2 layer's sizes (Granite-4.0-H's ``mamba`` layers, ``kinds/mamba2``): x in ``heads``
    heads of ``head_dim``; B and C in ``groups`` groups of ``state_size`` (each group serves
    heads / groups heads); x, B and C through one causal convolution of ``conv_kernel`` taps
    (biased where ``conv_bias``); each step's dt = softplus(dt + dt_bias) kept within
    ``time_step_limit``."""

    heads: int
    head_dim: int
    state_size: int
    groups: int
    conv_kernel: int
    conv_bias: bool
    projection_bias: bool
    time_step_limit: tuple[float, float] = (0.0, float("inf"))

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def conv_channels(self) -> int:
        return self.inner + 2 * self.groups * self.state_size


@dataclass(frozen=True)
class ShortConvConfig:
    """A gated short convolution's (LFM2's ``conv`` layers, ``kinds/short_conv``): its taps, biases."""

    kernel: int
    bias: bool


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    # "head": q and k normed per head (Qwen3); "all": over the whole projection (OLMoE)
    qk_norm_scope: str = "head"
    qkv_clip: float | None = None  # OLMoE's clip_qkv: q, k, v clamped to +-this after the norms
    # per layer: None for full attention, else the window size in tokens
    sliding_windows: tuple[int | None, ...] = ()
    attention_sinks: bool = False  # gpt-oss: a learned logit per head in every softmax's denominator
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    moe: MoeConfig | None = None  # a mixture of experts' routing and sizes; None: every layer dense
    activation: str = "silu"  # the MLP's gate activation: "silu" (SwiGLU) or "gelu_tanh" (Gemma's GeGLU)
    # q.k's multiplier; None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    attention_scale: float | None = None
    # per layer: its mixer's kind (a key of ``kinds.MIXERS``); () every layer is attention
    layer_mixers: tuple[str, ...] = ()
    delta_rule: DeltaRuleConfig | None = None  # the Gated DeltaNet layers' sizes (Qwen3.5)
    short_conv: ShortConvConfig | None = None  # the short-convolution layers' (LFM2)
    mamba2: Mamba2Config | None = None  # the Mamba-2 layers' (Granite-4.0-H)
    # Qwen3.5: q_proj gives each head's q and a gate beside it; the attention's output is
    # multiplied by the gate's sigmoid before o_proj
    attention_output_gate: bool = False
    embedding_multiplier: float = 1.0  # Gemma: sqrt(hidden_size), applied in the activation dtype; Granite's own
    # Granite: each sub-layer's output times this before its residual add; the logits divided by logits_scaling
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    sandwich_norms: bool = False  # Gemma: attention and MLP outputs normed before their residual adds
    # the rope of the sliding-window layers where it is not the full layers' (Gemma 3's local base)
    local_rope: RopeConfig | None = None
    # per layer: whether q and k are rotated (SmolLM3 leaves every fourth layer without positions); () all are
    rope_layers: tuple[bool, ...] = ()

    def rope_of_layer(self, layer: int) -> str | None:
        """Which rotary tables a layer's q and k take: "global", "local" (a sliding layer with a
        rope of its own) or None (no positions: SmolLM3's NoPE layers)."""
        if self.rope_layers and not self.rope_layers[layer]:
            return None
        sliding = bool(self.sliding_windows) and self.sliding_windows[layer] is not None
        return "local" if sliding and self.local_rope is not None else "global"

    @functools.cached_property  # (asked per layer; a frozen dataclass's __dict__ still takes it)
    def layer_kinds(self) -> tuple[LayerKind, ...]:
        """Each layer's mixer, feed-forward and cache (``pagedllm.kinds``; the cache is the mixer's)."""
        mixers = self.layer_mixers or ("attention",) * self.num_layers
        return tuple(
            LayerKind(
                mixer,
                "sparse_moe" if self.is_moe_layer(i) else "dense_mlp",
                kinds.part(mixer, "cache").cache(self, i),
            )
            for i, mixer in enumerate(mixers)
        )

    @functools.cached_property
    def kv_pools(self) -> tuple[int | None, ...]:
        """The window of each KV pool, one pool per window the layers' paged caches have: full
        attention (None) first, then the windows from the widest. A sliding layer reads only its
        window, so its pool keeps only each sequence's last window of blocks; pool 0 is the one
        every context length is planned against (a model without full layers: its widest window)."""
        windows = {k.cache.window for k in self.layer_kinds if isinstance(k.cache, PagedKV)} or {None}
        return tuple(sorted(windows, key=lambda w: (w is not None, -(w or 0))))

    def kv_pool_of_layer(self, layer: int) -> int | None:
        """The pool of the layer's paged K/V; None for a layer that keeps none."""
        cache = self.layer_kinds[layer].cache
        return self.kv_pools.index(cache.window) if isinstance(cache, PagedKV) else None

    def state_bytes_per_sequence(self) -> int:
        """What the layers that keep a fixed state hold for one running sequence (``SequenceState``)."""
        return sum(k.cache.bytes for k in self.layer_kinds if isinstance(k.cache, SequenceState))

    @property
    def rotary_dim(self) -> int:
        """The dimensions of each head that rotary rotates (the first ones)."""
        return int(self.head_dim * self.rope.partial_rotary_factor)

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and self.moe.layers[layer]

    @property
    def family(self) -> Family:
        """Its family (``models/<family>/spec.py``): checkpoint names, GGUF reading, splitting."""
        from .models.registry import family

        return family(self.architecture)

    @classmethod
    def from_hf_dict(cls, d: dict, source: str = "config") -> ModelConfig:
        fam = family_of_config(d, source)
        if fam.normalise_config is not None:  # a family whose config.json names common fields its own way
            d = fam.normalise_config(d)
        for key in ("attn_logit_softcapping", "final_logit_softcapping", "use_bidirectional_attention"):
            if d.get(key):
                raise UnsupportedModelError(
                    f"{source}: {key} = {d[key]!r} is not supported (Gemma 2's softcaps, "
                    "EmbeddingGemma's bidirectional attention)"
                )
        try:
            hidden = int(d["hidden_size"])
            heads = int(d["num_attention_heads"])
            layers = int(d["num_hidden_layers"])
            cfg = cls(
                architecture=fam.architecture,
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                # (a mixture whose every layer is sparse may name no dense width: Qwen3.5-MoE)
                intermediate_size=int(d["intermediate_size"]) if "intermediate_size" in d or not fam.experts else 0,
                num_layers=layers,
                num_heads=heads,
                num_kv_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or hidden // heads),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
                rope=_rope_from_hf(d, source, "full_attention", fam.partial_rotary),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                qkv_bias=fam.qkv_bias == "always" or bool(d.get("attention_bias")),
                o_bias=fam.qkv_bias != "always" and bool(d.get("attention_bias")),
                mlp_bias=bool(d.get("mlp_bias")) or (fam.experts is not None and fam.experts.biased),
                qk_norm=fam.qk_norm is not None,
                qk_norm_scope=fam.qk_norm or "head",
                qkv_clip=float(d["clip_qkv"]) if d.get("clip_qkv") is not None else None,
                sliding_windows=_sliding_windows_from_hf(d, fam, layers),
                attention_sinks=fam.attention_sinks,
                bos_token_id=d.get("bos_token_id"),
                eos_token_ids=_as_tuple(d.get("eos_token_id")),
                moe=_moe_from_hf(d, fam, layers),
                activation=_activation_from_hf(d, source),
                attention_scale=_attention_scale(d),
                embedding_multiplier=hidden**0.5 if fam.embedding_scaled else float(d.get("embedding_multiplier", 1.0)),
                residual_multiplier=float(d.get("residual_multiplier", 1.0)),
                logits_scaling=float(d.get("logits_scaling", 1.0)),
                sandwich_norms=fam.sandwich_norms,
                local_rope=_local_rope_from_hf(d, source),
                rope_layers=tuple(bool(x) for x in d["no_rope_layers"]) if d.get("no_rope_layers") else (),
                layer_mixers=_layer_mixers_from_hf(d, fam, layers, source),
                **_mixer_sizes(d, fam),
                attention_output_gate=fam.attention_output_gate,
            )
        except KeyError as e:
            raise ModelLoadError(f"{source}: required field {e.args[0]!r} is missing") from None
        if cfg.num_heads % cfg.num_kv_heads:
            raise ModelLoadError(
                f"{source}: num_attention_heads ({cfg.num_heads}) is not a multiple of "
                f"num_key_value_heads ({cfg.num_kv_heads})"
            )
        return cfg

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ModelLoadError(f"{path}: no such file (a model directory needs config.json)")
        try:
            d = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"{path}: not valid JSON ({e})") from None
        return cls.from_hf_dict(d, source=str(path))


def _moe_from_hf(d: dict, fam: Family, layers: int) -> MoeConfig | None:
    """The experts' routing from an HF config, as the family's ``Experts`` says it reads."""
    spec = fam.experts
    if spec is None:
        return None
    experts = int(d.get("num_local_experts") or d.get("num_experts") or 0)  # transformers 5 writes the first
    top_k = int(d.get("num_experts_per_tok") or 0)
    if experts == 0 and spec.optional:  # Granite-4.0-H-Micro: no routed experts, every layer dense
        return None
    if experts < 1 or not 1 <= top_k <= experts:
        raise ModelLoadError(
            f"{fam.architecture}: {experts} experts and {top_k} per token do not make a mixture of experts"
        )
    if spec.every_layer:
        sparse = (True,) * layers
        size = int(d["intermediate_size"])
    else:
        step, dense = int(d.get("decoder_sparse_step") or 1), set(d.get("mlp_only_layers") or [])
        sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))
        size = int(d["moe_intermediate_size"])
    return MoeConfig(
        num_experts=experts,
        top_k=top_k,
        expert_size=size,
        normalize=spec.always_renormalise or bool(d.get("norm_topk_prob", False)),
        layers=sparse,
        shared_expert_size=int(d.get("shared_expert_intermediate_size") or 0) if spec.shared_expert else 0,
        shared_expert_gated=spec.shared_expert_gated,
        router_bias=spec.biased,
        softmax_after_topk=spec.softmax_after_topk,
        swiglu_limit=float(d["swiglu_limit"]) if spec.clamped_swiglu else None,
        swiglu_alpha=float(d.get("swiglu_alpha", 1.702)) if spec.clamped_swiglu else 1.0,
    )


def _as_tuple(v) -> tuple[int, ...]:
    if v is None:
        return ()
    return tuple(v) if isinstance(v, (list, tuple)) else (int(v),)


_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def _activation_from_hf(d: dict, source: str) -> str:
    named = d.get("hidden_activation") or d.get("hidden_act") or "silu"  # Gemma names it hidden_activation
    if named not in _ACTIVATIONS:
        raise UnsupportedModelError(
            f"{source}: MLP activation {named!r} is not supported; supported: {', '.join(_ACTIVATIONS)}"
        )
    return _ACTIVATIONS[named]


def _local_rope_from_hf(d: dict, source: str) -> RopeConfig | None:
    """Gemma 3's sliding layers' rope: ``rope_parameters["sliding_attention"]`` (transformers 5)
    or ``rope_local_base_freq`` (the configs Google published); None where the config has neither."""
    if "sliding_attention" in (d.get("rope_parameters") or {}):
        return _rope_from_hf(d, source, "sliding_attention")
    if d.get("rope_local_base_freq") is not None:
        return RopeConfig(theta=float(d["rope_local_base_freq"]))
    return None


def _rope_from_hf(d: dict, source: str, layer_type: str, partial_rotary: bool = False) -> RopeConfig:
    """``layer_type``: which entry of a per-layer-type ``rope_parameters`` (Gemma 3's) to read.
    ``partial_rotary``: the family rotates part of each head (``Family.partial_rotary``)."""
    # transformers >= 5 writes rope_parameters; older checkpoints rope_theta + rope_scaling.
    params = dict(d.get("rope_parameters") or {})
    if isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    scaling = d.get("rope_scaling") or {}
    merged = {**scaling, **params}
    theta = merged.get("rope_theta", d.get("rope_theta", 10000.0))
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    partial = float(merged.get("partial_rotary_factor", d.get("partial_rotary_factor")) or 1.0)
    if partial != 1.0 and not partial_rotary:
        raise UnsupportedModelError(
            f"{source}: rotary positions on part of each head (partial_rotary_factor, Phi-4-mini) are not supported yet"
        )
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"{source}: rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    return RopeConfig(
        theta=float(theta),
        type=rope_type,
        factor=float(merged.get("factor", 1.0)),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            merged.get("original_max_position_embeddings", d.get("max_position_embeddings", 8192))
        ),
        beta_fast=float(merged.get("beta_fast") or 32.0),
        beta_slow=float(merged.get("beta_slow") or 1.0),
        truncate=bool(merged.get("truncate", True)),
        attention_factor=float(merged["attention_factor"]) if merged.get("attention_factor") is not None else None,
        short_factor=tuple(float(f) for f in merged.get("short_factor") or ()),
        long_factor=tuple(float(f) for f in merged.get("long_factor") or ()),
        max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
        partial_rotary_factor=partial,
    )


def _layer_mixers_from_hf(d: dict, fam: Family, layers: int, source: str) -> tuple[str, ...]:
    """Each layer's mixer kind, where the family's layers differ (``Family.layer_type_mixers``
    maps each ``layer_types`` entry to its kind); () where every layer is attention."""
    if not fam.layer_type_mixers:
        return ()
    types = d.get("layer_types") or []
    if len(types) != layers:
        raise ModelLoadError(f"{source}: layer_types names {len(types)} layers, num_hidden_layers is {layers}")
    unknown = sorted(set(types) - set(fam.layer_type_mixers))
    if unknown:
        raise UnsupportedModelError(f"{source}: layer types {unknown} are not supported")
    return tuple(fam.layer_type_mixers[t] for t in types)


def _mixer_sizes(d: dict, fam: Family) -> dict:
    """The sizes of the mixers other than attention that the family's layers have."""
    kinds = set(fam.layer_type_mixers.values())
    return dict(
        delta_rule=_delta_rule_from_hf(d) if "gated_deltanet" in kinds else None,
        short_conv=ShortConvConfig(int(d["conv_L_cache"]), bool(d.get("conv_bias"))) if "short_conv" in kinds else None,
        mamba2=_mamba2_from_hf(d) if "mamba2" in kinds else None,
    )


def _mamba2_from_hf(d: dict) -> Mamba2Config:
    heads = int(d["mamba_n_heads"])
    head_dim = d.get("mamba_d_head", "auto")
    inner = int(d.get("mamba_expand", 2)) * int(d["hidden_size"])
    limit = d.get("time_step_limit") or (0.0, float("inf"))
    return Mamba2Config(
        heads=heads,
        head_dim=inner // heads if head_dim in (None, "auto") else int(head_dim),
        state_size=int(d["mamba_d_state"]),
        groups=int(d.get("mamba_n_groups", 1)),
        conv_kernel=int(d.get("mamba_d_conv", 4)),
        conv_bias=bool(d.get("mamba_conv_bias", True)),
        projection_bias=bool(d.get("mamba_proj_bias", False)),
        time_step_limit=(float(limit[0]), _float(limit[1])),
    )


def _float(value) -> float:
    """A number as config.json writes it (transformers writes infinity as ``{"__float__": "Infinity"}``)."""
    return float(value["__float__"]) if isinstance(value, dict) else float(value)


def _attention_scale(d: dict) -> float | None:
    """q.k's multiplier where the config sets one: Gemma's query_pre_attn_scalar ** -0.5, Granite's
    attention_multiplier; None: head_dim ** -0.5."""
    if d.get("query_pre_attn_scalar"):
        return float(d["query_pre_attn_scalar"]) ** -0.5
    return float(d["attention_multiplier"]) if d.get("attention_multiplier") is not None else None


def _delta_rule_from_hf(d: dict) -> DeltaRuleConfig:
    return DeltaRuleConfig(
        key_heads=int(d["linear_num_key_heads"]),
        value_heads=int(d["linear_num_value_heads"]),
        key_head_dim=int(d["linear_key_head_dim"]),
        value_head_dim=int(d["linear_value_head_dim"]),
        conv_kernel=int(d["linear_conv_kernel_dim"]),
        value_heads_tiled=bool(d.get(VALUE_HEADS_TILED_KEY, False)),
    )


def _sliding_windows_from_hf(d: dict, fam: Family, layers: int) -> tuple[int | None, ...]:
    window = d.get("sliding_window")
    if fam.sliding == "every layer":
        return (int(window) if window else None,) * layers
    types = d.get("layer_types")
    if not types and d.get("sliding_window_pattern") and window:
        # Gemma 3 as Google published it: every pattern-th layer full, the others sliding
        types = [
            "full_attention" if (i + 1) % int(d["sliding_window_pattern"]) == 0 else "sliding_attention"
            for i in range(layers)
        ]
    if types and window and d.get("use_sliding_window", True):
        return tuple(int(window) if t == "sliding_attention" else None for t in types)
    if d.get("use_sliding_window") and window:
        # Qwen2-style: layers from max_window_layers on use the window.
        first = int(d.get("max_window_layers", layers))
        return tuple(int(window) if i >= first else None for i in range(layers))
    return (None,) * layers
