"""What `pip install pagedllm` gives a user: a wheel built from this checkout, installed apart from
it, answers a prompt.

The wheel is built from a copy of the checkout (setuptools reuses a stale ``build/`` in place,
which would hide a file dropped from the package data), installed with ``pip install --no-deps
--target``, and run from another folder with only that target in front of the path, so the
checkout's ``pagedllm`` cannot be the one imported (asserted). The venv supplies the dependencies.

Planted to see these fail (December 3): ``server/web/*`` dropped from ``[tool.setuptools.package-data]``
fails the contents test naming the page's files; ``kernels/csrc/*.h`` dropped fails it naming
the headers, and the console script's answer fails too: its kernels, built from the wheel's
sources, lack the headers (KernelBuildError).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOP_LEVEL_NOT_COPIED = {".git", "build", "dist", "docs", "tests", "benchmarks", ".pytest_cache", ".hypothesis"}


def not_copied(folder: str, names: list[str]) -> set[str]:
    """What a wheel is not built from: venvs, earlier builds, caches, and the top-level folders
    outside the package."""
    top = Path(folder) == ROOT
    skipped = {n for n in names if n == "__pycache__" or n.endswith(".egg-info")}
    return skipped | ({n for n in names if n in TOP_LEVEL_NOT_COPIED or n.startswith(".venv")} if top else set())


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel of this checkout, built the way a user's pip builds it (setuptools, no deps)."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "source"
    shutil.copytree(ROOT, source, ignore=not_copied)
    out = tmp / "dist"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(source)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (built,) = out.glob("pagedllm-*.whl")
    return built


def package_files(root: Path, *patterns: str) -> set[str]:
    """The checkout's files under ``pagedllm/`` matching ``patterns``, as paths inside a wheel."""
    return {
        p.relative_to(root).as_posix()
        for pattern in patterns
        for p in (root / "pagedllm").rglob(pattern)
        if "__pycache__" not in p.parts
    }


def test_the_wheel_holds_every_module_kernel_source_and_web_file(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for what, expected in [
        ("modules", package_files(ROOT, "*.py")),
        ("kernel sources", package_files(ROOT, "kernels/csrc/*")),
        ("web page files", package_files(ROOT, "server/web/*")),
    ]:
        assert expected, what  # the checkout has them: a moved folder must move this test too
        missing = sorted(expected - names)
        assert not missing, f"the wheel lacks {len(missing)} {what}: {missing}"
    assert any(n.endswith(".h") for n in names) and any(n.endswith(".cpp") for n in names)


def test_the_wheels_metadata_names_the_pythons_and_the_structured_extra(wheel):
    from pagedllm.structured.grammars import INSTALL_HINT

    with zipfile.ZipFile(wheel) as z:
        (metadata,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        lines = z.read(metadata).decode().splitlines()
        entry_points = z.read(metadata.replace("METADATA", "entry_points.txt")).decode()
    assert "Requires-Python: <3.14,>=3.10" in lines
    assert "Provides-Extra: structured" in lines
    assert any(line.startswith("Requires-Dist: xgrammar") and 'extra == "structured"' in line for line in lines)
    # triton reaches a user only through the extra, never through a plain install
    assert not any(line.startswith("Requires-Dist: xgrammar") and "extra ==" not in line for line in lines)
    assert "pagedllm = pagedllm.cli:main" in entry_points
    assert "pip install 'pagedllm[structured]'" in INSTALL_HINT  # what a refused request tells the user


@pytest.mark.slow  # loads the default model (~10 s), and builds the kernels if no test did before
def test_the_installed_wheel_answers_a_prompt_from_its_console_script(wheel, tmp_path):
    target = tmp_path / "site"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(target)}  # PAGEDLLM_CACHE: the session's (conftest)
    imported = subprocess.run(
        [sys.executable, "-c", "import pagedllm; print(pagedllm.__file__)"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
    )
    assert imported.returncode == 0, imported.stderr[-3000:]
    assert Path(imported.stdout.strip()).is_relative_to(target), imported.stdout
    # the console script pip wrote for the wheel's entry point, on the compiled kernels only (no
    # quiet fallback to PyTorch): built from the wheel's own sources wherever they differ from what
    # this session built, since the build key hashes them
    prompt = "What is the capital of France?"
    answer = subprocess.run(
        [str(target / "bin" / "pagedllm"), "generate", "--greedy", "--max-tokens", "6", prompt],
        cwd=elsewhere,
        env={**env, "PAGEDLLM_KERNELS": "compiled"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert answer.returncode == 0, answer.stderr[-3000:]
    assert answer.stdout.strip(), answer.stderr[-3000:]
