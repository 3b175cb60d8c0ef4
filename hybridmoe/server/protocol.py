"""Request bodies of the HTTP API (strict pydantic): SGLang's native endpoints and the OpenAI API.

Field names follow SGLang and OpenAI. Validation is strict (see strict.py): exact JSON types,
documented ranges (the same bounds SamplingParams.validate enforces, imported from it), valid
Unicode, unknown fields refused, unimplemented fields refused by name. What depends on the model
(token ids below the vocabulary size, top_k <= vocab, max_new_tokens within the context) is
checked by the engine (Engine.make_request) and ServerState.build_req; the number of top logprobs
is capped by `check_top_logprobs` with the server's `max_top_logprobs_num`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Discriminator, Field, Tag, model_validator
from pydantic_core import PydanticCustomError
from typing_extensions import Self

from hybridmoe.engine.request import (
    INT64_MAX,
    MAX_FREQUENCY_PENALTY,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_REPETITION_PENALTY,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
)
from hybridmoe.server.errors import APIError
from hybridmoe.server.strict import (
    Int64,
    NonNegInt,
    RequestModel,
    Rid,
    Stop,
    StrictModel,
    TokenId,
    TokenIds,
    TopK,
    finite,
    one_or_list,
)
from hybridmoe.server.tool_protocol import TemplateKwargs, ToolCalls, ToolChoice, Tools

DEFAULT_MAX_TOP_LOGPROBS_NUM = 20  # OpenAI's cap; each one costs a top-k over the vocabulary per token

Temperature = finite(0, MAX_TEMPERATURE)
TopP = finite(0, 1, lo_open=True)
MinP = finite(0, 1)
RepetitionPenalty = finite(0, MAX_REPETITION_PENALTY, lo_open=True)
Penalty = finite(-MAX_FREQUENCY_PENALTY, MAX_FREQUENCY_PENALTY)
PosInt = Annotated[int, Field(ge=1, le=INT64_MAX)]
StopTokenIds = Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)]
# token id (decimal string, OpenAI's JSON keys) -> bias; ids are checked against the vocabulary by the engine
LogitBias = Annotated[dict[Annotated[str, Field(max_length=19)], finite(-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)],
                      Field(max_length=MAX_LOGIT_BIAS_ENTRIES)]
# a grammar's text; its size is bounded by the server's --max-grammar-size (structured.py)
GrammarText = Annotated[str, Field(min_length=1)]

_STRUCTURED = "structured output"


def check_top_logprobs(value: int, field: str, cap: int = DEFAULT_MAX_TOP_LOGPROBS_NUM) -> None:
    """APIError(400) when more top logprobs per token are asked for than the server's cap."""
    if value > cap:
        raise APIError(400, f"{field}={value} is above this server's limit of {cap} top logprobs per token "
                            "(--max-top-logprobs-num raises it)", param=field)


def max_top_logprobs_num(state: Any) -> int:
    """The server's cap: ServerState.limits.max_top_logprobs_num where the server has that setting."""
    limits = getattr(state, "limits", None)
    return int(getattr(limits, "max_top_logprobs_num", DEFAULT_MAX_TOP_LOGPROBS_NUM))


# ---------------------------------------------------------------- SGLang native


class SamplingParamsIn(StrictModel):
    """/generate's sampling_params: SamplingParams' fields, typed and range-checked."""

    not_implemented = {
        "structural_tag": (_STRUCTURED + " (structural_tag)", ()),
        "custom_params": ("custom logit processor parameters", ({},)),
        "stream_interval": ("a custom stream interval", (1,)),
    }

    max_new_tokens: NonNegInt | None = None
    min_new_tokens: NonNegInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    repetition_penalty: RepetitionPenalty | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    stop: Stop | None = None
    stop_token_ids: StopTokenIds | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    n: PosInt | None = None
    sampling_seed: Int64 | None = None
    seed: Int64 | None = None  # OpenAI's spelling of sampling_seed
    json_schema: GrammarText | None = None  # a JSON Schema as a JSON string
    regex: GrammarText | None = None
    ebnf: GrammarText | None = None
    logit_bias: LogitBias | None = None


def _as_dict(params: SamplingParamsIn) -> dict[str, Any]:
    return params.model_dump(exclude_none=True)  # null means "the default"


# After validation a sampling_params value is the dict of the fields given (what the engine takes).
SamplingDict = Annotated[SamplingParamsIn, AfterValidator(_as_dict)]


StartLen = Annotated[int, Field(ge=-1, le=INT64_MAX)]


