import contextlib
import os

import pytest

# Every engine in the tests (and in the servers they start) verifies its bookkeeping each step.
os.environ["PAGEDLLM_CHECK_INVARIANTS"] = "1"

from hypothesis import settings
from tiny_models import ARCHS, save_tiny_model

# ---- two parts: in parallel, then alone -------------------------------------------------------
# `make test` runs the suite in two pytest runs: the tests that only compute, on xdist workers
# (`-n 2 --serial=skip`), each worker given its own share of the cores as if it were a machine of
# its own (one torch thread on one core, on a 2-core box: the two workers never contend for a
# core); then the tests marked `serial`, which measure the machine (peak memory, resident memory,
# threads and pinning, times), alone on all of it (`--serial=only`), as a plain run has them.


def pytest_addoption(parser):
    parser.addoption(
        "--serial",
        choices=("run", "skip", "only"),
        default="run",
        help="tests marked serial: run them with the others (default; skipped on xdist workers, "
        "where the machine is shared), leave them out (deselect), or run only them",
    )


def _worker(config) -> dict | None:
    return getattr(config, "workerinput", None)


def pytest_configure(config):
    worker = _worker(config)
    if worker is not None:
        _take_this_workers_cores(int(worker["workerid"].removeprefix("gw")), int(worker["workercount"]))
    elif getattr(config.option, "numprocesses", None):  # the xdist controller, before it starts its workers
        _share_the_cache_and_kernels(config)


def _take_this_workers_cores(index: int, count: int) -> None:
    """This worker (and every process it starts: servers, engines, converters) runs on its
    slice of the CPUs, and torch on one thread per CPU of it: the engines plan and pin for the
    CPUs they see, so each worker is a smaller machine, not a share of a busy one."""
    cpus = sorted(os.sched_getaffinity(0))
    each = len(cpus) // count
    if each >= 1:
        mine = cpus[index * each : (index + 1) * each]
        os.sched_setaffinity(0, mine)
        import torch

        torch.set_num_threads(len(mine))


def _share_the_cache_and_kernels(config) -> None:
    """One cache for every worker (and for a later run given the same PAGEDLLM_TEST_CACHE), the
    kernels built and the default model converted in it now, on every core, before the workers
    start: otherwise each worker would do both on its one core, or wait on the other."""
    import threading

    if "PAGEDLLM_TEST_CACHE" not in os.environ:
        import tempfile

        config._pagedllm_cache = tempfile.mkdtemp(prefix="pagedllm-test-cache-")
        os.environ["PAGEDLLM_TEST_CACHE"] = config._pagedllm_cache
    os.environ["PAGEDLLM_CACHE"] = os.environ["PAGEDLLM_TEST_CACHE"]
    from pagedllm.kernels import compiled_ops
    from pagedllm.loading.default_model import default_gguf_path
    from pagedllm.loading.gguf_cache import converted_dir

    def convert() -> None:
        with contextlib.suppress(Exception):  # not installed: the tests that need it say so
            converted_dir(default_gguf_path())

    converting = threading.Thread(target=convert)  # a child process, beside the kernels' build
    converting.start()
    with contextlib.suppress(Exception):  # the tests that need the kernels fail on it, and report it
        compiled_ops()
    converting.join()


def pytest_unconfigure(config):
    cache = getattr(config, "_pagedllm_cache", None)
    if cache:
        import shutil

        shutil.rmtree(cache, ignore_errors=True)


# The longest files (minutes on the 2-core AVX2 box), handed to the workers first: a worker
# never starts one of them when the other is nearly done (xdist hands out whole files, in order).
# test_quality alone is about a third of the parallel part's work: it must start first.
LONGEST_FIRST = [  # seconds on one worker, measured on the busy box (make test, December 3)
    "test_quality.py",  # 542
    "test_memory_planner.py",  # its default model's grids: 178 on two threads, serial until December 3
    "test_bench.py",  # 157
    "test_hostile_input.py",  # 143
    "test_tensor_parallel.py",  # 98
    "test_lm_eval.py",  # 78
    "test_server.py",  # 57
    "test_clients.py",  # 42
    "test_structured_output.py",  # 39
    "test_structured_server.py",  # 35
    "test_web_page.py",  # 31
    "test_default_model.py",  # 30
    "test_speculative.py",  # 29
    "test_loading_errors.py",  # 24
    "test_text_api.py",  # 23
    "test_responses_api.py",  # 18
    "test_messages_api.py",  # 15
]


def pytest_collection_modifyitems(config, items):
    if _worker(config) is not None:
        rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
        items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: files stay whole
    serial = config.getoption("serial")
    if serial == "run":
        if _worker(config) is not None:
            skip = pytest.mark.skip(reason="serial: measures the machine, which xdist workers share (--serial=only)")
            for item in items:
                if item.get_closest_marker("serial"):
                    item.add_marker(skip)
        return
    wanted = serial == "only"
    keep = [item for item in items if bool(item.get_closest_marker("serial")) == wanted]
    left = [item for item in items if bool(item.get_closest_marker("serial")) != wanted]
    if left:
        config.hook.pytest_deselected(items=left)
        items[:] = keep


# Property tests draw the same examples on every run (CI, `make test`): a red run is a change,
# never the luck of the draw. PAGEDLLM_HYPOTHESIS_EXPLORE=1 draws new ones, to look for bugs.
settings.register_profile("pagedllm", derandomize=os.environ.get("PAGEDLLM_HYPOTHESIS_EXPLORE", "") in ("", "0"))
settings.load_profile("pagedllm")


@pytest.fixture(autouse=True)
def _seeded():
    """Every test starts from the same random state (torch's and Python's): a test that draws
    without its own generator draws the same values on every run, so a failure reproduces."""
    import random

    import torch

    torch.manual_seed(0)
    random.seed(0)


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    """Tests never write the user's cache; the kernels are built and the default model is
    converted once per run (PAGEDLLM_TEST_CACHE: a folder the run's workers, or runs, share)."""
    if "PAGEDLLM_TEST_CACHE" in os.environ:
        os.environ["PAGEDLLM_CACHE"] = os.environ["PAGEDLLM_TEST_CACHE"]
    else:
        os.environ["PAGEDLLM_CACHE"] = str(tmp_path_factory.mktemp("pagedllm-cache"))


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """{arch name: (directory, transformers model)} for every supported architecture."""
    out = {}
    for name in ARCHS:
        d = tmp_path_factory.mktemp(f"tiny-{name}")
        out[name] = (d, save_tiny_model(name, d))
    return out


@pytest.fixture(scope="session")
def default_llm():
    from pagedllm import LLM

    return LLM()


@pytest.fixture(params=["compiled", "torch"])
def kernels(request):
    """Runs a test on the compiled CPU kernels and on the pure-PyTorch path (the fallback
    without a compiler); 'compiled' fails if the kernels cannot be built here."""
    from pagedllm.kernels import compiled_ops, select

    previous = select(request.param)
    if request.param == "compiled":
        assert compiled_ops() is not None
    yield request.param
    select(previous)


@pytest.fixture
def ops():
    """The compiled kernels (torch.ops.pagedllm); fails if they cannot be built here."""
    from pagedllm.kernels import compiled_ops, select

    previous = select("compiled")
    ops = compiled_ops()
    assert ops is not None, "the CPU kernels must build on this machine"
    yield ops
    select(previous)
