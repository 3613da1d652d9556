"""Which receive path a bridge load takes, for the tests that assert what a load reports after
a layer failed verification (docs/binding.md §4; docs/transport.md "The data plane: data
streams parsed in C").

The Python receive path (``bridge/receive.py``) stops a FETCH at its first layer whose digest
does not match: the layers after it are left to the next source, or to recompute. The native
data plane (``bridge/native_receive.py``) has registered every layer of the FETCH before it
left; each lands and is verified as it arrives, so the layers after a bad one are verified too
and only the bad ones go to the next source. Both satisfy binding §4: a failed layer is never
exposed, and only the layers still missing are requested again.
"""

from __future__ import annotations

from typing import Any

from kvsp_moq.transport import TransportConfig


def lands_natively(sink: Any) -> bool:
    """Whether a FETCH into ``sink`` under the default ``TransportConfig()`` (its backend is
    ``$KVSP_QUIC_BACKEND``) takes the native data plane (``bridge.native_receive.native_fetch``:
    a native connection and a sink that hands out every destination at once); False: the
    Python path, which ends a FETCH at its first layer that fails verification."""
    return TransportConfig().backend == "native" and sink.destinations_at_once()
