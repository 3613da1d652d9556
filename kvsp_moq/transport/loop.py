"""Event loop helpers: uvloop where available, never forced globally.

``run(main())`` runs a coroutine on a fresh loop (uvloop when installed and asked for) and
closes it, like :func:`asyncio.run`. ``new_event_loop()`` makes such a loop for code that
manages its own. Importing this module installs nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from .config import TransportConfig

__all__ = ["new_event_loop", "run", "uvloop_available"]

T = TypeVar("T")


def uvloop_available() -> bool:
    """True when uvloop can be imported (it does not exist on Windows)."""
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


def _want_uvloop(use_uvloop: bool | None, config: TransportConfig | None) -> bool:
    if use_uvloop is None:
        use_uvloop = config.use_uvloop if config is not None else True
    return use_uvloop and uvloop_available()


def new_event_loop(use_uvloop: bool | None = None,
                   config: TransportConfig | None = None) -> asyncio.AbstractEventLoop:
    """A new event loop: uvloop's if wanted (``use_uvloop``, else ``config.use_uvloop``,
    else yes) and installed, asyncio's otherwise."""
    if _want_uvloop(use_uvloop, config):
        import uvloop

        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def run(main: Coroutine[Any, Any, T], *, use_uvloop: bool | None = None,
        config: TransportConfig | None = None, debug: bool | None = None) -> T:
    """Run ``main`` to completion on a new loop from :func:`new_event_loop`, then close the
    loop (cancelling leftover tasks, shutting down async generators), like ``asyncio.run``."""
    with asyncio.Runner(debug=debug,
                        loop_factory=lambda: new_event_loop(use_uvloop, config)) as runner:
        return runner.run(main)
