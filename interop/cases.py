"""Interop cases: our MOQT stack (``kvsp_moq.pubsub``) against third-party peers.

Each case runs our side in this process and the peer as a subprocess, and returns what it
observed (negotiated version, every object's group/object/status/length/SHA-256, PUBLISH_DONE,
how sessions ended); ``tests/test_interop_*.py`` compare that with the expected bytes. Run one
by hand with::

    python -m interop.cases CASE --draft 22 --peer-bin .peers/moq-rs@moq-rs==0.5.1/bin \\
        --cert C --key K

(``interop.testing.run_case`` does this from the tests, through ``unshare -n`` where the peer
is an aiomoqt server.) ``--transport webtransport`` runs the same case with every session over
WebTransport (``https://`` URLs; our server with ``TransportConfig.webtransport``; aiomoqt's
servers in their WebTransport mode; caprid-relay has none). The last stdout line is
``RESULT <json>``; progress goes to stderr.

Cases (``--draft`` pins our ALPN list to ``moqt-<draft>`` unless ``--alpn`` is given):

==================== ====================================================================
moqrs-pub            moq-rs server publishes (peer_scripts/moqrs_publisher.py); our client
                     subscribes
moqrs-sub            our server publishes; moq-rs client subscribes (moqrs_subscriber.py)
aiomoqt-sub-example  our server publishes; ``python -m aiomoqt.examples.sub_example``
aiomoqt-sub          our server publishes; aiomoqt_subscriber.py (same aiomoqt API, bytes)
aiomoqt-pub-example  ``python -m aiomoqt.examples.pub_example`` publishes to our server
aiomoqt-pub-server   ``moq-pub-server`` publishes; our client subscribes (netns only)
aiomoqt-relay-pub-   pub_example publishes into aiomoqt's ``moq-interop-relay``; our client
example              subscribes at that relay (netns only)
caprid-sub           our server publishes; caprid-relay subscriber (caprid_subscriber.py)
caprid-pub           caprid-relay publisher; our server asks SUBSCRIBE_NAMESPACE, SUBSCRIBEs
==================== ====================================================================
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import sys
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvsp_moq.moqt.messages import Location, LocationFilter, MessageParameters
from kvsp_moq.moqt.objects import ObjectStatus
from kvsp_moq.pubsub import (Catalog, MoqtError, MoqtServer, ReceivedObject, MoqtSession, connect,
                             serve)
from kvsp_moq.transport import TransportConfig

from .harness import PEER_SCRIPTS, CaseError, PeerProcess, log, only_loopback, payload, sha256

#: Every case publishes GROUPS groups of OBJECTS objects of SIZE bytes (3 packets each).
GROUPS, OBJECTS, SIZE = 3, 4, 3000
#: The track name; the namespace is ns_of(peer) = ("kvsp", "interop", peer) (moq-rs sees it
#: as the broadcast path ``kvsp/interop/moqrs``).
TRACK = "t0"
STEP = 10.0  # seconds for any single expected step (safety net, never a readiness wait)
#: Fixed port for aiomoqt's servers: they run alone in a fresh network namespace.
NETNS_PORT = 14434


@dataclass
class Options:
    case: str
    draft: int
    peer_bin: Path
    cert: Path
    key: Path
    alpn: tuple[str, ...] = ()
    groups: int = GROUPS
    objects: int = OBJECTS
    size: int = SIZE
    #: Every session over WebTransport (``https://`` URLs) instead of raw QUIC.
    webtransport: bool = False

    @property
    def alpns(self) -> tuple[str, ...]:
        return self.alpn or (f"moqt-{self.draft}",)

    @property
    def python(self) -> str:
        return str(self.peer_bin / "python")

    @property
    def scheme(self) -> str:
        """The URL scheme of every session: ``https`` (WebTransport) or ``moqt``."""
        return "https" if self.webtransport else "moqt"

    def server_config(self) -> TransportConfig:
        return TransportConfig(certificate_pem=self.cert.read_bytes(),
                               private_key_pem=self.key.read_bytes(),
                               alpn_protocols=self.alpns, webtransport=self.webtransport)

    def client_config(self) -> TransportConfig:
        return TransportConfig(insecure=True, alpn_protocols=self.alpns)


def obj_record(o: ReceivedObject) -> dict[str, Any]:
    return {"group": o.group_id, "subgroup": o.subgroup_id, "object": o.object_id,
            "status": int(o.status), "len": len(o.payload), "sha256": sha256(o.payload),
            "properties": [[p.type, p.value if isinstance(p.value, int) else bytes(p.value).hex()]
                           for p in o.properties]}


def ns_of(peer: str) -> tuple[str, ...]:
    return ("kvsp", "interop", peer)


# ==========================================================================================
# our server side, shared by the "peer subscribes" cases
class OurServer:
    """Our MOQT server with one track; records each session's version and how it ended."""

    def __init__(self, opts: Options, namespace: tuple[str, ...],
                 on_session: Callable[[MoqtSession], Awaitable[None] | None] | None = None,
                 accept_publish: bool = False) -> None:
        self.opts = opts
        self.accept_publish = accept_publish
        self.catalog = Catalog()
        self.track = self.catalog.create(namespace, TRACK)
        self.sessions: list[MoqtSession] = []
        self._on_session = on_session
        self.server: MoqtServer | None = None

    async def __aenter__(self) -> OurServer:
        def on_session(s: MoqtSession) -> Awaitable[None] | None:
            log(f"our server: session on draft {int(s.version)}")
            self.sessions.append(s)
            return self._on_session(s) if self._on_session is not None else None

        self.server = await serve("127.0.0.1", 0, self.opts.server_config(),
                                  catalog=self.catalog, on_session=on_session,
                                  accept_publish=self.accept_publish)
        return self

    @property
    def port(self) -> int:
        assert self.server is not None
        return self.server.port

    async def publish(self) -> None:
        o = self.opts
        for g in range(o.groups):
            for i in range(o.objects):
                await self.track.write_object(g, i, payload(g, i, o.size))
        await self.track.finish()
        log("our server: track written and finished")

    def report(self) -> dict[str, Any]:
        """Each session's version and close (code, reason); None: still open at this point."""
        out = []
        for s in self.sessions:
            closed = s.closed.result() if s.closed.done() else None
            out.append({"version": int(s.version), "closed": list(closed) if closed else None})
        return {"server_sessions": out,
                "version": out[0]["version"] if out else None,
                "track_subscribers_seen": self.track.subscribed.is_set()}

    async def __aexit__(self, *exc: object) -> None:
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.server.wait_closed(), 5)


