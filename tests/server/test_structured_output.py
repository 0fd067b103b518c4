"""Structured output through the official `openai` client's helpers:
`chat.completions.parse` with a Pydantic model (whole and streamed),
`json_schema` and `json_object` response formats, and a strict tool call.
The model has random weights: unconstrained, it writes no JSON; schemas
bound their strings and lists so that it finishes them within a few hundred
tokens."""

import json
from enum import Enum
from typing import Annotated, List, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
MESSAGES = [{"role": "user", "content": "Describe a product as JSON."}]


class Kind(str, Enum):
    book = "book"
    tool = "tool"
    food = "food"


class Price(BaseModel):
    amount: Annotated[int, Field(ge=0, le=999)]
    currency: Literal["EUR", "USD"]


class Product(BaseModel):
    name: Annotated[str, Field(max_length=8)]
    kind: Kind
    tags: Annotated[List[Annotated[str, Field(max_length=4)]], Field(max_length=3)]
    price: Price
    in_stock: bool


class GetWeather(BaseModel):
    city: Annotated[str, Field(max_length=10)]
    unit: Literal["celsius", "fahrenheit"]
    days: Annotated[int, Field(ge=1, le=7)]


def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def test_unconstrained_answer_is_not_json(server):
    r = client(server).chat.completions.create(
        model="tiny-qwen", messages=MESSAGES, temperature=0, max_tokens=40, extra_body=NO_THINK)
    with pytest.raises(json.JSONDecodeError):
        json.loads(r.choices[0].message.content)


@pytest.mark.parametrize("temperature,seed", [(0, None), (1.0, 3), (0.8, 11)])
def test_parse_with_a_pydantic_model(server, temperature, seed):
    r = client(server).chat.completions.parse(
        model="tiny-qwen", messages=MESSAGES, response_format=Product, temperature=temperature,
        seed=seed, max_tokens=300, extra_body=NO_THINK)
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Product)
    jsonschema.validate(json.loads(choice.message.content), Product.model_json_schema())


def test_streamed_parse_matches_whole(server):
    c = client(server)
    kw = dict(model="tiny-qwen", messages=MESSAGES, response_format=Product, temperature=0,
              max_tokens=300, extra_body=NO_THINK)
    whole = c.chat.completions.parse(**kw).choices[0].message
    deltas = []
    with c.chat.completions.stream(**kw) as stream:
        for event in stream:
            if event.type == "content.delta":
                deltas.append(event.delta)
        final = stream.get_final_completion().choices[0].message
    assert len(deltas) > 1
    assert "".join(deltas) == whole.content
    assert final.parsed == whole.parsed


def test_json_schema_and_json_object(server):
    schema = {
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "level": {"enum": ["low", "high"]},
            "points": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                       "minItems": 1, "maxItems": 4},
        },
        "required": ["ok", "level", "points"],
        "additionalProperties": False,
    }
    c = client(server)
    r = c.chat.completions.create(
        model="tiny-qwen", messages=MESSAGES, temperature=0, max_tokens=100, extra_body=NO_THINK,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "status", "strict": True, "schema": schema}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    # json_object: any object. This random model writes long free strings
    # (a key of ~50 tokens, greedy), so `max_tokens` cuts the answer:
    # `length` and an incomplete object, as OpenAI returns it.
    r = c.chat.completions.create(
        model="tiny-qwen", messages=MESSAGES, temperature=0, max_tokens=12, extra_body=NO_THINK,
        response_format={"type": "json_object"})
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "length"
    assert text.startswith('{"')
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny-qwen", messages=MESSAGES, max_tokens=5,
                                  response_format={"type": "json_schema",
                                                   "json_schema": {"schema": schema}})
    assert e.value.body["param"] == "response_format.json_schema.name"


def test_strict_tool_call(server):
    r = client(server).chat.completions.parse(
        model="tiny-qwen", messages=[{"role": "user", "content": "Weather in Rome?"}],
        tools=[openai.pydantic_function_tool(GetWeather)],
        tool_choice={"type": "function", "function": {"name": "GetWeather"}},
        temperature=0, max_tokens=200, extra_body=NO_THINK)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.function.name == "GetWeather"
    assert isinstance(call.function.parsed_arguments, GetWeather)
    jsonschema.validate(json.loads(call.function.arguments), GetWeather.model_json_schema())
