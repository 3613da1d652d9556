"""A router for disaggregated serving: prefill on one engine, decode on others, KV streamed over MOQT.

OpenAI-compatible like vLLM's disaggregation proxy examples (``POST /v1/completions``), with
one difference that is the point of it: the decode engines get the request **at the same
time** as the prefill engine, not after it, and take its KV layer by layer while it is being
computed (docs/vllm.md "Prefill→decode"). For each request the router:

1. draws a stream id (16 random octets, :mod:`.stream`);
2. sends the prefill engine the request with ``max_tokens = 1`` and
   ``kv_transfer_params = {"kvsp_stream": {"id": ..., "as": "producer"}}``;
3. sends the same request, whole, to ``fan_out`` decode engines (chosen round robin) with
   ``{"as": "consumer"}``; they subscribe to the prompt's blocks through the relay and start
   decoding once every layer of every block is in, verified;
4. answers with the first decode engine's output (``choices``), and in ``kvsp`` what each
   engine reported (its ``kv_transfer_params["kvsp"]``, its time to first token).

A prefill engine that fails (killed mid-stream, or erroring) does not fail the request: the
decode engines' streams end, they recompute what did not arrive (``kv_load_failure_policy =
"recompute"``), and the answer is still right (``kvsp.prefill.error`` says what happened). A
decode engine that fails fails the request only when every chosen one failed.

Engines are reached through :class:`Engine` (one coroutine per request):
``kvsp_moq.integrations.vllm.router.ProcessEngine`` drives a vLLM engine process (the tests,
``kvsp demo``). The request body takes ``prompt`` as token ids (``list[int]``): this router
does not tokenize. Its HTTP API: :mod:`.routes`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

__all__ = ["STREAM_PARAM", "CompletionError", "DisaggRouter", "Engine"]

log = logging.getLogger(__name__)

#: The ``kv_transfer_params`` member naming a stream (the vLLM connector's
#: ``integrations.vllm.stream.PARAM``; tests/test_vllm_stream.py checks they are one).
STREAM_PARAM = "kvsp_stream"

#: The largest ``max_tokens`` and prompt the router accepts (the engines have their own limits).
MAX_TOKENS = 32_768
MAX_PROMPT_TOKENS = 1 << 20


class CompletionError(ValueError):
    """A completion request the router refuses (HTTP 400 with the reason)."""


class Engine(Protocol):
    """One engine: ``complete`` answers one greedy request (``prompt_token_ids``, ``max_tokens``,
    ``kv_transfer_params``, ``cache_salt``) with ``token_ids`` and ``kv_transfer_params``."""

    name: str

    async def complete(self, request: Mapping[str, Any]) -> dict[str, Any]: ...


def _completion_request(body: object) -> dict[str, Any]:
    """The router's part of an OpenAI completion request, checked (:class:`CompletionError`)."""
    if not isinstance(body, Mapping):
        raise CompletionError("the body must be a JSON object")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]  # one prompt of token ids, OpenAI's batch form
    if not isinstance(prompt, list) or not prompt or len(prompt) > MAX_PROMPT_TOKENS \
            or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in prompt):
        raise CompletionError("prompt must be a non-empty array of token ids (this router does not tokenize)")
    max_tokens = body.get("max_tokens", 16)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 1 <= max_tokens <= MAX_TOKENS:
        raise CompletionError(f"max_tokens must be an integer in [1, {MAX_TOKENS}]")
    if body.get("temperature", 0) not in (0, 0.0):
        raise CompletionError("only greedy decoding (temperature 0) is routed")
    if body.get("kv_transfer_params") is not None:
        raise CompletionError("kv_transfer_params are the router's to set")
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise CompletionError("cache_salt must be a string")
    return {"prompt_token_ids": list(prompt), "max_tokens": max_tokens, "cache_salt": salt,
            "model": body.get("model")}


class DisaggRouter:
    """The routing of one request (module notes) over a prefill engine and decode engines."""

    def __init__(self, prefill: Engine, decoders: Sequence[Engine], *, fan_out: int = 1,
                 detokenize: Callable[[list[int]], str] | None = None) -> None:
        if not decoders:
            raise ValueError("a router needs at least one decode engine")
        if not 1 <= fan_out <= len(decoders):
            raise ValueError(f"fan_out must be in [1, {len(decoders)}]")
        self.prefill = prefill
        self.decoders = list(decoders)
        self.fan_out = fan_out
        self.detokenize = detokenize
        self._next = itertools.cycle(range(len(decoders)))
        self.requests = 0

    def _chosen(self) -> list[Engine]:
        first = next(self._next)
        return [self.decoders[(first + i) % len(self.decoders)] for i in range(self.fan_out)]

    async def complete(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """Route one completion request (module notes); :class:`CompletionError` for a bad one,
        RuntimeError when every chosen decode engine failed."""
        request = _completion_request(body)
        self.requests += 1
        stream_id = secrets.token_hex(16)
        base = {k: request[k] for k in ("prompt_token_ids", "cache_salt")}
        started = time.perf_counter()

        async def timed(engine: Engine, req: dict[str, Any]) -> dict[str, Any]:
            out = await engine.complete(req)
            return {**out, "router_ms": round((time.perf_counter() - started) * 1e3, 3)}

        prefill = asyncio.ensure_future(timed(self.prefill, {
            **base, "max_tokens": 1, "kv_transfer_params": {STREAM_PARAM: {"id": stream_id, "as": "producer"}}}))
        chosen = self._chosen()
        decodes = [asyncio.ensure_future(timed(d, {
            **base, "max_tokens": request["max_tokens"],
            "kv_transfer_params": {STREAM_PARAM: {"id": stream_id, "as": "consumer"}}})) for d in chosen]
        results = await asyncio.gather(prefill, *decodes, return_exceptions=True)
        pre, outs = results[0], results[1:]
        answers = [o for o in outs if isinstance(o, dict)]
        if not answers:
            raise RuntimeError(f"every decode engine failed: {'; '.join(repr(o) for o in outs)}")
        if isinstance(pre, BaseException):
            log.warning("router: the prefill engine failed (%r): the decode engines recomputed", pre)
        first = answers[0]
        tokens = list(first["token_ids"])
        return {
            "id": f"cmpl-{stream_id}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": request.get("model") or "",
            "choices": [{"index": 0, "text": self.detokenize(tokens) if self.detokenize else "",
                         "token_ids": tokens, "finish_reason": "length", "logprobs": None}],
            "usage": {"prompt_tokens": len(request["prompt_token_ids"]), "completion_tokens": len(tokens),
                      "total_tokens": len(request["prompt_token_ids"]) + len(tokens)},
            "kvsp": {
                "stream": stream_id,
                "prefill": _engine_report(self.prefill, pre),
                "decoders": [_engine_report(d, o) for d, o in zip(chosen, outs)],
            },
        }


def _engine_report(engine: Engine, result: object) -> dict[str, Any]:
    if isinstance(result, BaseException):
        return {"engine": engine.name, "error": f"{type(result).__name__}: {result}"}
    assert isinstance(result, dict)
    params = result.get("kv_transfer_params") or {}
    ttft = result.get("first_token_s")
    return {"engine": engine.name, "token_ids": list(result.get("token_ids", [])),
            "ttft_ms": round(float(ttft) * 1e3, 3) if ttft is not None else None,
            "first_token_ns": result.get("first_token_ns"), "router_ms": result.get("router_ms"),
            "kvsp": params.get("kvsp", {})}
