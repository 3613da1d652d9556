"""JSON bodies of ``POST {ii}generate`` (ours; docs/http-api.md "Generation").

Inference requests are outside KVSP (§1.3 "Inference requests themselves ... are out of
scope"): this is the smallest request shape that lets a front end, the demo or a test drive
the instance's engine. Built on the core's record machinery (unknown members ignored, the
member at fault named, §4.4).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from ...kvsp.errors import RecordError
from ...kvsp.records import Record, Sampler
from ...kvsp.records.members import HEX16, HTTP_URL, TOKEN, UUID, Bool, Enum, Int, ListOf, Num, Str, child
from ...kvsp.records.record import Nested, member
from ..common.session_records import OutputToken

__all__ = ["BlockUse", "GenerateRequest", "GenerateResult", "MAX_PROMPT_TOKENS"]

#: Longest prompt one request may carry (tokens).
MAX_PROMPT_TOKENS = 1 << 20
#: Where a prompt block's KV came from: the instance's own store (computed or prefetched
#: earlier), a ``moqt://`` replica (on demand, layer by layer), an HTTP holder (on demand), or
#: none: recomputed here.
SOURCES = ("local", "moqt", "http", "recomputed")


@dataclass(frozen=True, kw_only=True)
class GenerateRequest(Record):
    """Body of ``POST {ii}generate``: exactly one of ``prompt`` (text, byte-tokenized with BOS)
    and ``prompt_ids``; ``sampler`` (§4.4 shape; default greedy) at step 0; ``request_ref``
    names the PC's prefetch directive for this request (§6.5), which the engine lets finish
    (bounded by the directive's deadline) before it looks the prompt up."""

    RECORD_NAME = "generate request"

    scope_id: bytes = member(HEX16)
    prompt: str | None = member(Str(min_len=0, max_len=4 * MAX_PROMPT_TOKENS), optional=True)
    prompt_ids: tuple[int, ...] | None = member(ListOf(TOKEN), optional=True)
    max_tokens: int = member(Int(1, 1 << 20))
    sampler: Sampler | None = member(Nested(Sampler), optional=True)
    request_ref: str | None = member(Str(min_len=0, max_len=1024), optional=True)

    def _check(self, path: str) -> None:
        if (self.prompt is None) == (self.prompt_ids is None):
            raise RecordError(path, "exactly one of prompt and prompt_ids is required")
        if self.prompt_ids is not None and not 0 < len(self.prompt_ids) <= MAX_PROMPT_TOKENS:
            raise RecordError(child(path, "prompt_ids"), f"must hold 1..{MAX_PROMPT_TOKENS} tokens")
        if self.sampler is not None and self.sampler.step != 0:
            raise RecordError(child(child(path, "sampler"), "step"), "a new request starts at step 0")


@dataclass(frozen=True, kw_only=True)
class BlockUse(Record):
    """Where one complete prompt block's KV came from, and the KV octets moved (K and V
    sections of every layer; 0 for local and recomputed blocks)."""

    RECORD_NAME = "block use"

    index: int = member(Int(0))
    source: str = member(Enum(*SOURCES))
    octets: int = member(Int(0))
    holder: str | None = member(Str(max_len=2048), optional=True)


@dataclass(frozen=True, kw_only=True)
class GenerateResult(Record):
    """The answer (200) to ``POST {ii}generate``.

    ``tokens`` carry their output index (§6.8 step 4: the sampler step that drew them).
    ``ttft_ms`` runs from the moment the engine starts serving the request (after the wait
    for its prefetch directive, ``prefetch_wait_ms``) to the first sampled token; ``layerwise``
    is true when at least one prefix block was loaded over MOQT while the layers computed.
    ``published`` lists where the new complete blocks went (``store``: the instance's own
    replica records, ``holder``: HTTP PUT, ``moqt``: records naming the relay).
    """

    RECORD_NAME = "generate result"

    request: uuid.UUID = member(UUID)
    instance: str = member(HTTP_URL)
    prompt_tokens: int = member(Int(1))
    matched: int = member(Int(0))
    blocks: tuple[BlockUse, ...] = member(ListOf(Nested(BlockUse)))
    tokens: tuple[OutputToken, ...] = member(ListOf(Nested(OutputToken)))
    text: str = member(Str(min_len=0, max_len=1 << 24))
    finish: str = member(Enum("length", "eos"))
    ttft_ms: float = member(Num(0))
    prefetch_wait_ms: float = member(Num(0))
    total_ms: float = member(Num(0))
    layerwise: bool = member(Bool())
    published: tuple[str, ...] = member(ListOf(Str(max_len=64)))
