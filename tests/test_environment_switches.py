"""The README's kernel switches, each observed in a process of its own started as a user starts
one: ``PAGEDLLM_KERNELS=torch`` (or ``backend="cpu-torch"``) never builds or loads the compiled
kernels; ``PAGEDLLM_KERNELS=compiled`` (or ``backend="cpu-compiled"``) without a compiler is an
error, not a fallback; an unknown value is refused; and where no C++ compiler can be found the
same model runs on the PyTorch path, with one log line that says so.

What the child did is read from outside the code under test: the tokens against transformers'
greedy output, the files in its cache folder, the libraries mapped into it (/proc/self/maps),
a stand-in compiler that writes down every call, and the lines it logged."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from greedy import assert_greedy_matches, hf_greedy

ROOT = Path(__file__).parent.parent
PROMPT = [5, 6, 7, 8, 9]
NEW_TOKENS = 8

# Logging left as a user's script leaves it (Python prints warnings and errors to stderr, one
# line each): stderr is what the user sees. One request, then what the process holds.
CHILD = r"""
import json, sys
import torch
from pagedllm import LLM, SamplingParams
llm = LLM(sys.argv[1], num_blocks=16, max_model_len=64, **json.loads(sys.argv[2]))
params = SamplingParams(max_tokens=int(sys.argv[4]), temperature=0, ignore_eos=True)
out = llm.generate([json.loads(sys.argv[3])], params)[0]
with open("/proc/self/maps") as f:
    mapped = "pagedllm_cpu_ops" in f.read()
print(json.dumps({"tokens": out.token_ids, "library_mapped": mapped,
                  "ops_registered": hasattr(torch.ops.pagedllm, "paged_attention")}))
