"""``kvsp demo --engine vllm --json`` as a real process: two vLLM engine processes share a prompt's
KV through KVSP over MOQT through the relay; the report's numbers agree with each other and with
the relay's own counters, reused KV gives the same greedy output, and nothing the demo started
is left running after it exits (it runs in a session of its own: every process of that session
must be gone), also when SIGTERM comes while the engines start. One engine pair runs to the end
(6 minutes on 2 busy cores, nearly all of it the engines' start); the SIGTERM case waits until
its engines have made their shared memory (a minute or two), then about 20 s.

Nothing else of a run outlives it either, counted over what the run made only
(tests/leftovers_support.py): none of the shared memory its processes mapped (vLLM's
``/dev/shm/psm_*``, which a killed engine does not free: the demo unlinks it), nothing in the
``TMPDIR`` of its own, where the run's directory (the relay's key, the CA) and each engine's
(vLLM's sockets) were while it ran.

Skipped, with the reason, where vLLM is not installed (the ``vllm`` extra).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from leftovers_support import (
    Snapshot,
    Watched,
    group_members,
    left_in,
    own_segments,
    private_tmpdir,
    run_env,
    run_watched,
    session_members,
    shm_mappings,
)

if importlib.util.find_spec("vllm") is None:  # the test process itself never imports vLLM
    pytest.skip("vLLM is not installed (pip install -e '.[vllm]', docs/vllm.md)", allow_module_level=True)

#: bf16, the dtype production models run (fp32 runs in tests/test_bench_vllm.py and test_vllm_shards.py).
CMD = [sys.executable, "-m", "kvsp_moq", "demo", "--engine", "vllm", "--dtype", "bfloat16", "--json"]
GUARD = 1500.0  # safety net only: engine starts take minutes on a loaded 2-core machine
#: Bound on two engines' start up to their shared memory (vLLM makes it half way through).
START_S = 900.0
B = 32


@dataclass
class DemoRun:
    report: dict[str, Any]
    run: Watched
    #: Taken at each progress line while both engines were up.
    up: Snapshot
    #: What was left in its TMPDIR after it exited.
    left: list[str]


@pytest.fixture(scope="module")
def demo_run() -> Iterator[DemoRun]:
    with private_tmpdir() as tmp:
        up, serving = Snapshot(), []

        def on_line(line: str, sid: int) -> None:
            if line.startswith("[demo] prompts "):  # both engines are ready
                serving.append(True)
            elif line.startswith("[demo] shutting down"):
                serving.clear()
            if serving:
                up.take(sid, tmp)

        run = run_watched(CMD, env=run_env(tmp), timeout=GUARD, on_line=on_line)
        assert run.code == 0, run.stderr[-5000:]
        yield DemoRun(json.loads(run.stdout), run, up, left_in(tmp))


@pytest.fixture(scope="module")
def demo(demo_run: DemoRun) -> tuple[dict[str, Any], str, int]:
    return demo_run.report, demo_run.run.stderr, demo_run.run.pid


def test_engine_b_loads_a_s_blocks_over_moqt_and_answers_the_same(demo: tuple[dict[str, Any], str, int]) -> None:
    report, _, _ = demo
    assert report["ok"] is True and report["outputs_match"] is True and report["dtype"] == "bfloat16"
    blocks = report["prompt_blocks"]
    assert blocks == report["prompt_tokens"] // B and report["blocks_published"] == blocks
    assert report["hit_tokens"] == blocks * B  # every full block (the full-hit rule keeps one token)
    assert report["hit_tokens_shared_prefix"] == report["shared_prefix_blocks"] * B
    cold, published, warm, cached, off, partial, partial_off, local = report["requests"]
    assert cold["connector"] is False and cold["hit_tokens"] == 0 and cold["kvsp"] == {}
    assert published["kvsp"]["blocks_published"] == blocks and published["hit_tokens"] == 0
    assert warm["hit_tokens"] == blocks * B and warm["local_hit_tokens"] == 0
    # vLLM's prefix cache is on: once B has loaded the blocks, they are its own hits.
    assert cached["hit_tokens"] == 0 and cached["local_hit_tokens"] == blocks * B
    assert cached["computed_tokens"] == warm["computed_tokens"] == report["prompt_tokens"] - blocks * B
    assert partial["local_hit_tokens"] == report["shared_prefix_blocks"] * B
    assert off["kvsp"] == partial_off["kvsp"] == {} and off["computed_tokens"] == report["prompt_tokens"]
    assert published["token_ids"] == cached["token_ids"] == off["token_ids"] and len(off["token_ids"]) == 16
    assert partial["token_ids"] == partial_off["token_ids"] != off["token_ids"]
    # The transports add up over B's requests with the connector; bf16: two octets an element.
    t = report["transports"]
    block_bytes = 4 * 2 * B * 2 * 32 * 2  # layers x (K, V) x tokens x KV heads x head_dim x octets
    assert t["moqt"] == {"blocks": blocks, "bytes": blocks * block_bytes, "relay_bytes_out": blocks * block_bytes}
    assert t["http"] == {"blocks": 0, "bytes": 0} and t["failed"] == {"blocks": 0}
    assert t["vllm_prefix_cache"] == {"blocks": blocks + report["shared_prefix_blocks"]}
    assert t["recomputed"]["tokens"] == warm["computed_tokens"] + cached["computed_tokens"] + partial["computed_tokens"]
    assert t["recomputed"]["kv_bytes"] == t["recomputed"]["tokens"] * block_bytes // B
    # The relay saw B's first (timed) load, from a cold cache: one FETCH per block, upstream to
    # A's holder, every layer an object out of it.
    relay = report["relay_during_load"]
    assert relay["fetches_total"] == relay["upstream_fetches_total"] == blocks
    assert relay["objects_out_total"] == 4 * blocks and relay["bytes_out_total"] == blocks * block_bytes
    ttft = report["ttft_ms"]
    assert ttft["without_cache"] == cold["elapsed_ms"] > 0 and ttft["with_cache"] == warm["elapsed_ms"] > 0
    # Whether the cache helped, and where the time went, measured (not a speed assertion).
    assert local["local_hit_tokens"] == blocks * B and ttft["local_hit"] == local["elapsed_ms"] > 0
    went = report["where_the_time_went"]
    assert report["cache_helped"] is (warm["elapsed_ms"] < cold["elapsed_ms"]) is went["helped"]
    assert went["load_ms"] == round(warm["elapsed_ms"] - local["elapsed_ms"], 3)
    assert went["recompute_ms"] == round(cold["elapsed_ms"] - local["elapsed_ms"], 3)
    assert ("did NOT help" in went["why"]) is not report["cache_helped"]
    # What publishing cost A: its request, B's same request without the connector, and the
    # background publications' time after it (measured, reported; not a speed assertion).
    pub = report["publishing"]
    assert pub["a_request_ms"] == published["elapsed_ms"] and pub["b_same_request_off_ms"] == off["elapsed_ms"]
    assert pub["background_ms"] >= 0


def test_progress_and_shutdown(demo: tuple[dict[str, Any], str, int]) -> None:
    report, err, pid = demo
    lines = err.splitlines()
    assert any(line.startswith("[demo] engine B") and "ready" in line for line in lines)
    assert lines[-1] == "[demo] all servers stopped, relay and engines exited"
    assert {s["role"] for s in report["servers"]} >= {"index", "relay", "holder", "engine A", "engine B"}
    assert session_members(pid) == []  # the engines, vLLM's engine cores, the relay: all gone


def test_nothing_of_the_run_is_left(demo_run: DemoRun) -> None:
    up = demo_run.up
    # While it ran: vLLM's shared memory, the run's directory with its relay key, the engines' own.
    assert up.linked(), "the engines were seen mapping no shared memory (vLLM's psm_* queues)"
    assert any(e.startswith("kvsp-demo-vllm-") and e.endswith("/relay.key") for e in up.tmp), up.tmp
    assert len([e for e in up.tmp if e.startswith("kvsp-engine-") and "/" not in e]) == 2, up.tmp
    # After: none of it.
    assert session_members(demo_run.run.pid) == []
    assert own_segments(up.pids, up.segments) == set()
    assert demo_run.left == []


def made_shared_memory(pgid: int) -> bool:
    """Whether a process of group ``pgid`` maps a /dev/shm segment by its own name (vLLM's
    message queues, made half way through an engine's start)."""
    return any(not n.endswith(" (deleted)") for n in shm_mappings(group_members(pgid)).values())


def test_sigterm_while_the_engines_start_stops_everything() -> None:
    """SIGTERM to the demo alone (the engines get no signal) while its engines start, hung: each
    stopped (SIGSTOP to its process group) once it has made vLLM's shared memory. 130, after the
    engines' grace (10 s from their stdin's close) they are killed with what they started, and
    nothing of the run is left: no process of its session, none of the segments the engines
    mapped (a killed vLLM frees nothing: the demo unlinked them, and said so), nothing in its
    TMPDIR (the run's directory with its relay key, the engines' own)."""
    engines: dict[str, int] = {}  # name -> pid, its process group's id
    up = Snapshot()

    def hang_then_sigterm(sid: int, tmp: Path) -> None:
        deadline = time.monotonic() + START_S
        while not all(made_shared_memory(pgid) for pgid in engines.values()):
            assert sid in session_members(sid), "the demo ended while its engines started"
            assert time.monotonic() < deadline, f"no shared memory made by both engines within {START_S} s"
            time.sleep(0.5)  # polling the engines' maps, a bounded wait
        for pgid in engines.values():
            os.killpg(pgid, signal.SIGSTOP)
        up.take(sid, tmp)
        os.kill(sid, signal.SIGTERM)

    with private_tmpdir() as tmp:
        def on_line(line: str, sid: int) -> None:
            if m := re.match(r"\[demo\] (engine \w) +starting \(pid (\d+);", line):
                engines[m[1]] = int(m[2])
            if line.startswith("[demo] engines ") and not up.pids:  # both engine processes are started
                hang_then_sigterm(sid, tmp)

        run = run_watched(CMD, env=run_env(tmp), timeout=GUARD, on_line=on_line)
        left = left_in(tmp)
    assert run.code == 130, run.stderr[-5000:]
    assert sorted(engines) == ["engine A", "engine B"]
    assert session_members(run.pid) == []
    for name in engines:
        assert f"[demo] {name:<14} unlinked the " in run.stderr, run.stderr[-5000:]
    assert up.linked() and own_segments(up.pids, up.segments) == set()
    assert any(e.startswith("kvsp-demo-vllm-") and e.endswith("/relay.key") for e in up.tmp), up.tmp
    assert left == []
