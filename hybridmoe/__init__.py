"""hybridmoe: serve Mixture-of-Experts LLMs on one GPU plus a large CPU."""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"

if TYPE_CHECKING:
    from hybridmoe.client import AsyncClient, Client, SGLangClient
    from hybridmoe.engine.llm import LLM
    from hybridmoe.engine.request import SamplingParams

__all__ = ["AsyncClient", "Client", "LLM", "SGLangClient", "SamplingParams", "__version__"]


def __getattr__(name: str):  # lazy: `import hybridmoe` stays cheap (no torch import)
    if name == "LLM":
        from hybridmoe.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from hybridmoe.engine.request import SamplingParams

        return SamplingParams
    if name in ("Client", "AsyncClient", "SGLangClient"):
        from hybridmoe import client

        return getattr(client, name)
    raise AttributeError(f"module 'hybridmoe' has no attribute {name!r}")
