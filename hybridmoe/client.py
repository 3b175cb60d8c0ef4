"""Python client for a hybridmoe (or SGLang) server: `Client` (blocking) and `AsyncClient`.

    from hybridmoe import Client
    c = Client(port=30000)
    out = c.generate(prompt="The default value", max_new_tokens=16, temperature=0)
    print(out.output_text, out.finish_reason)
    for chunk in c.generate(prompt="Hello", max_new_tokens=16, stream=True):
        print(chunk.delta, end="")

Sampling parameters are keyword arguments with SGLang's names; those left at None take the
server's defaults. A server error raises ServerError carrying the server's message and status.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

__all__ = ["AsyncClient", "ChatChunk", "ChatOutput", "Client", "GenerateChunk", "GenerateOutput", "SGLangClient",
           "ServerError"]


class ServerError(RuntimeError):
    """The server answered with an error (or the stream carried one)."""

    def __init__(self, status_code: int, message: str, body: Any = None) -> None:
        super().__init__(f"{status_code}: {message}")
        self.status_code = status_code
        self.message = message
        self.body = body


@dataclass
class GenerateOutput:
    """A finished /generate request."""

    output_text: str
    output_ids: list[int]
    finish_reason: dict | None
    meta_info: dict
    raw: dict = field(repr=False, default_factory=dict)

    @property
    def text(self) -> str:
        return self.output_text


@dataclass
class GenerateChunk:
    """One streamed /generate event: cumulative text and ids, plus the new text since the last chunk."""

    text: str
    delta: str
    output_ids: list[int]
    finish_reason: dict | None
    meta_info: dict


@dataclass
class ChatOutput:
    """A finished chat completion."""

    output_text: str
    finish_reason: str | None
    usage: dict
    raw: dict = field(repr=False, default_factory=dict)


@dataclass
class ChatChunk:
    """One streamed chat completion delta."""

    delta: str
    finish_reason: str | None
    raw: dict = field(repr=False, default_factory=dict)


def _sampling(**kw: Any) -> dict[str, Any]:
    return {k: v for k, v in kw.items() if v is not None}


def _generate_body(prompt: str | None, input_ids: list[int] | None, sampling: dict[str, Any], stream: bool,
                   return_logprob: bool, top_logprobs_num: int, rid: str | None) -> dict[str, Any]:
    if (prompt is None) == (input_ids is None):
        raise ValueError("give exactly one of prompt= and input_ids=")
    body: dict[str, Any] = {"sampling_params": sampling, "stream": stream}
    body["text" if prompt is not None else "input_ids"] = prompt if prompt is not None else input_ids
    if return_logprob:
        body.update(return_logprob=True, top_logprobs_num=top_logprobs_num)
    if rid is not None:
        body["rid"] = rid
    return body


def _chat_body(messages: list[dict[str, Any]], model: str, stream: bool, params: dict[str, Any]) -> dict[str, Any]:
    return dict(params, model=model, messages=messages, stream=stream)


def _raise_for(status: int, content: bytes) -> None:
    if status < 400:
        return
    try:
        body = json.loads(content)
    except ValueError:
        raise ServerError(status, content.decode(errors="replace") or "error", None) from None
    message = body.get("message") if isinstance(body, dict) else None
    if message is None and isinstance(body, dict) and isinstance(body.get("error"), dict):
        message = body["error"].get("message")
    raise ServerError(status, str(message or body), body)


def _events(line: str) -> dict | None:
    """Parse one SSE line; None for keep-alives, blank lines and the final [DONE]."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return None
    event = json.loads(data)
    if isinstance(event, dict) and "error" in event and "choices" not in event and "text" not in event:
        err = event["error"]
        raise ServerError(err.get("code", 500) if isinstance(err, dict) else 500,
                          err.get("message", str(err)) if isinstance(err, dict) else str(err), event)
    return event


def _output(d: dict) -> GenerateOutput:
    meta = d.get("meta_info", {})
    return GenerateOutput(d.get("text", ""), d.get("output_ids", []), meta.get("finish_reason"), meta, d)


def _chat_output(d: dict) -> ChatOutput:
    choice = d["choices"][0]
    return ChatOutput(choice["message"].get("content") or "", choice.get("finish_reason"), d.get("usage", {}), d)


class _Base:
    def __init__(self, host: str = "localhost", port: int = 30000, api_key: str | None = None,
                 timeout: float = 600.0, base_url: str | None = None) -> None:
        self.base_url = (base_url or f"http://{host}:{port}").rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = timeout
        self.model = "default"


