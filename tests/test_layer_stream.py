"""A dense model larger than its budget (issue 51): its last decoder layers stay in the
checkpoint's files and are read into slots every step. Oracles: the same model with every layer
loaded (outputs identical to the token), the files themselves (what a slot holds), the process's
own memory maps, and the planner's arithmetic redone in the test."""

import os
import shutil

import pytest
import torch
from tiny_models import save_tiny_gguf

from pagedllm import LLM, CacheDoesNotFitError, SamplingParams
from pagedllm.config import ModelConfig
from pagedllm.engine_config import ConfigError, EngineConfig
from pagedllm.errors import ModelLoadError
from pagedllm.loading import resolve_model_dir, streamable_layers
from pagedllm.loading.checkpoint_facts import safetensors_files
from pagedllm.loading.safetensors_io import iter_tensors, read_header
from pagedllm.memory.footprint import StreamableLayers
from pagedllm.memory.planner import plan_engine

PROMPTS = ["the cat sat on the mat", "hello there, how are", "one two three four five six seven"]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
LAYERS = 5


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    """A tiny Qwen2 (5 layers, q/k/v biases) written as llama.cpp writes a Q8_0 GGUF, converted
    once: the directory the stream reads, and the unbounded run's outputs."""
    path = tmp_path_factory.mktemp("layer-stream") / "tiny-qwen2-Q8_0.gguf"
    save_tiny_gguf("qwen2", path, weights="Q8_0", num_hidden_layers=LAYERS)
    model_dir, _ = resolve_model_dir(path)
    unbounded = LLM(str(model_dir), block_size=8, num_blocks=64)
    expected = {
        name: [o.token_ids for o in unbounded.generate(PROMPTS, p)]
        for name, p in (("greedy", GREEDY), ("seeded", SEEDED))
    }
    assert unbounded.loaded.model.layer_stream is None
    return model_dir, expected, unbounded.loaded.model.weight_bytes()


def test_outputs_are_the_unbounded_runs_whatever_stays_resident(dense_dir):
    """Every layer streamed through two slots, some resident, two streamed in two slots (read
    once), one in one slot: the same tokens, greedy and seeded, alone and batched; each step reads
    every streamed layer that shares its slot with another."""
    model_dir, expected, _ = dense_dir
    for resident in (0, 2, 3, 4):
        llm = LLM(str(model_dir), block_size=8, num_blocks=64, resident_layers=resident)
        stream = llm.loaded.model.layer_stream
        assert stream is not None and stream.order == list(range(resident, LAYERS))
        assert stream.slots == min(2, LAYERS - resident)
        for name, params in (("greedy", GREEDY), ("seeded", SEEDED)):
            assert [o.token_ids for o in llm.generate(PROMPTS, params)] == expected[name], (resident, name)
            assert [o.token_ids for o in llm.generate(PROMPTS[:1], params)] == expected[name][:1], (resident, name)
        # the k-th streamed layer in slot k % slots: a slot of one layer reads it once, a slot of
        # several reads each of them every step
        turns = [len(range(k, LAYERS - resident, stream.slots)) for k in range(stream.slots)]
        taking_turns = sum(c for c in turns if c > 1)
        steps = llm.engine.stats.steps
        assert steps * taking_turns <= stream.stats.reads <= steps * taking_turns + LAYERS - resident
        assert llm.engine.stats.streamed_layer_reads == stream.stats.reads


def test_the_streamed_layers_are_held_only_in_the_slots_and_read_without_a_mapping(dense_dir):
    """The model holds the unbounded model's weights less the streamed layers' matrices plus two
    slots; after a step each slot holds the bytes the file stores for its layer (the first
    streamed one read again while the step finished), and no file of the checkpoint is mapped into the process."""
    model_dir, _, unbounded_bytes = dense_dir
    facts = streamable_layers(model_dir, None)
    sizes = facts.layer_bytes
    assert len(sizes) == LAYERS and len(set(sizes)) == 1
    llm = LLM(str(model_dir), block_size=8, num_blocks=64, resident_layers=1)
    model = llm.loaded.model
    assert model.weight_bytes() == unbounded_bytes - sum(sizes[1:]) + 2 * sizes[0]
    llm.generate(PROMPTS, GREEDY)
    stored = {}
    for f in safetensors_files(model_dir):
        stored.update(iter_tensors(f, *read_header(f)))
    stream = model.layer_stream
    held = stream.held()  # layer 1 read again after the step into slot 0; layer 4 in slot 1
    assert held == [1, 4]
    for layer in held:
        block = model.model.decoder_layers()[layer]
        for linear, names in ((block.self_attn.qkv_proj, "qkv"), (block.mlp.down_proj, "d")):
            parts = [
                stored[f"model.layers.{layer}.{p}.weight.qweight"]
                for p in (
                    ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
                    if names == "qkv"
                    else ["mlp.down_proj"]
                )
            ]
            (segment,) = linear.segments
            assert torch.equal(segment.qweight, torch.cat(parts)), layer
    maps = open(f"/proc/{os.getpid()}/maps").read()
    assert not any(str(f) in maps for f in safetensors_files(model_dir))


