"""Streaming read and write of the safetensors format, one tensor at a time.

Why not ``safetensors.safe_open``: it memory-maps the file, and every page it touches stays
resident until the file is closed, so loading a model costs its weights twice in RSS. Reading each
tensor with ``readinto`` straight into its final buffer keeps the peak at the weights plus one
tensor, and lets us say precisely which file is truncated or corrupt.

Format: 8-byte little-endian header length, a JSON header mapping names to dtype, shape and
``data_offsets`` (relative to the end of the header), then the raw little-endian bytes.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from ..errors import ModelLoadError
from ..sizes import CONVERT_CHUNK_BYTES

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
NAMES = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024


def read_header(path: Path) -> tuple[dict, int]:
    """Returns ({name: entry}, data_start) after checking every entry fits inside the file."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ModelLoadError(f"{path}: truncated safetensors file ({size} bytes, no header)")
        (n,) = struct.unpack("<Q", raw)
        if n > min(_MAX_HEADER, size - 8):
            raise ModelLoadError(f"{path}: corrupt or truncated safetensors header (claims {n} bytes)")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ModelLoadError(f"{path}: corrupt safetensors header (not JSON)") from None
    if not isinstance(header, dict):
        raise ModelLoadError(f"{path}: corrupt safetensors header")
    header.pop("__metadata__", None)
    data_start = 8 + n
    for name, e in header.items():
        try:
            dtype = DTYPES[e["dtype"]]
            begin, end = e["data_offsets"]
            count = 1
            for d in e["shape"]:
                count *= int(d)
        except (KeyError, TypeError, ValueError):
            raise ModelLoadError(f"{path}: corrupt entry for tensor {name!r}") from None
        if end - begin != count * dtype.itemsize:
            raise ModelLoadError(f"{path}: tensor {name!r} has a size that does not match its shape")
        if data_start + end > size:
            raise ModelLoadError(
                f"{path}: truncated: tensor {name!r} ends at byte {data_start + end}, file has {size} bytes"
            )
    return header, data_start


def iter_tensors(
    path: Path,
    header: dict,
    data_start: int,
    dtype: torch.dtype | None = None,
    destination: Callable[[str], torch.Tensor | None] | None = None,
    keep_dtype: Callable[[str], bool] | None = None,
    select: Callable[[str, dict], tuple[int, int, int] | None] | None = None,
    wanted: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (name, tensor) in file order, each in a fresh buffer of ``dtype`` (default: as stored),
    or read straight into ``destination(name)`` when that gives a contiguous tensor (the rows a
    stacked layer keeps for it): no buffer that is copied and freed.

    A tensor stored as ``dtype`` is read straight into its buffer. One stored in another dtype is
    read ``CONVERT_CHUNK_BYTES`` at a time into one reused buffer and converted from there into
    its final one: a float32 checkpoint loads as bfloat16 without a float32 copy of any tensor.
    Tensors for which ``keep_dtype(name)`` is true (a quantized weight's parts) stay as stored.

    ``select(name, entry)``: ``(dim, start, stop)`` to read only that part of a tensor along one
    dimension (one run of bytes per index of the dimensions before it: rows of a matrix are one
    run, its columns a run per row), None for all of it: a rank of a split model reads its own
    slice and nothing else. ``wanted(name)`` false: the tensor is not read at all (the experts an
    expert cache reads later).
    """
    scratch = torch.empty(CONVERT_CHUNK_BYTES, dtype=torch.uint8)
    with open(path, "rb") as f:
        for name, e in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            if wanted is not None and not wanted(name):
                continue
            stored = DTYPES[e["dtype"]]
            target = stored if dtype is None or (keep_dtype is not None and keep_dtype(name)) else dtype
            shape, runs = _runs(e, data_start, select(name, e) if select is not None else None, stored.itemsize)
            given = destination(name) if destination is not None else None
            if given is not None and (tuple(given.shape) != shape or given.dtype != target):
                given = None  # a mismatch is the loader's to report, with the names
            out = given if given is not None else torch.empty(shape, dtype=target)
            flat, done = out.reshape(-1), 0
            for offset, nbytes in runs:
                f.seek(offset)
                if target == stored:
                    _read_into(f, flat[done : done + nbytes // stored.itemsize].view(torch.uint8), path, name)
                    done += nbytes // stored.itemsize
                    continue
                step = CONVERT_CHUNK_BYTES // stored.itemsize
                for first in range(0, nbytes // stored.itemsize, step):
                    count = min(step, nbytes // stored.itemsize - first)
                    piece = scratch[: count * stored.itemsize]
                    _read_into(f, piece, path, name)
                    flat[done : done + count].copy_(piece.view(stored))
                    done += count
            yield name, out


def _runs(
    entry: dict, data_start: int, part: tuple[int, int, int] | None, itemsize: int
) -> tuple[tuple[int, ...], list[tuple[int, int]]]:
    """(shape read, [(file offset, bytes)]) for all of a tensor or the part ``select`` chose."""
    begin, end = entry["data_offsets"]
    shape = tuple(int(d) for d in entry["shape"])
    if part is None:
        return shape, [(data_start + begin, end - begin)]
    dim, start, stop = part
    if not (0 <= dim < len(shape) and 0 <= start <= stop <= shape[dim]):
        raise ValueError(f"cannot read [{start}, {stop}) along dim {dim} of a tensor shaped {shape}")
    inner = itemsize  # bytes of one index along dim
    for d in shape[dim + 1 :]:
        inner *= d
    outer = 1  # runs: one per index of the dimensions before dim
    for d in shape[:dim]:
        outer *= d
    first, width = data_start + begin + start * inner, (stop - start) * inner
    read = (*shape[:dim], stop - start, *shape[dim + 1 :])
    return read, [(first + o * shape[dim] * inner, width) for o in range(outer)]


def _read_into(f, buffer: torch.Tensor, path: Path, name: str) -> None:
    if buffer.numel() and f.readinto(buffer.numpy().data) != buffer.numel():
        raise ModelLoadError(f"{path}: truncated while reading tensor {name!r}")


def write_streaming(
    path: Path, specs: list[tuple[str, torch.dtype, tuple[int, ...]]], produce, metadata: dict | None = None
) -> None:
    """Writes a safetensors file whose tensors are produced one at a time by ``produce(name)``.

    The header is written first from ``specs``, so no more than one tensor is in memory.
    """
    header: dict = {"__metadata__": metadata or {}}
    offset = 0
    for name, dtype, shape in specs:
        nbytes = dtype.itemsize
        for d in shape:
            nbytes *= d
        header[name] = {"dtype": NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, dtype, shape in specs:
            t = produce(name).to(dtype).contiguous()
            if tuple(t.shape) != tuple(shape):
                raise ValueError(f"{name}: produced shape {tuple(t.shape)}, expected {shape}")
            f.write(t.reshape(-1).view(torch.uint8).numpy().data)
