"""Several models behind one server under one budget (``pagedllm serve --model NAME=PATH ...``,
``server/fleet``): requests routed by ``model``, models loaded on demand and unloaded to make
room, the whole process tree under ``--memory``, a model that cannot fit refused at start, a
missing file an error for its model only, SIGTERM draining everything."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from server_process import ServerProcess, tree_rss

from pagedllm.cli import _fleet_models
from pagedllm.engine_config import ConfigError
from pagedllm.loading import default_gguf_path
from pagedllm.server.fleet.models import parse_specs
from pagedllm.sizes import parse_memory

# Two copies of the default model (0.75 GiB needed each, as its planner says) cannot be resident
# together in 1.1 GiB with the front's own memory: every switch unloads one.
BUDGET = "1.1GiB"
GREEDY = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}


class PeakSampler(threading.Thread):
    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.peak, self.done = pid, 0, threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            self.peak = max(self.peak, tree_rss(self.pid))
            time.sleep(0.02)


def complete(url: str, model: str, prompt: str = "The capital of France is") -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": model, "prompt": prompt, **GREEDY}, timeout=300)


@pytest.mark.serial  # peak resident memory of the process tree against the budget: measured alone
def test_two_models_take_turns_under_one_budget_and_sigterm_drains_them(tmp_path):
    second = tmp_path / "b.gguf"
    second.symlink_to(default_gguf_path())  # a second name: its own model, one conversion (the first's)
    server = ServerProcess(
        "--model", f"a={default_gguf_path()}", "--model", f"b={second}", "--memory", BUDGET, "--max-model-len", "512"
    )
    sampler = PeakSampler(server.pid)
    sampler.start()
    try:
        listed = httpx.get(server.url + "/v1/models").json()["data"]
        assert [(m["id"], m["state"]) for m in listed] == [("a", "on disk"), ("b", "on disk")]
        assert 2 * listed[0]["need_bytes"] > parse_memory(BUDGET) - 48 * 2**20, "the two must not fit together"
        answers = [complete(server.url, m) for m in ("a", "b", "a", "b")]
        assert [r.status_code for r in answers] == [200] * 4, answers[-1].text
        texts = [r.json()["choices"][0]["text"] for r in answers]
        assert texts[0] == texts[2] and texts[1] == texts[3], "a model's answer must not change with the switching"
        assert texts[0] == texts[1], "the two copies of one model answer alike"
        listed = {m["id"]: m for m in httpx.get(server.url + "/v1/models").json()["data"]}
        assert listed["a"]["loads"] == 2 and listed["b"]["loads"] == 2
        assert (listed["a"]["state"], listed["b"]["state"]) == ("on disk", "resident")
        assert listed["a"]["last_switch_seconds"] > 0
        # the promise as arithmetic: the front's own peak plus every resident model's budget
        front_peak = next(int(line.split()[1]) * 1024 for line in open(f"/proc/{server.pid}/status") if "VmHWM" in line)
        assert front_peak + sum(m["share_bytes"] for m in listed.values()) <= parse_memory(BUDGET)
        assert server.metric("pagedllm_fleet_unloads_total") == 3

        missing = httpx.post(server.url + "/v1/completions", json={"model": "nope", "prompt": "x"}, timeout=30)
        assert missing.status_code == 404 and "nope" in missing.json()["error"]["message"]
        unnamed = httpx.post(server.url + "/v1/completions", json={"prompt": "x"}, timeout=30)
        assert unnamed.status_code == 400 and "'a', 'b'" in unnamed.json()["error"]["message"]

        stream = threading.Thread(target=lambda: results.append(complete(server.url, "b", "Once upon a time")))
        results: list[httpx.Response] = []
        stream.start()
        time.sleep(0.3)
        assert server.stop(timeout=90, keep_log=True) == 0, server.log_tail()
        stream.join(60)
        assert results and results[0].status_code == 200, "the request in flight finishes before the server exits"
    finally:
        sampler.done.set()
        sampler.join()
        server.stop()
    assert 0 < sampler.peak <= parse_memory(BUDGET), f"peak {sampler.peak / 2**20:.0f} MiB over {BUDGET}"
    assert not [p for p in os.listdir("/proc") if p.isdigit() and _is_fleet_child(int(p), second)]


def _is_fleet_child(pid: int, path: Path) -> bool:
    try:
        return str(path) in open(f"/proc/{pid}/cmdline").read()
    except OSError:
        return False


def test_an_idle_model_is_unloaded_and_a_file_gone_fails_that_model_only(tmp_path):
    """``--keep-alive``: a model idle that long is unloaded; a model file deleted while its model
    is unloaded: a 503 naming it, and the other model serves on."""
    second = tmp_path / "b.gguf"
    second.symlink_to(default_gguf_path())  # a second name: its own model, one conversion (the first's)
    server = ServerProcess(
        "--model", f"a={default_gguf_path()}", "--model", f"b={second}", "--memory", BUDGET, "--keep-alive", "1"
    )
    try:
        assert complete(server.url, "a").status_code == 200
        time.sleep(3)
        assert {m["id"]: m["state"] for m in httpx.get(server.url + "/v1/models").json()["data"]}["a"] == "on disk"
        second.unlink()
        gone = complete(server.url, "b")
        assert gone.status_code == 503 and "'b'" in gone.json()["error"]["message"], gone.text
        again = complete(server.url, "a")
        assert again.status_code == 200, again.text
    finally:
        server.stop()


def test_a_pinned_model_stays_and_a_model_with_no_room_left_is_a_503(tmp_path):
    """``--pin a``: loaded at start, never unloaded; b, which fits only without a, is refused
    with the reason, and a keeps serving."""
    second = tmp_path / "b.gguf"
    second.symlink_to(default_gguf_path())  # a second name: its own model, one conversion (the first's)
    server = ServerProcess(
        "--model", f"a={default_gguf_path()}", "--model", f"b={second}", "--memory", BUDGET, "--pin", "a"
    )
    try:
        states = {m["id"]: m["state"] for m in httpx.get(server.url + "/v1/models").json()["data"]}
        assert states == {"a": "resident", "b": "on disk"}
        refused = complete(server.url, "b")
        assert refused.status_code == 503 and "pinned" in refused.json()["error"]["message"], refused.text
        assert complete(server.url, "a").status_code == 200
    finally:
        server.stop()


def test_a_resident_model_is_shrunk_to_its_need_where_that_makes_room(tmp_path):
    """Under a budget that holds both only if the first gives up its spare cache: b's load
    shrinks a (its server's own plan then says so), nothing is unloaded, both answer."""
    second = tmp_path / "b.gguf"
    second.symlink_to(default_gguf_path())  # a second name: its own model, one conversion (the first's)
    server = ServerProcess(
        "--model", f"a={default_gguf_path()}", "--model", f"b={second}", "--memory", "1.9GiB", "--max-model-len", "512"
    )
    try:
        assert complete(server.url, "a").status_code == 200
        first = {m["id"]: m for m in httpx.get(server.url + "/v1/models").json()["data"]}
        assert first["a"]["share_bytes"] > first["a"]["need_bytes"], "alone, a takes what is free"
        assert complete(server.url, "b").status_code == 200
        listed = {m["id"]: m for m in httpx.get(server.url + "/v1/models").json()["data"]}
        assert (listed["a"]["state"], listed["b"]["state"]) == ("resident", "resident")
        assert listed["a"]["share_bytes"] == listed["a"]["need_bytes"]
        assert server.metric("pagedllm_fleet_unloads_total") == 0
        plan_a = httpx.get(server.url + "/v1/plan?model=a", timeout=60).json()
        assert plan_a["budget_bytes"] == listed["a"]["need_bytes"], "a's server runs under the shrunk budget"
        assert (
            complete(server.url, "a").json()["choices"][0]["text"]
            == complete(server.url, "b").json()["choices"][0]["text"]
        )
    finally:
        server.stop()


def test_a_model_that_cannot_fit_even_alone_is_refused_at_start_with_the_planners_reason(tmp_path):
    second = tmp_path / "b.gguf"
    second.symlink_to(default_gguf_path())  # a second name: its own model, one conversion (the first's)
    launch = "import sys\nfrom pagedllm.cli import main\nsys.exit(main(sys.argv[1:]))"
    done = subprocess.run(
        [sys.executable, "-c", launch, "serve", "--model", f"a={default_gguf_path()}", "--model", f"b={second}"]
        + ["--memory", "500MiB", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 3, done.stderr
    assert "model 'a' does not fit" in done.stderr and "smallest memory that fits" in done.stderr


def test_several_models_are_named_by_their_flags_or_their_files(tmp_path):
    (tmp_path / "m1").mkdir()
    (tmp_path / "m1" / "config.json").write_text("{}")
    (tmp_path / "coder.gguf").write_bytes(b"")
    (tmp_path / "notes.txt").write_text("")
    specs = parse_specs([f"chat={tmp_path / 'm1'}"], str(tmp_path))
    assert [(s.name, Path(s.path).name) for s in specs] == [("chat", "m1"), ("coder", "coder.gguf"), ("m1", "m1")]
    with pytest.raises(ConfigError, match="share a name"):
        parse_specs([f"x={tmp_path / 'm1'}", f"x={tmp_path / 'coder.gguf'}"], None)
    with pytest.raises(ConfigError, match="does not exist"):
        parse_specs([f"x={tmp_path / 'gone'}"], None)
    # one --model PATH stays the single-model server; NAME=PATH or several make a fleet
    assert _fleet_models(["serve", "--model", str(tmp_path / "m1")]) == ([], ["serve", "--model", str(tmp_path / "m1")])
    models, rest = _fleet_models(["serve", "--model", "a=x", "--port", "0", "--model=b=y"])
    assert models == ["a=x", "b=y"] and rest == ["serve", "--port", "0"]


def test_two_models_waiters_cannot_evict_each_other_in_turn(monkeypatch):
    """A hand-built worst case, on a fleet whose servers are stand-ins: a request for b makes b
    load (a unloaded), and a request for a arrives meanwhile. b's request must be served by the
    server just loaded for it (counted in flight before a's load may choose b to unload); a
    loads once b's request is done. Before: each load's waiter lost its model to the other's
    load, and the page's two models were loaded in turn for ever."""
    import asyncio

    from pagedllm.server.fleet import fleet as fleet_module
    from pagedllm.server.fleet.fleet import Entry, Fleet, Resident
    from pagedllm.server.fleet.models import ModelSpec
    from pagedllm.server.fleet.planning import ModelPlan

    loads: list[str] = []

    class StandIns(Fleet):
        async def _start(self, entry, share, deadline):
            loads.append(entry.spec.name)
            await asyncio.sleep(0.01)
            return Resident(proc=None, url="", share=share, log_path="")  # type: ignore[arg-type]

    monkeypatch.setattr(fleet_module, "_stop", lambda proc, timeout: None)
    plan = ModelPlan(need_bytes=600, full_bytes=900, weights_bytes=100, max_model_len=512)
    entries = [Entry(ModelSpec(n, n), plan) for n in ("a", "b")]

    async def scenario() -> None:
        fleet = StandIns(entries, budget=1000, reserve=100, child_flags=[])  # room for one
        fleet.release(await fleet.acquire("a"))
        for_b = asyncio.create_task(fleet.acquire("b"))
        await asyncio.sleep(0)
        for_a = asyncio.create_task(fleet.acquire("a"))
        served_b = await asyncio.wait_for(for_b, 5)
        assert served_b is fleet.entries["b"].resident and served_b.in_flight == 1 and loads == ["a", "b"]
        await asyncio.sleep(0.05)
        assert not for_a.done(), "a waits for b's request to finish"
        fleet.release(served_b)
        fleet.release(await asyncio.wait_for(for_a, 5))
        assert loads == ["a", "b", "a"] and fleet.unloads == 2

    asyncio.run(scenario())


def test_stopping_the_fleet_ends_a_server_still_loading():
    """A server whose model is still loading when the fleet stops (SIGTERM to the front while a
    request waits for a load) is ended with the rest, not left behind."""
    import asyncio

    from pagedllm.server.fleet.fleet import Entry, Fleet
    from pagedllm.server.fleet.models import ModelSpec
    from pagedllm.server.fleet.planning import ModelPlan

    plan = ModelPlan(need_bytes=600, full_bytes=900, weights_bytes=100, max_model_len=512)
    fleet = Fleet([Entry(ModelSpec("a", "a"), plan)], budget=1000, reserve=100, child_flags=[], shutdown_timeout=1)

    async def scenario() -> subprocess.Popen:
        async def never_healthy(entry, share, deadline):  # a server that takes for ever to load
            fleet._spawned.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
            await asyncio.sleep(60)

        fleet._start = never_healthy  # type: ignore[method-assign]
        waiting = asyncio.create_task(fleet.acquire("a"))
        while not fleet._spawned:
            await asyncio.sleep(0.01)
        await fleet.stop_all()
        waiting.cancel()
        return fleet._spawned[0]

    loading = asyncio.run(scenario())
    assert loading.poll() is not None, "the loading server must be ended"
