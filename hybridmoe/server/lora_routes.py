"""LoRA routes (SGLang's): POST /load_lora_adapter {lora_name, lora_path}, POST /unload_lora_adapter
{lora_name}; and which adapter an OpenAI `model` field names ("<adapter>" or "<served>:<adapter>").

A load reads the adapter's files on a worker thread, then registers it on the engine thread; a bad adapter
or name is a 400 naming it, and leaves the server as it was."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from hybridmoe.lora.adapter import LoRAAdapterError
from hybridmoe.lora.engine_ops import answer, load_adapter, read_for_load, unload_adapter
from hybridmoe.lora.manager import LoRAError
from hybridmoe.server.errors import APIError

log = logging.getLogger(__name__)


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str
    pinned: bool = False  # SGLang's: keep it in a slot; accepted, slots are managed by use here


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str


def adapter_names(state) -> list[str]:
    mgr = getattr(getattr(state.core, "runner", None), "lora", None)
    return mgr.names() if mgr is not None else []


def model_adapter(state, model: str | None, base_names: tuple[str, ...]) -> str | None:
    """The adapter an OpenAI `model` names (None: the base model); APIError 404 naming an unknown one."""
    if model is None or model in base_names:
        return None
    adapters = adapter_names(state)
    if model in adapters:  # first: a name with a colon ("tiny:v2") was taken for "<served>:<adapter>"
        return model
    served, sep, adapter = model.rpartition(":")
    if sep and served in base_names:
        if adapter in adapters:
            return adapter
        raise APIError(404, f"the LoRA adapter {adapter!r} is not loaded on this server (loaded: {adapters or 'none'})",
                       param="model")
    if model in adapters:
        return model
    raise APIError(404, f"the model {model!r} does not exist; this server serves {state.model_name!r}"
                        + (f" and the LoRA adapters {adapters}" if adapters else ""), param="model")


def adapter_cards(state, created: int) -> list[dict[str, Any]]:
    """/v1/models entries of the loaded adapters (parent: the served model)."""
    mgr = getattr(state.core.runner, "lora", None)
    if mgr is None:
        return []
    return [{"id": name, "object": "model", "created": created, "owned_by": "hybridmoe", "root": path,
             "parent": state.model_name} for name, path in dict(mgr.paths).items()]


def register_routes(app: FastAPI, state) -> None:
    reading = asyncio.Lock()  # one adapter read at a time: each can take gigabytes of host memory

    async def load(name: str, path: str) -> dict[str, Any]:
        if name in state.base_names():
            return await state.engine.call(lambda e: answer(
                e, f"LoRA adapter name {name!r} is the served model's name; an OpenAI `model` could not ask for it"))
        mgr = getattr(state.core.runner, "lora", None)
        if mgr is None:  # (load_adapter says that LoRA is off)
            return await state.engine.call(lambda e: load_adapter(e, name, path))
        async with reading:
            # read off the engine thread: requests keep running while the files are read and checked
            try:
                adapter = await asyncio.to_thread(read_for_load, mgr, name, path)
            except (LoRAError, LoRAAdapterError, OSError) as err:
                msg = str(err)
                return await state.engine.call(lambda e: answer(e, msg))
            except Exception as err:  # noqa: BLE001  (as load_adapter: the load fails, the server goes on)
                log.warning("reading LoRA adapter %r from %r failed", name[:400], path[:400], exc_info=True)
                msg = f"LoRA adapter {path[:400]!r}: cannot be loaded ({type(err).__name__}: {str(err)[:200]})"
                return await state.engine.call(lambda e: answer(e, msg))
        return await state.engine.call(lambda e: load_adapter(e, name, path, adapter))

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> JSONResponse:
        out = await load(body.lora_name, body.lora_path)
        return JSONResponse(out, status_code=200 if out["success"] else 400)

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> JSONResponse:
        out = await state.engine.call(lambda e: unload_adapter(e, body.lora_name))
        return JSONResponse(out, status_code=200 if out["success"] else 400)
