"""Running the relay: its configuration (``config``), the ``--config`` file's principals and
grants (``auth``, ``names``), per-request authorization (``tokens``, ``gate``) and what it
reports (``stats``, ``metrics``, ``logs``). docs/relay.md "Operations"."""
