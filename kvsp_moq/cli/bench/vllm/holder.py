"""The holder process of ``kvsp bench vllm``'s direct baseline (:mod:`.direct`):
``python -m kvsp_moq.cli.bench.vllm.holder --layers L --layer-bytes X`` serves ``kvsp bench
kv``'s benchmark block (``kv.holder.serve_block``) of ``L`` layers of ``X`` octets each over MOQT
on loopback, prints its :class:`~kvsp_moq.cli.bench.kv.holder.HolderInfo` line and serves until
its stdin closes. ``kv.holder``'s own entry point takes whole MiB per layer; a prefix's layer
is rarely that. Not imported by the package, so that ``python -m`` runs it fresh.
"""

from __future__ import annotations

import argparse

from ..kv.holder import serve_block
from ..kv.relayed import serve_until_stdin_closes
from .direct import BACKEND, DATAGRAM_SIZE, TOKEN_BYTES

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m {__name__}")
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--layer-bytes", type=int, required=True, help=f"a multiple of {TOKEN_BYTES}")
    p.add_argument("--datagram-size", type=int, default=DATAGRAM_SIZE)
    p.add_argument("--backend", default=BACKEND)
    p.add_argument("--host", default="127.0.0.1")
    args = p.parse_args(argv)
    return serve_until_stdin_closes(lambda stop: serve_block(args.host, args.layers, args.layer_bytes,
                                                             args.datagram_size, args.backend, stop))


if __name__ == "__main__":
    raise SystemExit(main())
