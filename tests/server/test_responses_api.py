"""POST /v1/responses against real servers (demo model) with the official `openai` client and raw HTTP: the
answer, usage and limits are the chat route's for the same messages (each test compares with
/v1/chat/completions, not with fixed strings); streamed events come in OpenAI's order with increasing sequence
numbers and add up to the non-streamed response; every object validates against the SDK's own models; tools,
reasoning items and structured output go through the chat machinery; bad requests are 400s naming the field; a
client that hangs up aborts its request."""

from __future__ import annotations

import asyncio
import json
import re
import time
import typing
from types import SimpleNamespace

import httpx
import jsonschema
import pytest

from hybridmoe.server.async_engine import EngineFailed
from hybridmoe.server.chat_tools import ChatPlan
from hybridmoe.server.openai_api import ChatJob
from hybridmoe.server.responses_api import _events

openai = pytest.importorskip("openai")
from openai.types.responses import Response, ResponseStreamEvent  # noqa: E402

QUESTION = "What does json.dumps do?"
WEATHER = {"type": "function", "name": "get_weather", "description": "the weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Rome"]},
                                                           "unit": {"type": "string", "enum": ["c", "f"]}},
                          "required": ["city", "unit"]}}
# ChatML whose generation prompt opens a thinking part: with --reasoning-parser qwen3 the answer starts as reasoning
THINK_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + (m['content'] or '') + '<|im_end|>'"
                  " + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}"
                  "{% endif %}")
# the SDK's event models by their `type`, to validate each event against its own model
_EVENT_MODELS = {typing.get_args(m.model_fields["type"].annotation)[0]: m
                 for m in typing.get_args(typing.get_args(ResponseStreamEvent)[0])}


