"""Architecture registry: `config.architectures[0]` -> the ArchSpec builder of its family.

The built-in families are registered in models/__init__.py and imported on first use.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from hybridmoe.registry import Registry

if TYPE_CHECKING:
    from hybridmoe.models.base import ArchSpec

SpecBuilder = Callable[[object], "ArchSpec"]
ARCHITECTURES: Registry[SpecBuilder] = Registry("architecture")


def register_arch(name: str) -> Callable[[SpecBuilder], SpecBuilder]:
    """Decorator registering an ArchSpec builder for `config.architectures` entry `name`."""
    return ARCHITECTURES.decorator(name)


def supported_architectures() -> list[str]:
    return ARCHITECTURES.names()


def arch_spec(config: object, source: str = "config.json") -> ArchSpec:
    """The ArchSpec for a transformers config; an unsupported one is an error listing ours."""
    archs = getattr(config, "architectures", None) or []
    for a in archs:
        if a in ARCHITECTURES:
            return ARCHITECTURES.get(a)(config)
    raise ValueError(f"{source}: architecture {archs or '(none given)'} is not supported; "
                     f"supported architectures: {', '.join(ARCHITECTURES.names())}")
