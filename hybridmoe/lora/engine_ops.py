"""Run-time adapter loading and unloading. The registry changes on the engine thread (between steps: the
slot buffers are never written during a forward); the server reads an adapter's files before, on a thread
of its own (`read_for_load`), so a large or slow adapter does not stall the requests running. SGLang's
response shape: success, error_message, loaded_adapters {name: path}."""

from __future__ import annotations

import logging
from typing import Any

from hybridmoe.lora.adapter import LoRAAdapter, LoRAAdapterError, check_name, one_line, read_adapter
from hybridmoe.lora.manager import LoRAError

log = logging.getLogger(__name__)


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


def answer(engine, error: str | None = None) -> dict[str, Any]:
    """The response; an error as one line (a path or a library's message may hold newlines)."""
    return {"success": error is None, "error_message": one_line(error) if error else "",
            "loaded_adapters": loaded(engine)}


def _precheck(mgr, name: str) -> None:
    check_name(name)
    if mgr.has(name):
        raise LoRAError(f"a LoRA adapter named {name!r} is already loaded; unload it first")
    mgr.check_room()


def read_for_load(mgr, name: str, path: str) -> LoRAAdapter:
    """The adapter at `path` read and checked for `mgr` (any thread: it reads only the manager's limits);
    LoRAError / LoRAAdapterError naming the problem."""
    _precheck(mgr, name)
    return read_adapter(path, name, mgr.max_rank)


def load_adapter(engine, name: str, path: str, adapter: LoRAAdapter | None = None) -> dict[str, Any]:
    """Register `adapter` (read from `path` here when None) as `name`; a failure leaves the server as it was."""
    try:
        mgr = _manager(engine)
        _precheck(mgr, name)
        mgr.collect(_in_use(engine))
        mgr.register(adapter if adapter is not None else read_adapter(path, name, mgr.max_rank))
    except (LoRAError, LoRAAdapterError, OSError) as e:
        return answer(engine, str(e))
    except Exception as e:  # noqa: BLE001  (a case the checks miss: the load fails, the server goes on)
        log.warning("loading LoRA adapter %r from %r failed", name[:400], path[:400], exc_info=True)
        return answer(engine, f"LoRA adapter {path[:400]!r}: cannot be loaded ({type(e).__name__}: {str(e)[:200]})")
    return answer(engine)


def unload_adapter(engine, name: str) -> dict[str, Any]:
    """New requests can no longer use `name`; the requests running with it finish with it."""
    try:
        _manager(engine).unregister(name, _in_use(engine))
    except LoRAError as e:
        return answer(engine, str(e))
    return answer(engine)