@pytest.fixture(scope="module")
def oai(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def tools_srv(start_server, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "think.jinja"
    template.write_text(THINK_TEMPLATE)
    return start_server("--tool-call-parser", "qwen25", "--reasoning-parser", "qwen3", "--chat-template",
                        str(template), "--served-model-name", "demo")


@pytest.fixture(scope="module")
def toai(tools_srv):
    with openai.OpenAI(base_url=tools_srv.url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def _post(url: str, body: dict) -> dict:
    """A non-streamed response, validated against the SDK's Response model (every field it declares)."""
    r = httpx.post(url + "/v1/responses", json=body, timeout=120)
    assert r.status_code == 200, r.text
    Response.model_validate(r.json())
    return r.json()


def _stream(url: str, body: dict) -> list[dict]:
    """A streamed response's events: each named by its `event:` line, validated against its SDK model."""
    events, name = [], None
    with httpx.stream("POST", url + "/v1/responses", json=dict(body, stream=True), timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                event = json.loads(line[len("data: "):])
                assert event["type"] == name, (name, event)
                _EVENT_MODELS[event["type"]].model_validate(event)
                events.append(event)
    return events


def _chat(client, messages: list[dict], n: int, **kw):
    return client.chat.completions.create(model="demo", messages=messages, max_tokens=n, temperature=0, **kw)


def _text_of(response: dict) -> str:
    return "".join(p["text"] for item in response["output"] if item["type"] == "message" for p in item["content"])


def _same_items(a: list[dict], b: list[dict]) -> None:
    """Two output arrays alike but for their ids (a streamed and a non-streamed answer)."""
    def strip(items):
        return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items]
    assert strip(a) == strip(b)


# ---------------------------------------------------------------- the answer is the chat route's


def test_text_and_usage_equal_the_chat_routes(oai, server):
    r = oai.responses.create(model="demo", input=QUESTION, max_output_tokens=16, temperature=0)
    chat = _chat(oai, [{"role": "user", "content": QUESTION}], 16)
    assert r.output_text == chat.choices[0].message.content and r.output_text
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == \
        (chat.usage.prompt_tokens, chat.usage.completion_tokens, chat.usage.total_tokens)
    assert r.status == {"stop": "completed", "length": "incomplete"}[chat.choices[0].finish_reason]
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "demo" and r.error is None
    raw = _post(server.url, {"model": "demo", "input": QUESTION, "max_output_tokens": 16, "temperature": 0,
                             "metadata": {"k": "v"}, "store": True, "user": "u1", "reasoning": {"effort": "low"},
                             "include": ["reasoning.encrypted_content"]})
    assert _text_of(raw) == r.output_text
    assert raw["metadata"] == {"k": "v"} and raw["user"] == "u1" and raw["max_output_tokens"] == 16
    assert raw["store"] is False  # nothing is stored, whatever was asked
    [message] = raw["output"]
    assert message["type"] == "message" and message["role"] == "assistant" and message["id"].startswith("msg_")


def test_instructions_are_a_system_message_first(oai):
    r = oai.responses.create(model="demo", instructions="Answer in French.", input=QUESTION, max_output_tokens=16,
                             temperature=0)
    chat = _chat(oai, [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": QUESTION}], 16)
    plain = _chat(oai, [{"role": "user", "content": QUESTION}], 1)
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens > plain.usage.prompt_tokens
    assert r.instructions == "Answer in French."


def test_a_conversation_equals_the_chat_routes(oai):
    """Messages of each role, plain and as parts (an earlier output_text sent back), in order."""
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is a list?"}]},
             {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed", "phase": None,
              "content": [{"type": "output_text", "text": "A sequence.", "annotations": [], "logprobs": None}]},
             {"role": "user", "content": "And a tuple?"}]
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "What is a list?"},
                {"role": "assistant", "content": "A sequence."}, {"role": "user", "content": "And a tuple?"}]
    r = oai.responses.create(model="demo", input=items, max_output_tokens=16, temperature=0)
    chat = _chat(oai, messages, 16)
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    shorter = _chat(oai, messages[1:], 1)  # every item reaches the prompt
    assert shorter.usage.prompt_tokens < r.usage.input_tokens


def test_the_length_limit_makes_an_incomplete_response(oai, server):
    chat = _chat(oai, [{"role": "user", "content": QUESTION}], 3)
    assert chat.choices[0].finish_reason == "length"
    raw = _post(server.url, {"input": QUESTION, "max_output_tokens": 3, "temperature": 0})
    assert raw["status"] == "incomplete" and raw["incomplete_details"] == {"reason": "max_output_tokens"}
    assert raw["usage"]["output_tokens"] == 3 and raw["completed_at"] is None
    assert _text_of(raw) == chat.choices[0].message.content
    assert raw["output"][0]["status"] == "incomplete"
    done = _post(server.url, {"input": QUESTION, "max_output_tokens": 200, "temperature": 0})
    assert done["status"] == "completed" and done["incomplete_details"] is None and done["completed_at"]


# ---------------------------------------------------------------- streaming


def _event_order(events: list[dict]) -> list[str]:
    """Event types with runs of one delta type folded into one."""
    out: list[str] = []
    for e in events:
        if not (out and out[-1] == e["type"] and e["type"].endswith(".delta")):
            out.append(e["type"])
    return out


@pytest.mark.parametrize("limit,terminal", [(40, "response.completed"), (4, "response.incomplete")])
def test_stream_events_add_up_to_the_response(server, limit, terminal):
    body = {"input": QUESTION, "max_output_tokens": limit, "temperature": 0}
    whole = _post(server.url, body)
    events = _stream(server.url, body)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert _event_order(events) == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", terminal]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == _text_of(whole) and text
    assert next(e for e in events if e["type"] == "response.output_text.done")["text"] == text
    final = events[-1]["response"]
    assert final["status"] == whole["status"] and final["usage"] == whole["usage"]
    assert final["id"] == events[0]["response"]["id"]
    _same_items(final["output"], whole["output"])


def test_the_sdk_streams_and_accumulates(oai):
    whole = oai.responses.create(model="demo", input=QUESTION, max_output_tokens=16, temperature=0)
    events = list(oai.responses.create(model="demo", input=QUESTION, max_output_tokens=16, temperature=0, stream=True))
    assert events[0].type == "response.created" and events[-1].type == f"response.{whole.status}"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    # the SDK's stream helper checks item identities and rebuilds the response from the events
    with oai.responses.stream(model="demo", input=QUESTION, max_output_tokens=16, temperature=0) as stream:
        for _ in stream:
            pass
        final = stream.get_final_response()
    assert final.output_text == whole.output_text and final.usage == whole.usage


# ---------------------------------------------------------------- tools, reasoning, structured output


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}])
def test_a_forced_call_is_a_function_call_item(toai, tools_srv, choice):
    body = {"input": "What is the weather in Paris?", "tools": [WEATHER], "tool_choice": choice,
            "parallel_tool_calls": False, "max_output_tokens": 200, "temperature": 0}
    whole = _post(tools_srv.url, body)
    [call] = whole["output"]
    assert call["type"] == "function_call" and call["name"] == "get_weather" and call["status"] == "completed"
    args = json.loads(call["arguments"])
    assert args["city"] in ("Paris", "Oslo", "Rome") and args["unit"] in ("c", "f")
    assert whole["status"] == "completed" and call["call_id"] and call["id"].startswith("fc_")
    chat_choice = choice if isinstance(choice, str) else {"type": "function", "function": {"name": "get_weather"}}
    chat = toai.chat.completions.create(model="demo", messages=[{"role": "user", "content": body["input"]}],
                                        tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items()
                                                                                 if k != "type"}}],
                                        tool_choice=chat_choice, parallel_tool_calls=False, max_tokens=200,
                                        temperature=0)
    assert [(c.function.name, c.function.arguments) for c in chat.choices[0].message.tool_calls] == \
        [(call["name"], call["arguments"])]
    events = _stream(tools_srv.url, body)
    assert _event_order(events) == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    pieces = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert pieces == call["arguments"] == events[-2]["item"]["arguments"]
    _same_items(events[-1]["response"]["output"], whole["output"])


