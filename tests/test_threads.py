"""Threads: one per physical core by default, worker threads pinned; fewer and unpinned while
other processes keep the cores busy (a step's parallel regions all wait for a descheduled
thread), back when they stop."""

import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from pagedllm import backends
from pagedllm.backends.cpu.threads import CHECK_INTERVAL_S, allowed_cpus, physical_cores

pytestmark = pytest.mark.serial  # threads, pinning and load: the machine's cores, alone


def test_default_is_one_thread_per_physical_core_and_the_callers_thread_stays_free():
    backend = backends.get()
    governor = backend.thread_policy()
    assert governor.threads == torch.get_num_threads() == len(physical_cores(allowed_cpus()))
    assert governor.pinned == (backend.name == "cpu-compiled")  # pinning is the compiled kernels' op
    with governor.running():
        if governor.pinned:
            assert os.sched_getaffinity(0) == {governor.cores[0]}
    assert os.sched_getaffinity(0) == set(allowed_cpus())  # between steps: every CPU


def wait_for(governor, condition, seconds=15.0):
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(CHECK_INTERVAL_S)
        governor.after_step()
    return condition()


class InjectedLoad:
    """The host's CPU time as the governor reads it, with the share other processes keep busy
    set by the test (the real host's load, which other jobs move, never enters)."""

    def __init__(self) -> None:
        self.busy_share, self.busy, self.total = 0.0, 0.0, 0.0

    def __call__(self) -> tuple[float, float]:
        self.total += 10_000
        self.busy += 10_000 * self.busy_share
        return self.busy, self.total


def test_threads_step_down_next_to_busy_processes_and_come_back(monkeypatch):
    """With the host's load injected, and every CPU of the machine taken for a core (a box of one
    core and two hyper-threads runs it too); the thread count and the pinning follow the load."""
    from pagedllm.backends.cpu import threads as cpu_threads

    cpus = list(range(os.cpu_count() or 1))  # the machine's, not this thread's (an engine pinned it)
    if len(cpus) < 2:
        pytest.skip("one CPU: nothing to give up")
    monkeypatch.setattr(cpu_threads, "allowed_cpus", lambda: cpus)
    monkeypatch.setattr(cpu_threads, "physical_cores", lambda cpus: list(cpus))
    saved = os.sched_getaffinity(0)
    try:
        governor = backends.get().thread_policy()
        assert governor.max_threads == len(cpus)
        step_down_and_back(governor)
    finally:
        os.sched_setaffinity(0, saved)


def step_down_and_back(governor) -> None:
    governor.read_load = load = InjectedLoad()
    assert wait_for(governor, lambda: governor._last is not None)  # first reading
    assert governor.threads == governor.max_threads, "an idle host: every core"
    load.busy_share = 1.0  # others keep every CPU busy
    assert wait_for(governor, lambda: governor.threads == 1), "never stepped down"
    assert not governor.pinned and torch.get_num_threads() == governor.threads
    load.busy_share = 0.0
    assert wait_for(governor, lambda: governor.threads == governor.max_threads), "never came back"
    assert governor.pinned == governor.pin  # pinned again, where pinning is on


def test_the_hosts_cpu_time_is_read_from_proc_stat():
    from pagedllm.backends.cpu.threads import _proc_stat

    first = _proc_stat()
    busy = subprocess.Popen([sys.executable, "-c", "import time; t = time.time()\nwhile time.time() < t + 0.5: pass"])
    busy.wait()
    second = _proc_stat()
    assert first is not None and second is not None
    assert 0 <= first[0] <= first[1] and second[0] - first[0] >= 0.3 * os.sysconf("SC_CLK_TCK")  # 0.5 s busy


def _tasks() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def _allowed(tid: int) -> set[int]:
    return set(os.sched_getaffinity(tid))


def test_a_step_on_another_thread_runs_on_workers_pinned_one_per_core():
    """The server steps on its own thread, which gets its own team of OpenMP workers: they must
    be pinned one per core too, not left to inherit the step's one-core binding (then the whole
    step ran on one core)."""
    backend = backends.get()
    governor = backend.thread_policy()
    if not governor.pinned or governor.threads < 2:
        pytest.skip("pinning needs the compiled kernels and two cores")
    found: dict = {}

    def step():
        before = _tasks()
        with governor.running():
            torch.ones(1 << 22).add_(1)  # a parallel region: this thread's workers start
            found["own"] = _allowed(threading.get_native_id())
            found["workers"] = [_allowed(t) for t in _tasks() - before - {threading.get_native_id()}]

    t = threading.Thread(target=step)
    t.start()
    t.join()
    assert found["own"] == {governor.cores[0]}
    assert found["workers"] and all(w == {c} for w, c in zip(found["workers"], governor.cores[1:])), found


def test_the_server_leaves_its_threads_unpinned(tiny_checkpoints):
    """Its event loop runs beside the engine: pinned workers it preempts cannot move."""
    from fastapi.testclient import TestClient

    from pagedllm import LLM
    from pagedllm.server.app import create_app

    llm = LLM(tiny_checkpoints["llama"][0], num_blocks=16, max_model_len=64)
    with TestClient(create_app(llm)) as client:
        assert client.get("/health").status_code == 200
        assert not llm.engine.threads.pinned and not llm.engine.threads.pin


