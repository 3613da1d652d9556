"""The native QUIC data plane: QUIC v1 on ngtcp2 and GnuTLS in a network thread of its own
(issue #28, step 1).

:mod:`._ngtcp2` is a C extension (sources beside this file, ``nq.h`` maps them) built by
setup.py when Debian's ngtcp2 and GnuTLS development packages are installed; the package
works without it. Its API (``_ngtcp2.pyi``): an ``Endpoint`` owns one UDP socket and a
network thread that does every per-packet step (batched UDP I/O with GSO/GRO, pacing,
ngtcp2's congestion controllers); Python drains coalesced events when the endpoint's
eventfd (``fileno()``) turns readable, and never runs per packet.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["available", "extension", "unavailable_reason"]

_HINT = ("the native QUIC backend was not built: install libngtcp2-dev "
         "libngtcp2-crypto-gnutls-dev libgnutls28-dev and reinstall (pip install -e .)")


def _load() -> tuple[ModuleType | None, str | None]:
    try:
        return importlib.import_module(f"{__name__}._ngtcp2"), None
    except ImportError as exc:
        if exc.name == f"{__name__}._ngtcp2":
            return None, _HINT
        return None, f"{_HINT} ({exc})"  # built, but its libraries do not load


def available() -> bool:
    """Whether the extension is built and loads."""
    return _load()[0] is not None


def unavailable_reason() -> str | None:
    """Why the extension cannot be used (None when it can)."""
    return _load()[1]


def extension() -> ModuleType:
    """The extension module (``_ngtcp2``, as ``_ngtcp2.pyi`` describes it): what the backend
    (:mod:`.backend`) builds on. ImportError, with :func:`unavailable_reason`, where it
    cannot be loaded."""
    module, reason = _load()
    if module is None:
        raise ImportError(reason, name=f"{__name__}._ngtcp2")
    return module
