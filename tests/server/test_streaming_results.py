"""streaming.results when the client goes away: every stream aborted, and nothing logged as a lost exception."""

from __future__ import annotations

import asyncio
import gc

import pytest

from hybridmoe.server.errors import APIError
from hybridmoe.server.streaming import results


class _Stream:
    def __init__(self, rid: str) -> None:
        self.rid, self.finished = rid, False

    async def result(self) -> dict:
        await asyncio.Event().wait()  # never ends: the client leaves first
        raise AssertionError("unreachable")


class _Engine:
    def __init__(self) -> None:
        self.aborted: list[str] = []

    def abort(self, rid: str, message: str) -> None:
        self.aborted.append(rid)


class _Request:
    async def receive(self) -> dict:
        await asyncio.sleep(0.01)
        return {"type": "http.disconnect"}


def test_a_disconnect_aborts_the_batch_and_leaves_no_unretrieved_exception():
    """Seen on a served batch whose client timed out: asyncio logged "_GatheringFuture exception was never
    retrieved" with a traceback (the cancelled gather's CancelledError)."""
    lost: list[dict] = []

    async def main() -> list[str]:
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: lost.append(ctx))
        engine = _Engine()
        with pytest.raises(APIError) as e:
            await results(_Request(), engine, [_Stream(f"r{i}") for i in range(3)])  # type: ignore[arg-type]
        assert e.value.status == 499
        for _ in range(5):  # the gather's children end, then the gather itself
            await asyncio.sleep(0)
        gc.collect()  # the gather future is collected here: an exception nobody took is reported now
        await asyncio.sleep(0)
        return engine.aborted

    assert asyncio.run(main()) == ["r0", "r1", "r2"]
    gc.collect()
    assert not lost, [c.get("message") for c in lost]
