"""A bounded soak: 16 clients send a seeded mix of valid, cut-short and invalid requests to a
fresh `pagedllm serve` for 20 s. Every valid answer is well-formed (the fixed greedy and seeded
ones exactly equal to their answers alone), every invalid one gets its 4xx, nothing is a 5xx,
memory is flat after warm-up, and every KV block is free at the end (tests/soak.py)."""

import pytest
import soak

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # a timed load; resident memory flat and under the budget


def test_a_mixed_load_is_answered_correctly_and_leaves_the_server_idle(tmp_path):
    report = soak.run(duration=20, concurrency=16, seed=0, json_path=str(tmp_path / "soak.json"))
    assert report["passed"], "\n" + soak.format_report(report)
    kinds = report["by_kind"]
    assert kinds["reference"]["count"] > 0 and kinds["invalid"]["count"] > 0
