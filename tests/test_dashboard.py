"""The live dashboard in headless Chromium against the demo's cluster (docs/dashboard.md).

The demo's scenario runs for real (``kvsp_moq.cli.demo.scenario``: IS, holder, relay, PC, front
end and two ``kvsp instance`` processes running the reference model; five sessions through the
front end, a prefetch over MOQT), then one more session is opened that the PC keeps tracking while
the page is shown: it names the system prompt's cached blocks but asks for a sampler no instance
has, so the active instance refuses it, the PC raises its epoch to 2 and keeps it pending (the
other instance sleeps); nothing moves any more, so the page and the roles can be read at one
moment. The dashboard is
served (``serve_dashboard``) with the demo client's token; Debian's chromium (never a downloaded
browser) driven by Playwright opens it and waits for the attribute the page sets once it has
rendered a snapshot (``body[data-ready="1"]``), then the numbers shown are read from the DOM and
compared with what the roles say at that moment: ``GET {pc}instances``, ``GET {pc}sessions``,
the PC's, instances', holder's, IS's, front end's and relay's ``/metrics``. A screenshot is saved
under the test's tmp dir (and as docs/img/dashboard.png with KVSP_UPDATE_SCREENSHOTS=1).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tomllib
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest

from kvsp_moq.cli.demo import SYSTEM_PROMPT, BLOCK_TOKENS, Cluster, scenario
from kvsp_moq.cli.demo.cluster import http_request
from kvsp_moq.control.common.session_records import ClientSessionRequest
from kvsp_moq.control.dashboard.collect import DashboardSources, Samples, parse_metrics
from kvsp_moq.control.dashboard.serve import serve_dashboard
from kvsp_moq.kvsp.blockkeys import BlockKeyChain
from kvsp_moq.kvsp.records import LookupRequest, Sampler

pytest.importorskip("torch")
playwright_api = pytest.importorskip("playwright.async_api")

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
GUARD = 240.0  # a safety net against hangs, never a way to wait for something
ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="Debian's chromium is not installed")


async def _json(url: str, token: str) -> Any:
    reply = await http_request(url, token=token)
    assert reply.status == 200, (url, reply.status, reply.body[:300])
    return reply.json()


async def _metrics(url: str, token: str | None) -> Samples:
    reply = await http_request(url, token=token)
    assert reply.status == 200, (url, reply.status)
    return parse_metrics(reply.body.decode())


def _scope_key(cluster: Cluster) -> bytes:
    """The scope key the demo's instances were configured with (their config names its file)."""
    config = tomllib.loads(cluster.instances[0].config_path.read_text())
    return bytes.fromhex(Path(config["instance"]["engine"]["scope_key_files"][0]).read_text().strip())


async def _open_refused_session(cluster: Cluster, report: dict[str, Any]) -> str:
    """A session naming the system prompt's blocks (cached at the IS) that the instance refuses
    (an unknown sampler): the PC raises its epoch and keeps it pending (module notes)."""
    from kvsp_moq.model import ByteTokenizer

    ids = ByteTokenizer().encode(f"{SYSTEM_PROMPT}\nUser: tell me everything.\nAssistant:")
    compat_id, scope_id = bytes.fromhex(report["compat_id"]), bytes.fromhex(report["scope_id"])
    keys = BlockKeyChain(_scope_key(cluster), compat_id, BLOCK_TOKENS).extend(ids)
    named = report["system_blocks"]  # the system prompt's complete blocks: listed at the IS
    request = ClientSessionRequest(
        compat_id=compat_id, scope_id=scope_id, prompt_blocks=tuple(keys[:named]),
        prompt_tail=tuple(ids[named * BLOCK_TOKENS:]), tokens=len(ids),
        sampler=Sampler(method="no-such-sampler", params={}, seed=0, step=0, deterministic=True), max_tokens=8)
    session = await cluster.frontend_client.start(cluster.frontend.url, request)
    assert session.instance is not None
    # The refusal comes from the instance process (POST {pc}sessions/{id}/failed): bounded
    # polling of the PC's view until it has been handled.
    async with asyncio.timeout(GUARD):
        while True:
            view = await _json(f"{cluster.pc.url}sessions/{session.session}", cluster.tokens["client"])
            if view["epoch"] >= 2 and "instance" not in view:
                return str(session.session)
            await asyncio.sleep(0.05)


