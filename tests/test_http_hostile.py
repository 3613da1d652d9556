"""Hostile input on the session, front-end and resharding routes (kvsp-draft §6.8, §6.9;
docs/http-api.md), against real servers on 127.0.0.1: a PC (and IS), a front end and an
instance with a real session engine, and, for ``POST generate``/``GET engine``, an instance
running the reference model.

Every route gets the attacks of ``_hostile_support.attack_json_route`` (credentials, media
types, sizes, malformed JSON, each member with the wrong type or an out-of-range number) or,
for query parameters, malformed, inverted, overflowing and non-ASCII-digit values. Every answer
must be an RFC 9457 problem with the right status (and the KVSP problem type where there is
one, e.g. 409 ``kvsp-stale-epoch`` for §6.8's old epochs), never a 500, and a real session
that the attacks target stays intact.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from _hostile_support import Findings, JsonRoute, attack_json_route, send
from kvsp_moq.control.common.config import ControlConfig, FrontEndConfig, InstanceConfig, PcConfig, TierConfig
from kvsp_moq.control.frontend.serve import FRONTEND_SERVICE, serve_frontend
from kvsp_moq.control.frontend.service import FrontEnd
from kvsp_moq.control.http.server import RunningServer
from kvsp_moq.control.instance.reshard import MAX_ABORTED
from kvsp_moq.control.instance.serve import INSTANCE_SERVICE, serve_instance
from kvsp_moq.control.pc.serve import PC_SERVICE
from kvsp_moq.control.pc.service import PlacementController
from test_instance_support import AUTH, COMPAT, SCOPE_A, TOKENS, World, bkey, world
from test_sessions_support import CountingEngine, client_request, guarded, sampler, status

MAX_BODY = 64 * 1024  # every role's max_body_octets here: oversized bodies stay cheap to send


@dataclass
class Hostile:
    w: World
    fe: RunningServer
    ii: RunningServer
    engine: CountingEngine
    session: uuid.UUID  # a real session, started through the front end, running at ``ii``

    @property
    def http(self) -> aiohttp.ClientSession:
        return self.w.session

    @property
    def pc(self) -> str:
        return self.w.pc.url

    @property
    def pc_service(self) -> PlacementController:
        return self.w.pc.app[PC_SERVICE]

    @property
    def fe_service(self) -> FrontEnd:
        return self.fe.app[FRONTEND_SERVICE]

    def checkpoint(self, epoch: int = 1, n: int = 2, session: uuid.UUID | None = None) -> dict[str, Any]:
        return {"session": str(session or self.session), "epoch": epoch, "compat_id": COMPAT.hex(),
                "scope_id": SCOPE_A.hex(), "prompt_blocks": [], "prompt_tail": [374, 264, 11],
                "generated": [5, 6][:n], "output_offset": n, "sampler": sampler() | {"step": n}}

    async def intact(self) -> None:
        """The real session is where it was: epoch 1 at ``ii``, nothing delivered or failed."""
        view = await send(self.http, "GET", f"{self.pc}sessions/{self.session}", token=TOKENS["client-a"])
        assert view.status == 200 and view.json == {"session": str(self.session), "instance": self.ii.url,
                                                    "epoch": 1, "output_offset": 0}, view.body
        assert self.fe_service.failure(self.session) is None and self.fe_service.epoch(self.session) == 0


@asynccontextmanager
async def hostile_world() -> AsyncIterator[Hostile]:
    pcc = PcConfig(instance_token=TOKENS["pc"], max_body_octets=MAX_BODY)
    async with world(holders=0, pc=pcc) as w:
        fc = FrontEndConfig(pc_url=w.pc.url, pc_token=TOKENS["pc"], max_body_octets=MAX_BODY)
        fe = await w.stack.enter_async_context(await serve_frontend(ControlConfig(auth=AUTH, frontend=fc)))
        engine = CountingEngine("a", hang_at=0)  # takes sessions and holds them, producing nothing
        ic = InstanceConfig(pc_url=w.pc.url, token=TOKENS["inst"], tiers=(TierConfig("host", 1 << 16),),
                            max_body_octets=MAX_BODY)
        ii = await w.stack.enter_async_context(
            await serve_instance(ControlConfig(auth=AUTH, instance=ic), clock=w.clock, epoch=1, report=False,
                                 session_engine=engine))
        reply = await send(w.session, "PUT", f"{w.pc.url}instance-status", token=TOKENS["inst"],
                           body=json.dumps(status(ii.url).to_json()).encode())
        assert reply.status == 200, reply.body
        started = await send(w.session, "POST", f"{fe.url}sessions", token=TOKENS["client-a"],
                             body=json.dumps(client_request(4)).encode())
        assert started.status == 201, started.body
        await guarded(engine.reached.wait())
        h = Hostile(w, fe, ii, engine, uuid.UUID(started.json["session"]))
        await h.intact()
        yield h


# ---------------------------------------------------------------------------------------------
# The PC (§6.8 sessions, §6.9 Shard Maps)


async def test_pc_session_and_shard_map_routes_refuse_hostile_input() -> None:
    async with hostile_world() as h:
        found = Findings()
        sid, pc, ii = h.session, h.pc, h.ii.url
        open_body = {"session": str(uuid.uuid4()), "compat_id": COMPAT.hex(), "scope_id": SCOPE_A.hex(),
                     "prompt_blocks": [bkey(1).hex()], "prompt_tail": [1, 2], "tokens": 18, "sampler": sampler(),
                     "max_tokens": 4, "front_end": h.fe.url}
        wide = frozenset({"sampler.seed", "checkpoint.sampler.seed"})
        routes = [
            JsonRoute("POST", f"{pc}sessions", open_body, "pc", MAX_BODY, "pc-b", wide),
            JsonRoute("PUT", f"{pc}sessions/{sid}/checkpoint", h.checkpoint(), "inst", MAX_BODY, "pc-b", wide),
            JsonRoute("POST", f"{pc}sessions/{sid}/done", {"epoch": 1, "output_offset": 0}, "inst", MAX_BODY, "pc-b"),
            JsonRoute("POST", f"{pc}sessions/{sid}/failed", {"epoch": 1, "reason": "r"}, "inst", MAX_BODY, "pc-b"),
            # another instance than ii: a valid variant (without epoch) fails it, not the real session's
            JsonRoute("POST", f"{pc}failures", {"instance": "http://127.0.0.1:9/", "epoch": 0}, "pc", MAX_BODY, "client-a"),
            JsonRoute("PUT", f"{pc}shard-maps/m1",
                      {"map": "m1", "version": 1, "shards": [{"tokens": [0, 16], "instance": ii}]}, "pc", MAX_BODY,
                      "client-a"),
        ]
        for route in routes:
            await attack_json_route(h.http, route, TOKENS, found)
            await h.intact()

        async def check(what: str, method: str, url: str, body: Any, status: int, problem: str | None = None,
                        member: str | None = None, who: str = "inst", **kw: Any) -> None:
            raw = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
            found.check(what, await send(h.http, method, url, token=TOKENS[who], body=raw, **kw), status, problem, member)

        # valid bodies against the real session's state: §6.8 epochs
        cp = f"{pc}sessions/{sid}/checkpoint"
        await check("checkpoint epoch 0", "PUT", cp, h.checkpoint(epoch=0), 409, "kvsp-stale-epoch")
        await check("checkpoint epoch max", "PUT", cp, h.checkpoint(epoch=2**53 - 1), 400, "kvsp-bad-record", "epoch")
        await check("checkpoint of another session", "PUT", cp, h.checkpoint(session=uuid.uuid4()), 400, member="session")
        await check("done epoch max", "POST", f"{pc}sessions/{sid}/done", {"epoch": 2**53 - 1, "output_offset": 0}, 409,
                    "kvsp-stale-epoch")
        await check("failed epoch max", "POST", f"{pc}sessions/{sid}/failed", {"epoch": 2**53 - 1, "reason": "r"}, 400,
                    member="epoch")
        await check("failed reason too long", "POST", f"{pc}sessions/{sid}/failed", {"epoch": 1, "reason": "r" * 1025},
                    400, member="reason")
        await check("failure of an older incarnation", "POST", f"{pc}failures", {"instance": ii, "epoch": 0}, 409,
                    "kvsp-stale-epoch", who="pc")
        # unknown ids (404 kvsp-not-found)
        other = uuid.uuid4()
        await check("unknown checkpoint", "PUT", f"{pc}sessions/{other}/checkpoint", h.checkpoint(session=other), 404,
                    "kvsp-not-found")
        for tail, body in (("done", {"epoch": 1, "output_offset": 0}), ("failed", {"epoch": 1, "reason": "r"})):
            await check(f"unknown {tail}", "POST", f"{pc}sessions/{other}/{tail}", body, 404, "kvsp-not-found")
        await check("unknown view", "GET", f"{pc}sessions/{other}", None, 404, "kvsp-not-found", who="client-a")
        await check("unknown map", "GET", f"{pc}shard-maps/nope", None, 404, "kvsp-not-found", who="pc")
        for bad in ("not-a-uuid", str(sid).upper(), f"{sid}0", "%FF"):
            await check(f"session path {bad}", "GET", f"{pc}sessions/{bad}", None, 404, "kvsp-not-found", who="pc")
        await check("map path with a slash", "GET", f"{pc}shard-maps/a%2Fb", None, 404, "kvsp-not-found", who="pc")
        await check("map path too long", "GET", f"{pc}shard-maps/{'m' * 257}", None, 404, "kvsp-not-found", who="pc")
        await check("map of another path", "PUT", f"{pc}shard-maps/m2",
                    {"map": "m1", "version": 1, "shards": [{"tokens": [0, 16], "instance": ii}]}, 400, member="map", who="pc")
        shard_map = {"map": "m3", "version": 1, "shards": [{"tokens": [0, 16], "instance": ii}]}
        for bad, in (("0",), ("-1",), ("x",), ("1e3",), ("１",), ("9" * 10,), ("1" * 5000,), ("",)):
            await check(f"deadline_ms={bad[:20]}", "PUT", f"{pc}shard-maps/m3", shard_map, 400, "kvsp-bad-record",
                        "deadline_ms", who="pc", params={"deadline_ms": bad})
        for what, shards in (
            ("a > b", [{"tokens": [16, 0], "instance": ii}]),
            ("empty range", [{"tokens": [4, 4], "instance": ii}]),
            ("overlap", [{"tokens": [0, 16], "instance": ii}, {"tokens": [8, 24], "instance": ii}]),
            ("gap", [{"tokens": [0, 16], "instance": ii}, {"tokens": [20, 24], "instance": ii}]),
            ("beyond I-JSON", [{"tokens": [0, 2**53], "instance": ii}]),
            ("three numbers", [{"tokens": [0, 1, 2], "instance": ii}]),
            ("no shards", []),
        ):
            await check(f"shard map {what}", "PUT", f"{pc}shard-maps/m4", {"map": "m4", "version": 1, "shards": shards},
                        400, "kvsp-bad-record", "shards", who="pc")
        # a map at version 1, then a stale version and a jump
        await check("install", "PUT", f"{pc}shard-maps/m5", shard_map | {"map": "m5", "version": 7}, 200, who="pc")
        await check("stale version", "PUT", f"{pc}shard-maps/m5", shard_map | {"map": "m5", "version": 6}, 409,
                    "kvsp-stale-epoch", who="pc")
        await check("version jump", "PUT", f"{pc}shard-maps/m5", shard_map | {"map": "m5", "version": 9}, 400,
                    member="version", who="pc")
        await check("version max", "PUT", f"{pc}shard-maps/m5", shard_map | {"map": "m5", "version": 2**53 - 1}, 400,
                    member="version", who="pc")
        found.assert_clean()
        await h.intact()


# ---------------------------------------------------------------------------------------------
# The instance (§6.8 start/resume, §6.9 reshard and shards, §6.5 prefetch status)


async def test_instance_session_reshard_and_shard_routes_refuse_hostile_input() -> None:
    async with hostile_world() as h:
        found = Findings()
        ii, fe = h.ii.url, h.fe.url
        other = uuid.uuid4()
        order = {"epoch": 2, "checkpoint": h.checkpoint(session=other), "front_end": fe, "max_tokens": 4}
        plan = {"map": "m1", "from": 1, "to": 2, "deadline_ms": 100, "retain": [[0, 8]],
                "fetch": [{"tokens": [8, 16], "from": ii}], "release": [[16, 24]]}
        wide = frozenset({"checkpoint.sampler.seed"})
        routes = [
            JsonRoute("POST", f"{ii}sessions/{other}/start", order, "pc", MAX_BODY, "client-a", wide),
            JsonRoute("POST", f"{ii}sessions/{other}/resume", order, "pc", MAX_BODY, "client-a", wide),
            JsonRoute("POST", f"{ii}reshard", plan, "pc", MAX_BODY, "client-a"),
            JsonRoute("POST", f"{ii}reshard", {"map": "m1", "commit": 2}, "pc", MAX_BODY, "client-a"),
            JsonRoute("POST", f"{ii}reshard", {"map": "m1", "abort": 2}, "pc", MAX_BODY, "client-a"),
        ]
        for route in routes:
            await attack_json_route(h.http, route, TOKENS, found)
            await h.intact()

        async def check(what: str, method: str, url: str, body: Any, status: int | tuple[int, ...],
                        problem: str | None = None, member: str | None = None, who: str = "pc", **kw: Any) -> None:
            raw = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
            found.check(what, await send(h.http, method, url, token=TOKENS[who], body=raw, **kw), status, problem, member)

        # §6.8: an epoch not above the one seen here is stale; the real session runs at epoch 1
        sid = h.session
        stale = {"epoch": 1, "checkpoint": h.checkpoint(epoch=0, n=0), "max_tokens": 4}
        await check("resume at the running epoch", "POST", f"{ii}sessions/{sid}/resume", stale, 409, "kvsp-stale-epoch")
        await check("start at the running epoch", "POST", f"{ii}sessions/{sid}/start", stale, 409, "kvsp-stale-epoch")
        await check("order for another path", "POST", f"{ii}sessions/{uuid.uuid4()}/start", order, 400,
                    member="checkpoint.session")
        await check("epoch not above the checkpoint's", "POST", f"{ii}sessions/{other}/start",
                    order | {"epoch": 1, "checkpoint": h.checkpoint(epoch=1, session=other)}, 400, member="epoch")
        await check("both commit and abort", "POST", f"{ii}reshard", {"map": "m1", "commit": 2, "abort": 2}, 400,
                    member="$")
        for what, body, member in (
            ("to != from + 1", plan | {"to": 5}, "to"),
            ("from at I-JSON max", plan | {"from": 2**53 - 1, "to": 2**53}, "to"),
            ("overlapping ranges", plan | {"retain": [[0, 12]]}, "fetch"),
            ("inverted range", plan | {"retain": [[8, 0]]}, "retain"),
            ("empty range", plan | {"release": [[30, 30]]}, "release"),
            ("fetch from a bad URL", plan | {"fetch": [{"tokens": [8, 16], "from": "ftp://x/"}]}, "fetch"),
            ("deadline 0", plan | {"deadline_ms": 0}, "deadline_ms"),
        ):
            await check(f"plan {what}", "POST", f"{ii}reshard", body, 400, "kvsp-bad-record", member)
        # unknown maps and versions: not held here
        # (a plan of m1 that a valid variant above started is still pending: 412 until its abort)
        await check("plan for an unknown map", "POST", f"{ii}reshard", plan | {"map": "m9", "retain": [[0, 8]]}, 404,
                    "kvsp-not-found")
        await check("abort of the pending m1 plan", "POST", f"{ii}reshard", {"map": "m1", "abort": 2}, 200)
        for i in range(MAX_ABORTED + 50):  # aborts that overtake no plan are remembered, but boundedly
            await check("abort of an unknown plan", "POST", f"{ii}reshard", {"map": f"x{i}", "abort": 1}, 200)
        assert len(h.ii.app[INSTANCE_SERVICE].shards._aborted) == MAX_ABORTED

        await check("commit of an unknown map", "POST", f"{ii}reshard", {"map": "zz", "commit": 2}, 404, "kvsp-not-found")

        # shards/{map}/{version}?tokens=a-b (GET: a peer's fetch; PUT: install a computed range)
        shards = f"{ii}shards/m1/1"
        for bad in ("", "1", "-", "5-3", "3-3", "-1-2", "1--2", "1-2-3", "a-b", "0x1-0x2", " 1-2", "1-2 ",
                    "١-٢", "²-³", "1-１", "0-" + "9" * 17, "9" * 17 + "-" + "9" * 18, "0-" + "1" * 5000, "+1-2"):
            await check(f"GET tokens={bad[:24]!r}", "GET", shards, None, 400, "kvsp-bad-record", "tokens",
                        params={"tokens": bad})
            await check(f"PUT tokens={bad[:24]!r}", "PUT", shards, b"KVB1", 400, "kvsp-bad-record", "tokens",
                        content_type="application/kvsp-block", who="inst", params={"tokens": bad})
        await check("GET without tokens", "GET", shards, None, 400, "kvsp-bad-record", "tokens")
        await check("GET tokens=%FF", "GET", f"{shards}?tokens=%FF-%FE", None, 400, "kvsp-bad-record", "tokens")
        await check("GET unknown map", "GET", shards, None, 404, "kvsp-not-found", params={"tokens": "0-4"})
        await check("GET version too long", "GET", f"{ii}shards/m1/{'9' * 17}", None, 404, params={"tokens": "0-4"})
        await check("GET version negative", "GET", f"{ii}shards/m1/-1", None, 404, params={"tokens": "0-4"})
        await check("GET version max", "GET", f"{ii}shards/m1/{'9' * 16}", None, 404, params={"tokens": "0-4"})
        await check("GET as an outsider", "GET", shards, None, 403, "kvsp-forbidden", who="client-a",
                    params={"tokens": "0-4"})
        await check("GET without credentials", "GET", shards, None, 401, "kvsp-unauthorized", who="pc",
                    params={"tokens": "0-4"}, headers={"Authorization": "Bearer"})
        for what, body, ctype, status_ in (
            ("not a container", b"KVB1" + b"\0" * 60, "application/kvsp-block", 400),
            ("empty", b"", "application/kvsp-block", 400),
            ("JSON", b"{}", "application/kvsp+json", 415),
            ("oversized", b"\0" * (MAX_BODY + 1), "application/kvsp-block", 413),
        ):
            await check(f"PUT {what}", "PUT", shards, body, status_, who="inst", content_type=ctype,
                        params={"tokens": "0-4"})
        found.check("PUT oversized chunked", await send(h.http, "PUT", shards, token=TOKENS["inst"], body=b"\0" * (MAX_BODY + 1),
                                                        content_type="application/kvsp-block", chunked=True,
                                                        params={"tokens": "0-4"}), 413)
        await check("PUT as an outsider", "PUT", shards, b"KVB1", 403, "kvsp-forbidden", who="client-a",
                    content_type="application/kvsp-block", params={"tokens": "0-4"})

        # GET prefetch/{id}?wait_ms= (§6.5 status, long poll)
        directive = f"{ii}prefetch/{uuid.uuid4()}"
        for bad in ("-1", "x", "1.5", "60001", "١", "²", "0" * 5000, "9" * 5000, "", " 1"):
            await check(f"wait_ms={bad[:20]!r}", "GET", directive, None, 400, "kvsp-bad-record", "wait_ms",
                        params={"wait_ms": bad})
        await check("unknown directive", "GET", directive, None, 404, "kvsp-not-found", params={"wait_ms": "0"})
        await check("directive path not a UUID", "GET", f"{ii}prefetch/nope", None, 404, "kvsp-not-found")
        found.assert_clean()
        await h.intact()


# ---------------------------------------------------------------------------------------------
# The front end (§6.8 delivery, the client's stream, the PC's failure notice)


async def test_front_end_routes_refuse_hostile_input() -> None:
    async with hostile_world() as h:
        found = Findings()
        fe, sid = h.fe.url, h.session
        batch = {"session": str(sid), "epoch": 1, "tokens": [{"index": 0, "token": 5}], "end": 4}
        wide = frozenset({"sampler.seed"})
        routes = [
            JsonRoute("POST", f"{fe}sessions", client_request(4), "client-a", MAX_BODY, "pc-b", wide),
            JsonRoute("POST", f"{fe}sessions/{sid}/tokens", batch, "inst", MAX_BODY, "pc-b"),
            JsonRoute("POST", f"{fe}sessions/{sid}/failed", {"epoch": 1, "reason": "r"}, "pc", MAX_BODY, "pc-b"),
        ]
        for route in routes:
            await attack_json_route(h.http, route, TOKENS, found)
        # the "without ..." variants of a delivery may be valid: start again from a clean output
        assert h.fe_service.failure(sid) is None

        async def check(what: str, method: str, url: str, body: Any, status: int | tuple[int, ...],
                        problem: str | None = None, member: str | None = None, who: str = "inst", **kw: Any) -> None:
            if isinstance(body, dict):
                body = {k: v for k, v in body.items() if v is not None}  # None: leave the member out
            raw = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
            found.check(what, await send(h.http, method, url, token=TOKENS[who], body=raw, **kw), status, problem, member)

        tokens_url = f"{fe}sessions/{sid}/tokens"
        for what, body, member in (
            ("index at max_tokens", batch | {"tokens": [{"index": 4, "token": 1}], "end": None}, "tokens[0].index"),
            ("index beyond end", batch | {"tokens": [{"index": 3, "token": 1}], "end": 3}, "tokens[0].index"),
            ("end beyond max_tokens", batch | {"tokens": [], "end": 5}, "end"),
            ("index at I-JSON max", batch | {"tokens": [{"index": 2**53 - 1, "token": 1}]}, "tokens[0].index"),
            ("token beyond uint32", batch | {"tokens": [{"index": 0, "token": 2**32}]}, "tokens[0].token"),
            ("session of another path", batch | {"session": str(uuid.uuid4())}, "session"),
        ):
            await check(f"delivery {what}", "POST", tokens_url, body, 400, "kvsp-bad-record", member)
        many = json.dumps(batch | {"tokens": [{"index": i, "token": 1} for i in range(4097)]}, separators=(",", ":"))
        found.check("delivery of 4097 tokens", await send(h.http, "POST", tokens_url, token=TOKENS["inst"],
                                                          body=many.encode()), (400, 413))
        await check("delivery epoch 0", "POST", tokens_url, batch | {"epoch": 0}, 400, member="epoch")
        other = uuid.uuid4()
        await check("delivery for an unknown session", "POST", f"{fe}sessions/{other}/tokens",
                    batch | {"session": str(other)}, 404, "kvsp-not-found")
        await check("notice for an unknown session", "POST", f"{fe}sessions/{other}/failed", {"epoch": 1, "reason": "r"},
                    404, "kvsp-not-found", who="pc")
        await check("stream of an unknown session", "GET", f"{fe}sessions/{other}/tokens", None, 404, "kvsp-not-found",
                    who="client-a")
        await check("stream as an outsider", "GET", tokens_url, None, 403, "kvsp-forbidden", who="pc-b")
        await check("stream without credentials", "GET", tokens_url, None, 401, "kvsp-unauthorized", who="client-a",
                    headers={"Authorization": "Basic x"})
        for bad in ("-1", "x", "1.5", "١", "²", "1" * 17, "0" * 5000, "", " 1", "0x1"):
            await check(f"from={bad[:20]!r}", "GET", tokens_url, None, 400, "kvsp-bad-record", "from",
                        who="client-a", params={"from": bad})
        await check("from=%FF", "GET", f"{tokens_url}?from=%FF", None, 400, "kvsp-bad-record", "from", who="client-a")
        # §6.8: a higher epoch, then the lower one is stale; a notice of a lower epoch too
        await check("delivery epoch 2", "POST", tokens_url, batch | {"epoch": 2, "tokens": [], "end": None}, 200)
        await check("delivery epoch 1 after 2", "POST", tokens_url, batch, 409, "kvsp-stale-epoch")
        await check("notice epoch 1 after 2", "POST", f"{fe}sessions/{sid}/failed", {"epoch": 1, "reason": "r"}, 409,
                    "kvsp-stale-epoch", who="pc")
        assert h.fe_service.failure(sid) is None and h.fe_service.epoch(sid) == 2
        found.assert_clean()


# ---------------------------------------------------------------------------------------------
# The engine's routes (POST generate, GET engine), on the reference model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch = pytest.importorskip("torch")
    from kvsp_moq.model import ensure_model_files
    torch.set_num_threads(1)
    return ensure_model_files(directory=tmp_path_factory.mktemp("model")).directory


async def test_engine_routes_refuse_hostile_input(model_dir: Path) -> None:
    from kvsp_moq.control.common.engine_config import EngineConfig
    engine = EngineConfig(model_dir=str(model_dir), block_tokens=16, torch_threads=1)
    ic = InstanceConfig(token=TOKENS["inst"], tiers=(TierConfig("host", 1 << 20),), engine=engine,
                        max_body_octets=MAX_BODY)
    async with aiohttp.ClientSession() as http, await serve_instance(ControlConfig(auth=AUTH, instance=ic),
                                                                     report=False) as ii:
        found = Findings()
        body = {"scope_id": SCOPE_A.hex(), "prompt_ids": [1, 2, 3], "max_tokens": 2, "sampler": sampler(),
                "request_ref": "r1"}
        await attack_json_route(http, JsonRoute("POST", f"{ii.url}generate", body, "inst", MAX_BODY,
                                                wide=frozenset({"sampler.seed"})), TOKENS, found)

        async def check(what: str, method: str, url: str, raw: Any, status: int | tuple[int, ...],
                        problem: str | None = None, member: str | None = None, who: str | None = "inst", **kw: Any) -> None:
            data = raw if isinstance(raw, bytes) or raw is None else json.dumps(raw).encode()
            found.check(what, await send(http, method, url, token=TOKENS[who] if who else None, body=data, **kw),
                        status, problem, member)

        for what, bad, member in (
            ("prompt and prompt_ids", body | {"prompt": "hi"}, "$"),
            ("neither prompt", {k: v for k, v in body.items() if k != "prompt_ids"}, "$"),
            ("no prompt tokens", body | {"prompt_ids": []}, "prompt_ids"),
            ("sampler at step 3", body | {"sampler": sampler() | {"step": 3}}, "sampler.step"),
            ("max_tokens beyond the cap", body | {"max_tokens": (1 << 20) + 1}, "max_tokens"),
        ):
            await check(f"generate {what}", "POST", f"{ii.url}generate", bad, 400, "kvsp-bad-record", member)
        await check("generate without the scope's key", "POST", f"{ii.url}generate", body, 403, "kvsp-forbidden")
        await check("engine", "GET", f"{ii.url}engine", None, 200)
        await check("engine without credentials", "GET", f"{ii.url}engine", None, 401, "kvsp-unauthorized", who=None)
        await check("engine with a bad token", "GET", f"{ii.url}engine", None, 401, "kvsp-unauthorized", who=None,
                    headers={"Authorization": "Bearer " + "Z" * 40})
        await check("engine POST", "POST", f"{ii.url}engine", b"{}", 405)
        found.assert_clean()


# ---------------------------------------------------------------------------------------------
# The holder's query parameters (§6.7 layers=a-b, codec=n): the same parsing rules


async def test_holder_block_query_parameters_refuse_hostile_values() -> None:
    async with world(holders=1) as w:
        found = Findings()
        url = f"{w.holders[0].url}blocks/{COMPAT.hex()}/{SCOPE_A.hex()}/{bkey(1).hex()}"
        for bad in ("1" * 5000 + "-1", "0-" + "9" * 5000, "3-1", "²-³", "١-٢", "a-b", "1", "-1-2", ""):
            found.check(f"layers={bad[:20]!r}", await send(w.session, "GET", url, token=TOKENS["holder-svc"],
                                                           params={"layers": bad}), 400, "kvsp-bad-record", "layers")
        for bad in ("9" * 5000, "65536", "²", "٣", "-1", "x", ""):
            found.check(f"codec={bad[:20]!r}", await send(w.session, "GET", url, token=TOKENS["holder-svc"],
                                                          params={"codec": bad}), 400, "kvsp-bad-record", "codec")
        found.check("unknown block", await send(w.session, "GET", url, token=TOKENS["holder-svc"],
                                                params={"layers": "0-1"}), 404)
        found.assert_clean()
