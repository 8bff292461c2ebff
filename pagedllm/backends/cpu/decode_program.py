"""A decode step's decoder layers in one compiled call (``kernels/csrc/decode_step.cpp``).

At one request the Python between a layer's ~10 ops cost a large part of each token (one
request as stored ran 1.44x faster without it: docs/benchmarks.md). ``DecodeProgram`` hands the
compiled ``DecodeStep`` every layer's weights once, as the layers hold them (oneDNN-packed,
tile-packed, plain, quantized or int8 segments, biases, Qwen3's q/k norms, sliding windows, gpt-oss's sinks,
Gemma's norms around each sub-layer, its GELU and its two rotary tables, SmolLM3's layers
without positions, a mixture's router and quantized experts), and runs all layers of a step in
one call with the kernels the layers call, in the same order. A sparse layer runs in it where
the backend's expert kernel would run it (``moe_quant_experts``: every expert quantized in one
format; gpt-oss's biases and clamp included), its router a softmax over top_k (Qwen3-MoE,
Mixtral, OLMoE, whose q/k norm over the whole projection the program computes as the layer does,
Qwen2-MoE with its gated shared expert) or gpt-oss's biased top_k softmaxed; Qwen3.5's
attention (an output gate per head, rotary on a quarter of each head) and its Gated DeltaNet
layers (in_proj, then ``gated_deltanet_layer_decode`` on each sequence's state slot in place,
then out_proj), in steps whose every row decodes a state it continues. q/k/v clipping
(``clip_qkv``), Granite's multipliers and the other state kinds (short convolutions, Mamba-2)
keep the loop.
It runs a step whose every row decodes (one new token per sequence) or of at most
``SMALL_STEP_TOKENS`` tokens (rows with speculative guesses, a short prompt); longer steps, the
PyTorch backend and a split model keep the Python layer loop, which stays the reference.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ... import env
from ...kinds.attention.forward import Attention
from ...kinds.gated_deltanet.forward import GatedDeltaNet
from ...kinds.sparse_moe.forward import SparseMoE
from ...layers.linear import Linear
from ...layers.quantized import QuantizedLinear
from ...layers.recurrence import StepRuns
from .expert_kernel import quantized_expert_arguments

if TYPE_CHECKING:
    from ...models.decoder import DecoderLM
    from .attention import CompiledPagedAttention

# Steps of up to this many tokens run the program whatever their rows are (a decode row with
# speculative guesses, a short prompt); longer prefills keep the Python loop.
SMALL_STEP_TOKENS = 64

# The compiled program's linear kinds (decode_step.cpp's LinearKind).
PLAIN, ONEDNN, TILES, QUANT, INT8 = range(5)
# A layer's rotary tables (``ModelConfig.rope_of_layer``) as decode_step.cpp's RopeKind.
ROPE_KINDS = {None: 0, "global": 1, "local": 2}


# (mixer, feed-forward) of the layer kinds the compiled step runs (``kinds``)
PROGRAMMED_KINDS = tuple((m, f) for m in ("attention", "gated_deltanet") for f in ("dense_mlp", "sparse_moe"))


class NotProgrammable(Exception):
    """A layer the compiled program does not run (the Python loop then runs every step)."""


def _linear_args(layer: torch.nn.Module) -> tuple[int, list[torch.Tensor], list[int], torch.Tensor]:
    """(kind, tensors, ints, bias) for ``DecodeStep.add_linear``; an empty tensor stands for none."""
    none = torch.empty(0)
    own_bias = getattr(layer, "bias", None)
    bias = own_bias.data if isinstance(own_bias, torch.Tensor) else none
    if isinstance(layer, QuantizedLinear):
        if layer.streamed:  # the program holds every layer's weights; these are read into slots each step
            raise NotProgrammable("a layer read from the file each step (a layer stream)")
        if not layer.packed or not layer.segments:
            raise NotProgrammable("a quantized layer not packed")
        if layer.int8_activations and not all(s.int8_per_row for s in layer.segments):
            raise NotProgrammable("w8a8 weights not int8 per row")
        tensors = [t for s in layer.segments for t in (s.qweight, s.scale, none if s.zero is None else s.zero)]
        ints = [i for s in layer.segments for i in (s.layout, s.group)]
        return (INT8 if layer.int8_activations else QUANT), tensors, ints, bias
    if isinstance(layer, Linear):
        weight = layer.weight.data
        kind = (TILES if weight.dim() == 4 else ONEDNN) if layer.packed else PLAIN
        return kind, [weight], [], bias
    raise NotProgrammable(f"a {type(layer).__name__}")


def _experts_args(moe: SparseMoE) -> tuple:
    """``DecodeStep.add_experts``' arguments for a sparse layer the program runs, else NotProgrammable."""
    if moe.expert_cache is not None:  # the program holds every expert's weights; these come and go
        raise NotProgrammable("experts read from the file into an expert cache")
    arguments = quantized_expert_arguments(moe)
    if arguments is None:
        raise NotProgrammable("experts the expert kernel does not take (float, mixed formats)")
    gu_q, gu_scale, gu_zero, gu_bits, gu_group, d_q, d_scale, d_zero, d_bits, d_group = arguments[:10]
    gu_bias, d_bias, limit, alpha = arguments[10:]
    none = torch.empty(0)

    def triples(q, scale, zero) -> list[torch.Tensor]:
        return [t for e in zip(q, scale, zero) for t in (e[0], e[1], none if e[2] is None else e[2])]

    bias = moe.router.bias
    return (
        moe.router.weight.data,
        bias.data.float() if bias is not None else none,  # as SparseMoE.route widens it
        moe.top_k,
        moe.normalize,
        moe.softmax_after_topk,
        triples(gu_q, gu_scale, gu_zero),
        triples(d_q, d_scale, d_zero),
        [gu_bits, gu_group, d_bits, d_group],
        gu_bias,
        d_bias,
        [limit, alpha],
    )


