"""Reading weights from the converted checkpoint at run time, for what does not stay resident
(``expert_cache``'s routed experts, ``layer_stream``'s decoder layers): ``os.preadv`` straight
into the memory that computes with them. Nothing is memory-mapped: a mapping's touched pages
would count in the process's RSS beyond any bound, while ``pread`` leaves them in the page
cache, which the kernel can drop.

A file changed underneath (its size or modification time differ from when it was opened) or
cut short is a ``ModelLoadError`` naming it at the next read, never output computed from other
bytes.
"""

from __future__ import annotations

import math
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from ..errors import ModelLoadError


@dataclass(frozen=True)
class StoredTensor:
    """Where one checkpoint tensor's bytes are: file, byte offset, size, dtype, shape."""

    file: Path
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


class StoredFiles:
    """The checkpoint's files, opened once, each read checked against what it was when opened."""

    def __init__(self) -> None:
        self._fds: dict[Path, int] = {}
        self._identity: dict[Path, tuple[int, int, int]] = {}  # (inode, size, mtime) when opened

    def open(self, path: Path) -> None:
        if path in self._fds:
            return
        fd = os.open(path, os.O_RDONLY)
        st = os.fstat(fd)
        self._fds[path] = fd
        self._identity[path] = (st.st_ino, st.st_size, st.st_mtime_ns)

    def read_into(self, part: StoredTensor, target: torch.Tensor, what: str) -> int:
        """``part``'s bytes into ``target`` (contiguous, as many bytes); returns how many. ``what``
        names the weights in the error when the file ends before them."""
        fd = self._fds[part.file]
        self._check_unchanged(part.file, fd)
        got = os.preadv(fd, [cast(Any, target.view(torch.uint8).numpy())], part.offset)
        if got != part.nbytes:
            raise ModelLoadError(f"{part.file}: truncated: {what} ends past the file's end")
        return got

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def _check_unchanged(self, path: Path, fd: int) -> None:
        st, (_, size, mtime) = os.fstat(fd), self._identity[path]
        if st.st_size < size:
            raise ModelLoadError(
                f"{path}: truncated while the engine reads weights from it ({st.st_size} bytes, {size} when it "
                "loaded); restart the engine on a whole file"
            )
        if (st.st_size, st.st_mtime_ns) != (size, mtime):
            raise ModelLoadError(
                f"{path}: the model file changed while the engine reads weights from it (its size or "
                "modification time differ from when it loaded); restart the engine"
            )


def anonymous(nbytes: int) -> mmap.mmap:
    """A private anonymous mapping of ``nbytes``: no page is resident until written, and
    ``madvise(MADV_DONTNEED)`` gives pages back to the OS."""
    return mmap.mmap(-1, max(1, nbytes), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def anonymous_slots(capacity: int, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[mmap.mmap, torch.Tensor]:
    """(the mapping, a [capacity, *shape] tensor over it)."""
    buffer = anonymous(capacity * math.prod(shape) * dtype.itemsize)
    tensor = torch.frombuffer(buffer, dtype=dtype, count=capacity * math.prod(shape)).view(capacity, *shape)
    return buffer, tensor
