"""Token generation: prompt ids -> a stream of (index, token) (kvsp-draft §6.8: every output
token carries its index)."""

from __future__ import annotations

from collections.abc import Collection, Iterator
from dataclasses import dataclass

import torch

from .cache import KVCache
from .errors import ModelError
from .prefill import TokenIds
from .sampler import Sampler
from .tokenizer import EOS_ID
from .transformer import ReferenceModel

__all__ = ["GeneratedToken", "generate"]


@dataclass(frozen=True)
class GeneratedToken:
    """One output token. ``index`` is the sampler step that drew it: the output index of
    §6.8 (a sampler restored at step s continues with index s)."""

    index: int
    token_id: int


def generate(
    model: ReferenceModel,
    token_ids: TokenIds,
    sampler: Sampler,
    max_new_tokens: int,
    *,
    cache: KVCache | None = None,
    stop_ids: Collection[int] = (EOS_ID,),
) -> Iterator[GeneratedToken]:
    """Generate after ``token_ids`` (the whole context: prompt, and when resuming, the tokens
    generated before). Lazy: the next decode step runs when the next token is asked for.

    ``cache`` (optional) holds the KV of the first ``cache.length`` tokens of ``token_ids``
    (loaded blocks, §6.8 step 1); only the rest is computed (step 2). It is extended in place:
    after each yielded token it covers every token before that one. A cache covering all of
    ``token_ids`` is cut back by one token to obtain the last token's logits. Stops after
    ``max_new_tokens`` or after yielding a token in ``stop_ids``.
    """
    ids = model.token_tensor(token_ids)
    if ids.numel() == 0:
        raise ModelError("generation needs at least one context token (e.g. BOS)")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ModelError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    return _stream(model, ids, sampler, max_new_tokens, cache, frozenset(stop_ids))


def _stream(
    model: ReferenceModel, ids: torch.Tensor, sampler: Sampler, limit: int,
    cache: KVCache | None, stop: frozenset[int],
) -> Iterator[GeneratedToken]:
    if limit == 0:
        return
    total = ids.numel()
    if cache is None:
        cache = model.new_cache(total + limit)
    held = cache.length
    if held > total:
        raise ModelError(f"the cache holds {held} tokens, more than the {total} given")
    if held == total:
        cache.truncate(total - 1)
        held = total - 1
    logits = model.prefill(ids[held:], cache).logits[-1]
    for produced in range(limit):
        index = sampler.step
        token = sampler.sample(logits)
        yield GeneratedToken(index, token)
        if token in stop or produced + 1 == limit:
            return
        logits = model.decode(token, cache)
