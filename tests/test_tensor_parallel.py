"""Tensor parallelism at tp=2 on this box: the driver (this test's process) and one worker rank it
starts, one thread each, gloo on 127.0.0.1.

Promises: a split model computes what the whole one does (greedy tokens equal, log-probabilities
within 1e-5, on every architecture, in a batch that chunks, preempts and hits the prefix cache,
with n > 1, logprobs, an 8-bit cache, GGUF weights kept quantized and structured output); each
rank holds exactly its slice of every checkpoint tensor (checked against slices taken here of
the transformers model's own tensors); the collectives sum and gather what arithmetic here says;
a worker that dies ends the driver's step with a clear error, not a hang; no rank outlives the
driver; ``torchrun`` launches ``pagedllm generate`` on two ranks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from tiny_models import save_tiny_gguf, save_tiny_model

from pagedllm import LLM, SamplingParams
from pagedllm.distributed.group import RankLost
from pagedllm.distributed.shards import RankShard, TensorParallelError
from pagedllm.errors import ModelLoadError
from pagedllm.loading.checkpoint import _rank_slices, checkpoint_weights, load_decoder
from pagedllm.sampling_params import StructuredOutput

# (architecture, config overrides): every switch a split must handle
VARIANTS = {
    "llama": ("llama", {}),
    "llama-one-kv-head": ("llama", {"num_key_value_heads": 1}),  # the KV head replicated on both ranks
    "llama3-rope-tied": ("llama3-rope-tied", {}),
    "mistral": ("mistral", {}),  # sliding window, head_dim other than hidden / heads
    "qwen2-odd-vocab": ("qwen2", {"vocab_size": 317}),  # q/k/v bias, tied, a vocabulary padded per rank
    "qwen3": ("qwen3", {}),  # per-head q/k norms
    # sliding and full layers with rope bases of their own, norms around both sub-layers, GELU,
    # scaled embeddings; layers without positions
    "gemma3": ("gemma3", {}),
    "smollm3": ("smollm3", {}),
    # mixtures of experts: each expert's columns split like the MLP's; a shared expert and a dense
    # layer among the sparse ones (Qwen2-MoE), Mixtral's names for its experts
    "qwen2-moe": ("qwen2-moe", {}),
    "mixtral": ("mixtral", {}),
    # experts fused in the checkpoint (gate/up interleaved), each rank reading its run of them;
    # biases, attention sinks per head, sliding and full layers
    "gpt-oss": ("gpt-oss", {}),
}
TIGHT = dict(block_size=4, num_blocks=40, max_batch_tokens=16, max_num_seqs=8, max_model_len=160, threads=1)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for name, (arch, overrides) in VARIANTS.items():
        d = tmp_path_factory.mktemp(f"tp-{name}")
        out[name] = (d, save_tiny_model(arch, d, **overrides))
    return out


def workload(vocab: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts sharing a 24-token prefix (prefix-cache hits), longer than a step's budget (chunked
    prefill), more than the cache holds at once (preemption); greedy with logprobs, and one
    request of two seeded samples (copy-on-write of the shared last block)."""
    g = torch.Generator().manual_seed(7)
    prefix = torch.randint(1, vocab, (24,), generator=g).tolist()
    prompts = [prefix + torch.randint(1, vocab, (k,), generator=g).tolist() for k in (3, 9, 17, 30, 5, 12)]
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=3)
    sampled = SamplingParams(max_tokens=24, temperature=0.8, seed=11, n=2, ignore_eos=True)
    return prompts, [greedy] * (len(prompts) - 1) + [sampled]


def run(directory, tp: int, **options):
    llm = LLM(str(directory), tensor_parallel_size=tp, **{**TIGHT, **options})
    try:
        prompts, params = workload(llm.engine.loaded.config.vocab_size)
        before = llm.engine.stats
        outs = llm.generate(prompts, params)
        stats = llm.engine.stats
        return outs, stats.preemptions - before.preemptions, stats.prefix_cache_hit_tokens
    finally:
        llm.close()


