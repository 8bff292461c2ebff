"""Turns what the user named (nothing, a model directory, a .gguf file) into weights and tokenizer.

Every path ends in an HF-style directory: a GGUF file is converted once into the cache, then
loaded like any checkpoint. Nothing is ever downloaded.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import ModelConfig
from ..errors import ModelLoadError
from ..sizes import torch_dtype
from .checkpoint_facts import Checkpoint, checkpoint_of
from .default_model import DEFAULT_MODEL_NAME, default_gguf_path
from .generation_config import sampling_defaults
from .gguf_cache import converted_dir

if TYPE_CHECKING:  # torch is imported by the functions that load weights, not by this package:
    import torch  # a server's API process reads tokenizers through it and holds no torch

    from ..backends.base import Backend
    from ..distributed.shards import RankShard
    from ..engine_config import EngineConfig
    from ..memory.footprint import RoutedExperts, StreamableLayers
    from ..models import DecoderLM

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: DecoderLM
    config: ModelConfig
    tokenizer: Any  # loading.tokenizer.Tokenizer (or a transformers one), None for a weights-only directory
    path: Path  # the HF-style directory the weights came from
    name: str
    sampling_defaults: dict = field(default_factory=dict)  # the model's own (generation_config.json)


def resolve_model_dir(model: str | Path | None) -> tuple[Path, str]:
    """(HF-style directory, display name) for what the user named."""

    if model is None:
        return converted_dir(default_gguf_path()), DEFAULT_MODEL_NAME
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path}: a model directory needs config.json and *.safetensors")
        return path, path.name
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"{path}: no such file")
        return converted_dir(path), path.stem
    if not path.exists():
        raise ModelLoadError(
            f"{model}: no such file or directory. pagedllm loads a local HF directory "
            "(config.json + *.safetensors) or a .gguf file; it never downloads from a model hub"
        )
    raise ModelLoadError(f"{path}: not a model directory or a .gguf file")


def load(
    model: str | Path | None = None,
    dtype: str | torch.dtype = "float32",
    quantization: str | None = None,
    backend: Backend | None = None,
) -> LoadedModel:
    model_dir, name = resolve_model_dir(model)
    return load_dir(model_dir, name, dtype, quantization=quantization, backend=backend)


def load_dir(
    model_dir: Path | Checkpoint,
    name: str,
    dtype: str | torch.dtype = "float32",
    tokenizer: Any = None,
    quantization: str | None = None,
    backend: Backend | None = None,
    shard: RankShard | None = None,
    expert_slots: int = 0,
    streamed_layers: tuple[int, int] = (0, 0),
) -> LoadedModel:
    """Weights (and the tokenizer, unless the caller loaded it already) of an HF-style directory;
    ``quantization``, ``backend``, ``shard``, ``expert_slots`` and ``streamed_layers`` as
    ``checkpoint.load_decoder`` takes them; ``model_dir`` read already (``Checkpoint``) or not."""
    from .checkpoint import load_decoder

    ckpt = checkpoint_of(model_dir)
    model_dir = ckpt.model_dir
    decoder = load_decoder(ckpt, torch_dtype(dtype), quantization, backend, shard, expert_slots, streamed_layers)
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model_dir)
    config = shard.cfg if shard is not None else decoder.config  # the whole model's, not the rank's
    return LoadedModel(decoder, config, tokenizer, model_dir, name, sampling_defaults(model_dir))


def checkpoint_weights(
    source: Path | Checkpoint, dtype: str, quantization: str | None, shard: RankShard | None = None
) -> tuple[int, bool]:
    """(bytes, quantized) of the weights as they will be loaded (``checkpoint.checkpoint_weights``)."""
    from .checkpoint import checkpoint_weights as weights

    return weights(source, dtype, quantization, shard)


def routed_experts(source: Path | Checkpoint, quantization: str | None, required: bool = False) -> RoutedExperts | None:
    """A mixture's routed experts as stored, for a residency plan (``checkpoint.routed_experts``)."""
    from .checkpoint import routed_experts as routed

    return routed(source, quantization, required)


def streamable_layers(
    source: Path | Checkpoint, quantization: str | None, required: bool = False
) -> StreamableLayers | None:
    """A dense model's layers as stored, for a residency plan (``streamed_layers.streamable_layers``)."""
    from .streamed_layers import streamable_layers as streamable

    return streamable(checkpoint_of(source), quantization, required)


def planning_facts(ckpt: Checkpoint, config: EngineConfig, shard: RankShard | None = None) -> dict[str, Any]:
    """What the planner reads of a checkpoint (``plan_engine``'s ``weights_bytes``,
    ``quantized_weights``, ``routed``, ``layers``), from one reading of it: the builder's and
    ``pagedllm plan``'s alike. A split model's (``shard``) keeps every expert and layer resident."""
    weights, quantized = checkpoint_weights(ckpt, config.dtype, config.quantization, shard)
    facts: dict[str, Any] = {"weights_bytes": weights, "quantized_weights": quantized}
    if shard is None:
        facts["routed"] = routed_experts(ckpt, config.quantization, config.expert_slots is not None)
        if ckpt.config.moe is None:
            facts["layers"] = streamable_layers(ckpt, config.quantization, config.resident_layers is not None)
    return facts


def load_tokenizer(model_dir: Path):
    """The directory's tokenizer, or None. A ``tokenizer.json`` loads into pagedllm's own
    ``Tokenizer`` (the Rust tokenizers library and jinja2, as transformers uses them): importing
    transformers for it would cost ~67 MiB resident in every process. Anything else (a
    sentencepiece ``tokenizer.model``) still goes through transformers' ``AutoTokenizer``."""
    if not any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        return None
    try:
        if (model_dir / "tokenizer.json").is_file():
            from .tokenizer import Tokenizer

            return Tokenizer.from_dir(model_dir)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as e:
        raise ModelLoadError(f"{model_dir}: cannot load its tokenizer ({type(e).__name__}: {e})") from None