async def close_quietly(session: MoqtSession | None) -> None:
    """Close ``session`` (if any) within 5 s, ignoring whatever goes wrong."""
    if session is not None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(session.close(), 5)


async def collect_objects(sub: Any, *,
                          until: Callable[[list[dict[str, Any]]], bool] | None = None,
                          timeout: float = STEP) -> tuple[list[dict[str, Any]], str | None]:
    """Objects of a subscription until it ends (or ``until(objects)``); returns them and the
    error that ended it, if any."""
    objs: list[dict[str, Any]] = []
    error: str | None = None

    async def run() -> None:
        nonlocal error
        try:
            async for o in sub:
                objs.append(obj_record(o))
                if until is not None and until(objs):
                    return
        except MoqtError as exc:
            error = str(exc)

    try:
        await asyncio.wait_for(run(), timeout)
    except asyncio.TimeoutError:
        error = f"timeout after {timeout:.0f} s"
    return objs, error


# ==========================================================================================
# moq-rs
async def case_moqrs_pub(opts: Options) -> dict[str, Any]:
    """moq-rs server publishes; our client subscribes."""
    ns = ns_of("moqrs")
    peer = PeerProcess("moq-rs server", [
        opts.python, PEER_SCRIPTS / "moqrs_publisher.py", "--bind", "127.0.0.1:0",
        "--cert", opts.cert, "--key", opts.key, "--broadcast", "/".join(ns), "--track", TRACK,
        "--groups", opts.groups, "--objects", opts.objects, "--size", opts.size], stdin=True)
    session = None
    result: dict[str, Any] = {}
    try:
        await peer.start()
        addr = await peer.expect(lambda ln: ln.startswith("READY ") and ln.split()[1], STEP,
                                 "READY line")
        port = int(addr.rsplit(":", 1)[1])
        session = await connect(f"{opts.scheme}://127.0.0.1:{port}/moq", opts.client_config())
        result["version"] = int(session.version)
        # moq-rs opens PUBLISH_NAMESPACE (and SUBSCRIBE_NAMESPACE) toward us on connect.
        kind, announced = await asyncio.wait_for(session.namespace_updates.get(), STEP)
        result["peer_publish_namespace"] = [kind, [f.decode() for f in announced]]
        sub = await session.subscribe(ns, TRACK)
        result["subscribe_ok_track_properties"] = [
            [p.type, p.value if isinstance(p.value, int) else bytes(p.value).hex()]
            for p in sub.response.track_properties]  # type: ignore[union-attr]
        await peer.send("publish")
        objs, error = await collect_objects(sub)
        result.update(objects=objs, error=error, data_streams=sub.stats.data_streams)
        done = sub.publish_done
        result["publish_done"] = (None if done is None else
                                  {"status": done.status_code, "stream_count": done.stream_count,
                                   "reason": done.error_reason})
        await peer.expect_event("published", STEP)
    finally:
        await close_quietly(session)
        await peer.stop()
        result["peer_log"] = peer.tail(30)
    return result


