"""The decoder every family in ``models/registry.py`` is: embeddings, a stack of layers, a norm
and the lm head. Each layer is a mixer and a feed-forward, each after its norm, built from its
kinds' folders (``pagedllm.kinds``; ``ModelConfig.layer_kinds`` says which), never here.

The families differ only in switches that ``ModelConfig`` carries: q/k/v bias (Qwen2), q/k RMSNorm
(Qwen3, OLMoE), sliding-window layers (Mistral), experts (``kinds/sparse_moe/``), tied embeddings,
rope scaling. q/k/v and gate/up are stacked into one ``Linear`` each (one GEMM instead of three
or two); ``checkpoint_slots`` says where each checkpoint tensor goes, by the names the family's
spec gives its roles, so weights load by HF name.

Weights may be kept quantized (``use_quantized``): chosen linear layers become
``QuantizedLinear`` and the embeddings ``QuantizedEmbedding`` (a tied lm_head then multiplies by
the same quantized matrix).

``forward`` takes one flat batch of tokens from many sequences (no padding), their positions,
the attention seam for this step, and the rows whose logits are wanted: logits are computed for
those rows only, never for every prompt token.

A rank of a split model (``distributed.shards``) is the same decoder built from its rank's config
(its heads, KV heads, MLP width and vocabulary rows): ``tensor_parallel`` sums the row-parallel
outputs and the vocab-parallel embedding over the ranks and gathers the logits on the driver.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from .. import kinds
from ..config import ModelConfig
from ..distributed.shards import RankShard
from ..layers.linear import Linear
from ..layers.norm import RMSNorm, add_rms_norm
from ..layers.quantized import INT8_COMPUTE, QuantizedEmbedding, QuantizedLinear
from ..layers.rotary import Rotary

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..backends.base import Backend, DecodeProgram
    from ..distributed.group import RankGroup
    from ..kinds.dense_mlp.forward import MLP
    from ..kinds.sparse_moe.forward import SparseMoE
    from ..layers.expert_cache import ExpertCache
    from ..layers.layer_stream import LayerStream


class DecoderLayer(nn.Module):
    """Attention then an MLP, each after a norm and added to the residual stream. With
    ``sandwich_norms`` (Gemma) each sub-layer's output is normed too before its add; the norms
    keep the checkpoint's names (Gemma's ``post_attention_layernorm`` is the attention's output
    norm, ``pre_feedforward_layernorm`` the MLP's input norm)."""

    def __init__(self, cfg: ModelConfig, layer: int, backend: Backend):
        super().__init__()
        kind = cfg.layer_kinds[layer]  # each part's module from its kind's folder (``pagedllm.kinds``)
        mixer = kinds.part(kind.mixer, "forward")
        # registered under the checkpoint's name of the part ("self_attn"; a delta-rule layer's
        # "linear_attn"), so that its own parameters load by their HF names
        self.mixer_name: str = mixer.CHECKPOINT_NAME
        self.add_module(self.mixer_name, mixer.build(cfg, layer, backend))
        self.mlp: MLP | SparseMoE = kinds.part(kind.feed_forward, "forward").build(cfg, layer, backend)

        def norm() -> RMSNorm:
            return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)

        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm() if cfg.sandwich_norms else None
        self.post_feedforward_layernorm = norm() if cfg.sandwich_norms else None

    @property
    def mixer(self) -> Any:
        """The layer's mixer module (its kind's ``forward.build``: attention, a recurrent mixer)."""
        return getattr(self, self.mixer_name)

    @property
    def mlp_norm(self) -> RMSNorm:
        return self.pre_feedforward_layernorm or self.post_attention_layernorm

    @property
    def attn_out_norm(self) -> RMSNorm | None:
        return self.post_attention_layernorm if self.pre_feedforward_layernorm is not None else None