async def _read_page(page: Any) -> dict[str, Any]:
    """What the page shows, read from its DOM in one evaluation (one rendered snapshot)."""
    return await page.evaluate("""() => {
      const q = (s) => document.querySelector(s), all = (s) => [...document.querySelectorAll(s)];
      return {
        seq: Number(document.body.dataset.seq),
        instances: Number(q('#instances-count').textContent),
        instanceStates: Object.fromEntries(all('#instance-states [data-state]').map(e => [e.dataset.state, Number(e.dataset.count)])),
        rows: all('tr.instance').map(e => ({url: e.dataset.instance, state: e.dataset.state, running: e.dataset.running,
                                             sessions: Number(e.querySelector('[data-field=sessions_running]').textContent)})),
        tracked: Number(q('#sessions-tracked').textContent),
        sessions: all('tr.session').map(e => ({id: e.dataset.session, state: e.dataset.state, epoch: Number(e.dataset.epoch),
                                                output: Number(e.dataset.output)})),
        hitRatio: q('#hit-ratio').dataset.value, hitText: q('#hit-ratio').textContent,
        ttft: q('#ttft-mean').dataset.value,
        fanout: q('#relay-fanout').dataset.value,
        relayObjects: q('#relay-objects').textContent, relayCache: q('#relay-cache').textContent,
        relaySubscribers: q('#relay-subscribers').textContent,
        indexReplicas: q('#index-replicas').textContent,
        feDelivered: q('#fe-delivered').textContent,
        holderTiers: all('tr.holder-tier').map(e => ({holder: e.dataset.holder, tier: e.dataset.tier, replicas: Number(e.dataset.replicas)})),
        prefixBlocks: Number(q('#prefix-blocks')?.textContent ?? 0),
        heldCells: all('#prefix-grid .cell[data-held="1"]').map(e => [e.dataset.key, e.dataset.holder]),
        prefixKeys: [...new Set(all('#prefix-grid .cell').map(e => e.dataset.key))],
        errors: q('#errors').textContent,
        chartHit: all('#chart-hit polyline').length, chartTtft: all('#chart-ttft polyline').length,
      };
    }""")


def _n(text: str) -> int:
    return int(text.replace(",", ""))


