"""Builds ``csrc/*.cpp`` with torch's C++ extension tooling and loads it as ``torch.ops.pagedllm``.

``csrc/`` holds one file per op family (attention, cache, pointwise, quant_gemm, grammar_mask,
threads), ``bindings.cpp`` with every op's schema, ``ops.h`` declaring the ops, and the
instruction-set code behind small headers (``vec_avx512.h``, ``quant_avx512.h``, ``amx.h``)
that compile to nothing where the compiler does not target that instruction set.

The library lands in ``$PAGEDLLM_CACHE/kernels/<key>``, the key hashing the source, the torch
version, the CPU's vector capability and the target, so a second start loads it in milliseconds
and a torch upgrade or another CPU rebuilds it. Compiled for this machine (``-march=native``,
or ``PAGEDLLM_KERNEL_TARGET``) with ATen's vector types at the width torch itself uses here.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .. import env
from ..paths import cache_root

log = logging.getLogger(__name__)

MODES = ("auto", "compiled", "torch")
CSRC = Path(__file__).with_name("csrc")
_NAME = "pagedllm_cpu_ops"

_state: dict[str, Any] = {"mode": None, "ops": None, "loaded": False, "error": None}


class KernelBuildError(RuntimeError):
    pass


def select(mode: str) -> str:
    """Chooses the kernels for this process from now on; returns the previous mode."""
    if mode not in MODES:
        raise ValueError(f"kernels mode {mode!r}: choose one of {', '.join(MODES)}")
    previous = _mode()
    _state.update(mode=mode, ops=None, loaded=False, error=None)
    return previous


def _mode() -> str:
    if _state["mode"] is None:
        mode = env.KERNELS.get()
        if mode not in MODES:
            raise ValueError(f"PAGEDLLM_KERNELS={mode!r}: choose one of {', '.join(MODES)}")
        _state["mode"] = mode
    return _state["mode"]


def compiled_ops() -> Any | None:
    """``torch.ops.pagedllm`` when the compiled kernels are in use, else None."""
    mode = _mode()
    if mode == "torch":
        return None
    if not _state["loaded"]:
        _state["loaded"] = True
        try:
            _state["ops"] = _load()
        except KernelBuildError as e:
            _state["error"] = e
            if mode == "compiled":
                raise
            log.warning("%s; running the pure-PyTorch kernels (slower)", e)
    return _state["ops"]


def required_ops() -> Any:
    """The kernels, built or loaded now; KernelBuildError if they cannot be built here. A build
    that failed is not tried again, and asking for the kernels announces no PyTorch fallback."""
    if _mode() == "compiled":
        return compiled_ops()
    if _state["error"] is not None:
        raise _state["error"]
    try:
        return _load()
    except KernelBuildError as e:
        _state["error"] = e
        raise


# x86-64 micro-architecture levels and the vector width ATen's headers use at each.
_LEVEL_CAPABILITY = {"x86-64-v4": "AVX512", "x86-64-v3": "AVX2"}


def build_target() -> str:
    """The CPU the kernels are built for: this one ('native'), or ``PAGEDLLM_KERNEL_TARGET``
    (x86-64-v3: AVX2 without AVX-512), so a machine with AVX-512 can build and test the paths
    other CPUs take."""
    return env.KERNEL_TARGET.get()


def _capability() -> str:
    import torch

    return _LEVEL_CAPABILITY.get(build_target()) or torch.backends.cpu.get_cpu_capability()


def _flags(capability: str) -> list[str]:
    flags = ["-O3", "-fopenmp"]
    if platform.machine() in ("x86_64", "AMD64"):
        flags.append(f"-march={build_target()}")
    if capability in ("AVX512", "AVX2"):  # ATen's Vectorized<float> at this width
        flags += [f"-DCPU_CAPABILITY={capability}", f"-DCPU_CAPABILITY_{capability}"]
    return flags


def build_dir() -> Path:
    import torch

    capability = _capability()
    key = hashlib.sha256(
        b"".join(p.read_bytes() for p in _sources_and_headers())
        + f"|{torch.__version__}|{capability}|{platform.machine()}|{build_target()}".encode()
    ).hexdigest()[:16]
    return cache_root() / "kernels" / f"cpu_ops-{key}"


def _sources_and_headers() -> list[Path]:
    """Everything the library is built from, for the build key. The headers sit beside the
    sources, not in a subfolder: pyproject.toml ships ``kernels/csrc/*.cpp`` and ``*.h``."""
    return sorted(CSRC.glob("*.cpp")) + sorted(CSRC.glob("*.h"))


def _load():
    import torch

    if not hasattr(torch.ops, "pagedllm") or not hasattr(torch.ops.pagedllm, "paged_attention"):
        target = build_dir()
        library = target / f"{_NAME}.so"
        if not library.is_file():
            _build(target)
        torch.ops.load_library(str(library))
    return torch.ops.pagedllm


def _build(target: Path) -> None:
    """Compiles in a child process: the build machinery (setuptools, the compiler driver's
    imports) never becomes part of the serving process."""
    compiler = env.COMPILER.get()
    if shutil.which(compiler) is None:
        raise KernelBuildError(f"no C++ compiler ({compiler!r} not found) to build the CPU kernels")
    if shutil.which("ninja") is None and importlib.util.find_spec("ninja") is None:
        raise KernelBuildError("ninja is not installed (pip install ninja) to build the CPU kernels")
    target.mkdir(parents=True, exist_ok=True)
    log.warning("building pagedllm's CPU kernels into %s (first start only, about 15 s)", target)
    start = time.perf_counter()
    child_env = dict(os.environ)
    ninja_dir = Path(sys.executable).parent  # pip's ninja puts its binary beside the interpreter
    child_env["PATH"] = f"{ninja_dir}{os.pathsep}{child_env.get('PATH', '')}"
    done = subprocess.run(
        [sys.executable, "-m", "pagedllm.kernels.build", str(target)], capture_output=True, text=True, env=child_env
    )
    if done.returncode != 0 or not (target / f"{_NAME}.so").is_file():
        tail = " ".join((done.stderr or done.stdout).split())[-400:]
        raise KernelBuildError(f"building the CPU kernels failed: {tail}")
    log.warning("built the CPU kernels in %.0f s", time.perf_counter() - start)


def _compile(target: Path) -> None:
    from torch.utils import cpp_extension

    cpp_extension.load(
        name=_NAME,
        sources=[str(p) for p in sorted(CSRC.glob("*.cpp"))],
        extra_cflags=_flags(_capability()),
        extra_ldflags=["-fopenmp"],
        build_directory=str(target),
        is_python_module=False,
        verbose=False,
    )


if __name__ == "__main__":
    _compile(Path(sys.argv[1]))