class Client(_Base):
    """Blocking client. `Client(host="localhost", port=30000, api_key=None)`."""

    def __init__(self, host: str = "localhost", port: int = 30000, api_key: str | None = None,
                 timeout: float = 600.0, base_url: str | None = None) -> None:
        super().__init__(host, port, api_key, timeout, base_url)
        self._http = httpx.Client(base_url=self.base_url, headers=self.headers, timeout=timeout)

    def _post(self, path: str, body: dict[str, Any]) -> Any:
        r = self._http.post(path, json=body)
        _raise_for(r.status_code, r.content)
        return r.json() if r.content else None

    def _get(self, path: str) -> Any:
        r = self._http.get(path)
        _raise_for(r.status_code, r.content)
        return r.json() if r.content else None

    def _stream(self, path: str, body: dict[str, Any]) -> Iterator[dict]:
        with self._http.stream("POST", path, json=body) as r:
            if r.status_code >= 400:
                _raise_for(r.status_code, r.read())
            for line in r.iter_lines():
                event = _events(line)
                if event is not None:
                    yield event

    def generate(self, prompt: str | None = None, *, input_ids: list[int] | None = None,
                 max_new_tokens: int | None = None, min_new_tokens: int | None = None,
                 temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                 min_p: float | None = None, repetition_penalty: float | None = None,
                 frequency_penalty: float | None = None, presence_penalty: float | None = None,
                 stop: str | list[str] | None = None, stop_token_ids: list[int] | None = None,
                 ignore_eos: bool | None = None, skip_special_tokens: bool | None = None,
                 spaces_between_special_tokens: bool | None = None, no_stop_trim: bool | None = None,
                 n: int | None = None, seed: int | None = None, stream: bool = False, return_logprob: bool = False,
                 top_logprobs_num: int = 0, rid: str | None = None) -> GenerateOutput | Iterator[GenerateChunk]:
        """POST /generate. Returns a GenerateOutput, or with stream=True an iterator of GenerateChunk."""
        sampling = _sampling(max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens, temperature=temperature,
                             top_p=top_p, top_k=top_k, min_p=min_p, repetition_penalty=repetition_penalty,
                             frequency_penalty=frequency_penalty, presence_penalty=presence_penalty, stop=stop,
                             stop_token_ids=stop_token_ids, ignore_eos=ignore_eos,
                             skip_special_tokens=skip_special_tokens,
                             spaces_between_special_tokens=spaces_between_special_tokens, no_stop_trim=no_stop_trim,
                             n=n, sampling_seed=seed)
        body = _generate_body(prompt, input_ids, sampling, stream, return_logprob, top_logprobs_num, rid)
        if stream:
            return self._generate_stream(body)
        return _output(self._post("/generate", body))

    def _generate_stream(self, body: dict[str, Any]) -> Iterator[GenerateChunk]:
        shown = ""
        for ev in self._stream("/generate", body):
            text = ev.get("text", "")
            meta = ev.get("meta_info", {})
            yield GenerateChunk(text, text[len(shown):], ev.get("output_ids", []), meta.get("finish_reason"), meta)
            shown = text

    def chat(self, messages: list[dict[str, Any]], *, max_tokens: int | None = None,
             temperature: float | None = None, top_p: float | None = None, stop: str | list[str] | None = None,
             seed: int | None = None, stream: bool = False, **extra: Any) -> ChatOutput | Iterator[ChatChunk]:
        """POST /v1/chat/completions; extra keywords (top_k, ignore_eos, ...) are passed through."""
        params = _sampling(max_tokens=max_tokens, temperature=temperature, top_p=top_p, stop=stop, seed=seed,
                           **extra)
        body = _chat_body(messages, self.model, stream, params)
        if stream:
            return (ChatChunk(c["choices"][0]["delta"].get("content") or "", c["choices"][0].get("finish_reason"), c)
                    for c in self._stream("/v1/chat/completions", body) if c.get("choices"))
        return _chat_output(self._post("/v1/chat/completions", body))

    def health(self) -> bool:
        """True when the server answers GET /health with 200."""
        try:
            return self._http.get("/health").status_code == 200
        except httpx.HTTPError:
            return False

    def model_info(self) -> dict[str, Any]:
        return self._get("/get_model_info")

    def server_info(self) -> dict[str, Any]:
        return self._get("/get_server_info")

    def flush_cache(self) -> None:
        r = self._http.post("/flush_cache")
        _raise_for(r.status_code, r.content)

    def abort(self, rid: str) -> None:
        self._post("/abort_request", {"rid": rid})

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._post("/tokenize", {"prompt": text, "add_special_tokens": add_special_tokens})["tokens"]

    def detokenize(self, ids: list[int]) -> str:
        return self._post("/detokenize", {"tokens": ids})["text"]

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient(_Base):
    """asyncio client with the same methods as Client (awaitable; streams are async iterators)."""

    def __init__(self, host: str = "localhost", port: int = 30000, api_key: str | None = None,
                 timeout: float = 600.0, base_url: str | None = None) -> None:
        super().__init__(host, port, api_key, timeout, base_url)
        self._http = httpx.AsyncClient(base_url=self.base_url, headers=self.headers, timeout=timeout)

    async def _post(self, path: str, body: dict[str, Any]) -> Any:
        r = await self._http.post(path, json=body)
        _raise_for(r.status_code, r.content)
        return r.json() if r.content else None

    async def _get(self, path: str) -> Any:
        r = await self._http.get(path)
        _raise_for(r.status_code, r.content)
        return r.json() if r.content else None

    async def _stream(self, path: str, body: dict[str, Any]) -> AsyncIterator[dict]:
        async with self._http.stream("POST", path, json=body) as r:
            if r.status_code >= 400:
                _raise_for(r.status_code, await r.aread())
            async for line in r.aiter_lines():
                event = _events(line)
                if event is not None:
                    yield event

    async def generate(self, prompt: str | None = None, *, input_ids: list[int] | None = None,
                       max_new_tokens: int | None = None, min_new_tokens: int | None = None,
                       temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                       min_p: float | None = None, repetition_penalty: float | None = None,
                       frequency_penalty: float | None = None, presence_penalty: float | None = None,
                       stop: str | list[str] | None = None, stop_token_ids: list[int] | None = None,
                       ignore_eos: bool | None = None, skip_special_tokens: bool | None = None,
                       spaces_between_special_tokens: bool | None = None, no_stop_trim: bool | None = None,
                       n: int | None = None, seed: int | None = None, stream: bool = False,
                       return_logprob: bool = False, top_logprobs_num: int = 0,
                       rid: str | None = None) -> GenerateOutput | AsyncIterator[GenerateChunk]:
        """POST /generate; with stream=True returns an async iterator of GenerateChunk."""
        sampling = _sampling(max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens, temperature=temperature,
                             top_p=top_p, top_k=top_k, min_p=min_p, repetition_penalty=repetition_penalty,
                             frequency_penalty=frequency_penalty, presence_penalty=presence_penalty, stop=stop,
                             stop_token_ids=stop_token_ids, ignore_eos=ignore_eos,
                             skip_special_tokens=skip_special_tokens,
                             spaces_between_special_tokens=spaces_between_special_tokens, no_stop_trim=no_stop_trim,
                             n=n, sampling_seed=seed)
        body = _generate_body(prompt, input_ids, sampling, stream, return_logprob, top_logprobs_num, rid)
        if stream:
            return self._generate_stream(body)
        return _output(await self._post("/generate", body))

    async def _generate_stream(self, body: dict[str, Any]) -> AsyncIterator[GenerateChunk]:
        shown = ""
        async for ev in self._stream("/generate", body):
            text = ev.get("text", "")
            meta = ev.get("meta_info", {})
            yield GenerateChunk(text, text[len(shown):], ev.get("output_ids", []), meta.get("finish_reason"), meta)
            shown = text

    async def chat(self, messages: list[dict[str, Any]], *, max_tokens: int | None = None,
                   temperature: float | None = None, top_p: float | None = None,
                   stop: str | list[str] | None = None, seed: int | None = None, stream: bool = False,
                   **extra: Any) -> ChatOutput | AsyncIterator[ChatChunk]:
        """POST /v1/chat/completions; with stream=True an async iterator of ChatChunk."""
        params = _sampling(max_tokens=max_tokens, temperature=temperature, top_p=top_p, stop=stop, seed=seed,
                           **extra)
        body = _chat_body(messages, self.model, stream, params)
        if stream:
            return self._chat_stream(body)
        return _chat_output(await self._post("/v1/chat/completions", body))

    async def _chat_stream(self, body: dict[str, Any]) -> AsyncIterator[ChatChunk]:
        async for c in self._stream("/v1/chat/completions", body):
            if c.get("choices"):
                choice = c["choices"][0]
                yield ChatChunk(choice["delta"].get("content") or "", choice.get("finish_reason"), c)

    async def health(self) -> bool:
        try:
            return (await self._http.get("/health")).status_code == 200
        except httpx.HTTPError:
            return False

    async def model_info(self) -> dict[str, Any]:
        return await self._get("/get_model_info")

    async def server_info(self) -> dict[str, Any]:
        return await self._get("/get_server_info")

    async def abort(self, rid: str) -> None:
        await self._post("/abort_request", {"rid": rid})

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


SGLangClient = Client