async def case_moqrs_sub(opts: Options) -> dict[str, Any]:
    """Our server publishes; moq-rs's client subscribes."""
    ns = ns_of("moqrs")
    result: dict[str, Any] = {}
    async with OurServer(opts, ns) as srv:
        peer = PeerProcess("moq-rs client", [
            opts.python, PEER_SCRIPTS / "moqrs_subscriber.py",
            f"{opts.scheme}://127.0.0.1:{srv.port}/moq", "/".join(ns), TRACK])
        try:
            await peer.start()
            await peer.expect_event("subscribed", STEP)
            await srv.publish()
            events = await peer.collect_events("end", STEP)
            result["peer_events"] = events
        except CaseError as exc:
            result["error"] = str(exc)
        finally:
            await peer.stop()
            result["peer_log"] = peer.tail(40)
            result.update(srv.report())
    return result


# ==========================================================================================
# aiomoqt (servers only inside a loopback-only network namespace)
def _aiomoqt_setup_draft(line: str) -> int | None:
    m = re.search(r"setup complete: draft-(\d+)", line)
    return int(m.group(1)) if m else None


async def case_aiomoqt_sub_example(opts: Options) -> dict[str, Any]:
    """Our server publishes; aiomoqt's sub_example (unmodified) subscribes."""
    ns = ns_of("aiomoqt")
    result: dict[str, Any] = {}
    async with OurServer(opts, ns) as srv:
        peer = PeerProcess("aiomoqt sub_example", [
            opts.python, "-m", "aiomoqt.examples.sub_example",
            f"{opts.scheme}://127.0.0.1:{srv.port}/moq", "-k", "-N", "/".join(ns), "-T", TRACK,
            "--draft", opts.draft, "-t", "15"])
        try:
            await peer.start()
            result["peer_draft"] = await peer.expect(_aiomoqt_setup_draft, STEP, "setup")
            await peer.expect(lambda ln: "MOQT app: subscribed to" in ln, STEP, "SUBSCRIBE_OK")
            await srv.publish()
            total = await peer.expect(
                lambda ln: re.search(r"Total: ([\d,]+) objects, ([\d,]+) groups", ln), 20,
                "summary")
            result["peer_total_objects"] = int(total.group(1).replace(",", ""))
            result["peer_total_groups"] = int(total.group(2).replace(",", ""))
            result["peer_rc"] = await peer.wait(STEP)
        except CaseError as exc:
            result["error"] = str(exc)
        finally:
            await peer.stop()
            result["peer_log"] = peer.tail(30)
            result.update(srv.report())
    return result


