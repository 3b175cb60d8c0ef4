"""A request's adapter: its name checked against the loaded ones, and its prefix cache key."""

from __future__ import annotations

from collections.abc import Callable


def request_lora(mgr, name: str | None, error: Callable[[str, str], Exception]) -> tuple[str | None, str | None]:
    """(adapter name, cache key) of a request's lora_path (None, None: the base model); `error(message, field)`
    (the engine's RequestError) for LoRA off or an unknown name."""
    if name is None:
        return None, None
    if not isinstance(name, str) or not name:
        raise error("lora_path must be the name of a loaded LoRA adapter", "lora_path")
    if mgr is None:
        raise error(f"LoRA adapter {name!r} requested but LoRA is not enabled on this server (start it with "
                    "--lora-paths or --enable-lora)", "lora_path")
    key = mgr.key_of(name)
    if key is None:
        raise error(f"unknown LoRA adapter {name!r}; loaded: {mgr.names() or 'none'}", "lora_path")
    return name, key
