"""Architecture registry: `config.architectures[0]` -> the ArchSpec builder of its family."""

from __future__ import annotations

from collections.abc import Callable

from hybridmoe.models.base import ArchSpec

_ARCHS: dict[str, Callable[[object], ArchSpec]] = {}


def register_arch(name: str) -> Callable:
    def wrap(fn: Callable[[object], ArchSpec]) -> Callable[[object], ArchSpec]:
        _ARCHS[name] = fn
        return fn

    return wrap


def supported_architectures() -> list[str]:
    _import_builtin()
    return sorted(_ARCHS)


def arch_spec(config: object, source: str = "config.json") -> ArchSpec:
    """The ArchSpec for a transformers config; an unsupported one is an error listing ours."""
    _import_builtin()
    archs = getattr(config, "architectures", None) or []
    for a in archs:
        if a in _ARCHS:
            return _ARCHS[a](config)
    raise ValueError(f"{source}: architecture {archs or '(none given)'} is not supported; "
                     f"supported architectures: {', '.join(sorted(_ARCHS))}")


def _import_builtin() -> None:
    from hybridmoe.models import mixtral, qwen2_moe, qwen3_moe  # noqa: F401
