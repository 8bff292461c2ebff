"""lm-evaluation-harness against ``pagedllm serve``: its ``local-completions`` log-likelihood
tasks send ``echo`` with ``logprobs`` and read the prompt's own token logprobs back. Each
log-likelihood it computes equals transformers' on the same GGUF (fp32 tolerance), and the
echoed answer is the prompt, so the harness scores what the model says, not chance."""

import json
import subprocess
import sys

import httpx
import pytest
import torch
from server_process import ServerProcess

from pagedllm.loading.default_model import default_gguf_path

pytestmark = pytest.mark.slow

# A small multiple-choice task written here: (question, choices, the right one).
QUESTIONS = [
    ("The capital of France is", [" Paris", " Berlin", " Rome"], 0),
    ("Two plus two equals", [" five", " four", " seven"], 1),
    ("The sun rises in the", [" west", " north", " east"], 2),
    ("Water freezes at zero degrees", [" Celsius", " Kelvin"], 0),
]
TASK = """task: pagedllm_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
"""


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--max-model-len", "512")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def hf_and_tokenizer(tmp_path_factory):
    """transformers' model and tokenizer of the default GGUF; the tokenizer saved where lm-eval
    can load it (its huggingface tokenizer backend)."""
    from formats import hf_model
    from transformers import AutoTokenizer

    gguf = default_gguf_path()
    hf = hf_model()  # transformers' own reading of the same GGUF file
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    directory = tmp_path_factory.mktemp("tokenizer")
    tokenizer.save_pretrained(directory)
    return hf, tokenizer, directory


def hf_loglikelihood(hf, context: list[int], continuation: list[int]) -> float:
    with torch.no_grad():
        logits = hf(torch.tensor([context + continuation])).logits[0].float().log_softmax(-1)
    rows = range(len(context) - 1, len(context) + len(continuation) - 1)
    return sum(logits[r, t].item() for r, t in zip(rows, continuation))


def test_echo_logprobs_are_the_prompts_own_under_transformers(server, hf_and_tokenizer):
    hf, tokenizer, _ = hf_and_tokenizer
    prompt = tokenizer.encode("The capital of France is Paris")
    body = {"prompt": prompt, "max_tokens": 1, "logprobs": 2, "echo": True, "temperature": 0}
    choice = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert choice["text"].startswith("The capital of France is Paris")
    lp = choice["logprobs"]
    assert len(lp["token_logprobs"]) == len(prompt) + 1 and lp["token_logprobs"][0] is None
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    for p in range(1, len(prompt)):
        assert lp["token_logprobs"][p] == pytest.approx(expected[p - 1, prompt[p]].item(), abs=2e-3)
        top = expected[p - 1].topk(2)
        assert list(lp["top_logprobs"][p].values()) == pytest.approx(top.values.tolist(), abs=2e-3)


def test_lm_eval_local_completions_loglikelihoods_equal_transformers(server, hf_and_tokenizer, tmp_path):
    hf, tokenizer, tokenizer_dir = hf_and_tokenizer
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "tiny_mc.yaml").write_text(TASK.format(data=data))
    name = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
    model_args = (
        f"model={name},base_url={server.url}/v1/completions,num_concurrent=1,max_retries=1,"
        f"tokenized_requests=True,tokenizer_backend=huggingface,tokenizer={tokenizer_dir}"
    )
    command = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", model_args]
    command += ["--tasks", "pagedllm_tiny_mc", "--include_path", str(tasks), "--log_samples"]
    command += ["--output_path", str(tmp_path / "out")]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    samples = [json.loads(line) for f in (tmp_path / "out").rglob("samples_*.jsonl") for line in f.open()]
    assert len(samples) == len(QUESTIONS)
    for sample in samples:
        for args, response in zip(sample["arguments"].values(), sample["resps"]):
            context, continuation = args["arg_0"], args["arg_1"]
            whole = tokenizer.encode(context + continuation, add_special_tokens=False)
            context_ids = tokenizer.encode(context, add_special_tokens=False)
            expected = hf_loglikelihood(hf, context_ids, whole[len(context_ids) :])
            assert float(response[0][0]) == pytest.approx(expected, abs=2e-3)
        assert sample["acc"] == 1.0 or sample["doc_id"] != 0  # the model knows Paris: scored, not chance