@pytest.mark.parametrize("damage", ["truncate", "rewrite"])
def test_a_file_cut_short_or_changed_underneath_is_a_clear_error(dense_dir, tmp_path, damage):
    """The files change while the engine streams layers from them: the next step is an error
    naming the file, never tokens computed from other bytes."""
    model_dir, _, _ = dense_dir
    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy)
    llm = LLM(str(copy), block_size=8, num_blocks=64, resident_layers=1)
    llm.generate(PROMPTS[:1], GREEDY)
    (weights,) = sorted(copy.glob("*.safetensors"))
    if damage == "truncate":
        os.truncate(weights, weights.stat().st_size // 2)
        said = "truncated"
    else:
        data = weights.read_bytes()
        weights.write_bytes(data)
        st = weights.stat()
        os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        # rewriting in place empties the file for a moment: a read ahead of the stream's next
        # layers may see it then, and says so
        said = "changed|truncated"
    with pytest.raises(ModelLoadError, match=said) as e:
        llm.generate(PROMPTS, GREEDY)
    assert str(weights) in str(e.value)


def test_the_plan_streams_only_where_every_layer_resident_does_not_fit(dense_dir):
    """Layers of 40 MiB, as if the tiny model were large: a budget that holds them all loads
    them all; one that does not keeps as many of the first layers resident as fit beside two
    slots and a cache for one 4096-token request (one more would not), and says so; a budget
    without room for one slot is refused; resident_layers on float layers names why not."""
    model_dir, _, _ = dense_dir
    cfg = ModelConfig.from_file(model_dir)
    mib = 2**20
    layers = StreamableLayers((40 * mib,) * LAYERS)
    weights = 100 * mib + 200 * mib
    facts = dict(weights_bytes=weights, quantized_weights=True, baseline_bytes=300 * mib, layers=layers)
    full = plan_engine(cfg, EngineConfig(memory="2GiB"), **facts)
    assert full.layer_slots == 0 and full.weights_bytes == weights
    seen = set()
    for budget in range(500 * mib, 900 * mib, 10 * mib):  # from no room for a slot to every layer resident
        try:
            tight = plan_engine(cfg, EngineConfig(memory=budget), **facts)
        except CacheDoesNotFitError:
            seen.add("refused")
            continue
        resident, slots = tight.resident_layers, tight.layer_slots
        if not slots:
            seen.add("all")
            assert tight.weights_bytes == weights and tight.total_bytes <= budget
            continue
        seen.add(slots)
        assert tight.weights_bytes == 100 * mib + (resident + slots) * 40 * mib
        assert tight.total_bytes <= budget and tight.cache_tokens >= 4096
        assert f"{resident} of the {LAYERS} decoder layers resident" in tight.table()
        if slots == 2:  # one more layer resident would not fit beside a cache for 4096 tokens
            with pytest.raises(CacheDoesNotFitError):
                plan_engine(cfg, EngineConfig(memory=budget, resident_layers=resident + 1, max_model_len=4096), **facts)
    assert seen == {"refused", 1, 2, "all"}, seen
    with pytest.raises(CacheDoesNotFitError, match="weights"):
        plan_engine(cfg, EngineConfig(memory=300 * mib + 100 * mib + 20 * mib), **facts)


def test_resident_layers_on_layers_the_file_does_not_hold_as_they_run_is_refused_with_why(dense_dir):
    model_dir, _, _ = dense_dir
    with pytest.raises(ConfigError, match="resident_layers.*quantizes them at load"):
        LLM(str(model_dir), quantization="int8", resident_layers=1)
