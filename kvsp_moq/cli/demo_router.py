"""The request path of ``kvsp demo``: what a front end does with a prompt (the seam where the
front end, ``kvsp frontend``, goes later).

:meth:`RequestRouter.route` takes a prompt and:

1. tokenizes it (byte tokenizer, BOS first) and computes its Block Keys with the scope key and
   the model's Compatibility ID (kvsp-draft §4.1, §4.2);
2. asks the PC where to run it: ``POST {pc}placements`` (ours; §6.4 placement by cost with the
   IS lookup, and a §6.5 prefetch directive to the chosen instance when loading beats
   recomputing) with a fresh ``request_ref``;
3. sends the request to the chosen instance: ``POST {ii}generate`` with the same
   ``request_ref``, so the instance lets that directive finish before it looks the prompt up.

Nothing here runs the model; the instances do.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from ..control.control_records import PlacementRequest
from ..kvsp.blockkeys import BlockKeyChain
from ..kvsp.records import dump_json
from .demo_cluster import http_request

__all__ = ["RequestRouter", "Routed", "RoutingFailed"]


class RoutingFailed(RuntimeError):
    """The PC or the instance refused or failed a call (status and body in the message)."""


@dataclass(frozen=True)
class Routed:
    """One request: the PC's placement and the instance's answer (JSON objects)."""

    prompt_ids: list[int]
    block_keys: list[bytes]
    placement: dict[str, Any]
    result: dict[str, Any]

    @property
    def instance(self) -> str:
        return str(self.placement["instance"])


class RequestRouter:
    def __init__(self, *, pc_url: str, token: str, scope_key: bytes, scope_id: bytes, compat_id: bytes,
                 block_tokens: int, tokenizer: Any) -> None:
        self.pc_url = pc_url
        self.token = token
        self.scope_key = scope_key
        self.scope_id = scope_id
        self.compat_id = compat_id
        self.block_tokens = block_tokens
        self.tokenizer = tokenizer

    def keys(self, prompt: str) -> tuple[list[int], list[bytes]]:
        ids = self.tokenizer.encode(prompt)
        return ids, BlockKeyChain(self.scope_key, self.compat_id, self.block_tokens).extend(ids)

    async def place(self, prompt: str, request_ref: str) -> tuple[list[int], list[bytes], dict[str, Any]]:
        ids, keys = self.keys(prompt)
        body = dump_json(PlacementRequest(scope_id=self.scope_id, compat_id=self.compat_id, block_keys=tuple(keys),
                                          tokens=len(ids), request_ref=request_ref, prefetch=True))
        reply = await http_request(f"{self.pc_url}placements", "POST", token=self.token, body=body)
        if reply.status != 200:
            raise RoutingFailed(f"POST {self.pc_url}placements: {reply.status} {reply.body[:400]!r}")
        return ids, keys, reply.json()

    async def generate(self, instance: str, prompt: str, max_tokens: int, request_ref: str | None) -> dict[str, Any]:
        body: dict[str, Any] = {"scope_id": self.scope_id.hex(), "prompt": prompt, "max_tokens": max_tokens}
        if request_ref is not None:
            body["request_ref"] = request_ref
        reply = await http_request(f"{instance}generate", "POST", token=self.token, body=_json(body), timeout=300)
        if reply.status != 200:
            raise RoutingFailed(f"POST {instance}generate: {reply.status} {reply.body[:400]!r}")
        return reply.json()

    async def route(self, prompt: str, max_tokens: int) -> Routed:
        """Place the request at the PC, then run it on the chosen instance."""
        ref = f"demo-{uuid.uuid4()}"
        ids, keys, placement = await self.place(prompt, ref)
        result = await self.generate(placement["instance"], prompt, max_tokens, ref)
        return Routed(ids, keys, placement, result)


def _json(obj: dict[str, Any]) -> bytes:
    import json

    return json.dumps(obj, separators=(",", ":")).encode()
