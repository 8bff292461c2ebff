"""Loads an HF checkpoint directory (config.json + *.safetensors, sharded or not) into DecoderLM.

The model is built on the meta device, then each tensor is read from disk straight into its own
parameter (converted to ``dtype`` if needed), so peak RAM is the weights plus one tensor.

``quantization`` says what becomes of the weights: None keeps each as stored (a quantized tensor,
``<name>.qweight`` / ``.scale`` / ``.zero`` as a converted GGUF has them, runs quantized; a float
one runs in ``dtype``); "int8" / "int4" quantize the float linear weights tensor by tensor as they
are read (embeddings and lm_head in int8; a tensor stored quantized is kept as stored); "w8a8"
stores every matrix in int8 per row, a tensor stored quantized dequantized and quantized again,
and multiplies in integers (``layers/quantized.py``); "none" dequantizes everything to ``dtype``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import cast

import torch
from torch import nn

from ..backends.base import Backend
from ..config import ModelConfig
from ..distributed.shards import RankShard, Slice
from ..engine_config import ConfigError
from ..errors import ModelLoadError
from ..kinds.sparse_moe.forward import ROUTER_SUFFIXES, SparseMoE
from ..layers.codebooks import CODEBOOKS
from ..layers.expert_cache import FIELDS, PROJECTIONS, ExpertCache, kind_of
from ..layers.layer_stream import LayerStream
from ..layers.linear import Linear, StackedRows
from ..layers.norm import RMSNorm
from ..layers.quantized import (
    INT8_COMPUTE,
    QuantizedEmbedding,
    QuantizedLinear,
    QuantizedWeight,
    columns_of,
    stored_bits,
    stored_weight,
)
from ..layers.stored_reads import StoredTensor
from ..layers.superblocks import SUPERBLOCK
from ..memory.footprint import RoutedExperts, expert_slot_floor
from ..memory.machine import return_freed_heap
from ..models import DecoderLM
from ..sizes import QUANTIZATIONS, QUANTIZED
from .checkpoint_facts import Checkpoint, checkpoint_of
from .gguf_convert import CODES, QUANTIZED_FIELDS
from .safetensors_io import iter_tensors
from .streamed_layers import stored_layers, stored_tensors, streamed_names

# Buffers some checkpoints carry that we recompute.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

log = logging.getLogger(__name__)


def stored_experts(cfg: ModelConfig, headers) -> tuple[dict[tuple[int, int], dict[str, list[StoredTensor]]], str]:
    """Where every routed expert's quantized matrices are in the files, by the expert cache's
    slot fields (``layers/expert_cache.py``), and "" ; or ({}, why they cannot be read so)."""
    if cfg.moe is None:
        return {}, "the model has no routed experts"
    where, family = stored_tensors(headers), cfg.family
    out: dict[tuple[int, int], dict[str, list[StoredTensor]]] = {}
    for layer in range(cfg.num_layers):
        if not cfg.is_moe_layer(layer):
            continue
        for e in range(cfg.moe.num_experts):
            fields: dict[str, list[StoredTensor]] = {}
            for projection, roles in PROJECTIONS.items():
                for field in FIELDS:
                    parts = [where.get(f"{family.name_of(role, layer, e)}.weight.{field}") for role in roles]
                    if field == "zero" and all(p is None for p in parts):
                        continue
                    if any(p is None for p in parts):
                        return (
                            {},
                            "its experts are not stored quantized, each in a tensor of its own (a GGUF file's are)",
                        )
                    fields[f"{projection}.{field}"] = cast(list[StoredTensor], parts)
                if f"{family.name_of(roles[0], layer, e)}.weight.codes" in where:
                    return {}, "its experts are stored as 4-bit codes"
            for stacked in fields.values():
                if len({(p.dtype, p.shape[1:]) for p in stacked}) != 1:
                    return {}, f"layer {layer}'s expert {e} stores gate and up in different formats"
            out[(layer, e)] = fields
    return out, ""


def routed_experts(source: Path | Checkpoint, quantization: str | None, required: bool = False) -> RoutedExperts | None:
    """What a residency plan needs of the checkpoint's routed experts (``RoutedExperts``), or None
    where they cannot stay in the files (no mixture, quantized at load, stored in float); then a
    ``ConfigError`` on ``expert_slots`` saying why, when ``required`` (the user set it)."""
    ckpt = checkpoint_of(source)
    cfg = ckpt.config
    why = "the model has no routed experts" if cfg.moe is None else ""
    if not why and quantization is not None:
        why = f"quantization={quantization!r} quantizes them at load; their files hold other values"
    experts: dict = {}
    if not why:
        experts, why = stored_experts(cfg, list(ckpt.headers))
    if not experts:
        if required:
            raise ConfigError("expert_slots", f"{ckpt.model_dir}: its experts cannot be read from the file: {why}")
        return None
    return _routed_facts(cfg, experts)


def _routed_facts(cfg: ModelConfig, experts: dict[tuple[int, int], dict[str, list[StoredTensor]]]) -> RoutedExperts:
    sizes = [sum(p.nbytes for parts in fields.values() for p in parts) for fields in experts.values()]
    kinds = {kind_of(fields) for fields in experts.values()}
    return RoutedExperts(sum(sizes), max(sizes), len(sizes), expert_slot_floor(cfg) * len(kinds))


def load_decoder(
    source: Path | Checkpoint,
    dtype: torch.dtype,
    quantization: str | None = None,
    backend: Backend | None = None,
    shard: RankShard | None = None,
    expert_slots: int = 0,
    streamed_layers: tuple[int, int] = (0, 0),
) -> DecoderLM:
    """``backend``: what the model computes with (default: ``backends.get()``, as
    PAGEDLLM_KERNELS says); weights it re-lays out are packed by it after loading. ``shard``:
    load one rank of a split model, reading only its slice of each tensor. ``expert_slots``:
    above 0, the routed experts stay in the files and that many of them are resident at once
    (``layers/expert_cache.py``). ``streamed_layers``: (resident, slots): layers from ``resident`` on read each step."""
    backend = backend or _default_backend()
    _check_quantization(quantization)
    ckpt = checkpoint_of(source)  # every file's header validated before any tensor is read
    ckpt.check_unchanged()  # (read at planning: the files must still be what they described)
    model_dir, cfg, headers = ckpt.model_dir, ckpt.config, list(ckpt.headers)
    stored = _stored_quantized(headers)
    experts, streamed = _streamed_experts(model_dir, cfg, headers, expert_slots, shard, quantization)
    streamed |= streamed_names(
        cfg, layers := _streamed_layers(model_dir, cfg, headers, streamed_layers, shard, quantization)
    )
    with torch.device("meta"):
        model = DecoderLM(cfg, backend, shard)
    _choose_quantized(model, stored, quantization, dtype)
    slots = model.checkpoint_slots()
    loaded: set[str] = set()
    pieces: dict[str, dict[str, torch.Tensor]] = {}  # a quantized tensor's parts read so far

    place = _placer(cfg, slots, loaded, dtype, backend, shard)
    select = _rank_slices(path_of=model_dir, shard=shard) if shard is not None else None
    unfuse = cfg.family.unfuse or (lambda name, value, cfg: None)

    destination = _row_views(slots, dtype)
    wanted = (lambda name: name.rpartition(".")[0] not in streamed) if streamed else (lambda name: True)
    loaded.update(streamed)
    for path, header, start in headers:
        for name, tensor in iter_tensors(path, header, start, dtype, destination, _kept_as_stored, select, wanted):
            value: torch.Tensor | QuantizedWeight = tensor
            if _kept_as_stored(name):
                base, _, field = name.rpartition(".")
                pieces.setdefault(base, {})[field] = tensor
                if set(pieces[base]) != stored[base]:
                    continue
                name, value = base, _quantized_weight(path, base, pieces.pop(base))
            if name.endswith(_IGNORED_SUFFIXES) or (cfg.tie_word_embeddings and name == "lm_head.weight"):
                continue
            if (parts := unfuse(name, value, cfg)) is not None:
                for part_name, part in parts:  # gpt-oss's fused experts, Phi-3's q/k/v and gate/up
                    place(path, part_name, cast(torch.Tensor | QuantizedWeight, part))
            else:
                place(path, name, value)
    missing = sorted(set(slots) - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ModelLoadError(f"{model_dir}: checkpoint lacks {len(missing)} tensor(s): {shown}")
    return _finished(model, cfg, (experts, expert_slots), (layers, streamed_layers[1]))


def _kept_as_stored(name: str) -> bool:
    """A quantized tensor's part (codes, scales): read in its own dtype, not converted."""
    return name.endswith(QUANTIZED_FIELDS)