# A child process that builds an engine on the tiny llama as a user would, with every CPU
# counted as a core (a box of one core and two hyper-threads then has two to cap or pin), and
# reports what torch and the OS say of its threads: inside a step, and after a request.
THREADS_CHILD = r"""
import json, os, sys
allowed = sorted(os.sched_getaffinity(0))
import torch
from pagedllm.backends.cpu import threads as cpu_threads
cpu_threads.physical_cores = lambda cpus: list(cpus)
from pagedllm import LLM, SamplingParams
llm = LLM(sys.argv[1], backend=sys.argv[2], num_blocks=16, max_model_len=64)
after_load = torch.get_num_threads()
llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
with llm.engine.threads.running():
    torch.ones(1 << 22).add_(1)  # a parallel region: every worker of this thread's team exists
    in_step = sorted(os.sched_getaffinity(0))
tasks = {}
for tid in os.listdir("/proc/self/task"):
    with open(f"/proc/self/task/{tid}/status") as f:
        line = next(x for x in f if x.startswith("Cpus_allowed_list:"))
    tasks[tid] = line.split(":", 1)[1].strip()
print(json.dumps({"allowed": allowed, "after_load": after_load, "after_request": torch.get_num_threads(),
                  "in_step": in_step, "tasks": tasks}))
"""

THREAD_SWITCHES = ("PAGEDLLM_THREADS", "PAGEDLLM_PIN_THREADS", "PAGEDLLM_ADAPT_THREADS", "PAGEDLLM_KERNELS")


def run_threads_child(model, backend: str, **env: str) -> dict:
    """The child starts free to run on every CPU of the machine: an engine built earlier in the
    suite pins the test's thread to one core, and a child would inherit that."""
    base = {k: v for k, v in os.environ.items() if k not in THREAD_SWITCHES}
    out = subprocess.run(
        [sys.executable, "-c", THREADS_CHILD, str(model), backend],
        capture_output=True,
        text=True,
        timeout=300,
        env={**base, **env},
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        preexec_fn=lambda: os.sched_setaffinity(0, range(os.cpu_count() or 1)),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _cpu_list(text: str) -> list[int]:
    """The kernel's list format, "0-3,8": every CPU it names."""
    cpus: list[int] = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        cpus += range(int(first), int(last or first) + 1)
    return cpus


def test_PAGEDLLM_THREADS_caps_the_engines_thread_count(tiny_checkpoints):
    """Promise: "PAGEDLLM_THREADS=N caps the count". An engine built with PAGEDLLM_THREADS=1 on
    a machine of two or more CPUs (each counted a core) runs torch on one thread, read from
    torch itself, after loading and after a request."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one CPU: one thread is the default, a cap of one shows nothing")
    seen = run_threads_child(tiny_checkpoints["llama"][0], "cpu-torch", PAGEDLLM_THREADS="1")
    assert len(seen["allowed"]) >= 2
    assert seen["after_load"] == seen["after_request"] == 1, seen


def test_PAGEDLLM_PIN_THREADS_0_never_pins(tiny_checkpoints, ops):
    """Promise: "PAGEDLLM_PIN_THREADS=0 never pins". On the compiled kernels (the backend that
    pins), no thread of the process is bound to fewer CPUs than it started with: not the
    caller inside a step, not any worker after a request, as /proc shows them."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one CPU: a pinned thread and a free one look alike")
    seen = run_threads_child(
        tiny_checkpoints["llama"][0], "cpu-compiled", PAGEDLLM_PIN_THREADS="0", PAGEDLLM_ADAPT_THREADS="0"
    )
    assert seen["after_request"] == len(seen["allowed"]) >= 2, seen  # a worker per CPU, each free to pin
    assert len(seen["tasks"]) >= seen["after_request"], seen
    assert seen["in_step"] == seen["allowed"], seen
    narrowed = {tid: cpus for tid, cpus in seen["tasks"].items() if _cpu_list(cpus) != seen["allowed"]}
    assert narrowed == {}, seen


def test_PAGEDLLM_ADAPT_THREADS_0_keeps_the_count_under_load(monkeypatch):
    """Promise: "PAGEDLLM_ADAPT_THREADS=0 keeps the count fixed". Under an injected load that
    makes a governor with adaptation on step down to one thread (checked first, the same way),
    one built with PAGEDLLM_ADAPT_THREADS=0 keeps every thread, in torch too, step after step."""
    from pagedllm.backends.cpu import threads as cpu_threads

    cpus = list(range(os.cpu_count() or 1))  # the machine's, each taken for a core
    if len(cpus) < 2:
        pytest.skip("one CPU: nothing to give up")
    monkeypatch.setattr(cpu_threads, "allowed_cpus", lambda: cpus)
    monkeypatch.setattr(cpu_threads, "physical_cores", lambda cpus: list(cpus))
    monkeypatch.setattr(cpu_threads, "CHECK_INTERVAL_S", 0.0)  # every step reads the load
    monkeypatch.delenv("PAGEDLLM_THREADS", raising=False)
    saved_threads, saved_cpus = torch.get_num_threads(), os.sched_getaffinity(0)
    backend = backends.get("cpu-torch")

    def under_load(governor) -> list[int]:
        governor.read_load = load = InjectedLoad()
        governor.after_step()  # the first reading
        load.busy_share = 1.0  # others keep every CPU busy
        counts = []
        for _ in range(6):
            governor.after_step()
            counts.append(torch.get_num_threads())
        return counts

    try:
        monkeypatch.setenv("PAGEDLLM_ADAPT_THREADS", "1")
        assert under_load(backend.thread_policy())[-1] == 1, (
            "the injected load must make an adapting governor step down"
        )
        monkeypatch.setenv("PAGEDLLM_ADAPT_THREADS", "0")
        fixed = backend.thread_policy()
        assert fixed.threads == len(cpus)
        assert under_load(fixed) == [len(cpus)] * 6
        assert fixed.threads == len(cpus)
    finally:
        torch.set_num_threads(saved_threads)
        os.sched_setaffinity(0, saved_cpus)
