"""The request body of OpenAI's Responses API (POST /v1/responses, the stateless part), strict like every other
body (strict.py), and its translation into the /v1/chat/completions request that serves it.

Input items: messages (text parts only), function_call and function_call_output items (a tool round trip), and
reasoning items (an earlier answer's thinking, given back to the template as the assistant's reasoning_content).
An earlier response's output items are input items as they are, so a client may send `response.output` back.
Anything that needs stored state (previous_response_id, conversation, prompt) or another modality (image, file,
audio parts) or a built-in tool (web search, file search, ...) is refused by name.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Discriminator, Field, Tag, model_validator
from pydantic_core import PydanticCustomError
from typing_extensions import Self

from hybridmoe.server.errors import APIError
from hybridmoe.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    JsonSchemaFormat,
    Metadata,
    ReasoningEffort,
    ResponseFormat,
    Temperature,
    TopP,
)
from hybridmoe.server.strict import NonNegInt, RequestModel, StrictModel, one_or_list
from hybridmoe.server.tool_protocol import (
    MAX_SCHEMA_CHARS,
    MAX_TOOL_CALLS,
    MAX_TOOLS,
    FunctionCallIn,
    FunctionDef,
    FunctionName,
    FunctionName_,
    NamedToolChoice,
    Schema,
    Tool,
    ToolCallIn,
)

ItemId = Annotated[str, Field(max_length=256)]  # an earlier response's item id, sent back with its item
CallId = Annotated[str, Field(max_length=256)]  # as a chat tool call's id
Arguments = Annotated[str, Field(max_length=MAX_SCHEMA_CHARS * 4)]  # as a chat tool call's arguments
ItemStatus = Literal["in_progress", "completed", "incomplete"]
# include values served: reasoning is returned as text in the reasoning item's content, which a client sends
# back as it is, so the encrypted copy a stateless client asks for has nothing to add
INCLUDABLE = ("reasoning.encrypted_content",)


def _refusing(what: str, supported: str) -> type[StrictModel]:
    """A model that refuses whatever it is given: an item, part or tool of a type this version does not
    implement, named by its `type` (the error's param is the path of that field)."""

    def refuse(cls: type, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        got = f"{kind[:40]!r} {what}" if isinstance(kind, str) else f"{what} without a type"
        raise PydanticCustomError("not_implemented", "{name}: {what} are not implemented in this version "
                                  "({supported})", {"name": "type", "what": got, "supported": supported})

    # made with a name of its own: the OpenAPI schema (/docs) names its models by their class names
    name = "Refused" + "".join(w.capitalize() for w in what.split())
    return type(name, (StrictModel,), {"__module__": __name__, "__qualname__": name, "__doc__": f"Refused {what}.",
                                       "_refuse": model_validator(mode="before")(classmethod(refuse))})


def _by_type(known: tuple[str, ...], default: str | None = None) -> Any:
    """A discriminator: the tag `<type>` of a known type, `<refused>` for any other (a value that is not an
    object goes to the first model, whose error then says what it should be)."""
    def kind(v: Any) -> str:
        if not isinstance(v, dict):
            return f"<{known[0]}>"
        t = v.get("type", default)
        return f"<{t}>" if t in known else "<refused>"
    return Discriminator(kind)


# ---------------------------------------------------------------- content parts


class TextPart(StrictModel):
    """Text content: input_text, or output_text (an earlier response's message sent back)."""

    type: Literal["input_text", "output_text"]
    text: str
    # what an earlier output_text part carries; nothing here reads them
    annotations: list[dict[str, Any]] | None = None
    logprobs: list[dict[str, Any]] | None = None


_PARTS = ("input_text", "output_text")
Part = Annotated[Annotated[TextPart, Tag("<input_text>")] | Annotated[TextPart, Tag("<output_text>")]
                 | Annotated[_refusing("content parts", "input_text and output_text parts are"), Tag("<refused>")],
                 _by_type(_PARTS)]
Content = one_or_list(str, Part)


def _text(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


# ---------------------------------------------------------------- input items


class MessageItem(StrictModel):
    """A message; `type` is optional (OpenAI's "easy" input message)."""

    not_implemented = {"phase": ("message phases", ())}  # null, as the SDK's models dump it, is taken

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Content
    id: ItemId | None = None
    status: ItemStatus | None = None


class FunctionCallItem(StrictModel):
    """A function call the model made earlier (an earlier response's function_call output item)."""

    not_implemented = {"namespace": ("tool namespaces", ()), "caller": ("programmatic tool callers", ()),
                       "async": ("asynchronous function calls", (False,))}

    type: Literal["function_call"]
    call_id: CallId
    name: FunctionName
    arguments: Arguments
    id: ItemId | None = None
    status: ItemStatus | None = None


class FunctionCallOutputItem(StrictModel):
    """The result of a function call, for the call of the same call_id."""

    not_implemented = {"namespace": ("tool namespaces", ()), "caller": ("programmatic tool callers", ())}

    type: Literal["function_call_output"]
    call_id: CallId
    output: Content
    name: FunctionName | None = None  # the function's, for templates that name a tool's result
    id: ItemId | None = None
    status: ItemStatus | None = None


class ReasoningText(StrictModel):
    type: Literal["reasoning_text"]
    text: str


class SummaryText(StrictModel):
    type: Literal["summary_text"]
    text: str


class ReasoningItem(StrictModel):
    """An earlier answer's reasoning (its `content` text reaches the template as the next assistant turn's
    reasoning_content; a summary is not the reasoning and is not used)."""

    not_implemented = {"encrypted_content": ("encrypted reasoning (reasoning is returned and taken as text, in "
                                             "content)", ())}

    type: Literal["reasoning"]
    id: ItemId | None = None
    summary: list[SummaryText] = []
    content: list[ReasoningText] | None = None
    status: ItemStatus | None = None


_ITEMS = ("message", "function_call", "function_call_output", "reasoning")
InputItem = Annotated[
    Annotated[MessageItem, Tag("<message>")] | Annotated[FunctionCallItem, Tag("<function_call>")]
    | Annotated[FunctionCallOutputItem, Tag("<function_call_output>")]
    | Annotated[ReasoningItem, Tag("<reasoning>")]
    | Annotated[_refusing("input items", "message, function_call, function_call_output and reasoning items are"),
                Tag("<refused>")],
    _by_type(_ITEMS, default="message")]
Input = one_or_list(str, InputItem)


def _not_empty(value: Any) -> Any:
    if isinstance(value, list) and not value:
        raise PydanticCustomError("bad_value", "must have at least one item")
    return value


# ---------------------------------------------------------------- tools and options


class FunctionTool(StrictModel):
    """A function the model may call: Responses' flat form of a chat tool."""

    type: Literal["function"]
    name: FunctionName
    description: Annotated[str, Field(max_length=MAX_SCHEMA_CHARS)] | None = None
    parameters: Schema | None = None
    strict: bool | None = None  # arguments always follow the schema when the grammar forces a call


def _unique_names(tools: list[FunctionTool]) -> list[FunctionTool]:
    names = [t.name for t in tools]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        # (not ctx "name": an error's ctx name is taken for the field it is about)
        raise PydanticCustomError("bad_value", "two tools are named {tool}", {"tool": repr(dup)})
    return tools


ToolSpec = Annotated[Annotated[FunctionTool, Tag("<function>")]
                     | Annotated[_refusing("tools", "function tools are"), Tag("<refused>")], _by_type(("function",))]
Tools = Annotated[list[ToolSpec], Field(max_length=MAX_TOOLS), AfterValidator(_unique_names)]


class FunctionChoice(StrictModel):
    """tool_choice naming a function."""

    type: Literal["function"]
    name: FunctionName

    @model_validator(mode="before")
    @classmethod
    def _function_only(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if isinstance(kind, str) and kind != "function":
            raise PydanticCustomError("not_implemented", "{name}: tool_choice of type {kind} is not implemented in "
                                      "this version (none, auto, required or a function are)",
                                      {"name": "type", "kind": repr(kind[:40])})
        return data


ToolChoice = Annotated[Annotated[Literal["none", "auto", "required"], Tag("<one>")]
                       | Annotated[FunctionChoice, Tag("<named>")],
                       Discriminator(lambda v: "<named>" if isinstance(v, dict) else "<one>")]


class TextFormat(StrictModel):
    """text.format: plain text, any JSON object, or JSON following a schema (the chat route's response_format)."""

    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _known_type(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if isinstance(kind, str) and kind not in ("text", "json_object", "json_schema"):
            raise PydanticCustomError("not_implemented", "{name}: format {kind} is not implemented in this version "
                                      "(text, json_object and json_schema are)", {"name": "type", "kind": repr(kind[:40])})
        return data

    @model_validator(mode="after")
    def _named(self) -> Self:
        if self.type == "json_schema" and self.name is None:
            raise PydanticCustomError("bad_request", "a format of type json_schema needs a name (and a schema)")
        return self

    def response_format(self) -> ResponseFormat | None:
        """The chat route's response_format of this format (None: unconstrained text)."""
        if self.type == "text":
            return None
        schema = None
        if self.type == "json_schema":
            assert self.name is not None
            schema = JsonSchemaFormat.model_construct(name=self.name, description=self.description,
                                                      schema_=self.schema_, strict=self.strict)
        return ResponseFormat.model_construct(type=self.type, json_schema=schema)


class TextConfig(StrictModel):
    not_implemented = {"verbosity": ("output verbosity control", ())}

    format: TextFormat | None = None


class ReasoningConfig(StrictModel):
    """`effort` reaches the chat template as `reasoning_effort` (as the chat route's field does: templates that read
    it choose their reasoning by it); the summaries are accepted and echoed (the reasoning is returned as text)."""

    effort: ReasoningEffort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


def _includable(values: list[str]) -> list[str]:
    bad = next((v for v in values if v not in INCLUDABLE), None)
    if bad is not None:
        raise PydanticCustomError("bad_value", "{value} is not implemented in this version (only {ok} is)",
                                  {"value": repr(bad[:80]), "ok": ", ".join(INCLUDABLE)})
    return values


class ResponsesRequest(RequestModel):
    """POST /v1/responses: one answer, streamed or not, nothing stored."""

    not_implemented = {
        "previous_response_id": ("stored responses (nothing is stored here: send the whole conversation in "
                                 "input)", ()),
        "conversation": ("stored conversations (send the whole conversation in input)", ()),
        "prompt": ("stored prompts", ()),
        "background": ("background responses", (False,)),
        "max_tool_calls": ("a limit on built-in tool calls", ()),
        "truncation": ("truncating the input", ("disabled",)),
        "service_tier": ("service tiers", ("auto", "default")),
        "top_logprobs": ("logprobs on /v1/responses (/v1/chat/completions returns them)", (0,)),
        "stream_options": ("stream options", ({},)),
        "prompt_cache_retention": ("prompt cache retention", ()),
    }

    model: str | None = None
    input: Annotated[Input, AfterValidator(_not_empty)]
    instructions: str | None = None  # a system message before the input
    max_output_tokens: NonNegInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stream: bool = False
    tools: Tools | None = None
    tool_choice: ToolChoice | None = None  # None: "auto" with tools
    parallel_tool_calls: bool | None = None  # None: true
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    include: Annotated[list[str], AfterValidator(_includable)] | None = None
    store: bool | None = None  # accepted; nothing is stored either way
    # informational, as on the chat route (echoed in the response)
    metadata: Metadata | None = None
    user: str | None = None
    prompt_cache_key: str | None = None  # the prefix cache needs no key: it finds shared prefixes itself
    safety_identifier: str | None = None


# ---------------------------------------------------------------- -> /v1/chat/completions


class _Messages:
    """Chat messages of input items, in order: function calls join the assistant turn before them (as a chat
    client sends an assistant message with its tool_calls); a reasoning item's text goes to the next assistant
    turn."""

    def __init__(self) -> None:
        self.out: list[ChatMessage] = []
        self.reasoning: str | None = None
        self.calls_may_join = False  # the last message is an assistant turn that later calls may join

    def add(self, msg: ChatMessage) -> None:
        if msg.role == "assistant" and self.reasoning is not None:
            msg.reasoning_content, self.reasoning = self.reasoning, None
        self.out.append(msg)
        self.calls_may_join = msg.role == "assistant"

    def call(self, item: FunctionCallItem, where: str) -> None:
        call = ToolCallIn.model_construct(id=item.call_id, type="function",
                                          function=FunctionCallIn.model_construct(name=item.name,
                                                                                  arguments=item.arguments))
        if not self.calls_may_join:
            self.add(ChatMessage.model_construct(role="assistant", content=None, tool_calls=[]))
        last = self.out[-1]
        last.tool_calls = [*(last.tool_calls or []), call]
        if len(last.tool_calls) > MAX_TOOL_CALLS:
            raise APIError(400, f"{where}: more than {MAX_TOOL_CALLS} function calls in one assistant turn",
                           param=where)

    def item(self, item: Any, where: str) -> None:
        if isinstance(item, MessageItem):
            self.add(ChatMessage.model_construct(role=item.role, content=_text(item.content)))
        elif isinstance(item, FunctionCallItem):
            self.call(item, where)
        elif isinstance(item, FunctionCallOutputItem):
            self.add(ChatMessage.model_construct(role="tool", tool_call_id=item.call_id, name=item.name,
                                                 content=_text(item.output)))
        elif isinstance(item, ReasoningItem):
            text = "".join(c.text for c in item.content or [])
            self.reasoning = (self.reasoning or "") + text if text else self.reasoning


def chat_messages(body: ResponsesRequest) -> list[ChatMessage]:
    """The chat messages of a request: instructions as a system message first, then the input's.

    Built with model_construct: every value was validated by ResponsesRequest with the types the chat models
    use (a body of thousands of items is not validated twice). APIError(400) for an assistant turn of more
    function calls than a chat message may carry."""
    messages = _Messages()
    if body.instructions is not None:
        messages.add(ChatMessage.model_construct(role="system", content=body.instructions))
    if isinstance(body.input, str):
        messages.add(ChatMessage.model_construct(role="user", content=body.input))
        return messages.out
    for i, item in enumerate(body.input):
        messages.item(item, f"input.{i}")
    return messages.out


def chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The /v1/chat/completions request that serves a Responses request (see chat_messages)."""
    tools = [Tool.model_construct(type="function", function=FunctionDef.model_construct(
        name=t.name, description=t.description, parameters=t.parameters, strict=t.strict)) for t in body.tools or []]
    choice: Any = body.tool_choice
    if isinstance(choice, FunctionChoice):
        choice = NamedToolChoice.model_construct(type="function", function=FunctionName_.model_construct(name=choice.name))
    fmt = body.text.format if body.text is not None else None
    return ChatCompletionRequest.model_construct(
        model=body.model, messages=chat_messages(body), max_completion_tokens=body.max_output_tokens,
        temperature=body.temperature, top_p=body.top_p, stream=body.stream, tools=tools or None, tool_choice=choice,
        parallel_tool_calls=body.parallel_tool_calls is not False,
        response_format=fmt.response_format() if fmt is not None else None, user=body.user, metadata=body.metadata,
        reasoning_effort=body.reasoning.effort if body.reasoning is not None else None)
