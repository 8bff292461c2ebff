"""A mixture of experts' sparse MLP (Mixtral, OLMoE, Qwen2-MoE, Qwen3-MoE, gpt-oss): a router picks each
token's ``top_k`` experts, each a SwiGLU ``MLP`` of its own, and the token's output is their
outputs weighted by the router's probabilities.

Computed as a memory-bound CPU wants it: the step's (token, expert) pairs are sorted by expert,
so each chosen expert multiplies all of its tokens in one GEMM and its weights are read once per
step; an expert no token chose is never read (a decode step of one token reads ``top_k`` of
them). The router computes in float32 whatever the experts' format, as llama.cpp's does
(``keep_float``; its weights widened to float32 once, at load: ``in_float32``): logits rounded
to bf16 or int8 would choose other experts than float32 does wherever two are close, and a
token sent to another expert is a different answer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from ...config import ModelConfig
from ...layers.linear import Linear
from ...layers.quantized import STORED_FIELDS, QuantizedLinear, stored_weight
from ..dense_mlp.forward import MLP

if TYPE_CHECKING:
    from ...backends.base import Backend
    from ...layers.expert_cache import ExpertCache


# Checkpoint names of the routers (Mixtral's, gpt-oss's, Granite's, the others'), whose weights load as float32.
ROUTER_SUFFIXES = (
    "block_sparse_moe.gate.weight",
    ".mlp.gate.weight",
    ".mlp.router.weight",
    ".mlp.router.bias",
    "block_sparse_moe.router.layer.weight",  # Granite's
)


# the checkpoint's name of the part under ``model.layers.N.``
CHECKPOINT_NAME = "mlp"


def build(cfg: ModelConfig, layer: int, backend: Backend) -> SparseMoE:
    return SparseMoE(cfg, backend)


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: Backend):
        super().__init__()
        moe = cfg.moe
        assert moe is not None
        self.backend = backend
        self.kernel_cache: dict = {}  # what the backend's sparse_experts prepared for this layer, once
        self.top_k, self.normalize, self.softmax_after_topk = moe.top_k, moe.normalize, moe.softmax_after_topk
        self.router = Linear(cfg.hidden_size, [moe.num_experts], bias=moe.router_bias, backend=backend)
        self.router.keep_float = self.router.in_float32 = True
        self.experts = nn.ModuleList(
            MLP(cfg, backend, moe.expert_size, moe.swiglu_limit, moe.swiglu_alpha) for _ in range(moe.num_experts)
        )
        # set when the routed experts stay in the checkpoint (``attach_expert_cache``)
        self.expert_cache: ExpertCache | None = None
        self.layer_index = -1
        self.shared_expert: MLP | None = None
        self.shared_expert_gate: Linear | None = None
        if moe.shared_expert_size:
            self.shared_expert = MLP(cfg, backend, moe.shared_expert_size)
        if moe.shared_expert_size and moe.shared_expert_gated:  # Qwen2-MoE's sigmoid gate; Granite has none
            self.shared_expert_gate = Linear(cfg.hidden_size, [1], bias=False, backend=backend)
            self.shared_expert_gate.keep_float = True

    def checkpoint_roles(self) -> dict[Linear, tuple[str, ...]]:
        """Its linear layers -> the roles of their parts (``family.Family.name_of``), ``#E``
        naming expert E: the router, each expert's gate and up (stacked) and down, and
        Qwen2-MoE's shared expert with its gate."""
        roles: dict[Linear, tuple[str, ...]] = {self.router: ("router",)}
        for e, expert in enumerate(self.expert_mlps()):
            roles[expert.gate_up_proj] = (f"expert_gate#{e}", f"expert_up#{e}")
            roles[expert.down_proj] = (f"expert_down#{e}",)
        if self.shared_expert_gate is not None:
            roles[self.shared_expert_gate] = ("shared_gate",)
        if self.shared_expert is not None:
            roles[self.shared_expert.gate_up_proj] = ("shared_expert_gate", "shared_expert_up")
            roles[self.shared_expert.down_proj] = ("shared_expert_down",)
        return roles

    def expert_mlps(self) -> list[MLP]:
        return cast(list[MLP], list(self.experts))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, top_k] in x's dtype, experts [T, top_k]): the top_k of the softmax of the
        router's float32 logits, renormalised over the chosen where the model does (transformers' order of
        operations, so that ties and roundings fall the same way)."""
        bias = self.router.bias.float() if self.router.bias is not None else None
        logits = torch.nn.functional.linear(x.float(), self.router.weight.float(), bias)  # float32 since loading
        if self.softmax_after_topk:  # gpt-oss: the top_k logits, softmaxed among themselves
            top, experts = torch.topk(logits, self.top_k, dim=-1)
            return torch.softmax(top, dim=-1).to(x.dtype), experts
        probs = torch.softmax(logits, dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def attach_expert_cache(self, cache: ExpertCache, layer: int) -> None:
        """The routed experts live in ``cache``'s slots from now on (none loaded here): each
        expert's layers, and the expert kernel's argument lists, point at its slot while it is
        resident and at nothing otherwise."""
        self.expert_cache, self.layer_index = cache, layer
        layers = [
            (cast(QuantizedLinear, mlp.gate_up_proj), cast(QuantizedLinear, mlp.down_proj))
            for mlp in self.expert_mlps()
        ]
        for pair in layers:
            for linear in pair:
                linear.streamed = True  # its bytes are the cache's
        lists: dict[str, list] = {}
        formats: dict[str, tuple[int, int]] = {}
        placeholder: dict[str, torch.Tensor | None] = {}
        pool = cache.pool_of[layer]
        for projection in ("gate_up", "down"):
            first = {
                p: pool.tensors[f"{projection}.{p}"][0] for p in STORED_FIELDS if f"{projection}.{p}" in pool.tensors
            }
            kind = stored_weight(first["qweight"], first.get("scale"), first.get("zero"))  # slot 0's, as a sample
            formats[projection] = (kind.layout, kind.group)
            for part in STORED_FIELDS:  # a K-quant's blocks have an empty scale of their own, and no zero
                key = f"{projection}.{part}"
                sample = getattr(kind, part)
                placeholder[key] = None if sample is None else sample.new_empty((0,))
                lists[key] = [placeholder[key]] * len(layers)

        def moved(expert: int, slot: int | None) -> None:
            gate_up_proj, down_proj = layers[expert]
            if slot is None:
                for key in lists:
                    lists[key][expert] = placeholder[key]
                gate_up_proj.segments, down_proj.segments = [], []
                return
            gate_up, down = cache.weights(layer, expert)
            for projection, weight in (("gate_up", gate_up), ("down", down)):
                for part in STORED_FIELDS:
                    lists[f"{projection}.{part}"][expert] = getattr(weight, part)
            gate_up_proj.segments, down_proj.segments = [gate_up], [down]

        cache.watch(layer, moved)
        cache.routers[layer], cache.top_k = self.router, self.top_k
        self.kernel_cache["quant_experts"] = (
            *(lists[f"gate_up.{p}"] for p in ("qweight", "scale", "zero")),
            *formats["gate_up"],
            *(lists[f"down.{p}"] for p in ("qweight", "scale", "zero")),
            *formats["down"],
            [],
            [],
            0.0,
            1.0,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        if self.expert_cache is not None:
            out = self._from_cache(self.expert_cache, x, weights, experts)
        else:
            kernel = self.backend.sparse_experts(self, x, weights, experts)
            out = kernel if kernel is not None else self._expert_loop(x, weights, experts)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            gate = torch.sigmoid(self.shared_expert_gate(x))
            out += gate * self.shared_expert(x)
        elif self.shared_expert is not None:
            out += self.shared_expert(x)
        return out

    def _from_cache(
        self, cache: ExpertCache, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
    ) -> torch.Tensor:
        """The layer's experts from the cache's slots: all chosen made resident, then computed as
        loaded ones are; where the pool cannot hold them all at once, one at a time."""
        chosen = torch.unique(experts).tolist()
        if len(chosen) <= cache.slots_of(self.layer_index):
            cache.make_resident(self.layer_index, chosen)
            cache.read_ahead(self.layer_index, x, chosen)
            out = self.backend.sparse_experts(self, x, weights, experts)
            return out if out is not None else self._expert_loop(x, weights, experts)
        return self._expert_loop(x, weights, experts, lambda e: cache.make_resident(self.layer_index, [e]))

    def _expert_loop(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        experts: torch.Tensor,
        before: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """The reference: each chosen expert on its gathered rows, one at a time (``before(e)``
        first, when given: the expert cache reads it)."""
        out = torch.zeros_like(x)
        chosen = experts.flatten()
        order = torch.argsort(chosen, stable=True)  # the (token, expert) pairs grouped by expert
        counts = torch.bincount(chosen, minlength=len(self.experts)).tolist()
        tokens, pair_weights = order // self.top_k, weights.flatten()[order]
        start = 0
        for e, (expert, count) in enumerate(zip(self.experts, counts)):
            if count:
                if before is not None:
                    before(e)
                rows = tokens[start : start + count]
                # unnamed: no expert's output outlives its add (the planner counts one at a time)
                out.index_add_(0, rows, expert(x.index_select(0, rows)).mul_(pair_weights[start : start + count, None]))
                start += count
        return out