async def test_the_dashboard_shows_what_the_roles_say(tmp_path: Path) -> None:
    async with AsyncExitStack() as stack:
        clusters: list[Cluster] = []
        report = await asyncio.wait_for(scenario(stack, str(tmp_path / "model"), False, on_cluster=clusters.append), GUARD)
        assert report["ok"] is True
        cluster = clusters[0]
        token = cluster.tokens["client"]
        refused = await _open_refused_session(cluster, report)

        sources = DashboardSources(pc=cluster.pc.url, index=cluster.index.url, frontend=cluster.frontend.url,
                                   relay_metrics=cluster.relay.metrics_url, holders=(cluster.holder.url,))
        server = await stack.enter_async_context(await serve_dashboard(sources, token))

        async with playwright_api.async_playwright() as pw:
            browser = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                page = await browser.new_page(viewport={"width": 1600, "height": 1250})
                await page.goto(server.url)
                # The page sets data-ready once a snapshot is rendered; the prefix picture is
                # filled from the second one (the first lists the sessions whose blocks it looks up).
                await page.wait_for_selector('body[data-ready="1"]', timeout=GUARD * 1e3)
                await page.wait_for_function("Number(document.body.dataset.seq) >= 4", timeout=GUARD * 1e3)
                shown = await _read_page(page)

                # What the roles say now.
                views = (await _json(f"{cluster.pc.url}instances", token))["instances"]
                listed = await _json(f"{cluster.pc.url}sessions", token)
                pc_m = await _metrics(f"{cluster.pc.url}metrics", token)
                inst_m = {i["instance"]: await _metrics(f"{i['instance']}metrics", token) for i in views}
                holder_m = await _metrics(f"{cluster.holder.url}metrics", token)
                index_m = await _metrics(f"{cluster.index.url}metrics", token)
                fe_m = await _metrics(f"{cluster.frontend.url}metrics", token)
                relay_m = await _metrics(cluster.relay.metrics_url, None)
                found = await cluster.index_client.lookup(LookupRequest(
                    scope_id=bytes.fromhex(report["scope_id"]), compat_id=bytes.fromhex(report["compat_id"]),
                    block_keys=tuple(bytes.fromhex(k) for k in shown["prefixKeys"])))
                await page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
            finally:
                await browser.close()
        if os.environ.get("KVSP_UPDATE_SCREENSHOTS") == "1":  # refresh the docs' picture on purpose
            (ROOT / "docs" / "img").mkdir(exist_ok=True)
            shutil.copyfile(tmp_path / "dashboard.png", ROOT / "docs" / "img" / "dashboard.png")

    assert shown["errors"] == ""
    # Instances: the PC's listing and its own gauges (instance-1 was put to sleep by the demo).
    assert shown["instances"] == len(views) == 2
    assert {r["url"]: r["state"] for r in shown["rows"]} == {v["instance"]: v["state"] for v in views}
    assert sorted(v["state"] for v in views) == ["active", "sleeping"]
    for state in ("active", "draining", "sleeping", "failed"):
        assert shown["instanceStates"][state] == pc_m.get("kvsp_pc_instances", state=state)
    for row in shown["rows"]:  # each instance's own gauge
        assert row["sessions"] == inst_m[row["url"]].get("kvsp_instance_sessions_running")
    # Sessions: the refused one is tracked, pending, at the epoch the PC says.
    assert shown["tracked"] == listed["total"] == 1 == pc_m.get("kvsp_pc_sessions", state="pending")
    (pc_view,) = listed["sessions"]
    assert pc_view["session"] == refused and "instance" not in pc_view
    (row,) = [s for s in shown["sessions"] if s["id"] == refused]
    assert row["state"] == "pending" and row["epoch"] == pc_view["epoch"] == 2 == pc_m.get("kvsp_pc_session_epoch_max")
    assert row["output"] == pc_view["output_offset"] == 0
    # Hit ratio and TTFT: the instances' engine counters, summed.
    blocks = {s: sum(m.total("kvsp_engine_request_blocks_total", source=s) for m in inst_m.values())
              for s in ("local", "moqt", "http", "recomputed")}
    total = sum(blocks.values())
    assert total > 0 and blocks["recomputed"] < total
    assert float(shown["hitRatio"]) == pytest.approx((total - blocks["recomputed"]) / total)
    assert shown["hitText"] == f"{100 * (total - blocks['recomputed']) / total:.1f} %"
    ttft_n = sum(m.get("kvsp_engine_ttft_seconds_count") for m in inst_m.values())
    ttft_s = sum(m.get("kvsp_engine_ttft_seconds_sum") for m in inst_m.values())
    assert ttft_n >= len(report["requests"])
    assert float(shown["ttft"]) == pytest.approx(1e3 * ttft_s / ttft_n)
    assert shown["chartHit"] >= 1 and shown["chartTtft"] >= 1
    # The relay's fan-out and cache.
    objects_in, objects_out = relay_m.get("relay_objects_in_total"), relay_m.get("relay_objects_out_total")
    assert objects_out > 0
    assert shown["relayObjects"] == f"{int(objects_in):,} / {int(objects_out):,}"
    assert shown["relayCache"] == (f"{int(relay_m.get('relay_cache_hits_total')):,} / "
                                   f"{int(relay_m.get('relay_cache_misses_total')):,}")
    assert _n(shown["relaySubscribers"]) == relay_m.get("relay_subscribers")
    if objects_in:
        assert float(shown["fanout"]) == pytest.approx(objects_out / objects_in)
    # The IS, the holder's tiers, the front end.
    assert _n(shown["indexReplicas"]) == index_m.get("kvsp_index_replica_records") > 0
    tiers = {(r["holder"], r["tier"]): r["replicas"] for r in shown["holderTiers"]}
    for labels, value in holder_m.rows("kvsp_holder_tier_replicas"):
        assert tiers[(cluster.holder.url, labels["tier"])] == value
    assert sum(tiers.values()) > 0
    assert _n(shown["feDelivered"]) == fe_m.get("kvsp_frontend_tokens_delivered_total")
    # The prefix picture: the refused session's blocks, each where the IS lists it.
    assert shown["prefixBlocks"] == report["system_blocks"]
    held = {(k, h) for k, h in shown["heldCells"]}
    assert held == {(b.block_key.hex(), r.holder) for b in found.blocks for r in b.replicas}
    places = {h for _, h in held}
    assert cluster.holder.url in places  # the demo published every computed block to the holder
    assert len(places) >= 2  # and to the computing instance's own store
    assert (tmp_path / "dashboard.png").stat().st_size > 10_000
    json.dumps(shown)  # the page's figures are plain data