def _row_views(slots: dict, dtype: torch.dtype):
    """name -> the rows of a float stacked layer its tensor fills (read there in place), or None."""

    def destination(name: str) -> torch.Tensor | None:
        module, leaf, part = slots.get(name, (None, "", None))
        if isinstance(module, Linear) and part is not None:
            return module.part_view(leaf, part, dtype)
        return None

    return destination


def _finished(model: DecoderLM, cfg: ModelConfig, experts: tuple[dict, int], layers: tuple[dict, int]) -> DecoderLM:
    """Every tensor read: the embeddings tied, the expert cache ((experts, slots)) and the layer
    stream ((layers, slots)) attached where they stay in the files, the weights packed."""
    if cfg.tie_word_embeddings:
        model.tie_embeddings()
    if experts[0]:
        cache = ExpertCache(experts[0], experts[1], expert_slot_floor(cfg))
        cache.facts = _routed_facts(cfg, experts[0])
        _attach_expert_cache(model, cache)
    if layers[0]:
        model.layer_stream = LayerStream(layers[0], layers[1], model.model.decoder_layers())
    model.pack()
    return_freed_heap()  # the plain copies packing replaced
    return model.eval()


def _streamed_experts(
    model_dir: Path, cfg: ModelConfig, headers, expert_slots: int, shard: RankShard | None, quantization: str | None
) -> tuple[dict[tuple[int, int], dict[str, list[StoredTensor]]], set[str]]:
    """(where each routed expert is stored, the checkpoint names of their weights: not loaded)
    when ``expert_slots`` says they stay in the files; ({}, set()) otherwise."""
    if not expert_slots:
        return {}, set()
    if shard is not None or quantization is not None:
        raise ModelLoadError(
            f"{model_dir}: the weights exceed the budget; reading experts from the file works for a model "
            "of one rank with its weights as stored (no tensor_parallel_size, no quantization)"
        )
    experts, why = stored_experts(cfg, headers)
    if not experts:
        raise ModelLoadError(
            f"{model_dir}: the weights exceed the budget and {why}: its experts cannot be read from the file"
        )
    family = cfg.family
    names = {
        f"{family.name_of(role, layer, e)}.weight"
        for layer, e in experts
        for roles in PROJECTIONS.values()
        for role in roles
    }
    return experts, names


