"""A name -> lazily imported object registry, shared by the attention backends, the MoE experts
backends and the architectures.

A package registers its implementations in its own `__init__.py` by "module:attr" strings, so the
interface module that owns a registry never imports the implementations (no import cycle), and an
implementation whose dependencies are missing (Triton on a CPU-only install) makes only its own
name unavailable, with an error naming it, when someone asks for it:

    BACKENDS: Registry[Callable[[], Backend]] = Registry("attention backend")
    BACKENDS.register("torch", "hybridmoe.layers.attention.torch_backend:TorchAttentionBackend")
    BACKENDS.get("torch")  # imports torch_backend now, returns the class
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Iterator
from functools import reduce
from typing import Generic, TypeVar

T = TypeVar("T")

_TARGET = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


class UnknownNameError(ValueError):
    """A name nobody registered; the message lists the registered ones."""


class FactoryLoadError(ImportError):
    """A registered target that cannot be imported (a missing optional dependency, a renamed attr)."""


class Registry(Generic[T]):
    """Names -> objects of type T, each given either directly or as a "module:attr" string that is
    imported on the first `get` of its name (and then kept).

    Args:
        kind: what the names are ("MoE experts backend"); error messages start with it.
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._targets: dict[str, str] = {}  # name -> "module:attr", for names not loaded yet
        self._loaded: dict[str, T] = {}

    def register(self, name: str, target: str | T) -> None:
        """Add `name`. A string must be "module:attr" and is not imported now. Registering a name
        again is an error unless it is the same target (the object that "module:attr" names, when
        its module registers itself while being imported)."""
        if not name:
            raise ValueError(f"{self.kind}: empty name")
        if isinstance(target, str) and not _TARGET.match(target):
            raise ValueError(f"{self.kind} {name!r}: target {target!r} is not 'module:attr'")
        if name in self._targets or name in self._loaded:
            if not self._same(name, target):
                raise ValueError(f"{self.kind} {name!r} is already registered as {self._describe(name)}")
            if isinstance(target, str):
                return
        if isinstance(target, str):
            self._targets[name] = target
        else:
            self._targets.pop(name, None)
            self._loaded[name] = target

    def decorator(self, name: str) -> Callable[[T], T]:
        """`@registry.decorator(name)` registers the decorated object under `name`."""

        def wrap(obj: T) -> T:
            self.register(name, obj)
            return obj

        return wrap

    def get(self, name: str) -> T:
        """The object registered as `name`, importing its module on first use.

        Raises:
            UnknownNameError: `name` is not registered (the message lists the registered names).
            FactoryLoadError: its module or attribute cannot be imported (the message names `name`).
        """
        if name in self._loaded:
            return self._loaded[name]
        if name not in self._targets:
            raise UnknownNameError(f"unknown {self.kind} {name!r}; available: {', '.join(self.names()) or '(none)'}")
        target = self._targets[name]
        module_name, attr = target.split(":")
        try:
            module = importlib.import_module(module_name)
            obj = reduce(getattr, attr.split("."), module)
        except (ImportError, AttributeError) as exc:
            raise FactoryLoadError(
                f"{self.kind} {name!r} is unavailable: cannot import {target} ({type(exc).__name__}: {exc})"
            ) from exc
        self._targets.pop(name, None)
        self._loaded[name] = obj
        return obj

    def names(self) -> list[str]:
        """Every registered name, sorted (nothing is imported)."""
        return sorted({*self._targets, *self._loaded})

    def available(self) -> list[str]:
        """The registered names whose target imports here (this imports every one of them)."""
        out = []
        for name in self.names():
            try:
                self.get(name)
            except FactoryLoadError:
                continue
            out.append(name)
        return out

    def is_loaded(self, name: str) -> bool:
        """True once `name`'s object is at hand (given directly, or imported by `get`)."""
        return name in self._loaded

    def __contains__(self, name: object) -> bool:
        return name in self._targets or name in self._loaded

    def __getitem__(self, name: str) -> T:
        return self.get(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._targets) + len(self._loaded)

    def _same(self, name: str, target: str | T) -> bool:
        old = self._targets.get(name)
        if old is None:  # already loaded: the same object, or the string that names it
            obj = self._loaded[name]
            return target is obj or (isinstance(target, str) and _names(obj) == target)
        return target == old or (not isinstance(target, str) and _names(target) == old)

    def _describe(self, name: str) -> str:
        if name in self._targets:
            return self._targets[name]
        return _names(self._loaded[name]) or repr(self._loaded[name])


def _names(obj: object) -> str | None:
    """"module:qualname" of a function or class (None for other objects)."""
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    return f"{module}:{qualname}" if module and qualname else None
