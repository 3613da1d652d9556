"""``kvsp moq subscribe|fetch|publish``: a MOQT client/server on the command line.

NAMESPACE is the Track Namespace fields joined by ``/`` (``kvsp-1/demo``). ``subscribe`` and
``fetch`` print one line per object on stdout: ``group object size sha256hex``. Progress
and errors go to stderr. Exit status: 0 done, 1 a MOQT error (its code is printed), 2 bad
arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import signal
import sys
from pathlib import Path
from collections.abc import Callable, Coroutine, Iterable

from ..moqt.version import Version
from ..pubsub import Catalog, MoqtError, ReceivedObject, MoqtSession, TrackPublisher, connect, serve
from ..transport import TransportConfig, run
from ..transport.tls import make_self_signed
from .core import UsageError


def _namespace(text: str) -> tuple[str, ...]:
    fields = tuple(text.split("/"))
    if not text or any(not f for f in fields):
        raise UsageError(f"NAMESPACE {text!r}: fields joined by '/', none empty")
    return fields


def _location(text: str) -> tuple[int, int]:
    group, sep, obj = text.partition(":")
    if not sep or not group.isdigit() or not obj.isdigit():
        raise UsageError(f"location {text!r} must be GROUP:OBJECT (decimal)")
    return int(group), int(obj)


def _config(args: argparse.Namespace, **extra: object) -> TransportConfig:
    alpns = [Version(d).alpn for d in args.draft] if args.draft else None
    try:
        return TransportConfig(
            insecure=args.insecure, ca_file=args.ca,
            max_datagram_size=args.max_datagram_size,
            **({"alpn_protocols": alpns} if alpns else {}), **extra)  # type: ignore[arg-type]
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _print_object(obj: ReceivedObject) -> None:
    digest = hashlib.sha256(obj.payload).hexdigest()
    sys.stdout.write(f"{obj.group_id} {obj.object_id} {len(obj.payload)} {digest}\n")
    sys.stdout.flush()


async def _subscribe(args: argparse.Namespace) -> int:
    session = await connect(args.url, _config(args))
    try:
        sub = await session.subscribe(_namespace(args.namespace), args.track)
        seen = 0
        async for obj in sub:
            _print_object(obj)
            seen += 1
            if args.count is not None and seen >= args.count:
                await sub.cancel()
                break
        return 0
    finally:
        await session.close()


async def _fetch(args: argparse.Namespace) -> int:
    session = await connect(args.url, _config(args))
    try:
        stream = await session.fetch(_namespace(args.namespace), args.track,
                                     start=_location(args.start),
                                     end=_location(args.end) if args.end else None)
        async for obj in stream:
            _print_object(obj)
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


async def _publish_objects(track: TrackPublisher, args: argparse.Namespace) -> None:
    if args.subscribers:
        print(f"kvsp moq publish: waiting for {args.subscribers} subscriber(s)", file=sys.stderr)
        await _wait_subscribers(track, args.subscribers)
    total = -(-Path(args.file).stat().st_size // args.object_size)
    for object_id, chunk in enumerate(_chunks(Path(args.file), args.object_size)):
        await track.write_object(args.group, object_id, chunk)
        print(f"kvsp moq publish: object {object_id + 1}/{total}", file=sys.stderr)
    await track.end_group()


async def _until_signalled() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


async def _publish(args: argparse.Namespace) -> int:
    if not Path(args.file).is_file():
        raise UsageError(f"{args.file}: no such file")
    if args.object_size <= 0:
        raise UsageError("--object-size must be positive")
    ns = _namespace(args.namespace)
    if args.serve:
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
        track = catalog.add(TrackPublisher(ns, args.track))
        server = await serve(host, int(port), _config(args, **tls), catalog=catalog)
        print(f"kvsp moq publish: serving moqt://{host}:{server.port}/ "
              f"{args.namespace} {args.track}", file=sys.stderr, flush=True)
        try:
            await _publish_objects(track, args)
            print("kvsp moq publish: done; serving FETCH until interrupted", file=sys.stderr, flush=True)
            await _until_signalled()
        finally:
            server.close()
            await server.wait_closed()
        return 0
    if not args.url:
        raise UsageError("give the relay URL, or --serve HOST:PORT")
    session: MoqtSession = await connect(args.url, _config(args))
    try:
        track = session.create_track(ns, args.track)
        await session.publish_namespace(ns)
        await _publish_objects(track, args)
        await track.finish()  # PUBLISH_DONE to every subscriber
        await session.drain()  # nothing sent may be lost to the close below
        if args.linger:
            await asyncio.sleep(args.linger)  # keep answering FETCH for --linger seconds
        return 0
    finally:
        await session.close()


def _runner(coro_fn: Callable[[argparse.Namespace], Coroutine[object, object, int]]
            ) -> Callable[[argparse.Namespace], int]:
    def handler(args: argparse.Namespace) -> int:
        try:
            return int(run(coro_fn(args)))
        except MoqtError as exc:
            print(f"kvsp moq: MOQT error 0x{exc.code:x}: {exc}", file=sys.stderr)
            return 1
        except (ConnectionError, TimeoutError, asyncio.TimeoutError) as exc:
            print(f"kvsp moq: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
    return handler


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--insecure", action="store_true", help="do not verify the server certificate")
    p.add_argument("--ca", metavar="PEM", help="trust this CA / self-signed certificate")
    p.add_argument("--draft", type=int, action="append", choices=[18, 20, 21, 22],
                   help="offer only this draft (repeatable; default 22, 21, 20, 18)")
    p.add_argument("--max-datagram-size", type=int, default=1200, metavar="BYTES")


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser("moq", help="MOQT client and server tools")
    msub = p.add_subparsers(dest="moq_command", required=True, metavar="ACTION")

    q = msub.add_parser("subscribe", help="SUBSCRIBE and print `group object size sha256` per object")
    q.add_argument("url", metavar="URL")
    q.add_argument("namespace", metavar="NAMESPACE")
    q.add_argument("track", metavar="TRACK")
    q.add_argument("--count", type=int, metavar="N", help="stop after N objects")
    _common(q)
    q.set_defaults(handler=_runner(_subscribe))

    q = msub.add_parser("fetch", help="FETCH an object range and print one line per object")
    q.add_argument("url", metavar="URL")
    q.add_argument("namespace", metavar="NAMESPACE")
    q.add_argument("track", metavar="TRACK")
    q.add_argument("--start", default="0:0", metavar="G:O")
    q.add_argument("--end", metavar="G:O", help="inclusive; default: the largest object")
    _common(q)
    q.set_defaults(handler=_runner(_fetch))

    q = msub.add_parser("publish", help="publish FILE as the objects of one group")
    q.add_argument("url", metavar="URL", nargs="?", help="relay to publish to (omit with --serve)")
    q.add_argument("namespace", metavar="NAMESPACE")
    q.add_argument("track", metavar="TRACK")
    q.add_argument("--file", required=True, metavar="F")
    q.add_argument("--object-size", required=True, type=int, metavar="N")
    q.add_argument("--group", type=int, default=0)
    q.add_argument("--serve", metavar="HOST:PORT", help="be the server instead of connecting")
    q.add_argument("--cert", metavar="PEM")
    q.add_argument("--key", metavar="PEM")
    q.add_argument("--subscribers", type=int, default=0, metavar="N",
                   help="wait for N subscribers before publishing")
    q.add_argument("--linger", type=float, default=0.0, metavar="S",
                   help="client mode: keep the session S seconds after publishing")
    _common(q)
    q.set_defaults(handler=_runner(_publish))
