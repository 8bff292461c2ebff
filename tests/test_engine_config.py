"""One engine config: every knob is a field of EngineConfig, every command's engine flags are
exactly those fields, every bad value is refused in one place naming its field, and the API and
the engine plan the same way from it."""

import dataclasses

import pytest

from pagedllm import LLM
from pagedllm.cli import build_parser
from pagedllm.engine import LLMEngine
from pagedllm.engine_config import ConfigError, EngineConfig
from pagedllm.structured import GRAMMAR_CACHE_BYTES

FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}
SERVE_ONLY = {"idle_release_after", "idle_keep_prefix_cache"}  # an idle engine is a server's


def fields_of(command: str) -> set[str]:
    return FIELDS if command == "serve" else FIELDS - SERVE_ONLY


@pytest.mark.parametrize("command", ["generate", "chat", "serve", "bench", "plan"])
def test_every_command_has_exactly_the_config_fields_as_engine_flags(command):
    parser = build_parser()
    sub = next(a for a in parser._subparsers._group_actions).choices[command]
    group = next(g for g in sub._action_groups if g.title == "model and engine")
    assert {a.dest for a in group._group_actions} == fields_of(command)
    assert EngineConfig.from_args(parser.parse_args([command] if command != "generate" else [command, "x"])) == (
        EngineConfig()
    ), "the flags' defaults are the config's"


@pytest.mark.parametrize("command", ["generate", "chat", "serve", "bench", "plan"])
def test_every_commands_help_lists_the_engine_flags(command, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([command, "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "--memory MEMORY | --memory-fraction MEMORY_FRACTION" in out
    flags = {"enable_prefix_caching": "--no-prefix-caching", "structured_output": "--no-structured-output"}
    assert all(flags.get(name, f"--{name.replace('_', '-')}") in out for name in fields_of(command))


def test_flags_become_the_config_they_name():
    args = build_parser().parse_args(
        "plan --model m --dtype bfloat16 --kv-cache-dtype fp8 --quantization int4 --block-size 8 --num-blocks 9 "
        "--max-batch-tokens 10 --max-num-seqs 11 --max-model-len 12 --memory 1GiB --no-prefix-caching "
        "--no-structured-output --backend cpu-torch --threads 1".split()
    )
    assert EngineConfig.from_args(args) == EngineConfig(
        model="m",
        dtype="bfloat16",
        kv_cache_dtype="fp8",
        quantization="int4",
        block_size=8,
        num_blocks=9,
        max_batch_tokens=10,
        max_num_seqs=11,
        max_model_len=12,
        memory="1GiB",
        enable_prefix_caching=False,
        structured_output=False,
        backend="cpu-torch",
        threads=1,
    )


@pytest.mark.parametrize(
    "options, field, words",
    [
        (dict(block_size=0), "block_size", ">= 1"),
        (dict(max_num_seqs=2.5), "max_num_seqs", "whole number"),
        (dict(threads=True), "threads", "whole number"),
        (dict(dtype="float16"), "dtype", "not supported"),
        (dict(kv_cache_dtype="int4"), "kv_cache_dtype", "not supported"),
        (dict(quantization="int3"), "quantization", "int8"),
        (dict(memory="6 parsecs"), "memory", "6GiB"),
        (dict(memory="1GiB", memory_fraction=0.5), "memory", "not both"),
        (dict(memory_fraction=1.5), "memory_fraction", "(0, 1]"),
        (dict(backend="cuda"), "backend", "not implemented"),
        (dict(backend="tpu"), "backend", "cpu-compiled"),
    ],
)
def test_a_bad_setting_is_refused_naming_its_field(options, field, words):
    with pytest.raises(ConfigError) as e:
        EngineConfig(**options)
    assert e.value.field == field and str(e.value).startswith(f"{field}: ") and words in str(e.value)


def test_spellings_are_normalised_and_unknown_options_are_named():
    assert EngineConfig(dtype="bf16", kv_cache_dtype="float8_e4m3fn").dtype == "bfloat16"
    assert EngineConfig(kv_cache_dtype="float8_e4m3fn").kv_cache_dtype == "fp8"
    with pytest.raises(TypeError, match="max_seqs.*known:.*max_num_seqs"):
        LLM(max_seqs=4)
    with pytest.raises(ConfigError, match="block_size"):
        LLM(block_size=-1)  # refused before any model is read


def test_the_api_and_the_engine_plan_from_the_same_inputs(tiny_checkpoints, default_llm):
    """``LLM`` plans before loading, ``LLMEngine`` after, through one function: the same weights
    (quantized ones counted quantized), the same structured-output caches, the same sizes."""
    d = tiny_checkpoints["llama"][0]
    llm = LLM(d, quantization="int8", num_blocks=40, max_batch_tokens=32, max_model_len=64)
    again = LLMEngine.of(llm.loaded, llm.config).memory_plan
    first = llm.memory_plan
    assert (again.weights_bytes, again.weights_format) == (first.weights_bytes, first.weights_format)
    assert "int8" in first.weights_format
    assert (again.num_blocks, again.max_batch_tokens, again.max_model_len) == (40, 32, 64)
    with pytest.raises(ConfigError, match="dtype: bfloat16 asked for, but the loaded model is float32"):
        LLMEngine.of(llm.loaded, llm.config.replace(dtype="bfloat16"))

    small = default_llm.config.replace(num_blocks=16, max_model_len=256)  # a tokenizer: grammars count
    with_grammars = LLMEngine.of(default_llm.loaded, small).memory_plan
    without = LLMEngine.of(default_llm.loaded, small.replace(structured_output=False)).memory_plan
    assert with_grammars.overhead_bytes - without.overhead_bytes == GRAMMAR_CACHE_BYTES


def test_plan_without_an_engine_plans_for_the_backend_named():
    """``pagedllm plan --backend cpu-torch`` reserves the PyTorch path's workspaces (it gathers
    contexts), not the compiled kernels' (which read them in place, with per-thread scratch);
    ``auto`` plans for what an engine started here would run."""
    from pathlib import Path

    from pagedllm.backends.cpu.machine import expected_kernels
    from pagedllm.config import ModelConfig
    from pagedllm.memory.planner import plan_engine

    cfg = ModelConfig.from_file(Path(__file__).parent.parent / "benchmarks/configs/llama-3-70b.json")
    sizes = dict(dtype="bfloat16", memory="200GiB", max_model_len=8192, max_batch_tokens=2048)
    torch_path = plan_engine(cfg, EngineConfig(backend="cpu-torch", **sizes)).activation_bytes
    compiled = plan_engine(cfg, EngineConfig(backend="cpu-compiled", **sizes)).activation_bytes
    assert torch_path != compiled
    auto = plan_engine(cfg, EngineConfig(**sizes)).activation_bytes
    assert auto == (compiled if expected_kernels() == "compiled" else torch_path)


def test_the_idle_release_flags_are_the_servers_and_checked():
    args = build_parser().parse_args("serve --idle-release-after 2.5 --idle-keep-prefix-cache".split())
    assert EngineConfig.from_args(args) == EngineConfig(idle_release_after=2.5, idle_keep_prefix_cache=True)
    with pytest.raises(SystemExit):
        build_parser().parse_args("generate x --idle-release-after 2".split())
    with pytest.raises(ConfigError, match="idle_release_after"):
        EngineConfig(idle_release_after=-1)
