"""The aiopquic backend (picoquic through aiopquic, Python >= 3.12): see :mod:`.backend`.
Importing this package imports no QUIC library; ``load_backend("aiopquic")`` loads
:mod:`.backend`."""
