"""Request bodies of the HTTP API (pydantic): SGLang's native endpoints and the OpenAI API.

Field names follow SGLang and OpenAI. Unknown fields are accepted and ignored (clients send many
optional OpenAI fields); the values of known fields are type-checked here, their ranges by the
engine (SamplingParams.validate), so both APIs report the same message for the same mistake.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# ---------------------------------------------------------------- SGLang native


class GenerateRequest(BaseModel):
    """POST /generate. One prompt (text or input_ids) or a batch (lists); batches do not stream."""

    model_config = ConfigDict(extra="ignore")

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    rid: str | list[str] | None = None
    lora_path: str | list[str | None] | None = None


class TokenizeRequest(BaseModel):
    """POST /tokenize."""

    model_config = ConfigDict(extra="ignore")

    prompt: str | list[str]
    add_special_tokens: bool = True
    model: str | None = None


class DetokenizeRequest(BaseModel):
    """POST /detokenize."""

    model_config = ConfigDict(extra="ignore")

    tokens: list[int] | list[list[int]]
    skip_special_tokens: bool = True
    model: str | None = None


class AbortRequest(BaseModel):
    """POST /abort_request: one request by rid, or every request with abort_all."""

    model_config = ConfigDict(extra="ignore")

    rid: str = ""
    abort_all: bool = False


# ---------------------------------------------------------------- OpenAI


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(BaseModel):
    """Sampling fields shared by /v1/completions and /v1/chat/completions (OpenAI + SGLang extras)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    user: str | None = None
    # SGLang extras
    top_k: int = -1
    min_p: float = 0.0
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    rid: str | None = None


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: bool = False