class DecodeProgram:
    """The compiled decode step of one model, built once its weights are loaded and packed."""

    def __init__(self, model: DecoderLM, step_class: Any):
        cfg = model.config
        if cfg.qkv_clip is not None:
            raise NotProgrammable("q/k/v clipped (clip_qkv)")
        if cfg.residual_multiplier != 1.0:
            raise NotProgrammable("sub-layer outputs scaled before their residual adds (Granite)")
        kinds = {(k.mixer, k.feed_forward) for k in cfg.layer_kinds} - set(PROGRAMMED_KINDS)
        if kinds:  # a kind is in the program once its entry is (kernels/csrc/decode_step.cpp)
            raise NotProgrammable(f"layers of kinds {sorted(kinds)}")
        layers = model.model.decoder_layers()
        attn0 = next((layer.mixer for layer in layers if isinstance(layer.mixer, Attention)), None)
        if attn0 is None:
            raise NotProgrammable("no attention layer")
        self.step = step_class(
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps, attn0.scale, cfg.activation == "gelu_tanh"
        )
        self.step.set_attention_gate(cfg.attention_output_gate, cfg.rotary_dim)
        self.backend = model.backend
        self.packed_quantized = False  # any layer on quant_linear, whose row rule the backend keeps
        # a model with state layers runs a step only where each of its rows decodes (``all_decode``)
        self.stateful = any(isinstance(layer.mixer, GatedDeltaNet) for layer in layers)
        for layer in layers:
            linears = self._add_mixer(layer)
            mlp: Any = layer.mlp
            if isinstance(mlp, SparseMoE):
                if mlp.shared_expert is not None and mlp.shared_expert_gate is None:
                    raise NotProgrammable("a shared expert without a gate (Granite)")
                self.step.add_experts(*_experts_args(mlp))
                self.packed_quantized = True  # its experts take the backend's row rule too
                if mlp.shared_expert is not None and mlp.shared_expert_gate is not None:  # Qwen2-MoE
                    shared = mlp.shared_expert
                    linears += [shared.gate_up_proj, shared.down_proj, mlp.shared_expert_gate]
            else:
                linears += [mlp.gate_up_proj, mlp.down_proj]
            for which, linear in enumerate(linears):
                kind, tensors, ints, bias = _linear_args(linear)
                self.packed_quantized |= kind == QUANT
                self.step.add_linear(which, kind, tensors, ints, bias)
        self.step.set_final_norm(model.model.norm.weight.data)

    def _add_mixer(self, layer) -> list:
        """The layer's norms and its mixer's own parameters into the program; returns the mixer's
        two linear layers (the program's qkv and o slots)."""
        none, a = torch.empty(0), layer.mixer
        norms = [layer.input_layernorm.weight.data, layer.mlp_norm.weight.data]
        if isinstance(a, GatedDeltaNet):
            norms += [none, none] + [n.weight.data if n is not None else none for n in _sub_layer_norms(layer)]
            self.step.add_layer(norms + [none], 0, ROPE_KINDS[None])
            params = [a.conv1d.weight.data.reshape(a.conv1d.weight.shape[0], -1), a.A_log, a.dt_bias, a.norm.weight]
            self.step.add_delta_rule([t.data for t in params], a.widths[:3] + [a.key_heads], a.value_heads_tiled)
            return [a.in_proj, a.out_proj]
        optional = (a.q_norm, a.k_norm, *_sub_layer_norms(layer))
        norms += [n.weight.data if n is not None else none for n in optional]
        norms.append(a.sinks.data.float() if a.sinks is not None else none)  # as Attention.forward widens them
        self.step.add_layer(norms, a.window or 0, ROPE_KINDS[a.rope])
        return [a.qkv_proj, a.o_proj]

    def takes(self, tokens: int, sequences: int, dtype: torch.dtype, layout: Any) -> bool:
        """Whether the program runs this step: every row decodes, or the step is small (rows
        with speculative guesses, a short prompt), and quantized layers would take the
        packed-weight kernel at this many rows (the backend's own rule; w8a8 and float layers
        run the same op at any count). A model with state layers: every row a decode row of a
        state continued, with no checkpoint to copy (``layers.recurrence.all_decode``)."""
        small = tokens == sequences or tokens <= SMALL_STEP_TOKENS
        if self.stateful and (tokens != sequences or StepRuns.of(layout).decodes != list(range(sequences))):
            return False
        return small and (not self.packed_quantized or self.backend.quant_kernel_takes(tokens, dtype))

    def run(
        self, h: torch.Tensor, ropes: dict[str, tuple[torch.Tensor, torch.Tensor]], attn: CompiledPagedAttention
    ) -> torch.Tensor:
        """h: the step's embeddings (the residual stream, added to in place); ropes: the rotary
        tables by kind (``DecoderBody.rope_tables``). Returns the final norm of the last layer's
        output, as the Python loop does."""
        lay, cache = attn.layout, attn.cache
        scales = (cache.k_scale, cache.v_scale) if cache.quantized else ([], [])
        none = torch.empty(0)
        local_cos, local_sin = ropes.get("local", (none, none))
        states = [cache.states.get(i, {}) for i in range(len(cache.layer_pool))]
        slots = StepRuns.of(lay).index if self.stateful else none
        return self.step.run(
            h,
            *ropes["global"],
            local_cos,
            local_sin,
            cache.k,
            cache.v,
            *scales,
            lay.query_start,
            lay.context_lens,
            [lay.tables(pool) if pool is not None else none for pool in cache.layer_pool],
            lay.block_size,
            lay.pairs_budget,
            [s.get("conv", none) for s in states],
            [s.get("recurrent", none) for s in states],
            slots,
        )


def _sub_layer_norms(layer) -> tuple:
    """Gemma's norms of each sub-layer's output before its add (None where the model has none)."""
    return layer.attn_out_norm, layer.post_feedforward_layernorm


def build(model: DecoderLM, step_class: Any) -> DecodeProgram | None:
    """The model's compiled decode step (``step_class``: the kernels' ``DecodeStep``), or None where
    the model is split over ranks, a layer is one the program does not run, or
    ``PAGEDLLM_DECODE_STEP=0`` asks for the Python layer loop (to compare the two)."""
    if not env.DECODE_STEP.get() or model.tensor_parallel is not None or model.shard is not None:
        return None
    try:
        return DecodeProgram(model, step_class)
    except NotProgrammable:
        return None
