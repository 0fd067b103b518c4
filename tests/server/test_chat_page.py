"""The chat page (`GET /`) in a real browser: Playwright (PyPI) driving
Debian's Chromium (`/usr/bin/chromium`, or $CHROMIUM; never a browser
downloaded by Playwright). Run by tests/server/browser.sh, which installs
both; elsewhere skipped when either is missing. Every test fails on any
console error or uncaught exception in the page (a CSP violation included)."""

import json
import os
import time

import pytest

pytestmark = pytest.mark.browser

# browser.sh sets this: a missing browser or package is then a failure.
REQUIRED = os.environ.get("MOEFLUX_BROWSER_TESTS") == "1"
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")

if REQUIRED:
    from playwright.sync_api import expect, sync_playwright
else:
    sync_api = pytest.importorskip("playwright.sync_api")
    expect, sync_playwright = sync_api.expect, sync_api.sync_playwright

TIMEOUT_MS = 15_000


@pytest.fixture(scope="module")
def browser():
    if not os.path.exists(CHROMIUM):
        (pytest.fail if REQUIRED else pytest.skip)(f"no Chromium at {CHROMIUM}")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True)
        yield b
        b.close()


class Page:
    """A fresh browser context's page, recording console errors."""

    def __init__(self, browser):
        self.context = browser.new_context()
        self.page = self.context.new_page()
        self.page.set_default_timeout(TIMEOUT_MS)
        expect.set_options(timeout=TIMEOUT_MS)
        self.errors = []
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(f"uncaught: {e}"))
        self.requests = []
        self.page.on("request", lambda r: r.url.endswith("/v1/chat/completions")
                     and self.requests.append(json.loads(r.post_data)))

    def settings(self, **fields):
        p = self.page
        p.click("#settings-toggle")
        for field, value in fields.items():
            if field == "thinking":
                p.select_option("#thinking", value)
            else:
                p.fill(f"#{field}", value)
        p.click("#settings-toggle")

    def send(self, text):
        self.page.fill("#input", text)
        self.page.press("#input", "Enter")


@pytest.fixture
def page(browser):
    p = Page(browser)
    yield p
    p.context.close()


def content(page, i):
    """The answer text of the i-th assistant message."""
    return page.page.locator(".msg.assistant").nth(i).locator("> .content")


def test_chat_streams_stops_and_reloads(server, page):
    p = page.page
    p.goto(server.url + "/")
    expect(p.locator("#model")).to_contain_text("tiny-qwen")
    page.settings(**{"max-tokens": "12", "temperature": "0", "thinking": "off",
                     "system": "You are terse."})

    # Shift+Enter is a new line, Enter sends.
    p.fill("#input", "Hello")
    p.press("#input", "Shift+Enter")
    p.keyboard.type("there")
    assert p.input_value("#input") == "Hello\nthere"
    p.press("#input", "Enter")
    expect(content(page, 0)).not_to_be_empty()
    assert p.locator(".msg.user .text").inner_text() == "Hello\nthere"
    expect(p.locator("#send")).to_be_visible()
    expect(p.locator("#speed")).to_contain_text("tok/s")
    sent = page.requests[0]
    assert sent["stream"] is True and sent["model"] == "tiny-qwen"
    assert sent["max_tokens"] == 12 and sent["temperature"] == 0
    assert sent["chat_template_kwargs"] == {"enable_thinking": False}
    assert sent["messages"] == [{"role": "system", "content": "You are terse."},
                                {"role": "user", "content": "Hello\nthere"}]
    first_answer = content(page, 0).inner_text()

    # A long answer (ignore_eos added on the way: the random model may end
    # early otherwise), stopped from the page mid-stream.
    def long_answer(route):
        body = json.loads(route.request.post_data)
        route.continue_(post_data=json.dumps({**body, "max_tokens": 4000, "ignore_eos": True}))
    p.route("**/v1/chat/completions", long_answer)
    before = server.metrics()
    page.send("Tell me everything")
    expect(p.locator("#stop")).to_be_visible()
    expect(content(page, 1)).not_to_be_empty()
    shown = len(content(page, 1).inner_text())
    # Text keeps arriving while the answer streams.
    deadline = time.time() + 10
    while len(content(page, 1).inner_text()) == shown and time.time() < deadline:
        time.sleep(0.05)
    assert len(content(page, 1).inner_text()) > shown, "the answer did not stream"
    p.click("#stop")
    expect(p.locator("#send")).to_be_visible()
    expect(p.locator("#stop")).to_be_hidden()
    expect(p.locator(".msg.assistant").nth(1).locator(".note")).to_have_text("stopped")
    # The server stopped generating when the page hung up.
    for _ in range(200):
        m = server.metrics()
        if (m["moeflux_requests_cancelled_total"] > before["moeflux_requests_cancelled_total"]
                and m["moeflux_requests_running"] == 0):
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"generation not cancelled: {server.metrics()}")
    generated = m["moeflux_generated_tokens_total"] - before["moeflux_generated_tokens_total"]
    assert generated < 4000, generated
    stopped_text = content(page, 1).inner_text()
    p.unroute("**/v1/chat/completions")

    # The conversation survives a reload (local storage), the settings too.
    p.reload()
    expect(p.locator("#model")).to_contain_text("tiny-qwen")
    expect(p.locator(".msg")).to_have_count(4)
    assert content(page, 0).inner_text() == first_answer
    assert content(page, 1).inner_text() == stopped_text
    assert p.input_value("#max-tokens") == "12"
    # And goes on from there: the stopped answer is part of the history.
    page.send("Go on")
    expect(p.locator(".msg.assistant")).to_have_count(3)
    expect(content(page, 2)).not_to_be_empty()
    expect(p.locator("#send")).to_be_visible()
    history = page.requests[-1]["messages"]
    assert [m["role"] for m in history] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert history[4]["content"] == stopped_text

    # New chat clears it, in storage too.
    p.click("#new-chat")
    expect(p.locator(".msg")).to_have_count(0)
    p.reload()
    expect(p.locator("#model")).to_contain_text("tiny-qwen")
    expect(p.locator(".msg")).to_have_count(0)
    assert page.errors == []


