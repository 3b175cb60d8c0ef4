"""A request's adapter: its name checked against the loaded ones, and its prefix cache key."""

from __future__ import annotations


def request_lora(mgr, name: str | None, error: type[Exception]) -> tuple[str | None, str | None]:
    """(adapter name, cache key) of a request's lora_path (None, None: the base model); `error`
    (the engine's RequestError) for LoRA off or an unknown name."""
    if name is None:
        return None, None
    if not isinstance(name, str) or not name:
        raise error("lora_path must be the name of a loaded LoRA adapter")
    if mgr is None:
        raise error(f"LoRA adapter {name!r} requested but LoRA is not enabled on this server (start it with "
                    "--lora-paths or --enable-lora)")
    key = mgr.key_of(name)
    if key is None:
        raise error(f"unknown LoRA adapter {name!r}; loaded: {mgr.names() or 'none'}")
    return name, key
