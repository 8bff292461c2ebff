"""Chat templates come from model files, which may be hostile: they render in a sandbox (no
attribute escapes, no I/O, bounded ranges), and a template that fails gives a clear error."""

import pytest

from pagedllm import SamplingParams

pytestmark = pytest.mark.slow  # loads the default model

HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture
def template(default_llm):
    original = default_llm.tokenizer.chat_template

    def use(text):
        default_llm.tokenizer.chat_template = text

    yield use
    default_llm.tokenizer.chat_template = original


@pytest.mark.parametrize(
    "hostile",
    [
        "{{ cycler.__init__.__globals__.os.system('touch {marker}') }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}{{ joiner.__init__.__globals__['os'].popen('touch {marker}') }}",
        "{% set _ = messages.append({'role': 'user', 'content': 'x'}) %}{{ messages }}",
        "{% for i in range(10 ** 9) %}x{% endfor %}",
        "{{ raise_exception('this template refuses') }}",
    ],
)
def test_a_hostile_template_fails_cleanly_and_does_nothing(default_llm, template, tmp_path, hostile):
    marker = tmp_path / "escaped"
    template(hostile.replace("{marker}", str(marker)))
    messages = [dict(m) for m in HI]
    with pytest.raises(ValueError, match="chat template cannot render"):
        default_llm.apply_chat_template(messages)
    assert not marker.exists() and messages == HI


def test_the_engine_serves_on_after_a_template_failure(default_llm, template):
    template("{{ raise_exception('no') }}")
    with pytest.raises(ValueError):
        default_llm.chat(HI, SamplingParams(max_tokens=2))
    template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert default_llm.chat(HI, SamplingParams(max_tokens=2))[0].finish_reason in ("stop", "length")
    assert not default_llm.engine.has_unfinished()
