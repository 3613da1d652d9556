"""The "peer via our relay" cells: third-party publishers and subscribers through OUR relay
(``python -m relay``), per draft, with exact payload bytes, counts and negotiated versions.

    python -m interop.relay_cases CASE --draft 22 --peer-bin .peers/moq-rs@moq-rs==0.5.1/bin \\
        --cert C --key K

Every case starts a fresh relay (``python -m relay --listen 127.0.0.1:0 --log-format json``,
our certificate); for drafts below 22 the relay's ALPN list is pinned to ``moqt-<draft>``
(``interop/relay_alpn.py``, the same relay code path), because neither moq-rs nor caprid can
pin its version. The relay's JSON log gives every session's negotiated version
(``session_open``) and the requests it received. The last stdout line is ``RESULT <json>``;
:func:`check` turns a result into the list of problems (empty: the cell passes) — the tests
(``tests/test_interop_relay_peers.py``) and the matrix (``python -m interop.matrix``, column
group ``peer via our relay``) share it.

======================== ============================================================ ======
case                     path                                                         drafts
======================== ============================================================ ======
moqrs-pub>relay>ours     moq-rs client publishes (PUBLISH_NAMESPACE) → relay → our     22 20 18
                         subscriber
moqrs-pub>relay>moqrs    moq-rs client publishes → relay → moq-rs client subscribes    22 20 18
ours>relay>moqrs         our publisher (PUBLISH_NAMESPACE) → relay → moq-rs subscriber 22 20 18
caprid-pub>relay>ours    caprid publisher (waits for SUBSCRIBE_NAMESPACE) → relay →    22 20
                         our subscriber
ours>relay>caprid        our publisher → relay → caprid subscriber                     22 20
======================== ============================================================ ======

Readiness is always something on the wire or a line a process prints: the relay's listening
line, a peer's JSON event, our SUBSCRIBE_NAMESPACE's NAMESPACE for the peer's namespace, a
SUBSCRIBE_OK. moq-rs's publisher writes only after the far subscriber's SUBSCRIBE_OK (a moq-rs
subscription starts at the latest group).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import traceback
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from kvsp_moq.pubsub import Catalog, MoqtError, MoqtSession, connect

from .cases import (GROUPS, OBJECTS, SIZE, STEP, TRACK, Options, close_quietly, collect_objects,
                    ns_of)
from .harness import PEER_SCRIPTS, ROOT, CaseError, PeerProcess, log, parse_json, payload, \
    sha256

#: Drafts each case runs on (caprid speaks 22 and 20 only).
DRAFTS: dict[str, tuple[int, ...]] = {
    "moqrs-pub>relay>ours": (22, 20, 18),
    "moqrs-pub>relay>moqrs": (22, 20, 18),
    "ours>relay>moqrs": (22, 20, 18),
    "caprid-pub>relay>ours": (22, 20),
    "ours>relay>caprid": (22, 20),
}
#: Cases whose peers speak WebTransport too (``--transport webtransport``; caprid-relay
#: is raw QUIC only).
WEBTRANSPORT_CASES = ("moqrs-pub>relay>ours", "moqrs-pub>relay>moqrs", "ours>relay>moqrs")
#: The peer venv each case needs ("moq-rs" / "caprid-relay", names of interop.peers.PEERS).
PEER_OF: dict[str, str] = {
    "moqrs-pub>relay>ours": "moq-rs", "moqrs-pub>relay>moqrs": "moq-rs",
    "ours>relay>moqrs": "moq-rs", "caprid-pub>relay>ours": "caprid-relay",
    "ours>relay>caprid": "caprid-relay",
}
COLUMN = "peer via our relay"


def _env() -> dict[str, str]:
    import os
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    return env


class OurRelay:
    """``python -m relay`` (draft 22: our default ALPN list) or ``interop.relay_alpn``
    pinned to ``moqt-<draft>``; JSON logs kept for the report."""

    def __init__(self, opts: Options) -> None:
        args: list[object] = ["--listen", "127.0.0.1:0", "--cert", opts.cert, "--key", opts.key,
                              "--log-format", "json"]
        if opts.draft == 22:
            argv = [sys.executable, "-m", "relay", *args]
        else:
            argv = [sys.executable, "-m", "interop.relay_alpn", "--alpn", f"moqt-{opts.draft}",
                    *args]
        self.proc = PeerProcess("our relay", argv, cwd=ROOT, env=_env(), keep_lines=5000)
        self.url = ""
        self.webtransport = opts.webtransport

    async def start(self) -> str:
        await self.proc.start()
        self.url = str(await self.proc.expect(
            lambda ln: ln.split("relay listening on ")[-1].strip()
            if "relay listening on " in ln else None, 30, "listening line"))
        if self.webtransport:  # the same port takes WebTransport (ALPN h3)
            self.url = "https://" + self.url.split("://", 1)[1]
        return self.url

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1].split("/")[0])

    def events(self) -> list[dict[str, Any]]:
        return [ev for ln in self.proc.lines if (ev := parse_json(ln)) and ev.get("event") != "log"]

    def report(self) -> dict[str, Any]:
        evs = self.events()
        return {
            "relay_sessions": [e.get("version") for e in evs if e["event"] == "session_open"],
            "relay_transports": [e.get("transport") for e in evs
                                 if e["event"] == "session_open"],
            "relay_peer_implementations": [e.get("implementation") for e in evs
                                           if e["event"] == "session_open"],
            "relay_requests": [[e.get("type"), e.get("namespace"), e.get("track"),
                                e.get("decision")] for e in evs if e["event"] == "request"],
            "relay_request_errors": [[e.get("code"), e.get("reason")] for e in evs
                                     if e["event"] == "request_error"],
        }

    async def stop(self) -> None:
        await self.proc.stop()


async def _our_publisher(opts: Options, url: str, ns: tuple[str, ...]
                         ) -> tuple[MoqtSession, Any]:
    catalog = Catalog()
    track = catalog.create(ns, TRACK)
    session = await connect(url, opts.client_config(), catalog=catalog, setup_timeout=STEP)
    await asyncio.wait_for(session.publish_namespace(ns), STEP)
    return session, track


async def _write_track(opts: Options, track: Any) -> None:
    for g in range(opts.groups):
        for i in range(opts.objects):
            await track.write_object(g, i, payload(g, i, opts.size))
    await track.finish()
    log("our publisher: track written and finished")


async def _wait_namespace(session: MoqtSession, want: tuple[str, ...]) -> list[Any]:
    """Namespace updates until NAMESPACE for suffix ``want``; returns them all."""
    seen: list[Any] = []
    target = tuple(f.encode() for f in want)
    while True:
        kind, suffix = await asyncio.wait_for(session.namespace_updates.get(), STEP)
        seen.append([kind, [f.decode(errors="replace") for f in suffix]])
        if kind in ("namespace", "publish_namespace") and tuple(suffix) == target:
            return seen


def _done(sub: Any) -> dict[str, Any] | None:
    done = sub.publish_done
    return None if done is None else {"status": done.status_code,
                                      "stream_count": done.stream_count,
                                      "reason": done.error_reason}


async def _subscribe_and_collect(opts: Options, session: MoqtSession, ns: tuple[str, ...],
                                 before_publish: Callable[[], Awaitable[None]]
                                 ) -> dict[str, Any]:
    sub = await asyncio.wait_for(session.subscribe(ns, TRACK), STEP)
    await before_publish()
    objs, error = await collect_objects(sub)
    return {"objects": objs, "error": error, "data_streams": sub.stats.data_streams,
            "publish_done": _done(sub)}


# ==========================================================================================
async def case_moqrs_pub_ours(opts: Options) -> dict[str, Any]:
    ns = ns_of("moqrs")
    relay = OurRelay(opts)
    result: dict[str, Any] = {}
    session = None
    pub = None
    try:
        url = await relay.start()
        pub = PeerProcess("moq-rs client publisher", [
            opts.python, PEER_SCRIPTS / "moqrs_client_publisher.py", url,
            "--broadcast", "/".join(ns), "--track", TRACK, "--groups", opts.groups,
            "--objects", opts.objects, "--size", opts.size], stdin=True)
        session = await connect(url, opts.client_config(), setup_timeout=STEP)
        result["version"] = int(session.version)
        await session.subscribe_namespace(ns[:2])
        await pub.start()
        await pub.expect_event("connected", STEP)
        result["namespace_updates"] = await _wait_namespace(session, ns[2:])

        async def go() -> None:
            await pub.send("publish")

        result.update(await _subscribe_and_collect(opts, session, ns, go))
        await pub.expect_event("published", STEP)
    except (CaseError, MoqtError, asyncio.TimeoutError) as exc:
        result.setdefault("error", repr(exc))
    finally:
        await close_quietly(session)
        if pub is not None:
            await pub.stop()
            result["peer_log"] = pub.tail(20)
        await relay.stop()
        result.update(relay.report())
        result["relay_log"] = relay.proc.tail(20)
    return result


async def case_moqrs_pub_moqrs(opts: Options) -> dict[str, Any]:
    ns = ns_of("moqrs")
    relay = OurRelay(opts)
    result: dict[str, Any] = {}
    procs: list[PeerProcess] = []
    try:
        url = await relay.start()
        pub = PeerProcess("moq-rs client publisher", [
            opts.python, PEER_SCRIPTS / "moqrs_client_publisher.py", url,
            "--broadcast", "/".join(ns), "--track", TRACK, "--groups", opts.groups,
            "--objects", opts.objects, "--size", opts.size], stdin=True)
        sub = PeerProcess("moq-rs subscriber", [
            opts.python, PEER_SCRIPTS / "moqrs_subscriber.py", url, "/".join(ns), TRACK])
        procs += [pub, sub]
        await pub.start()
        await pub.expect_event("connected", STEP)
        await sub.start()
        # moq-rs's subscriber waits for the broadcast itself (SUBSCRIBE_NAMESPACE + NAMESPACE).
        await sub.expect_event("subscribed", STEP)
        await pub.send("publish")
        result["peer_events"] = await sub.collect_events("end", STEP)
        await pub.expect_event("published", STEP)
    except CaseError as exc:
        result["error"] = str(exc)
    finally:
        for p in reversed(procs):
            await p.stop()
        result["peer_log"] = [ln for p in procs for ln in p.tail(15)]
        await relay.stop()
        result.update(relay.report())
        result["relay_log"] = relay.proc.tail(20)
    return result


async def case_ours_moqrs(opts: Options) -> dict[str, Any]:
    ns = ns_of("moqrs")
    relay = OurRelay(opts)
    result: dict[str, Any] = {}
    session = None
    sub = None
    try:
        url = await relay.start()
        session, track = await _our_publisher(opts, url, ns)
        result["version"] = int(session.version)
        sub = PeerProcess("moq-rs subscriber", [
            opts.python, PEER_SCRIPTS / "moqrs_subscriber.py", url, "/".join(ns), TRACK])
        await sub.start()
        await sub.expect_event("subscribed", STEP)
        await _write_track(opts, track)
        result["peer_events"] = await sub.collect_events("end", STEP)
    except (CaseError, MoqtError, asyncio.TimeoutError) as exc:
        result.setdefault("error", repr(exc))
    finally:
        if sub is not None:
            await sub.stop()
            result["peer_log"] = sub.tail(20)
        await close_quietly(session)
        await relay.stop()
        result.update(relay.report())
        result["relay_log"] = relay.proc.tail(20)
    return result


async def case_caprid_pub_ours(opts: Options) -> dict[str, Any]:
    """caprid's publisher connects and waits for a SUBSCRIBE_NAMESPACE; our subscriber
    SUBSCRIBEs at the relay once caprid reported its session up."""
    ns = ns_of("caprid")
    relay = OurRelay(opts)
    result: dict[str, Any] = {}
    session = None
    pub = None
    try:
        url = await relay.start()
        pub = PeerProcess("caprid publisher", [
            opts.python, PEER_SCRIPTS / "caprid_publisher.py",
            f"https://127.0.0.1:{relay.port}/moq", "/".join(ns), TRACK,
            "--groups", opts.groups, "--objects", opts.objects, "--size", opts.size])
        await pub.start()
        await pub.expect_event("connected", STEP)
        session = await connect(url, opts.client_config(), setup_timeout=STEP)
        result["version"] = int(session.version)
        try:
            result.update(await _subscribe_and_collect(opts, session, ns, _nothing))
        except MoqtError as exc:
            result["subscribe_error"] = {"code": int(exc.code), "reason": str(exc)}
            result["error"] = repr(exc)
        else:
            result["peer_events"] = await pub.collect_events("end", STEP)
    except (CaseError, MoqtError, asyncio.TimeoutError) as exc:
        result.setdefault("error", repr(exc))
    finally:
        await close_quietly(session)
        if pub is not None:
            await pub.stop()
            result["peer_log"] = pub.tail(20)
        await relay.stop()
        result.update(relay.report())
        result["relay_log"] = relay.proc.tail(20)
    return result


async def _nothing() -> None:
    return None


async def case_ours_caprid(opts: Options) -> dict[str, Any]:
    ns = ns_of("caprid")
    relay = OurRelay(opts)
    result: dict[str, Any] = {}
    session = None
    sub = None
    try:
        url = await relay.start()
        session, track = await _our_publisher(opts, url, ns)
        result["version"] = int(session.version)
        sub = PeerProcess("caprid subscriber", [
            opts.python, PEER_SCRIPTS / "caprid_subscriber.py",
            f"https://127.0.0.1:{relay.port}/moq", "/".join(ns), TRACK])
        await sub.start()
        result["peer_protocol"] = (await sub.expect_event("connected", STEP)).get("protocol")
        await sub.expect_event("subscribed", STEP)
        await _write_track(opts, track)
        result["peer_events"] = await sub.collect_events("end", STEP)
    except (CaseError, MoqtError, asyncio.TimeoutError) as exc:
        result.setdefault("error", repr(exc))
    finally:
        if sub is not None:
            await sub.stop()
            result["peer_log"] = sub.tail(20)
        await close_quietly(session)
        await relay.stop()
        result.update(relay.report())
        result["relay_log"] = relay.proc.tail(20)
    return result


CASES: dict[str, Callable[[Options], Awaitable[dict[str, Any]]]] = {
    "moqrs-pub>relay>ours": case_moqrs_pub_ours,
    "moqrs-pub>relay>moqrs": case_moqrs_pub_moqrs,
    "ours>relay>moqrs": case_ours_moqrs,
    "caprid-pub>relay>ours": case_caprid_pub_ours,
    "ours>relay>caprid": case_ours_caprid,
}


# ==========================================================================================
# checks (shared by the tests and the matrix)
def _expected() -> dict[tuple[int, int], str]:
    return {(g, o): sha256(payload(g, o, SIZE)) for g in range(GROUPS) for o in range(OBJECTS)}


def _check_versions(r: dict[str, Any], draft: int, sessions: int) -> list[str]:
    out = []
    if r.get("version") not in (None, draft):
        out.append(f"our session negotiated {r.get('version')}, expected {draft}")
    got = r.get("relay_sessions") or []
    if len(got) < sessions or any(v != f"moqt-{draft}" for v in got):
        out.append(f"relay sessions {got}, expected {sessions}× moqt-{draft}")
    want = r.get("transport", "quic")
    transports = r.get("relay_transports") or []
    if any(t != want for t in transports):
        out.append(f"relay sessions over {transports}, expected {want}")
    return out


def _check_our_objects(r: dict[str, Any], *, end_of_track: bool) -> list[str]:
    out = []
    objs = r.get("objects") or []
    normal = {(o["group"], o["object"]): o["sha256"] for o in objs if o["status"] == 0}
    if normal != _expected():
        out.append(f"objects {sorted(normal)} / bytes differ from the {GROUPS}x{OBJECTS} "
                   f"expected")
    if any(o["len"] != SIZE for o in objs if o["status"] == 0):
        out.append("an object has the wrong length")
    status = [(o["group"], o["object"], o["status"]) for o in objs if o["status"] != 0]
    # moq-rs ends a track with END_OF_TRACK (0x4) as object 0 of a group of its own.
    want_status = [(GROUPS, 0, 4)] if end_of_track else []
    if status != want_status:
        out.append(f"status objects {status}, expected {want_status}")
    done = r.get("publish_done")
    if not done or done["status"] != 0x2:
        out.append(f"PUBLISH_DONE {done}, expected TRACK_ENDED (0x2)")
    elif done["stream_count"] != r.get("data_streams"):
        out.append(f"PUBLISH_DONE Stream Count {done['stream_count']} != data streams "
                   f"{r.get('data_streams')}")
    return out


def _check_moqrs_events(r: dict[str, Any]) -> list[str]:
    events = r.get("peer_events") or []
    if not events or events[-1]["event"] != "end":
        return [f"moq-rs subscriber did not end cleanly: {events[-1:] or r.get('error')}"]
    got = [(e["group"], e["object"], e["sha256"]) for e in events if e["event"] == "object"]
    out = []
    if len(got) != GROUPS * OBJECTS or {(g, o): h for g, o, h in got} != _expected():
        out.append(f"moq-rs subscriber got {len(got)} objects / bytes differ")
    if any(e["len"] != SIZE for e in events if e["event"] == "object"):
        out.append("an object has the wrong length")
    return out


def _check_caprid_events(r: dict[str, Any], draft: int) -> list[str]:
    events = r.get("peer_events") or []
    if not events or events[-1]["event"] != "end":
        return [f"caprid subscriber did not end cleanly: {events[-1:] or r.get('error')}"]
    out = []
    if r.get("peer_protocol") != f"moqt-{draft}":
        out.append(f"caprid negotiated {r.get('peer_protocol')}")
    got = [e for e in events if e["event"] == "object"]
    if len(got) != GROUPS * OBJECTS or {(e["group"], e["object"]): e["sha256"]
                                        for e in got} != _expected():
        out.append(f"caprid subscriber got {len(got)} objects / bytes differ")
    if any(e["status"] != "normal" or e["len"] != SIZE for e in got):
        out.append("an object has a wrong status or length")
    done = [(e["status"], e["stream_count"]) for e in events if e["event"] == "publisher_done"]
    if done != [(0x2, GROUPS)]:
        out.append(f"PUBLISH_DONE {done}, expected [(TRACK_ENDED 0x2, {GROUPS})]")
    if sum(e["event"] == "subgroup_end" for e in events) != GROUPS:
        out.append("subgroup stream ends != GROUPS")
    return out


def check(case: str, draft: int, r: dict[str, Any]) -> list[str]:
    """Problems with a case result (empty: pass)."""
    if case == "moqrs-pub>relay>ours":
        out = _check_versions(r, draft, 2)
        if r.get("error"):
            out.append(f"error: {r['error']}")
        return out + _check_our_objects(r, end_of_track=True)
    if case == "moqrs-pub>relay>moqrs":
        return _check_versions(r, draft, 2) + _check_moqrs_events(r)
    if case == "ours>relay>moqrs":
        return _check_versions(r, draft, 2) + _check_moqrs_events(r)
    if case == "caprid-pub>relay>ours":
        out = _check_versions(r, draft, 2)
        if r.get("subscribe_error"):
            return out + [f"SUBSCRIBE refused: {r['subscribe_error']}"]
        if r.get("error"):
            out.append(f"error: {r['error']}")
        return out + _check_our_objects(r, end_of_track=False)
    if case == "ours>relay>caprid":
        return _check_versions(r, draft, 2) + _check_caprid_events(r, draft)
    raise KeyError(case)


# ==========================================================================================
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m interop.relay_cases", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("case", choices=sorted(CASES))
    ap.add_argument("--draft", type=int, required=True)
    ap.add_argument("--peer-bin", type=Path, required=True, help="the peer venv's bin folder")
    ap.add_argument("--cert", type=Path, required=True)
    ap.add_argument("--key", type=Path, required=True)
    ap.add_argument("--guard", type=float, default=45.0, help="whole-case safety timeout (s)")
    ap.add_argument("--transport", choices=("quic", "webtransport"), default="quic",
                    help="every session over raw QUIC (moqt://) or WebTransport (https://)")
    args = ap.parse_args(argv)
    opts = Options(args.case, args.draft, args.peer_bin, args.cert, args.key,
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
    result["problems"] = check(args.case, args.draft, result)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
