"""The planner's promises: its prediction is checked against measured peaks; auto-sizing never
exceeds the budget and is maximal; what does not fit fails before anything is allocated, saying
what does fit."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from memory_grid import check_grid

from pagedllm import LLM, CacheDoesNotFitError, SamplingParams, loading
from pagedllm.config import ModelConfig
from pagedllm.engine_config import EngineConfig
from pagedllm.kinds.sparse_moe.forward import SparseMoE
from pagedllm.memory.budget import _cgroup_free, parse_memory, resolve_budget
from pagedllm.memory.footprint import EngineSettings, activation_peak, kv_bytes_per_block, parameter_count
from pagedllm.memory.planner import OVERHEAD_BYTES, plan
from pagedllm.memory.tracker import track_peak

GiB = 1024**3
CONFIGS = Path(__file__).parent.parent / "benchmarks/configs"


@pytest.mark.serial  # measured peaks, torch's thread count in the GEMM scratch: alone
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    "arch",
    [
        *("qwen2", "qwen3", "mistral", "llama3-rope-tied", "gemma3", "smollm3", "phi3"),
        *("qwen3-moe", "qwen2-moe", "olmoe", "gpt-oss"),
    ],
)
def test_step_memory_prediction_matches_measured_peak_on_tiny_models(tiny_checkpoints, arch, dtype):
    """A mixture of experts runs with its routers zeroed: every token then picks the same experts
    (the softmax ties, and topk takes the first), the step whose memory the planner bounds (one
    expert's rows are every token's). A random routing uses less, by as much as its spread."""
    loaded = loading.load(tiny_checkpoints[arch][0], dtype)
    for layer in loaded.model.model.decoder_layers():
        if isinstance(layer.mlp, SparseMoE):
            layer.mlp.router.weight.data.zero_()
    check_grid(loaded, dtype)


@pytest.mark.slow  # not serial: what it measures is this process's own tensor memory (track_peak)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_step_memory_prediction_matches_measured_peak_on_the_default_model(dtype):
    """As it ships: its Q4_1 / Q8_0 tensors run quantized. It runs beside other tests (on an xdist
    worker: three minutes of the suite off the serial part), which cannot move a count of this
    process's own allocations; the prediction takes the thread count this process runs on, and
    the GEMM scratch at the machine's whole thread count is pinned by the tiny models' grids,
    which stay serial."""
    check_grid(loading.load(None, dtype), dtype)


@pytest.mark.serial
@pytest.mark.parametrize(
    "quantization, kv_dtype, dtype",
    [
        ("int4", "int8", "bfloat16"),
        ("int8", "fp8", "bfloat16"),
        ("w8a8", None, "float32"),
        ("w8a8", "int8", "bfloat16"),
    ],
)
def test_step_memory_prediction_covers_quantized_weights_and_kv_cache(tiny_checkpoints, quantization, kv_dtype, dtype):
    check_grid(loading.load(tiny_checkpoints["qwen3"][0], dtype, quantization=quantization), dtype, kv_dtype)


@pytest.mark.serial
def test_activation_peak_bounds_the_heaviest_steps(tiny_checkpoints):
    """What the planner reserves for activations covers the worst steps the limits allow."""
    llm = LLM(tiny_checkpoints["qwen3"][0], max_batch_tokens=256, max_num_seqs=32, max_model_len=256, num_blocks=600)
    engine, reserve = llm.engine, llm.memory_plan.activation_bytes
    g = torch.Generator().manual_seed(0)
    full = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.5, repetition_penalty=1.2, logprobs=5, ignore_eos=True)
    for _ in range(32):
        engine.add_request(torch.randint(3, 300, (240,), generator=g).tolist(), full)
    peaks = []
    while engine.has_unfinished():
        with track_peak() as m:
            engine.step()
        peaks.append(m.peak_bytes)
    assert max(peaks) <= reserve


def over_baseline(mib: int) -> int:
    """A budget of ``mib`` MiB above what this (test) process holds now: memory= bounds the
    whole process, and the test process is large."""
    from pagedllm.memory.machine import resident_bytes

    return resident_bytes()[0] + mib * 1024**2


@pytest.mark.parametrize("kv, value_bytes, scale_bytes", [(None, 4, 0), ("int8", 1, 4), ("fp8", 1, 4)])
def test_cache_tensors_are_exactly_the_predicted_bytes(tiny_checkpoints, kv, value_bytes, scale_bytes):
    """The plan's cache bytes against the tensors and against arithmetic written here: per token,
    layer and KV head, K and V of head_dim values, plus one float32 scale each for 8-bit caches."""
    budget = over_baseline(120)
    llm = LLM(tiny_checkpoints["mistral"][0], memory=budget, block_size=8, kv_cache_dtype=kv)
    cache, plan_, cfg = llm.engine.kv_cache, llm.memory_plan, llm.loaded.config
    slots = cache.num_blocks * cache.block_size  # the blocks in use (the tensors reserve room to grow)
    tensors = cache.k + cache.v + cache.k_scale + cache.v_scale
    actual = sum(t[:, :slots].numel() * t.element_size() for t in tensors)
    per_token = cfg.num_layers * cfg.num_kv_heads * 2 * (cfg.head_dim * value_bytes + scale_bytes)
    assert actual == plan_.kv_cache_bytes == plan_.num_blocks * 8 * per_token
    assert sum(p.numel() for p in llm.loaded.model.parameters()) == parameter_count(llm.loaded.config)
    assert plan_.total_bytes <= budget


# ---- the solver ---------------------------------------------------------------------------------

configs = st.builds(
    lambda layers, kv, group, d, h_mult, inter_mult, vocab, tie, arch, ctx: ModelConfig.from_hf_dict(
        {
            "architectures": [arch],
            "num_hidden_layers": layers,
            "num_attention_heads": kv * group,
            "num_key_value_heads": kv,
            "head_dim": d,
            "hidden_size": 64 * h_mult,
            "intermediate_size": 64 * h_mult * inter_mult,
            "vocab_size": vocab,
            "tie_word_embeddings": tie,
            "max_position_embeddings": ctx,
        }
    ),
    st.integers(1, 96),
    st.integers(1, 16),
    st.integers(1, 8),
    st.sampled_from([32, 64, 128]),
    st.integers(1, 128),
    st.integers(2, 5),
    st.integers(256, 256_000),
    st.booleans(),
    st.sampled_from(["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"]),
    st.sampled_from([2048, 8192, 32768, 131072]),
)
engine_settings = st.builds(
    EngineSettings,
    dtype=st.sampled_from(["float32", "bfloat16"]),
    kv_dtype=st.sampled_from([None, "bfloat16", "float32", "int8", "fp8"]),
    block_size=st.sampled_from([1, 8, 16, 32]),
)


def total(cfg, s, n, m, seqs, max_len):
    from pagedllm.memory.footprint import weight_bytes

    return (
        weight_bytes(cfg, s.dtype)
        + n * kv_bytes_per_block(cfg, s.block_size, s.kv)
        + activation_peak(cfg, s, m, seqs, max_len)
        + OVERHEAD_BYTES
    )


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    cfg=configs,
    s=engine_settings,
    budget_gib=st.floats(0.05, 2000),
    mode=st.sampled_from(["auto", "n", "m"]),
    seqs=st.integers(1, 256),
    data=st.data(),
)
def test_solver_fits_and_is_maximal_and_its_suggestions_fit(cfg, s, budget_gib, mode, seqs, data):
    budget = int(budget_gib * GiB)
    n_given = data.draw(st.integers(1, 200_000)) if mode == "n" else None
    m_given = data.draw(st.integers(1, 16384)) if mode == "m" else None
    try:
        p = plan(cfg, budget, settings=s, num_blocks=n_given, max_batch_tokens=m_given, max_num_seqs=seqs)
    except CacheDoesNotFitError as e:
        sug = e.suggestions
        assert sug["memory_bytes"] > budget  # it really did not fit
        if "num_blocks" in sug and mode != "n":  # the suggested cache fits with the same M
            m = m_given or 1
            assert total(cfg, s, sug["num_blocks"], m, seqs, p_len(cfg, s)) <= budget
        if "max_batch_tokens" in sug and n_given is not None:
            assert total(cfg, s, n_given, sug["max_batch_tokens"], seqs, p_len(cfg, s)) <= budget
        if "max_model_len" in sug:  # a request of that length fits, with the failed step budget
            m = m_given or 512
            blocks = -(-sug["max_model_len"] // s.block_size)
            assert total(cfg, s, blocks, m, seqs, sug["max_model_len"]) <= budget
        return
    max_len = p.max_model_len
    used = total(cfg, s, p.num_blocks, p.max_batch_tokens, seqs, max_len)
    assert used == p.total_bytes <= budget
    assert p.num_blocks * s.block_size >= max_len
    if mode != "n":  # N was solved: one more block would not fit
        assert total(cfg, s, p.num_blocks + 1, p.max_batch_tokens, seqs, max_len) > budget
    if mode == "n":  # M was solved: one more token per step would not fit
        assert total(cfg, s, p.num_blocks, p.max_batch_tokens + 1, seqs, max_len) > budget
    if mode != "n" and max_len < p_len(cfg, s):  # L was solved: one more block of context would not fit
        longer = max_len + s.block_size
        n_longer = (budget - total(cfg, s, 0, p.max_batch_tokens, seqs, longer)) // kv_bytes_per_block(
            cfg, s.block_size, s.kv
        )
        assert n_longer * s.block_size < longer


def p_len(cfg, s):
    return min(s.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)


def small_cfg():
    return ModelConfig.from_hf_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "num_hidden_layers": 30,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "hidden_size": 576,
            "intermediate_size": 1536,
            "vocab_size": 49152,
            "tie_word_embeddings": True,
            "max_position_embeddings": 8192,
        }
    )


def test_both_given_is_checked_and_the_error_says_what_fits():
    cfg = small_cfg()
    with pytest.raises(CacheDoesNotFitError) as e:
        plan(cfg, 2 * GiB, num_blocks=2000, max_batch_tokens=20000, budget_source="memory=2GiB")
    msg = str(e.value)
    for part in (
        "GiB",
        "weights",
        "KV cache",
        "activations",
        "budget: 2.000 GiB (memory=2GiB)",
        "largest max_batch_tokens that fits with num_blocks=2000",
        "largest num_blocks that fits with max_batch_tokens=20000",
        "smallest memory",
        "bfloat16",
    ):
        assert part in msg
    assert isinstance(e.value, MemoryError)
    sug = e.value.suggestions
    for n, m in ((sug["num_blocks"], 20000), (2000, sug["max_batch_tokens"])):
        assert plan(cfg, 2 * GiB, num_blocks=n, max_batch_tokens=m).total_bytes <= 2 * GiB


def test_weights_alone_too_big():
    with pytest.raises(CacheDoesNotFitError, match="weights alone exceed"):
        plan(small_cfg(), 256 * 1024**2)


def test_a_cache_too_small_for_the_models_context_serves_the_context_it_holds():
    p = plan(small_cfg(), 4 * GiB, num_blocks=100)
    assert (p.max_model_len, p.max_model_len_source) == (1600, "solved: what the cache holds")


def test_a_given_max_model_len_the_cache_cannot_hold_is_refused_with_the_length_that_fits():
    s = EngineSettings(max_model_len=8192)
    with pytest.raises(CacheDoesNotFitError, match=r"cannot hold one request of max_model_len=8192") as e:
        plan(small_cfg(), 4 * GiB, settings=s, num_blocks=100)
    assert e.value.suggestions["max_model_len"] == 1600


def test_plan_is_checked_before_any_weight_is_loaded(tiny_checkpoints, monkeypatch):
    def fail(*a, **k):
        raise AssertionError("weights were loaded before the plan was checked")

    monkeypatch.setattr(loading, "load_dir", fail)
    with pytest.raises(CacheDoesNotFitError) as e:
        LLM(tiny_checkpoints["llama"][0], memory="1MiB", max_model_len=512)
    # The process baseline is measured (this test process holds far more than a few MiB), and
    # the memory the error names is enough for that same engine.
    from pagedllm.memory.machine import resident_bytes
    from pagedllm.memory.planner import plan_engine

    baseline = e.value.breakdown["baseline"]
    assert 50 * 1024**2 < baseline <= resident_bytes()[0]
    cfg = ModelConfig.from_file(tiny_checkpoints["llama"][0])
    asked = EngineConfig(memory=e.value.suggestions["memory_bytes"], max_model_len=512)
    fits = plan_engine(cfg, asked, baseline_bytes=baseline)
    assert fits.total_bytes <= e.value.suggestions["memory_bytes"] and fits.max_model_len == 512


# ---- the budget ---------------------------------------------------------------------------------


def test_memory_strings():
    assert parse_memory("6GiB") == 6 * GiB and parse_memory("512 MiB") == 512 * 1024**2
    assert parse_memory("8GB") == 8 * 10**9 and parse_memory("1.5GiB") == int(1.5 * GiB) and parse_memory(123) == 123
    with pytest.raises(ValueError, match="6 parsecs"):
        parse_memory("6 parsecs")


def test_cgroup_v2_and_v1_limits(tmp_path):
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.max").write_text("4294967296\n")
    (v2 / "memory.current").write_text("1073741824\n")
    assert _cgroup_free(str(v2)) == (3 * GiB, "cgroup v2 memory.max - memory.current")
    (v2 / "memory.max").write_text("max\n")
    assert _cgroup_free(str(v2)) is None
    v1 = tmp_path / "v1" / "memory"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text(str(2 * GiB))
    (v1 / "memory.usage_in_bytes").write_text(str(GiB // 2))
    assert _cgroup_free(str(tmp_path / "v1"))[0] == GiB + GiB // 2


def test_fraction_of_free_memory():
    budget, source = resolve_budget(None, 0.5)
    assert "0.5 x" in source and "free" in source and budget > 0
    with pytest.raises(ValueError):
        resolve_budget("1GiB", 0.5)
    with pytest.raises(ValueError):
        resolve_budget(None, 1.5)


def test_engine_with_a_memory_budget_serves_within_it(tiny_checkpoints):
    budget = over_baseline(130)
    llm = LLM(tiny_checkpoints["qwen2"][0], memory=budget, max_model_len=512)
    p = llm.memory_plan
    assert p.total_bytes <= budget < p.total_bytes + p.kv_bytes_per_block
    outs = llm.generate([[1, 2, 3]] * 4, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    assert all(len(o.token_ids) == 5 for o in outs)


# ---- the runtime guard --------------------------------------------------------------------------


def test_a_step_that_runs_out_of_memory_is_retried_smaller_and_loses_nothing(tiny_checkpoints):
    directory = tiny_checkpoints["llama"][0]
    prompts = [[i % 300 + 1] * (20 + i) for i in range(12)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    expected = [o.token_ids for o in LLM(directory, max_batch_tokens=512).generate(prompts, params)]

    llm = LLM(directory, max_batch_tokens=512)
    real_run, failures = llm.engine.runner.run, []

    def run_or_fail(batch, seqs):
        if batch.total_tokens > 100:
            failures.append(batch.total_tokens)
            raise torch.OutOfMemoryError("injected: step too large")
        return real_run(batch, seqs)

    llm.engine.runner.run = run_or_fail
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == expected
    assert llm.stats.oom_recoveries == len(failures) >= 1
    assert llm.engine.scheduler.max_batch_tokens <= 100 and llm.stats.max_batch_tokens <= 100
    assert llm.engine.blocks.num_free == llm.engine.blocks.num_blocks


# ---- the CLI ------------------------------------------------------------------------------------

LLAMA_70B = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "rope_scaling": {
        "factor": 8.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
}


def pagedllm(*args):
    return subprocess.run([sys.executable, "-m", "pagedllm.cli", *args], capture_output=True, text=True, timeout=120)


def test_plan_cli_plans_a_70b_model_from_its_config(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA_70B))
    res = pagedllm(
        "plan",
        "--model",
        str(config),
        "--memory",
        "200GiB",
        "--dtype",
        "bfloat16",
        "--max-model-len",
        "32768",
        "--json",
    )
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["fits"] and out["total_bytes"] <= 200 * GiB
    assert 131 * GiB < out["weights_bytes"] < 132 * GiB  # 70.55B parameters in bf16
    table = pagedllm(
        "plan", "--model", str(config), "--memory", "200GiB", "--dtype", "bfloat16", "--max-model-len", "32768"
    )
    assert "KV cache" in table.stdout and "headroom" in table.stdout
    too_small = pagedllm("plan", "--model", str(config), "--memory", "80GiB", "--dtype", "bfloat16")
    assert too_small.returncode == 3 and "weights alone exceed" in too_small.stderr


# The mixtures of experts' total parameters as their model cards state them (every expert, the
# routers, attention, embeddings and head).
MOE_CONFIGS = [("qwen3-30b-a3b", 30.5e9), ("mixtral-8x7b", 46.7e9), ("olmoe-1b-7b", 6.9e9), ("gpt-oss-20b", 20.9e9)]


@pytest.mark.parametrize("name, published", MOE_CONFIGS)
def test_a_mixture_of_experts_counts_every_expert_as_its_model_card_does(name, published):
    cfg = ModelConfig.from_file(CONFIGS / f"{name}.json")
    assert abs(parameter_count(cfg) - published) <= 0.005 * published  # the cards round to 0.1B


# (config, GiB of weights: 0.75 bytes a weight in int4 groups, the embeddings in int8, norms and
# routers in bf16 or float32)
# Qwen3-30B-A3B's matrices all have widths of whole 256-column blocks: int4 holds them as Q4_K
# (0.5625 bytes a weight, ~16.3 GiB); gpt-oss-20b's 2880 are not: groups of 32 with float32
# scales and zeros (0.75 bytes a weight).
MOE_PLANS = [("qwen3-30b-a3b", 16, 16.5), ("gpt-oss-20b", 14.5, 15.5)]


@pytest.mark.parametrize("name, least, most", MOE_PLANS)
def test_a_mixture_plans_int4_with_32k_tokens_of_context_in_24_gib(name, least, most):
    """README's MoE promise (issue 49): the plan of its config.json, weights in int4, an int8 KV
    cache."""
    res = pagedllm(
        "plan", "--model", str(CONFIGS / f"{name}.json"), "--quantization", "int4", "--dtype", "bfloat16",
        "--kv-cache-dtype", "int8", "--memory", "24GiB", "--max-model-len", "32768", "--json",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["fits"] and out["total_bytes"] <= 24 * GiB and out["num_blocks"] * out["block_size"] >= 32768
    assert least * GiB < out["weights_bytes"] < most * GiB


@pytest.mark.parametrize(
    "sizes",
    [dict(), dict(num_blocks=2000, max_batch_tokens=20000), dict(num_blocks=300), dict(max_batch_tokens=4096)],
)
def test_every_number_in_a_does_not_fit_message_is_the_planners(sizes):
    """One consistent set of numbers: each figure the message prints is one the planner computed
    (breakdown, suggestions), and each suggestion it prints is one that fits."""
    import re

    from pagedllm.sizes import gib

    cfg, budget = small_cfg(), 900 * 1024**2
    s = EngineSettings(max_model_len=8192)
    with pytest.raises(CacheDoesNotFitError) as e:
        plan(cfg, budget, settings=s, baseline_bytes=300 * 1024**2, **sizes)
    msg, b, sug = str(e.value), e.value.breakdown, e.value.suggestions
    needs = re.search(
        r"needs (\S+ GiB): process baseline (\S+ GiB) \+ weights (\S+ GiB) .*KV cache (\S+ GiB) "
        r"\((\d+) blocks.*activations (\S+ GiB) .*overhead (\S+ GiB)",
        msg,
    )
    assert needs, msg
    parts = [b["total"], b["baseline"], b["weights"], b["kv_cache"], None, b["activations"], b["overhead"]]
    for shown, value in zip(needs.groups(), parts):
        if value is not None:
            assert shown == gib(value)
    assert int(needs.group(5)) * kv_bytes_per_block(cfg, 16, "float32") == b["kv_cache"]
    assert b["total"] == sum(b[k] for k in ("baseline", "weights", "kv_cache", "activations", "overhead"))
    assert "smallest memory that fits" in msg and msg.count(gib(b["total"])) >= 2
    for key, label in (
        ("num_blocks", "largest num_blocks"),
        ("max_batch_tokens", "largest max_batch_tokens"),
        ("max_model_len", "longest max_model_len"),
    ):
        shown = re.search(label + r"[^:]*: (\d+)", msg)
        assert (shown is not None) == (key in sug), (key, msg)
        if shown:
            assert int(shown.group(1)) == sug[key]


def test_a_tight_budget_solves_max_num_seqs_down_to_the_blocks_it_has():
    """No more sequences than blocks ever run at once; reserving logits for more wastes the
    budget a small cache needs."""
    cfg = small_cfg()
    tight = plan(cfg, 680 * 1024**2, settings=EngineSettings(dtype="bfloat16"), baseline_bytes=300 * 1024**2)
    assert tight.max_num_seqs <= tight.num_blocks and tight.max_num_seqs < 64
    wider = plan(
        cfg, 680 * 1024**2, settings=EngineSettings(dtype="bfloat16"), max_num_seqs=64, baseline_bytes=300 * 1024**2
    )
    assert wider.max_num_seqs == 64 and wider.num_blocks < tight.num_blocks
    roomy = plan(cfg, 4 * GiB, settings=EngineSettings(dtype="bfloat16"), baseline_bytes=300 * 1024**2)
    assert roomy.max_num_seqs == 64


def test_qwen3_30b_a3b_in_int4_plans_32k_tokens_of_bf16_context_in_24_gib():
    """Issue 65's target: int4 as Q4_K blocks, bf16 activations and the default (bf16) KV cache,
    32k tokens in 24 GiB. The weights are the test's arithmetic on the config: every decoder
    matrix at 144 bytes a 256 weights, the embedding and lm_head in int8 with a float32 scale a
    row, the routers in float32; the norms (bf16) are what the 0.1% bound leaves."""
    cfg = json.loads((CONFIGS / "qwen3-30b-a3b.json").read_text())
    h, layers, experts, width = (
        cfg["hidden_size"],
        cfg["num_hidden_layers"],
        cfg["num_experts"],
        cfg["moe_intermediate_size"],
    )
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    linear = layers * ((q + 2 * kv) * h + h * q + experts * 3 * h * width)
    expected = linear * 144 // 256 + 2 * cfg["vocab_size"] * (h + 4) + layers * experts * h * 4
    res = pagedllm(
        "plan", "--model", str(CONFIGS / "qwen3-30b-a3b.json"), "--quantization", "int4", "--dtype", "bfloat16",
        "--memory", "24GiB", "--max-model-len", "32768", "--json",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert expected <= out["weights_bytes"] < expected * 1.001
    assert out["fits"] and out["total_bytes"] <= 24 * GiB and out["num_blocks"] * out["block_size"] >= 32768


def test_the_plan_sums_each_layer_kinds_cache_and_counts_a_state_per_sequence():
    """The planner asks each layer's cache (``kinds``), never its kind: a model whose
    every other layer keeps a fixed state in place of paged K/V (the next round's recurrent
    kinds, built here by hand) pays half the bytes per block and max_num_seqs states, which the
    solve takes from the cache: the arithmetic below is the test's own."""
    from pagedllm.kinds import LayerKind, PagedKV, SequenceState
    from pagedllm.sizes import ceil_div

    cfg, state = small_cfg(), 3 * 1024**2
    attention = PagedKV(None, cfg.num_kv_heads, cfg.head_dim)
    kinds = tuple(
        LayerKind("attention", "dense_mlp", attention if i % 2 == 0 else SequenceState((("s", (state // 4,)),)))
        for i in range(cfg.num_layers)
    )
    hybrid = dataclasses.replace(cfg)
    hybrid.__dict__["layer_kinds"] = kinds  # (a cached property of the frozen config)
    attention_layers = ceil_div(cfg.num_layers, 2)
    per_block = 16 * attention_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2  # bf16 K and V, 16 tokens
    seqs, sizes = 8, dict(max_batch_tokens=256, max_num_seqs=8)
    s = EngineSettings(dtype="bfloat16", max_model_len=2048)
    dense, mixed = plan(cfg, 2 * GiB, settings=s, **sizes), plan(hybrid, 2 * GiB, settings=s, **sizes)
    assert mixed.kv_bytes_per_block == per_block and dense.kv_bytes_per_block == 2 * per_block
    # a state for each sequence that may run, and as many prefix checkpoints (one per sequence)
    assert mixed.checkpoint_slots == seqs and dense.checkpoint_slots == 0
    assert mixed.state_bytes == 2 * seqs * state * (cfg.num_layers - attention_layers)
    assert mixed.total_bytes <= 2 * GiB and mixed.total_bytes + per_block > 2 * GiB  # maximal, states counted
    assert "sequence states" in mixed.table() and "sequence states" not in dense.table()
    from pagedllm.backends.cpu.torch_backend import CPUTorchBackend

    with pytest.raises(ValueError, match="state_slots"):  # a state per running sequence, or no cache
        CPUTorchBackend().allocate_kv_cache(hybrid, 4, 16, "bfloat16", resident=False)
    cache = CPUTorchBackend().allocate_kv_cache(
        hybrid, 4, 16, "bfloat16", resident=False, state_slots=seqs, checkpoint_slots=mixed.checkpoint_slots
    )
    held = [t for pool in (cache.states, cache.checkpoints) for layer in pool.values() for t in layer.values()]
    assert sum(t.numel() * 4 for t in held) == mixed.state_bytes
