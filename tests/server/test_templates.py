"""Tool calls through other families' real chat templates (GLM-4.5, Kimi
K2-Thinking, Qwen3-Coder, Qwen3-2507), with the official `openai` client:
the template renders the tools and the history, a forced call comes back as
an OpenAI tool call in each spelling, whole and streamed alike. The model
has random weights: the forced call's opening is what makes it a call."""

import json
import shutil
import tempfile
from pathlib import Path

import openai
import pytest

from conftest import FIXTURES, Server

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

# template dir -> what the call's id looks like
TEMPLATES = {
    "glm4.5": "call_",
    "kimi-k2-thinking": "functions.get_weather:",
    "qwen3-coder": "call_",
    "qwen3-2507-thinking": "call_",
}


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def template_server(request, model_dir):
    tmp = Path(tempfile.mkdtemp(prefix="moeflux-template-test-"))
    dst = tmp / "tiny"
    shutil.copytree(model_dir, dst)
    shutil.copy(FIXTURES / "templates" / request.param / "chat_template.jinja", dst)
    s = Server(dst)
    yield request.param, s
    s.stop()
    shutil.rmtree(tmp, ignore_errors=True)


def test_forced_call_whole_streamed_and_back(template_server):
    name, server = template_server
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = dict(model="tiny", tools=TOOLS, temperature=0, max_tokens=16,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    r = c.chat.completions.create(messages=messages, **kw)
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather", name
    assert call.id.startswith(TEMPLATES[name]), call.id
    assert isinstance(json.loads(call.function.arguments), dict)
    # Streamed: the same call, in deltas.
    got = {"id": None, "name": "", "arguments": ""}
    for chunk in c.chat.completions.create(messages=messages, stream=True, **kw):
        for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            got["id"] = got["id"] or tc.id
            got["name"] += (tc.function.name or "") if tc.function else ""
            got["arguments"] += (tc.function.arguments or "") if tc.function else ""
    assert (got["name"], got["arguments"]) == (call.function.name, call.function.arguments)
    assert got["id"].startswith(TEMPLATES[name])
    # The call and the tool's answer go back through the template.
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 21})},
    ]
    r2 = c.chat.completions.create(model="tiny", messages=messages, tools=TOOLS,
                                   temperature=0, max_tokens=4)
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens
