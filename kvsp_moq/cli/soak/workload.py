"""The steady traffic of ``kvsp soak`` and what it counts.

``--clients`` loops run side by side until the soak's end; each picks (seeded) one of:

* a **session** (§6.8, 70 %): one of the prompts (two system prompts × three questions, so
  prefixes are shared), started at the front end with the cached prefix named by Block Key, as
  ``kvsp demo`` does (``cli/demo/router.py``); its output is read from the front end's stream;
* a **prefetch** (15 %): ``POST {pc}placements`` with a prompt's Block Keys and ``prefetch``,
  then a long poll on the directive's status (§6.4, §6.5);
* a **plain generation** (15 %): ``POST {ii}generate`` to a live instance (retried on another
  one when the instance dies under it: a plain request has no §6.8 recovery).

Every prompt's greedy output is known beforehand: the soak computes it once with the
reference model in its own process (:func:`expected_outputs`). Against it, for every session
that was started (the front end answered 201) and every generation that answered 200:

* **tokens lost**: indices below the expected length that were never delivered (a session that
  failed, timed out or ended short loses the rest of its output);
* **tokens repeated**: an index the client's stream carried more than once (§6.8: exactly once);
* **tokens wrong**: a delivered token that differs from the expected one at its index (KV that
  was not the prompt's, or a wrong token after a resume).

A session that failed before its first token (the blocks it named by key could be loaded nowhere:
it carries no tokens to recompute them from, §6.8) is started again once with every prompt token,
as a client would, and counted as resubmitted; a session the front end refused (no instance could
take it) is counted as refused: none of its tokens was promised. Each wait is bounded (``session_timeout_s``); the last failure reasons are
kept for the report.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ...control.client.http import HttpFrontEndClient, HttpIndexClient
from ...control.common.errors import PeerUnreachable
from ...control.common.session_records import ClientSessionRequest, StreamEnd, StreamFailed
from ..demo import QUESTIONS, SYSTEM_PROMPT, prompt_of
from ..demo.cluster import http_request
from ..demo.router import GREEDY, SessionClient
from .roles import SoakCluster

__all__ = ["PROMPTS", "Tally", "Workload", "expected_outputs"]

#: A second system prompt: sessions share a prefix with one of two, never across them.
SYSTEM_PROMPT_2 = (
    "You are the on-call assistant of a network operations team. Reply with the command to run "
    "first, then one sentence on why. Never guess an interface name: ask for it. Mention the "
    "rollback for every change. Prefer read-only commands until the cause is known. "
)
PROMPTS: tuple[str, ...] = (
    *(prompt_of(q) for q in QUESTIONS),
    *(f"{SYSTEM_PROMPT_2}\nUser: {q}\nAssistant:" for q in QUESTIONS),
)
SYSTEM_PROMPTS = (SYSTEM_PROMPT, SYSTEM_PROMPT_2)
MAX_TOKENS = 16
#: Times a client reopens a token stream the front end cut (503 while its store fails over),
#: and the pause before each reopening.
STREAM_REOPENS = 5
STREAM_REOPEN_PAUSE_S = 1.0
KINDS = (("session", 0.70), ("prefetch", 0.15), ("generate", 0.15))


def expected_outputs(model_dir: str, max_tokens: int = MAX_TOKENS) -> dict[str, list[int]]:
    """Each prompt's greedy output, computed here with the reference model (imports torch)."""
    import torch

    from ...model import ByteTokenizer, ReferenceModel, Sampler, generate

    torch.set_num_threads(1)
    model = ReferenceModel.load(model_dir)
    tokenizer = ByteTokenizer()
    return {p: [t.token_id for t in generate(model, tokenizer.encode(p), Sampler.greedy(), max_tokens)] for p in PROMPTS}