async def case_aiomoqt_sub(opts: Options) -> dict[str, Any]:
    """Our server publishes; aiomoqt's client API (aiomoqt_subscriber.py) reports bytes."""
    ns = ns_of("aiomoqt")
    result: dict[str, Any] = {}
    async with OurServer(opts, ns) as srv:
        peer = PeerProcess("aiomoqt subscriber", [
            opts.python, PEER_SCRIPTS / "aiomoqt_subscriber.py",
            f"{opts.scheme}://127.0.0.1:{srv.port}/moq", "/".join(ns), TRACK, opts.draft,
            opts.groups * opts.objects, "15"])
        try:
            await peer.start()
            setup = await peer.expect_event("setup", STEP)
            result["peer_draft"] = setup.get("draft")
            await peer.expect_event("subscribed", STEP)
            await srv.publish()
            result["peer_events"] = await peer.collect_events("end", 20)
        except CaseError as exc:
            result["error"] = str(exc)
        finally:
            await peer.stop()
            result["peer_log"] = peer.tail(30)
            result.update(srv.report())
    return result


async def case_aiomoqt_pub_example(opts: Options) -> dict[str, Any]:
    """aiomoqt's pub_example publishes with a bare PUBLISH (forward=0) to our server, which
    accepts it (REQUEST_OK, then REQUEST_UPDATE forward=1) and collects RELAY_OBJECTS objects."""
    ns = ns_of("aiomoqt")[:2]
    result: dict[str, Any] = {}
    sessions: asyncio.Queue[MoqtSession] = asyncio.Queue()
    async with OurServer(opts, ("unused",), on_session=sessions.put_nowait,
                         accept_publish=True) as srv:
        peer = PeerProcess("aiomoqt pub_example", [
            opts.python, "-m", "aiomoqt.examples.pub_example",
            f"{opts.scheme}://127.0.0.1:{srv.port}/moq", "-k", "-N", "/".join(ns), "-T", TRACK,
            "--draft", opts.draft, "-t", "30", "-r", "200", "-s", opts.size])
        try:
            await peer.start()
            result["peer_draft"] = await peer.expect(_aiomoqt_setup_draft, STEP, "setup")
            session = await asyncio.wait_for(sessions.get(), STEP)
            result["version"] = int(session.version)
            incoming = await asyncio.wait_for(session.incoming_publishes.get(), STEP)
            result["published"] = ["/".join(f.decode() for f in incoming.namespace),
                                   incoming.name.decode()]

            def enough(objs: list[dict[str, Any]]) -> bool:
                return sum(o["status"] == ObjectStatus.NORMAL for o in objs) >= RELAY_OBJECTS

            objs, error = await collect_objects(incoming.subscription, until=enough)
            result.update(objects=objs, error=error)
            await incoming.subscription.cancel()
        except CaseError as exc:
            result["error"] = str(exc)
        finally:
            await peer.stop()
            result["peer_log"] = peer.tail(30)
            result.update(srv.report())
    return result


async def case_aiomoqt_pub_server(opts: Options) -> dict[str, Any]:
    """aiomoqt's moq-pub-server publishes; our client subscribes to groups 0..GROUPS-1."""
    if not only_loopback():
        raise CaseError("refusing to start moq-pub-server outside a loopback-only network "
                        "namespace (it listens on every address whatever --bind says)")
    ns = ns_of("aiomoqt")
    peer = PeerProcess("moq-pub-server", [
        opts.peer_bin / "moq-pub-server", "--bind", "127.0.0.1", "-p", NETNS_PORT,
        "-W" if opts.webtransport else "-Q",
        "--draft", opts.draft, "-N", "/".join(ns), "-T", TRACK, "-s", opts.size,
        "-g", opts.objects, "-r", "500", "--cert", opts.cert, "--key", opts.key])
    session = None
    result: dict[str, Any] = {}
    last_group = opts.groups - 1
    try:
        await peer.start()
        await peer.expect(lambda ln: "publisher server ready on" in ln, STEP, "ready line")
        # aiomoqt's WebTransport servers serve the path "/" only (404 for "/moq")
        path = "/" if opts.webtransport else "/moq"
        session = await connect(f"{opts.scheme}://127.0.0.1:{NETNS_PORT}{path}",
                                opts.client_config())
        result["version"] = int(session.version)
        # ABSOLUTE_RANGE {0, 0} .. end of group GROUPS-1.
        flt = LocationFilter.absolute(Location(0, 0), last_group)
        params = MessageParameters(location_filter=flt)
        sub = await session.subscribe(ns, TRACK, parameters=params)

        def enough(objs: list[dict[str, Any]]) -> bool:
            normal = [o for o in objs if o["status"] == ObjectStatus.NORMAL]
            return len(normal) >= opts.groups * opts.objects or any(
                o["group"] > last_group for o in objs)

        objs, error = await collect_objects(sub, until=enough)
        result.update(objects=objs, error=error)
        await sub.cancel()
    finally:
        await close_quietly(session)
        await peer.stop()
        result["peer_log"] = peer.tail(30)
    return result


