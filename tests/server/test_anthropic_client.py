"""`moeflux serve`'s Anthropic Messages API through the official `anthropic`
Python client (and raw HTTP where the client hides what is tested). The
model has random weights: tests check structure, determinism and limits,
not meaning."""

import json
import re
import urllib.error
import urllib.request

import anthropic
import pytest

NO_THINK = {"type": "disabled"}
# Every request with tools starts with this question: the prompt up to its
# end (~570 tokens, most of them the template's tool instructions) is
# prefilled once, then served from the prefix cache (the OpenAI client's
# forced-call test asks the same with the same tool).
QUESTION = {"role": "user", "content": "What is the weather in Paris?"}
TOOLS = [{
    "name": "get_weather",
    "description": "Current weather of a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"],
    },
}]
# The stream's own events (the client adds its `text`, `thinking`, ... ones).
RAW = {"message_start", "content_block_start", "content_block_delta",
       "content_block_stop", "message_delta", "message_stop"}


def sampling(kw):
    """The client has no sampling arguments any more: they go in the body."""
    extra = {k: kw.pop(k) for k in ("temperature", "top_p", "top_k") if k in kw}
    if extra:
        kw["extra_body"] = {**kw.get("extra_body", {}), **extra}
    return kw


def client(server, **kw):
    kw.setdefault("api_key", "none")
    return anthropic.Anthropic(base_url=server.url, max_retries=0, timeout=60, **kw)


def ask(c, content, **kw):
    kw.setdefault("thinking", NO_THINK)
    kw.setdefault("max_tokens", 12)
    return c.messages.create(
        model="tiny-qwen", messages=[{"role": "user", "content": content}], **sampling(kw))


def streamed(c, content, **kw):
    """The raw event types, the text streamed and the final message."""
    kw.setdefault("thinking", NO_THINK)
    kw.setdefault("max_tokens", 12)
    with c.messages.stream(model="tiny-qwen", messages=[{"role": "user", "content": content}],
                           **sampling(kw)) as s:
        types = [e.type for e in s if e.type in RAW]
        return types, s.get_final_message()


def blocks(message):
    """Content blocks without their random ids."""
    return [{k: v for k, v in b.model_dump().items() if k != "id"} for b in message.content]


def assert_event_order(types):
    # message_start, (block start, deltas, stop)*, message_delta, message_stop
    order = " ".join(types)
    block = r"(content_block_start( content_block_delta)* content_block_stop )"
    assert re.fullmatch(rf"message_start {block}*message_delta message_stop", order), order


def test_message_non_streaming(server):
    r = ask(client(server), "Hello!", temperature=0)
    assert r.type == "message" and r.role == "assistant" and r.id.startswith("msg_")
    assert r.model == "tiny-qwen"
    assert [b.type for b in r.content] == ["text"] and r.content[0].text
    assert r.stop_reason in ("end_turn", "max_tokens")
    assert r.stop_sequence is None
    assert r.usage.input_tokens > 0 and 1 <= r.usage.output_tokens <= 12


def test_streaming_matches_non_streaming(server):
    c = client(server)
    full = ask(c, "Stream this", temperature=0)
    types, final = streamed(c, "Stream this", temperature=0)
    assert_event_order(types)
    assert types.count("content_block_start") == len(full.content) == 1
    assert blocks(final) == blocks(full)
    assert (final.stop_reason, final.usage.input_tokens, final.usage.output_tokens) == \
        (full.stop_reason, full.usage.input_tokens, full.usage.output_tokens)


def test_thinking_blocks_stream_like_they_answer(server):
    # The template's default: the model starts in its thinking block.
    c = client(server)
    kw = dict(temperature=0, max_tokens=10, thinking={"type": "enabled", "budget_tokens": 1024})
    full = ask(c, "Think about it", **kw)
    assert full.content[0].type == "thinking" and full.content[0].thinking
    types, final = streamed(c, "Think about it", **kw)
    assert_event_order(types)
    assert blocks(final) == blocks(full)


def test_system_as_blocks_is_the_joined_string(server):
    c = client(server)
    parts = ["You are terse.", "Answer in French."]
    as_blocks = ask(c, "Hi", temperature=0, max_tokens=6,
                    system=[{"type": "text", "text": p} for p in parts])
    as_string = ask(c, "Hi", temperature=0, max_tokens=6, system="\n\n".join(parts))
    without = c.messages.count_tokens(model="m", messages=[{"role": "user", "content": "Hi"}],
                                      thinking=NO_THINK).input_tokens
    assert blocks(as_blocks) == blocks(as_string)
    assert as_blocks.usage.input_tokens == as_string.usage.input_tokens > without


