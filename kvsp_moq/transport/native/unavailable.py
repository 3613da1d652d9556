"""The error for asking for the native backend where its extension is not built:
:class:`NativeUnavailableError`. Importing this module loads no extension."""

from __future__ import annotations

from ..api import BackendUnavailableError, TransportError

__all__ = ["NativeUnavailableError"]


class NativeUnavailableError(BackendUnavailableError, ValueError):
    """``TransportConfig(backend="native")`` or ``load_backend("native")`` where the C
    extension ``kvsp_moq.transport.native._ngtcp2`` is not built or its libraries do not
    load. A :class:`BackendUnavailableError` (an ImportError) and, like every backend name
    ``TransportConfig`` refuses, a ValueError. ``reason`` is
    :func:`kvsp_moq.transport.native.unavailable_reason`: it names the Debian packages to
    install (libngtcp2-dev libngtcp2-crypto-gnutls-dev libgnutls28-dev) and
    ``pip install -e .``."""

    def __init__(self, reason: str) -> None:
        TransportError.__init__(
            self, f"QUIC backend 'native' is not available: {reason}; or choose another "
                  f"backend (TransportConfig.backend / $KVSP_QUIC_BACKEND)")
        self.backend = "native"
        self.package = "libngtcp2-dev libngtcp2-crypto-gnutls-dev libgnutls28-dev"
