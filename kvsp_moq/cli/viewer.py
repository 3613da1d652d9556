"""``kvsp moq view RECORD.json [...] [--url https://...] [--cert-sha256 HEX] [--listen
HOST:PORT]``: serve the block viewer (docs/viewer.md) for the Replica Records given.

Prints ``kvsp moq view: http://HOST:PORT/`` on stdout once listening (``?block=N`` shows the
N-th record, 0 first) and serves until SIGINT / SIGTERM (exit 0). A record that cannot be
viewed (not served over MOQT, no layer digests, a size that is not that of codec raw) or a
bad option: one ``kvsp: ...`` line, exit 2.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
from pathlib import Path

from ..control.common.cli import parse_listen
from ..control.viewer import ViewerBlock, serve_viewer
from ..kvsp.errors import KvspError
from ..kvsp.records import ReplicaRecord
from ..transport import run
from .errors import UsageError

__all__ = ["register_view"]


def _blocks(args: argparse.Namespace) -> list[ViewerBlock]:
    blocks = []
    for path in args.records:
        try:
            record = ReplicaRecord.from_json(json.loads(Path(path).read_text()))
            blocks.append(ViewerBlock.from_record(record, args.url, args.cert_sha256,
                                                  int(args.timeout * 1000)))
        except (OSError, ValueError, KvspError) as exc:  # ViewerError (a ValueError), JSON errors
            raise UsageError(f"{path}: {exc}") from None
    return blocks


async def _view(args: argparse.Namespace) -> int:
    blocks = _blocks(args)
    try:
        host, port = parse_listen(args.listen)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    server = await serve_viewer(blocks, host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"kvsp moq view: {server.url}", flush=True)
    try:
        await stop.wait()
    finally:
        await server.close()
    return 0


def register_view(msub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    q = msub.add_parser("view", help="serve a browser page that receives blocks over "
                                     "WebTransport and verifies each layer (docs/viewer.md)",
                        description="Serve the block viewer for RECORD.json files (Replica "
                                    "Records with a moqt:// holder and layer_digests).")
    q.add_argument("records", metavar="RECORD.json", nargs="+")
    q.add_argument("--url", metavar="https://HOST:PORT/PATH",
                   help="the relay's WebTransport URL (default: the record's moqt:// holder "
                        "as https://)")
    q.add_argument("--cert-sha256", metavar="HEX",
                   help="SHA-256 of the relay's certificate, for serverCertificateHashes (a "
                        "certificate of at most 14 days; `python -m relay` prints it)")
    q.add_argument("--listen", default="127.0.0.1:0", metavar="HOST:PORT",
                   help="where to serve the page (default 127.0.0.1:0, any free port)")
    q.add_argument("--timeout", type=float, default=20.0, metavar="S",
                   help="seconds the page waits for the session, each answer and the block")
    q.set_defaults(handler=lambda args: int(run(_view(args))))
