"""One peer session of the relay: driving the sans-IO MOQT session over a QUIC connection
(``peer``), sending what waits on it in draft-22 §"Priorities" order (``schedule``,
``sender``), what is refused before routing (``limits``) and the bound on every wait on a
peer (``deadline``). docs/relay.md "Architecture"."""
