"""`moeflux serve` through the official `openai` Python client (and raw
HTTP where the client hides what is tested). The model has random weights:
tests check structure, determinism and limits, not meaning."""

import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest

NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}]


def client(server, **kw):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=kw.pop("api_key", "none"),
                         max_retries=kw.pop("max_retries", 0), timeout=60, **kw)


def ask(c, content, **kw):
    kw.setdefault("extra_body", NO_THINK)
    return c.chat.completions.create(
        model="tiny-qwen", messages=[{"role": "user", "content": content}], **kw)


def test_models_and_health(server):
    models = client(server).models.list()
    assert [m.id for m in models.data] == ["tiny-qwen"]
    with urllib.request.urlopen(server.url + "/health") as r:
        assert json.load(r)["status"] == "ok"


def test_chat_non_streaming(server):
    r = ask(client(server), "Hello!", temperature=0, max_tokens=10)
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 0 and 1 <= r.usage.completion_tokens <= 10
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_streaming_matches_non_streaming(server):
    c = client(server)
    full = ask(c, "Stream this", temperature=0, max_tokens=12)
    stream = ask(c, "Stream this", temperature=0, max_tokens=12, stream=True,
                 stream_options={"include_usage": True})
    text, finishes, usage = "", [], None
    for chunk in stream:
        if chunk.usage is not None and not chunk.choices:
            usage = chunk.usage
        for ch in chunk.choices:
            text += ch.delta.content or ""
            if ch.finish_reason:
                finishes.append(ch.finish_reason)
    assert text == full.choices[0].message.content
    assert finishes == [full.choices[0].finish_reason]
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens


def test_seed_and_sampling_parameters(server):
    c = client(server)
    kw = dict(temperature=1.0, top_p=0.9, seed=42, max_tokens=8,
              presence_penalty=0.5, frequency_penalty=0.3)
    a = ask(c, "Random text", **kw).choices[0].message.content
    b = ask(c, "Random text", **kw).choices[0].message.content
    assert a == b
    different = {ask(c, "Random text", **{**kw, "seed": s}).choices[0].message.content
                 for s in range(1, 5)}
    assert len(different) > 1


def test_stop_string(server):
    c = client(server)
    full = c.completions.create(model="tiny-qwen", prompt="Once upon a time",
                                temperature=0, max_tokens=16).choices[0].text
    cut = next(i for i in range(4, len(full)) if full[i] != "\ufffd" and not full[i].isspace())
    stop = full[cut:cut + 2]
    r = c.completions.create(model="tiny-qwen", prompt="Once upon a time",
                             temperature=0, max_tokens=16, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == full[:full.index(stop)]


def test_completions_streaming(server):
    c = client(server)
    full = c.completions.create(model="tiny-qwen", prompt="Hello", temperature=0, max_tokens=8)
    assert full.object == "text_completion"
    parts = list(c.completions.create(model="tiny-qwen", prompt="Hello", temperature=0,
                                      max_tokens=8, stream=True))
    assert "".join(p.choices[0].text for p in parts if p.choices) == full.choices[0].text


def test_forced_tool_call_round_trip(server):
    c = client(server)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = c.chat.completions.create(
        model="tiny-qwen", messages=messages, tools=TOOLS, temperature=0, max_tokens=32,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        extra_body=NO_THINK)
    choice = r.choices[0]
    assert choice.finish_reason in ("tool_calls", "length")
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather"
    assert call.id.startswith("call_")
    assert isinstance(json.loads(call.function.arguments), dict)
    # The call and the tool's answer go back through the template.
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 21})},
    ]
    r2 = c.chat.completions.create(model="tiny-qwen", messages=messages, tools=TOOLS,
                                   temperature=0, max_tokens=4, extra_body=NO_THINK)
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens


