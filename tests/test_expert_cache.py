"""A mixture of experts larger than its budget (issue 51): the routed experts stay in the
checkpoint's files and a fixed number of slots hold the ones in use. Oracles: the same model with
every expert loaded (outputs identical to the token), the files themselves (what a slot holds),
the process's own memory maps, and the planner's arithmetic redone in the test."""

import os
import shutil

import pytest
import torch
from tiny_models import save_tiny_gguf

from pagedllm import LLM, CacheDoesNotFitError, SamplingParams
from pagedllm.config import ModelConfig
from pagedllm.engine_config import ConfigError, EngineConfig
from pagedllm.errors import ModelLoadError
from pagedllm.kinds.sparse_moe.forward import SparseMoE
from pagedllm.loading import resolve_model_dir, routed_experts
from pagedllm.loading.checkpoint_facts import safetensors_files
from pagedllm.loading.safetensors_io import iter_tensors, read_header
from pagedllm.memory.footprint import RoutedExperts
from pagedllm.memory.planner import plan_engine

PROMPTS = ["the cat sat on the mat", "hello there, how are", "one two three four five six seven"]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    """A tiny Qwen3-MoE (2 layers of 8 experts, top 2) written as llama.cpp writes a Q8_0 GGUF,
    converted once: the directory the expert cache reads, and the unbounded run's outputs."""
    path = tmp_path_factory.mktemp("expert-cache") / "tiny-qwen3-moe-Q8_0.gguf"
    save_tiny_gguf("qwen3-moe", path, experts="Q8_0", moe_intermediate_size=96)
    model_dir, _ = resolve_model_dir(path)
    unbounded = LLM(str(model_dir), block_size=8, num_blocks=64)
    expected = {
        name: [o.token_ids for o in unbounded.generate(PROMPTS, p)]
        for name, p in (("greedy", GREEDY), ("seeded", SEEDED))
    }
    assert unbounded.loaded.model.expert_cache is None
    return model_dir, expected, unbounded.loaded.model.weight_bytes()


@pytest.mark.parametrize("ahead", ["1", "0"])
def test_outputs_are_the_unbounded_runs_at_every_cache_size(moe_dir, monkeypatch, ahead):
    """From the smallest cache that plans (one layer's experts: what a step's layer may choose at
    once) to one expert short of all 16: the same tokens, greedy and seeded, alone and batched,
    with the next layer's likely experts read ahead or not; experts were read from the file, and
    never more resident than the slots."""
    monkeypatch.setenv("PAGEDLLM_EXPERT_PREFETCH", ahead)
    model_dir, expected, _ = moe_dir
    routed = routed_experts(model_dir, None)
    assert (routed.count, routed.floor) == (16, 8)
    for slots in (8, 11, 15):
        llm = LLM(str(model_dir), block_size=8, num_blocks=64, expert_slots=slots)
        cache = llm.loaded.model.expert_cache
        assert cache is not None and sum(p.slots for p in cache.pools) == slots
        for name, params in (("greedy", GREEDY), ("seeded", SEEDED)):
            assert [o.token_ids for o in llm.generate(PROMPTS, params)] == expected[name], (slots, name)
            assert [o.token_ids for o in llm.generate(PROMPTS[:1], params)] == expected[name][:1], (slots, name)
        assert cache.stats.misses > 0 and len(cache.where) <= slots
        assert cache.stats.bytes_read == (cache.stats.misses + cache.stats.prefetched) * routed.slot_bytes
        assert (cache.stats.prefetched > 0) == (ahead == "1")
        stats = llm.engine.stats  # what /metrics reports
        assert (stats.expert_slots, stats.expert_misses, stats.expert_hits) == (
            slots,
            cache.stats.misses,
            cache.stats.hits,
        )


def held_experts(model) -> list[tuple[int, int]]:
    """(layer, expert) of every expert whose layers hold weights."""
    return [
        (layer, e)
        for layer, block in enumerate(model.model.decoder_layers())
        if isinstance(block.mlp, SparseMoE)
        for e, mlp in enumerate(block.mlp.expert_mlps())
        if mlp.gate_up_proj.quantized_weights() or mlp.down_proj.quantized_weights()
    ]


def test_the_experts_are_held_only_in_the_cache_and_read_without_a_mapping(moe_dir):
    """The model holds what every token reads plus the slots, not the experts: its weights are
    the unbounded model's less 16 experts plus the slots, each resident expert's matrices are
    the bytes the file stores for it, and no file of the checkpoint is mapped into the process."""
    model_dir, _, unbounded_bytes = moe_dir
    routed = routed_experts(model_dir, None)
    llm = LLM(str(model_dir), block_size=8, num_blocks=64, expert_slots=9)
    model = llm.loaded.model
    assert model.weight_bytes() == unbounded_bytes - routed.total_bytes + 9 * routed.slot_bytes
    assert held_experts(model) == []  # nothing read at load
    llm.generate(PROMPTS, GREEDY)
    cache = model.expert_cache
    held = held_experts(model)
    assert sorted(held) == sorted(cache.where) and 0 < len(held) <= 9  # only the resident, as slot views
    assert_slots_hold_the_files_bytes(model_dir, cache)
    maps = open(f"/proc/{os.getpid()}/maps").read()
    assert not any(str(f) in maps for f in safetensors_files(model_dir))


