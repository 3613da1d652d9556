"""The KVSP client's event loop, on a thread of its own (docs/vllm.md "Threads").

vLLM calls a connector synchronously from its scheduler loop and from the model's forward
pass. The client library (MOQT sessions, HTTP clients, sinks, the block store) is asyncio and
not thread-safe, so all of it lives on one loop running on a daemon thread: vLLM's threads
only :meth:`ClientLoop.submit` coroutines or :meth:`ClientLoop.call` plain functions there
and wait on the future, always with a bound (``deadline_ms``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["ClientLoop"]

T = TypeVar("T")


class ClientLoop:
    """An asyncio loop on a daemon thread (module notes)."""

    def __init__(self, name: str = "kvsp-client") -> None:
        self.loop = asyncio.new_event_loop()
        started = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.loop.call_soon(started.set)
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, name=name, daemon=True)
        self.thread.start()
        if not started.wait(30):
            raise RuntimeError("the KVSP client loop did not start within 30 s")

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run ``coro`` on the loop; its future (thread-safe)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run ``coro`` and wait at most ``timeout`` s (then it is cancelled: TimeoutError)."""
        future = self.submit(coro)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"no result within {timeout} s") from None

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        """Call ``fn(*args)`` on the loop, soon (fire and forget; exceptions are logged)."""
        self.loop.call_soon_threadsafe(fn, *args)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the loop after the pending callbacks; wait for the thread."""
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout)
        if not self.thread.is_alive():
            self.loop.close()
