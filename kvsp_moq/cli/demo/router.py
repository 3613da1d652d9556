"""The client side of ``kvsp demo``: a prompt becomes a §6.8 session at the front end, and its
output is read back from the front end's stream.

:meth:`SessionClient.run` takes a prompt and:

1. tokenizes it (byte tokenizer, BOS first) and computes its Block Keys with the scope key and
   the model's Compatibility ID (kvsp-draft §4.1, §4.2);
2. asks the IS which prefix of them is cached (§6.2 lookup, no targets): those blocks are the
   session's ``prompt_blocks`` (loaded by Block Key, their tokens are not sent), the tokens
   after them its ``prompt_tail`` (the Session Checkpoint's split, §4.4); at most
   ``(T - 1) // B`` blocks, since the last prompt token is always computed;
3. starts the session at the front end: ``POST {fe}sessions`` (the front end names it and has
   the PC place it, §6.4; the PC sends the chosen instance a §6.5 prefetch directive for the
   blocks not resident there, whose ``request_ref`` is the session id, then the start order);
4. reads ``GET {fe}sessions/{id}/tokens`` (NDJSON) to its end, checking that every index comes
   once and in order (§6.8 "the front end delivers every index exactly once"), and times the
   first token as the client sees it.

Nothing here runs the model; the instances do.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from ...control.client.http import HttpFrontEndClient, HttpIndexClient
from ...control.common.session_records import StreamEnd, StreamFailed
from ...control.common.session_records import ClientSessionRequest
from ...kvsp.blockkeys import BlockKeyChain
from ...kvsp.records import LookupRequest, Sampler

__all__ = ["SessionClient", "SessionFailed", "Streamed"]

#: The demo's sampler: greedy, so that reused KV must give the output of recomputing everything.
GREEDY = Sampler(method="greedy", params={}, seed=0, step=0, deterministic=True)


class SessionFailed(RuntimeError):
    """The front end refused the session, or its stream broke the §6.8 delivery rules."""


@dataclass(frozen=True)
class Streamed:
    """One session as the client saw it."""

    session: uuid.UUID
    instance: str  # where the PC started it
    prompt_ids: list[int]
    block_keys: list[bytes]
    prompt_blocks: int  # sent as Block Keys (cached, per the IS)
    tokens: list[int]  # the output, index 0.. in order
    client_ttft_ms: float  # POST sessions -> first token read from the stream
    total_ms: float


class SessionClient:
    def __init__(self, *, fe_url: str, front_end: HttpFrontEndClient, index: HttpIndexClient, scope_key: bytes,
                 scope_id: bytes, compat_id: bytes, block_tokens: int, tokenizer: Any) -> None:
        self.fe_url = fe_url
        self.front_end = front_end
        self.index = index
        self.scope_key = scope_key
        self.scope_id = scope_id
        self.compat_id = compat_id
        self.block_tokens = block_tokens
        self.tokenizer = tokenizer

    def keys(self, prompt: str) -> tuple[list[int], list[bytes]]:
        ids = self.tokenizer.encode(prompt)
        return ids, BlockKeyChain(self.scope_key, self.compat_id, self.block_tokens).extend(ids)

    async def cached_prefix(self, keys: list[bytes]) -> int:
        """How many leading ``keys`` the IS lists a replica for (§6.2)."""
        if not keys:
            return 0
        found = await self.index.lookup(LookupRequest(scope_id=self.scope_id, compat_id=self.compat_id,
                                                      block_keys=tuple(keys)))
        return found.matched

    async def run(self, prompt: str, max_tokens: int) -> Streamed:
        """Start a session for ``prompt`` at the front end and read its output (module notes)."""
        ids, keys = self.keys(prompt)
        usable = (len(ids) - 1) // self.block_tokens
        cached = await self.cached_prefix(keys[:usable])
        request = ClientSessionRequest(
            compat_id=self.compat_id, scope_id=self.scope_id, prompt_blocks=tuple(keys[:cached]),
            prompt_tail=tuple(ids[cached * self.block_tokens:]), tokens=len(ids), sampler=GREEDY, max_tokens=max_tokens)
        started = time.perf_counter()
        try:
            session = await self.front_end.start(self.fe_url, request)
        except Exception as exc:
            raise SessionFailed(f"POST {self.fe_url}sessions: {exc}") from None
        if session.instance is None:
            raise SessionFailed(f"session {session.session}: the PC placed it nowhere")
        tokens: list[int] = []
        first_ms: float | None = None
        end: int | None = None
        async for item in self.front_end.tokens(self.fe_url, session.session):
            if isinstance(item, StreamEnd):
                end = item.end
                break
            if isinstance(item, StreamFailed):
                raise SessionFailed(f"session {session.session}: the PC gave it up after "
                                    f"{item.next} tokens: {item.reason}")
            if first_ms is None:
                first_ms = (time.perf_counter() - started) * 1e3
            if item.index != len(tokens):
                raise SessionFailed(f"session {session.session}: index {item.index} where {len(tokens)} was due")
            tokens.append(item.token)
        if end is None or end != len(tokens) or first_ms is None:
            raise SessionFailed(f"session {session.session}: the stream ended after {len(tokens)} tokens (end {end})")
        return Streamed(session=session.session, instance=session.instance, prompt_ids=ids, block_keys=keys,
                        prompt_blocks=cached, tokens=tokens, client_ttft_ms=round(first_ms, 3),
                        total_ms=round((time.perf_counter() - started) * 1e3, 3))
