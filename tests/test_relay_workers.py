"""``python -m relay --workers 2`` (relay/workers.py): two worker processes on one UDP port
(SO_REUSEPORT) under one hub. A publisher and subscribers connect to the one public URL; the
kernel spreads them over the workers. Subscribers are added until the hub has routed one
(its ``relay_subscribes_total`` > 0: a subscriber on the worker without the publisher);
every subscriber then receives the live objects exactly, FETCHes them back (a cache miss
on its worker, asked of the hub), and SIGTERM drains everything and exits 0.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
from pathlib import Path

from kvsp_moq.moqt.errors import PublishDoneCode
from kvsp_moq.pubsub import Catalog, MoqtSession, connect

from test_relay import NS, client_config, payload, within

ROOT = Path(__file__).resolve().parent.parent
MAX_SUBSCRIBERS = 16  # all on the publisher's worker by chance: 2**-16


async def _metric(url: str, name: str) -> int:
    host, port = re.match(r"http://([^:/]+):(\d+)/", url).groups()  # type: ignore[union-attr]
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    body = (await reader.read()).decode()
    writer.close()
    m = re.search(rf"^{name} (\d+)$", body, re.M)
    assert m, body
    return int(m.group(1))


async def test_workers_share_one_port_and_one_upstream_subscription() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "relay", "--listen", "127.0.0.1:0", "--workers", "2",
        "--metrics", "0", "--max-datagram-size", "8192", "--drain-timeout", "10",
        cwd=ROOT, stdout=asyncio.subprocess.PIPE)
    assert proc.stdout is not None
    sessions: list[MoqtSession] = []
    try:
        lines = [(await within(proc.stdout.readline(), 90)).decode().strip() for _ in range(3)]
        assert lines[0].startswith("relay listening on moqt://127.0.0.1:"), lines
        assert lines[1].startswith("relay workers: 2 (hub moqt://127.0.0.1:"), lines
        url = lines[0].rsplit(" ", 1)[1]
        metrics = lines[2].split()[3]
        catalog = Catalog()
        pub = await within(connect(url, client_config(), catalog=catalog))
        sessions.append(pub)
        await within(pub.publish_namespace(NS))
        track = catalog.create(NS, "w", keep=True)
        subs = []
        while len(subs) < MAX_SUBSCRIBERS:
            s = await within(connect(url, client_config()))
            sessions.append(s)
            subs.append(await within(s.subscribe(NS, "w")))
            if await within(_metric(metrics, "relay_subscribes_total")) > 0:
                break
        assert await within(_metric(metrics, "relay_subscribes_total")) > 0
        objects = [payload(0, o, 100_000) for o in range(3)]
        for o, data in enumerate(objects):
            await within(track.write_object(0, o, data))
        await within(track.finish())
        for sub in subs:
            got = await within(sub.collect())
            assert [bytes(x.payload) for x in got] == objects
            assert sub.publish_done is not None
            assert sub.publish_done.status_code == PublishDoneCode.TRACK_ENDED
        for s in sessions[1:]:
            f = await within(s.fetch(NS, "w", start=(0, 0), end=(0, 2)))
            assert [bytes(x.payload) for x in await within(f.collect())] == objects
        await within(pub.drain())
        for s in sessions:
            await within(s.close())
        sessions.clear()
        proc.terminate()
        assert await within(proc.wait(), 60) == 0
        rest = (await within(proc.stdout.read())).decode()
        assert "relay stopped" in rest
    finally:
        for s in sessions:
            await s.close()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def test_bench_relay_through_relay_workers() -> None:
    """``kvsp bench relay --relay-workers 2``: the fan-out figures through a 2-worker relay,
    named ``..._workers2`` (the baseline of the scaling figure too), the bytes checked."""
    from test_cli import kvsp

    proc = kvsp("bench", "relay", "--run-mib", "1", "--object-kib", "64", "--repeat", "1",
                "--relay-workers", "2")
    figures = {f["name"]: f for f in map(json.loads, proc.stdout.splitlines())}
    scaling = figures["relay_fanout_8_workers2_vs_1"]
    assert scaling["baseline_name"] == "relay_fanout_1_workers2_delivered"
    assert scaling["params"]["relay_workers"] == 2 and scaling["value"] > 0
