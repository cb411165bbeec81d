"""The chat page of ``mlx-ferrum serve`` (``GET /``), driven end to end in headless Chromium
by Playwright, against a real server on stories260K.

The page's replies are compared with the server's own non-streaming API answer for the
same messages and with the stories260K recording (independent numpy / transformers /
mlx-lm runs), not with anything the page computes. Needs Playwright for Python and a
Chromium binary (Debian's ``chromium`` package; .ci/run installs it); skips without them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import httpx
import pytest

from support.server_helpers import PLAIN_TEMPLATE, running_server

try:
    from playwright import sync_api
except ImportError:  # the tests that need no browser still run
    sync_api = None

MODEL = "stories"
ADAPTER = "tiny-adapter"
CHROMIUM = os.environ.get("FERRUM_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
PROMPT = "Once upon a time"
TIMEOUT_MS = 60_000


@pytest.fixture(scope="module")
def browser():
    if sync_api is None:
        pytest.skip("Playwright for Python is not installed (pip install playwright, or the dev extra)")
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium, or set FERRUM_CHROMIUM)")
    # The Playwright driver (node) and the browser it spawns start without LD_PRELOAD: the
    # test setup preloads OpenBLAS for MLX, and in node OpenBLAS's thread pool breaks node's
    # own thread creation ("pthread_create: Invalid argument") unless OPENBLAS_NUM_THREADS=1
    preload = os.environ.pop("LD_PRELOAD", None)
    try:
        playwright = sync_api.sync_playwright().start()
        instance = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
    finally:
        if preload is not None:
            os.environ["LD_PRELOAD"] = preload
    try:
        yield instance
    finally:
        instance.close()
        playwright.stop()


def _serve(stories_path, tmp, extra=()):
    template = tmp / "plain.jinja"
    template.write_text(PLAIN_TEMPLATE)
    return running_server(stories_path, tmp, ["--served-model-name", MODEL, "--chat-template", str(template), *extra],
                          {"FERRUM_PREFIX_CACHE": "0"})


@pytest.fixture(scope="module")
def server(stories_path, tmp_path_factory):
    """stories260K, plus a random LoRA adapter served as ``ADAPTER`` (for the model picker)."""
    import mlx_ferrum as mf
    from support.lora_fixtures import random_peft_adapter

    tmp = tmp_path_factory.mktemp("webui")
    model, _ = mf.load(str(stories_path))
    adapter = random_peft_adapter(model, tmp / "adapter", seed=0, std=0.5)
    with _serve(stories_path, tmp, ["--lora-modules", f"{ADAPTER}={adapter}", "--max-lora-rank", "8"]) as s:
        yield s


class Page:
    """A fresh browser context (empty storage) on the chat page, with the page's console
    errors and uncaught exceptions collected in ``errors``."""

    def __init__(self, browser, url: str, width: int = 1000, height: int = 720):
        self.context = browser.new_context(viewport={"width": width, "height": height}, accept_downloads=True)
        self.context.set_default_timeout(TIMEOUT_MS)
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(f"uncaught: {e}"))
        self.url = url
        self.open()

    def open(self) -> None:
        self.page.goto(self.url + "/")
        self.page.evaluate("window.ferrumChat.ready")

    def settings(self, **fields) -> None:
        """Fill the settings panel: ``temperature="0"``, ``max_tokens="40"``, ``extra='{...}'``."""
        if self.page.get_attribute("#toggle-settings", "aria-expanded") != "true":
            self.page.click("#toggle-settings")
        for name, value in fields.items():
            self.page.fill("#" + name.replace("_", "-"), value)

    def send(self, text: str) -> None:
        self.page.fill("#prompt", text)
        self.page.press("#prompt", "Enter")

    def wait_idle(self) -> None:
        self.page.wait_for_function("() => !window.ferrumChat.busy()")

    def stored(self) -> list:
        return json.loads(self.page.evaluate("localStorage.getItem('mlx-ferrum.conversations')"))

    def messages(self) -> list:
        """The current conversation's stored messages as (role, content) pairs."""
        current = self.page.evaluate("localStorage.getItem('mlx-ferrum.current')")
        conversation = next(c for c in self.stored() if c["id"] == current)
        return [(m["role"], m["content"]) for m in conversation["messages"]]

    def error_text(self) -> str:
        return self.page.inner_text("#error") if self.page.is_visible("#error") else ""

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def chat(browser, server):
    page = Page(browser, server.url)
    yield page
    page.close()