def _streamed_layers(
    model_dir: Path, cfg: ModelConfig, headers, plan: tuple[int, int], shard: RankShard | None, quantization
) -> dict:
    """Where each streamed decoder layer is stored (``plan``: (resident layers, slots)), or {}."""
    resident, slots = plan
    if not slots:
        return {}
    if shard is not None or quantization is not None:
        raise ModelLoadError(
            f"{model_dir}: the weights exceed the budget; reading layers from the file works for a model "
            "of one rank with its weights as stored (no tensor_parallel_size, no quantization)"
        )
    layers, why = stored_layers(cfg, headers)
    if not layers:
        raise ModelLoadError(f"{model_dir}: the weights exceed the budget and {why}: its layers cannot be streamed")
    return {i: layers[i] for i in range(resident, cfg.num_layers)}


def _attach_expert_cache(model: DecoderLM, cache: ExpertCache) -> None:
    model.expert_cache = cache
    for layer, decoder_layer in enumerate(model.model.decoder_layers()):
        if isinstance(decoder_layer.mlp, SparseMoE):
            decoder_layer.mlp.attach_expert_cache(cache, layer)


def _placer(
    cfg: ModelConfig, slots: dict, loaded: set[str], dtype: torch.dtype, backend: Backend, shard: RankShard | None
):
    """What puts one checkpoint tensor into its slot (``DecoderLM.checkpoint_slots``), recording
    its name in ``loaded``."""

    offset = cfg.family.norm_weight_offset
    skipped, skipped_seen = cfg.family.skipped_prefixes, list[str]()

    def place(path: Path, name: str, value: torch.Tensor | QuantizedWeight) -> None:
        """One checkpoint tensor into its slot, converted as the slot holds it."""
        if name not in slots and skipped and name.startswith(skipped):
            if not skipped_seen:
                log.info("%s: tensors under %s skipped (a head pagedllm does not run yet)", path, ", ".join(skipped))
            skipped_seen.append(name)
            return
        if name not in slots:
            raise ModelLoadError(f"{path}: unexpected tensor {name!r} for {cfg.architecture}")
        module, leaf, part = slots[name]
        stacked = module if isinstance(module, StackedRows) else None
        want = stacked.part_shape(leaf, part or 0) if stacked is not None else tuple(getattr(module, leaf).shape)
        if shard is not None:
            value = _fit_to_rank(value, shard.slice_of(name), want)
        if tuple(value.shape) != tuple(want):
            raise ModelLoadError(f"{path}: tensor {name!r} has shape {tuple(value.shape)}, config.json implies {want}")
        if isinstance(value, QuantizedWeight) and getattr(module, "requantize", False):
            value = backend.dequantize(value, torch.float32)  # quantized again by load_part
        if isinstance(value, QuantizedWeight):
            if isinstance(module, (QuantizedLinear, QuantizedEmbedding)) and leaf == "weight":
                module.load_quantized_part(part or 0, value)
                loaded.add(name)
                return
            value = backend.dequantize(value, dtype)  # a float layer: "none", or a stack not all quantized
        if stacked is not None:
            stacked.load_part(leaf, part or 0, value)
        else:
            if isinstance(module, RMSNorm) and offset:
                value = value.float() + offset  # Gemma's (1 + weight), added in float32 as transformers does
            module._parameters[leaf] = nn.Parameter(value.to(dtype), requires_grad=False)
        loaded.add(name)

    return place