#: Objects per group of aiomoqt's pub_example (``GROUP_SIZE`` in examples/pub_example.py).
PUB_EXAMPLE_GROUP = 30
RELAY_OBJECTS = PUB_EXAMPLE_GROUP + 10


async def case_aiomoqt_relay_pub_example(opts: Options) -> dict[str, Any]:
    """aiomoqt's pub_example publishes into aiomoqt's relay (``moq-interop-relay``); our client
    subscribes at the relay and gets the first RELAY_OBJECTS objects (netns only)."""
    if not only_loopback():
        raise CaseError("refusing to start moq-interop-relay outside a loopback-only network "
                        "namespace (it listens on every address whatever --bind says)")
    ns = ns_of("aiomoqt")[:2]
    relay = PeerProcess("moq-interop-relay", [
        opts.peer_bin / "moq-interop-relay", "--bind", "127.0.0.1", "--port", NETNS_PORT,
        *([] if opts.webtransport else ["--quic"]), "--draft", opts.draft, "--cert", opts.cert,
        "--key", opts.key])
    pub = PeerProcess("aiomoqt pub_example", [
        opts.python, "-m", "aiomoqt.examples.pub_example",
        f"{opts.scheme}://127.0.0.1:{NETNS_PORT}/",
        "-k", "-N", "/".join(ns), "-T", TRACK, "--draft", opts.draft, "-t", "30",
        "-r", "200", "-s", opts.size])
    session = None
    result: dict[str, Any] = {}
    try:
        await relay.start()
        await relay.expect(lambda ln: "Listening on" in ln, STEP, "listening line")
        await pub.start()
        result["peer_draft"] = await pub.expect(_aiomoqt_setup_draft, STEP, "setup")
        # The relay accepted the PUBLISH (REQUEST_OK, forward=0: parked until a subscriber).
        await pub.expect(lambda ln: "RequestOk(request_id=0" in ln, STEP, "PUBLISH accepted")
        session = await connect(f"{opts.scheme}://127.0.0.1:{NETNS_PORT}/", opts.client_config())
        result["version"] = int(session.version)
        sub = await session.subscribe(ns, TRACK)

        def enough(objs: list[dict[str, Any]]) -> bool:
            return sum(o["status"] == ObjectStatus.NORMAL for o in objs) >= RELAY_OBJECTS

        objs, error = await collect_objects(sub, until=enough)
        result.update(objects=objs, error=error)
        await sub.cancel()
    finally:
        await close_quietly(session)
        await pub.stop()
        await relay.stop()
        result["peer_log"] = pub.tail(15) + relay.tail(15)
    return result


# ==========================================================================================
# caprid-relay
async def case_caprid_sub(opts: Options) -> dict[str, Any]:
    """Our server publishes; caprid-relay's subscriber subscribes."""
    ns = ns_of("caprid")
    result: dict[str, Any] = {}
    async with OurServer(opts, ns) as srv:
        peer = PeerProcess("caprid subscriber", [
            opts.python, PEER_SCRIPTS / "caprid_subscriber.py",
            f"https://127.0.0.1:{srv.port}/moq", "/".join(ns), TRACK])
        try:
            await peer.start()
            result["peer_protocol"] = (await peer.expect_event("connected", STEP)).get("protocol")
            await peer.expect_event("subscribed", STEP)
            await srv.publish()
            result["peer_events"] = await peer.collect_events("end", STEP)
        except CaseError as exc:
            result["error"] = str(exc)
        finally:
            await peer.stop()
            result["peer_log"] = peer.tail(30)
            result.update(srv.report())
    return result


