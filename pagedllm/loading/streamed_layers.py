"""What a dense model's layer stream needs of the checkpoint (``layers/layer_stream.py``): where
each decoder layer's quantized matrices lie in the files, and what the planner needs of that
(``StreamableLayers``: each layer's bytes in a slot). Only a checkpoint that stores every layer
matrix quantized, each part in a tensor of its own, streams: those bytes are what the kernels
read (a converted GGUF file's), so a slot holds the file's bytes as they are.
"""

from __future__ import annotations

import torch

from ..config import ModelConfig
from ..engine_config import ConfigError
from ..errors import ModelLoadError
from ..layers.codebooks import CODEBOOKS
from ..layers.layer_stream import FIELDS, MATRICES, StoredLayer, StoredSegment, layer_bytes
from ..layers.quantized import columns_of, stored_bits
from ..layers.stored_reads import StoredTensor
from ..memory.footprint import StreamableLayers
from .checkpoint_facts import Checkpoint
from .safetensors_io import DTYPES


def stored_tensors(headers) -> dict[str, StoredTensor]:
    """Every tensor of the files (``(path, header, data start)`` each) by name: where its bytes are."""
    where: dict[str, StoredTensor] = {}
    for path, header, start in headers:
        for name, e in header.items():
            begin, end = e["data_offsets"]
            where[name] = StoredTensor(path, start + begin, end - begin, DTYPES[e["dtype"]], tuple(e["shape"]))
    return where


def stored_layers(cfg: ModelConfig, headers) -> tuple[dict[int, StoredLayer], str]:
    """Every decoder layer's quantized matrices as stored, and ""; or ({}, why they cannot stream)."""
    if cfg.moe is not None:
        return {}, "it is a mixture of experts (its routed experts stay in the file instead)"
    if cfg.family.unfuse is not None:
        return {}, "its checkpoint fuses matrices that its layers split (q/k/v, gate/up)"
    where, family = stored_tensors(headers), cfg.family
    out: dict[int, StoredLayer] = {}
    for layer in range(cfg.num_layers):
        stored: StoredLayer = {}
        for path, roles in MATRICES.items():
            runs: list[tuple[tuple, dict[str, list[StoredTensor]], str | None]] = []
            for role in roles:
                base = f"{family.name_of(role, layer)}.weight"
                fields = {f: where[f"{base}.{f}"] for f in FIELDS if f"{base}.{f}" in where}
                if "qweight" not in fields or ("scale" not in fields and len(fields["qweight"].shape) != 3):
                    return {}, "its layers' matrices are not all stored quantized (a GGUF file's are)"
                codes = where.get(f"{base}.codes")
                codebook = _codebook(codes, base) if codes is not None else None
                key = _format(fields, codebook)
                if runs and runs[-1][0] == key:  # stacked with the part before, as QuantizedLinear.pack does
                    for f, part in fields.items():
                        runs[-1][1][f].append(part)
                else:
                    runs.append((key, {f: [part] for f, part in fields.items()}, codebook))
            stored[path] = [StoredSegment(fields, codebook) for _, fields, codebook in runs]
        out[layer] = stored
    return out, ""


def streamable_layers(ckpt: Checkpoint, quantization: str | None, required: bool = False) -> StreamableLayers | None:
    """What a residency plan needs of a dense model's layers (``StreamableLayers``), or None where
    they cannot stream (a mixture, quantized at load, stored in float); then a ``ConfigError`` on
    ``resident_layers`` saying why, when ``required`` (the user set it)."""
    cfg = ckpt.config
    why = f"quantization={quantization!r} quantizes them at load; their files hold other values" if quantization else ""
    layers: dict[int, StoredLayer] = {}
    if not why:
        layers, why = stored_layers(cfg, list(ckpt.headers))
    if not layers:
        if required:
            raise ConfigError("resident_layers", f"{ckpt.model_dir}: its layers cannot be read from the file: {why}")
        return None
    return StreamableLayers(tuple(layer_bytes(layers[i]) for i in range(cfg.num_layers)))


def streamed_names(cfg: ModelConfig, layers: dict[int, StoredLayer]) -> set[str]:
    """The checkpoint names (``<name>.weight``) of the streamed layers' matrices: not loaded."""
    family = cfg.family
    return {f"{family.name_of(role, i)}.weight" for i in layers for roles in MATRICES.values() for role in roles}


def _format(fields: dict[str, StoredTensor], codebook: str | None) -> tuple:
    """What must agree for two parts to stack (``QuantizedWeight.format``): bits, codebook, group, offsets."""
    q = fields["qweight"]
    if len(q.shape) == 3:  # a K-quant's blocks: their size names the type
        return "blocks", q.shape[2]
    scale = fields["scale"]
    groups = scale.shape[1]
    bits = stored_bits(q.dtype, q.shape[1], groups)
    return bits, codebook, columns_of(bits, q.shape[1]) // max(1, groups), "zero" in fields, scale.dtype


def _codebook(codes: StoredTensor, name: str) -> str:
    """The kernels' codebook whose 16 values the file's codes tensor holds."""
    with open(codes.file, "rb") as f:
        f.seek(codes.offset)
        values = tuple(int(v) for v in torch.frombuffer(bytearray(f.read(codes.nbytes)), dtype=torch.int8).tolist())
    found = next((c for c, table in CODEBOOKS.items() if table == values), None)
    if found is None:
        raise ModelLoadError(f"{codes.file}: {name}'s 4-bit codes are {list(values)}, no codebook the kernels read")
    return found
