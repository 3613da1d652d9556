"""The MOQT relay (DESIGN.md §1, §2; docs/relay.md): routes by namespace, fans one upstream
subscription out to many subscribers, caches objects and serves FETCH from the cache,
chains to another relay. Content-agnostic: imports only kvsp_moq.wire / moqt / transport /
pubsub, never kvsp_moq.kvsp.

``relay = await Relay(RelayConfig(...)).start()``; ``python -m relay --listen HOST:PORT``.

Grouped by job (docs/relay.md "Architecture"): ``session`` (one peer session), ``subscribe``
(routing, subscriptions, fan-out, PUBLISH, the upstream link), ``fetch`` (the object cache
and FETCH), ``transcode``, ``ops`` (configuration, authorization, observability); the server
(``core``, ``ports``, ``workers``) at the top.
"""

from .core import Relay
from .fetch.cache import CachedObject, ObjectCache
from .ops.config import RelayConfig
from .ops.stats import RelayStats
from .subscribe.routing import RoutingTable

__all__ = ["CachedObject", "ObjectCache", "Relay", "RelayConfig", "RelayStats", "RoutingTable"]
