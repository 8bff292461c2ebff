"""A checkpoint as one build reads it: config.json parsed once, every safetensors header once.

The planner (its weights, the experts and layers that may stay in the files), ``pagedllm plan``
and the loader all ask one ``Checkpoint`` instead of re-reading the directory (a build parsed
config.json five times). Each file's size and modification time are kept beside its header: a
file changed between the plan and the load is then a clear error, where re-using its old header
would read other bytes than it describes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..config import ModelConfig
from ..errors import ModelLoadError


@dataclass(frozen=True)
class Checkpoint:
    model_dir: Path
    config: ModelConfig
    headers: tuple[tuple[Path, dict, int], ...]  # (file, {name: entry}, data start), in file order
    stamps: tuple[tuple[int, int], ...]  # each file's (size, mtime_ns) when its header was read

    @classmethod
    def read(cls, model_dir: Path) -> Checkpoint:
        """config.json and every header, checked (each entry inside its file); ModelLoadError if not."""
        from .safetensors_io import read_header  # (it imports torch: a build's loading does anyway)

        config = ModelConfig.from_file(model_dir)
        files = safetensors_files(model_dir)
        stamps = tuple(_stamp(f) for f in files)
        headers = tuple((f, *read_header(f)) for f in files)
        return cls(Path(model_dir), config, headers, stamps)

    def check_unchanged(self) -> None:
        """ModelLoadError naming a file whose size or modification time moved since ``read``."""
        for (path, _, _), stamp in zip(self.headers, self.stamps):
            try:
                now = _stamp(path)
            except OSError as e:
                raise ModelLoadError(f"{path}: gone since the model was planned ({e.strerror})") from None
            if now != stamp:
                raise ModelLoadError(f"{path}: changed since the model was planned; start again to read it anew")


def checkpoint_of(source: Path | Checkpoint) -> Checkpoint:
    """``source`` as read already, or read now (the tests' and single calls' way in)."""
    return source if isinstance(source, Checkpoint) else Checkpoint.read(Path(source))


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


def _stamp(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns
