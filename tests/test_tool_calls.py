"""OpenAI tool calling through the real openai SDK: `required` and a named function constrain a
random model to a valid call (streaming and not); `auto` parses calls out of text; bad tools and
unknown names are 400s naming the field. Parsers are checked on fixed texts."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from server_utils import running_server
from srt.entrypoints.openai.tool_calls import ToolCallParser, parse_tool_plan

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 6}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(llama_model):
    with running_server(llama_model, "--max-total-tokens", "16384") as handle:
        yield openai.OpenAI(base_url=handle.url + "/v1", api_key="unused")


def _check_call(call, names=("get_weather", "get_time")):
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_gives_a_valid_call_on_a_random_model(client):
    out = client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                         max_tokens=96, temperature=1.0, n=8)
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        _check_call(choice.message.tool_calls[0])


def test_named_function_is_the_one_called_streaming_and_not(client):
    choice = {"type": "function", "function": {"name": "get_time"}}
    out = client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                         max_tokens=64, temperature=1.0)
    _check_call(out.choices[0].message.tool_calls[0], names=("get_time",))
    chunks = list(client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                                 max_tokens=64, temperature=1.0, stream=True))
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].index == 0
    _check_call(calls[0], names=("get_time",))
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_auto_on_the_demo_model_answers_text_or_a_parsed_call():
    """The embedded demo model (no --model-path): with tools and `auto` it answers in text (a
    model that never learned tools); the same reply parsed with a call appended gives the call."""
    from srt.server_args import DEMO_MODEL_DIR

    with running_server(DEMO_MODEL_DIR, "--max-total-tokens", "4096") as handle:
        demo = openai.OpenAI(base_url=handle.url + "/v1", api_key="unused")
        for stream in (False, True):
            kw = dict(model="m", messages=MESSAGES, tools=TOOLS, max_tokens=24, temperature=0)
            if stream:
                chunks = list(demo.chat.completions.create(stream=True, **kw))
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
            else:
                out = demo.chat.completions.create(**kw)
                text, calls = out.choices[0].message.content or "", out.choices[0].message.tool_calls or []
            assert calls == [] and text.strip()
    content, calls = ToolCallParser(_plan()).parse(
        text + '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>')
    assert content == text.strip() and calls[0]["function"]["name"] == "get_time"


@pytest.mark.parametrize("extra,param", [
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
])
def test_bad_tools_and_unknown_names_are_400_naming_the_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4, extra_body=extra)
    assert err.value.body["param"] == param


def test_tool_results_round_trip_through_the_template(client):
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"c\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}]
    out = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=4, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")


def _plan(choice="auto"):
    return parse_tool_plan({"tools": TOOLS, "tool_choice": choice})


def test_hermes_parser_finds_calls_in_text_and_streams_them():
    text = 'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n' \
           '</tool_call> and <tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
    content, calls = ToolCallParser(_plan()).parse(text)
    assert content == "Let me check.  and" and [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo", "unit": "c"}
    parser, streamed, got = ToolCallParser(_plan()), "", []
    pieces = [text[i:i + 7] for i in range(0, len(text), 7)]
    for i, piece in enumerate(pieces):
        out, calls = parser.feed(piece, final=i == len(pieces) - 1)
        streamed += out
        got += calls
        assert "<tool" not in out
    assert streamed == "Let me check.  and " and [c["index"] for c in got] == [0, 1]
    plain, none = ToolCallParser(_plan()).parse("No call here, <tool_call>broken")
    assert none == [] and plain == "No call here, <tool_call>broken"


def test_llama3_parser_reads_a_json_call_and_leaves_text_alone():
    parser = ToolCallParser(_plan(), "llama3")
    content, calls = parser.parse('<|python_tag|>{"name": "get_time", "parameters": {"zone": "CET"}}')
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"zone": "CET"}
    assert ToolCallParser(_plan(), "llama3").parse("It is sunny.") == ("It is sunny.", [])
    assert ToolCallParser(_plan(), "llama3").parse('{"name": "unknown", "parameters": {}}')[1] == []
