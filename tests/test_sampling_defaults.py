"""Default sampling comes from the model, explicit arguments win, and the defaults keep the
embedded model's chat answers out of repetition loops."""

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.loading import gguf_convert
from pagedllm.loading.generation_config import sampling_defaults
from pagedllm.sampling_params import INTERACTIVE_DEFAULTS


@pytest.fixture
def model_with(tiny_checkpoints, tmp_path):
    """A tiny checkpoint whose generation_config.json says ``config`` (None: has none)."""

    def make(config):
        d = tmp_path / "model"
        shutil.copytree(tiny_checkpoints["llama"][0], d)
        (d / "generation_config.json").unlink(missing_ok=True)
        if config is not None:
            (d / "generation_config.json").write_text(json.dumps(config))
        return d

    return make


def params_of(llm, params):
    rid = llm.engine.add_request([5, 6, 7], params)
    resolved = llm.engine.requests[rid].params
    llm.engine.abort(rid)
    return resolved


def test_the_models_generation_config_is_applied_and_explicit_arguments_win(model_with):
    llm = LLM(model_with({"do_sample": True, "temperature": 0.6, "top_p": 0.8, "top_k": 20, "eos_token_id": 2}))
    got = params_of(llm, SamplingParams(max_tokens=4))
    assert (got.temperature, got.top_p, got.top_k, got.min_p, got.repetition_penalty) == (0.6, 0.8, 20, 0.0, 1.0)
    got = params_of(llm, SamplingParams(max_tokens=4, temperature=1.0, top_k=0))
    assert (got.temperature, got.top_k, got.top_p) == (1.0, 0, 0.8)  # the rest still the model's
    got = params_of(llm, SamplingParams(max_tokens=4, temperature=0))
    assert got.greedy and (got.top_k, got.top_p, got.repetition_penalty) == (0, 1.0, 1.0)  # greedy is plain greedy


def test_do_sample_false_means_greedy(model_with):
    assert sampling_defaults(model_with({"do_sample": False, "temperature": 0.9})) == {"temperature": 0.0}


def test_without_a_model_default_the_interactive_default_applies(model_with):
    llm = LLM(model_with(None))
    got = params_of(llm, SamplingParams(max_tokens=4))
    assert {k: getattr(got, k) for k in INTERACTIVE_DEFAULTS} == INTERACTIVE_DEFAULTS
    assert got.top_k == 0
    got = params_of(llm, SamplingParams(max_tokens=4, temperature=0, repetition_penalty=1.3))
    assert got.greedy and got.repetition_penalty == 1.3 and got.top_p == 1.0  # only what was asked


@pytest.mark.parametrize("config", ['{"temperature": -1}', "not json", '{"top_p": 7}'])
def test_a_bad_generation_config_is_ignored_not_fatal(model_with, config, caplog):
    d = model_with({})
    (d / "generation_config.json").write_text(config)
    assert sampling_defaults(d) == {}
    assert "generation_config.json" in caplog.text


def test_a_gguf_files_sampling_metadata_becomes_the_models_default(tmp_path, monkeypatch):
    from test_quantization import TYPES, write_llama_gguf

    monkeypatch.setattr(gguf_convert, "_save_tokenizer", lambda *a: None)
    path, out = tmp_path / "tiny.gguf", tmp_path / "converted"
    write_llama_gguf(path, TYPES, np.random.default_rng(0), {"general.sampling.temp": 0.3, "general.sampling.top_k": 7})
    out.mkdir()
    gguf_convert.convert(path, out)
    assert sampling_defaults(out) == pytest.approx({"temperature": 0.3, "top_k": 7})


@pytest.mark.slow
def test_default_chat_answers_without_a_loop_on_five_seeds(default_llm):
    """The question that loops to max_tokens under greedy decoding, with no sampling argument but a
    seed: no answer loops (the measurement's own loop rule, benchmarks/sampling_defaults.py), and
    greedy still does, so the test can tell the two apart."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from sampling_defaults import loops

    prompt = default_llm.apply_chat_template([{"role": "user", "content": "Give me two tips for sleeping better."}])
    params = [SamplingParams(max_tokens=256, seed=s) for s in range(5)] + [
        SamplingParams(max_tokens=256, temperature=0)
    ]
    *sampled, greedy = default_llm.generate([prompt] * 6, params)  # one batch: greedy rides along
    assert not any(loops(o.token_ids, 256) for o in sampled), [o.text[-80:] for o in sampled]
    assert loops(greedy.token_ids, 256), greedy.text[-80:]
