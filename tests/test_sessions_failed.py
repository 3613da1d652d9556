"""Sessions an instance cannot serve are reported to the PC (``POST {pc}sessions/{id}/failed``),
which places them elsewhere or marks them failed (kvsp-draft §6.4, §6.8; docs/migration.md).

Real processes on 127.0.0.1: an IS, an HTTP holder, a PC and a front end in this process, and
two ``kvsp instance`` processes running the reference model, one of them with another block
size, i.e. another model (another Compatibility ID, §4.1), so it cannot serve the sessions of
the other. Nothing sleeps: the test waits for the PC's handling of each report (an event set by
a spy around ``SessionManager.failed``), and for the client's stream to end (the PC places the
pending session when the instance reports itself active again).
"""

from __future__ import annotations

import asyncio
import os
import uuid
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from kvsp_moq.control.common.session_records import SessionFailed, SessionView  # noqa: E402
from kvsp_moq.kvsp.compat import compat_id as derive_compat_id  # noqa: E402
from kvsp_moq.model import ByteTokenizer, ReferenceModel, Sampler, build_descriptor, ensure_model_files, generate  # noqa: E402
from test_migration_support import B, PROMPT, SCOPE_ID, Cluster, cluster, guarded, sampler_json  # noqa: E402


@pytest.fixture(scope="module")
def model_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], bytes]:
    torch.set_num_threads(1)
    files = ensure_model_files(directory=tmp_path_factory.mktemp("model"))
    descriptor = build_descriptor(files, block_tokens=B)
    return files.directory, descriptor, derive_compat_id(descriptor)


class Reports:
    """Each failure report the PC handled, with the view it answered (a spy, not a stand-in:
    the PC's own method runs)."""

    def __init__(self, c: Cluster) -> None:
        self.seen: list[tuple[uuid.UUID, SessionFailed, SessionView]] = []
        self.changed = asyncio.Event()
        sessions = c.pc_service.sessions
        handle = sessions.failed

        async def spy(principal: Any, session: uuid.UUID, body: SessionFailed) -> SessionView:
            view = await handle(principal, session, body)
            self.seen.append((session, body, view))
            self.changed.set()
            return view

        sessions.failed = spy  # type: ignore[method-assign]

    async def wait_for(self, count: int) -> None:
        while len(self.seen) < count:
            self.changed.clear()
            await guarded(self.changed.wait())


async def test_a_session_refused_is_placed_elsewhere_or_failed(tmp_path: Path, model_files: Any) -> None:
    model_dir, descriptor, compat = model_files
    ids = ByteTokenizer().encode(PROMPT)
    n = 8
    async with cluster(tmp_path, model_dir, descriptor, compat) as c:
        other = await c.start_instance("other-model", block_tokens=2 * B)  # another Compatibility ID
        good = await c.start_instance("good", status_ttl_ms=3000)  # reports every second
        reports = Reports(c)

        # 1. the only active instance runs another model: it refuses, the PC keeps the session
        #    pending (an instance that has not refused it exists), and places it there later
        asleep = await c.call("PUT", f"{c.pc.url}instance-state", {"instance": good, "state": "sleeping"})
        assert asleep.status == 200 and asleep.json["state"] == "sleeping", asleep.body
        started = await c.open_session({
            "compat_id": compat.hex(), "scope_id": SCOPE_ID.hex(), "prompt_blocks": [], "prompt_tail": ids,
            "tokens": len(ids), "sampler": sampler_json("greedy"), "max_tokens": n})
        sid = uuid.UUID(started["session"])
        assert started["instance"] == other and started["epoch"] == 1
        await reports.wait_for(1)
        session, body, view = reports.seen[0]
        assert session == sid and body.epoch == 1 and "compat_id" in body.reason
        assert view == SessionView(session=sid, instance=None, epoch=2, output_offset=0)  # pending, not failed
        stale = await c.call("POST", f"{c.pc.url}sessions/{sid}/failed", {"epoch": 1, "reason": "again"})
        assert stale.status == 409 and stale.problem == "kvsp-stale-epoch"
        awake = await c.call("PUT", f"{c.pc.url}instance-state", {"instance": good, "state": "active"})
        assert awake.status == 200 and awake.json["state"] == "active", awake.body
        # its next status report (active again) is when the PC retries the pending session (§6.3)
        lines = await guarded(c.stream(started["tokens_url"]))
        model = ReferenceModel.load(directory=model_dir)
        reference = [t.token_id for t in generate(model, ids, Sampler.greedy(), n)]
        assert [line.get("token") for line in lines[:-1]] == reference and lines[-1] == {"end": n}
        assert [line["index"] for line in lines[:-1]] == list(range(n))
        tally = c.fe_service.tally(sid)
        # epoch 2 (raised by the report, no order sent with it before) at the good instance only
        assert tally is not None and tally.accepted == {2: n} and tally.duplicates == 0
        counters = {url: (await c.call("GET", f"{url}engine")).json["counters"] for url in (other, good)}
        assert counters[other]["sessions"] == counters[other]["failed_sessions"] == 1
        assert counters[good]["sessions"] == 1 and counters[good]["failed_sessions"] == 0

        # 2. prompt blocks that no replica delivers: the good instance cannot load them, the
        #    other runs another model; once every instance refused it, the session is failed
        unknown = [os.urandom(32).hex() for _ in range(3)]
        started = await c.open_session({
            "compat_id": compat.hex(), "scope_id": SCOPE_ID.hex(), "prompt_blocks": unknown,
            "prompt_tail": ids[-7:], "tokens": 3 * B + 7, "sampler": sampler_json("greedy"), "max_tokens": n})
        sid = uuid.UUID(started["session"])
        await reports.wait_for(3)
        assert [session for session, _, _ in reports.seen[1:]] == [sid, sid]
        last = reports.seen[-1][2]
        assert last.session == sid and last.instance is None and last.epoch == 3 and last.failed
        assert "every instance refused it" in last.failed
        reasons = [body.reason for _, body, _ in reports.seen[1:]]
        assert any("prompt blocks could be loaded" in r for r in reasons) and any("compat_id" in r for r in reasons)
        view = await c.call("GET", f"{c.pc.url}sessions/{sid}")
        assert view.status == 200 and view.json["failed"] == last.failed and "instance" not in view.json
        assert await c.pc_service.sessions.retry_pending() == []  # a failed session is not placed again
        # the PC told the front end: the client's stream ends with the failure, not a hang
        assert c.fe_service.failure(sid) == last.failed
        lines = await guarded(c.stream(started["tokens_url"]))
        assert lines == [{"failed": last.failed, "next": 0}]