"""

KERNEL_LINE = re.compile(r"compiler|kernel|pytorch", re.IGNORECASE)

# What decides the kernels in the child is set by each test alone.
SWITCHES = ("PAGEDLLM_KERNELS", "PAGEDLLM_KERNEL_TARGET", "CXX", "CC")


def run_child(model: Path, cache: Path, env: dict[str, str], **llm_kwargs) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in SWITCHES}
    full = {**base, "PAGEDLLM_CACHE": str(cache), **env}
    args = [str(model), json.dumps(llm_kwargs), json.dumps(PROMPT), str(NEW_TOKENS)]
    return subprocess.run(
        [sys.executable, "-c", CHILD, *args], capture_output=True, text=True, timeout=300, env=full, cwd=ROOT
    )


def kernel_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if KERNEL_LINE.search(line)]


@pytest.fixture(scope="module")
def llama(tiny_checkpoints):
    """The tiny llama's folder and transformers' greedy tokens for PROMPT (the oracle)."""
    directory, hf = tiny_checkpoints["llama"]
    return directory, hf_greedy(hf, PROMPT, NEW_TOKENS)


@pytest.fixture
def no_compiler(tmp_path) -> dict[str, str]:
    """A PATH on which no compiler (nor anything else) is found; CXX and CC unset."""
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    return {"PATH": str(empty)}


@pytest.fixture
def recording_compiler(tmp_path) -> tuple[dict[str, str], Path]:
    """CXX, CC and every compiler name on PATH are a script that writes down its call and fails."""
    bin_dir, calls = tmp_path / "fake-bin", tmp_path / "compiler-calls"
    bin_dir.mkdir()
    for name in ("c++", "g++", "cc", "gcc", "clang", "clang++"):
        script = bin_dir / name
        script.write_text(f'#!/bin/sh\necho "$0 $*" >> {calls}\nexit 1\n')
        script.chmod(0o755)
    env = {"CXX": str(bin_dir / "c++"), "CC": str(bin_dir / "cc"), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    return env, calls


def libraries_in(cache: Path) -> list[Path]:
    return sorted(cache.rglob("*.so")) if cache.exists() else []


@pytest.mark.parametrize(
    "how", ["PATH without a compiler", "CXX naming a missing compiler"], ids=["no-path-compiler", "missing-cxx"]
)
def test_without_a_compiler_the_model_runs_on_pytorch_and_one_log_line_says_so(llama, tmp_path, no_compiler, how):
    """Promise: "Without a compiler the same model runs on plain PyTorch ops, slower, and one
    log line says so." Default switches (auto), an empty kernel cache, no compiler to be found:
    the model still generates transformers' tokens, nothing is built or loaded, and of what the
    process prints with logging as Python sets it up (warnings and up), exactly one line is about
    the kernels, and it names the missing compiler and the PyTorch path."""
    directory, reference = llama
    cache = tmp_path / "cache"
    env = no_compiler if how.startswith("PATH") else {"CXX": "/nonexistent/bin/c++", "CC": "/nonexistent/bin/cc"}
    run = run_child(directory, cache, env)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert_greedy_matches([result["tokens"]], [reference])
    assert not result["library_mapped"] and not result["ops_registered"]
    assert libraries_in(cache) == []
    lines = kernel_lines(run.stderr)
    assert len(lines) == 1, run.stderr[-3000:]
    assert re.search(r"compiler", lines[0], re.I) and re.search(r"pytorch", lines[0], re.I), lines


@pytest.mark.parametrize(
    "switch, kwargs",
    [({"PAGEDLLM_KERNELS": "torch"}, {}), ({}, {"backend": "cpu-torch"})],
    ids=["PAGEDLLM_KERNELS=torch", "backend=cpu-torch"],
)
def test_the_torch_switch_never_builds_or_loads_the_kernels(llama, tmp_path, recording_compiler, switch, kwargs):
    """Promise: "PAGEDLLM_KERNELS=torch (or backend="cpu-torch") never builds them." With an
    empty kernel cache and a compiler that would be found (a stand-in that writes down each
    call), the model generates transformers' tokens; the compiler is never called, the cache
    holds no library, none is mapped into the process nor registered with torch, and nothing
    is logged about kernels or compilers."""
    directory, reference = llama
    env, calls = recording_compiler
    cache = tmp_path / "cache"
    run = run_child(directory, cache, {**env, **switch}, **kwargs)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert_greedy_matches([result["tokens"]], [reference])
    assert not calls.exists(), f"the compiler was called: {calls.read_text()}"
    assert not (cache / "kernels").exists() and libraries_in(cache) == []
    assert not result["library_mapped"] and not result["ops_registered"]
    assert kernel_lines(run.stderr) == [], run.stderr[-3000:]


@pytest.mark.parametrize(
    "switch, kwargs",
    [({"PAGEDLLM_KERNELS": "compiled"}, {}), ({}, {"backend": "cpu-compiled"})],
    ids=["PAGEDLLM_KERNELS=compiled", "backend=cpu-compiled"],
)
def test_the_compiled_switch_without_a_compiler_is_an_error(llama, tmp_path, no_compiler, switch, kwargs):
    """Promise: "PAGEDLLM_KERNELS=compiled (or backend="cpu-compiled") requires the kernels
    (error if they cannot be built)." No compiler to be found and an empty kernel cache: the
    process stops with KernelBuildError naming the compiler it looked for, before generating,
    and does not fall back to the PyTorch path."""
    directory, _ = llama
    cache = tmp_path / "cache"
    run = run_child(directory, cache, {**no_compiler, **switch}, **kwargs)
    assert run.returncode != 0 and run.stdout.strip() == "", run.stdout + run.stderr[-3000:]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("pagedllm.kernels.build.KernelBuildError: "), run.stderr[-3000:]
    assert "no C++ compiler" in last and "'c++'" in last, last
    assert libraries_in(cache) == []
    # the error is the one word on it: no line says the model runs on PyTorch instead (under
    # backend="cpu-compiled" one did, and the build ran twice)
    assert not re.search(r"pytorch", run.stderr, re.I), run.stderr[-3000:]


def test_an_unknown_kernels_value_is_refused_naming_the_choices(llama, monkeypatch):
    """Promise (the README's three values of PAGEDLLM_KERNELS): any other value is a clear
    error naming the value and the three choices, not a silent default. The compiler is made
    missing, so a switch that ignored the value would quietly run on the PyTorch path."""
    from pagedllm import LLM
    from pagedllm.kernels import build

    monkeypatch.setattr(
        build, "_state", {"mode": None, "ops": None, "loaded": False, "error": None}
    )  # as a new process
    monkeypatch.setenv("PAGEDLLM_KERNELS", "cuda")
    monkeypatch.setenv("CXX", "/nonexistent/bin/c++")
    with pytest.raises(ValueError, match=r"PAGEDLLM_KERNELS='cuda': choose one of auto, compiled, torch"):
        LLM(llama[0], num_blocks=16, max_model_len=64)