def test_tool_call_streamed_as_deltas(server):
    c = client(server)
    kw = dict(model="tiny-qwen", tools=TOOLS, tool_choice="required", temperature=0,
              max_tokens=32, extra_body=NO_THINK,
              messages=[{"role": "user", "content": "Weather in Oslo for 3 days?"}])
    full = c.chat.completions.create(**kw).choices[0].message.tool_calls
    assert full, "required tool_choice gave no call"
    calls = {}
    for chunk in c.chat.completions.create(stream=True, **kw):
        for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            slot = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            slot["id"] = slot["id"] or tc.id
            slot["name"] += (tc.function.name or "") if tc.function else ""
            slot["arguments"] += (tc.function.arguments or "") if tc.function else ""
    assert [(v["id"] is not None, v["name"], v["arguments"]) for _, v in sorted(calls.items())] == \
        [(True, f.function.name, f.function.arguments) for f in full]


def test_bad_requests(server):
    c = client(server)
    cases = [
        (dict(temperature=5), "temperature"),
        (dict(max_tokens=100000), "max_tokens"),
        (dict(n=3), "n"),
        (dict(extra_body={"top_p": 0}), "top_p"),
    ]
    for kw, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            ask(c, "x", **kw)
        assert e.value.status_code == 400
        assert e.value.body["param"] == param, e.value.body
        assert param in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="m", messages=[{"role": "wizard", "content": "x"}])
    assert e.value.body["param"] == "messages[0].role"
    with pytest.raises(openai.BadRequestError) as e:
        ask(c, "word " * 9000)
    assert e.value.body["code"] == "context_length_exceeded"
    # Malformed JSON and unknown paths, over raw HTTP.
    for path, body, status in [("/v1/chat/completions", b"{not json", 400),
                               ("/v1/chat/completions", b"[]", 400),
                               ("/v1/embeddings", b"{}", 404)]:
        req = urllib.request.Request(server.url + path, data=body,
                                     headers={"content-type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req)
        assert e.value.code == status
        err = json.load(e.value)["error"]
        assert err["message"] and err["type"] and "param" in err and "code" in err
    # Too large a body: 413, and the server goes on.
    req = urllib.request.Request(server.url + "/v1/chat/completions", data=b" " * (5 << 20))
    try:
        urllib.request.urlopen(req)
        raise AssertionError("accepted a 5 MiB body")
    except urllib.error.HTTPError as e:
        assert e.code == 413
    except (ConnectionError, urllib.error.URLError):
        pass  # the server may close the connection before reading it all
    assert ask(c, "still there?", max_tokens=2).choices[0].message is not None


def test_api_key(auth_server):
    with pytest.raises(openai.AuthenticationError):
        client(auth_server).models.list()
    with pytest.raises(openai.AuthenticationError):
        ask(client(auth_server, api_key="wrong"), "x", max_tokens=2)
    r = ask(client(auth_server, api_key="test-key"), "x", max_tokens=2)
    assert r.usage.completion_tokens >= 1
    with urllib.request.urlopen(auth_server.url + "/health") as r:
        assert r.status == 200


def test_chat_page_and_no_ui(server, auth_server, no_ui_server):
    # The page is public (the API is not), with its CSP; --no-ui drops it.
    for s in (server, auth_server):
        with urllib.request.urlopen(s.url + "/") as r:
            assert r.headers["Content-Type"] == "text/html; charset=utf-8"
            assert r.headers["Content-Security-Policy"].startswith("default-src 'none';")
            assert b'<script src="/ui/app.js"' in r.read()
    for path in ("/", "/ui/app.js"):
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(no_ui_server.url + path)
        assert e.value.code == 404


def _wait_cancelled(server, before):
    for _ in range(200):
        m = server.metrics()
        if m["moeflux_requests_cancelled_total"] > before and m["moeflux_requests_running"] == 0:
            return m
        time.sleep(0.05)
    raise AssertionError(f"generation not cancelled: {server.metrics()}")


def _raw_request(server, body):
    s = socket.create_connection((server.host, server.port))
    data = json.dumps(body).encode()
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
              b"Content-Type: application/json\r\nContent-Length: "
              + str(len(data)).encode() + b"\r\n\r\n" + data)
    return s


def test_disconnect_cancels_generation(server):
    # ignore_eos: the answer is 4000 tokens whatever the random model says
    # (seconds of work; the client leaves after a fraction of one).
    body = {"messages": [{"role": "user", "content": "Tell me everything"}],
            "max_tokens": 4000, "ignore_eos": True, "temperature": 1, "seed": 3, **NO_THINK}
    generated = server.metrics()["moeflux_generated_tokens_total"]
    # Streaming: read the first bytes, then hang up.
    before = server.metrics()["moeflux_requests_cancelled_total"]
    s = _raw_request(server, {**body, "stream": True})
    assert s.recv(100).startswith(b"HTTP/1.1 200")
    s.close()
    m = _wait_cancelled(server, before)
    # Non-streaming: hang up while it generates.
    before = m["moeflux_requests_cancelled_total"]
    s = _raw_request(server, body)
    time.sleep(0.2)
    s.close()
    m = _wait_cancelled(server, before)
    # Both stopped well before their 4000 tokens.
    assert m["moeflux_generated_tokens_total"] - generated < 2 * 3000
    assert ask(client(server), "after", max_tokens=2).usage.completion_tokens >= 1


def test_load_32_clients_x_20_requests(load_server):
    c = client(load_server)
    for i in range(3):  # warm up, then measure
        ask(c, f"warm {i}", max_tokens=4)
    rss_before = load_server.rss_kib()
    statuses, errors = [], []

    def worker(k):
        cl = client(load_server)
        for j in range(20):
            try:
                r = ask(cl, f"client {k} request {j}: tell me about {k * j}", max_tokens=4,
                        temperature=0.7, seed=k * 100 + j)
                assert r.choices[0].message is not None
                statuses.append(200)
            except openai.RateLimitError as e:
                assert int(e.response.headers["retry-after"]) >= 1
                statuses.append(429)
            except Exception as e:  # noqa: BLE001 - recorded, then failed below
                errors.append(repr(e))

    def round_():
        threads = [threading.Thread(target=worker, args=(k,)) for k in range(32)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    round_()
    rss_after = load_server.rss_kib()
    round_()
    rss_after2 = load_server.rss_kib()
    assert not errors, errors[:5]
    assert len(statuses) == 2 * 32 * 20
    assert set(statuses) <= {200, 429}
    assert statuses.count(200) >= 32, statuses.count(200)
    assert statuses.count(429) > 0  # the queue of 4 did fill
    print(f"load: {statuses.count(200)} x 200, {statuses.count(429)} x 429; "
          f"VmRSS {rss_before} -> {rss_after} -> {rss_after2} KiB")
    # Bounded memory: the first round may grow caches to their limits; the
    # second must not keep growing.
    assert rss_after < rss_before + 96 * 1024, (rss_before, rss_after)
    assert rss_after2 < rss_after + 16 * 1024, (rss_after, rss_after2)
    m = load_server.metrics()
    assert m['moeflux_requests_total{endpoint="chat",status="429"}'] == statuses.count(429)
    assert m["moeflux_queue_depth"] == 0


def test_concurrent_streams_equal_each_request_alone(parallel_server, alone_server):
    # More streams than slots, of different prompt and answer lengths, all
    # at once; each stream's text must be what the request gives alone.
    prompts = [f"stream {i}: " + "tell me about rivers and seas " * (1 + 3 * (i % 4))
               for i in range(6)]
    lengths = [8 + 6 * i for i in range(6)]
    texts = [None] * len(prompts)
    errors = []

    def stream(i):
        try:
            out = []
            for chunk in ask(client(parallel_server), prompts[i], temperature=0,
                             max_tokens=lengths[i], stream=True,
                             extra_body={"ignore_eos": True, **NO_THINK}):
                if chunk.choices and chunk.choices[0].delta.content:
                    out.append(chunk.choices[0].delta.content)
            texts[i] = "".join(out)
        except Exception as e:  # noqa: BLE001 - recorded, then failed below
            errors.append(repr(e))

    before = parallel_server.metrics()
    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    after = parallel_server.metrics()
    for i, p in enumerate(prompts):
        alone = ask(client(alone_server), p, temperature=0, max_tokens=lengths[i],
                    extra_body={"ignore_eos": True, **NO_THINK})
        assert texts[i] == alone.choices[0].message.content, i
    steps = after["moeflux_steps_total"] - before["moeflux_steps_total"]
    seqs = after["moeflux_step_sequences_total"] - before["moeflux_step_sequences_total"]
    assert seqs / steps > 1.5, (seqs, steps)  # the streams did share steps
