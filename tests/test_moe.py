"""What a mixture of experts promises beyond equal logits (test_models_match_transformers): a step
runs only the experts its tokens chose, each once; routing ties fall as transformers' do; what
is not implemented is refused with the reason."""

from __future__ import annotations

import pytest
import torch
from test_models_match_transformers import hf_logits, our_logits
from tiny_models import MOE_ARCHS, save_tiny_model

from pagedllm import LLM, SamplingParams
from pagedllm.config import ModelConfig
from pagedllm.distributed.shards import TensorParallelError, shard_layout
from pagedllm.errors import UnsupportedModelError
from pagedllm.kinds.sparse_moe.forward import SparseMoE


def hf_chosen_experts(hf, prompt: list[int]) -> list[set[int]]:
    """Per sparse layer, the experts transformers' routers choose for ``prompt``'s tokens."""
    chosen: list[set[int]] = []

    def record(module, args, output):
        chosen.append(set(output[-1].flatten().tolist()))  # (logits, weights, indices)

    hooks = [m.register_forward_hook(record) for name, m in hf.named_modules() if name.endswith("mlp.gate")]
    with torch.no_grad():
        hf(torch.tensor([prompt]))
    for h in hooks:
        h.remove()
    return chosen


def experts_run(llm: LLM) -> tuple[list[list[int]], list]:
    """([per sparse layer, the experts each call ran, in order] of the next steps, the hooks)."""
    layers = [layer.mlp for layer in llm.engine.runner.model.model.decoder_layers() if isinstance(layer.mlp, SparseMoE)]
    runs: list[list[int]] = [[] for _ in layers]
    hooks = []
    for i, moe in enumerate(layers):
        for e, expert in enumerate(moe.experts):
            hooks.append(expert.register_forward_hook(lambda m, a, o, i=i, e=e: runs[i].append(e)))
    return runs, hooks


@pytest.mark.parametrize("arch", ["qwen3-moe", "mixtral"])
def test_a_step_runs_each_chosen_expert_once_and_no_other(tiny_checkpoints, arch):
    """A prompt's prefill step runs, per sparse layer, each expert transformers' router chose for
    its tokens exactly once (its tokens in one GEMM); a decode step of one token runs top_k
    experts: the point of a mixture on a memory-bound CPU. Computing every expert (or each
    token's experts one token at a time) fails it."""
    directory, hf = tiny_checkpoints[arch]
    prompt = list(range(3, 43))
    llm = LLM(directory, num_blocks=64, max_num_seqs=1)
    runs, hooks = experts_run(llm)
    llm.engine.add_request(prompt, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    llm.engine.step()  # the whole prompt
    chosen = hf_chosen_experts(hf, prompt)
    assert [sorted(r) for r in runs] == [sorted(c) for c in chosen]  # each chosen one, once
    for r in runs:
        r.clear()
    llm.engine.step()  # one token
    top_k = hf.config.num_experts_per_tok
    assert [len(r) for r in runs] == [top_k] * len(runs) and all(len(set(r)) == top_k for r in runs)
    for h in hooks:
        h.remove()


@pytest.mark.parametrize("arch", sorted(MOE_ARCHS))
def test_routing_ties_fall_as_in_transformers_and_unused_experts_are_never_read(tmp_path, arch):
    """Zeroed routers: every expert ties for every token; topk takes the first top_k, in
    transformers and here, so one expert takes every token and the others none. The logits
    equal transformers' (as do those of a normalised and an unnormalised routing: the
    architectures' own settings)."""
    hf = save_tiny_model(arch, tmp_path / "model")
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight", "mlp.router.weight", "router.bias")):
                p.zero_()
    hf.save_pretrained(tmp_path / "model", safe_serialization=True)
    batch, ours = our_logits(tmp_path / "model")
    torch.testing.assert_close(ours, hf_logits(hf, batch), atol=1e-4, rtol=0)


def test_what_is_not_implemented_is_refused_with_the_reason():
    """README: gpt-oss's MXFP4 safetensors are not read yet; Phi-3's fused q/k/v do not split over
    ranks (gpt-oss's fused experts do: test_tensor_parallel)."""
    from pathlib import Path

    from pagedllm.models.gpt_oss.spec import unfuse

    with pytest.raises(UnsupportedModelError, match="MXFP4"):
        unfuse("model.layers.0.mlp.experts.gate_up_proj_blocks", torch.zeros(2, 4, 3, 16, dtype=torch.uint8))

    gpt_oss = ModelConfig.from_file(Path(__file__).parent.parent / "benchmarks/configs/gpt-oss-20b.json")
    assert shard_layout(gpt_oss, 2).expert == gpt_oss.moe.expert_size // 2
    phi3 = ModelConfig.from_hf_dict(
        {
            "architectures": ["Phi3ForCausalLM"],
            **dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4),
            **dict(num_key_value_heads=2, vocab_size=100, rms_norm_eps=1e-5),
        }
    )
    with pytest.raises(TensorParallelError, match="fuse several weights in one tensor.*tensor_parallel_size=1"):
        shard_layout(phi3, 2)
    assert shard_layout(phi3, 1).tp == 1


def test_olmoe_does_not_split_over_ranks():
    """OLMoE norms q and k over every head at once: a rank holding half the heads would norm by
    half the sum of squares. Refused, not run wrong (README)."""
    from pathlib import Path

    cfg = ModelConfig.from_file(Path(__file__).parent.parent / "benchmarks/configs/olmoe-1b-7b.json")
    with pytest.raises(TensorParallelError, match="normed over all heads.*tensor_parallel_size=1"):
        shard_layout(cfg, 2)


@pytest.mark.parametrize("quantization", [None, "int8", "int4", "w8a8"])
@pytest.mark.parametrize("arch", ["qwen3-moe", "qwen2-moe", "mixtral", "gpt-oss"])
def test_the_planner_counts_the_bytes_a_mixture_loads(tiny_checkpoints, arch, quantization):
    """Every expert in its format, the routers widened to float32 (computed once at load, never
    per step), the shared expert's gate and the norms in bf16: the planner's arithmetic and its
    reading of the checkpoint's headers equal the bytes the loaded model holds."""
    from pagedllm.loading.checkpoint import checkpoint_weights, load_decoder
    from pagedllm.memory.footprint import weight_bytes

    directory = tiny_checkpoints[arch][0]
    model = load_decoder(directory, torch.bfloat16, quantization)
    routers = [layer.mlp.router for layer in model.model.decoder_layers() if isinstance(layer.mlp, SparseMoE)]
    assert routers and all(r.weight.dtype == torch.float32 for r in routers)
    loaded = model.weight_bytes()
    assert loaded == weight_bytes(model.config, "bfloat16", quantization)
    assert loaded == checkpoint_weights(directory, "bfloat16", quantization)[0]