def api_reply(server, messages, **params) -> dict:
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                   json={"model": MODEL, "messages": messages} | params)
    assert r.status_code == 200, r.text
    return r.json()


def wait_running(server, count: int, timeout_s: float = 20.0) -> dict:
    """Poll ``/metrics`` until ``count`` requests run (and, for 0, no KV block is held)."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = server.metrics()
        if m["mlx_ferrum:num_requests_running"] == count and (count or m["mlx_ferrum:kv_cache_used_blocks"] == 0):
            return m
        assert time.monotonic() < deadline, m
        time.sleep(0.02)


def test_page_loads_from_the_package_with_no_console_errors(chat, server):
    page = chat.page
    assert page.title() == "mlx-ferrum chat"
    assert page.eval_on_selector_all("#model option", "os => os.map(o => o.value)") == [MODEL, ADAPTER]
    assert not page.is_visible("#key-form")  # no --api-key: nothing asked
    assert chat.errors == []
    page_response = httpx.get(server.url + "/")
    assert "script-src 'self'" in page_response.headers["content-security-policy"]
    for name in ("app.js", "markdown.js", "style.css"):
        assert httpx.get(f"{server.url}/web/{name}").status_code == 200


def test_every_control_has_a_label(chat):
    unlabelled = chat.page.evaluate("""() => Array.from(document.querySelectorAll('button, input, select, textarea'))
        .filter(el => !((el.labels && el.labels.length) || el.getAttribute('aria-label') ||
                        (el.tagName === 'BUTTON' && el.textContent.trim())))
        .map(el => el.id || el.outerHTML)""")
    assert unlabelled == []


def test_streamed_reply_equals_the_apis_greedy_reply(chat, server, stories_expected):
    chat.settings(temperature="0", max_tokens="40")
    chat.send(PROMPT)
    chat.wait_idle()
    assert chat.error_text() == ""
    expected = api_reply(server, [{"role": "user", "content": PROMPT}], temperature=0, max_tokens=40)
    text = expected["choices"][0]["message"]["content"]
    assert chat.messages() == [("user", PROMPT), ("assistant", text)]
    # the plain template makes the recording's prompt (BOS + the text), so the reply starts the recording
    assert stories_expected["once"]["completion_text"].startswith(text) and len(text) > 20
    # the streamed text went through the Markdown renderer
    rendered = chat.page.inner_html(".message.assistant .content")
    assert rendered == chat.page.evaluate("t => window.FerrumMarkdown.toHTML(t)", text)
    stats = chat.page.inner_text(".message.assistant .stats")
    assert f"{expected['usage']['completion_tokens']} tokens" in stats
    assert "tokens/s" in stats and "first token" in stats and "finish: length" in stats
    assert chat.errors == []


def test_model_picker_offers_the_served_adapter(chat, server):
    assert chat.page.inner_text(f"#model option[value='{ADAPTER}']") == f"{ADAPTER} (adapter of {MODEL})"
    chat.page.select_option("#model", ADAPTER)
    chat.settings(temperature="0", max_tokens="16")
    chat.send(PROMPT)
    chat.wait_idle()
    messages = [{"role": "user", "content": PROMPT}]
    with_adapter = api_reply(server, messages, model=ADAPTER, temperature=0, max_tokens=16)["choices"][0]["message"]["content"]
    base = api_reply(server, messages, temperature=0, max_tokens=16)["choices"][0]["message"]["content"]
    assert with_adapter != base  # the adapter changes the reply, so the page did use it
    assert chat.messages()[-1] == ("assistant", with_adapter)
    assert chat.page.inner_text(".message.assistant .role") == ADAPTER
    chat.page.reload()
    chat.page.evaluate("window.ferrumChat.ready")
    assert chat.page.input_value("#model") == ADAPTER  # the choice is kept


def test_regenerate_and_edit_last(chat, server):
    chat.settings(temperature="0", max_tokens="12")
    chat.send(PROMPT)
    chat.wait_idle()
    first = chat.messages()
    chat.page.click("#regenerate")
    chat.wait_idle()
    assert chat.messages() == first  # greedy: the same reply again
    chat.page.click("#edit-last")
    assert chat.page.input_value("#prompt") == PROMPT
    assert chat.messages() == []
    chat.page.fill("#prompt", "The dog")
    chat.page.click("#send")
    chat.wait_idle()
    expected = api_reply(server, [{"role": "user", "content": "The dog"}], temperature=0, max_tokens=12)
    assert chat.messages() == [("user", "The dog"), ("assistant", expected["choices"][0]["message"]["content"])]


def test_sampling_settings_are_sent(chat, server):
    """A seeded sample at temperature 1 with top_p: the page's reply equals the API's for the
    same fields, and differs from the greedy one (so the fields did arrive)."""
    chat.settings(temperature="1", top_p="0.9", seed="7", max_tokens="24")
    chat.send(PROMPT)
    chat.wait_idle()
    messages = [{"role": "user", "content": PROMPT}]
    sampled = api_reply(server, messages, temperature=1, top_p=0.9, seed=7, max_tokens=24)["choices"][0]["message"]["content"]
    greedy = api_reply(server, messages, temperature=0, max_tokens=24)["choices"][0]["message"]["content"]
    assert sampled != greedy
    assert chat.messages()[-1] == ("assistant", sampled)


def test_system_message_is_sent(chat, server):
    chat.settings(temperature="0", max_tokens="12", system="Lily and Tom. ")
    chat.send(PROMPT)
    chat.wait_idle()
    expected = api_reply(server, [{"role": "system", "content": "Lily and Tom. "}, {"role": "user", "content": PROMPT}],
                         temperature=0, max_tokens=12)
    assert chat.messages()[-1] == ("assistant", expected["choices"][0]["message"]["content"])
    chat.page.reload()
    assert chat.page.input_value("#system") == "Lily and Tom. "


def _start_long_reply(chat, server) -> None:
    chat.settings(temperature="0", max_tokens="480", extra='{"ignore_eos": true}')
    chat.send(PROMPT)
    chat.page.wait_for_function("() => document.querySelector('.message.assistant .content').textContent.length > 0")
    wait_running(server, 1)


def test_stop_cancels_mid_stream_and_frees_the_request(chat, server):
    _start_long_reply(chat, server)
    chat.page.click("#stop")
    chat.wait_idle()
    wait_running(server, 0)
    (_, reply), = [m for m in chat.messages() if m[0] == "assistant"]
    full = api_reply(server, [{"role": "user", "content": PROMPT}], temperature=0, max_tokens=480, ignore_eos=True)
    assert 0 < len(reply) < len(full["choices"][0]["message"]["content"])
    assert full["choices"][0]["message"]["content"].startswith(reply)
    assert "stopped" in chat.page.inner_text(".message.assistant .stats")
    assert chat.error_text() == "" and chat.errors == []


def test_keyboard_enter_sends_shift_enter_breaks_line_escape_stops(chat, server):
    page = chat.page
    page.click("#prompt")
    page.keyboard.type("first line")
    page.keyboard.press("Shift+Enter")
    page.keyboard.type("second line")
    assert page.input_value("#prompt") == "first line\nsecond line"
    assert chat.messages() == []
    chat.settings(temperature="0", max_tokens="480", extra='{"ignore_eos": true}')
    page.click("#prompt")
    page.keyboard.press("Enter")
    page.wait_for_function("() => document.querySelector('.message.assistant .content').textContent.length > 0")
    wait_running(server, 1)
    page.keyboard.press("Escape")
    chat.wait_idle()
    wait_running(server, 0)
    assert chat.messages()[0] == ("user", "first line\nsecond line")
    assert "stopped" in page.inner_text(".message.assistant .stats")


def test_conversation_survives_a_reload(chat):
    chat.settings(temperature="0", max_tokens="10")
    chat.send(PROMPT)
    chat.wait_idle()
    before = chat.messages()
    shown = chat.page.inner_text("#messages")
    chat.page.reload()
    chat.page.evaluate("window.ferrumChat.ready")
    assert chat.messages() == before
    assert chat.page.inner_text("#messages") == shown
    assert chat.page.inner_text("#conversation-list") == PROMPT
    assert chat.page.input_value("#temperature") == "0"  # the settings too


def test_export_then_import_round_trips(chat, tmp_path):
    page = chat.page
    chat.settings(temperature="0", max_tokens="8")
    chat.send(PROMPT)
    chat.wait_idle()
    page.click("#new-conversation")
    chat.send("The cat")
    chat.wait_idle()
    page.once("dialog", lambda d: d.accept("Cat story <b>bold</b>"))
    page.click("#rename-conversation")
    exported_conversations = chat.stored()
    assert len(exported_conversations) == 2
    with page.expect_download() as download:
        page.click("#export-conversations")
    path = tmp_path / "export.json"
    download.value.save_as(path)
    data = json.loads(path.read_text())
    assert data["conversations"] == exported_conversations
    # a browser with nothing stored imports the file and has the same conversations
    page.evaluate("localStorage.clear()")
    page.reload()
    assert chat.stored()[0]["messages"] == []
    with page.expect_file_chooser() as chooser:
        page.click("#import-button")
    chooser.value.set_files(str(path))
    page.wait_for_function("() => document.querySelectorAll('#conversation-list li').length === 2")
    assert chat.stored() == exported_conversations
    assert page.inner_text("#conversation-list").splitlines() == ["Cat story <b>bold</b>", PROMPT]
    # a broken file says why, and changes nothing
    bad = tmp_path / "bad.json"
    bad.write_text('{"conversations": [{"messages": [{"role": "wizard", "content": 1}]}]}')
    page.set_input_files("#import-conversations", str(bad))
    page.wait_for_selector("#error:not([hidden])")
    assert "Import failed" in chat.error_text() and "role" in chat.error_text()
    assert chat.stored() == exported_conversations
    # delete asks first
    page.once("dialog", lambda d: d.accept())
    page.click("#delete-conversation")
    assert [c["title"] for c in chat.stored()] == [PROMPT]


HOSTILE = ("# Title\n\n<script>window.__pwned = 1</script>\n\n<img src=x onerror=\"window.__pwned = 2\">\n\n"
           "**bold** and *it* and `<b>code</b>` and [safe](https://example.com) and [bad](javascript:window.__pwned=3)\n\n"
           "- one\n- two <i>x</i>\n\n```html\n<script>window.__pwned = 4</script>\n```\n")


def test_markdown_renderer_escapes_html(chat):
    page = chat.page
    html = page.evaluate("t => window.FerrumMarkdown.toHTML(t)", HOSTILE)
    page.evaluate("t => { const d = document.createElement('div'); d.id = 'probe'; "
                  "d.append(window.FerrumMarkdown.render(t)); document.body.append(d); }", HOSTILE)
    page.wait_for_timeout(200)  # an injected onerror would fire by now
    assert page.evaluate("window.__pwned") is None
    probe = page.locator("#probe")
    assert probe.locator("script, img, i, b").count() == 0  # no tag from the text became an element
    assert probe.locator("strong").inner_text() == "bold" and probe.locator("em").inner_text() == "it"
    assert probe.locator("a").count() == 1 and probe.locator("a").get_attribute("href") == "https://example.com"
    assert "[bad](javascript:window.__pwned=3)" in probe.inner_text()
    assert probe.locator("li").all_inner_texts() == ["one", "two <i>x</i>"]
    assert probe.locator(".code-block code").inner_text() == "<script>window.__pwned = 4</script>"
    assert probe.locator(".code-block .copy-code").count() == 1
    assert "&lt;script&gt;window.__pwned = 1&lt;/script&gt;" in html
    assert chat.errors == []


def test_streamed_html_in_model_output_is_not_executed(chat):
    """The real streaming path with crafted model output: the chat completion's SSE body
    is replaced in the browser by one whose deltas carry HTML and a script."""
    pieces = [HOSTILE[i:i + 7] for i in range(0, len(HOSTILE), 7)]  # tags split across deltas
    events = [{"choices": [{"index": 0, "delta": {"content": p}, "finish_reason": None}]} for p in pieces]
    events.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    events.append({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": len(pieces), "total_tokens": 5 + len(pieces)}})
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    chat.page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, headers={"Content-Type": "text/event-stream"}, body=body))
    chat.send("hello")
    chat.wait_idle()
    chat.page.wait_for_timeout(200)
    assert chat.page.evaluate("window.__pwned") is None
    content = chat.page.locator(".message.assistant .content")
    assert content.locator("script, img").count() == 0
    assert chat.messages()[-1] == ("assistant", HOSTILE)
    assert content.inner_html() == chat.page.evaluate("t => window.FerrumMarkdown.toHTML(t)", HOSTILE)
    assert f"{len(pieces)} tokens" in chat.page.inner_text(".message.assistant .stats")
    # the copy button copies the code block's text
    chat.context.grant_permissions(["clipboard-read", "clipboard-write"])
    content.locator(".copy-code").click()
    assert chat.page.evaluate("navigator.clipboard.readText()") == "<script>window.__pwned = 4</script>"
    assert chat.errors == []


def test_a_refused_request_shows_the_servers_message(chat, server):
    chat.settings(temperature="-1")
    chat.send(PROMPT)
    chat.wait_idle()
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "temperature": -1,
        "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 400
    assert chat.error_text() == f"The server refused the request (400): {r.json()['error']['message']}"
    assert chat.messages() == [("user", PROMPT)]  # the conversation keeps the message


#: The visible elements whose content is wider than they are, other than those that scroll
#: it on purpose (code blocks) or hide it on purpose (ellipsized conversation titles).
OVERFLOWING = """() => Array.from(document.querySelectorAll('body *')).filter(el => {
    const style = getComputedStyle(el);
    return el.offsetParent !== null && el.scrollWidth > el.clientWidth + 1 && style.display !== 'inline'
        && !['auto', 'scroll', 'hidden', 'clip'].includes(style.overflowX);
}).map(el => el.tagName + '#' + el.id + '.' + el.className)"""


def test_readable_at_320_pixels(browser, server):
    chat = Page(browser, server.url, width=320, height=640)
    try:
        page = chat.page
        chat.settings(temperature="0", max_tokens="60")
        chat.send(PROMPT + " " + "x" * 200)  # a long unbroken word
        chat.wait_idle()
        assert not page.is_visible("#sidebar")  # folded away at this width
        for state, toggle in (("settings open", None), ("conversations open too", "#toggle-conversations"),
                              ("settings closed", "#toggle-settings")):
            if toggle:
                page.click(toggle)
            width = page.evaluate("document.documentElement.scrollWidth")
            assert width <= 320, f"{state}: the page scrolls sideways ({width} px)"
            assert page.evaluate(OVERFLOWING) == [], f"{state}: text runs out of its box"
            for selector in ("#prompt", "#send", "#model", "#toggle-settings", "#temperature", "#extra",
                             "#new-conversation", "#export-conversations", ".message.user .content"):
                if page.is_visible(selector):
                    box = page.locator(selector).bounding_box()
                    assert box["x"] >= 0 and box["x"] + box["width"] <= 320, f"{state}: {selector} sticks out"
        assert page.is_visible("#sidebar") and not page.is_visible("#settings")
        assert chat.errors == []
    finally:
        chat.close()


def test_api_key_server_refuses_the_page_until_the_key_is_given(browser, stories_path, tmp_path):
    with _serve(stories_path, tmp_path, ["--api-key", "sesame"]) as server:
        chat = Page(browser, server.url)
        try:
            page = chat.page
            assert page.is_visible("#key-form")
            assert page.eval_on_selector_all("#model option", "os => os.length") == 0
            chat.send(PROMPT)
            assert "API key" in chat.error_text()
            assert chat.page.locator(".message.assistant").count() == 0
            page.fill("#api-key", "wrong")
            page.press("#api-key", "Enter")
            page.wait_for_function("() => document.getElementById('key-message').textContent.includes('refused')")
            assert page.is_visible("#key-form")
            page.fill("#api-key", "sesame")
            page.click("#key-save")
            page.wait_for_selector("#key-form", state="hidden")
            assert page.eval_on_selector_all("#model option", "os => os.map(o => o.value)") == [MODEL]
            chat.settings(temperature="0", max_tokens="10")
            page.click("#regenerate")  # the message refused earlier is still there: answer it now
            chat.wait_idle()
            assert chat.error_text() == ""
            assert [role for role, _ in chat.messages()] == ["user", "assistant"]
            assert page.evaluate("sessionStorage.getItem('mlx-ferrum.api-key')") == "sesame"
            assert "sesame" not in json.dumps(page.evaluate("Object.assign({}, localStorage)"))
        finally:
            chat.close()


def test_lost_connection_says_so_and_keeps_the_conversation(browser, stories_path, tmp_path):
    with _serve(stories_path, tmp_path) as server:
        chat = Page(browser, server.url)
        try:
            chat.settings(temperature="0", max_tokens="10")
            chat.send(PROMPT)
            chat.wait_idle()
            before = chat.messages()
            server.process.send_signal(signal.SIGTERM)
            assert server.process.wait(timeout=60) == 0
            chat.send("The dog")
            chat.wait_idle()
            assert "Lost the connection to the server" in chat.error_text()
            assert chat.messages() == before + [("user", "The dog")]
            assert chat.page.locator(".message").count() == 3
        finally:
            chat.close()


def test_no_web_ui_flag_turns_the_page_off(stories_path, tmp_path):
    with _serve(stories_path, tmp_path, ["--no-web-ui"]) as server:
        assert httpx.get(server.url + "/").status_code == 404
        assert httpx.get(server.url + "/web/app.js").status_code == 404
        assert httpx.get(server.url + "/v1/models").status_code == 200
