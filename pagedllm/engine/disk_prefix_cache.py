"""The prefix cache's disk tier: full KV blocks kept in files beneath the KV pool, so a long
prompt computed once is read back instead of recomputed: in this process after its blocks left
the pool, and in the next process after a restart.

On CPU a prompt's prefill is the expensive part (seconds for a few thousand tokens of the default
model); reading its blocks back is a file read per block. The pool's prefix cache forgets what it
evicts and starts cold after a restart; this tier does neither.

When a block is written: as soon as it is full and computed (``BlockPools.register_computed``),
not when the pool evicts it. A block written only on eviction is lost with the process, and the
case that pays most (the same long prompt after a restart) would never hit. The engine thread
copies the block out (one block's bytes, microseconds) and a writer thread checksums and writes
it, so a step never waits for the disk; when the writer falls more than ``WRITE_BUFFER_BYTES``
behind, blocks are dropped (counted), never queued without bound.

When a block is read: as a request enters the queue, the writer's thread asks the OS to read its
chain's files into the page cache (``read_ahead``: the disk works while steps run); at admission,
where the pool's chain of cached blocks ends, the chain goes on on disk: each next block found
there is read into a free block of the pool, checked, and adopted as a cached block
(``BlockManager.adopt_filled``). A block that fails its check is deleted and the chain stops
there: its tokens are computed again, never read wrong.

Safety (files outlive the process, and another process may share the directory):

- Names: ``<dir>/<namespace>/<first 2 hex of the hash>/<hash>.kv``. The namespace is a digest of
  everything a block's bytes depend on (``namespace_of``: the weights' files, dtype, KV dtype,
  block size, quantization, the cache's layout), so another model, or the same one under another
  setting, never reads them; the hash is the block's chain hash (``block_manager.chain_hash``),
  which names every token before the block's end.
- Each file is a header (magic, version, payload size, CRC-32 of the payload, the block's hash)
  and the payload. It is written under a temporary name and renamed over its final name, so a
  crash mid-write leaves no file under a name that is read; a torn or corrupt file fails its check.
- The disk budget is a bound on the files of the whole directory (every namespace): the writer
  sums what is there (``os.scandir``, so two processes count the same files once) and deletes the
  least recently used down to 90% of the budget. A file's modification time is its last use
  (written, read back, or its block adopted from the pool), less its index in its chain
  (``BlockPools``), so a chain's head outlives its tail.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
import queue
import struct
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path

from ..backends.base import KVCache
from ..memory.costs import DISK_TIER_WRITE_BUFFER_BYTES as WRITE_BUFFER_BYTES

log = logging.getLogger(__name__)

MAGIC = b"PLKV"
VERSION = 1
HEADER = struct.Struct("<4sIQI16s")  # magic, version, payload bytes, crc32, block hash
SUFFIX = ".kv"
LOW_WATER = 0.9  # eviction deletes down to this share of the budget, so it runs once per many writes


@dataclass
class DiskTierStats:
    hit_blocks: int = 0  # blocks read back instead of computed
    misses: int = 0  # admissions whose chain went on past the pool but found no block on disk
    bytes_read: int = 0
    blocks_written: int = 0
    bytes_written: int = 0
    writes_dropped: int = 0  # blocks not written: the writer was WRITE_BUFFER_BYTES behind
    corrupt: int = 0  # files that failed their check (deleted; their tokens computed again)
    evicted: int = 0  # files deleted to stay within the disk budget
    disk_bytes: int = 0  # the directory's entries, at the writer's last count


class DiskPrefixCache:
    """Full KV blocks of one pool on disk, under ``directory/namespace``; see the module docstring."""

    def __init__(self, directory: str | Path, budget_bytes: int, namespace: str, kv_cache: KVCache, pool: int = 0):
        self.root = Path(directory).expanduser()
        self.dir = self.root / namespace
        self.dir.mkdir(parents=True, exist_ok=True)
        self.budget = budget_bytes
        self.kv_cache, self.pool = kv_cache, pool
        self.entry_bytes = HEADER.size + kv_cache.block_nbytes(pool)
        self.stats = DiskTierStats()
        # (hash, payload, used) to write; ("read ahead", hashes); None: stop
        self._queue: queue.Queue[tuple | None] = queue.Queue()
        self._queued_bytes = 0
        self._lock = threading.Lock()
        self._written: set[bytes] = set()  # hashes this process wrote or found (not written again)
        self.stats.disk_bytes = sum(size for _, size, _ in self._entries())
        self._writer = threading.Thread(target=self._write_loop, name="pagedllm-disk-tier", daemon=True)
        self._writer.start()
        atexit.register(self.close)

    # ---- reads: on the engine thread, at admission ----------------------------------------------

    def path(self, block_hash: bytes) -> Path:
        name = block_hash.hex()
        return self.dir / name[:2] / (name + SUFFIX)

    def contains(self, block_hash: bytes) -> bool:
        return self.path(block_hash).is_file()

    def load(self, block_hash: bytes, block: int, *, used_ns: int) -> bool:
        """Reads the entry of ``block_hash`` into ``block`` of the pool, and marks it used at
        ``used_ns``. False, and the file deleted, where it is missing, torn, corrupt or not this
        hash's."""
        path = self.path(block_hash)
        data = bytearray(self.entry_bytes + 1)  # one byte more: a longer file is caught
        try:
            with open(path, "rb") as f:
                size = f.readinto(data)
        except OSError:
            return False
        del data[size:]
        payload = _checked_payload(data, block_hash, self.entry_bytes - HEADER.size)
        if payload is None:
            self.stats.corrupt += 1
            log.warning("prefix cache on disk: %s failed its check; deleted, its tokens are computed again", path)
            _remove(path)
            return False
        self.kv_cache.write_block(self.pool, block, payload)
        self.stats.hit_blocks += 1
        self.stats.bytes_read += len(data)
        _stamp(path, used_ns)
        return True

    def touch(self, hashes: list[bytes], now_ns: int) -> None:
        """Marks the entries of a chain's blocks (from its head) used: each at ``now_ns`` less its
        index, so the head is evicted last. (The pool's own hits too: a block hot in RAM is not
        old on disk.)"""
        for i, block_hash in enumerate(hashes):
            _stamp(self.path(block_hash), now_ns - i)

    def read_ahead(self, hashes: list[bytes]) -> None:
        """Asks the writer's thread to have the OS read a chain's entries (from its head, up to
        the first missing) into its page cache: the admission's reads then wait for no disk.
        (Page cache, not this process's memory: the plan is untouched.)"""
        if hashes and self._writer.is_alive() and hasattr(os, "posix_fadvise"):  # (Linux; not macOS)
            self._queue.put(("read ahead", hashes))

    # ---- writes: copied out on the engine thread, written on the writer's -----------------------

    def store(self, block_hash: bytes, block: int, used_ns: int) -> None:
        """Queues a full, computed block of the pool for writing, to be marked used at ``used_ns``
        (a copy of it now: the block may be evicted and rewritten before the writer runs)."""
        if block_hash in self._written or self.entry_bytes > self.budget or not self._writer.is_alive():
            return
        with self._lock:
            if self._queued_bytes + self.entry_bytes > WRITE_BUFFER_BYTES:
                self.stats.writes_dropped += 1
                return
            self._queued_bytes += self.entry_bytes
        self._written.add(block_hash)
        self._queue.put((block_hash, self.kv_cache.read_block(self.pool, block), used_ns))

    def flush(self) -> None:
        """Waits until every queued block is on disk."""
        self._queue.join()

    def close(self) -> None:
        """Writes what is queued and stops the writer (at exit too: a restart finds them)."""
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()
        atexit.unregister(self.close)

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                if item[0] == "read ahead":
                    self._read_ahead(item[1])
                else:
                    self._write(*item)
            except OSError as e:  # a full or read-only disk: the block is only not kept
                log.warning("prefix cache on disk: could not write a block: %s", e)
            finally:
                if item is not None and item[0] != "read ahead":
                    with self._lock:
                        self._queued_bytes -= self.entry_bytes
                self._queue.task_done()

    def _write(self, block_hash: bytes, payload: bytes, used_ns: int) -> None:
        path = self.path(block_hash)
        if path.is_file():
            _stamp(path, used_ns)
            return  # another process wrote it
        path.parent.mkdir(exist_ok=True)
        header = HEADER.pack(MAGIC, VERSION, len(payload), zlib.crc32(payload), block_hash)
        temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        with open(temporary, "wb") as f:
            f.write(header)
            f.write(payload)
        os.utime(temporary, ns=(used_ns, used_ns))
        os.replace(temporary, path)  # atomic: a reader sees the whole entry or none
        self.stats.blocks_written += 1
        self.stats.bytes_written += len(header) + len(payload)
        self.stats.disk_bytes += len(header) + len(payload)
        if self.stats.disk_bytes > self.budget:
            self._evict()

    def _read_ahead(self, hashes: list[bytes]) -> None:
        for block_hash in hashes:
            try:
                fd = os.open(self.path(block_hash), os.O_RDONLY)
            except OSError:
                return  # the chain ends here
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)

    def _evict(self) -> None:
        """Deletes the least recently used entries of the whole directory down to LOW_WATER of the
        budget (counted afresh: another process may have written or deleted some)."""
        entries = sorted(self._entries(), key=lambda e: e[2])
        used = sum(size for _, size, _ in entries)
        for path, size, _ in entries:
            if used <= self.budget * LOW_WATER:
                break
            if _remove(path):
                self.stats.evicted += 1
                if _is_hash(path.stem):
                    self._written.discard(bytes.fromhex(path.stem))  # written again when computed again
            used -= size
        self.stats.disk_bytes = used

    def _entries(self) -> list[tuple[Path, int, int]]:
        """(path, bytes, last use) of every entry under the directory, every namespace's."""
        out = []
        for namespace in _subdirs(self.root):
            for shard in _subdirs(namespace):
                for entry in _scan(shard):
                    if entry.name.endswith(SUFFIX):
                        try:
                            st = entry.stat()
                        except OSError:
                            continue  # deleted meanwhile (by another process)
                        out.append((Path(entry.path), st.st_size, st.st_mtime_ns))
        return out


