"""Threads: one per physical core by default, worker threads pinned; fewer and unpinned while
other processes keep the cores busy (a step's parallel regions all wait for a descheduled
thread), back when they stop."""

import os
import subprocess
import sys
import time

import pytest
import torch

from pagedllm import backends
from pagedllm.backends.cpu_threads import CHECK_INTERVAL_S, allowed_cpus, physical_cores


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


def test_threads_step_down_next_to_busy_processes_and_come_back():
    backend = backends.get()
    governor = backend.thread_policy()
    if governor.max_threads < 2:
        pytest.skip("a single core: nothing to give up")
    governor.after_step()  # first reading
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in governor.cpus]
    try:
        assert wait_for(governor, lambda: governor.threads < governor.max_threads), "never stepped down"
        assert not governor.pinned and torch.get_num_threads() == governor.threads
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert wait_for(governor, lambda: governor.threads == governor.max_threads), "never came back"
    assert governor.pinned == (backend.name == "cpu-compiled")
