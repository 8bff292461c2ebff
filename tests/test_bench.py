"""`pagedllm bench` measures what it says: the workloads have the promised shapes, every engine
gets the same token ids, the runner counts the tokens it generated, missing peers are skipped."""

import argparse
import dataclasses
import json
import os
import subprocess
import sys

import pytest

from pagedllm.bench import runners, workloads
from pagedllm.bench.run import table


@pytest.fixture(scope="module")
def tokenizer(default_llm):
    return default_llm.tokenizer


@pytest.mark.slow  # loads the default model
def test_standard_workload_spreads_prompt_lengths_and_is_reproducible(tokenizer):
    w = workloads.standard(tokenizer, n=16, new_tokens=8)
    lengths = sorted(len(p) for p in w.prompts)
    assert len(w.prompts) == 16 and w.max_tokens == [8] * 16
    assert 16 <= lengths[0] <= 40 and 256 <= lengths[-1] <= 280
    assert w.prompts == workloads.standard(tokenizer, n=16, new_tokens=8).prompts
    assert [len(p) for p in w.prompts] != lengths  # shuffled


@pytest.mark.slow  # loads the default model
def test_shared_prefix_workload_shares_a_long_prefix(tokenizer):
    w = workloads.shared_prefix(tokenizer, n=4, new_tokens=8)
    first, second = w.prompts[0], w.prompts[1]
    common = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    assert common >= 500 and all(p[:common] == first[:common] for p in w.prompts)


@pytest.mark.slow  # loads the default model
def test_jsonl_workload(tmp_path, tokenizer):
    f = tmp_path / "w.jsonl"
    f.write_text(
        '{"prompt": "Hello"}\n{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}\n'
        '{"prompt_token_ids": [1, 2, 3]}\n'
    )
    w = workloads.from_jsonl(str(f), tokenizer, new_tokens=5)
    assert w.max_tokens == [5, 3, 5] and w.prompts[2] == [1, 2, 3]