def test_a_function_call_output_round_trip(toai, tools_srv):
    """The first response's output sent back with the call's result: served as the chat route serves the same
    conversation (an assistant turn with the call, then the tool's message)."""
    first = toai.responses.create(model="demo", input="What is the weather in Paris?", tools=[WEATHER],
                                  tool_choice="required", parallel_tool_calls=False, max_output_tokens=200,
                                  temperature=0)
    call = first.output[-1]
    assert call.type == "function_call"
    items = [{"role": "user", "content": "What is the weather in Paris?"},
             *first.output,  # the SDK's own objects, sent back as they came
             {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"}]
    r = toai.responses.create(model="demo", input=items, tools=[WEATHER], max_output_tokens=24, temperature=0)
    chat = toai.chat.completions.create(model="demo", max_tokens=24, temperature=0, messages=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function", "function": {
            "name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "18 C, sunny"}],
        tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}])
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    reasoning = [item for item in r.output if item.type == "reasoning"]
    assert "".join(c.text for item in reasoning for c in item.content) == (chat.choices[0].message.reasoning_content or "")
    assert r.output_text == (chat.choices[0].message.content or "")


def test_reasoning_is_a_reasoning_item(toai, tools_srv):
    """--reasoning-parser: the thinking part is a reasoning item before the message, streamed as reasoning_text."""
    body = {"input": "Tell me about Paris", "max_output_tokens": 12, "temperature": 0}
    chat = _chat(toai, [{"role": "user", "content": body["input"]}], 12)
    whole = _post(tools_srv.url, body)
    kinds = [item["type"] for item in whole["output"]]
    assert kinds == ["reasoning", "message"], whole["output"]
    assert whole["output"][0]["content"][0]["text"] == chat.choices[0].message.reasoning_content
    assert _text_of(whole) == (chat.choices[0].message.content or "")
    assert 0 < whole["usage"]["output_tokens_details"]["reasoning_tokens"] <= whole["usage"]["output_tokens"]
    events = _stream(tools_srv.url, body)
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == \
        chat.choices[0].message.reasoning_content
    assert _event_order(events)[2:7] == ["response.output_item.added", "response.content_part.added",
                                         "response.reasoning_text.delta", "response.reasoning_text.done",
                                         "response.content_part.done"]
    _same_items(events[-1]["response"]["output"], whole["output"])


def test_text_format_json_schema_gives_valid_json(oai, server):
    schema = {"type": "object", "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 8},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    fmt = {"type": "json_schema", "name": "person", "schema": schema, "strict": True}
    r = oai.responses.create(model="demo", input="Describe a person.", max_output_tokens=200, temperature=0,
                             text={"format": fmt})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)
    chat = _chat(oai, [{"role": "user", "content": "Describe a person."}], 200, response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}})
    assert r.output_text == chat.choices[0].message.content
    assert r.text.format.type == "json_schema"
    obj = oai.responses.create(model="demo", input="JSON please.", max_output_tokens=200, temperature=0,
                               text={"format": {"type": "json_object"}})
    json_chat = _chat(oai, [{"role": "user", "content": "JSON please."}], 200, response_format={"type": "json_object"})
    assert obj.output_text == json_chat.choices[0].message.content


# ---------------------------------------------------------------- bad requests


