"""``pagedllm.env``: a variable's value, its default, and a bad value named in the error."""

import subprocess
import sys

import pytest

from pagedllm import env


def test_unset_or_empty_is_the_default_and_a_value_is_parsed(monkeypatch):
    monkeypatch.delenv("PAGEDLLM_THREADS", raising=False)
    assert env.THREADS.get() == 0
    monkeypatch.setenv("PAGEDLLM_THREADS", "  ")
    assert env.THREADS.get() == 0
    monkeypatch.setenv("PAGEDLLM_THREADS", " 3 ")
    assert env.THREADS.get() == 3
    monkeypatch.setenv("PAGEDLLM_DECODE_STEP", "0")
    assert env.DECODE_STEP.get() is False
    monkeypatch.setenv("PAGEDLLM_DECODE_STEP", "1")
    assert env.DECODE_STEP.get() is True


def test_a_value_that_does_not_parse_names_the_variable(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_GROW_SETTLE_S", "soon")
    with pytest.raises(ValueError, match=r"PAGEDLLM_GROW_SETTLE_S='soon': expected seconds"):
        env.GROW_SETTLE_S.get()


def test_the_table_lists_every_variable_once():
    out = subprocess.run([sys.executable, "-m", "pagedllm.env"], capture_output=True, text=True, check=True).stdout
    names = [line.split()[0] for line in out.splitlines()]
    assert names == [v.name for v in env.ALL]
    assert len(set(names)) == len(names) and "PAGEDLLM_KERNELS" in names and "PAGEDLLM_CACHE" in names