def assert_same_outputs(split, whole, tolerance: float = 1e-5) -> None:
    assert len(split) == len(whole)
    for a, b in zip((c for o in split for c in o.outputs), (c for o in whole for c in o.outputs), strict=True):
        assert a.token_ids == b.token_ids and a.index == b.index
        for la, lb in zip(a.logprobs or [], b.logprobs or []):  # {"token": (id, lp), "top": [(id, lp)...]}
            pairs = [(la["token"], lb["token"]), *zip(la["top"], lb["top"])]
            assert [x[0] for x, _ in pairs] == [y[0] for _, y in pairs]
            assert max(abs(x[1] - y[1]) for x, y in pairs) < tolerance, pairs


@pytest.mark.parametrize("name", VARIANTS)
def test_a_split_model_generates_what_the_whole_model_does(checkpoints, name):
    directory, _ = checkpoints[name]
    whole, _, _ = run(directory, 1)
    split, preempted, hits = run(directory, 2)
    assert preempted > 0 and hits > 0, "the batch must preempt and hit the prefix cache"
    assert max(len(o.prompt_token_ids) for o in split) > TIGHT["max_batch_tokens"], "and chunk"
    assert_same_outputs(split, whole)
    assert [c.index for c in split[-1].outputs] == [0, 1]  # both samples of the last request


def test_an_8_bit_cache_splits_its_heads_like_a_float_one(checkpoints):
    directory, _ = checkpoints["llama"]
    whole, _, _ = run(directory, 1, kv_cache_dtype="int8")
    split, _, _ = run(directory, 2, kv_cache_dtype="int8")
    # the same tokens; logprobs within 1e-4: a K/V value the two sums put either side of an int8
    # rounding boundary is cached one step apart (measured 3e-5 with fp32 GEMMs on oneDNN)
    assert_same_outputs(split, whole, tolerance=1e-4)


def converted_gguf(directory, types):
    from test_quantization import write_llama_gguf

    from pagedllm.loading import gguf_convert

    path, out = directory / "tiny.gguf", directory / "converted"
    write_llama_gguf(path, types, np.random.default_rng(0))
    out.mkdir()
    saved = gguf_convert._save_tokenizer
    gguf_convert._save_tokenizer = lambda *a: None  # it carries none
    try:
        gguf_convert.convert(path, out)
    finally:
        gguf_convert._save_tokenizer = saved
    return out


@pytest.fixture(scope="module")
def quantized_gguf(tmp_path_factory):
    """A converted GGUF holding every supported quantized type, its row-parallel layers (Q4_1,
    and Q5_K, whose 512 columns tp=2 cuts at a whole block of 256) cut at whole groups."""
    from test_quantization import TYPES

    return converted_gguf(tmp_path_factory.mktemp("tp-gguf"), {**TYPES, "attn_output": "Q4_1"})


def test_a_k_quant_cut_inside_a_block_is_refused_by_name(tmp_path):
    """A K-quant is kept as its blocks of 256 columns: tp=2 cutting a 256-wide row-parallel
    layer (o_proj in Q4_K) at column 128 would split a block; the error names the tensor."""
    from test_quantization import TYPES

    model_dir = converted_gguf(tmp_path, TYPES)
    shard = RankShard.of(load_decoder(model_dir, torch.float32).config, 2, 0)
    with pytest.raises(ModelLoadError, match=r"o_proj.weight' is quantized in groups of 256 columns"):
        load_decoder(model_dir, torch.float32, None, shard=shard)


def test_gguf_weights_kept_quantized_split_at_whole_groups(quantized_gguf):
    whole, _, _ = run(quantized_gguf, 1)
    split, _, _ = run(quantized_gguf, 2)
    assert_same_outputs(split, whole)
    # the planner's per-rank figure is what the rank holds, and the two ranks hold the model once
    # (plus the replicated norms and the padded vocabulary)
    cfg_shards = [RankShard.of(load_decoder(quantized_gguf, torch.float32).config, 2, r) for r in (0, 1)]
    held = [load_decoder(quantized_gguf, torch.float32, None, shard=s).weight_bytes() for s in cfg_shards]
    planned = [checkpoint_weights(quantized_gguf, "float32", None, s)[0] for s in cfg_shards]
    assert held == planned


