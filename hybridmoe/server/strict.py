"""Building blocks of the strict request models: base classes, bounded types, one-or-list unions.

Strict means: no coercion (`"no"` is not a bool, `1.0` and `true` are not ints), unknown fields
refused, every string valid Unicode, and fields this version does not implement refused by name
unless they carry their no-op value (`"tools": []`), never silently ignored.
"""

from __future__ import annotations

import itertools
from typing import Annotated, Any, ClassVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator
from pydantic_core import PydanticCustomError

from hybridmoe.engine.request import INT64_MAX, INT64_MIN, MAX_STOP_CHARS, MAX_STOP_STRINGS, is_unicode
from hybridmoe.server.errors import path_part

Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
NonNegInt = Annotated[int, Field(ge=0, le=INT64_MAX)]
# Vocabularies fit in int32; the exact [0, vocab) range is checked where the vocabulary is known.
TokenId = Annotated[int, Field(ge=0, le=(1 << 31) - 1)]
# A request id names a stream in logs and /abort_request: short and printable is enough.
Rid = Annotated[str, Field(max_length=256)]


def finite(lo: float, hi: float, *, lo_open: bool = False) -> Any:
    """A finite float in [lo, hi] ((lo, hi] with lo_open); ints are accepted (JSON `0`), bools are not."""
    return Annotated[float, Field(gt=lo, le=hi, allow_inf_nan=False) if lo_open
                     else Field(ge=lo, le=hi, allow_inf_nan=False)]


def _stop_str(s: str) -> str:
    if not s:
        raise PydanticCustomError("bad_value", "a stop string must not be empty")
    return s


StopStr = Annotated[str, Field(max_length=MAX_STOP_CHARS), AfterValidator(_stop_str)]


def _shape(v: Any) -> str:
    return "<list>" if isinstance(v, list) else "<one>"


def one_or_list(one: Any, many: Any, *, max_length: int | None = None) -> Any:
    """`one | list[many]`, told apart by the JSON shape, so an error speaks of the branch that was sent
    (a plain union reports every branch: "valid string; valid list")."""
    listed = Annotated[list[many], Field(max_length=max_length)] if max_length is not None else list[many]
    return Annotated[Annotated[one, Tag("<one>")] | Annotated[listed, Tag("<list>")], Discriminator(_shape)]


Stop = one_or_list(StopStr, StopStr, max_length=MAX_STOP_STRINGS)


def _ids_shape(v: Any) -> str:
    return "<batch>" if isinstance(v, list) and v and isinstance(v[0], list) else "<one>"


# input_ids / tokens: one list of ids, or a batch of lists of ids
TokenIds = Annotated[Annotated[list[TokenId], Tag("<one>")] | Annotated[list[list[TokenId]], Tag("<batch>")],
                     Discriminator(_ids_shape)]


def _top_k(v: int) -> int:
    if v == 0 or v < -1:
        raise PydanticCustomError("bad_value", "must be -1 (off) or an integer >= 1")
    return v


TopK = Annotated[int, Field(le=INT64_MAX), AfterValidator(_top_k)]


def is_noop(value: Any, noops: tuple[Any, ...]) -> bool:
    """value is null or one of the values that ask for nothing (compared with their type: 1 is not True)."""
    if value is None:
        return True
    return any(type(value) is type(n) and value == n for n in noops)


def _string_error(path: list[str | int], s: str) -> PydanticCustomError:
    where = ".".join(path_part(p) for p in path) or "body"
    pos = next(i for i, ch in enumerate(s) if 0xD800 <= ord(ch) <= 0xDFFF)
    return PydanticCustomError("invalid_unicode", "{where}: not valid Unicode (a lone surrogate at character "
                               "{pos}); send UTF-8 text", {"where": where, "pos": pos})


# A place in a body: None (the body) or (its container's place, key or index), a linked path built in O(1)
# per container and spelled out only for an error.
_Where = tuple[Any, str | int] | None
# Types a list may hold with no string inside; a list of only these is skipped at C speed (set(map(type, ...)))
_NO_STRINGS = frozenset({int, float, bool, type(None)})


def _no_strings(v: list[Any]) -> bool:
    """v holds only numbers, bools and nulls, or only lists of those (a batch of token ids): nothing to check."""
    kinds = set(map(type, v))
    if kinds == {list}:
        kinds = set(map(type, itertools.chain.from_iterable(v)))
    return _NO_STRINGS.issuperset(kinds)


def _path(where: _Where) -> list[str | int]:
    parts: list[str | int] = []
    while where is not None:
        where, key = where
        parts.append(key)
    return parts[::-1]


def check_unicode(data: Any) -> None:
    """Raise invalid_unicode naming the first string (or object key) anywhere in data that holds a lone
    surrogate: it would break tokenizers and the UTF-8 encoding of every answer that echoes it.
    Iterative, so a deeply nested body cannot exhaust the stack. It runs on the event loop for every
    request, so it costs little per scalar: only containers are queued, the path of a value is built only
    for an error, and a list of numbers (input_ids, tokens: millions in a 16 MiB body) is skipped whole
    (a per-element walk took 6 s for 5M ids, every other request of the server stalled meanwhile)."""
    if isinstance(data, str):
        if not is_unicode(data):
            raise _string_error([], data)
        return
    todo: list[tuple[_Where, Any]] = [(None, data)]
    while todo:
        where, v = todo.pop()
        if isinstance(v, dict):
            for k, item in v.items():
                if isinstance(k, str) and not is_unicode(k):
                    raise _string_error(_path(where), k)
                if isinstance(item, str):
                    if not is_unicode(item):
                        raise _string_error(_path((where, k)), item)
                elif isinstance(item, (dict, list)):
                    todo.append(((where, k), item))
        elif isinstance(v, list) and not _no_strings(v):
            for i, item in enumerate(v):
                if isinstance(item, str):
                    if not is_unicode(item):
                        raise _string_error(_path((where, i)), item)
                elif isinstance(item, (dict, list)):
                    todo.append(((where, i), item))


class StrictModel(BaseModel):
    """Strict types, unknown fields refused; `not_implemented` lists fields known but not implemented:
    name -> (what they ask for, their no-op values). Present with another value, they are refused."""

    model_config = ConfigDict(strict=True, extra="forbid")
    not_implemented: ClassVar[dict[str, tuple[str, tuple[Any, ...]]]] = {}

    @model_validator(mode="before")
    @classmethod
    def _refuse_not_implemented(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not cls.not_implemented:
            return data
        data = dict(data)
        for name, (what, noops) in cls.not_implemented.items():
            if name in data:
                if not is_noop(data[name], noops):
                    raise PydanticCustomError("not_implemented", "{name}: {what} is not implemented in this "
                                              "version; remove the field", {"name": name, "what": what})
                del data[name]
        return data


class RequestModel(StrictModel):
    """A whole request body: also checks that every string in it is valid Unicode."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        check_unicode(data)
        return data