@pytest.mark.parametrize("extra,status,param", [
    ({"previous_response_id": "resp_1"}, 400, "previous_response_id"),
    ({"conversation": "conv_1"}, 400, "conversation"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/a.png"}]}]}, 400,
     "input.0.content.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_file",
                                                                                   "file_id": "f"}]}]}, 400,
     "input.0.content.1.type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, 400, "input.0.type"),
    ({"tools": [{"type": "web_search"}]}, 400, "tools.0.type"),
    ({"tools": [WEATHER, WEATHER]}, 400, "tools"),
    ({"tool_choice": {"type": "file_search"}}, 400, "tool_choice.type"),
    ({"tool_choice": "required"}, 400, "tool_choice"),
    ({"input": "hello " * 3000}, 400, "input"),
    ({"max_output_tokens": 5000}, 400, "max_output_tokens"),
    ({"input": 5}, 400, "input"),
    ({"input": []}, 400, "input"),
    ({"input": ["hi"]}, 400, "input.0"),
    ({"max_output_tokens": "5"}, 400, "max_output_tokens"),
    ({"temperature": True}, 400, "temperature"),
    ({"top_p": 0}, 400, "top_p"),
    ({"stream": "yes"}, 400, "stream"),
    ({"top_logprobs": 2}, 400, "top_logprobs"),
    ({"include": ["message.output_text.logprobs"]}, 400, "include"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": 3}}}}, 400, "text.format"),
    ({"input": [{"role": "user", "content": "x", "extra": 1}]}, 400, "input.0.extra"),
    ({"no_such_field": 1}, 400, "no_such_field"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, 400, "metadata"),  # OpenAI's 16 pairs (was echoed unbounded)
    ({"metadata": {"k": "v" * 513}}, 400, "metadata.k"),
    ({"model": "demo:no-such-adapter"}, 404, "model"),
])
def test_bad_requests_name_the_param(server, extra, status, param):
    r = httpx.post(server.url + "/v1/responses", json={"input": "hi", "max_output_tokens": 2, **extra}, timeout=60)
    assert r.status_code == status, r.text
    body = r.json()
    assert body["object"] == "error" and body["error"]["code"] == status and body["error"]["type"], body
    assert body["error"]["param"] == param, body


def test_a_stream_whose_client_hangs_up_is_aborted(server, http):
    """A grammar that needs hundreds of tokens (over 10 s here) keeps the request running unless the hang-up
    aborts it: it must be gone within a few seconds, counted as aborted."""
    def aborted() -> float:
        found = re.search(r"^sglang:num_aborted_requests_total\{[^}]*\} (\S+)", http.get("/metrics").text, re.M)
        return float(found.group(1)) if found else 0.0

    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 300}
    body = {"input": "numbers", "max_output_tokens": 1500, "temperature": 0, "stream": True,
            "text": {"format": {"type": "json_schema", "name": "numbers", "schema": schema}}}
    before = aborted()
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=60) as r:
        assert r.status_code == 200
        next(line for line in r.iter_lines() if line.startswith("data: ") and "output_text.delta" in line)
    deadline = time.time() + 5
    while (info := http.get("/get_server_info").json())["num_running_reqs"] or info["kv_used_pages"]:
        assert time.time() < deadline, f"the abandoned request still runs: {info}"
        time.sleep(0.05)
    assert aborted() == before + 1


# ---------------------------------------------------------------- a failure after the 200


class _FailingStream:
    """A request stream whose engine fails it after one piece of text: with an abort that carries the failure
    (a grammar that dead-ends, a request's non-finite values), or by raising EngineFailed (the engine died)."""

    def __init__(self, how: str) -> None:
        self.how, self.rid, self.finished = how, "r1", False

    async def __aiter__(self):
        yield {"text": "Hello", "meta_info": {"finish_reason": None}}
        if self.how == "raise":
            raise EngineFailed("engine failure: RuntimeError: boom")
        yield {"text": "Hello", "meta_info": {"finish_reason": {
            "type": "abort", "message": "request failed: GrammarError: the sampled token does not fit"}}}


@pytest.mark.parametrize("how,code", [("abort", "invalid_prompt"), ("raise", "server_error")])
def test_a_failure_mid_stream_ends_with_an_error_and_response_failed(how, code):
    req = SimpleNamespace(rid="r1", params=SimpleNamespace(stop_strs=[]))
    job = ChatJob(req=req, plan=ChatPlan(), tail="", grammar=None)  # type: ignore[arg-type]
    shell = {"id": "resp_r1", "object": "response", "output": [], "status": "in_progress"}

    async def collect() -> list[dict]:
        chunks = [c async for c in _events(None, _FailingStream(how), job, shell)]  # type: ignore[arg-type]
        return [json.loads(c.decode().split("data: ", 1)[1]) for c in chunks]

    events = asyncio.run(collect())
    assert [e["type"] for e in events][-3:] == ["response.output_text.delta", "error", "response.failed"]
    assert events[-2]["code"] == code and events[-2]["message"]
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == code
    assert failed["output"][0]["content"][0]["text"] == "Hello"  # the output so far
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_reasoning_effort_goes_to_the_chat_requests_template_variable():
    """reasoning.effort becomes the chat request's reasoning_effort (the template's variable); a value OpenAI does not
    define is refused."""
    from pydantic import ValidationError

    from hybridmoe.server.responses_protocol import ResponsesRequest, chat_request

    body = ResponsesRequest.model_validate({"input": "hi", "reasoning": {"effort": "high"}})
    assert chat_request(body).reasoning_effort == "high"
    assert chat_request(ResponsesRequest.model_validate({"input": "hi"})).reasoning_effort is None
    with pytest.raises(ValidationError):
        ResponsesRequest.model_validate({"input": "hi", "reasoning": {"effort": "extreme"}})

