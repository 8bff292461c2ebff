"""Loading failures give a clear error naming the file and what is supported, never a deep traceback."""

import json
import shutil

import numpy as np
import pytest

from pagedllm import ModelLoadError, UnsupportedModelError
from pagedllm.loading import load
from pagedllm.loading.default_model import default_gguf_path


def copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_missing_path_says_nothing_is_downloaded(tmp_path):
    with pytest.raises(ModelLoadError, match="never downloads") as e:
        load("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert "SmolLM2-135M-Instruct" in str(e.value)


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        load(tmp_path)


def test_unknown_architecture_names_the_supported_ones(tiny_checkpoints, tmp_path):
    d = copy_checkpoint(tiny_checkpoints["llama"][0], tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel") as e:
        load(d)
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert arch in str(e.value)
    assert str(d / "config.json") in str(e.value)


def test_truncated_safetensors_names_the_file(tiny_checkpoints, tmp_path):
    d = copy_checkpoint(tiny_checkpoints["llama"][0], tmp_path / "m")
    weights = d / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="truncated") as e:
        load(d)
    assert str(weights) in str(e.value)


def test_corrupt_safetensors_header(tiny_checkpoints, tmp_path):
    d = copy_checkpoint(tiny_checkpoints["llama"][0], tmp_path / "m")
    weights = d / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[8:40] = b"\xff" * 32
    weights.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="corrupt") as e:
        load(d)
    assert str(weights) in str(e.value)


def test_weights_that_do_not_match_the_config(tiny_checkpoints, tmp_path):
    d = copy_checkpoint(tiny_checkpoints["llama"][0], tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 999
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="shape"):
        load(d)


def test_missing_shard_is_named(tiny_checkpoints, tmp_path):
    d = copy_checkpoint(tiny_checkpoints["llama"][0], tmp_path / "m")
    (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match="model-00002-of-00002.safetensors"):
        load(d)


def test_pytorch_bin_only_is_explained(tmp_path, tiny_checkpoints):
    d = tmp_path / "m"
    d.mkdir()
    shutil.copy(tiny_checkpoints["llama"][0] / "config.json", d)
    (d / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="only safetensors"):
        load(d)


def test_unsupported_dtype():
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        load(None, "float16")


@pytest.mark.parametrize("content", [b"", b"GGUF", bytes(range(256)) * 4])
def test_corrupt_gguf_names_the_file(tmp_path, content):
    path = tmp_path / "broken.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelLoadError, match="broken.gguf"):
        load(path)


@pytest.mark.slow  # reads the default model's GGUF
def test_truncated_gguf(tmp_path):
    path = tmp_path / "half.gguf"
    with open(default_gguf_path(), "rb") as f:
        path.write_bytes(f.read(20_000_000))
    with pytest.raises(ModelLoadError, match="corrupt or truncated") as e:
        load(path)
    assert "half.gguf" in str(e.value)


def test_gguf_of_an_unsupported_architecture(tmp_path):
    import gguf

    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="'gpt2'") as e:
        load(path)
    assert "llama" in str(e.value) and "gpt2.gguf" in str(e.value)


# ---- advertised loading paths, loaded (not only refused) ----------------------------------------


def test_a_sharded_checkpoint_loads_and_generates_what_the_single_file_does(tiny_checkpoints, tmp_path):
    from pagedllm import LLM, SamplingParams

    directory, hf = tiny_checkpoints["qwen3"]
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, safe_serialization=True, max_shard_size="200KB")
    shards = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(shards) > 1 and (sharded / "model.safetensors.index.json").is_file()
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [[5, 17, 99, 3], [42] * 9]
    single = [o.token_ids for o in LLM(directory).generate(prompts, params)]
    assert [o.token_ids for o in LLM(sharded).generate(prompts, params)] == single


def test_memory_fraction_through_llm_plans_within_that_share_of_free_memory(tiny_checkpoints):
    from pagedllm import LLM
    from pagedllm.memory.budget import free_memory

    free_before, _ = free_memory()
    llm = LLM(tiny_checkpoints["llama"][0], memory_fraction=0.05, max_model_len=64)
    plan = llm.memory_plan
    assert "fraction" in plan.budget_source or "free" in plan.budget_source, plan.budget_source
    # the plan's budget is the process before loading + 5% of what was free then (a little more
    # may have been free or taken by the time the planner looked)
    share = plan.budget_bytes - plan.baseline_bytes
    assert 0.04 * free_before <= share <= 0.06 * free_before
    assert plan.total_bytes <= plan.budget_bytes
    assert llm.generate([[1, 2, 3]])[0].token_ids


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_gguf_files_load_and_generate_what_transformers_does(tmp_path, arch):
    """Qwen2/Qwen3 GGUFs take their own conversion path: no rope permutation, q/k/v biases
    (qwen2), q/k norms and a head_dim other than hidden / heads (qwen3)."""
    from greedy import assert_greedy_matches, hf_greedy
    from tiny_models import save_tiny_gguf

    from pagedllm import LLM, SamplingParams

    path = tmp_path / f"tiny-{arch}.gguf"
    hf = save_tiny_gguf(arch, path)
    llm = LLM(path)
    assert llm.loaded.config.head_dim == (getattr(hf.config, "head_dim", None) or 64 // 4)
    prompts = [[5, 17, 99, 3], [42] * 9, list(range(30, 60))]
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    assert_greedy_matches([o.token_ids for o in outs], [hf_greedy(hf, p, 16) for p in prompts])
    assert llm.tokenizer.decode(llm.tokenizer.encode("tea at ten")) == "tea at ten"


def test_a_build_reads_config_and_each_header_once(tiny_checkpoints, tmp_path, monkeypatch):
    """Planning (weights, experts, layers) and loading share one reading of the checkpoint: a
    second parse could see another file than the plan did, and each cost a pass over the headers."""
    from pagedllm import LLM
    from pagedllm.config import ModelConfig
    from pagedllm.loading import safetensors_io

    d = copy_checkpoint(tiny_checkpoints["llama"][0], tmp_path / "m")
    reads: list[str] = []
    from_file, read_header = ModelConfig.from_file.__func__, safetensors_io.read_header
    monkeypatch.setattr(
        ModelConfig, "from_file", classmethod(lambda cls, p: reads.append("config") or from_file(cls, p))
    )
    monkeypatch.setattr(safetensors_io, "read_header", lambda p: reads.append(p.name) or read_header(p))
    llm = LLM(model=str(d), engine_process=False, max_model_len=64)
    try:
        assert sorted(reads) == ["config", "model.safetensors"], reads
        assert llm.generate([[1, 2, 3]])[0].outputs[0].token_ids  # and it runs
    finally:
        llm.close()


def test_a_file_changed_between_the_plan_and_the_load_is_named(tiny_checkpoints, tmp_path):
    """The headers read at planning describe the bytes the loader reads: a file rewritten in
    between is refused by name, not read through its old header."""
    import os

    from pagedllm.loading import Checkpoint, load_dir

    d = copy_checkpoint(tiny_checkpoints["llama"][0], tmp_path / "m")
    ckpt = Checkpoint.read(d)
    weights = d / "model.safetensors"
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # rewritten in place, same size
    with pytest.raises(ModelLoadError, match="changed since the model was planned") as e:
        load_dir(ckpt, "m")
    assert str(weights) in str(e.value)