SSE = [
    {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
    {"choices": [{"index": 0, "delta": {"reasoning_content": "The user wants "}}]},
    {"choices": [{"index": 0, "delta": {"reasoning_content": "<b>weather</b>."}}]},
    {"choices": [{"index": 0, "delta": {"content": "Checking <img src=x onerror=alert(1)> `now`"}}]},
    {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                                        "function": {"name": "get_weather", "arguments": ""}}]}}]},
    {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{\"city\": "}}]}}]},
    {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "\"Paris\"}"}}]}}]},
    {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}],
     "usage": {"prompt_tokens": 20, "completion_tokens": 21, "total_tokens": 41},
     "timings": {"decode_ms": 1000.0}},
]


def test_reasoning_tool_calls_and_markup_as_text(server, page):
    """A canned stream (the random model calls no tools): reasoning in a
    collapsible block, the call's name and arguments, markup shown as text,
    and the next message sent as the call's result."""
    p = page.page
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in SSE) + ": keep-alive\n\ndata: [DONE]\n\n"
    p.route("**/v1/chat/completions", lambda r: r.fulfill(
        status=200, headers={"content-type": "text/event-stream"}, body=body))
    p.goto(server.url + "/")
    expect(p.locator("#model")).to_contain_text("tiny-qwen")
    page.send("Weather in Paris?")
    reply = p.locator(".msg.assistant").first
    expect(reply.locator(".tool-call .name")).to_have_text("get_weather")
    expect(reply.locator(".tool-call pre")).to_have_text('{\n  "city": "Paris"\n}')
    reasoning = reply.locator("details.reasoning")
    expect(reasoning).to_have_js_property("open", False)  # closed once it answered
    reasoning.locator("summary").click()
    expect(reasoning).to_have_js_property("open", True)
    expect(reasoning.locator(".text")).to_have_text("The user wants <b>weather</b>.")
    expect(reply.locator("> .content")).to_have_text("Checking <img src=x onerror=alert(1)> now")
    expect(reply.locator("> .content code")).to_have_text("now")
    assert p.locator(".msg img, .msg b").count() == 0
    expect(p.locator("#speed")).to_have_text("20.0 tok/s · 21 tokens")

    # The next message answers the call.
    expect(p.locator("#input-label")).to_contain_text("get_weather")
    page.send("18 C, sunny")
    expect(p.locator(".msg.tool pre")).to_have_text("18 C, sunny")
    messages = page.requests[-1]["messages"]
    assert messages[1]["tool_calls"] == [{"id": "call_1", "type": "function",
                                          "function": {"name": "get_weather",
                                                       "arguments": "{\"city\": \"Paris\"}"}}]
    assert messages[2] == {"role": "tool", "tool_call_id": "call_1", "name": "get_weather",
                           "content": "18 C, sunny"}
    assert page.errors == []


def test_asks_for_the_api_key(auth_server, page):
    p = page.page
    p.goto(auth_server.url + "/")
    expect(p.locator("#key-form")).to_be_visible()
    p.fill("#api-key", "wrong")
    p.press("#api-key", "Enter")
    expect(p.locator("#key-error")).to_contain_text("refused")
    p.fill("#api-key", "test-key")
    p.click("#key-form button")
    expect(p.locator("#model")).to_contain_text("tiny-qwen")
    expect(p.locator("#key-form")).to_be_hidden()
    page.settings(**{"max-tokens": "4", "thinking": "off"})
    page.send("hi")
    expect(content(page, 0)).not_to_be_empty()
    expect(p.locator("#send")).to_be_visible()
    # The key is remembered.
    p.reload()
    expect(p.locator("#model")).to_contain_text("tiny-qwen")
    expect(p.locator("#key-form")).to_be_hidden()
    # The browser reports each refused request; nothing else went wrong.
    assert [e for e in page.errors if "401" not in e] == []
    assert len(page.errors) == 2, page.errors