async def case_caprid_pub(opts: Options) -> dict[str, Any]:
    """caprid-relay's publisher connects; our server sends SUBSCRIBE_NAMESPACE, learns the
    namespace from NAMESPACE, SUBSCRIBEs to the track and receives it (the ingest model)."""
    ns = ns_of("caprid")
    result: dict[str, Any] = {}
    received: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()

    async def ingest(s: MoqtSession) -> None:
        try:
            await s.subscribe_namespace(ns[:2])
            kind, suffix = await asyncio.wait_for(s.namespace_updates.get(), STEP)
            full = tuple(f.encode() for f in ns[:2]) + tuple(suffix)
            sub = await s.subscribe(full, TRACK)
            objs, error = await collect_objects(sub)
            done = sub.publish_done
            received.set_result({
                "namespace_update": [kind, [f.decode() for f in suffix]], "objects": objs,
                "error": error, "data_streams": sub.stats.data_streams,
                "publish_done": None if done is None else {
                    "status": done.status_code, "stream_count": done.stream_count}})
        except Exception as exc:  # noqa: BLE001 - reported in the result
            if not received.done():
                received.set_result({"error": repr(exc)})

    async with OurServer(opts, ("unused",), on_session=ingest) as srv:
        peer = PeerProcess("caprid publisher", [
            opts.python, PEER_SCRIPTS / "caprid_publisher.py",
            f"https://127.0.0.1:{srv.port}/moq", "/".join(ns), TRACK,
            "--groups", opts.groups, "--objects", opts.objects, "--size", opts.size])
        try:
            await peer.start()
            result.update(await asyncio.wait_for(received, 2 * STEP))
            result["peer_events"] = await peer.collect_events("end", STEP)
        except (CaseError, asyncio.TimeoutError) as exc:
            result.setdefault("error", repr(exc))
        finally:
            await peer.stop()
            result["peer_log"] = peer.tail(30)
            result.update(srv.report())
    return result


CASES: dict[str, Callable[[Options], Awaitable[dict[str, Any]]]] = {
    "moqrs-pub": case_moqrs_pub,
    "moqrs-sub": case_moqrs_sub,
    "aiomoqt-sub-example": case_aiomoqt_sub_example,
    "aiomoqt-sub": case_aiomoqt_sub,
    "aiomoqt-pub-example": case_aiomoqt_pub_example,
    "aiomoqt-pub-server": case_aiomoqt_pub_server,
    "aiomoqt-relay-pub-example": case_aiomoqt_relay_pub_example,
    "caprid-sub": case_caprid_sub,
    "caprid-pub": case_caprid_pub,
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m interop.cases", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("case", choices=sorted(CASES))
    ap.add_argument("--draft", type=int, required=True)
    ap.add_argument("--peer-bin", type=Path, required=True, help="the peer venv's bin folder")
    ap.add_argument("--cert", type=Path, required=True)
    ap.add_argument("--key", type=Path, required=True)
    ap.add_argument("--alpn", default="", help="comma list overriding moqt-<draft>")
    ap.add_argument("--guard", type=float, default=60.0, help="whole-case safety timeout (s)")
    ap.add_argument("--transport", choices=("quic", "webtransport"), default="quic",
                    help="raw QUIC (moqt://) or WebTransport (https://) for every session")
    args = ap.parse_args(argv)
    opts = Options(args.case, args.draft, args.peer_bin, args.cert, args.key,
                   alpn=tuple(a for a in args.alpn.split(",") if a),
                   webtransport=args.transport == "webtransport")

    async def run() -> dict[str, Any]:
        return await asyncio.wait_for(CASES[args.case](opts), args.guard)

    try:
        from kvsp_moq.transport import run as run_loop

        result = run_loop(run())
    except Exception as exc:  # noqa: BLE001 - the harness reads the result line
        traceback.print_exc()
        result = {"error": f"case failed: {exc!r}"}
    result = {"case": args.case, "draft": args.draft, "transport": args.transport, **result}
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
