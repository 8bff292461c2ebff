"""Where a GGUF file's conversion lives, and converting it when it is not there yet. Torch-free:
the server's API process resolves the model (for its tokenizer) through here and must not load
torch; the conversion itself (``gguf_convert``, torch) runs in a child process.

The folder's name includes a key over the file's path, size and mtime, so a changed file is
converted afresh. It is written to a temporary folder and renamed into place, so an interrupted
conversion leaves nothing half-written behind.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from ..errors import ModelLoadError, UnsupportedModelError
from ..paths import cache_root

log = logging.getLogger(__name__)

# 6: float16 scales where the file's are (Q4_0, Q4_1, Q8_0, ...), Q4_0 as codes q - 8, Q5_0/Q5_1 in
# 5 bits (were a byte a value); 5: K-quants
# kept as their blocks (were widened); 4: MXFP4 kept as 4-bit codes (was widened to 8 bits);
# IQ4_NL, IQ4_XS
CONVERTER_VERSION = 6
UNSUPPORTED_EXIT = 3  # the converter's exit status for an unsupported model
ERROR_MARK = "pagedllm-convert-error: "  # the converter's reported error follows this on stderr


def converted_dir(gguf_path: Path) -> Path:
    """The cache folder for this GGUF file, converting it first if needed."""
    gguf_path = gguf_path.resolve()
    try:
        st = gguf_path.stat()
    except OSError:
        raise ModelLoadError(f"{gguf_path}: no such file") from None
    key = hashlib.sha256(f"{gguf_path}|{st.st_size}|{st.st_mtime_ns}|{CONVERTER_VERSION}".encode()).hexdigest()[:16]
    target = cache_root() / f"{gguf_path.stem}-{key}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".converting-", dir=target.parent))
    try:
        log.info("converting %s into %s (once)", gguf_path, target)
        convert_in_subprocess(gguf_path, tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race; its result is as good as ours
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def convert_in_subprocess(gguf_path: Path, out_dir: Path) -> None:
    """Runs ``convert`` in a child process. Dequantizing and building the tokenizer from GGUF
    metadata touch hundreds of MB (the memory-mapped file, float32 tensors, the tokenizer
    converter's imports) that the allocator would keep in this process afterwards, outside the
    memory plan; a child gives all of it back when it exits. Its errors keep their type."""
    command = [sys.executable, "-m", "pagedllm.loading.gguf_convert", str(gguf_path), str(out_dir)]
    run = subprocess.run(command, capture_output=True, text=True)
    if run.returncode == 0:
        return
    if ERROR_MARK in run.stderr:
        message = run.stderr.rpartition(ERROR_MARK)[2].strip()
    else:  # a crash, not a reported error: its last line says what
        message = f"{gguf_path}: converting failed: " + (run.stderr.strip().splitlines() or ["no output"])[-1]
    error = UnsupportedModelError if run.returncode == UNSUPPORTED_EXIT else ModelLoadError
    raise error(message)
