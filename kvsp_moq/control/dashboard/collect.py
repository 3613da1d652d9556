"""What the dashboard shows, gathered from the roles (docs/dashboard.md "Where the numbers come from").

:class:`Collector.snapshot` makes one JSON-ready picture of the cluster, calling every role
with the dashboard's token (the browser never holds it):

* the PC: ``GET {pc}instances`` (state and the load of the last status record) and ``GET
  {pc}sessions`` (the sessions it tracks: epoch, output checkpointed, prompt blocks), and its
  ``/metrics`` (instances and sessions by state, as the PC counts them);
* every instance the PC lists: its ``/metrics`` (sessions running, prefetches running, and its
  engine's counters: prompt blocks by source, time to first token);
* the IS: ``/metrics`` (replica records, lookups) and ``POST {is}lookup`` of the prompt blocks
  of the sessions seen (which replica holds each block, in which tier);
* each holder (given, or found as an ``http(s)`` holder of a replica that is not an instance):
  ``/metrics`` (replicas and layers per tier);
* the front end's and the relay's ``/metrics`` (tokens delivered, duplicates; subscribers,
  cache hits, objects in and out: the fan-out).

A source that fails is reported in ``errors`` and leaves its panel empty; the rest is shown.
Sessions the PC no longer tracks (done: it forgets them) stay listed as ``done`` with what was
last seen of them, up to ``remember_sessions``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import OrderedDict
from collections.abc import Awaitable, Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from prometheus_client.parser import text_string_to_metric_families

from ...kvsp.records import LookupRequest
from ..client.http import HttpClient, HttpIndexClient
from ..common.tls import TlsConfig

__all__ = ["Collector", "DashboardSources", "Samples", "parse_metrics"]

#: Prompt-block sources of the engine's request path (docs/metrics.md, engine).
SOURCES = ("local", "moqt", "http", "recomputed")
INSTANCE_STATES = ("active", "draining", "sleeping", "failed")
#: Blocks of the prefix picture (keys of the sessions seen), newest sessions first.
MAX_PICTURE_BLOCKS = 256


class Samples:
    """Parsed Prometheus text: the value of each sample, by name and labels."""

    def __init__(self, values: dict[tuple[str, frozenset[tuple[str, str]]], float]) -> None:
        self.values = values

    def get(self, name: str, **labels: str) -> float:
        """The sample's value; 0 when absent (a counter that never moved, a role without it)."""
        return self.values.get((name, frozenset(labels.items())), 0.0)

    def total(self, name: str, **labels: str) -> float:
        """The sum over every sample of ``name`` whose labels include ``labels``."""
        want = set(labels.items())
        return sum(v for (n, ls), v in self.values.items() if n == name and want <= ls)

    def by(self, name: str, label: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for (n, ls), v in self.values.items():
            if n == name:
                key = dict(ls).get(label)
                if key is not None:
                    out[key] = out.get(key, 0.0) + v
        return out

    def rows(self, name: str) -> list[tuple[dict[str, str], float]]:
        return [(dict(ls), v) for (n, ls), v in self.values.items() if n == name]


def parse_metrics(text: str) -> Samples:
    values: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            values[(s.name, frozenset(s.labels.items()))] = float(s.value)
    return Samples(values)


def metrics_url(base: str) -> str:
    return (base if base.endswith("/") else base + "/") + "metrics"


def _num(value: float) -> float | None:
    """A JSON number (NaN, a role's "cannot count", becomes null)."""
    return None if value != value else value


@dataclass(frozen=True)
class DashboardSources:
    """Where the roles are (``kvsp dashboard`` options). URLs are base URLs ending in ``/``,
    except ``relay_metrics``, the relay's full ``--metrics`` URL."""

    pc: str
    index: str | None = None
    frontend: str | None = None
    relay_metrics: str | None = None
    holders: tuple[str, ...] = ()


class RoleReader(HttpClient):
    """GETs with the dashboard's token (``HttpClient``: its TLS rules, plain HTTP only to loopback)."""

    async def get(self, url: str) -> bytes:
        status, body, problem, detail = await self._call("GET", url)
        if status != 200:
            raise RuntimeError(f"GET {url}: {status} {problem or ''} {detail}".strip())
        return body

    async def get_json(self, url: str) -> Any:
        return json.loads(await self.get(url))

    async def get_metrics(self, url: str) -> Samples:
        return parse_metrics((await self.get(url)).decode())


@dataclass
class _SeenSession:
    summary: dict[str, Any]
    done: bool = False


@dataclass
class Collector:
    """Builds snapshots (module notes); :meth:`close` releases its HTTP clients."""

    sources: DashboardSources
    token: str | None
    tls: TlsConfig = field(default_factory=TlsConfig)
    timeout_s: float = 5.0
    remember_sessions: int = 64

    def __post_init__(self) -> None:
        self.reader = RoleReader(self.token, timeout_s=self.timeout_s, tls=self.tls)
        self.index = (HttpIndexClient(self.sources.index, self.token, timeout_s=self.timeout_s, tls=self.tls)
                      if self.sources.index else None)
        self.sessions: OrderedDict[str, _SeenSession] = OrderedDict()
        self.found_holders: set[str] = set()
        self.seq = 0
        self._lock = asyncio.Lock()
        self._last: dict[str, Any] | None = None
        self._last_at = 0.0

    async def close(self) -> None:
        await self.reader.close()
        if self.index is not None:
            await self.index.close()

    async def latest(self, max_age_s: float = 0.5) -> dict[str, Any]:
        """A snapshot no older than ``max_age_s`` (several pages polling share one collection)."""
        async with self._lock:
            if self._last is None or time.monotonic() - self._last_at > max_age_s:
                self._last = await self.snapshot()
                self._last_at = time.monotonic()
            return self._last

    async def _try(self, errors: list[str], what: str, aw: Awaitable[Any]) -> Any:
        try:
            return await aw
        except Exception as exc:  # one source down leaves its panel empty, not the page
            errors.append(f"{what}: {type(exc).__name__}: {exc}"[:300])
            return None

    async def snapshot(self) -> dict[str, Any]:
        errors: list[str] = []
        src = self.sources
        pc = src.pc
        instances_doc, sessions_doc, pc_metrics, is_metrics, fe_metrics, relay_metrics = await asyncio.gather(
            self._try(errors, "PC instances", self.reader.get_json(f"{pc}instances")),
            self._try(errors, "PC sessions", self.reader.get_json(f"{pc}sessions?limit=256")),
            self._try(errors, "PC metrics", self.reader.get_metrics(metrics_url(pc))),
            self._optional(errors, "IS metrics", src.index),
            self._optional(errors, "front end metrics", src.frontend),
            self._try(errors, "relay metrics", self.reader.get_metrics(src.relay_metrics)) if src.relay_metrics
            else _none(),
        )
        views = (instances_doc or {}).get("instances", [])
        urls = [v["instance"] for v in views]
        scraped = await asyncio.gather(*(self._try(errors, f"instance {u} metrics", self.reader.get_metrics(metrics_url(u)))
                                         for u in urls))
        instances = [self._instance(v, m) for v, m in zip(views, scraped)]
        sessions = self._sessions(sessions_doc)
        picture = await self._picture(errors, set(urls))
        holder_urls = sorted(set(src.holders) | self.found_holders)
        holder_metrics = await asyncio.gather(*(self._try(errors, f"holder {h} metrics", self.reader.get_metrics(metrics_url(h)))
                                                for h in holder_urls))
        self.seq += 1
        return {
            "seq": self.seq,
            "time": time.time(),
            "sources": {"pc": pc, "index": src.index, "frontend": src.frontend, "relay_metrics": src.relay_metrics,
                        "holders": holder_urls},
            "instances": instances,
            "instance_states": {s: sum(1 for i in instances if i["state"] == s) for s in INSTANCE_STATES},
            "pc": self._pc(pc_metrics),
            "sessions": sessions,
            "hit": self._hit(scraped),
            "ttft": self._ttft(scraped),
            "prefix": picture,
            "holders": [self._holder(h, m) for h, m in zip(holder_urls, holder_metrics)],
            "index": self._index(is_metrics),
            "frontend": self._frontend(fe_metrics),
            "relay": self._relay(relay_metrics),
            "errors": errors,
        }

    async def _optional(self, errors: list[str], what: str, base: str | None) -> Samples | None:
        if base is None:
            return None
        return await self._try(errors, what, self.reader.get_metrics(metrics_url(base)))

    # -- panels ----------------------------------------------------------------------------------

    @staticmethod
    def _instance(view: dict[str, Any], m: Samples | None) -> dict[str, Any]:
        out = {k: view.get(k) for k in ("instance", "epoch", "state", "reported", "assigned", "running", "queued",
                                         "kv_utilization")}
        if m is not None:
            out["metrics"] = {
                "sessions_running": m.get("kvsp_instance_sessions_running"),
                "prefetch_running": m.get("kvsp_instance_prefetch_running"),
                "session_epoch_max": m.get("kvsp_instance_session_epoch_max"),
                "checkpoint_lag_max": m.get("kvsp_instance_checkpoint_lag_tokens_max"),
                "blocks": {s: m.get("kvsp_engine_request_blocks_total", source=s) for s in SOURCES},
                "ttft_count": m.get("kvsp_engine_ttft_seconds_count"),
                "ttft_sum_s": m.get("kvsp_engine_ttft_seconds_sum"),
                "decode_tokens_per_s": _num(m.get("kvsp_engine_decode_tokens_per_second")),
            }
        return out

    @staticmethod
    def _pc(m: Samples | None) -> dict[str, Any] | None:
        if m is None:
            return None
        return {"instances": m.by("kvsp_pc_instances", "state"), "sessions": m.by("kvsp_pc_sessions", "state"),
                "session_epoch_max": m.get("kvsp_pc_session_epoch_max"), "leader": m.get("kvsp_pc_leader"),
                "directives": m.by("kvsp_pc_prefetch_directives_total", "result")}

    def _sessions(self, doc: dict[str, Any] | None) -> dict[str, Any]:
        if doc is not None:
            listed = {s["session"]: s for s in doc.get("sessions", [])}
            for sid, seen in self.sessions.items():
                if sid not in listed:
                    seen.done = True
            for sid in reversed(list(listed)):  # oldest first, so the newest end up last
                self.sessions[sid] = _SeenSession(listed[sid])
                self.sessions.move_to_end(sid)
            while len(self.sessions) > self.remember_sessions:
                self.sessions.popitem(last=False)
        rows = []
        for sid, seen in reversed(self.sessions.items()):
            s = seen.summary
            state = "done" if seen.done else "failed" if s.get("failed") else "serving" if s.get("instance") else "pending"
            rows.append({"session": sid, "instance": s.get("instance"), "epoch": s["epoch"],
                         "output_offset": s["output_offset"], "max_tokens": s["max_tokens"],
                         "progress": s["output_offset"] / s["max_tokens"] if s["max_tokens"] else None,
                         "prompt_blocks": len(s["prompt_blocks"]), "state": state, "failed": s.get("failed")})
        tracked = [r for r in rows if r["state"] != "done"]
        return {"tracked": doc.get("total") if doc is not None else None, "list": rows,
                "by_state": {st: sum(1 for r in rows if r["state"] == st) for st in ("serving", "pending", "failed", "done")},
                "epoch_max": max((r["epoch"] for r in tracked), default=0)}

    @staticmethod
    def _hit(scraped: Iterable[Samples | None]) -> dict[str, Any]:
        blocks = {s: 0.0 for s in SOURCES}
        for m in scraped:
            if m is not None:
                for s in SOURCES:
                    blocks[s] += m.get("kvsp_engine_request_blocks_total", source=s)
        total = sum(blocks.values())
        reused = total - blocks["recomputed"]
        return {"blocks": blocks, "reused": reused, "total": total, "ratio": reused / total if total else None}

    @staticmethod
    def _ttft(scraped: Iterable[Samples | None]) -> dict[str, Any]:
        count = sum(m.get("kvsp_engine_ttft_seconds_count") for m in scraped if m is not None)
        total = sum(m.get("kvsp_engine_ttft_seconds_sum") for m in scraped if m is not None)
        return {"count": count, "sum_s": total, "mean_ms": 1e3 * total / count if count else None}

    async def _picture(self, errors: list[str], instances: set[str]) -> dict[str, Any]:
        """Which replica holds each prompt block of the sessions seen, by tier (IS lookups)."""
        groups: dict[tuple[str, str], list[str]] = {}
        for seen in reversed(self.sessions.values()):
            s = seen.summary
            keys = groups.setdefault((s["compat_id"], s["scope_id"]), [])
            for k in s["prompt_blocks"]:
                if k not in keys and sum(len(v) for v in groups.values()) < MAX_PICTURE_BLOCKS:
                    keys.append(k)
        blocks: list[dict[str, Any]] = []
        if self.index is None:
            return {"blocks": blocks, "places": []}
        places: set[str] = set()
        for (cid, sid), keys in groups.items():
            if not keys:
                continue
            found = await self._try(errors, "IS lookup", self.index.lookup(LookupRequest(
                scope_id=bytes.fromhex(sid), compat_id=bytes.fromhex(cid), block_keys=tuple(bytes.fromhex(k) for k in keys))))
            if found is None:
                continue
            matched = {b.block_key.hex(): b for b in found.blocks}
            for k in keys:
                replicas = []
                for r in (matched[k].replicas if k in matched else ()):
                    scheme = urlsplit(r.holder).scheme
                    kind = "instance" if r.holder in instances else "relay" if scheme.startswith("moqt") else "holder"
                    if kind == "holder" and scheme in ("http", "https"):
                        self.found_holders.add(r.holder)
                    places.add(r.holder)
                    replicas.append({"holder": r.holder, "kind": kind,
                                     "tiers": sorted({res.tier for res in r.residency})})
                blocks.append({"key": k, "scope_id": sid, "replicas": replicas})
        return {"blocks": blocks, "places": sorted(places)}

    @staticmethod
    def _holder(url: str, m: Samples | None) -> dict[str, Any]:
        if m is None:
            return {"url": url, "tiers": [], "replicas": None}
        tiers = []
        for labels, value in sorted(m.rows("kvsp_holder_tier_replicas"), key=lambda r: r[0].get("tier", "")):
            t, k = labels.get("tier", ""), labels.get("kind", "")
            tiers.append({"tier": t, "kind": k, "replicas": value,
                          "layers": m.get("kvsp_holder_tier_layers", tier=t, kind=k),
                          "used_octets": m.get("kvsp_holder_tier_used_octets", tier=t, kind=k),
                          "capacity_octets": m.get("kvsp_holder_tier_capacity_octets", tier=t, kind=k)})
        return {"url": url, "tiers": tiers, "replicas": m.get("kvsp_holder_replicas"),
                "leases": m.get("kvsp_holder_leases"),
                "served_layers": m.by("kvsp_holder_served_layers_total", "kind")}

    @staticmethod
    def _index(m: Samples | None) -> dict[str, Any] | None:
        if m is None:
            return None
        return {"replica_records": _num(m.get("kvsp_index_replica_records")),
                "lookups": m.get("kvsp_index_lookups_total"),
                "blocks_asked": m.get("kvsp_index_lookup_blocks_total", result="asked"),
                "blocks_matched": m.get("kvsp_index_lookup_blocks_total", result="matched")}

    @staticmethod
    def _frontend(m: Samples | None) -> dict[str, Any] | None:
        if m is None:
            return None
        return {"tokens_delivered": m.get("kvsp_frontend_tokens_delivered_total"),
                "duplicates_dropped": m.get("kvsp_frontend_duplicates_dropped_total"),
                "stale_tokens_refused": m.get("kvsp_frontend_stale_tokens_refused_total"),
                "sessions": m.get("kvsp_frontend_sessions")}

    @staticmethod
    def _relay(m: Samples | None) -> dict[str, Any] | None:
        if m is None:
            return None
        names = ("sessions", "subscribers", "tracks", "cache_objects", "cache_bytes", "cache_hits_total",
                 "cache_misses_total", "objects_in_total", "objects_out_total", "bytes_in_total", "bytes_out_total",
                 "fetches_total", "upstream_fetches_total")
        out: dict[str, Any] = {n.removesuffix("_total"): m.get(f"relay_{n}") for n in names}
        out["cache_hit_ratio"] = _num(m.get("relay_cache_hit_ratio"))
        out["fanout"] = out["objects_out"] / out["objects_in"] if out["objects_in"] else None
        return out


async def _none() -> None:
    return None
