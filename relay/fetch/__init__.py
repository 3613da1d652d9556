"""The relay's object cache and FETCH (draft-22 §"FETCH", §"Caching Relays"): the cache and
its digest admission (``cache``, ``digests``), FETCH served from the cache, from what is held
or single-flight upstream (``service``, ``known``, ``held``, ``inflight``) and fill fetches
(``fill``). docs/relay.md "Cache and FETCH"."""
