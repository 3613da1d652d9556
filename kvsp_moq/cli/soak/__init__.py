"""``kvsp soak --minutes M [--seed S]``: sustained traffic on loopback while faults are done to
real processes, and a count of what was lost (issue 19; docs/reliability.md "Soak").

Every role is its own process (``.roles``): IS, PC, holder, front end, relay A, relay B chained
to A and reached through a lossy link (``.lossy``), and ``--instances`` (at least four) ``kvsp instance``
processes running the reference model. ``--clients`` loops send a steady mix of sessions sharing
prefixes, prefetches and plain generations (``.workload``) while the seeded chaos schedule
(``.chaos``) SIGKILLs and restarts instances, a relay and the holder, and SIGSTOPs the holder.
After ``--minutes`` the traffic stops (the sessions in flight are read to their end), the
replicas the IS lists are verified (``.report``) and one JSON object is printed on stdout:

``sessions`` (started at the front end, resubmissions included; finished, failed, refused,
resubmitted), ``generations``, ``prefetches`` (by directive
state), ``tokens_delivered``, **``tokens_lost``, ``tokens_repeated``, ``tokens_wrong``,
``blocks_wrong_digest``** (each must be 0), ``digests`` (the replica check), ``fallbacks`` (the
instances' engine counters summed over their incarnations: MOQT fallbacks, blocks by source,
failed sessions), ``ttft_ms`` (client-side, sessions: p50, p99, n), ``chaos`` (every fault done),
``rss_mib`` (each role when up and at the end), ``lossy_link`` (its counters), ``failures`` (the
last reasons), ``seconds`` and ``ok``. With ``--store cluster`` the IS, PC, holder and front end
keep their state on a Redis Cluster the soak starts (3 primaries with 2 replicas each,
``bench.redis_cluster``), the chaos also SIGKILLs its primaries (``kill-primary``), and the
report counts ``primary_failovers``. Exit 0 when every must-be-zero count is 0 and every fault
kind happened, 1 otherwise, 130 on Ctrl-C. Progress goes to stderr (``[soak] ...``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ...transport import new_event_loop
from ...bench.redis_cluster import RedisClusterProcess
from .chaos import Chaos
from .report import EngineWatch, check_digests, percentile, rss
from .roles import start_soak_cluster
from .workload import PROMPTS, Workload, expected_outputs

__all__ = ["register", "soak"]

#: Seconds the sessions still in flight get to end after the traffic stopped.
DRAIN_S = 120.0


def _progress(message: str) -> None:
    print(f"[soak] {message}", file=sys.stderr, flush=True)


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    from ...kvsp import compat, scope
    from ...model import ModelConfig, build_descriptor, default_model_dir, ensure_model_files
    from ..demo import BLOCK_TOKENS

    started = time.monotonic()
    target = Path(args.model_dir) if args.model_dir else default_model_dir(ModelConfig().name)
    files = await asyncio.to_thread(ensure_model_files, None, str(target))
    descriptor = build_descriptor(files, block_tokens=BLOCK_TOKENS)
    _progress(f"computing the expected greedy output of {len(PROMPTS)} prompts with the reference model")
    expected = await asyncio.to_thread(expected_outputs, str(files.directory))
    scope_key = os.urandom(32)
    cid, sid = compat.compat_id(descriptor), scope.scope_id(scope_key)

    redis_cluster: RedisClusterProcess | None = None
    with tempfile.TemporaryDirectory(prefix="kvsp-soak-") as tmp:
        if args.store == "cluster":
            # Two replicas per primary: with every write acknowledged by one (store_wait_replicas = 1),
            # a killed primary's shard still has a replica to acknowledge writes after the failover
            # (docs/deploy.md "Durability"); with one, it refuses writes until the node is back.
            redis_cluster = RedisClusterProcess(Path(tmp) / "redis-cluster", replicas=2)
            await asyncio.to_thread(redis_cluster.start)
            _progress(f"redis cluster up (3 primaries, 2 replicas each): {redis_cluster.url}")
        try:
            report = await _run(args, Path(tmp), redis_cluster, descriptor, files, expected, scope_key, cid, sid, started)
        finally:
            if redis_cluster is not None:
                await asyncio.to_thread(redis_cluster.close)
    return report


async def _run(args: argparse.Namespace, tmp: Path, redis_cluster: RedisClusterProcess | None, descriptor: Any,
               files: Any, expected: Any, scope_key: bytes, cid: bytes, sid: bytes, started: float) -> dict[str, Any]:
    """The soak itself, its roles on ``redis_cluster`` when there is one; the report."""
    from ...control.client.http import HttpFrontEndClient, HttpIndexClient
    from ...model import ByteTokenizer
    from ..demo import BLOCK_TOKENS
    from ..demo.router import SessionClient

    cluster = await start_soak_cluster(tmp, descriptor=descriptor, model_dir=str(files.directory),
                                       scope_key=scope_key, instances=args.instances, loss=args.loss,
                                       seed=args.seed, progress=_progress,
                                       store=None if redis_cluster is None else redis_cluster.url)
    index = HttpIndexClient(cluster.url(cluster.index), cluster.tokens["client"])
    front_end = HttpFrontEndClient(cluster.tokens["client"], timeout_s=60)
    try:
        rss_start = rss(cluster)
        client = SessionClient(fe_url=cluster.url(cluster.frontend), front_end=front_end, index=index,
                               scope_key=scope_key, scope_id=sid, compat_id=cid, block_tokens=BLOCK_TOKENS,
                               tokenizer=ByteTokenizer())
        chaos = Chaos(cluster, args.seed, every_s=args.chaos_every, progress=_progress,
                      redis_cluster=redis_cluster)
        workload = Workload(cluster, client=client, front_end=front_end, expected=expected, seed=args.seed,
                            live_instances=chaos.live_instances)
        watch = EngineWatch(cluster)
        chaos_error: str | None = None
        done = asyncio.Event()
        watcher = asyncio.create_task(watch.run(done))
        until = time.monotonic() + args.minutes * 60
        _progress(f"traffic for {args.minutes:g} min: {args.clients} clients, a fault every ~{args.chaos_every:g} s "
                  f"(seed {args.seed})")
        traffic = asyncio.create_task(workload.run(args.clients, until))
        try:
            await chaos.run(until)
        except Exception as exc:  # a fault of the schedule itself: reported, the run is not ok
            chaos_error = f"{type(exc).__name__}: {exc}"
            _progress(f"chaos schedule failed: {chaos_error}")
        try:
            async with asyncio.timeout(max(0.0, until - time.monotonic()) + DRAIN_S):
                await traffic
        except TimeoutError:
            workload.tally.note(f"traffic still running {DRAIN_S:.0f} s after the end: cancelled")
            traffic.cancel()
        done.set()
        await watcher
        await watch.poll()
        keys = sorted({k for p in PROMPTS for k in client.keys(p)[1]})
        digests = await check_digests(cluster, index, keys, scope_id=sid, compat_id=cid)
        rss_end = rss(cluster)
    finally:
        await index.close()
        await front_end.close()
        await cluster.stop()
    lossy = next((json.loads(line)["lossy_link"] for line in cluster.lossy.tail if line.startswith("{")), None)

    t = workload.tally
    kinds = {e["fault"] for e in chaos.events if not e["what"].startswith("skipped")}
    not_back = [e["role"] for e in chaos.events if e.get("not_back")]
    must_be_zero = {"tokens_lost": t.tokens_lost, "tokens_repeated": t.tokens_repeated, "tokens_wrong": t.tokens_wrong,
                    "blocks_wrong_digest": digests["wrong_digest"]}
    ok = (all(v == 0 for v in must_be_zero.values()) and kinds == set(chaos.faults) and t.sessions_finished > 0
          and chaos_error is None and not not_back)
    return {
        "minutes": args.minutes, "seed": args.seed, "instances": args.instances, "clients": args.clients,
        "sessions": {"started": t.sessions_started, "finished": t.sessions_finished, "failed": t.sessions_failed,
                     "refused": t.sessions_refused, "resubmitted": t.sessions_resubmitted},
        "generations": {"ok": t.generations_ok, "retried": t.generations_retried, "failed": t.generations_failed},
        "prefetches": dict(t.prefetches),
        "tokens_delivered": t.tokens_delivered,
        "streams_reopened": t.streams_reopened,
        **must_be_zero,
        "digests": digests,
        "fallbacks": watch.fallbacks(),
        "ttft_ms": {"p50": percentile(t.ttft_ms, 50), "p99": percentile(t.ttft_ms, 99), "n": len(t.ttft_ms)},
        "chaos": chaos.events,
        "chaos_kinds": sorted(kinds),
        "store": args.store,
        "primary_failovers": chaos.primary_failovers,
        "chaos_restart_failures": sum(len(e.get("restart_failures", [])) for e in chaos.events),
        "roles_not_back": not_back,
        "chaos_error": chaos_error,
        "rss_mib": {name: {"start": rss_start.get(name), "end": rss_end.get(name)} for name in rss_start},
        "lossy_link": lossy,
        "failures": t.failures,
        "seconds": round(time.monotonic() - started, 1),
        "ok": ok,
    }


def cmd_soak(args: argparse.Namespace) -> int:
    if args.minutes <= 0 or args.instances < 4 or args.clients < 1 or args.chaos_every <= 0 or not 0 <= args.loss <= 100:
        print("kvsp: soak: --minutes > 0, --instances >= 4, --clients >= 1, --chaos-every > 0, --loss in [0, 100]",
              file=sys.stderr)
        return 2
    loop = new_event_loop(use_uvloop=True)
    task = loop.create_task(soak(args))
    interrupted = False

    def on_signal() -> None:
        nonlocal interrupted
        if not interrupted:
            interrupted = True
            _progress("interrupted: shutting down")
            task.cancel()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    try:
        report = loop.run_until_complete(task)
    except asyncio.CancelledError:
        return 130
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
    print(json.dumps(report) if args.json else json.dumps(report, indent=2))
    verdict = "ok" if report["ok"] else "NOT ok"
    _progress(f"{verdict}: {report['tokens_lost']} lost, {report['tokens_repeated']} repeated, {report['tokens_wrong']} "
              f"wrong, {report['blocks_wrong_digest']} blocks with a wrong digest; faults {report['chaos_kinds']}")
    return 0 if report["ok"] else 1


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser("soak", help="traffic on a loopback cluster of processes while faults are done to them; "
                                    "counts what was lost (docs/reliability.md)")
    p.add_argument("--minutes", type=float, default=5.0, help="how long the traffic runs (default 5)")
    p.add_argument("--seed", type=int, default=1, help="seeds the workload, the chaos schedule and the link's loss")
    p.add_argument("--instances", type=int, default=4, help="kvsp instance processes (>= 4; default 4)")
    p.add_argument("--clients", type=int, default=3, help="concurrent client loops (default 3)")
    p.add_argument("--chaos-every", type=float, default=8.0, metavar="S", help="seconds between faults (default 8)")
    p.add_argument("--loss", type=float, default=0.5, help="percent of packets the link to relay B drops each way (default 0.5)")
    p.add_argument("--model-dir", metavar="DIR", default=None, help="the reference model's files (as kvsp demo)")
    p.add_argument("--store", choices=("memory", "cluster"), default="memory",
                   help="cluster: the IS, PC, holder and front end keep their state on a Redis Cluster of "
                        "3 primaries with 2 replicas each, started by the soak; the chaos kills its primaries too")
    p.add_argument("--json", action="store_true", help="the report as one line (default: indented)")
    p.set_defaults(handler=cmd_soak)