def _default_backend() -> Backend:
    from .. import backends

    return backends.get()


def _check_quantization(quantization: str | None) -> None:
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(
            f"quantization {quantization!r}: choose one of {', '.join(QUANTIZATIONS)} (or None: as stored)"
        )


def checkpoint_weights(
    source: Path | Checkpoint, dtype: str, quantization: str | None, shard: RankShard | None = None
) -> tuple[int, bool]:
    """(bytes, whether they run quantized) of the loaded weights, from the checkpoint's headers
    alone: the planner's figures when the checkpoint is at hand (exact for tensors kept as
    stored, whatever their format). ``shard``: one rank's, as ``load_decoder`` holds them (its
    slices, its vocabulary rows padded, zeros for a row-parallel bias off rank 0)."""
    from ..memory.footprint import weight_bytes
    from ..sizes import dtype_bytes

    ckpt = checkpoint_of(source)
    cfg, headers = ckpt.config, list(ckpt.headers)
    stored = _stored_quantized(headers)
    if quantization is not None or not stored:
        local = shard.local_config if shard is not None else cfg
        return weight_bytes(local, dtype, quantization), quantization in QUANTIZED
    total = 0
    for _, header, _ in headers:
        for name, e in header.items():
            if name.endswith(_IGNORED_SUFFIXES) or (cfg.tie_word_embeddings and name == "lm_head.weight"):
                continue
            if name.endswith(CODES):  # a codebook's 16 values: the kernels hold their own table
                continue
            begin, end = e["data_offsets"]
            held = _held_fraction(shard, name, e) if shard is not None else 1.0
            if name.endswith(QUANTIZED_FIELDS):
                total += round((end - begin) * held)
            else:
                count = 1
                for d in e["shape"]:
                    count *= int(d)
                value_bytes = 4 if name.endswith(ROUTER_SUFFIXES) else dtype_bytes(dtype)  # float32 routers
                total += round(count * held) * value_bytes
    return total, True


