"""``kvsp moq subscribe|fetch|publish``: a MOQT client/server on the command line
(``kvsp moq view``, the browser block viewer, is :mod:`.viewer`).

NAMESPACE is the Track Namespace fields joined by ``/`` (``kvsp-1/demo``; a field ``hex:ab01``
is binary), or ``--block COMPAT/SCOPE/KEY/REPLICA`` names a binding-v1 block (.moq_args).
``--token`` / ``--token-file`` go in SETUP and with each request. ``subscribe`` and ``fetch``
print one line per object on stdout: ``group object size sha256hex`` (``--out FILE``: the
payloads too). Progress and errors go to stderr. Exit status: 0 done, 1 a MOQT or connection
error (one ``kvsp: ...`` line with its code and a hint), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import logging
import signal
import sys
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from collections.abc import Callable, Coroutine, Iterable

from typing import BinaryIO

from ..bridge.binding import BLOCK_GROUP, LAYER_DIGEST, track_properties
from ..kvsp import container
from ..kvsp.errors import KvspError
from ..moqt.messages import MessageParameters
from ..moqt.version import Version
from ..pubsub import Catalog, ReceivedObject, MoqtSession, TrackPublisher, connect, serve
from ..transport import TransportConfig, run
from ..transport.tls import make_self_signed
from .errors import UsageError
from .viewer import register_view
from .moq_args import (Names, add_name_options, add_token_options, names, request_parameters,
                       tokens)


def _location(text: str) -> tuple[int, int]:
    group, sep, obj = text.partition(":")
    if not sep or not group.isdigit() or not obj.isdigit():
        raise UsageError(f"location {text!r} must be GROUP:OBJECT (decimal)")
    return int(group), int(obj)


_URL_HELP = ("moqt://HOST:PORT/PATH (MOQT over raw QUIC) or https://HOST:PORT/PATH (MOQT over "
             "WebTransport)")


def _config(args: argparse.Namespace, **extra: object) -> TransportConfig:
    alpns = [Version(d).alpn for d in args.draft] if args.draft else None
    try:
        return TransportConfig(
            insecure=args.insecure, ca_file=args.ca,
            max_datagram_size=args.max_datagram_size, handshake_timeout=args.connect_timeout,
            qlog_dir=getattr(args, "qlog", None),
            congestion_control_algorithm=getattr(args, "congestion_control", None),
            **({"alpn_protocols": alpns} if alpns else {}), **extra)  # type: ignore[arg-type]
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _print_object(obj: ReceivedObject, out: BinaryIO | None) -> None:
    digest = hashlib.sha256(obj.payload).hexdigest()
    if out is not None:
        out.write(obj.payload)
    sys.stdout.write(f"{obj.group_id} {obj.object_id} {len(obj.payload)} {digest}\n")
    sys.stdout.flush()


class _Request:
    """What a client command sends: its names, tokens and per-request parameters."""

    def __init__(self, args: argparse.Namespace, positionals: list[str], what: str) -> None:
        self.names: Names = names(args, positionals, what)
        self.tokens = tokens(args)
        self.parameters: MessageParameters = request_parameters(self.tokens)

    async def connect(self, url: str, config: TransportConfig) -> MoqtSession:
        return await connect(url, config, setup_tokens=self.tokens)


def _out_file(args: argparse.Namespace) -> AbstractContextManager[BinaryIO | None]:
    """``--out FILE``: where the payloads are written, in the order received."""
    return open(args.out, "wb") if args.out else nullcontext()


async def _subscribe(args: argparse.Namespace) -> int:
    req = _Request(args, [p for p in (args.namespace, args.track) if p is not None], "URL")
    config = _config(args)
    with _out_file(args) as out:
        session = await req.connect(args.url, config)
        try:
            sub = await session.subscribe(req.names.namespace, req.names.track,
                                          parameters=req.parameters)
            seen = 0
            async for obj in sub:
                _print_object(obj, out)
                seen += 1
                if args.count is not None and seen >= args.count:
                    await sub.cancel()
                    break
            return 0
        finally:
            await session.close()


async def _fetch(args: argparse.Namespace) -> int:
    req = _Request(args, [p for p in (args.namespace, args.track) if p is not None], "URL")
    start = _location(args.start)
    end = _location(args.end) if args.end else None
    config = _config(args)
    with _out_file(args) as out:
        session = await req.connect(args.url, config)
        try:
            stream = await session.fetch(req.names.namespace, req.names.track, start=start,
                                         end=end, parameters=req.parameters)
            async for obj in stream:
                _print_object(obj, out)
            return 0
        finally:
            await session.close()


def _chunks(path: Path, size: int) -> Iterable[bytes]:
    with open(path, "rb") as fh:
        while chunk := fh.read(size):
            yield chunk


async def _wait_subscribers(track: TrackPublisher, wanted: int) -> None:
    while track.subscriber_count < wanted:
        track.subscribed.clear()
        if track.subscriber_count >= wanted:
            break
        await track.subscribed.wait()


Properties = tuple[tuple[int, int | bytes], ...]


class _Source:
    """The objects to publish: ``--file`` in ``--object-size`` pieces (Object IDs from 0 in
    ``--group``), or ``--container``'s layers as binding v1 has them (docs/binding.md §2:
    group 0, Object ID = absolute layer index, payload K||V, LAYER_DIGEST; the block's Track
    Properties)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.track_properties: Properties = ()
        if (args.file is None) == (args.container is None):
            raise UsageError("give --file F --object-size N, or --container FILE")
        if args.container is not None:
            self._container(args.container)
            return
        if args.object_size is None or args.object_size <= 0:
            raise UsageError("--file needs a positive --object-size N")
        if not Path(args.file).is_file():
            raise UsageError(f"{args.file}: no such file")
        self.group = args.group
        self.total = -(-Path(args.file).stat().st_size // args.object_size)
        self.objects: Iterable[tuple[int, bytes, Properties]] = (
            (i, chunk, ()) for i, chunk in enumerate(_chunks(Path(args.file), args.object_size)))

    def _container(self, path: str) -> None:
        data = Path(path).read_bytes()
        try:
            box = container.decode_container(data)
        except KvspError as exc:
            raise UsageError(f"{path}: not a KVB1 container: {exc}") from None
        header = box.header
        digests = box.layer_digests()
        self.group = BLOCK_GROUP
        self.total = header.layer_count
        self.objects = [(header.first_layer + i, bytes(box.layer_payload(header.first_layer + i)),
                         ((LAYER_DIGEST, digest),)) for i, digest in enumerate(digests)]
        self.track_properties = track_properties(
            token_count=header.token_count, first_layer=header.first_layer,
            layer_count=header.layer_count, layer_digests=digests, max_cache_duration_ms=None)


async def _publish_objects(track: TrackPublisher, args: argparse.Namespace, source: _Source) -> None:
    if args.subscribers:
        print(f"kvsp moq publish: waiting for {args.subscribers} subscriber(s)", file=sys.stderr)
        await _wait_subscribers(track, args.subscribers)
    for n, (object_id, chunk, props) in enumerate(source.objects, 1):
        await track.write_object(source.group, object_id, chunk, properties=props)
        print(f"kvsp moq publish: object {n}/{source.total}", file=sys.stderr, flush=True)
    await track.end_group()


async def _until_signalled() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


async def _publish(args: argparse.Namespace) -> int:
    source = _Source(args)
    positionals = [p for p in (args.url, args.namespace, args.track) if p is not None]
    if args.serve:
        return await _publish_serve(args, names(args, positionals, "the options"), source)
    if not positionals:
        raise UsageError("give the relay URL, or --serve HOST:PORT")
    url = positionals.pop(0)
    req = _Request(args, positionals, "URL")
    session: MoqtSession = await req.connect(url, _config(args))
    try:
        track = session.create_track(req.names.namespace, req.names.track)
        track.track_properties = source.track_properties
        await session.publish_namespace(req.names.namespace, parameters=req.parameters)
        await _publish_objects(track, args, source)
        await track.finish()  # PUBLISH_DONE to every subscriber
        await session.drain()  # nothing sent may be lost to the close below
        if args.linger:
            print(f"kvsp moq publish: published {source.total} objects of {req.names}; answering "
                  f"FETCH for {args.linger:g} s (Ctrl-C ends it)", file=sys.stderr, flush=True)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(_until_signalled(), args.linger)
        return 0
    finally:
        await session.close()


async def _publish_serve(args: argparse.Namespace, where: Names, source: _Source) -> int:
    """``--serve HOST:PORT``: be the MOQT server of the track (every client served)."""
    if args.token or args.token_file:
        raise UsageError("--token / --token-file are for a client (a relay URL), not --serve")
    host, _, port = args.serve.rpartition(":")
    if not host or not port.isdigit():
        raise UsageError("--serve takes HOST:PORT")
    if args.cert and args.key:
        tls: dict[str, object] = {"certificate_file": args.cert, "private_key_file": args.key}
    else:
        cert = make_self_signed()
        tls = {"certificate_pem": cert.cert_pem, "private_key_pem": cert.key_pem}
        print("kvsp moq publish: no --cert/--key, using a self-signed certificate", file=sys.stderr)
    catalog = Catalog()
    track = catalog.add(TrackPublisher(where.namespace, where.track))
    server = await serve(host, int(port), _config(args, webtransport=True, **tls),
                         catalog=catalog)
    print(f"kvsp moq publish: serving moqt://{host}:{server.port}/ "
          f"{where}", file=sys.stderr, flush=True)
    print(f"kvsp moq publish: and over WebTransport at https://{host}:{server.port}/",
          file=sys.stderr, flush=True)
    try:
        await _publish_objects(track, args, source)
        print("kvsp moq publish: done; serving FETCH until interrupted", file=sys.stderr, flush=True)
        await _until_signalled()
    finally:
        server.close()
        await server.wait_closed()
    return 0


def _runner(coro_fn: Callable[[argparse.Namespace], Coroutine[object, object, int]]
            ) -> Callable[[argparse.Namespace], int]:
    """A handler running ``coro_fn``; its failures (MOQT errors, connection errors) reach
    ``kvsp``'s main, which prints them as one ``kvsp: ...`` line (cli/errors.py)."""
    def handler(args: argparse.Namespace) -> int:
        # aioquic logs a failed handshake itself; the one line of cli/errors.py says it
        logging.getLogger("quic").setLevel(logging.ERROR)
        return int(run(coro_fn(args)))
    return handler


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--insecure", action="store_true", help="do not verify the server certificate")
    p.add_argument("--ca", metavar="PEM", help="trust this CA / self-signed certificate")
    p.add_argument("--draft", type=int, action="append", choices=[18, 20, 21, 22],
                   help="offer only this draft (repeatable; default 22, 21, 20, 18)")
    p.add_argument("--max-datagram-size", type=int, default=1200, metavar="BYTES")
    p.add_argument("--connect-timeout", type=float, default=10.0, metavar="S",
                   help="seconds the QUIC handshake may take")
    p.add_argument("--congestion-control", metavar="NAME",
                   help="QUIC congestion control (aioquic: reno, cubic, bbr; default: the "
                        "backend's; docs/transport.md)")
    p.add_argument("--qlog", metavar="DIR",
                   help="write the connection's qlog file into DIR (docs/tracing.md)")


def _names(p: argparse.ArgumentParser) -> None:
    p.add_argument("namespace", metavar="NAMESPACE", nargs="?",
                   help="fields joined by '/'; hex:HEX (or 0xHEX) for a binary field")
    p.add_argument("track", metavar="TRACK", nargs="?", help="track name (with --block: raw)")
    add_name_options(p)


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser("moq", help="MOQT client and server tools")
    msub = p.add_subparsers(dest="moq_command", required=True, metavar="ACTION")

    q = msub.add_parser("subscribe", help="SUBSCRIBE and print `group object size sha256` per object",
                        description="SUBSCRIBE to NAMESPACE TRACK (or --block ...) and print one "
                                    "line per object: group object size sha256")
    q.add_argument("url", metavar="URL", help=_URL_HELP)
    _names(q)
    q.add_argument("--count", type=int, metavar="N", help="stop after N objects")
    q.add_argument("--out", metavar="FILE", help="also write the payloads to FILE, in order")
    _common(q)
    add_token_options(q)
    q.set_defaults(handler=_runner(_subscribe))

    q = msub.add_parser("fetch", help="FETCH an object range and print one line per object",
                        description="FETCH an object range of NAMESPACE TRACK (or --block ...) "
                                    "and print one line per object: group object size sha256")
    q.add_argument("url", metavar="URL", help=_URL_HELP)
    _names(q)
    q.add_argument("--start", default="0:0", metavar="G:O")
    q.add_argument("--end", metavar="G:O", help="inclusive; default: the largest object")
    q.add_argument("--out", metavar="FILE", help="also write the payloads to FILE, in order")
    _common(q)
    add_token_options(q)
    q.set_defaults(handler=_runner(_fetch))

    q = msub.add_parser("publish", help="publish FILE as the objects of one group")
    q.add_argument("url", metavar="URL", nargs="?",
                   help="relay to publish to (omit with --serve); " + _URL_HELP)
    _names(q)
    q.add_argument("--file", metavar="F", help="publish F's octets, --object-size N per object")
    q.add_argument("--object-size", type=int, metavar="N")
    q.add_argument("--group", type=int, default=0, help="the group of --file's objects")
    q.add_argument("--container", metavar="FILE",
                   help="publish a KVB1 container's layers as binding v1 objects (with --block)")
    q.add_argument("--serve", metavar="HOST:PORT", help="be the server instead of connecting")
    q.add_argument("--cert", metavar="PEM")
    q.add_argument("--key", metavar="PEM")
    q.add_argument("--subscribers", type=int, default=0, metavar="N",
                   help="wait for N subscribers before publishing")
    q.add_argument("--linger", type=float, default=0.0, metavar="S",
                   help="client mode: keep the session S seconds after publishing")
    _common(q)
    add_token_options(q)
    q.set_defaults(handler=_runner(_publish))

    register_view(msub)
