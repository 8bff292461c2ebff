"""The web page at ``/``, in a real browser: Debian's Chromium, headless, driven by Selenium
(``scripts/setup.sh test`` installs both). One server with an API key, the default model; the
oracles are the server's own JSON (``/v1/plan``, ``/metrics``) and text written in the test.
The last test saves the screenshot README shows (docs/web-page.png)."""

import json
import shutil
import time
from pathlib import Path

import httpx
import pytest
from server_process import ServerProcess, parse_metrics

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not shutil.which("chromedriver"), reason="needs chromium-driver (scripts/setup.sh test)"),
]

KEY = "page-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
SCREENSHOT = Path(__file__).resolve().parents[1] / "docs" / "web-page.png"


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--api-key", KEY, "--max-model-len", "2048", "--memory", "1GiB")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    from selenium import webdriver

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    profile = tmp_path_factory.mktemp("chromium-profile")
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        "--window-size=1280,900",
    ):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(shutil.which("chromedriver")))
    yield driver
    driver.quit()


def until(condition, timeout: float = 60.0, every: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(every)
    raise AssertionError("condition not met in time")


def console_errors(browser) -> list[dict]:
    return [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]


def metric(server, name: str) -> float:
    return parse_metrics(httpx.get(server.url + "/metrics", headers=AUTH).text)[name]


def element(browser, css: str):
    from selenium.webdriver.common.by import By

    return browser.find_element(By.CSS_SELECTOR, css)


def elements(browser, css: str) -> list:
    from selenium.webdriver.common.by import By

    return browser.find_elements(By.CSS_SELECTOR, css)


def set_field(browser, css: str, text: str) -> None:
    settings = element(browser, "#settings")
    if not settings.get_attribute("open"):  # the sampling fields fold away
        element(browser, "#settings summary").click()
    field = element(browser, css)
    field.clear()
    field.send_keys(text)


def last_answer(browser) -> str:
    """The last answer's text as shown (read in one call: streaming replaces its elements)."""
    script = "const a = document.querySelectorAll('#messages .message.assistant .content'); "
    return browser.execute_script(script + "return a.length ? a[a.length - 1].innerText : '';")


def ask(browser, question: str) -> None:
    from selenium.webdriver.common.keys import Keys

    field = element(browser, "#input")
    field.send_keys(question)
    field.send_keys(Keys.ENTER)


def test_without_the_key_nothing_of_the_api_is_reachable_and_the_page_asks_for_it(server, browser):
    assert httpx.get(server.url + "/v1/plan").status_code == 401  # the API: behind the key
    assert httpx.get(server.url + "/").status_code == 200  # the page: public, no data in it
    browser.get(server.url + "/")
    until(lambda: element(browser, "#keybox").is_displayed())
    time.sleep(1.5)  # a refresh tick: without a key the page calls nothing
    assert elements(browser, "#plan-legend li") == []
    set_field(browser, "#key", KEY)
    element(browser, "#save-key").click()
    until(lambda: len(elements(browser, "#plan-legend li")) == 5)
    assert console_errors(browser) == []


def test_the_memory_bar_shows_the_plans_own_numbers(server, browser):
    plan = httpx.get(server.url + "/v1/plan", headers=AUTH).json()
    legend = (
        "return [...document.querySelectorAll('#plan-legend li')]"
        ".map(li => [li.dataset.part, li.dataset.bytes, li.innerText]);"
    )
    parts = {part: (int(size), text) for part, size, text in browser.execute_script(legend)}  # (redrawn each second)
    fields = {
        "baseline": "baseline_bytes",
        "weights": "weights_bytes",
        "kv_cache": "kv_cache_bytes",
        "activation": "activation_bytes",
        "overhead": "overhead_bytes",
    }
    for part, field in fields.items():
        assert parts[part][0] == plan[field]
        assert parts[part][1].endswith(f"{plan[field] / 2**30:.3f} GiB")
    assert element(browser, "#budget").text == f"{plan['budget_bytes'] / 2**30:.3f} GiB"
    total = metric(server, "pagedllm_kv_blocks_total")
    used, cached, free = (int(element(browser, f"#kv-{k}").text) for k in ("used", "cached", "free"))
    assert used + cached + free == total
    assert element(browser, "#rss").text.endswith("GiB")
    assert browser.execute_script("return document.getElementById('experts').hidden;")  # a dense model


def test_the_expert_cache_line_shows_the_metrics_it_is_given(server, browser):
    """A mixture whose experts stay in the file: the panel says how many are resident of how
    many, and the hits, misses and bytes read, as /metrics and /v1/plan give them (figures here
    written by the test, drawn and read back in one script: the page redraws every second)."""
    shown = browser.execute_script(
        "showExperts({routed_experts: 768}, {pagedllm_expert_slots: 219, pagedllm_expert_cache_hits_total: 11579,"
        " pagedllm_expert_cache_misses_total: 859, pagedllm_expert_cache_read_bytes_total: 2 ** 30});"
        "const line = document.getElementById('experts');"
        "return [line.hidden, line.innerText];"
    )
    assert shown == [
        False,
        "routed experts: 219 resident of 768 (in the weights), the others read from the file when chosen: "
        "11579 hits, 859 misses, 1.000 GiB read",
    ]


def test_the_disk_tier_line_shows_the_metrics_it_is_given(server, browser):
    """With --prefix-cache-dir: the panel says the tier's bytes of its bound, blocks read back,
    misses and bytes written, as /metrics gives them (figures written by the test); hidden
    without a tier (the server here has none)."""
    assert browser.execute_script("return document.getElementById('disk-tier').hidden;")
    shown = browser.execute_script(
        "showDiskTier({pagedllm_prefix_disk_budget_bytes: 8 * 2 ** 30, pagedllm_prefix_disk_bytes: 2 ** 29,"
        " pagedllm_prefix_disk_hit_blocks_total: 187, pagedllm_prefix_disk_misses_total: 3,"
        " pagedllm_prefix_disk_written_bytes_total: 2 ** 28});"
        "const line = document.getElementById('disk-tier');"
        "return [line.hidden, line.innerText];"
    )
    assert shown == [
        False,
        "prefix cache on disk: 0.500 GiB of 8.000 GiB, 187 blocks read back, 3 misses, 0.250 GiB written",
    ]


def test_shift_enter_is_a_new_line_and_enter_sends_a_streamed_answer(server, browser):
    from selenium.webdriver.common.keys import Keys

    set_field(browser, "#temperature", "0")
    set_field(browser, "#max_tokens", "48")
    field = element(browser, "#input")
    field.send_keys("Write a short poem", Keys.SHIFT, Keys.ENTER, Keys.NULL, "about the sea.")
    assert "\n" in field.get_attribute("value") and elements(browser, "#messages .message") == []
    field.send_keys(Keys.ENTER)
    seen = []
    until(lambda: last_answer(browser))
    while not element(browser, "#send").is_enabled() or not seen:
        text = last_answer(browser)
        if not seen or text != seen[-1]:
            seen.append(text)
        time.sleep(0.02)
    assert len(set(seen)) >= 3, seen  # it grew token by token, not in one piece
    final = last_answer(browser)
    assert all(final.startswith(s.rstrip()) for s in seen)
    assert elements(browser, "#messages .message.user")[0].text == "Write a short poem\nabout the sea."


def test_the_conversation_is_kept_in_the_browser_and_a_new_one_clears_it(server, browser):
    before = [m.text for m in elements(browser, "#messages .message")]
    browser.refresh()
    until(lambda: [m.text for m in elements(browser, "#messages .message")] == before)
    element(browser, "#new-conversation").click()
    assert elements(browser, "#messages .message") == []


def test_stop_aborts_the_request_on_the_server(server, browser):
    set_field(browser, "#max_tokens", "600")
    aborted = metric(server, "pagedllm_requests_aborted_total")
    ask(browser, "Write a very long story about a dragon and a knight.")
    until(lambda: len(last_answer(browser)) > 20)
    element(browser, "#stop").click()
    until(lambda: metric(server, "pagedllm_requests_aborted_total") > aborted, timeout=10, every=0.2)
    note = "const m = document.querySelectorAll('#messages .message.assistant'); return m[m.length - 1].innerText;"
    until(lambda: "stopped" in browser.execute_script(note))
    assert element(browser, "#send").is_enabled()


def test_markup_in_model_output_renders_as_text(server, browser):
    element(browser, "#new-conversation").click()
    payload = "<script>window.pwned = 1</script><img src=x onerror=window.pwned=2><b>bold</b>"
    set_field(browser, "#schema", json.dumps({"type": "string", "enum": [payload]}))
    set_field(browser, "#max_tokens", "80")
    ask(browser, "Say something.")
    until(lambda: element(browser, "#send").is_enabled() and last_answer(browser))
    assert payload in last_answer(browser)  # shown as the text it is
    assert browser.execute_script("return window.pwned") is None
    assert elements(browser, "#messages script, #messages img, #messages b") == []
    set_field(browser, "#schema", json.dumps({"type": "string", "enum": ["see ```<b>x</b> = 1```"]}))
    ask(browser, "Show code.")
    until(lambda: element(browser, "#send").is_enabled() and "see" in last_answer(browser))
    code = "const c = document.querySelectorAll('#messages pre code'); return c.length ? c[c.length-1].innerText : '';"
    assert browser.execute_script(code) == "<b>x</b> = 1"  # a code block, its markup as text
    set_field(browser, "#schema", "")


def test_the_budget_control_changes_the_engines_budget(server, browser):
    set_field(browser, "#new-budget", "900MiB")
    element(browser, "#budget-form button").click()
    until(lambda: element(browser, "#budget").text == f"{900 / 1024:.3f} GiB")
    assert httpx.get(server.url + "/v1/plan", headers=AUTH).json()["budget_bytes"] == 900 * 2**20
    set_field(browser, "#new-budget", "2000TiB")
    element(browser, "#budget-form button").click()
    until(lambda: element(browser, "#budget-result").text not in ("", "applied"))  # the planner's refusal
    assert all("/v1/memory" in e["message"] and "400" in e["message"] for e in console_errors(browser))
    set_field(browser, "#new-budget", "1GiB")
    element(browser, "#budget-form button").click()
    until(lambda: element(browser, "#budget").text == "1.000 GiB")


def test_the_page_works_at_phone_width_and_the_screenshot_is_saved(server, browser):
    element(browser, "#new-conversation").click()
    set_field(browser, "#max_tokens", "40")
    ask(browser, "What is the capital of France? Answer with a code block too.")
    until(lambda: element(browser, "#send").is_enabled() and last_answer(browser), timeout=60)
    time.sleep(8)  # some points on the resident-memory line
    browser.set_window_size(1280, 900)
    browser.save_screenshot(str(SCREENSHOT))
    browser.set_window_size(390, 844)  # a phone: chat above the memory panel
    chat, memory = element(browser, "#chat").rect, element(browser, "#memory").rect
    assert memory["y"] >= chat["y"] + chat["height"] and chat["width"] <= 390
    assert console_errors(browser) == []


def test_a_server_with_several_models_has_a_picker_and_shows_the_chosen_ones_plan(browser, tmp_path):
    """``pagedllm serve --model a=... --model b=...``: the page itself loads no model; the
    picker lists both, the answer comes from the model chosen (which the server then holds, the
    other unloaded to make room) and the memory panel shows that model's plan."""
    from selenium.webdriver.support.ui import Select

    from pagedllm.loading import default_gguf_path

    second = tmp_path / "b.gguf"
    second.symlink_to(default_gguf_path())  # a second name: its own model, one conversion (the first's)
    fleet = ServerProcess("--model", f"a={default_gguf_path()}", "--model", f"b={second}", "--memory", "1.1GiB")

    def states() -> dict:
        return {m["id"]: m["state"] for m in httpx.get(fleet.url + "/v1/models").json()["data"]}

    try:
        assert httpx.get(fleet.url + "/").status_code == 200 and states() == {"a": "on disk", "b": "on disk"}
        browser.get(fleet.url + "/")
        until(lambda: element(browser, "#model-picker").is_displayed())
        until(lambda: len(Select(element(browser, "#model-picker")).options) == 2)
        Select(element(browser, "#model-picker")).select_by_value("b")
        set_field(browser, "#temperature", "0")
        set_field(browser, "#max_tokens", "8")
        ask(browser, "Hi")
        until(lambda: element(browser, "#send").is_enabled() and last_answer(browser), timeout=120)
        assert states() == {"a": "on disk", "b": "resident"}
        budget = httpx.get(fleet.url + "/v1/plan?model=b").json()["budget_bytes"]
        until(lambda: element(browser, "#budget").text == f"{budget / 2**30:.3f} GiB")
        assert console_errors(browser) == []
    finally:
        fleet.stop()
