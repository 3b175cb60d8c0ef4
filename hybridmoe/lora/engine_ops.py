"""Run-time adapter loading and unloading, run on the engine thread (between steps: the slot
buffers are never written during a forward). SGLang's response shape: success, error_message,
loaded_adapters {name: path}."""

from __future__ import annotations

from typing import Any

from hybridmoe.lora.adapter import LoRAAdapterError, read_adapter
from hybridmoe.lora.manager import LoRAError


def _manager(engine):
    mgr = engine.runner.lora
    if mgr is None:
        raise LoRAError("LoRA is not enabled on this server (start it with --lora-paths or --enable-lora)")
    return mgr


def _in_use(engine) -> set[str]:
    return {r.lora_key for r in engine.reqs.values() if r.lora_key is not None}


def loaded(engine) -> dict[str, str]:
    mgr = engine.runner.lora
    return dict(mgr.paths) if mgr is not None else {}


def _answer(engine, error: str | None = None) -> dict[str, Any]:
    return {"success": error is None, "error_message": error or "", "loaded_adapters": loaded(engine)}


def load_adapter(engine, name: str, path: str) -> dict[str, Any]:
    """Read, validate and register `path` as `name`; a failure leaves the server as it was."""
    try:
        mgr = _manager(engine)
        if mgr.has(name):
            raise LoRAError(f"a LoRA adapter named {name!r} is already loaded; unload it first")
        mgr.collect(_in_use(engine))
        mgr.register(read_adapter(path, name))
    except (LoRAError, LoRAAdapterError, OSError) as e:
        return _answer(engine, str(e))
    return _answer(engine)


def unload_adapter(engine, name: str) -> dict[str, Any]:
    """New requests can no longer use `name`; the requests running with it finish with it."""
    try:
        _manager(engine).unregister(name, _in_use(engine))
    except LoRAError as e:
        return _answer(engine, str(e))
    return _answer(engine)
