"""Subscriptions through the relay: routing by namespace (``routing``, ``solicit``,
``namespaces``, ``rendezvous``), one upstream SUBSCRIBE per track fanned out to N subscribers
(``upstream``, ``fanout``, ``datagrams``), PUBLISH in and out (``publish_in``,
``publish_out``) and the session to the ``--upstream`` relay (``uplink``, ``switchover``).
docs/relay.md "Architecture"."""
