"""The tensor-parallel split (pagedllm/distributed/shards.py) without processes: every query head
computed by exactly one rank, which also holds the KV head that head reads (KV heads replicated
when there are fewer than ranks), the MLP and vocabulary partitioned, and a size that does not
divide the model refused with the numbers. Checked on Llama-3-70B's config at tp 1-16 and on
the default model, against arithmetic written here."""

import re
from pathlib import Path

import pytest

from pagedllm.config import ModelConfig
from pagedllm.distributed.shards import TensorParallelError, rank_config, shard_layout
from pagedllm.errors import CacheDoesNotFitError
from pagedllm.memory.footprint import kv_bytes_per_block, parameter_count

CONFIGS = Path(__file__).parent.parent / "benchmarks/configs"
LLAMA_70B = ModelConfig.from_file(CONFIGS / "llama-3-70b.json")


@pytest.mark.parametrize("tp", [1, 2, 4, 8, 16])
def test_every_head_runs_on_one_rank_beside_the_kv_head_it_reads(tp):
    cfg = LLAMA_70B
    s = shard_layout(cfg, tp)
    group = cfg.num_heads // cfg.num_kv_heads  # query heads per KV head: 8
    owners = {}
    for rank in range(tp):
        for head in s.head_range(rank):
            assert head not in owners, head
            owners[head] = rank
            assert head // group in s.kv_head_range(rank), (rank, head)
        assert len(s.kv_head_range(rank)) == (8 // tp if tp <= 8 else 1)
    assert sorted(owners) == list(range(64))
    # KV heads: split at tp <= 8; at 16 each of the 8 is on two neighbouring ranks
    held = [kv for rank in range(tp) for kv in s.kv_head_range(rank)]
    assert sorted(set(held)) == list(range(8))
    assert len(held) == max(8, tp)
    assert s.kv_replicas == (2 if tp == 16 else 1)


@pytest.mark.parametrize("tp", [1, 2, 4, 8, 16])
def test_mlp_and_vocabulary_are_partitioned(tp):
    cfg = LLAMA_70B
    s = shard_layout(cfg, tp)
    columns = [c for rank in range(tp) for c in s.intermediate_range(rank)]
    assert columns == list(range(28672))
    tokens = [t for rank in range(tp) for t in s.vocab_range(rank, cfg.vocab_size)]
    assert tokens == list(range(128256))
    assert s.vocab % 16 == 0 and s.padded_vocab >= 128256 and s.padded_vocab - 128256 < 16 * tp


@pytest.mark.parametrize("tp", [2, 4, 8, 16])
def test_the_ranks_together_hold_the_model_once_plus_what_is_replicated(tp):
    cfg, rank = LLAMA_70B, rank_config(LLAMA_70B, tp)
    h, layers = 8192, 80
    norms = layers * 2 * h + h  # two norms a layer, the final one: on every rank
    kv_copies = max(0, tp // 8 - 1) * 8 * 128 * h * 2 * layers  # K and V weights of replicated heads
    padding = (rank.vocab_size * tp - 128256) * h * 2  # embedding and LM head (untied)
    assert tp * parameter_count(rank) == parameter_count(cfg) + (tp - 1) * norms + kv_copies + padding
    # the KV cache: each rank keeps its heads' K and V, 2 bytes each, 16 tokens a block
    assert kv_bytes_per_block(rank, 16, "bfloat16") == 2 * layers * 16 * max(1, 8 // tp) * 128 * 2


def test_a_size_that_does_not_divide_the_model_names_the_numbers():
    default = ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        max_position_embeddings=8192,
    )
    with pytest.raises(TensorParallelError, match=r"9 attention heads.*sizes that do: 1, 3$"):
        shard_layout(default, 2)
    with pytest.raises(TensorParallelError, match="MLP width of 1536"):
        shard_layout(default, 9)
    with pytest.raises(TensorParallelError, match="must be 1 or more"):
        shard_layout(default, 0)
    assert rank_config(default, 3).num_kv_heads == 1 and rank_config(default, 1) is default


@pytest.mark.parametrize("tp", [1, 2, 4, 8, 16])
def test_plan_sizes_one_rank_of_llama_70b_from_its_config(tp):
    """`pagedllm plan --tensor-parallel-size` without weights: one rank's weights and KV heads,
    bf16, 64 GiB per rank; each rank's parts counted here by hand."""
    from pagedllm.engine_config import EngineConfig
    from pagedllm.memory.planner import plan_engine

    config = EngineConfig(dtype="bfloat16", memory="64GiB", max_model_len=8192, tensor_parallel_size=tp)
    if tp <= 2:  # 141 GB of weights: 70.6 GB (65.7 GiB) a rank at tp=2
        with pytest.raises(CacheDoesNotFitError, match="weights alone exceed") as e:
            plan_engine(LLAMA_70B, config)
        assert tp == 1 or "weights 65.709 GiB (bfloat16)" in str(e.value)
        return
    p = plan_engine(LLAMA_70B, config)
    h, layers, kv = 8192, 80, max(1, 8 // tp)
    per_layer = h * (64 // tp) * 128 * 2 + 2 * h * kv * 128 + 3 * h * (28672 // tp) + 2 * h
    params = layers * per_layer + 2 * (128256 // tp) * h + h  # 128256 / tp is a multiple of 16 here
    assert p.weights_bytes == 2 * params
    assert p.kv_bytes_per_block == 2 * layers * 16 * kv * 128 * 2
    assert p.tensor_parallel_size == tp and p.total_bytes <= 64 * 2**30
    assert p.full_length_requests >= 1 and p.max_model_len == 8192
    assert re.search(rf"^ranks +{tp}: each rank's process", p.table(), re.M)


def test_the_driver_plans_for_the_whole_vocabulary_it_samples_from():
    """Rank 0 gathers every rank's logits: its sampler phase holds the full vocabulary's float32
    logits for every sampled row, not one rank's slice."""
    from pagedllm.memory.footprint import EngineSettings, StepShape, step_phases

    tp, rows = 4, 8
    s = shard_layout(LLAMA_70B, tp)
    settings = EngineSettings(dtype="bfloat16", tensor_parallel=tp, gathered_vocab=s.padded_vocab)
    phases = step_phases(rank_config(LLAMA_70B, tp), settings, StepShape(tokens=rows, sampled=rows))
    assert phases["sampler"] >= rows * 128256 * 4
    assert phases["logits gathered"] >= rows * 128256 * 2 + rows * s.vocab * 2


def test_a_command_refuses_a_split_the_model_cannot_take_and_plan_sizes_one_that_can(capsys):
    from pagedllm.cli import main

    assert main(["generate", "-tp", "2", "hello"]) == 1  # the default model: 9 heads, 3 KV heads
    assert "does not split this model: it does not divide its 9 attention heads" in capsys.readouterr().err
    args = ["--dtype", "bfloat16", "--max-model-len", "8192", "-tp", "4", "--memory", "64GiB"]
    assert main(["plan", "--model", str(CONFIGS / "llama-3-70b.json"), *args]) == 0
    assert re.search(r"^ranks +4: each rank's process", capsys.readouterr().out, re.M)
