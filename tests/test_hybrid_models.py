"""Layers that keep a state per sequence (Qwen3.5's Gated DeltaNet) beside attention layers: the
same outputs as transformers through every way the engine cuts, mixes, forks and restarts
sequences, and the states planned as the config's arithmetic says."""

from pathlib import Path

import pytest
import torch
from flat_steps import flat_step
from greedy import assert_greedy_matches, hf_greedy
from tiny_models import (
    HYBRID_ARCHS,
    save_tiny_granite_gguf,
    save_tiny_lfm2_gguf,
    save_tiny_model,
    save_tiny_qwen35_gguf,
)
from transformers.models.qwen3_5 import modeling_qwen3_5 as reference

from pagedllm import LLM, SamplingParams
from pagedllm.backends.cpu.kv_cache import KVCache
from pagedllm.config import ModelConfig
from pagedllm.errors import UnsupportedModelError
from pagedllm.kinds.gated_deltanet import delta_rule
from pagedllm.loading import load

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
# The mixture's logits on the compiled kernels: its float32 GEMMs sum in another order than
# transformers' (the first layer's mixer output 7e-6 from transformers' on a spread of 3.5, 2e-6
# relative; the PyTorch path's 5e-7), and four sparse layers after delta-rule layers carry that to
# 1.2e-4 (a 40-token prompt) and 3.4e-4 (the 70-token one) of logits up to 4.5 (PyTorch path:
# 1.7e-5; each MoE layer alone is exact on both paths; a wrong gate or weight moves them by 0.1+).
# Likewise the prompts' recurrences on the compiled kernels (token after token, where transformers
# and the PyTorch path sum in chunks): within 2e-7 of the chunked form's outputs in every layer of
# the tiny Qwen3.5, and as near float64's as it, but this random model carries a 1e-6 relative
# change of those outputs to 5e-5 of its logits and 1e-5 to 8e-4 (measured), so the logits land
# 2.9e-4 from float64 transformers' (float32 transformers: 8.4e-5; the PyTorch path: 9.5e-5).
# On a 2-core AMD EPYC (AVX-512, no AMX) the PyTorch path's own float32 GEMMs sum in yet another
# order and the delta-rule models' logits land 1.5e-4 to 3.3e-4 away on it too (measured), so
# those models take this bound on both paths.
COMPILED_ATOL = 5e-4


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """{arch: (directory, transformers model)}."""
    out = {}
    for name in HYBRID_ARCHS:
        d = tmp_path_factory.mktemp(f"tiny-{name}")
        out[name] = (d, save_tiny_model(name, d))
    return out