class GenerateRequest(RequestModel):
    """POST /generate. One prompt (text or input_ids) or a batch (lists); batches do not stream.

    `sampling_params` and `rid` are one value, or a list with one entry per prompt of a batch.
    After validation `sampling_params` holds plain dicts (see SamplingDict).
    """

    not_implemented = {
        "image_data": ("image input", ()), "audio_data": ("audio input", ()), "video_data": ("video input", ()),
        "input_embeds": ("input embeddings", ()), "modalities": ("multimodal input", ([],)),
        "return_hidden_states": ("hidden-state output", (False,)),
        "token_ids_logprob": ("logprobs of given token ids", ()),
        "custom_logit_processor": ("custom logit processors", ()), "session_params": ("sessions", ()),
        # sglang-router forwards these with their defaults
        "background": ("background requests", (False,)), "return_bytes": ("byte output", (False,)),
        "return_entropy": ("entropy output", (False,)),
    }

    text: one_or_list(str, str) | None = None
    model: str | None = None  # sent by sglang-router (null); the server serves one model
    log_metrics: bool = True  # SGLang's per-request metrics switch; metrics here are per server
    no_logs: bool = False  # accepted for SGLang clients; --log-requests still logs the request
    input_ids: TokenIds | None = None
    sampling_params: one_or_list(SamplingDict, SamplingDict) | None = None
    stream: bool = False
    # each of these three: one value for every prompt, or (a batch) a list of one per prompt, as SGLang takes them
    return_logprob: one_or_list(bool, bool) = False
    top_logprobs_num: one_or_list(NonNegInt, NonNegInt) = 0
    # prompt logprobs from this position on (-1: none; SGLang's default), with return_logprob
    logprob_start_len: one_or_list(StartLen, StartLen) = -1
    return_text_in_logprobs: bool = False
    rid: one_or_list(Rid, Rid) | None = None
    lora_path: one_or_list(str, str | None) | None = None

    @property
    def batch_size(self) -> int | None:
        """None for one prompt, else the number of prompts."""
        if isinstance(self.text, list):
            return len(self.text)
        if self.input_ids and isinstance(self.input_ids[0], list):
            return len(self.input_ids)
        return None

    @model_validator(mode="after")
    def _lists_match_the_batch(self) -> Self:
        n = self.batch_size
        for name in ("sampling_params", "rid"):
            value = getattr(self, name)
            if not isinstance(value, list):
                continue
            if n is None:
                raise PydanticCustomError("bad_request", "{name} is a list but there is one prompt: give one value "
                                          "(or a list of prompts in text/input_ids)", {"name": name})
            if len(value) != n:
                raise PydanticCustomError("bad_request", "{name} has {got} entries for {n} prompts",
                                          {"name": name, "got": len(value), "n": n})
        if n is not None and isinstance(self.rid, str):
            raise PydanticCustomError("bad_request", "rid must be a list of {n} distinct strings for a batch of {n} "
                                      "prompts", {"n": n})
        if isinstance(self.rid, list) and len(set(self.rid)) != len(self.rid):
            raise PydanticCustomError("bad_request", "rid has repeated values; each prompt needs its own")
        return self


class TokenizeRequest(RequestModel):
    """POST /tokenize."""

    prompt: one_or_list(str, str)
    add_special_tokens: bool = True
    model: str | None = None


class DetokenizeRequest(RequestModel):
    """POST /detokenize."""

    tokens: TokenIds
    skip_special_tokens: bool = True
    model: str | None = None


class AbortRequest(RequestModel):
    """POST /abort_request: one request by rid, or every request with abort_all."""

    rid: Rid = ""
    abort_all: bool = False


# ---------------------------------------------------------------- OpenAI