def test_without_a_tokenizer_the_workloads_are_token_ids_of_the_same_lengths(tmp_path):
    """A weights-only checkpoint: prompts drawn from its vocabulary, never its special ids, at the
    lengths the tokenized workloads aim for, the same on every run of the seed."""
    vocab = workloads.Vocab(8, frozenset({0, 7}))  # so small that 199 draws would meet 0 and 7
    w = workloads.standard(None, n=16, new_tokens=8, vocab=vocab)
    assert sorted(len(p) for p in w.prompts) == [16 + (256 - 16) * i // 15 for i in range(16)]
    assert [len(p) for p in w.prompts] != sorted(len(p) for p in w.prompts)  # shuffled
    assert w.max_tokens == [8] * 16
    assert set().union(*w.prompts) == {1, 2, 3, 4, 5, 6}
    assert w.prompts == workloads.standard(None, n=16, new_tokens=8, vocab=vocab).prompts
    assert w.prompts != workloads.standard(None, n=16, new_tokens=8, vocab=vocab, seed=1).prompts

    one = workloads.single(None, vocab=workloads.Vocab(50_000))
    assert [len(p) for p in one.prompts] == [199] and one.max_tokens == [128]
    assert all(0 <= t < 50_000 for t in one.prompts[0]) and len(set(one.prompts[0])) > 190

    shared = workloads.shared_prefix(None, n=4, new_tokens=8, vocab=workloads.Vocab(50_000))
    assert [len(p) for p in shared.prompts] == [512 + 32] * 4
    assert all(p[:512] == shared.prompts[0][:512] for p in shared.prompts)
    assert len({tuple(p[512:]) for p in shared.prompts}) == 4  # each its own question

    f = tmp_path / "w.jsonl"
    f.write_text('{"prompt_token_ids": [1, 2, 3]}\n')
    assert workloads.from_jsonl(str(f), None).prompts == [[1, 2, 3]]
    f.write_text('{"prompt_token_ids": [1, 2, 3]}\n{"prompt": "Hello"}\n')
    with pytest.raises(ValueError, match=r"w.jsonl:2: a text prompt .* needs the model's tokenizer"):
        workloads.from_jsonl(str(f), None)


def test_the_vocabulary_leaves_out_the_ids_the_config_names_special():
    from test_memory_planner import small_cfg  # SmolLM2-135M's shapes: 49152 tokens

    cfg = dataclasses.replace(small_cfg(), bos_token_id=1, eos_token_ids=(2, 49151))
    assert workloads.Vocab.of(cfg) == workloads.Vocab(49152, frozenset({1, 2, 49151}))
    assert workloads.Vocab.of(small_cfg()) == workloads.Vocab(49152)  # none named: none left out


def test_the_llama_cpp_peer_runs_the_gguf_pagedllm_runs(tmp_path):
    from pagedllm.bench.run import peer_gguf

    args = argparse.Namespace(gguf=None, model=str(tmp_path / "m.gguf"))
    assert peer_gguf(args) == str(tmp_path / "m.gguf")
    assert peer_gguf(argparse.Namespace(gguf="other.gguf", model=str(tmp_path / "m.gguf"))) == "other.gguf"
    assert peer_gguf(argparse.Namespace(gguf=None, model=str(tmp_path))) is None  # a directory: --gguf


def test_bench_runs_a_checkpoint_without_a_tokenizer(tiny_checkpoints, tmp_path, monkeypatch, capsys):
    """`pagedllm bench --model DIR` on config.json + safetensors alone (the tiny checkpoints carry
    no tokenizer) reports its throughput."""
    from pagedllm import cli
    from pagedllm.bench import limits

    model_dir = tiny_checkpoints["llama"][0]
    assert not list(model_dir.glob("tokenizer*"))
    measure = limits.measure
    monkeypatch.setattr(limits, "measure", lambda *a: measure(*a, read_bytes=32 * 2**20))  # seconds saved
    out = tmp_path / "r.json"
    argv = ["bench", "--model", str(model_dir), "--workload", "standard", "--num-prompts", "4", "--new-tokens", "4"]
    assert cli.main([*argv, "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["results"]
    assert row["engine"] == "pagedllm" and row["requests"] == 4 and row["output_tokens"] == 16
    assert row["output_tokens_per_s"] == pytest.approx(16 / row["elapsed_s"])
    assert "no tokenizer: prompts drawn as random token ids" in capsys.readouterr().out


def test_pagedllm_runner_counts_what_it_generated(tiny_checkpoints, tmp_path, capsys):
    wl = {"name": "t", "prompts": [[1, 2, 3], [4] * 20, [5] * 7], "max_tokens": [4, 6, 5]}
    path = tmp_path / "w.json"
    path.write_text(json.dumps(wl))
    runners.main(["pagedllm", str(path), str(tiny_checkpoints["llama"][0]), "float32"])
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("BENCH_RESULT ")][0]
    r = json.loads(line.split(" ", 1)[1])
    assert r["output_tokens"] == 15 and r["requests"] == 3
    assert r["output_tokens_per_s"] == pytest.approx(15 / r["elapsed_s"])
    assert r["peak_rss_bytes"] > 0 and r["ttft_p50_s"] >= 0


def test_table_shows_ratios_and_skipped_peers():
    ours = {
        "engine": "pagedllm",
        "requests_per_s": 2,
        "output_tokens_per_s": 200,
        "total_tokens_per_s": 600,
        "peak_rss_bytes": 1e9,
    }
    peer = dict(ours, engine="peer", output_tokens_per_s=100)
    text = table([ours, peer, {"engine": "vllm-cpu", "skipped": "no vLLM environment"}])
    assert "| peer |" in text and "2.00x" in text and "skipped: no vLLM environment" in text


@pytest.mark.slow
def test_bench_cli_end_to_end_with_a_peer(tmp_path):
    out = tmp_path / "r.json"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagedllm.cli",
            "bench",
            "--num-prompts",
            "4",
            "--new-tokens",
            "4",
            "--memory",
            "2GiB",
            "--compare",
            "hf-static,vllm",
            "--peer-dtypes",
            "float32,bfloat16",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr
    results = json.loads(out.read_text())["results"]
    assert results[0]["engine"] == "pagedllm" and results[0]["output_tokens"] == 16
    # each peer once per --peer-dtypes, named by it
    assert [r["engine"].rsplit(" ", 1)[1] for r in results[1:]] == ["float32", "bfloat16"] * 2
    assert results[1]["output_tokens"] == results[2]["output_tokens"] == 16
    assert "skipped" in results[3] and "skipped" in results[4]  # no --vllm-python given
    assert "| pagedllm |" in res.stdout and "# machine limits: float32 GEMM" in res.stdout
    shares = results[0]["limit_shares"]
    # present for every row that ran (their sizes are timings of a 16-token run: not asserted here;
    # the arithmetic is test_limit_shares_are_the_work_done_over_the_machines_rate's)
    assert shares["gemm"] > 0 and shares["read"] > 0
    assert results[1]["limit_shares"]["gemm"] > 0 and results[2]["limit_shares"]["gemm"] > 0


@pytest.mark.slow
def test_bench_variants_run_each_configuration_in_one_run(tmp_path):
    """One bench run, several pagedllm rows: weights as stored and dequantized, an 8-bit KV cache;
    each row reports the RSS its engine added above the interpreter."""
    out = tmp_path / "r.json"
    variants = "float32:none,bfloat16:stored:int8"
    cmd = [sys.executable, "-m", "pagedllm.cli", "bench", "--num-prompts", "2", "--new-tokens", "3"]
    res = subprocess.run(
        [*cmd, "--variants", variants, "--json", str(out)], capture_output=True, text=True, timeout=600
    )
    assert res.returncode == 0, res.stderr
    results = json.loads(out.read_text())["results"]
    assert [r["engine"] for r in results] == ["pagedllm float32 none", "pagedllm bfloat16 stored kv int8"]
    assert all(r["output_tokens"] == 6 for r in results)
    assert all(0 < r["interpreter_rss_bytes"] < r["peak_rss_bytes"] for r in results)
    assert results[1]["weights_bytes"] < results[0]["weights_bytes"] / 3  # Q4_1 against float32


def test_arrivals_are_all_at_once_or_a_seeded_poisson_process():
    from pagedllm.bench.serve import arrivals

    assert arrivals(5, float("inf")) == [0.0] * 5
    times = arrivals(2000, 4.0, seed=1)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert times[0] == 0 and all(g >= 0 for g in gaps) and times == arrivals(2000, 4.0, seed=1)
    assert abs(sum(gaps) / len(gaps) - 0.25) < 0.02  # mean gap 1/rate
    assert arrivals(10, 4.0, seed=2) != arrivals(10, 4.0, seed=1)


@pytest.mark.slow  # starts a server
def test_the_online_load_counts_every_token_and_times_it(tiny_checkpoints):
    """Against a real server: every token the workload asks for is counted (ignore_eos), the
    server's own counter agrees, and each request's first token comes before its end."""
    import asyncio

    from server_process import ServerProcess

    from pagedllm.bench.serve import run_load

    server = ServerProcess("--model", str(tiny_checkpoints["llama"][0]), "--max-model-len", "64", "--max-num-seqs", "8")
    try:
        prompts, max_tokens = [[1, 2, 3], [4] * 20, [5] * 7, [6] * 11], [4, 6, 5, 9]
        for rate in (float("inf"), 20.0):
            before = server.metric("pagedllm_generation_tokens_total")
            summary = asyncio.run(run_load(server.url, prompts, max_tokens, rate)).summary()
            assert summary["failed"] == 0 and summary["output_tokens"] == sum(max_tokens)
            assert server.metric("pagedllm_generation_tokens_total") - before == sum(max_tokens)
            assert 0 < summary["ttft_ms"]["p50"] <= summary["ttft_ms"]["p99"]
            assert summary["output_tokens_per_s"] == pytest.approx(sum(max_tokens) / summary["elapsed_s"])
    finally:
        server.stop()


def test_limit_shares_are_the_work_done_over_the_machines_rate():
    """GEMM share: 2 FLOPs per decoder linear weight for every token and per lm_head weight for
    every output token, over the elapsed time, over the measured rate; read share: the weights
    once per step over the time, over the bandwidth (arithmetic written out here)."""
    from pagedllm.bench.limits import MachineLimits, Work, shares

    machine = MachineLimits({"float32": 200e9}, read_bytes_per_s=20e9)
    work = Work(linear_weights=100e6, lm_head_weights=30e6, prompt_tokens=9000)
    row = {"output_tokens": 4000, "elapsed_s": 20.0, "steps": 150, "weights_bytes": 500e6}
    got = shares(row, machine, "float32", work)
    assert got["gemm"] == pytest.approx((2 * 100e6 * 13000 + 2 * 30e6 * 4000) / 20.0 / 200e9)
    assert got["read"] == pytest.approx(500e6 * 150 / 20.0 / 20e9)
    # a row that measured the bandwidth beside it is set against that, not the run's first
    beside = shares({**row, "read_limit_bytes_per_s": 40e9}, machine, "float32", work)
    assert beside["read"] == pytest.approx(500e6 * 150 / 20.0 / 40e9) and beside["gemm"] == got["gemm"]
    assert shares({"output_tokens": 4000, "elapsed_s": 20.0}, machine, "float32", work).keys() == {"gemm"}
    # an untied embedding table is not read whole each step: the row's own count of what is
    assert shares({**row, "step_read_bytes": 450e6}, machine, "float32", work)["read"] == pytest.approx(
        450e6 * 150 / 20.0 / 20e9
    )


def test_a_step_reads_every_weight_but_an_untied_embedding_table(tiny_checkpoints):
    """The bytes a decode step reads: the plan's weights less the untied embedding table
    (vocabulary x hidden float32 values here), of which a step reads only its tokens' rows."""
    from pagedllm import LLM
    from pagedllm.bench.runners import _untied_embedding_bytes

    checkpoint = str(tiny_checkpoints["llama"][0])
    llm = LLM(checkpoint, dtype="float32")
    cfg = llm.engine.loaded.config
    assert not cfg.tie_word_embeddings  # the case this measures
    assert _untied_embedding_bytes(llm.engine.loaded.model) == cfg.vocab_size * cfg.hidden_size * 4
    # kept quantized (int8: a byte a value and a float16 scale per 32 columns)
    int8 = LLM(checkpoint, dtype="float32", quantization="int8")
    assert _untied_embedding_bytes(int8.engine.loaded.model) == cfg.vocab_size * (
        cfg.hidden_size + cfg.hidden_size // 32 * 2
    )


def test_the_work_counts_every_linear_weight_of_the_model():
    from test_memory_planner import small_cfg  # SmolLM2-135M's shapes

    from pagedllm.bench.limits import Work

    cfg = small_cfg()
    per_layer = 576 * 576 * 2 + 2 * 576 * 192 + 3 * 576 * 1536  # q and o, k and v, gate/up/down
    work = Work.of(cfg, prompt_tokens=10)
    assert (work.linear_weights, work.lm_head_weights) == (30 * per_layer, 49152 * 576)


def test_the_work_of_a_mixture_counts_each_tokens_chosen_experts_only():
    import json
    from pathlib import Path

    from pagedllm.bench.limits import Work
    from pagedllm.config import ModelConfig

    a3b = json.loads((Path(__file__).parents[1] / "benchmarks/configs/qwen3-30b-a3b.json").read_text())
    cfg = ModelConfig.from_hf_dict(a3b)
    per_layer = 2048 * 4096 * 2 + 2 * 2048 * 512 + 8 * 3 * 2048 * 768  # q and o, k and v, 8 of 128 experts
    work = Work.of(cfg, prompt_tokens=10)
    assert (work.linear_weights, work.lm_head_weights) == (48 * per_layer, 151936 * 2048)
    # a step reads the experts its rows chose: one row, 8 of 128 in each layer; 16 rows routed
    # evenly, 1 - (120/128)**16 of them; every other weight in full
    experts = 48 * 128 * 3 * 2048 * 768
    share = experts / 30_532_122_624  # A3B's parameters (test_memory_planner pins the count)
    assert work.read_fraction(1) == pytest.approx(1 - share + share * 8 / 128)
    assert work.read_fraction(16) == pytest.approx(1 - share + share * (1 - (120 / 128) ** 16))


def test_the_machine_limits_are_measured():
    from pagedllm.bench.limits import measure

    limits = measure(64, 128, ["float32", "bfloat16"], read_bytes=32 * 2**20)
    assert set(limits.gemm_flops) == {"float32", "bfloat16"}
    assert min(limits.gemm_flops.values()) > 1e8 and limits.read_bytes_per_s > 1e8
    assert "float32 GEMM" in limits.describe()


def test_bench_matrix_writes_one_table_of_every_variant_and_workload_into_the_doc(tmp_path, tiny_checkpoints):
    """``bench --matrix``: each variant on one request and on a batch, one row each in a table
    written between its markers (its stale section replaced, the machine's own section and the
    rest of the file kept), its ratios to float32 those of its own tok/s figures (the test
    divides), the CPU's flags beside it, and an emulation variable set in the run named as such.
    A stale section left in, or the ratio taken against the wrong row: fails."""
    doc = tmp_path / "benchmarks.md"
    emulated = "(MKL_ENABLE_INSTRUCTIONS=AVX2)"
    native = "<!-- pagedllm bench --matrix: begin -->\nnative\n<!-- pagedllm bench --matrix: end -->\n"
    stale = (
        f"<!-- pagedllm bench --matrix {emulated}: begin -->\nstale\n<!-- pagedllm bench --matrix {emulated}: end -->"
    )
    doc.write_text(f"# Benchmarks\n\n{native}\n{stale}\n\nafter\n")
    cmd = [sys.executable, "-m", "pagedllm.cli", "bench", "--matrix", "--model", str(tiny_checkpoints["llama"][0])]
    cmd += ["--variants", "float32:none,float32:int8", "--num-prompts", "3", "--new-tokens", "4"]
    env = {**os.environ, "MKL_ENABLE_INSTRUCTIONS": "AVX2"}  # stands in for an AVX2 machine's MKL
    res = subprocess.run([*cmd, "--matrix-doc", str(doc)], capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stderr
    text = doc.read_text()
    assert text.startswith(f"# Benchmarks\n\n{native}\n") and text.endswith("\n\nafter\n") and "stale" not in text
    assert text.count(f"<!-- pagedllm bench --matrix {emulated}: begin -->") == 1
    assert "CPU flags" in text and f"**emulated** {emulated}" in text
    rows = {
        line.split(" | ")[0][2:]: line.split(" | ")[1:] for line in text.splitlines() if line.startswith("| pagedllm")
    }
    assert list(rows) == ["pagedllm float32 none", "pagedllm float32 int8"]
    for column in range(2):  # one request; 3 prompts at once
        base = float(rows["pagedllm float32 none"][column].split(",")[0])
        for cells in rows.values():
            rate, versus_float, versus_peer = (c.strip(" |") for c in cells[column].split(","))
            # the table's rates are rounded to 0.1 tok/s, its ratio taken from the unrounded rates
            slack = 0.005 + 0.05 / base + 0.05 * float(rate) / base**2
            assert abs(float(versus_float.removesuffix("x")) - float(rate) / base) <= slack, (versus_float, rate, base)
            assert versus_peer == "-"  # no peer in this run