def prompts(vocab: int, lengths=(1, 5, 17, 40, 70, 3, 29), seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


def test_the_chunked_mamba2_scan_equals_transformers_token_by_token_update():
    """Across chunk boundaries (150 tokens: 64 + 64 + 22), from a state already there, two groups
    of B and C for four heads: the outputs and the last state of transformers' one-token update
    (``mamba2_selective_state_update``, its state [heads, head_dim, state_size]), run token by token."""
    from transformers.models.granitemoehybrid import modeling_granitemoehybrid as granite

    from pagedllm.kinds.mamba2 import scan

    torch.manual_seed(0)
    t, heads, groups, p, n = 150, 4, 2, 12, 16
    x, b, c = torch.randn(t, heads, p), torch.randn(t, groups, n), torch.randn(t, groups, n)
    dt, a = torch.rand(t, heads) * 0.5, -torch.rand(heads) * 2
    start = torch.randn(heads, p, n)
    hf_state, want = start[None].clone(), []
    for i in range(t):
        want.append(
            granite.mamba2_selective_state_update(
                hf_state,
                x[i][None],
                dt[i][None, :, None].expand(1, heads, p),
                a[:, None, None].expand(heads, p, n),
                b[i][None],
                c[i][None],
            )[0]
        )
    k, q = (y.repeat_interleave(heads // groups, dim=1) for y in (b, c))
    state = start.transpose(1, 2).contiguous()  # ours: [heads, state_size, head_dim]
    out = scan.chunked(q, k, x * dt[..., None], dt * a, state)
    torch.testing.assert_close(out, torch.stack(want), atol=5e-5, rtol=1e-5)
    torch.testing.assert_close(state, hf_state[0].transpose(1, 2), atol=5e-5, rtol=1e-5)


def test_the_chunked_delta_rule_equals_the_token_by_token_reference():
    """Across chunk boundaries (150 tokens: 64 + 64 + 22) and from a state already there: the
    outputs and the last state of transformers' one-token-at-a-time loop."""
    torch.manual_seed(0)
    t, heads, dk, dv = 150, 4, 16, 24
    q, k = torch.randn(1, t, heads, dk), torch.randn(1, t, heads, dk)
    v, g, beta = torch.randn(1, t, heads, dv), -torch.rand(1, t, heads) * 2, torch.rand(1, t, heads)
    start = torch.randn(1, heads, dk, dv)
    want, want_state = reference.torch_recurrent_gated_delta_rule(
        q, k, v, g, beta, initial_state=start.clone(), output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    qn, kn = delta_rule.normalised(q[0], k[0])
    state = start[0].clone()
    out = delta_rule.chunked(qn, kn, v[0], g[0], beta[0], state)
    torch.testing.assert_close(out, want[0], atol=2e-5, rtol=0)
    torch.testing.assert_close(state, want_state[0], atol=2e-5, rtol=0)


def test_the_compiled_decode_update_equals_the_reference_in_place_in_its_slots(ops):
    """The kernel's one-token update of sequences in slots 3 and 0 of a pool of 5 (value width 40:
    not a whole number of vectors): its outputs and those slots' states as ``recurrent_step``
    gives them on the gathered states, every other slot untouched."""
    g = torch.Generator().manual_seed(3)
    n, heads, dk, dv = 2, 3, 16, 40
    pool = torch.randn(5, heads, dk, dv, generator=g)
    slots = torch.tensor([3, 0])
    q, k = delta_rule.normalised(torch.randn(n, heads, dk, generator=g), torch.randn(n, heads, dk, generator=g))
    v = torch.randn(n, heads, dv, generator=g)
    decay, beta = -torch.rand(n, heads, generator=g), torch.rand(n, heads, generator=g)
    want_state = pool[slots].clone()
    want = delta_rule.recurrent_step(q, k, v, decay, beta, want_state)
    before = pool.clone()
    out = ops.delta_rule_decode(pool, slots, q, k, v, decay, beta)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(pool[slots], want_state, atol=1e-5, rtol=0)
    others = [i for i in range(5) if i not in slots.tolist()]
    assert torch.equal(pool[others], before[others])


@pytest.mark.parametrize("silu, bias", [(True, True), (False, False), (False, True)])
def test_the_compiled_convolution_step_continues_each_window_in_its_slot(ops, silu, bias):
    """Slots 3 and 0 of a pool of 5, 4 taps: each output is the taps against the slot's last three
    inputs and the new one, plus the bias, silu'd where asked (arithmetic here), each window
    shifted by the new input; the other slots untouched."""
    g = torch.Generator().manual_seed(7)
    n, channels, taps = 2, 37, 4
    pool = torch.randn(5, channels, taps - 1, generator=g)
    slots, x = torch.tensor([3, 0]), torch.randn(n, channels, generator=g)
    weight, offset = torch.randn(channels, 1, taps, generator=g), torch.randn(channels, generator=g)
    window = torch.cat([pool[slots], x[:, :, None]], dim=2)  # oldest input first
    want = (window * weight[:, 0]).sum(-1) + (offset if bias else 0)
    want = torch.nn.functional.silu(want) if silu else want
    before = pool.clone()
    out = ops.conv_state_step(pool, slots, x, weight[:, 0].contiguous(), offset if bias else torch.empty(0), silu)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(pool[slots], window[:, :, 1:])
    assert torch.equal(pool[[1, 2, 4]], before[[1, 2, 4]])


@pytest.mark.parametrize("dv", [40, 24])
def test_the_compiled_prefill_is_the_token_loop_and_the_decode_update_bit_for_bit(ops, dv):
    """A 150-token prompt through slot 2 of a pool of 4 (value width 40 or 24: one block of
    columns and a part of one, or one block with its second register part-filled): the outputs
    and last state of transformers' one-token-at-a-time loop (within float32 rounding), and
    exactly what 150 decode updates leave, so a prompt and the same tokens decoded agree; the
    other slots untouched."""
    g = torch.Generator().manual_seed(5)
    t, heads, dk = 150, 3, 16
    q, k = torch.randn(t, heads, dk, generator=g), torch.randn(t, heads, dk, generator=g)
    v, beta = torch.randn(t, heads, dv, generator=g), torch.rand(t, heads, generator=g)
    decay = -torch.rand(t, heads, generator=g) * 2
    pool = torch.randn(4, heads, dk, dv, generator=g)
    want, want_state = reference.torch_recurrent_gated_delta_rule(
        q[None],
        k[None],
        v[None],
        decay[None],
        beta[None],
        initial_state=pool[2:3].clone(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    qn, kn = delta_rule.normalised(q, k)
    stepped, outs = pool.clone(), []
    for i in range(t):
        outs.append(
            ops.delta_rule_decode(
                stepped,
                torch.tensor([2]),
                qn[i : i + 1],
                kn[i : i + 1],
                v[i : i + 1],
                decay[i : i + 1],
                beta[i : i + 1],
            )
        )
    before = pool.clone()
    out = ops.delta_rule_prefill(pool[2], qn, kn, v, decay, beta)
    torch.testing.assert_close(out, want[0], atol=2e-5, rtol=0)
    torch.testing.assert_close(pool[2], want_state[0], atol=2e-5, rtol=0)
    assert torch.equal(out, torch.cat(outs)) and torch.equal(pool[2], stepped[2])
    assert torch.equal(pool[[0, 1, 3]], before[[0, 1, 3]])


@pytest.mark.parametrize("dv", [40, 24])
def test_the_compiled_mamba2_prefill_is_the_token_loop_and_the_decode_update_bit_for_bit(ops, dv):
    """As the delta rule's, against ``scan.recurrent_step`` a token at a time in PyTorch, and
    bit for bit against the decode update run token after token."""
    from pagedllm.kinds.mamba2 import scan

    g = torch.Generator().manual_seed(6)
    t, heads, dk = 150, 3, 16
    q, k, v = (torch.randn(t, heads, d, generator=g) for d in (dk, dk, dv))
    decay = -torch.rand(t, heads, generator=g) * 2
    pool = torch.randn(4, heads, dk, dv, generator=g)
    reference_state, stepped = pool[2:3].clone(), pool.clone()
    want = torch.cat(
        [
            scan.recurrent_step(q[i : i + 1], k[i : i + 1], v[i : i + 1], decay[i : i + 1], reference_state)
            for i in range(t)
        ]
    )
    outs = [
        ops.mamba2_decode(stepped, torch.tensor([2]), q[i : i + 1], k[i : i + 1], v[i : i + 1], decay[i : i + 1])
        for i in range(t)
    ]
    before = pool.clone()
    out = ops.mamba2_prefill(pool[2], q, k, v, decay)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(pool[2], reference_state[0], atol=2e-5, rtol=1e-5)
    assert torch.equal(out, torch.cat(outs)) and torch.equal(pool[2], stepped[2])
    assert torch.equal(pool[[0, 1, 3]], before[[0, 1, 3]])


@pytest.mark.parametrize("tiled", [False, True])
def test_the_compiled_layer_step_equals_the_convolution_then_the_rule(ops, tiled):
    """The fused decode step of a Gated DeltaNet layer (slots 3 and 0 of 5; two value heads per
    key head, paired as the checkpoint or as llama.cpp's files order them) against the
    convolution's last output, q and k repeated to the value heads and normalised, and
    ``recurrent_step``, computed here: outputs, both states, other slots untouched."""
    g = torch.Generator().manual_seed(5)
    n, key_heads, heads, dk, dv, taps = 2, 2, 4, 16, 24, 4
    channels = 2 * key_heads * dk + heads * dv
    conv_pool, pool = torch.randn(5, channels, taps - 1, generator=g), torch.randn(5, heads, dk, dv, generator=g)
    slots = torch.tensor([3, 0])
    x, weight = torch.randn(n, channels, generator=g), torch.randn(channels, 1, taps, generator=g) * 0.5
    decay, beta = -torch.rand(n, heads, generator=g), torch.rand(n, heads, generator=g)
    window = torch.cat([conv_pool[slots], x[:, :, None]], dim=2)
    convolved = torch.nn.functional.silu((window * weight[:, 0]).sum(-1))
    q, k, v = convolved.split([key_heads * dk, key_heads * dk, heads * dv], dim=-1)
    q, k = (y.view(n, key_heads, dk) for y in (q, k))
    q, k = (y.repeat(1, 2, 1) if tiled else y.repeat_interleave(2, dim=1) for y in (q, k))
    q, k = delta_rule.normalised(q, k)
    want_state = pool[slots].clone()
    want = delta_rule.recurrent_step(q, k, v.reshape(n, heads, dv), decay, beta, want_state)
    before_conv, before = conv_pool.clone(), pool.clone()
    out = ops.gated_deltanet_decode(conv_pool, pool, slots, x, weight.view(channels, taps), decay, beta, 2, tiled)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool[slots], want_state, atol=1e-5, rtol=1e-5)
    assert torch.equal(conv_pool[slots], window[:, :, 1:])
    others = [1, 2, 4]
    assert torch.equal(pool[others], before[others]) and torch.equal(conv_pool[others], before_conv[others])


def test_the_compiled_layer_with_its_gates_and_norm_equals_the_steps(ops):
    """A decode step's whole layer (``gated_deltanet_layer_decode``) against its gates computed
    here from b and a, the fused step (checked above) and the gated norm computed here: the
    same outputs and states."""
    g = torch.Generator().manual_seed(6)
    n, heads, dk, dv, taps, eps = 2, 4, 16, 24, 4, 1e-6
    channels = 4 * dk + heads * dv
    pools = [torch.randn(5, channels, taps - 1, generator=g), torch.randn(5, heads, dk, dv, generator=g)]
    slots, x = torch.tensor([2, 4]), torch.randn(n, channels, generator=g)
    weight = torch.randn(channels, taps, generator=g) * 0.5
    b, a, z = torch.randn(n, heads, generator=g), torch.randn(n, heads, generator=g) * 3, torch.randn(n, heads * dv)
    a_log, dt_bias, norm = torch.randn(heads, generator=g), torch.randn(heads, generator=g), torch.rand(dv) + 0.5
    decay = -a_log.exp() * torch.nn.functional.softplus(a + dt_bias)
    copies = [p.clone() for p in pools]
    o = ops.gated_deltanet_decode(*copies, slots, x, weight, decay, b.sigmoid(), 2, False)
    gate = torch.nn.functional.silu(z.view(n, heads, dv))
    want = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * norm * gate
    out = ops.gated_deltanet_layer_decode(*pools, slots, x, weight, b, a, a_log, dt_bias, z, norm, eps, 2, False)
    torch.testing.assert_close(out, want.view(n, -1), atol=1e-5, rtol=1e-5)
    assert all(torch.allclose(p, c, atol=1e-6) for p, c in zip(pools, copies))


def test_the_compiled_mamba2_update_equals_the_reference_in_place_in_its_slots(ops):
    """As the delta rule's: slots 1 and 4 of a pool of 5, head width 24 (not a whole number of
    vectors), against ``scan.recurrent_step`` on the gathered states; other slots untouched."""
    from pagedllm.kinds.mamba2 import scan

    g = torch.Generator().manual_seed(4)
    n, heads, dk, dv = 2, 3, 16, 24
    pool = torch.randn(5, heads, dk, dv, generator=g)
    slots = torch.tensor([4, 1])
    q, k, v = torch.randn(n, heads, dk, generator=g), torch.randn(n, heads, dk, generator=g), torch.randn(n, heads, dv)
    decay = -torch.rand(n, heads, generator=g)
    want_state = pool[slots].clone()
    want = scan.recurrent_step(q, k, v, decay, want_state)
    before = pool.clone()
    out = ops.mamba2_decode(pool, slots, q, k, v, decay)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(pool[slots], want_state, atol=1e-5, rtol=0)
    others = [i for i in range(5) if i not in slots.tolist()]
    assert torch.equal(pool[others], before[others])


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_logits_of_a_mixed_step_equal_transformers_in_fp32(hybrid, arch, kernels):
    """Every prompt in one flat step, each from a fresh state in a slot a previous sequence left
    dirty: every position's logits."""
    directory, hf = hybrid[arch]
    loaded = load(directory, "float32")
    batch = prompts(loaded.config.vocab_size)
    cache = KVCache(loaded.config, num_blocks=64, block_size=8, dtype="float32", state_slots=len(batch) + 2)
    for tensors in cache.states.values():
        for t in tensors.values():
            t.normal_()  # what the slots' last owners left: a fresh sequence must not read it
    ids, positions, layout = flat_step(batch, 8, loaded.config.num_heads // loaded.config.num_kv_heads)
    layout.state_slots = torch.arange(len(batch)) + 2  # not the first slots
    attn = loaded.model.backend.attention(cache, layout)
    logits = loaded.model(torch.tensor(ids), torch.tensor(positions), attn, torch.arange(len(ids)))
    with torch.no_grad():
        want = torch.cat([hf(torch.tensor([p])).logits[0].float() for p in batch])
    compiled = loaded.config.delta_rule is not None or (
        kernels == "compiled" and (loaded.config.moe is not None or loaded.config.mamba2 is not None)
    )
    torch.testing.assert_close(logits.float(), want, atol=COMPILED_ATOL if compiled else 1e-4, rtol=0)


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_greedy_batched_chunked_and_preempted_equals_transformers(hybrid, arch, kernels):
    """A step budget below the longest prompt (its state carried chunk to chunk), decode rows
    batched, and too few blocks for all at once (preempted sequences restart from a fresh
    state); then the same prompts again, in slots the first run left dirty."""
    directory, hf = hybrid[arch]
    llm = LLM(directory, dtype="float32", block_size=4, num_blocks=48, max_batch_tokens=16, max_num_seqs=6)
    batch = prompts(llm.engine.loaded.config.vocab_size)
    engine = llm.engine
    outs = llm.generate(batch, GREEDY)
    assert engine.stats.preemptions > 0, "the test must exercise preemption"
    assert max(len(p) for p in batch) > engine.scheduler.max_batch_tokens, "and chunked prefill"
    refs = [hf_greedy(hf, p, GREEDY.max_tokens) for p in batch]
    assert_greedy_matches([o.token_ids for o in outs], refs)
    again = llm.generate(batch[::-1], GREEDY)
    assert [o.token_ids for o in again] == [o.token_ids for o in outs][::-1]
    engine.blocks.check_invariants()
    assert not engine.blocks.state_of and len(engine.blocks.free_states) == engine.blocks.state_slots


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_forked_samples_continue_their_parents_state(hybrid, arch):
    """n = 3 greedy samples: each fork starts from a copy of the prompt's state (a fork from a
    zero or stale state would part from the reference at once)."""
    directory, hf = hybrid[arch]
    llm = LLM(directory, dtype="float32", max_num_seqs=8)
    batch = prompts(llm.engine.loaded.config.vocab_size, lengths=(9, 33))
    llm.generate(prompts(llm.engine.loaded.config.vocab_size, lengths=(20, 20, 20, 20), seed=7), GREEDY)  # dirty slots
    outs = llm.generate(batch, SamplingParams(n=3, max_tokens=16, temperature=0, ignore_eos=True))
    for p, out in zip(batch, outs):
        want = hf_greedy(hf, p, 16).tokens
        assert [s.token_ids for s in out.outputs] == [want] * 3


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_the_planned_weights_are_transformers_parameters(hybrid, arch):
    """The planner counts a delta-rule layer's tensors from config.json alone (its kind's
    ``footprint.parameters``): the same number as the checkpoint transformers wrote."""
    from pagedllm.memory.footprint import parameter_count

    directory, hf = hybrid[arch]
    assert parameter_count(ModelConfig.from_file(directory)) == sum(p.numel() for p in hf.parameters())


def test_state_bytes_per_sequence_are_the_configs_arithmetic(hybrid):
    """Per Gated DeltaNet layer: the convolution's last kernel - 1 inputs of its q/k/v channels and a
    key_dim x value_dim matrix per value head, float32; the attention layers' K/V stay paged."""
    directory, _ = hybrid["qwen3_5"]
    cfg = ModelConfig.from_file(directory)
    c = HYBRID_ARCHS["qwen3_5"][1]
    channels = 2 * c["linear_num_key_heads"] * c["linear_key_head_dim"] + 4 * c["linear_value_head_dim"]
    per_layer = 4 * (channels * (c["linear_conv_kernel_dim"] - 1) + 4 * 16 * 16)
    assert cfg.state_bytes_per_sequence() == 3 * per_layer  # three delta-rule layers of four
    assert [cfg.kv_pool_of_layer(i) for i in range(4)] == [None, None, None, 0]
    llm = LLM(directory, dtype="float32", max_num_seqs=5, num_blocks=64)  # (no budget: a worker's baseline varies)
    plan = llm.engine.memory.plan
    # five running sequences and five prefix checkpoints
    assert plan.checkpoint_slots == 5 and plan.state_bytes == (5 + 5) * 3 * per_layer
    assert f"{3 * per_layer} bytes per sequence x 5 running + 5 prefix checkpoints" in plan.table()
    cache = llm.engine.memory.kv_cache
    assert all(cache.k[i].numel() == 0 for i in range(3)) and cache.k[3].numel() > 0  # no K/V for a state layer
    held = [t for pool in (cache.states, cache.checkpoints) for layer in pool.values() for t in layer.values()]
    assert sum(t.numel() * 4 for t in held) == plan.state_bytes  # what is allocated is what was planned


def test_mamba2_state_bytes_per_sequence_are_the_configs_arithmetic(hybrid):
    """Per Mamba-2 layer: the convolution's last d_conv - 1 inputs of its x, B and C channels and a
    d_state x d_head matrix per head, float32; the attention layer's K/V stay paged."""
    directory, _ = hybrid["granite-h"]
    c = HYBRID_ARCHS["granite-h"][1]
    channels = c["mamba_expand"] * 64 + 2 * c["mamba_n_groups"] * c["mamba_d_state"]  # hidden 64
    per_layer = 4 * (channels * (c["mamba_d_conv"] - 1) + c["mamba_n_heads"] * c["mamba_d_state"] * c["mamba_d_head"])
    cfg = ModelConfig.from_file(directory)
    assert cfg.state_bytes_per_sequence() == 3 * per_layer  # three Mamba-2 layers of four
    assert [cfg.kv_pool_of_layer(i) for i in range(4)] == [None, None, 0, None]
    assert cfg.rope_of_layer(2) is None  # Granite-4.0-H's attention: no positions


def cold(directory, prompt, params=GREEDY):
    """A new engine's tokens and its time to the first token of ``prompt`` (nothing cached)."""
    llm = LLM(directory, dtype="float32", block_size=4, max_batch_tokens=16)
    return llm.generate([prompt], params)[0].token_ids


@pytest.mark.parametrize("arch", ["qwen3_5", "lfm2", "granite-h"])
@pytest.mark.parametrize("interval", [8, 256])
def test_a_prefix_hit_starts_from_a_checkpoint_with_exact_outputs(hybrid, monkeypatch, interval, arch):
    """Two requests that share a 37-token prefix, then a third that repeats the second and goes
    on (a conversation's next turn). With a checkpoint every 8 tokens the second starts at 32
    (the last one within the shared part); with one every 256 only the prompt's last boundary is
    kept, so the second starts cold and the third at the second's prompt end. Every answer is
    transformers' and a cold engine's; the hits are counted where /metrics reads them."""
    from pagedllm.engine import state_checkpoints

    monkeypatch.setattr(state_checkpoints, "INTERVAL_TOKENS", interval)
    directory, hf = hybrid[arch]
    llm = LLM(directory, dtype="float32", block_size=4, max_batch_tokens=16)
    shared = prompts(320, lengths=(37,), seed=11)[0]
    first, second = shared + [5, 6, 7, 8, 9, 10, 11, 12, 13, 14], shared + [21, 22, 23, 24, 25, 26, 27]
    runs = [llm.generate([first], GREEDY)[0].token_ids]
    hits = llm.engine.blocks.prefix_stats.hit_tokens
    runs.append(llm.generate([second], GREEDY)[0].token_ids)
    assert llm.engine.blocks.prefix_stats.hit_tokens - hits == (32 if interval == 8 else 0)
    third = second + runs[1] + [40, 41, 42]
    hits = llm.engine.blocks.prefix_stats.hit_tokens
    runs.append(llm.generate([third], GREEDY)[0].token_ids)
    assert llm.engine.blocks.prefix_stats.hit_tokens - hits == 44  # the second's prompt, 44 tokens, ends a block
    stats = llm.engine.stats
    assert stats.state_checkpoint_hits == (2 if interval == 8 else 1) and stats.state_checkpoints_taken > 0
    for prompt, ours in zip((first, second, third), runs):
        assert ours == hf_greedy(hf, prompt, GREEDY.max_tokens).tokens == cold(directory, prompt)
    llm.engine.blocks.check_invariants()


@pytest.mark.parametrize("arch", ["qwen3_5", "lfm2", "granite-h"])
def test_a_checkpoint_equals_the_state_recomputed_bit_for_bit(hybrid, monkeypatch, arch):
    """The state kept at token 32 of a 47-token prompt computed in chunks of 16 is, in every
    layer and to the bit, the state a 32-token prompt leaves in its slot."""
    from pagedllm.engine import state_checkpoints

    monkeypatch.setattr(state_checkpoints, "INTERVAL_TOKENS", 32)
    directory, _ = hybrid[arch]
    prompt = prompts(320, lengths=(47,), seed=12)[0]
    llm = LLM(directory, dtype="float32", block_size=4, max_batch_tokens=16, enable_prefix_caching=True)
    llm.generate([prompt], SamplingParams(max_tokens=1))
    checkpoints = llm.engine.blocks.checkpoints
    key = list(checkpoints.by_key)[0]
    assert key[2] == tuple(prompt[28:32])  # the first kept: the block that ends at 32
    slot = checkpoints.by_key[key]
    kept = {
        (layer, name): t[slot].clone()
        for layer, d in llm.engine.memory.kv_cache.checkpoints.items()
        for name, t in d.items()
    }
    fresh = LLM(directory, dtype="float32", block_size=4, max_batch_tokens=16, enable_prefix_caching=False)
    fresh.generate([prompt[:32]], SamplingParams(max_tokens=1))
    states = fresh.engine.memory.kv_cache.states  # slot 0: the only sequence's, its state after 32 tokens
    for (layer, name), value in kept.items():
        assert torch.equal(value, states[layer][name][0]), (layer, name)


# GGUF files as llama.cpp's converter writes Qwen3.5 (``save_tiny_qwen35_gguf``, its tensors byte
# for byte the converter's on the same model): dense in float32 and with Q8_0 projections, and the mixture
GGUF_CASES = [
    ("qwen3_5", "F32"),
    ("qwen3_5", "Q8_0"),
    ("qwen3_5-moe", "F32"),
    ("lfm2", "F32"),
    ("granite-h", "F32"),
    ("granite-h", "Q8_0"),
    ("granite-h-dense", "F32"),
    ("qwen3-next", "F32"),
    ("qwen3-next", "Q8_0"),
]


@pytest.fixture(scope="module")
def hybrid_gguf(tmp_path_factory):
    """(arch, weights) -> (the GGUF file, transformers' model), each written once for both kernel
    paths (the second LLM finds the file's conversion in the cache)."""
    made: dict[tuple[str, str], tuple[Path, torch.nn.Module]] = {}

    def of(arch: str, weights: str) -> tuple[Path, torch.nn.Module]:
        if (arch, weights) not in made:
            path = tmp_path_factory.mktemp(f"gguf-{arch}-{weights}") / f"{arch}.gguf"
            if arch == "lfm2":
                hf = save_tiny_lfm2_gguf(path)
            elif arch.startswith("granite"):
                hf = save_tiny_granite_gguf(arch, path, weights=weights)
            else:
                hf = save_tiny_qwen35_gguf(arch, path, weights=weights)
            made[arch, weights] = (path, hf)
        return made[arch, weights]

    return of


@pytest.mark.parametrize(("arch", "weights"), GGUF_CASES)
def test_a_gguf_file_as_llama_cpp_writes_it_equals_transformers(hybrid_gguf, arch, weights, kernels):
    """Logits of every position of a mixed step, and greedy batched and chunked. Qwen3.5: the
    value heads regrouped by llama.cpp's converter (two per key head here), A_log stored as
    -exp(A_log), the norms plus one and the convolution flattened; LFM2: its layer types read
    from the KV heads per layer, its final norm named as the embeddings', its taps flattened;
    Qwen3-Next: q/k/v and z apart, b and a fused per key head (quantized rows split too);
    Granite-4.0-H: its layer types likewise, A_log as -exp(A_log), D and the gated norm's scale
    reshaped, q/k rows in llama.cpp's rope order, its multipliers from the metadata. All must come
    back as transformers holds them."""
    path, hf = hybrid_gguf(arch, weights)
    llm = LLM(str(path), dtype="float32", max_batch_tokens=16, max_num_seqs=4)
    config = llm.engine.loaded.config
    if arch == "lfm2":
        assert config.layer_mixers == ("short_conv", "attention", "short_conv", "short_conv")
    elif arch.startswith("granite"):
        assert config.layer_mixers == ("mamba2", "mamba2", "attention", "mamba2")
        assert (config.moe is None) == arch.endswith("dense") and config.residual_multiplier == 0.5
    else:
        assert config.delta_rule.value_heads == 2 * config.delta_rule.key_heads
        assert config.delta_rule.value_heads_tiled == (arch != "qwen3-next")  # its converter regroups none
    batch = prompts(config.vocab_size, lengths=(3, 40, 17, 29))
    outs = llm.generate(batch, GREEDY)
    assert_greedy_matches([o.token_ids for o in outs], [hf_greedy(hf, p, GREEDY.max_tokens) for p in batch])
    cache = KVCache(config, num_blocks=64, block_size=8, dtype="float32", state_slots=len(batch))
    ids, positions, layout = flat_step(batch, 8, config.num_heads // config.num_kv_heads)
    layout.state_slots = torch.arange(len(batch))
    model = llm.engine.loaded.model
    logits = model(
        torch.tensor(ids), torch.tensor(positions), model.backend.attention(cache, layout), torch.arange(len(ids))
    )
    with torch.no_grad():
        want = torch.cat([hf(torch.tensor([p])).logits[0].float() for p in batch])
    # the compiled Q8_0 GEMM sums each block's products in its own order (as the compiled float32
    # mixture does: COMPILED_ATOL): 2.4e-4 at most here, the PyTorch path within 1e-4; the compiled
    # recurrences run a prompt token after token (COMPILED_ATOL's note): 1.1e-4 for Qwen3.5 in F32
    # (and the delta-rule models on the PyTorch path, on the AMD EPYC: COMPILED_ATOL's note)
    compiled_order = arch in ("qwen3_5", "qwen3_5-moe", "qwen3-next", "granite-h") or (
        kernels == "compiled" and arch != "lfm2"
    )
    torch.testing.assert_close(logits.float(), want, atol=COMPILED_ATOL if compiled_order else 1e-4, rtol=0)


def test_what_a_state_cannot_do_yet_is_refused_clearly(hybrid):
    directory, _ = hybrid["qwen3_5"]
    with pytest.raises(UnsupportedModelError, match="speculative decoding"):
        LLM(directory, dtype="float32", speculative_method="ngram", num_speculative_tokens=2)
    assert "state" in ModelConfig.from_file(directory).family.not_split_because


def test_the_checkpoint_pool_evicts_the_least_recently_used_and_hides_what_is_unwritten():
    """Hand-built: two slots, three prefixes. A pending checkpoint is not found (its step has not
    written it yet), a failed step's go back, and the one used last survives an eviction."""
    from pagedllm.engine.state_checkpoints import StateCheckpoints

    pool = StateCheckpoints(2, block_size=4)
    a, b, c = ("a",), ("b",), ("c",)
    slot_a, slot_b = pool.take(a), pool.take(b)
    assert pool.find(a) is None and pool.take(a) is None  # written by the step in flight
    pool.commit()
    assert pool.find(a) == slot_a and pool.find(b) == slot_b
    pool.find(a)  # a used last: b is the one to go
    assert pool.take(c) == slot_b and pool.stats.evicted == 1
    pool.drop_pending()  # c's step failed
    assert pool.find(c) is None and pool.find(b) is None and pool.find(a) == slot_a
    pool.check_invariants()
    assert pool.boundaries(0, 40, 37) == [36] and pool.boundaries(0, 44, 44) == [40, 44]
    pool.interval = 8
    assert pool.boundaries(10, 40, 37) == [16, 24, 32, 36] and pool.boundaries(36, 37, 37) == []


def test_a_shrunk_checkpoint_pool_keeps_the_most_recently_used_renumbered():
    """Hand-built: four committed checkpoints, ``b`` and ``d`` found last; down to two slots, those
    two stay (renumbered 0 and 1, the cache told where each was) and the others are evicted;
    grown to three again, one slot is free and nothing comes back."""
    from pagedllm.engine.state_checkpoints import StateCheckpoints

    pool = StateCheckpoints(4, block_size=4)
    slots = {key: pool.take((key,)) for key in "abcd"}
    pool.commit()
    assert pool.find(("b",)) == slots["b"] and pool.find(("d",)) == slots["d"]
    moves = pool.resize(2)
    assert moves == [(slots["b"], 0), (slots["d"], 1)]
    assert pool.find(("b",)) == 0 and pool.find(("d",)) == 1
    assert pool.find(("a",)) is None and pool.find(("c",)) is None and pool.stats.evicted == 2
    pool.check_invariants()
    assert pool.resize(3) == [(0, 0), (1, 1)]
    assert pool.take(("e",)) == 2 and pool.take(("f",)) is not None and pool.stats.evicted == 3
    pool.check_invariants()


def test_a_shrinking_budget_sheds_prefix_checkpoints_before_it_preempts_a_request(hybrid):
    """Four requests running, then a budget whose KV cache, with all six checkpoints planned,
    would hold fewer blocks than the requests hold when they finish, and with three shed holds
    them all (the budget set so by arithmetic on the plan's own terms): nothing is preempted,
    three checkpoints stay, the outputs are transformers'. A policy that keeps checkpoints while
    only the blocks in use now fit, or that preempts first, fails it."""
    directory, hf = hybrid["qwen3_5"]
    llm = LLM(directory, dtype="float32", block_size=4, max_num_seqs=6, max_batch_tokens=16, max_model_len=64)
    before = llm.memory_plan
    state = before.state_bytes // before.state_count  # a sequence's state, a checkpoint's
    engine, params = llm.engine, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    batch = prompts(engine.loaded.config.vocab_size, lengths=(40, 33, 29, 17))
    ids = [engine.add_request(p, params) for p in batch]
    for _ in range(9):  # every prompt computed: 119 tokens, 16 a step
        engine.step()
    to_finish = sum(-(-(len(p) + 8) // 4) for p in batch)
    # four checkpoints kept would still hold the blocks in use now (a policy that looks only at them keeps four)
    assert engine.blocks.num_used <= to_finish - 0.5 * state / before.kv_bytes_per_block
    everything_but_kv = before.total_bytes - before.kv_cache_bytes - before.checkpoint_slots * state
    budget = everything_but_kv + to_finish * before.kv_bytes_per_block + int(3.5 * state)
    plan = llm.set_memory(budget)
    assert plan.checkpoint_slots == 3 and plan.num_blocks >= to_finish
    assert engine.blocks.checkpoints.slots == 3
    assert all(t.shape[0] == 3 for layer in engine.kv_cache.checkpoints.values() for t in layer.values())
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.token_ids
    assert engine.stats.preemptions == 0
    refs = [hf_greedy(hf, p, 8) for p in batch]
    assert_greedy_matches([outs[i] for i in ids], refs)
    # the last prompt's checkpoints are the most recent: kept, carried into the smaller pool, reused
    hits = engine.blocks.checkpoints.stats.hits
    again = llm.generate([batch[3]], params)[0].token_ids
    assert engine.blocks.checkpoints.stats.hits == hits + 1 and again == outs[ids[3]]
    engine.blocks.check_invariants()
