"""The QUIC backend a ``kvsp bench`` command runs on (``--backend``): the default, and the
refusal of one this build cannot run, before anything starts."""

from __future__ import annotations

import os

from ...transport import BackendUnavailableError, load_backend
from ...transport.config import BACKEND_ENV
from ..errors import UsageError

__all__ = ["check_backend", "default_backend"]


def default_backend() -> str:
    """``$KVSP_QUIC_BACKEND``, else ``aioquic``: ``TransportConfig``'s default."""
    return os.environ.get(BACKEND_ENV) or "aioquic"


def check_backend(given: str | None) -> str:
    """The backend ``--backend`` names (``given``; None: :func:`default_backend`) if this build
    can run it; else a :class:`UsageError` saying why (an unknown name with the known ones; a
    known one with what is missing, e.g. the native extension's Debian packages)."""
    name = given or default_backend()
    where = f"--backend {name}" if given else f"${BACKEND_ENV}={name} (the default of --backend)"
    try:
        load_backend(name)
    except BackendUnavailableError as exc:  # before ValueError: NativeUnavailableError is both
        raise UsageError(f"{where}: {exc}") from None
    except ValueError as exc:
        raise UsageError(f"{where}: {exc}") from None
    return name