@pytest.mark.parametrize("damage", ["truncate", "rewrite"])
def test_a_file_cut_short_or_changed_underneath_is_a_clear_error(moe_dir, tmp_path, damage):
    """The files change while the engine reads experts from them: the next read is an error
    naming the file, never tokens computed from other bytes."""
    model_dir, _, _ = moe_dir
    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy)
    llm = LLM(str(copy), block_size=8, num_blocks=64, expert_slots=8)
    llm.generate(PROMPTS[:1], GREEDY)
    (weights,) = sorted(copy.glob("*.safetensors"))
    if damage == "truncate":
        os.truncate(weights, weights.stat().st_size // 2)
        said = "truncated"
    else:
        data = weights.read_bytes()
        weights.write_bytes(data)  # same bytes, a new modification time: the engine cannot know them unchanged
        st = weights.stat()
        os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        said = "changed"
    with pytest.raises(ModelLoadError, match=said) as e:
        for _ in range(4):  # until a chosen expert is not resident
            llm.generate(PROMPTS, GREEDY)
    assert str(weights) in str(e.value)


def test_the_plan_keeps_what_every_token_reads_and_fills_the_rest_with_experts(moe_dir):
    """Weights above the budget: the plan holds the weights less the routed experts, plus as many
    slots as fit beside a cache for one 4096-token request (one slot more would not), and says so
    in its table; a budget that cannot hold the floor, and expert_slots below it, are refused
    with the reason. Experts of 40 MiB each, as if the tiny model were large."""
    model_dir, _, _ = moe_dir
    cfg = ModelConfig.from_file(model_dir)
    mib = 2**20
    routed = RoutedExperts(total_bytes=16 * 40 * mib, slot_bytes=40 * mib, count=16, floor=8)
    weights = 100 * mib + routed.total_bytes
    facts = dict(weights_bytes=weights, quantized_weights=True, baseline_bytes=300 * mib, routed=routed)
    full = plan_engine(cfg, EngineConfig(memory="2GiB"), **facts)
    assert full.expert_slots == 0 and full.weights_bytes == weights  # it fits: everything loaded
    budget = 300 * mib + 100 * mib + 500 * mib + 150 * mib
    tight = plan_engine(cfg, EngineConfig(memory=budget), **facts)
    assert routed.floor <= tight.expert_slots < routed.count
    assert tight.weights_bytes == 100 * mib + tight.expert_slots * routed.slot_bytes
    assert tight.total_bytes <= budget and tight.cache_tokens >= 4096
    assert f"{tight.expert_slots} of the 16 routed experts resident" in tight.table()
    with pytest.raises(CacheDoesNotFitError):
        plan_engine(cfg, EngineConfig(memory=budget, expert_slots=tight.expert_slots + 1, max_model_len=4096), **facts)
    with pytest.raises(CacheDoesNotFitError, match="routed experts"):
        plan_engine(cfg, EngineConfig(memory=300 * mib + 100 * mib + 7 * routed.slot_bytes), **facts)
    with pytest.raises(CacheDoesNotFitError, match="expert_slots=3"):
        plan_engine(cfg, EngineConfig(memory="2GiB", expert_slots=3), **facts)


def test_expert_slots_on_experts_the_file_does_not_hold_as_they_run_is_refused_with_why(moe_dir):
    """Experts quantized at load are other values than the file's: expert_slots names why not."""
    model_dir, _, _ = moe_dir
    with pytest.raises(ConfigError, match="expert_slots.*quantizes them at load"):
        LLM(str(model_dir), quantization="int8", expert_slots=8)


def test_a_new_number_of_slots_keeps_the_outputs_and_the_slots_hold_the_files_bytes(moe_dir):
    """A new budget moves the slots first (EngineMemory.resize): fewer, the experts past the new
    end move down (or leave) and every resident expert still holds its own bytes; more, they
    fill again. The tokens stay the unbounded run's throughout."""
    model_dir, expected, _ = moe_dir
    llm = LLM(str(model_dir), block_size=8, num_blocks=64, expert_slots=15)
    cache = llm.loaded.model.expert_cache
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected["greedy"]
    assert len(cache.where) > 8
    cache.resize(8)
    assert cache.slots == 8 and len(cache.where) <= 8 and all(s < 8 for s in cache.where.values())
    assert_slots_hold_the_files_bytes(model_dir, cache)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected["greedy"]
    cache.resize(16)
    assert [o.token_ids for o in llm.generate(PROMPTS, SEEDED)] == expected["seeded"]
    assert_slots_hold_the_files_bytes(model_dir, cache)
    assert cache.nbytes() == 16 * routed_experts(model_dir, None).slot_bytes


def assert_slots_hold_the_files_bytes(model_dir, cache) -> None:
    stored = {}
    for f in safetensors_files(model_dir):
        stored.update(iter_tensors(f, *read_header(f)))
    for layer, expert in cache.where:
        gate_up, down = cache.weights(layer, expert)
        base = f"model.layers.{layer}.mlp.experts.{expert}"
        want = torch.cat([stored[f"{base}.gate_proj.weight.qweight"], stored[f"{base}.up_proj.weight.qweight"]])
        assert torch.equal(gate_up.qweight, want), (layer, expert)
        assert torch.equal(down.qweight, stored[f"{base}.down_proj.weight.qweight"])
        assert torch.equal(down.scale, stored[f"{base}.down_proj.weight.scale"])