def _checked_payload(data: bytearray, block_hash: bytes, payload_bytes: int) -> memoryview | None:
    """The payload of an entry if its header and checksum hold, else None."""
    if len(data) != HEADER.size + payload_bytes:
        return None
    magic, version, size, crc, stored_hash = HEADER.unpack_from(data)
    payload = memoryview(data)[HEADER.size :]
    ok = (magic, version, size, stored_hash) == (MAGIC, VERSION, payload_bytes, block_hash)
    return payload if ok and zlib.crc32(payload) == crc else None


def namespace_of(model_dir: Path, settings: dict) -> str:
    """A digest of everything a block's bytes depend on: the model directory's files (each small
    file whole; a large one, its size and 1 MiB at its start, middle and end: hashing gigabytes
    at each start would cost more than it saves) and the engine's ``settings`` (dtype, KV dtype,
    block size, quantization, the cache's layout)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(repr(sorted(settings.items())).encode())
    for path in sorted(p for p in Path(model_dir).iterdir() if p.is_file()):
        h.update(path.name.encode())
        h.update(_file_fingerprint(path))
    return h.hexdigest()


def _file_fingerprint(path: Path, sample: int = 1024**2) -> bytes:
    size = path.stat().st_size
    h = hashlib.blake2b(str(size).encode(), digest_size=16)
    with open(path, "rb") as f:
        if size <= 4 * sample:
            h.update(f.read())
        else:
            for at in (0, size // 2, size - sample):
                f.seek(at)
                h.update(f.read(sample))
    return h.digest()


def _subdirs(path: Path) -> list[Path]:
    return [Path(e.path) for e in _scan(path) if e.is_dir(follow_symlinks=False)]


def _scan(path: Path) -> list[os.DirEntry]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except OSError:
        return []


def _stamp(path: Path, ns: int) -> None:
    try:
        os.utime(path, ns=(ns, ns))
    except OSError:
        pass  # deleted meanwhile (another process's eviction)


def _remove(path: Path) -> bool:
    try:
        path.unlink()
        return True
    except OSError:
        return False


def _is_hash(name: str) -> bool:
    return len(name) == 32 and all(c in "0123456789abcdef" for c in name)
