"""Text in, text out with the default model: chat, streaming, stop strings, the CLI."""

import json
import subprocess
import sys

import pytest

from pagedllm import SamplingParams
from pagedllm.engine.detokenizer import Detokenizer
from pagedllm.engine.sequence import Sequence

pytestmark = pytest.mark.slow

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def test_chat_answers(default_llm):
    out = default_llm.chat(FRANCE, SamplingParams(max_tokens=32, temperature=0))[0]
    assert "Paris" in out.text and out.finish_reason == "stop"
    assert out.token_ids[-1] in default_llm.engine.eos_token_ids
    assert "<|im_end|>" not in out.text


def test_stop_string_ends_the_text_exactly_before_it(default_llm):
    full = default_llm.chat(FRANCE, SamplingParams(max_tokens=32, temperature=0))[0].text
    for stop in ["Paris", "of Fr", "capital"]:
        out = default_llm.chat(FRANCE, SamplingParams(max_tokens=32, temperature=0, stop=[stop, "zzz"]))[0]
        assert out.finish_reason == "stop"
        assert out.text == full[: full.index(stop)]
        streamed = "".join(
            default_llm.stream(
                default_llm.apply_chat_template(FRANCE), SamplingParams(max_tokens=32, temperature=0, stop=stop)
            )
        )
        assert streamed == out.text


def test_streamed_text_equals_generated_text(default_llm):
    prompt = default_llm.apply_chat_template([{"role": "user", "content": "Write a short poem about rain."}])
    params = SamplingParams(max_tokens=40, temperature=0.8, seed=3)
    whole = default_llm.generate([prompt], params)[0].text
    assert "".join(default_llm.stream(prompt, params)) == whole


def test_streaming_never_splits_a_multibyte_character(default_llm):
    tok = default_llm.tokenizer
    text = "Café ☕ naïve 日本語の文章 🌍🚀 done"
    ids = tok.encode(text, add_special_tokens=False)
    seq = Sequence("x", [1], SamplingParams(max_tokens=len(ids)))
    detok, deltas = Detokenizer(tok, eos_token_ids=(), max_model_len=1024), []
    for t in ids:
        seq.output_token_ids.append(t)
        detok.update(seq, drop_last=False)
        end = detok.releasable(seq)
        deltas.append(seq.text[seq.emitted_chars : end])
        seq.emitted_chars = end
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text


def test_length_finish_and_max_tokens(default_llm):
    out = default_llm.generate(["Once upon a time"], SamplingParams(max_tokens=7, temperature=0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 7


def run_cli(*args, stdin=None):
    return subprocess.run(
        [sys.executable, "-m", "pagedllm.cli", *args], input=stdin, capture_output=True, text=True, timeout=300
    )


def test_cli_generate_answers():
    res = run_cli("generate", "What is the capital of France?", "--max-tokens", "24", "--greedy")
    assert res.returncode == 0, res.stderr
    assert "Paris" in res.stdout


def test_cli_batch_job_writes_one_result_per_line(tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows = [
        {"messages": FRANCE},
        {"prompt": "1, 2, 3,", "max_tokens": 5, "ignore_eos": True},
        {"prompt_token_ids": [1, 4093, 198], "max_tokens": 3},
    ]
    src.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    res = run_cli("generate", "--input", str(src), "--output", str(dst), "--max-tokens", "24", "--greedy")
    assert res.returncode == 0, res.stderr
    results = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [r["index"] for r in results] == [0, 1, 2]
    assert "Paris" in results[0]["text"]
    assert len(results[1]["token_ids"]) == 5 and results[1]["finish_reason"] == "length"
    assert "requests" in res.stderr and "tok/s" in res.stderr


def test_cli_batch_job_reports_a_bad_line(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "hi"}\n{"prompt": "x", "temperature": -3}\n')
    res = run_cli("generate", "--input", str(src))
    assert res.returncode == 2 and "in.jsonl:2" in res.stderr and "temperature" in res.stderr


def test_cli_chat_keeps_the_conversation():
    res = run_cli("chat", "--max-tokens", "24", "--greedy", stdin="What is the capital of France?\nAnd of Italy?\n")
    assert res.returncode == 0, res.stderr
    assert "Paris" in res.stdout and "Rome" in res.stdout


def test_cli_names_a_missing_model():
    res = run_cli("generate", "hi", "--model", "/nonexistent/model")
    assert res.returncode == 1 and "/nonexistent/model" in res.stderr and "Traceback" not in res.stderr
