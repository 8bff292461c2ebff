import os

import pytest

# Every engine in the tests (and in the servers they start) verifies its bookkeeping each step.
os.environ["PAGEDLLM_CHECK_INVARIANTS"] = "1"

from hypothesis import settings
from tiny_models import ARCHS, save_tiny_model

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
    """Tests never write the user's cache; the default model is converted once per session."""
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