def _held_fraction(shard: RankShard, name: str, entry: dict) -> float:
    """How much of a stored tensor one rank holds, as a fraction of it (above 1 for vocabulary
    rows padded to the rank's equal share)."""
    base = name.rpartition(".")[0] if name.endswith(QUANTIZED_FIELDS) else name
    part = shard.slice_of(base)
    if part is None or part.zero:
        return 1.0
    if base in ("model.embed_tokens.weight", "lm_head.weight"):
        return shard.layout.vocab / part.total
    return (part.stop - part.start) / part.total


def _stored_quantized(headers) -> dict[str, set[str]]:
    """Names of the tensors stored quantized -> the fields stored for each ('qweight', 'scale',
    'zero', 'codes')."""
    out: dict[str, set[str]] = {}
    for _, header, _ in headers:
        for name in header:
            if name.endswith(QUANTIZED_FIELDS):
                base, _, field = name.rpartition(".")
                out.setdefault(base, set()).add(field)
    return out


def _quantized_weight(path: Path, name: str, fields: dict[str, torch.Tensor]) -> QuantizedWeight:
    q, scale, zero = fields.get("qweight"), fields.get("scale"), fields.get("zero")
    codebook = None
    if "codes" in fields:  # 4-bit codes: the 16 values they stand for name one of the kernels' codebooks
        values = tuple(int(v) for v in fields["codes"].reshape(-1).tolist())
        codebook = next((c for c, table in CODEBOOKS.items() if table == values), None)
        if codebook is None or q is None or q.dtype != torch.uint8:
            raise ModelLoadError(
                f"{path}: quantized tensor {name!r} has 4-bit codes of values {list(values)}, not one of the "
                f"codebooks the kernels read ({', '.join(CODEBOOKS)})"
            )
    if q is not None and q.dim() == 3:  # a K-quant's blocks as the file stores them
        if scale is not None or zero is not None or codebook is not None:
            raise ModelLoadError(f"{path}: quantized tensor {name!r} has blocks and a scale, zero or codes beside them")
        try:
            return stored_weight(q, None, None)
        except ValueError as e:
            raise ModelLoadError(f"{path}: quantized tensor {name!r}: {e}") from None
    if (
        q is None
        or scale is None
        or q.dim() != 2
        or scale.dim() != 2
        or scale.dtype not in (torch.float32, torch.float16, torch.uint8)
    ):
        raise ModelLoadError(f"{path}: quantized tensor {name!r} lacks a 2-D qweight or a float32/float16/uint8 scale")
    cols = columns_of(stored_bits(q.dtype, q.shape[1], scale.shape[1]), q.shape[1])
    if q.dtype not in (torch.uint8, torch.int8) or scale.shape[0] != q.shape[0] or cols % max(1, scale.shape[1]):
        raise ModelLoadError(f"{path}: quantized tensor {name!r} has inconsistent qweight/scale shapes")
    if scale.dtype != torch.float32 and cols != 32 * scale.shape[1]:
        raise ModelLoadError(
            f"{path}: quantized tensor {name!r} has {scale.dtype} scales, which the kernels read per 32 columns only"
        )
    if scale.dtype == torch.uint8 and zero is not None:
        raise ModelLoadError(f"{path}: quantized tensor {name!r} has exponent scales (MXFP4's) and offsets")
    if zero is not None and (zero.shape != scale.shape or zero.dtype != scale.dtype):
        raise ModelLoadError(f"{path}: quantized tensor {name!r}: zero and scale shapes or dtypes differ")
    return stored_weight(q, scale, zero, codebook)


