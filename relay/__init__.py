"""The MOQT relay (DESIGN.md §1, §2; docs/relay.md): routes by namespace, fans one upstream
subscription out to many subscribers, caches objects and serves FETCH from the cache,
chains to another relay. Content-agnostic: imports only kvsp_moq.wire / moqt / transport /
pubsub, never kvsp_moq.kvsp.

``relay = await Relay(RelayConfig(...)).start()``; ``python -m relay --listen HOST:PORT``.
"""

from .cache import CachedObject, ObjectCache
from .config import RelayConfig
from .core import Relay
from .routing import RoutingTable
from .stats import RelayStats

__all__ = ["CachedObject", "ObjectCache", "Relay", "RelayConfig", "RelayStats", "RoutingTable"]