@dataclass
class Tally:
    sessions_started: int = 0
    sessions_finished: int = 0
    sessions_failed: int = 0
    sessions_refused: int = 0
    sessions_resubmitted: int = 0
    generations_ok: int = 0
    generations_retried: int = 0
    generations_failed: int = 0
    prefetches: Counter[str] = field(default_factory=Counter)
    tokens_delivered: int = 0
    tokens_lost: int = 0
    streams_reopened: int = 0
    tokens_repeated: int = 0
    tokens_wrong: int = 0
    ttft_ms: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def note(self, what: str) -> None:
        self.failures.append(what[:300])
        del self.failures[:-20]

    def score(self, expected: list[int], delivered: dict[int, int]) -> None:
        """Lost and wrong tokens of one output against its expected one."""
        self.tokens_delivered += len(delivered)
        self.tokens_lost += sum(1 for i in range(len(expected)) if i not in delivered)
        self.tokens_wrong += sum(1 for i, t in delivered.items() if i >= len(expected) or expected[i] != t)


class Workload:
    def __init__(self, cluster: SoakCluster, *, client: SessionClient, front_end: HttpFrontEndClient,
                 expected: dict[str, list[int]], seed: int, live_instances: Any, session_timeout_s: float = 120.0) -> None:
        self.cluster = cluster
        self.client = client
        self.front_end = front_end
        self.expected = expected
        self.rng = random.Random(seed)
        self.live_instances = live_instances  # () -> list of instance URLs not being killed now
        self.session_timeout_s = session_timeout_s
        self.tally = Tally()
        self.token = cluster.tokens["client"]

    async def run(self, clients: int, until: float) -> None:
        await asyncio.gather(*(self._loop(until, random.Random(self.rng.random())) for _ in range(clients)))

    async def _loop(self, until: float, rng: random.Random) -> None:
        while time.monotonic() < until:
            kind = rng.choices([k for k, _ in KINDS], [w for _, w in KINDS])[0]
            prompt = rng.choice(PROMPTS)
            try:
                if kind == "session":
                    await self.session(prompt)
                elif kind == "prefetch":
                    await self.prefetch(rng.choice(SYSTEM_PROMPTS))
                else:
                    await self.generate(prompt, rng)
            except Exception as exc:  # a bug of the soak itself must not end the run silently
                self.tally.note(f"{kind}: unexpected {type(exc).__name__}: {exc}")

    async def session(self, prompt: str) -> None:
        """One session; resubmitted once with every prompt token when it failed before its first
        token (what a client does when the blocks it named by key cannot be loaded anywhere any
        more: a session that names blocks carries no tokens to recompute them from, §6.8)."""
        t = self.tally
        client = self.client
        ids, keys = client.keys(prompt)
        try:
            cached = await client.cached_prefix(keys[:(len(ids) - 1) // client.block_tokens])
        except Exception as exc:  # the IS unreachable: start without naming cached blocks
            t.note(f"lookup: {exc}")
            cached = 0
        delivered: dict[int, int] = {}
        for attempt in (1, 2):
            named = cached if attempt == 1 else 0
            request = ClientSessionRequest(
                compat_id=client.compat_id, scope_id=client.scope_id, prompt_blocks=tuple(keys[:named]),
                prompt_tail=tuple(ids[named * client.block_tokens:]), tokens=len(ids), sampler=GREEDY,
                max_tokens=MAX_TOKENS)
            outcome = await self._one_session(request, delivered)
            if outcome == "refused":
                return
            if outcome == "ended" or delivered or named == 0:
                break
            t.sessions_resubmitted += 1  # failed before its first token: again, with every token
        if outcome == "ended":
            t.sessions_finished += 1
        else:
            t.sessions_failed += 1
        t.score(self.expected[prompt], delivered)

    async def _one_session(self, request: ClientSessionRequest, delivered: dict[int, int]) -> str:
        """``refused`` (never started), ``ended`` (the stream's end came) or ``failed``;
        the tokens read go to ``delivered`` (index -> token)."""
        t = self.tally
        started = time.perf_counter()
        try:
            session = await self.front_end.start(self.cluster.url(self.cluster.frontend), request)
        except Exception as exc:
            t.sessions_refused += 1
            t.note(f"session refused: {exc}")
            return "refused"
        t.sessions_started += 1
        try:
            async with asyncio.timeout(self.session_timeout_s):
                # A stream cut by the front end (its store failing over: 503) is reopened from the
                # next index, as a client does (docs/deploy.md "Front end"), a bounded number of times.
                for reopened in range(STREAM_REOPENS + 1):
                    start = len(delivered)
                    try:
                        async for item in self.front_end.tokens(self.cluster.url(self.cluster.frontend),
                                                                session.session, start):
                            if isinstance(item, StreamEnd):
                                return "ended"
                            if isinstance(item, StreamFailed):
                                t.note(f"session {session.session} failed after {item.next} tokens: {item.reason}")
                                return "failed"
                            if not delivered:
                                t.ttft_ms.append((time.perf_counter() - started) * 1e3)
                            if item.index in delivered:
                                t.tokens_repeated += 1
                            delivered[item.index] = item.token
                    except PeerUnreachable as exc:
                        if reopened == STREAM_REOPENS:
                            raise
                        t.streams_reopened += 1
                        t.note(f"session {session.session}: stream reopened after {type(exc).__name__}: {exc}")
                        await asyncio.sleep(STREAM_REOPEN_PAUSE_S)
        except Exception as exc:
            t.note(f"session {session.session}: stream {type(exc).__name__}: {exc}")
        return "failed"

    async def prefetch(self, prompt: str) -> None:
        ids, keys = self.client.keys(prompt)
        body = {"scope_id": self.client.scope_id.hex(), "compat_id": self.client.compat_id.hex(),
                "block_keys": [k.hex() for k in keys], "tokens": len(ids), "request_ref": f"soak {uuid.uuid4()}",
                "prefetch": True}
        try:
            reply = await http_request(f"{self.cluster.url(self.cluster.pc)}placements", "POST", token=self.token,
                                       body=json.dumps(body).encode())
            if reply.status != 200:
                self.tally.prefetches[f"placement {reply.status}"] += 1
                return
            placed = reply.json()
            if placed.get("directive_status") is None:
                self.tally.prefetches["resident"] += 1  # nothing to move: the chosen instance holds it all
                return
            status = await http_request(f"{placed['directive_status']}?wait_ms=20000", token=self.token, timeout=30)
            self.tally.prefetches[status.json().get("state", "?") if status.status == 200 else f"status {status.status}"] += 1
        except Exception as exc:
            self.tally.prefetches["interrupted"] += 1
            self.tally.note(f"prefetch: {type(exc).__name__}: {exc}")

    async def generate(self, prompt: str, rng: random.Random) -> None:
        t = self.tally
        body = json.dumps({"scope_id": self.client.scope_id.hex(), "prompt": prompt, "max_tokens": MAX_TOKENS,
                           "sampler": {"method": "greedy", "params": {}, "seed": 0, "step": 0, "deterministic": True}}
                          ).encode()
        for attempt in range(3):
            live = self.live_instances()
            if not live:
                break
            url = rng.choice(live)
            try:
                reply = await http_request(f"{url}generate", "POST", token=self.token, body=body,
                                           timeout=self.session_timeout_s)
            except Exception as exc:
                t.generations_retried += 1
                t.note(f"generate at {url}: {type(exc).__name__}: {exc}")
                continue
            if reply.status != 200:
                t.generations_retried += 1
                t.note(f"generate at {url}: {reply.status} {reply.body[:200]!r}")
                continue
            answer = reply.json()
            t.generations_ok += 1
            t.score(self.expected[prompt], {int(x["index"]): int(x["token"]) for x in answer["tokens"]})
            return
        t.generations_failed += 1
