"""Loads an HF checkpoint directory (config.json + *.safetensors, sharded or not) into DecoderLM.

The model is built on the meta device, then each tensor is read from disk straight into its own
parameter (converted to ``dtype`` if needed), so peak RAM is the weights plus one tensor.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from ..config import ModelConfig
from ..errors import ModelLoadError
from ..layers.linear import Linear
from ..memory.machine import return_freed_heap
from ..models import DecoderLM
from .safetensors_io import iter_tensors, read_header

# Buffers some checkpoints carry that we recompute.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, UnicodeDecodeError):
            raise ModelLoadError(f"{index}: corrupt index (no weight_map)") from None
        files = [model_dir / f for f in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index}: shard(s) missing: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        others = [p.name for p in model_dir.glob("*.bin")] + [p.name for p in model_dir.glob("*.pt*")]
        hint = f" (found {', '.join(others)}: only safetensors is supported)" if others else ""
        raise ModelLoadError(f"{model_dir}: no *.safetensors weights{hint}")
    return files


def load_decoder(model_dir: Path, dtype: torch.dtype) -> DecoderLM:
    cfg = ModelConfig.from_file(model_dir)
    files = safetensors_files(model_dir)
    headers = [(f, *read_header(f)) for f in files]  # validate every file before reading any
    with torch.device("meta"):
        model = DecoderLM(cfg)
    slots = model.checkpoint_slots()
    loaded: set[str] = set()

    def destination(name: str) -> torch.Tensor | None:
        """Stacked layers' rows, so their tensors are read in place."""
        module, leaf, part = slots.get(name, (None, "", None))
        if isinstance(module, Linear) and part is not None:
            return module.part_view(leaf, part, dtype)
        return None

    for path, header, start in headers:
        for name, tensor in iter_tensors(path, header, start, dtype, destination):
            if name.endswith(_IGNORED_SUFFIXES) or (cfg.tie_word_embeddings and name == "lm_head.weight"):
                continue
            if name not in slots:
                raise ModelLoadError(f"{path}: unexpected tensor {name!r} for {cfg.architecture}")
            module, leaf, part = slots[name]
            param = getattr(module, leaf)
            if isinstance(module, Linear) and part is not None:
                want = (module.parts[part], *param.shape[1:])
            else:
                want = tuple(param.shape)
            if tuple(tensor.shape) != want:
                raise ModelLoadError(
                    f"{path}: tensor {name!r} has shape {tuple(tensor.shape)}, config.json implies {want}"
                )
            if isinstance(module, Linear) and part is not None:
                module.load_part(leaf, part, tensor)
            else:
                module._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)
            loaded.add(name)
    missing = sorted(set(slots) - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ModelLoadError(f"{model_dir}: checkpoint lacks {len(missing)} tensor(s): {shown}")
    if cfg.tie_word_embeddings:
        model.tie_embeddings()
    model.pack()
    return_freed_heap()  # the plain copies packing replaced
    return model.eval()
