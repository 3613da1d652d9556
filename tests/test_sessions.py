"""Session checkpoints and migration (kvsp-draft §6.8) over real HTTP on 127.0.0.1: a PC, a
front end and instances running a small real engine. Checkpoint ordering and stale epochs,
resume on another instance after a reported failure, after missed heartbeats, and after a
restart, old-epoch messages refused everywhere, non-deterministic output held until
acknowledged, and a session every instance refused ending the client's stream with the
failure."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from typing import Any

from kvsp_moq.control.client.http import HttpFrontEndClient
from kvsp_moq.control.common.config import PcConfig
from kvsp_moq.control.common.errors import SessionRefused
from kvsp_moq.control.common.session_records import OutputToken, SessionOrder, StreamFailed
from kvsp_moq.control.instance.sessions import SessionOutput
from kvsp_moq.control.pc.serve import PC_SERVICE
from kvsp_moq.control.pc.service import PlacementController
from kvsp_moq.kvsp.records import SessionCheckpoint
from test_instance_support import COMPAT, SCOPE_A, TOKENS, call, instance_service
from test_sessions_support import CountingEngine, SessionWorld, client_request, expect_output, guarded, read_stream, sampler, session_id, session_world, token_at


def checkpoint(session: uuid.UUID, epoch: int, n: int, *, seed: int = 7, tail: list[int] | None = None) -> dict[str, Any]:
    generated = [token_at(seed, i) for i in range(n)]
    return SessionCheckpoint.from_json({
        "session": str(session), "epoch": epoch, "compat_id": COMPAT.hex(), "scope_id": SCOPE_A.hex(),
        "prompt_blocks": [], "prompt_tail": tail if tail is not None else [374, 264, 11], "generated": generated,
        "output_offset": n, "sampler": sampler(seed) | {"step": n},
    }).to_json()


def pc_of(sw: SessionWorld) -> PlacementController:
    return sw.w.pc.app[PC_SERVICE]


async def start_session(sw: SessionWorld, max_tokens: int = 10, **kw: Any) -> dict[str, Any]:
    reply = await call(sw.session, "POST", f"{sw.fe.url}sessions", who="client-a", body=client_request(max_tokens, **kw))
    assert reply.status == 201, reply.body
    return reply.json


async def test_checkpoints_keep_the_highest_offset_and_refuse_stale_epochs() -> None:
    engine = CountingEngine("a", hang_at=0)  # takes the session and produces nothing itself
    async with session_world({"a": engine}) as sw:
        await sw.report("a")
        started = await start_session(sw)
        sid = session_id(started)
        assert started["epoch"] == 1 and started["instance"] == sw.instances["a"].url
        await guarded(engine.reached.wait())
        url = f"{sw.w.pc.url}sessions/{sid}/checkpoint"

        async def put(body: Any, who: str | None = "inst", **kw: Any) -> Any:
            return await call(sw.session, "PUT", url, who=who, body=body, **kw)

        ack = await put(checkpoint(sid, 1, 3))
        assert ack.status == 200 and ack.json == {"session": str(sid), "epoch": 1, "output_offset": 3}
        assert (await put(checkpoint(sid, 1, 3))).json["output_offset"] == 3  # idempotent re-PUT
        assert (await put(checkpoint(sid, 1, 2))).json["output_offset"] == 3  # covers less: the highest is kept
        assert (await put(checkpoint(sid, 1, 5))).json["output_offset"] == 5
        view = await call(sw.session, "GET", f"{sw.w.pc.url}sessions/{sid}", who="client-a")
        assert view.json == {"session": str(sid), "instance": sw.instances["a"].url, "epoch": 1, "output_offset": 5}

        stale = await put(checkpoint(sid, 0, 6))
        assert stale.status == 409 and stale.problem == "kvsp-stale-epoch"  # §6.8 MUST reject
        future = await put(checkpoint(sid, 2, 6))
        assert future.status == 400 and future.json["member"] == "epoch"
        other = checkpoint(sid, 1, 6)
        other["generated"][1] += 1
        diverged = await put(other)
        assert diverged.status == 400 and diverged.json["member"] == "generated"
        wrong_prompt = await put(checkpoint(sid, 1, 6, tail=[1]))
        assert wrong_prompt.status == 400 and wrong_prompt.json["member"] == "prompt_tail"
        # hostile bodies and callers
        inconsistent = checkpoint(sid, 1, 6) | {"output_offset": 9}
        assert (await put(inconsistent)).json["member"] == "output_offset"
        assert (await put(b"{\"session\":")).json["member"] == "$"
        assert (await put(checkpoint(uuid.uuid4(), 1, 6))).json["member"] == "session"
        assert (await put(checkpoint(sid, 1, 6), content_type="text/plain")).status == 415
        assert (await put(checkpoint(sid, 1, 6), who=None)).status == 401
        assert (await put(checkpoint(sid, 1, 6), who="pc-b")).problem == "kvsp-forbidden"
        unknown = uuid.uuid4()
        missing = await call(sw.session, "PUT", f"{sw.w.pc.url}sessions/{unknown}/checkpoint", who="inst", body=checkpoint(unknown, 1, 1))
        assert missing.status == 404 and missing.problem == "kvsp-not-found"
        assert pc_of(sw).sessions.entry(sid).checkpoint.output_offset == 5


async def test_resume_after_a_reported_failure_reaches_a_new_instance_with_the_next_epoch() -> None:
    a = CountingEngine("a", hang_at=6)
    b = CountingEngine("b")
    async with session_world({"a": a, "b": b}, checkpoint_every=4) as sw:
        await sw.report("a", prefill=50_000)  # the cheaper instance (§6.4): the session starts there
        await sw.report("b", prefill=10_000)
        started = await start_session(sw, max_tokens=12)
        sid = session_id(started)
        assert started["instance"] == sw.instances["a"].url
        stream = asyncio.create_task(read_stream(sw.session, started["tokens_url"]))
        await guarded(a.reached.wait())  # tokens 0..5 delivered, checkpoint at 4 acknowledged
        assert sw.fe_service.delivered(sid) == [token_at(7, i) for i in range(6)]
        assert pc_of(sw).sessions.entry(sid).checkpoint.output_offset == 4

        reply = await call(sw.session, "POST", f"{sw.w.pc.url}failures", who="pc", body={"instance": sw.instances["a"].url})
        assert reply.status == 200, reply.body
        assert reply.json == {"sessions": [{"session": str(sid), "instance": sw.instances["b"].url, "epoch": 2, "output_offset": 4}]}
        await guarded(b.resumed.wait())
        kind, order = b.orders[0]
        assert kind == "resume" and order.epoch == 2 and order.checkpoint.output_offset == 4
        assert order.checkpoint.generated == tuple(token_at(7, i) for i in range(4))
        assert order.front_end == sw.fe.url and order.max_tokens == 12

        lines = await guarded(stream)
        expect_output(lines, 12)  # every index once: B's replayed 0..3 and regenerated 4, 5 were dropped
        assert sw.fe_service.epoch(sid) == 2

        # the failed instance wakes up: its old-epoch messages are refused everywhere (§6.8 MUST)
        late = await call(sw.session, "PUT", f"{sw.w.pc.url}sessions/{sid}/checkpoint", who="inst", body=checkpoint(sid, 1, 7))
        assert late.status == 404  # the session completed (B reported it done)
        a.unhang.set()
        await guarded(a.ended.wait())
        old = a.outputs[0]
        assert old.epoch == 1 and old.released == 6  # token 6 of epoch 1 was refused by the front end
        assert sw.fe_service.delivered(sid) == [token_at(7, i) for i in range(12)]
        await guarded(instance_service(sw.instances["a"]).sessions.wait(sid))
        assert sid not in instance_service(sw.instances["a"]).lifecycle.sessions


async def test_old_epoch_checkpoint_is_refused_once_the_session_moved() -> None:
    a = CountingEngine("a", hang_at=2)
    b = CountingEngine("b", hang_at=3)
    async with session_world({"a": a, "b": b}, checkpoint_every=64) as sw:
        await sw.report("a", prefill=50_000)
        await sw.report("b", prefill=10_000)
        sid = session_id(await start_session(sw))
        await guarded(a.reached.wait())
        await call(sw.session, "POST", f"{sw.w.pc.url}failures", who="pc", body={"instance": sw.instances["a"].url, "epoch": 1})
        await guarded(b.reached.wait())
        stale = await call(sw.session, "PUT", f"{sw.w.pc.url}sessions/{sid}/checkpoint", who="inst", body=checkpoint(sid, 1, 2))
        assert stale.status == 409 and stale.problem == "kvsp-stale-epoch"
        fresh = await call(sw.session, "PUT", f"{sw.w.pc.url}sessions/{sid}/checkpoint", who="inst", body=checkpoint(sid, 2, 3))
        assert fresh.json == {"session": str(sid), "epoch": 2, "output_offset": 3}
        # the front end refuses epoch 1 now that it saw epoch 2 (B replayed nothing yet, so send one)
        await call(sw.session, "POST", f"{sw.fe.url}sessions/{sid}/tokens", who="inst",
                   body={"session": str(sid), "epoch": 2, "tokens": []})
        old = await call(sw.session, "POST", f"{sw.fe.url}sessions/{sid}/tokens", who="inst",
                         body={"session": str(sid), "epoch": 1, "tokens": [{"index": 0, "token": 1}]})
        assert old.status == 409 and old.problem == "kvsp-stale-epoch"
        # a failure report about an older incarnation than the PC knows is stale
        await sw.report("a", epoch=5)
        report = await call(sw.session, "POST", f"{sw.w.pc.url}failures", who="pc", body={"instance": sw.instances["a"].url, "epoch": 4})
        assert report.status == 409 and report.problem == "kvsp-stale-epoch"
        b.unhang.set()


async def test_resume_after_missed_heartbeats() -> None:
    a = CountingEngine("a", hang_at=5)
    b = CountingEngine("b")
    async with session_world({"a": a, "b": b}) as sw:
        await sw.report("a", prefill=50_000, ttl_ms=3_000)
        await sw.report("b", prefill=10_000, ttl_ms=60_000)
        started = await start_session(sw, max_tokens=8)
        stream = asyncio.create_task(read_stream(sw.session, started["tokens_url"]))
        await guarded(a.reached.wait())
        sw.w.clock.advance(3_000)  # A's record expires (§6.3 failed)
        await sw.report("b", prefill=10_000)  # a live instance reports: the PC looks for failed ones
        await guarded(b.resumed.wait())
        assert b.orders[0][1].epoch == 2 and b.orders[0][1].checkpoint.output_offset == 4
        expect_output(await guarded(stream), 8)


async def test_periodic_failure_check_on_the_pc_clock() -> None:
    a = CountingEngine("a", hang_at=2)
    b = CountingEngine("b")
    config = PcConfig(instance_token=TOKENS["pc"], failure_check_ms=1_000)
    async with session_world({"a": a, "b": b}, pc=config) as sw:
        await sw.report("a", prefill=50_000, ttl_ms=3_000)
        await sw.report("b", prefill=10_000, ttl_ms=60_000)
        started = await start_session(sw, max_tokens=6)
        stream = asyncio.create_task(read_stream(sw.session, started["tokens_url"]))
        await guarded(a.reached.wait())
        sw.w.clock.advance(3_000)  # A expires; the PC's own check (every 1000 ms) finds it
        await guarded(b.resumed.wait())
        assert b.orders[0][1].epoch == 2
        expect_output(await guarded(stream), 6)


async def test_a_restart_with_a_higher_instance_epoch_resumes_its_sessions() -> None:
    a = CountingEngine("a", hang_at=1)
    async with session_world({"a": a}) as sw:
        await sw.report("a")
        started = await start_session(sw, max_tokens=5)
        sid = session_id(started)
        stream = asyncio.create_task(read_stream(sw.session, started["tokens_url"]))
        await guarded(a.reached.wait())
        a.hang_at = None
        await sw.report("a", epoch=2)  # §6.3: it restarted; what its first incarnation ran is gone
        await guarded(pc_of(sw).settle())
        assert [(k, o.epoch) for k, o in a.orders] == [("start", 1), ("resume", 2)]
        expect_output(await guarded(stream), 5)
        assert a.outputs[0].epoch == 1 and a.outputs[1].epoch == 2
        assert sw.fe_service.epoch(sid) == 2


async def test_non_deterministic_output_waits_for_the_acknowledged_checkpoint() -> None:
    a = CountingEngine("a", pause_at=3)
    async with session_world({"a": a}, checkpoint_every=64) as sw:
        await sw.report("a")
        started = await start_session(sw, max_tokens=5, deterministic=False)
        sid = session_id(started)
        await guarded(a.paused.wait())
        assert a.outputs[0].next_index == 3
        assert sw.fe_service.delivered(sid) == []  # §6.8 MUST NOT release before acknowledgement
        a.proceed.set()
        lines = await guarded(read_stream(sw.session, started["tokens_url"]))
        expect_output(lines, 5)
        assert a.outputs[0].acknowledged == 5


async def test_instance_refuses_non_increasing_epochs_and_hostile_orders() -> None:
    a = CountingEngine("a", hang_at=0)
    async with session_world({"a": a}) as sw:
        url = sw.instances["a"].url
        sid = uuid.uuid4()
        cp = checkpoint(sid, 1, 2)

        async def resume(body: Any, who: str = "pc", session: uuid.UUID = sid) -> Any:
            return await call(sw.session, "POST", f"{url}sessions/{session}/resume", who=who, body=body)

        order = {"epoch": 3, "checkpoint": cp, "max_tokens": 4}
        accepted = await resume(order)
        assert accepted.status == 202 and accepted.json == {"session": str(sid), "epoch": 3}
        again = await resume(order)
        assert again.status == 409 and again.problem == "kvsp-stale-epoch"
        lower = await resume(order | {"epoch": 2})
        assert lower.status == 409 and lower.problem == "kvsp-stale-epoch"
        assert (await resume(order | {"epoch": 1})).json["member"] == "epoch"  # not above the checkpoint's
        assert (await resume(order, session=uuid.uuid4())).json["member"] == "checkpoint.session"
        assert (await resume({"epoch": 5})).json["member"] == "checkpoint"
        assert (await resume(order | {"epoch": "5"})).json["member"] == "epoch"
        assert (await resume(order | {"epoch": 5, "max_tokens": 1})).json["member"] == "max_tokens"
        assert (await resume(order | {"epoch": 5}, who="client-a")).problem == "kvsp-forbidden"
        assert (await resume(b"[]")).json["member"] == "$"
        bad_path = await call(sw.session, "POST", f"{url}sessions/not-a-uuid/resume", body=order)
        assert bad_path.status == 404
        newer = await resume(order | {"epoch": 4})
        assert newer.status == 202  # a newer order replaces the run
        assert [o.epoch for _, o in a.orders][-1] == 4
        # start: the same rules
        start = await call(sw.session, "POST", f"{url}sessions/{uuid.uuid4()}/start", body=order)
        assert start.json["member"] == "checkpoint.session"


@dataclass
class RefusingEngine:
    """A real engine that emits the deterministic tokens below ``refuse_at``, then cannot go
    on (``SessionRefused``: the instance reports ``POST {pc}sessions/{id}/failed``)."""

    refuse_at: int
    orders: list[SessionOrder] = field(default_factory=list)

    async def start(self, order: SessionOrder, output: SessionOutput) -> None:
        await self._run(order, output)

    async def resume(self, order: SessionOrder, output: SessionOutput) -> None:
        await self._run(order, output)

    async def _run(self, order: SessionOrder, output: SessionOutput) -> None:
        self.orders.append(order)
        while output.next_index < self.refuse_at:
            await output.token(token_at(order.checkpoint.sampler.seed, output.next_index))
        raise SessionRefused(f"cannot go beyond index {self.refuse_at}")


async def test_a_session_every_instance_refused_ends_the_client_stream_with_the_failure() -> None:
    a, b = RefusingEngine(refuse_at=3), RefusingEngine(refuse_at=5)
    async with session_world({"a": a, "b": b}, checkpoint_every=4) as sw:  # type: ignore[dict-item]
        await sw.report("a", prefill=50_000)  # the session starts at A
        await sw.report("b", prefill=10_000)
        started = await start_session(sw, max_tokens=10)
        sid = session_id(started)
        assert started["instance"] == sw.instances["a"].url
        # the client's stream, open before anything failed: tokens 0..4 (A gave 0..2 at epoch 1,
        # B 3..4 at epoch 2 after replaying the duplicates), then the failure — not a hang
        lines = await guarded(read_stream(sw.session, started["tokens_url"]))
        assert [(line["index"], line["token"]) for line in lines[:-1]] == [(i, token_at(7, i)) for i in range(5)]
        last = lines[-1]
        assert set(last) == {"failed", "next"} and last["next"] == 5
        assert "every instance refused it" in last["failed"] and "cannot go beyond index 5" in last["failed"]
        view = await call(sw.session, "GET", f"{sw.w.pc.url}sessions/{sid}", who="client-a")
        assert view.status == 200 and view.json["failed"] == last["failed"] and view.json["epoch"] == 3
        assert [o.epoch for o in a.orders] == [1] and [o.epoch for o in b.orders] == [2]

        # delivered tokens stay delivered; a reopened stream shows them, then the failure again
        assert sw.fe_service.delivered(sid) == [token_at(7, i) for i in range(5)]
        again = await guarded(read_stream(sw.session, f"{started['tokens_url']}?from=3"))
        assert [line.get("index") for line in again] == [3, 4, None] and again[-1] == last
        client = HttpFrontEndClient(TOKENS["client-a"])
        try:
            items = [item async for item in client.tokens(sw.fe.url, sid, 4)]
        finally:
            await client.close()
        assert items == [OutputToken(index=4, token=token_at(7, 4)), StreamFailed(reason=last["failed"], next=5)]

        # nothing is added to a failed session's output, whatever its epoch (§6.8 fencing)
        for epoch in (2, 3, 9):
            late = await call(sw.session, "POST", f"{sw.fe.url}sessions/{sid}/tokens", who="inst",
                              body={"session": str(sid), "epoch": epoch, "tokens": [{"index": 5, "token": 1}]})
            assert late.status == 409 and late.problem == "kvsp-stale-epoch", late.body
        assert len(sw.fe_service.delivered(sid)) == 5
        # a repeated notice changes nothing
        notice = await call(sw.session, "POST", f"{sw.fe.url}sessions/{sid}/failed", who="pc",
                            body={"epoch": 3, "reason": "again"})
        assert notice.status == 204 and sw.fe_service.failure(sid) == last["failed"]


async def test_a_failure_notice_after_the_output_completed_changes_nothing() -> None:
    a = CountingEngine("a")
    async with session_world({"a": a}) as sw:
        await sw.report("a")
        started = await start_session(sw, max_tokens=4)
        sid = session_id(started)
        expect_output(await guarded(read_stream(sw.session, started["tokens_url"])), 4)
        notice = await call(sw.session, "POST", f"{sw.fe.url}sessions/{sid}/failed", who="pc",
                            body={"epoch": 1, "reason": "too late"})
        assert notice.status == 204 and sw.fe_service.failure(sid) is None
        expect_output(await guarded(read_stream(sw.session, started["tokens_url"])), 4)