def test_count_tokens_is_the_prompt(server):
    c = client(server)
    kw = dict(model="tiny-qwen", tools=TOOLS, thinking=NO_THINK,
              messages=[QUESTION])
    # The forced call's opening is part of the prompt too.
    forced = {"tool_choice": {"type": "tool", "name": "get_weather"}}
    n = c.messages.count_tokens(**kw, **forced).input_tokens
    r = c.messages.create(max_tokens=1, **kw, **forced)
    assert n == r.usage.input_tokens > c.messages.count_tokens(**kw).input_tokens


def test_stop_sequence(server):
    c = client(server)
    full = ask(c, "Once upon a time", temperature=0, max_tokens=16).content[0].text
    cut = next(i for i in range(4, len(full)) if full[i] != "\ufffd" and not full[i].isspace())
    stop = full[cut:cut + 2]
    r = ask(c, "Once upon a time", temperature=0, max_tokens=16,
            stop_sequences=["never-in-this-text", stop])
    assert (r.stop_reason, r.stop_sequence) == ("stop_sequence", stop)
    assert r.content[0].text == full[:full.index(stop)]


def test_tool_round_trip(server):
    c = client(server)
    messages = [QUESTION]
    # The random model never closes a parameter: the call ends with the
    # answer (max_tokens), with what it has.
    kw = dict(model="tiny-qwen", tools=TOOLS, extra_body={"temperature": 0}, max_tokens=8,
              thinking=NO_THINK, tool_choice={"type": "tool", "name": "get_weather"})
    r = c.messages.create(messages=messages, **kw)
    assert r.stop_reason in ("tool_use", "max_tokens")
    calls = [b for b in r.content if b.type == "tool_use"]
    assert calls and calls[0].name == "get_weather" and calls[0].id.startswith("toolu_")
    assert isinstance(calls[0].input, dict)
    # Streamed: the same blocks.
    types, final = streamed(c, messages[0]["content"], **{k: v for k, v in kw.items()
                                                          if k != "model"})
    assert_event_order(types)
    assert blocks(final) == blocks(r)
    # The call and its result go back through the template.
    messages += [
        {"role": "assistant", "content": [b.model_dump() for b in r.content]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": calls[0].id,
             "content": [{"type": "text", "text": json.dumps({"temp_c": 21})}]},
            {"type": "text", "text": "And tomorrow?"}]},
    ]
    r2 = c.messages.create(model="tiny-qwen", messages=messages, tools=TOOLS, max_tokens=1,
                           thinking=NO_THINK, extra_body={"temperature": 0})
    assert r2.usage.input_tokens > r.usage.input_tokens + 10
    # tool_choice "any" with one tool calls it; "none" renders no tools.
    kw["max_tokens"] = 2
    r3 = c.messages.create(messages=messages[:1], **{**kw, "tool_choice": {"type": "any"}})
    assert [b.name for b in r3.content if b.type == "tool_use"] == ["get_weather"]
    r4 = c.messages.create(messages=messages[:1], **{**kw, "tool_choice": {"type": "none"}})
    assert r4.usage.input_tokens < r.usage.input_tokens


def test_api_key(auth_server):
    with pytest.raises(anthropic.AuthenticationError) as e:
        ask(client(auth_server, api_key="wrong"), "x", max_tokens=2)
    assert e.value.status_code == 401
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "authentication_error"
    # x-api-key (the client's default) and Bearer (auth_token) both work.
    assert ask(client(auth_server, api_key="test-key"), "x", max_tokens=2).usage.output_tokens >= 1
    bearer = anthropic.Anthropic(base_url=auth_server.url, auth_token="test-key", max_retries=0)
    assert ask(bearer, "x", max_tokens=2).usage.output_tokens >= 1


def test_bad_requests(server):
    c = client(server)
    for kw, word in [(dict(temperature=5), "temperature"),
                     (dict(max_tokens=100000), "max_tokens"),
                     (dict(tool_choice={"type": "any"}), "tool_choice"),
                     (dict(stop_sequences=[""]), "stop")]:
        with pytest.raises(anthropic.BadRequestError) as e:
            ask(c, "x", **kw)
        assert e.value.status_code == 400
        assert e.value.body["type"] == "error", e.value.body
        assert e.value.body["error"]["type"] == "invalid_request_error"
        assert word in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}])
    assert "`image`" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):
        ask(c, "word " * 9000)
    # What the client would not send, over raw HTTP: no max_tokens, bad
    # JSON, an unknown path under /v1/messages.
    for path, body, status, kind in [
            ("/v1/messages", {"messages": [{"role": "user", "content": "x"}]}, 400,
             "invalid_request_error"),
            ("/v1/messages", "{not json", 400, "invalid_request_error"),
            ("/v1/messages/batches", {}, 404, "not_found_error")]:
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        req = urllib.request.Request(server.url + path, data=data,
                                     headers={"content-type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req)
        assert e.value.code == status
        err = json.load(e.value)
        assert err["type"] == "error" and err["error"]["type"] == kind and err["error"]["message"]