def _choose_quantized(model: DecoderLM, stored: dict[str, set[str]], quantization: str | None, dtype) -> None:
    """Which layers run quantized, and how their float tensors get so (see the module docstring)."""
    if quantization == "none":
        return
    by_module: dict[str, list[str]] = {}
    modules = {id(m): name for name, m in model.named_modules()}
    for hf, (module, leaf, _) in model.checkpoint_slots().items():
        if leaf == "weight":
            by_module.setdefault(modules[id(module)], []).append(hf.removesuffix(".weight"))
    schemes: dict[str, str | None] = {}
    for name, module in model.linear_layers().items():
        if (name == "lm_head" and model.config.tie_word_embeddings) or getattr(module, "keep_float", False):
            continue
        parts = by_module.get(name, [])
        if quantization is not None:
            schemes[name] = "int8" if name == "lm_head" and quantization != INT8_COMPUTE else quantization
        elif parts and all(f"{p}.weight" in stored for p in parts):
            schemes[name] = None
    embed = "model.embed_tokens.weight"
    embedding: str | None | bool = False
    if quantization is not None:
        embedding = "int8"
    elif embed in stored:
        embedding = None
    model.use_quantized(schemes, embedding, dtype)


def _rank_slices(path_of: Path, shard: RankShard):
    """``iter_tensors``' ``select`` for one rank: its part of each stored tensor, in the stored
    tensor's own elements. A quantized tensor (``<name>.qweight`` / ``.scale`` / ``.zero``) is
    cut along its columns only at whole groups of the quantization: a cut inside one is an error
    naming the tensor."""

    fused_part = shard.cfg.family.fused_rank_part

    def select(name: str, entry: dict) -> tuple[int, int, int] | None:
        base, field = name, ""
        if name.endswith(QUANTIZED_FIELDS):
            base, _, field = name.rpartition(".")
        part = shard.slice_of(base)
        if part is None and fused_part is not None and not field:  # gpt-oss's experts: unfused from the rank's run
            return fused_part(name, tuple(int(d) for d in entry["shape"]), shard.range_of)
        if part is None or field == "codes":  # a codebook's 16 values: every rank reads them whole
            return None
        if part.zero:
            return (0, 0, 0)  # nothing read: the rank holds zeros (``_fit_to_rank``)
        if not field or part.dim == 0:
            return part.dim, part.start, part.stop
        columns = int(entry["shape"][1])
        if field == "qweight" and len(entry["shape"]) == 3:
            group = SUPERBLOCK  # a K-quant's blocks: whole blocks of 256 columns, [rows, blocks, bytes]
        elif field == "qweight":
            group = 32 if entry["dtype"] == "U8" else 1  # 4-bit: a group's 32 columns share 16 bytes
        else:
            group = part.total // columns  # one scale (and zero) per group of columns
        if part.start % group or part.stop % group:
            raise ModelLoadError(
                f"{path_of}: tensor {base!r} is quantized in groups of {group} columns; tensor parallelism "
                f"cuts it at columns {part.start}-{part.stop}, inside a group: choose a tensor_parallel_size "
                "that splits its width into whole groups, or a float checkpoint"
            )
        return 1, part.start * columns // part.total, part.stop * columns // part.total

    return select


def _fit_to_rank(value: torch.Tensor | QuantizedWeight, part: Slice | None, want: tuple[int, ...]):
    """What a rank keeps of a tensor it read: zeros for a row-parallel bias off rank 0; its
    vocabulary rows padded with zero rows to the rank's equal share."""
    if part is None:
        return value
    if part.zero:
        assert isinstance(value, torch.Tensor)
        return value.new_zeros(want)
    missing = want[0] - value.shape[0]
    if missing <= 0 or part.dim != 0:
        return value
    if isinstance(value, QuantizedWeight):

        def padded(t: torch.Tensor) -> torch.Tensor:
            return torch.cat([t, t.new_zeros(missing, *t.shape[1:])])

        zero = None if value.zero is None else padded(value.zero)
        return QuantizedWeight(
            padded(value.qweight),
            padded(value.scale),
            zero,
            value.bits,
            value.group,
            value.codebook,
            value.block_type,
        )
    return torch.cat([value, value.new_zeros(missing, *value.shape[1:])])