class StreamOptions(StrictModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(StrictModel):
    """response_format.json_schema: OpenAI's structured outputs (the schema is always enforced)."""

    name: Annotated[str, Field(min_length=1, max_length=256)]
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    """OpenAI's response_format: text (no constraint), json_object (any JSON object), json_schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="before")
    @classmethod
    def _known_type(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if isinstance(kind, str) and kind not in ("text", "json_object", "json_schema"):
            raise PydanticCustomError("not_implemented", "type: {kind} is not implemented in this version (text, "
                                      "json_object and json_schema are)", {"kind": repr(kind[:40])})
        return data

    @model_validator(mode="after")
    def _schema_given(self) -> Self:
        if self.type == "json_schema" and self.json_schema is None:
            raise PydanticCustomError("bad_request", "response_format of type json_schema needs a json_schema "
                                      "object (name, schema, strict)")
        return self


# OpenAI's bounds on `metadata`: 16 pairs, keys of 64 characters, values of 512 (informational here; /v1/responses
# echoes it, so an unbounded one made a 20,000-key body a 2 MB answer)
Metadata = Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                     Field(max_length=16)]


class SamplingFields(RequestModel):
    """Sampling fields shared by /v1/completions and /v1/chat/completions (OpenAI + SGLang extras).

    A null field takes its default. `user` and `metadata` are informational in OpenAI's API and
    accepted as such.
    """

    not_implemented = {
        "store": ("stored completions", (False,)), "service_tier": ("service tiers", ("auto", "default")),
        "return_hidden_states": ("hidden-state output", (False,)),
    }

    model: str | None = None
    max_tokens: NonNegInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    n: PosInt | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Stop | None = None
    seed: Int64 | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    user: str | None = None
    metadata: Metadata | None = None
    # SGLang extras
    top_k: TopK | None = None
    min_p: MinP | None = None
    min_tokens: NonNegInt | None = None
    repetition_penalty: RepetitionPenalty | None = None
    stop_token_ids: StopTokenIds | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    rid: Rid | None = None
    # a loaded LoRA adapter's name, as /generate's lora_path (SGLang's field; openai_api.request_adapters): one
    # name, or on /v1/completions a list of one per prompt (null entries: the base model)
    lora_path: one_or_list(str, str | None) | None = None
    # structured output and logit bias (server/structured.py turns them into sampling parameters)
    logit_bias: LogitBias | None = None
    response_format: ResponseFormat | None = None
    regex: GrammarText | None = None  # SGLang extras
    ebnf: GrammarText | None = None
    json_schema: GrammarText | None = None


def _prompt_shape(v: Any) -> str:
    if not isinstance(v, list):
        return "<text>"
    if v and isinstance(v[0], str):
        return "<texts>"
    if v and isinstance(v[0], list):
        return "<id-lists>"
    return "<ids>"


CompletionPrompt = Annotated[
    Annotated[str, Tag("<text>")] | Annotated[list[str], Tag("<texts>")] | Annotated[list[TokenId], Tag("<ids>")]
    | Annotated[list[list[TokenId]], Tag("<id-lists>")], Discriminator(_prompt_shape)]


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    not_implemented = SamplingFields.not_implemented | {
        "suffix": ("suffix (insertion)", ("",)), "best_of": ("server-side best-of sampling", (1,))}

    prompt: CompletionPrompt
    max_tokens: NonNegInt | None = 16
    echo: bool = False
    logprobs: NonNegInt | None = None


class ContentPart(StrictModel):
    """One part of a chat message's content: text only in this version."""

    type: Literal["text"]
    text: str

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if isinstance(kind, str) and kind != "text":
            raise PydanticCustomError("unsupported_part", "{kind} content parts are not implemented in this version "
                                      "(text parts only)", {"kind": kind[:40]})
        return data


class ChatMessage(StrictModel):
    not_implemented = {
        "function_call": ("function calls", ()), "audio": ("audio", ()),
    }

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: one_or_list(str, ContentPart) | None = None
    name: str | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    tool_calls: ToolCalls | None = None  # an assistant message's earlier calls (tool_protocol.py)

    @property
    def text(self) -> str | None:
        """The content as one string (text parts joined)."""
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]  # OpenAI's values


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    not_implemented = SamplingFields.not_implemented | {
        "functions": ("function calling (functions)", ([],)),
        "function_call": ("function calling (function_call)", ("none", "auto")),
        "audio": ("audio output", ()), "modalities": ("output modalities other than text", (["text"],)),
        "prediction": ("predicted outputs", ()),
        "web_search_options": ("web search", ()),
    }

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    # SGLang's reasoning-parser switches (sglang-router sends them, true): no effect without a reasoning parser
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    max_completion_tokens: NonNegInt | None = None
    logprobs: bool = False
    top_logprobs: NonNegInt | None = None
    chat_template_kwargs: TemplateKwargs | None = None
    # the chat template's `reasoning_effort` variable (templates that read it, gpt-oss-style, choose their reasoning
    # by it; the others render as without it); chat_template_kwargs' own reasoning_effort wins
    reasoning_effort: ReasoningEffort | None = None
    continue_final_message: bool = False
    # tool calling and reasoning (tool_protocol.py, parsers/)
    tools: Tools | None = None
    tool_choice: ToolChoice | None = None  # None: "auto" with tools, else "none"
    parallel_tool_calls: bool = True
    separate_reasoning: bool = True  # SGLang: split the thinking part out (with --reasoning-parser)
    stream_reasoning: bool = True  # SGLang: False sends the reasoning in one chunk once it ends
