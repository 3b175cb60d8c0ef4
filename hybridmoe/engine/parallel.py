"""n > 1: one prompt, n sequences. The first sequence prefills the prompt; once it has, the other
n - 1 are forked from it: they take references on its full prompt pages (kv_cache.share), compute
only the prompt's last partial page themselves, and sample on their own streams.

With a seed, sequence i samples from a stream derived from (seed, i), so the n outputs are
reproducible, and sequence 0 is what n=1 with the same seed gives.
"""

from __future__ import annotations

import dataclasses

from hybridmoe.engine.kv_cache import KVCacheManager
from hybridmoe.engine.request import Req

_GOLDEN = 0x9E3779B97F4A7C15  # odd: i -> i * _GOLDEN spreads the seeds of the n sequences apart


def derive_seed(seed: int | None, index: int) -> int | None:
    """The sampling seed of sequence `index` of a request seeded with `seed` (index 0 keeps it)."""
    if seed is None or index == 0:
        return seed
    return (seed + index * _GOLDEN) % (1 << 63)


def expand(req: Req) -> None:
    """Give a request with params.n > 1 its n - 1 forks (not yet scheduled): rids `{rid}-{i}`."""
    n = req.params.n
    req.params.n = 1
    for i in range(1, n):
        params = dataclasses.replace(req.params, sampling_seed=derive_seed(req.params.sampling_seed, i))
        req.forks.append(Req(rid=f"{req.rid}-{i}", prompt_ids=req.prompt_ids, params=params, lora_name=req.lora_name,
                             lora_key=req.lora_key,
                             return_logprob=req.return_logprob, top_logprobs_num=req.top_logprobs_num,
                             logprob_start_len=req.logprob_start_len,
                             return_text_in_logprobs=req.return_text_in_logprobs,
                             arrival_time=req.arrival_time, sample_index=i))


def ready_to_fork(req: Req) -> bool:
    """Whether req's prompt is prefilled (every position's KV is in its pages) and forks wait."""
    return bool(req.forks) and req.num_computed >= len(req.prompt_ids)


def fork(req: Req, kv: KVCacheManager) -> list[Req]:
    """Hand req's forks references on its full prompt pages (leaving at least one prompt token
    for each to compute: its first sampled token needs logits) and its prompt logprobs."""
    children, req.forks = req.forks, []
    full = min(len(req.pages), (len(req.prompt_ids) - 1) // kv.page_size)
    for child in children:
        child.pages = kv.share(req.pages[:full])
        child.num_computed = full * kv.page_size
        child.cached_tokens = req.cached_tokens
        child.input_logprobs = list(req.input_logprobs)
    return children
