"""The budget changes while the engine runs (``LLM.set_memory``): shrinking loses no request and
changes no output (the newest requests are preempted and recomputed, live blocks past the new end
are moved down with their prefix-cache registrations and their sharers), the freed pages go back
to the OS (the process's resident memory falls under the new budget, measured), growing back
restores the cache, and a budget that cannot fit is refused without changing anything."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch
from test_memory_planner import over_baseline

from pagedllm import LLM, SamplingParams
from pagedllm.engine.block_manager import BlockManager
from pagedllm.engine_config import ConfigError
from pagedllm.errors import CacheDoesNotFitError

MiB = 1024**2

pytestmark = pytest.mark.serial  # resident memory given back, budgets over this process and the free memory


def test_shrinking_the_block_manager_moves_live_blocks_with_their_sharers_and_registrations():
    bm = BlockManager(16, 4)
    for seq in range(4):  # 4 sequences of 3 blocks each: blocks 0-11
        bm.prepare_write(seq, 0, 12)
        bm.register_computed(seq, lambda a, b, s=seq: [s * 100 + t for t in range(a, b)], 12)
    bm.fork(3, 9)  # sequence 9 shares sequence 3's blocks
    bm.free(0)  # its blocks stay cached (registered, unused)
    bm.free(1)
    content = {b: f"kv{b}" for b in range(16)}  # what each block holds, moved as the caller would
    before = {seq: [content[b] for b in bm.table(seq)] for seq in (2, 3, 9)}
    moves = bm.resize(7)  # 3 x 2 live blocks (3 and 9 share), 6 + cached ones past the end
    for source, destination in moves:
        assert source >= 7 > destination
        content[destination] = content[source]
    bm.check_invariants()
    assert bm.num_blocks == 7 and all(b < 7 for t in bm.tables.values() for b in t)
    assert {seq: [content[b] for b in bm.table(seq)] for seq in (2, 3, 9)} == before
    assert bm.table(3) == bm.table(9) and all(bm.ref_counts[b] == 2 for b in bm.table(3))
    # sequence 2's prefix is still found in the cache, at its new blocks
    assert bm.adopt_prefix(50, [200 + t for t in range(13)]) == 12
    assert bm.table(50) == bm.table(2)
    with pytest.raises(RuntimeError, match="in use"):
        bm.resize(3)
    assert bm.resize(20) == [] and bm.num_free == 20 - bm.num_used
    bm.check_invariants()


@pytest.mark.parametrize("keep", [True, False])
def test_an_idle_block_manager_compacts_its_prefix_cache_to_the_bottom_or_forgets_it(keep):
    bm = BlockManager(12, 4)
    chain = {s: [s * 100 + t for t in range(13)] for s in range(3)}  # 3 full blocks (+1 token) each
    for seq in range(3):  # sequence s: blocks 3s .. 3s+2
        bm.prepare_write(seq, 0, 12)
        bm.register_computed(seq, lambda a, b, s=seq: chain[s][a:b], 12)
    for seq in range(3):
        bm.free(seq)
    bm.prepare_write(90, 0, 24)  # takes the 3 plain free blocks, then evicts sequence 0's chain
    with pytest.raises(RuntimeError, match="hold blocks"):
        bm.compact(keep)
    bm.free(90)  # now: blocks 0-2 and 9-11 plainly free, 3-8 cached (sequences 1 and 2)
    content = {b: f"kv{b}" for b in range(12)}
    expected = {1: ["kv3", "kv4", "kv5"], 2: ["kv6", "kv7", "kv8"]}
    moves, end = bm.compact(keep)
    for source, destination in moves:  # the caller's copies
        assert source >= end > destination
        content[destination] = content[source]
    bm.check_invariants()
    assert bm.num_free == 12 and bm.num_cached_free == end == (6 if keep else 0)
    assert bm.adopt_prefix(50, chain[0]) == 0  # evicted before: gone either way
    for s in (1, 2):
        assert bm.adopt_prefix(50 + s, chain[s]) == (12 if keep else 0)
        assert all(b < end for b in bm.table(50 + s))
        assert [content[b] for b in bm.table(50 + s)] == (expected[s] if keep else [])
    bm.prepare_write(70, 0, 4)
    assert bm.table(70) == [end]  # the lowest free block is handed out first
    bm.check_invariants()


GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def prompts(vocab: int, n: int = 32) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(1, vocab, (20,), generator=g).tolist()
    return [prefix + torch.randint(1, vocab, (5 + 3 * i,), generator=g).tolist() for i in range(n)]


def run(llm: LLM, batch, params, shrink_after: int | None = None):
    """``batch`` through the engine; after ``shrink_after`` steps, ``set_memory`` to a budget
    whose cache holds half the blocks in use then (so some requests must be preempted)."""
    engine = llm.engine
    ids = [engine.add_request(p, q) for p, q in zip(batch, params)]
    outs, steps = {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outs.setdefault(out.request_id, {})[out.index] = out.token_ids
        steps += 1
        if steps == shrink_after:
            preempted, first = engine.stats.preemptions, engine.blocks.num_blocks
            plan = llm.set_memory(_budget_for(llm, max(40, engine.blocks.num_used // 2)))
            engine.check_invariants()
            assert plan.num_blocks < first and engine.blocks.num_blocks == plan.num_blocks
            assert engine.stats.preemptions > preempted, "the shrink must preempt something"
    return [outs[i] for i in ids]


@pytest.mark.parametrize("arch, kv", [("llama", None), ("llama", "int8"), ("gemma3", None)])
def test_shrinking_under_load_loses_nothing_and_changes_no_output(tiny_checkpoints, arch, kv):
    """(Gemma 3: its sliding layers' pool shrinks and grows with the full layers'.)"""
    directory, _ = tiny_checkpoints[arch]
    budget = over_baseline(300)  # memory= bounds the whole (test) process, which is large
    options = dict(memory=budget, block_size=4, max_num_seqs=32, max_model_len=160, kv_cache_dtype=kv)
    batch = prompts(320)
    params = [GREEDY] * 30 + [SamplingParams(max_tokens=24, temperature=0.8, seed=3, n=2, ignore_eos=True)] * 2
    fixed = run(LLM(str(directory), **options), batch, params)

    llm = LLM(str(directory), **options)
    engine = llm.engine
    first = engine.blocks.num_blocks
    assert run(llm, batch, params) == fixed  # warm, with prefix-cache hits from this first run
    assert run(llm, batch, params, shrink_after=6) == fixed
    assert engine.blocks.num_free == engine.blocks.num_blocks  # nothing leaked
    llm.set_memory(budget)
    assert engine.blocks.num_blocks == first
    assert run(llm, batch, params) == fixed
    wide = [p[:40] for p in prompts(320, 64)]  # grown back, the cache serves a batch twice as wide
    assert all(len(out[0]) == 24 for out in run(llm, wide, [GREEDY] * 64))
    engine.check_invariants()


def test_a_grown_budget_admits_into_its_new_blocks_once_it_has_held(tiny_checkpoints, monkeypatch):
    """Growing: running requests may use the new blocks at once, new admissions only after the
    budget has held for GROW_SETTLE_S (an oscillating budget would preempt what they computed)."""
    from pagedllm.engine import elastic

    directory, _ = tiny_checkpoints["llama"]
    budget = over_baseline(300)
    llm = LLM(str(directory), memory=budget, block_size=4, max_num_seqs=64, max_model_len=192)
    engine = llm.engine
    small = llm.set_memory(_budget_for(llm, 40)).num_blocks
    monkeypatch.setattr(elastic, "GROW_SETTLE_S", 1.0)
    llm.set_memory(budget)
    assert engine.blocks.num_blocks > 2 * small
    for p in prompts(320, 48):
        engine.add_request(p, GREEDY)
    engine.step()
    assert 0 < engine.blocks.num_used <= small, "admitted past the old cache before the budget held"
    time.sleep(1.1)
    engine.step()
    assert engine.blocks.num_used > small, "the grown budget never opened to new admissions"
    while engine.has_unfinished():
        engine.step()
    engine.check_invariants()


def _budget_for(llm: LLM, blocks: int) -> int:
    """The budget whose plan has about ``blocks`` cache blocks (the planner's own arithmetic)."""
    plan = llm.memory_plan
    return plan.budget_bytes - (plan.num_blocks - blocks) * plan.kv_bytes_per_block


def test_a_budget_that_cannot_fit_is_refused_and_changes_nothing(tiny_checkpoints):
    directory, _ = tiny_checkpoints["llama"]
    llm = LLM(str(directory), memory=over_baseline(300))
    before = (llm.memory_plan, llm.engine.blocks.num_blocks)
    with pytest.raises(CacheDoesNotFitError):
        llm.set_memory("100MiB")  # less than the interpreter alone
    assert (llm.memory_plan, llm.engine.blocks.num_blocks) == before
    assert llm.generate([[1, 2, 3]], GREEDY)[0].token_ids


RSS_RUN = r"""
import json, sys
from pagedllm import LLM, SamplingParams
from pagedllm.memory.machine import resident_bytes
llm = LLM(sys.argv[1], memory="800MiB", block_size=16, max_model_len=256)
full = resident_bytes()[0]
outs = llm.generate([[(7 * i + j) % 300 + 5 for j in range(200)] for i in range(40)],
                    SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
plan = llm.set_memory("500MiB")
after = resident_bytes()[0]
more = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
print(json.dumps({"full": full, "after": after, "blocks": plan.num_blocks, "ok": bool(more[0].token_ids)}))
"""


def test_shrinking_gives_the_pages_back_resident_memory_falls_under_the_new_budget(tiny_checkpoints):
    directory, _ = tiny_checkpoints["qwen3"]
    out = subprocess.run([sys.executable, "-c", RSS_RUN, str(directory)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"resident {r['full'] / MiB:.0f} MiB at 800 MiB, {r['after'] / MiB:.0f} MiB after set_memory(500MiB)")
    assert r["full"] > 500 * MiB, "the cache must hold more than the new budget allows before the shrink"
    assert r["after"] <= 500 * MiB and r["ok"]


IDLE_RUN = r"""
import json, sys
from pagedllm.memory.machine import resident_bytes
from pagedllm import LLM, SamplingParams
interpreter = resident_bytes()[0]  # pagedllm and torch imported, no model
llm = LLM(sys.argv[1], memory="800MiB", block_size=16, max_model_len=256)
prompts = [[(7 * i + j) % 300 + 5 for j in range(200)] for i in range(40)]
params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
first = [o.token_ids for o in llm.generate(prompts, params)]
busy = resident_bytes()[0]
llm.engine.release_idle_memory(keep_prefix_cache=sys.argv[2] == "keep")
idle = resident_bytes()[0]
hits = llm.engine.stats.prefix_cache_hit_tokens
again = [o.token_ids for o in llm.generate(prompts, params)]
plan = llm.memory_plan
print(json.dumps(dict(interpreter=interpreter, busy=busy, idle=idle, weights=plan.weights_bytes,
  cache=plan.kv_cache_bytes, per_block=plan.kv_bytes_per_block, same=again == first,
  hits=llm.engine.stats.prefix_cache_hit_tokens - hits)))
"""


@pytest.mark.parametrize("keep", ["keep", "drop"])
def test_an_idle_engine_gives_its_free_cache_pages_back_and_serves_the_same_after(tiny_checkpoints, keep):
    directory, _ = tiny_checkpoints["qwen3"]
    out = subprocess.run(
        [sys.executable, "-c", IDLE_RUN, str(directory), keep], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    print({k: f"{v / MiB:.0f} MiB" if isinstance(v, int) and v > MiB else v for k, v in r.items()})
    assert r["same"], "the outputs after the release differ"
    full_blocks = 40 * (199 // 16)  # each prompt's full blocks, computed once and cached
    kept = full_blocks * r["per_block"] if keep == "keep" else 0
    assert r["hits"] == (full_blocks * 16 if keep == "keep" else 0)
    # the target: an idle engine holds the interpreter, its weights and at most 10% of its cache
    # (besides the prefix cache it was asked to keep)
    assert r["idle"] <= r["interpreter"] + r["weights"] + kept + 0.1 * r["cache"]
    assert r["busy"] - r["idle"] >= 0.8 * (r["cache"] - kept)


@pytest.mark.slow
def test_the_server_changes_its_budget_behind_the_api_key(tiny_checkpoints):
    import httpx
    from server_process import ServerProcess, parse_metrics

    directory, _ = tiny_checkpoints["llama"]
    server = ServerProcess(
        "--model", str(directory), "--memory", "800MiB", "--api-key", "k3y", "--idle-release-after", "2"
    )  # fmt: skip
    key = {"Authorization": "Bearer k3y"}
    try:
        assert httpx.get(server.url + "/v1/memory", timeout=10).status_code == 401
        assert httpx.post(server.url + "/v1/memory", json={"memory": "600MiB"}, timeout=10).status_code == 401
        before = httpx.get(server.url + "/v1/memory", headers=key, timeout=10).json()
        refused = httpx.post(server.url + "/v1/memory", json={"memory": "100MiB"}, headers=key, timeout=30)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "memory"
        assert httpx.get(server.url + "/v1/memory", headers=key, timeout=10).json() == before
        target = before["num_blocks"] // 2
        budget = before["budget_bytes"] - (before["num_blocks"] - target) * before["kv_bytes_per_block"]
        moved = httpx.post(server.url + "/v1/memory", json={"memory": budget}, headers=key, timeout=60)
        assert moved.status_code == 200, moved.text
        after = moved.json()
        assert after["budget_bytes"] == budget and after["num_blocks"] < before["num_blocks"]
        assert httpx.get(server.url + "/v1/memory", headers=key, timeout=10).json() == after
        body = {"model": directory.name, "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}
        assert httpx.post(server.url + "/v1/completions", json=body, headers=key, timeout=60).status_code == 200
        metrics = parse_metrics(httpx.get(server.url + "/metrics", headers=key, timeout=10).text)
        assert metrics["pagedllm_memory_resizes_total"] == 1
        assert metrics["pagedllm_memory_budget_bytes"] == budget
        assert metrics["pagedllm_kv_blocks_total"] == after["num_blocks"]
        pids = [server.pid, server.engine_pid()]
        busy = sum(rss(p) for p in pids)
        assert metrics["pagedllm_resident_bytes"] == pytest.approx(sum(rss(p) for p in pids), rel=0.05)
        assert f"memory budget 800 -> {budget / MiB:.0f} MiB" in server.log_tail(200)  # each resize logged
        both = httpx.post(server.url + "/v1/memory", json={"memory": budget, "memory_fraction": 0.5}, headers=key)
        assert both.status_code == 400
        # idle for 2 s: the cache's free pages go back to the OS
        deadline = time.monotonic() + 30
        while metrics["pagedllm_idle_releases_total"] < 1 and time.monotonic() < deadline:
            time.sleep(0.5)
            metrics = parse_metrics(httpx.get(server.url + "/metrics", headers=key, timeout=10).text)
        assert metrics["pagedllm_idle_releases_total"] == 1
        released = sum(rss(p) for p in pids)
        assert released <= metrics["pagedllm_resident_bytes"] + MiB
        assert released <= busy - 0.8 * after["kv_cache_bytes"]
    finally:
        server.stop()


def rss(pid: int) -> int:
    """VmRSS of ``pid`` in bytes, read here (the oracle for the server's gauge)."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def test_a_fraction_budget_is_that_share_of_the_free_memory_and_what_the_engine_holds(tiny_checkpoints, monkeypatch):
    from pagedllm.memory import budget as budget_module
    from pagedllm.memory.machine import resident_bytes

    directory, _ = tiny_checkpoints["llama"]
    llm = LLM(str(directory), memory=over_baseline(300))
    held = resident_bytes()[0]
    free = held + 400 * MiB  # what the machine has free, as the test says: half of free + held is held + 200 MiB
    monkeypatch.setattr(budget_module, "free_memory", lambda device="cpu": (free, "the test"))
    plan = llm.set_memory(memory_fraction=0.5)
    assert plan.budget_bytes == pytest.approx((free + held) / 2, abs=8 * MiB)
    assert plan.num_blocks == llm.engine.blocks.num_blocks
    with pytest.raises(ConfigError):
        llm.set_memory("500MiB", memory_fraction=0.5)
    with pytest.raises(ConfigError):
        llm.set_memory(memory_fraction=1.5)


# ---- memory="follow" ---------------------------------------------------------------------------


def test_the_machine_watch_reads_cgroup_v2_v1_and_pressure(tmp_path):
    from pagedllm.memory.follow import MachineWatch

    watch = MachineWatch(tmp_path, tmp_path / "pressure", margin=0.05, interval_s=0)
    assert watch.limit() is None and watch.pressure() is None
    assert watch.budget(100, host_memory=1000) == (950, "0.95 x host memory")
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1: no limit
    assert watch.limit() is None
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text("4000\n")
    assert watch.limit() == (4000, "cgroup v1 memory.limit_in_bytes")
    (tmp_path / "memory.max").write_text("max\n")  # v2 wins over v1; "max" is no limit
    (tmp_path / "memory.high").write_text("3000\n")
    assert watch.limit() == (3000, "cgroup v2 memory.high")
    (tmp_path / "memory.max").write_text("2000\n")
    assert watch.limit() == (2000, "cgroup v2 memory.max")
    (tmp_path / "pressure").write_text(
        "some avg10=12.50 avg60=3.00 avg300=1.00 total=123456\nfull avg10=4.00 avg60=1.00 avg300=0.00 total=1\n"
    )
    assert watch.pressure() == 12.5
    assert watch.budget(1000, host_memory=10**9) == (900, "memory pressure 12.5%: 0.9 x resident")
    assert watch.budget(5000, host_memory=10**9) == (1900, "0.95 x cgroup v2 memory.max")  # holds more: the limit


def test_an_engine_following_the_machine_moves_with_the_container_limit(tiny_checkpoints, tmp_path, monkeypatch):
    directory, _ = tiny_checkpoints["llama"]
    monkeypatch.setenv("PAGEDLLM_CGROUP_ROOT", str(tmp_path))
    monkeypatch.setenv("PAGEDLLM_PSI_PATH", str(tmp_path / "pressure"))
    monkeypatch.setenv("PAGEDLLM_FOLLOW_INTERVAL", "0")
    high, low = over_baseline(500), over_baseline(300)  # container limits above this (large) process
    (tmp_path / "memory.max").write_text(str(high))
    (tmp_path / "pressure").write_text("some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
    llm = LLM(str(directory), memory="follow", max_model_len=128)
    first = llm.memory_plan
    assert first.budget_bytes == int(high * 0.95) and "cgroup v2 memory.max" in first.budget_source
    (tmp_path / "memory.max").write_text(str(low))
    out = llm.generate([[5, 6, 7]], GREEDY)[0]
    shrunk = llm.engine.memory_plan
    assert shrunk.budget_bytes == int(low * 0.95) and shrunk.num_blocks < first.num_blocks
    assert llm.engine.blocks.num_blocks == shrunk.num_blocks
    (tmp_path / "memory.max").write_text(str(low + MiB))  # within 1%: no move
    llm.generate([[5, 6, 7]], GREEDY)
    assert llm.engine.memory_plan is shrunk
    (tmp_path / "memory.max").write_text(str(high))
    assert llm.generate([[5, 6, 7]], GREEDY)[0].token_ids == out.token_ids
    assert llm.engine.blocks.num_blocks == first.num_blocks