def test_structured_output_is_the_drivers_and_holds_at_tp2(tmp_path):
    path = tmp_path / "tiny-qwen2.gguf"
    save_tiny_gguf("qwen2", path)
    choice = StructuredOutput(choice=["yes", "no", "maybe not"])
    params = SamplingParams(max_tokens=8, temperature=0.7, seed=3, structured_output=choice)
    texts = {}
    for tp in (1, 2):
        llm = LLM(str(path), tensor_parallel_size=tp, threads=1)
        try:
            texts[tp] = [o.text for o in llm.generate([[5, 6, 7], [9, 10], [40, 41, 42, 43]], params)]
        finally:
            llm.close()
    assert all(t in choice.choice for t in texts[2])
    assert texts[2] == texts[1]


# ---- the shards, without processes ---------------------------------------------------------


def plain_weight(layer) -> torch.Tensor:
    """A linear layer's weight rows, however its backend packed them: the layer's product with
    the identity, without its bias (exact: one product per output)."""
    eye = torch.eye(layer.in_features)
    return layer.backend.linear(eye, layer.weight, None, layer.packed).T


@pytest.mark.parametrize("name", ["llama-one-kv-head", "qwen2-odd-vocab", "qwen3", "qwen2-moe"])
def test_each_rank_holds_exactly_its_slice_of_every_tensor(checkpoints, name):
    directory, hf = checkpoints[name]
    state = {k: v.float() for k, v in hf.state_dict().items()}
    cfg = hf.config
    heads, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, getattr(cfg, "head_dim", None) or 16
    vocab, per_rank = cfg.vocab_size, -(-cfg.vocab_size // 32) * 16  # rows per rank: a multiple of 16
    for rank in (0, 1):
        model = load_decoder(
            directory, torch.float32, shard=RankShard.of(load_decoder(directory, torch.float32).config, 2, rank)
        )
        q_rows = slice(rank * heads // 2 * d, (rank + 1) * heads // 2 * d)
        kv_head = rank * kv // 2 if kv >= 2 else 0  # one KV head each, or the one replicated
        kv_rows = slice(kv_head * d, (kv_head + max(1, kv // 2)) * d)
        mlp = slice(rank * cfg.intermediate_size // 2, (rank + 1) * cfg.intermediate_size // 2)
        layer = model.model.layers[0]
        qkv = plain_weight(layer.self_attn.qkv_proj)
        expected_qkv = torch.cat(
            [
                state[f"model.layers.0.self_attn.{p}_proj.weight"][r]
                for p, r in (("q", q_rows), ("k", kv_rows), ("v", kv_rows))
            ]
        )
        assert torch.equal(qkv, expected_qkv)
        assert torch.equal(
            plain_weight(layer.self_attn.o_proj), state["model.layers.0.self_attn.o_proj.weight"][:, q_rows]
        )
        up = state["model.layers.0.mlp.up_proj.weight"][mlp]
        assert torch.equal(plain_weight(layer.mlp.gate_up_proj)[mlp.stop - mlp.start :], up)
        assert torch.equal(plain_weight(layer.mlp.down_proj), state["model.layers.0.mlp.down_proj.weight"][:, mlp])
        if cfg.model_type == "qwen2":
            bias = state["model.layers.0.self_attn.q_proj.bias"][q_rows]
            assert torch.equal(layer.self_attn.qkv_proj.bias[: bias.numel()], bias)
        if cfg.model_type == "qwen3":
            assert torch.equal(layer.self_attn.q_norm.weight, state["model.layers.0.self_attn.q_norm.weight"])
        rows = range(rank * per_rank, min(vocab, (rank + 1) * per_rank))
        embed = model.model.embed_tokens.weight
        assert embed.shape[0] == per_rank
        assert torch.equal(embed[: len(rows)], state["model.embed_tokens.weight"][rows.start : rows.stop])
        assert not embed[len(rows) :].any()  # the padding rows


def test_a_cut_inside_a_quantization_group_is_refused_naming_the_tensor(checkpoints):
    directory, hf = checkpoints["llama"]
    shard = RankShard.of(load_decoder(directory, torch.float32).config, 2, 1)
    select = _rank_slices(directory, shard)
    name = "model.layers.0.mlp.down_proj.weight"  # 160 columns; rank 1 reads 80-159
    assert select(f"{name}.scale", {"shape": [64, 10], "dtype": "F32"}) == (1, 5, 10)  # groups of 16: whole
    assert select(f"{name}.qweight", {"shape": [64, 160], "dtype": "I8"}) == (1, 80, 160)
    with pytest.raises(ModelLoadError, match="'model.layers.0.mlp.down_proj.weight'.*groups of 32"):
        select(f"{name}.scale", {"shape": [64, 5], "dtype": "F32"})  # 80 is inside a group of 32
    assert select("model.layers.0.mlp.up_proj.weight.scale", {"shape": [160, 2], "dtype": "F32"}) == (0, 80, 160)


def test_each_rank_gets_its_own_cores_within_one_numa_node_where_the_counts_allow():
    from pagedllm.processes.driver_ranks import split_cores

    one_node = dict.fromkeys(range(8), 0)
    assert [split_cores(list(range(8)), one_node, r, 2) for r in (0, 1)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    two_nodes = {c: c % 2 for c in range(8)}  # CPUs interleaved over two sockets
    assert [split_cores(list(range(8)), two_nodes, r, 2) for r in (0, 1)] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert [split_cores(list(range(8)), two_nodes, r, 4) for r in range(4)] == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert split_cores([0, 1], one_node, 1, 3) == []  # more ranks than cores: they share (unpinned)


def test_a_size_that_does_not_split_the_model_fails_before_any_rank_starts(checkpoints):
    directory, _ = checkpoints["llama"]  # 4 heads
    started = time.perf_counter()
    with pytest.raises(TensorParallelError, match="4 attention heads"):
        LLM(str(directory), tensor_parallel_size=3)
    assert time.perf_counter() - started < 5


# ---- processes -------------------------------------------------------------------------------

COLLECTIVES = """
import sys, torch
from pagedllm import backends
from pagedllm.distributed import shm
from pagedllm.distributed.group import join
rank = int(sys.argv[1])
g = join(rank, 2, sys.argv[2], backends.get("cpu-compiled").shared_memory_ops())
assert (g.shm is not None) == (sys.argv[3] == "shm")
shm.SLOT_BYTES = 4096  # a tensor larger than a slot goes through in pieces
for dtype in (torch.float32, torch.bfloat16):
    for n in (6, 5000):  # one slot, several
        x = torch.arange(n, dtype=dtype) * (rank + 1)
        g.all_reduce_(x)
        assert torch.equal(x, torch.arange(n, dtype=dtype) * 3), x
    x = torch.full((3, 1000), 1.0 + rank, dtype=dtype)[:, ::2]  # not contiguous
    g.all_reduce_(x)
    assert torch.equal(x, torch.full((3, 500), 3.0, dtype=dtype))
for rows_, cols in ((2, 2), (9, 300)):  # 9 rows of 1200 bytes: three slots' worth
    mine = torch.arange(rows_ * cols, dtype=torch.float32).view(rows_, cols) + 1000 * rank
    got = g.gather_rows(mine)
    if rank == 0:
        base = torch.arange(rows_ * cols, dtype=torch.float32).view(rows_, cols)
        assert torch.equal(got, torch.cat([base, base + 1000], dim=1)), got
    else:
        assert got is None
got = g.broadcast({"step": [1, 2], "t": torch.arange(3)} if rank == 0 else None)
assert got["step"] == [1, 2] and torch.equal(got["t"], torch.arange(3))
assert g.gather_objects(rank * 10) == [0, 10]
g.close()
print("ok", rank)
"""


@pytest.mark.parametrize("path", ["shm", "gloo"])
def test_collectives_sum_gather_and_broadcast_what_arithmetic_says(tmp_path, path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "collectives.py"
    script.write_text(COLLECTIVES)
    env = {**os.environ, "PAGEDLLM_TP_SHM": "1" if path == "shm" else "0"}
    cmd = [sys.executable, str(script)]
    procs = [
        subprocess.Popen([*cmd, str(r), f"tcp://127.0.0.1:{port}", path], stdout=subprocess.PIPE, text=True, env=env)
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=60)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0] and outs == ["ok 0\n", "ok 1\n"]


def test_a_killed_worker_ends_the_step_with_an_error_not_a_hang(checkpoints):
    directory, _ = checkpoints["llama"]
    llm = LLM(str(directory), tensor_parallel_size=2, threads=1)
    worker = llm.engine.ranks.workers[0]
    assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4))[0].token_ids  # it runs
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait()
    started = time.perf_counter()
    with pytest.raises(RankLost, match="a rank of 2 stopped answering"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4))
    assert time.perf_counter() - started < 30
    llm.close()  # nothing left to stop, and it does not hang either


DRIVER = """
import sys
from pagedllm import LLM, SamplingParams
llm = LLM(sys.argv[1], tensor_parallel_size=2, threads=1)
print("worker", llm.engine.ranks.workers[0].pid, flush=True)
llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4))
if sys.argv[2] == "hang":
    import time
    time.sleep(600)
"""


@pytest.mark.slow
@pytest.mark.parametrize("end", ["exit without close", "killed"])
def test_no_worker_outlives_its_driver(checkpoints, tmp_path, end):
    directory, _ = checkpoints["llama"]
    script = tmp_path / "driver.py"
    script.write_text(textwrap.dedent(DRIVER))
    driver = subprocess.Popen(
        [sys.executable, str(script), str(directory), "hang" if end == "killed" else "exit"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert driver.stdout is not None
    pid = int(driver.stdout.readline().split()[1])
    if end == "killed":
        time.sleep(1)
        driver.kill()
    driver.wait(timeout=60)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
        time.sleep(0.2)
    assert not _alive(pid), f"worker {pid} outlived its driver ({end})"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow
def test_torchrun_launches_pagedllm_generate_on_two_ranks(checkpoints, tmp_path):
    directory, _ = checkpoints["llama"]
    torchrun = Path(sys.executable).with_name("torchrun")
    pagedllm = Path(sys.executable).with_name("pagedllm")
    requests = tmp_path / "requests.jsonl"
    requests.write_text('{"prompt_token_ids": [5, 6, 7]}\n')
    cmd = [str(torchrun), "--standalone", "--nproc-per-node=2", str(pagedllm), "generate", "--model", str(directory)]
    cmd += ["-tp", "2", "--threads", "1", "--max-tokens", "6", "--temperature", "0", "--input", str(requests)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr[-2000:]
    llm = LLM(str(directory), threads=1)
    expected = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6, temperature=0))[0].token_ids
    results = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert [r["token_ids"] for r in results] == [expected]  # rank 0 alone writes the results


# ---- the server ------------------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp-serve") / "tiny-qwen2.gguf"
    save_tiny_gguf("qwen2", path)
    return path


@pytest.mark.slow
def test_the_server_streams_a_split_model_and_leaves_no_rank_behind(tiny_gguf):
    from server_process import ServerProcess

    prompt = [5, 6, 7, 8]
    llm = LLM(str(tiny_gguf), threads=1)
    expected = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].text
    server = ServerProcess("--model", str(tiny_gguf), "-tp", "2", "--threads", "1")
    try:
        engine = server.engine_pid()
        assert engine is not None
        worker = _children(engine)[0]
        body = {"model": "tiny-qwen2", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        body["stream"] = True
        text = ""
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += json.loads(line[6:])["choices"][0]["text"]
        assert text == expected
    finally:
        status = server.stop()
    assert status == 0
    for pid in (engine, worker):
        deadline = time.monotonic() + 15
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(pid), f"process {pid} outlived the server"


@pytest.mark.slow
def test_a_worker_that_dies_ends_the_server_with_status_1(tiny_gguf):
    from server_process import ServerProcess

    server = ServerProcess("--model", str(tiny_gguf), "-tp", "2", "--threads", "1")
    try:
        engine = server.engine_pid()
        assert engine is not None
        os.kill(_children(engine)[0], signal.SIGKILL)
        body = {"model": "tiny-qwen2", "prompt": [5, 6, 7], "max_tokens": 8}
        response = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert response.status_code >= 500, response.text
        assert "rank 1 has exited" in response.text or "a rank of 2 stopped answering" in response.text, response.text
        assert server.proc.wait(60) == 1
    finally:
        server.stop()


# ---- out of memory -----------------------------------------------------------------------------

# Run in the worker (a sitecustomize module): its MLP runs out of memory once, in a step of more
# than 8 tokens, part-way through the forward pass.
WORKER_OOM = """
import pagedllm.kinds.dense_mlp.forward as mlp
forward, failed = mlp.MLP.forward, []
def failing_once(self, x):
    if x.shape[0] > 8 and not failed:
        failed.append(1)
        raise MemoryError("planted")
    return forward(self, x)
mlp.MLP.forward = failing_once
"""


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_out_of_memory_fails_the_step_on_every_rank_and_the_retry_matches(
    checkpoints, tmp_path, monkeypatch, rank
):
    directory, _ = checkpoints["llama"]
    prompts = [list(range(3, 40)), list(range(50, 70))]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    whole = LLM(str(directory), threads=1).generate(prompts, params)
    if rank == 1:
        (tmp_path / "sitecustomize.py").write_text(WORKER_OOM)
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    llm = LLM(str(directory), tensor_parallel_size=2, threads=1, max_batch_tokens=64)
    try:
        if rank == 0:
            mlp = llm.engine.loaded.model.model.layers[1].mlp
            forward, failed = mlp.forward, []

            def failing_once(x):
                if x.shape[0] > 8 and not failed:
                    failed.append(1)
                    raise torch.OutOfMemoryError("planted")
                return forward(x)

            monkeypatch.setattr(mlp, "forward", failing_once)
        split = llm.generate(prompts, params)
        assert llm.engine.stats.oom_recoveries == 1
        assert [o.token_ids for o in split] == [o.token_ids for o in whole]
    finally:
        llm.close()


@pytest.mark.slow
def test_torchrun_launches_pagedllm_serve_rank_0_serves_rank_1_headless(checkpoints, tmp_path):
    directory, _ = checkpoints["llama"]
    port_file = tmp_path / "port"
    torchrun = Path(sys.executable).with_name("torchrun")
    pagedllm = Path(sys.executable).with_name("pagedllm")
    cmd = [str(torchrun), "--standalone", "--nproc-per-node=2", str(pagedllm), "serve", "--model", str(directory)]
    cmd += ["-tp", "2", "--threads", "1", "--port", "0", "--port-file", str(port_file)]
    launcher = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (port_file.exists() and port_file.read_text().endswith("\n")) and time.monotonic() < deadline:
            time.sleep(0.2)
        url = f"http://127.0.0.1:{int(port_file.read_text())}"
        for _ in range(100):  # until the server answers
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        body = {"model": directory.name, "prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0}
        served = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
        assert served["usage"]["completion_tokens"] == 6
        # rank 0 is a server with its engine process; rank 1 steps in its own process, no server, no child
        assert sorted(len(_children(rank)) for rank in _children(launcher.pid)) == [0, 1]
    finally:
        ranks = _children(launcher.pid)
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(60)
    for pid in ranks:
        deadline = time.monotonic() + 15
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(pid), f"rank process {pid} outlived torchrun"
