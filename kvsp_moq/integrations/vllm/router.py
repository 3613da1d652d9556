"""A vLLM engine process as an engine of the disaggregation router (``kvsp_moq.control.router``).

:class:`ProcessEngine` drives an :class:`~.engine_process.EngineProcess` (the tests,
``kvsp demo --disagg``): each routed request is one request line to the process, answered on a
thread (the process answers one request at a time, in order), with the engine's own
``first_token_s`` and ``first_token_ns`` (CLOCK_MONOTONIC) marks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

__all__ = ["ProcessEngine"]


class ProcessEngine:
    """An :class:`~.engine_process.EngineProcess` as the router's ``Engine``."""

    def __init__(self, process: Any, *, timeout: float = 300.0) -> None:
        self.process = process
        self.name = str(process.name)
        self.timeout = timeout

    async def complete(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """The answer, with ``first_token_s`` (from the engine's receipt of the request)."""
        one = {"prompt_token_ids": list(request["prompt_token_ids"]), "max_tokens": int(request["max_tokens"]),
               "kv_transfer_params": request.get("kv_transfer_params"), "cache_salt": request.get("cache_salt")}
        results = await asyncio.to_thread(self.process.batch, [one], self.timeout)
        return dict(results[0])