class DecoderBody(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: Backend):
        super().__init__()
        # Built empty (the checkpoint fills it): nn.Embedding's own init would draw normal_
        # samples, and on the meta device that imports ~70 MB of torch's decompositions.
        self.embed_tokens = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size)
        )
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, backend) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)
        self.rotary = Rotary(cfg.rope, cfg.rotary_dim)
        self.residual_multiplier = cfg.residual_multiplier
        self.local_rotary = Rotary(cfg.local_rope, cfg.rotary_dim) if cfg.local_rope is not None else None

    def rope_tables(
        self, positions: torch.Tensor, dtype: torch.dtype, layout
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The step's rotary tables by kind: "global", and "local" where sliding layers have
        their own; ``layout`` (the step's ``StepLayout``) says which rows' sequences have outgrown
        LongRoPE's original context."""
        long_rows = self.rotary.long_rows(layout.query_start, layout.context_lens)
        tables = {"global": self.rotary.tables(positions, dtype, long_rows)}
        if self.local_rotary is not None:
            tables["local"] = self.local_rotary.tables(positions, dtype)
        return tables

    def decoder_layers(self) -> list[DecoderLayer]:
        return cast(list[DecoderLayer], list(self.layers))


class DecoderLM(nn.Module):
    """``backend``: what every layer computes with (``pagedllm.backends``), chosen once.
    ``shard``: this process's rank of a split model; ``config`` is then that rank's share (its
    heads, KV heads, MLP width, vocabulary rows), ``vocab_size`` the whole model's."""

    def __init__(self, cfg: ModelConfig, backend: Backend, shard: RankShard | None = None):
        super().__init__()
        self.shard = shard
        self.vocab_size = cfg.vocab_size
        cfg = shard.local_config if shard is not None else cfg
        self.config = cfg
        self.backend = backend
        self.vocab_rows = shard.vocab_range() if shard is not None else range(cfg.vocab_size)  # real tokens held
        self.tensor_parallel: RankGroup | None = None  # the ranks' collectives, set by a split engine
        self.model = DecoderBody(cfg, backend)
        self.lm_head = Linear(cfg.hidden_size, [cfg.vocab_size], bias=False, backend=backend)
        # decode steps' layers in one compiled call (the backend's ``decode_program``); built on the first decode
        # step, once the weights are packed. False: always the Python layer loop (the reference).
        self.use_decode_program = True
        # the routed experts' slots when they are read from the file (``loading.checkpoint``)
        self.expert_cache: ExpertCache | None = None
        # the last decoder layers' slots when they are read from the file each step (``loading.checkpoint``)
        self.layer_stream: LayerStream | None = None
        self._decode_program: DecodeProgram | None = None
        self._decode_program_built = False
        if cfg.tie_word_embeddings:
            self.tie_embeddings()

    def tie_embeddings(self) -> None:
        embed = self.model.embed_tokens
        if isinstance(embed, QuantizedEmbedding):
            assert embed.weight_q is not None, "tie after loading"
            head = QuantizedLinear(
                self.config.hidden_size, [self.config.vocab_size], bias=False, scheme=None, backend=self.backend
            )
            head.segments, head.packed = [embed.weight_q], True
            head.int8_activations = embed.requantize  # w8a8: the int8 embeddings multiplied in integers
            self.lm_head = head  # type: ignore[assignment]
        else:
            self.lm_head.weight = cast(nn.Parameter, embed.weight)

    def linear_layers(self) -> dict[str, nn.Module]:
        """Every linear layer by module name (``model.layers.3.mlp.down_proj``, ``lm_head``)."""
        return {name: m for name, m in self.named_modules() if isinstance(m, (Linear, QuantizedLinear))}

    def use_quantized(self, schemes: dict[str, str | None], embedding: str | None | bool, dtype: torch.dtype) -> None:
        """Makes the named linear layers quantized before loading: ``schemes`` maps a module name
        to how its float checkpoint tensors are quantized ('int8', 'int4'), or None when they come
        quantized. ``embedding``: the same for the token embeddings (False: keep them float)."""
        for name, scheme in schemes.items():
            parent_name, _, leaf = name.rpartition(".")
            parent = self.get_submodule(parent_name) if parent_name else self
            old = getattr(parent, leaf)
            new = QuantizedLinear(old.in_features, old.parts, old.bias is not None, scheme, self.backend)
            setattr(parent, leaf, new)
        if embedding is None or isinstance(embedding, str):
            cfg = self.config
            embed = QuantizedEmbedding(cfg.vocab_size, cfg.hidden_size, embedding, dtype, self.backend)
            embed.requantize = INT8_COMPUTE in schemes.values()
            self.model.embed_tokens = embed  # type: ignore[assignment]

    def quantized(self) -> bool:
        """Whether its linear layers run on quantized weights."""
        return any(isinstance(m, QuantizedLinear) for m in self.modules())

    def weight_bytes(self) -> int:
        """Bytes of every weight, quantized ones included (they are not ``parameters()``)."""
        seen: set[int] = set()  # ids: packed oneDNN weights have no data pointer
        total = 0
        for p in self.parameters():  # each once: a tied lm_head is the embeddings' parameter
            seen.add(id(p))
            total += p.numel() * p.element_size()
        for m in self.modules():
            if getattr(m, "streamed", False):  # weights that are an expert cache's or a layer stream's slots
                continue
            for w in getattr(m, "quantized_weights", lambda: [])():
                if id(w) not in seen:
                    seen.add(id(w))
                    total += w.nbytes()
        for slots in (self.expert_cache, self.layer_stream):
            total += slots.nbytes() if slots is not None else 0
        return total

    def checkpoint_slots(self) -> dict[str, tuple[nn.Module, str, int | None]]:
        """HF checkpoint name -> (module, parameter, part): ``part`` is the index of the rows a
        stacked ``Linear`` keeps for that tensor, None for a parameter of its own."""
        slots: dict[str, tuple[nn.Module, str, int | None]] = {}
        family = self.config.family
        for name, module in self.named_modules():
            if isinstance(module, (Linear, QuantizedLinear)):
                continue
            for leaf, _ in module.named_parameters(recurse=False):
                slots[family.checkpoint_name(f"{name}.{leaf}")] = (module, leaf, None)
        for i, layer in enumerate(self.model.decoder_layers()):
            # each part's stacked linear layers -> the roles of their parts (its kind's module says)
            stacked = layer.mixer.checkpoint_roles() | layer.mlp.checkpoint_roles()
            for linear, roles in stacked.items():
                for part, role in enumerate(roles):
                    role, _, expert = role.partition("#")
                    name = family.name_of(role, i, int(expert) if expert else None)
                    slots[f"{name}.weight"] = (linear, "weight", part)
                    if linear.bias is not None:
                        slots[f"{name}.bias"] = (linear, "bias", part)
        if not self.config.tie_word_embeddings:
            slots["lm_head.weight"] = (self.lm_head, "weight", 0)
        if isinstance(self.model.embed_tokens, QuantizedEmbedding):
            slots["model.embed_tokens.weight"] = (self.model.embed_tokens, "weight", 0)
        return slots

    def pack(self) -> None:
        """Hands every linear layer's weights to the GEMM library in its own layout, once. A
        tied lm_head stays as it is: packing it would keep a second copy of the embeddings
        (57 MB for the default model in bf16), which the lookup needs in plain rows."""
        for name, module in self.named_modules():
            if isinstance(module, QuantizedLinear):
                module.pack()
            elif isinstance(module, Linear) and not (name == "lm_head" and self.config.tie_word_embeddings):
                module.pack()

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn, logits_rows: torch.Tensor
    ) -> torch.Tensor:
        """input_ids, positions: [T]; logits_rows: [S] rows of the batch to sample from.

        Returns float32 logits [S, vocab].
        """
        return self.logits(self.hidden_states(input_ids, positions, attn), logits_rows)

    @torch.inference_mode()
    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        """[T, hidden]: every token's last hidden state, after the final norm (what embeddings
        pool); the K/V of every layer written to the cache on the way."""
        body = self.model
        h = self.embed(input_ids)  # the residual stream: this step's own buffer, added to in place
        ropes = body.rope_tables(positions, h.dtype, attn.layout)
        program = self.decode_program()
        if program is not None and program.takes(h.shape[0], attn.layout.query_start.numel() - 1, h.dtype, attn.layout):
            return program.run(h, ropes, attn)
        return self.layer_loop(h, ropes, attn)

    @torch.inference_mode()
    def logits(self, x: torch.Tensor, logits_rows: torch.Tensor) -> torch.Tensor:
        """Float32 logits [S, vocab] of rows ``logits_rows`` of ``x`` (``hidden_states``); a split
        model's whole vocabulary on the driver, none on the other ranks."""
        tp = self.tensor_parallel
        h = x.index_select(0, logits_rows)
        del x
        logits = self.lm_head(h)
        if self.config.logits_scaling != 1.0:  # Granite: divided in the activation dtype, as transformers does
            logits = logits / self.config.logits_scaling
        logits = logits.float()
        if tp is None:
            return logits
        whole = tp.gather_rows(logits)  # [R, padded vocabulary] on the driver, None elsewhere
        return whole[:, : self.vocab_size] if whole is not None else logits[:0]

    def layer_loop(self, h: torch.Tensor, ropes: dict[str, tuple[torch.Tensor, torch.Tensor]], attn) -> torch.Tensor:
        """Every decoder layer, then the final norm; ``h`` is added to in place."""
        body, tp, stream = self.model, self.tensor_parallel, self.layer_stream
        layers = body.decoder_layers()
        x = layers[0].input_layernorm(h)
        summed = tp.all_reduce_ if tp is not None else _whole
        if body.residual_multiplier != 1.0:  # Granite: each sub-layer's output scaled before its residual add
            summed = _scaled_by(summed, body.residual_multiplier)
        for i, layer in enumerate(layers):
            if stream is not None:  # a layer read from the file: its weights in its slot first
                stream.before(i)
            # each sub-layer's residual add is fused with the norm that follows it
            x = summed(layer.mixer(x, ropes, attn))
            if layer.attn_out_norm is not None:
                x = layer.attn_out_norm(x)
            x = add_rms_norm(h, x, layer.mlp_norm)
            following = layers[i + 1].input_layernorm if i + 1 < len(layers) else body.norm
            x = summed(layer.mlp(x))
            if layer.post_feedforward_layernorm is not None:
                x = layer.post_feedforward_layernorm(x)
            x = add_rms_norm(h, x, following)
        if stream is not None:
            stream.after_step()
        return x

    def decode_program(self) -> DecodeProgram | None:
        """The compiled decode step, built on first use (the weights are packed by then)."""
        if not self.use_decode_program:
            return None
        if not self._decode_program_built:
            self._decode_program = self.backend.decode_program(self)
            self._decode_program_built = True
        return self._decode_program

    def finish_collectives(self, tokens: int, rows: int) -> None:
        """After this rank's step failed part-way (out of memory), the collectives the other ranks
        still wait for in it, on zeros of the same shapes: the embedding's and two a layer's sums
        of [tokens, hidden], then the logits' gather of [rows, vocabulary rows]."""
        tp = self.tensor_parallel
        assert tp is not None
        cfg = self.config
        dtype = next(p for p in self.parameters() if p.is_floating_point()).dtype
        for _ in range(tp.reduced, 1 + 2 * cfg.num_layers):
            tp.all_reduce_(torch.zeros(tokens, cfg.hidden_size, dtype=dtype))
        if not tp.gathered:
            tp.gather_rows(torch.zeros(rows, cfg.vocab_size))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings; split by vocabulary, each rank looks up the tokens it holds
        (zeros for the others) and the ranks' rows are summed."""
        embed_tokens = self.model.embed_tokens
        if self.tensor_parallel is None:
            return self._scaled(embed_tokens(input_ids))
        local = input_ids - self.vocab_rows.start
        elsewhere = (local < 0) | (local >= len(self.vocab_rows))
        h = embed_tokens(local.masked_fill(elsewhere, 0))
        h.masked_fill_(elsewhere[:, None], 0)
        return self._scaled(self.tensor_parallel.all_reduce_(h))

    def _scaled(self, h: torch.Tensor) -> torch.Tensor:
        """Gemma's embeddings times sqrt(hidden), the multiplier rounded to the activation dtype
        first, as transformers does; in place (``h`` is this step's own)."""
        if self.config.embedding_multiplier != 1.0:
            h.mul_(torch.tensor(self.config.embedding_multiplier, dtype=h.dtype))
        return h


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t


def _scaled_by(summed: Callable[[torch.Tensor], torch.Tensor], multiplier: float):
    """``summed`` then times ``multiplier`` in place (a sub-layer's own output)."""
    return lambda t: summed(t).mul_(multiplier)
