"""``kvsp demo --engine vllm --json`` as a real process: two vLLM engine processes share a prompt's
KV through KVSP over MOQT through the relay; the report's numbers agree with each other and with
the relay's own counters, reused KV gives the same greedy output, and nothing the demo started
is left running after it exits (it runs in a session of its own: every process of that session
must be gone), also when SIGTERM comes while the engines start. One engine pair runs to the end
(6 minutes on 2 busy cores, nearly all of it the engines' start); the SIGTERM case about 30 s.

Skipped, with the reason, where vLLM is not installed (the ``vllm`` extra).
"""

from __future__ import annotations

import importlib.util
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:  # the test process itself never imports vLLM
    pytest.skip("vLLM is not installed (pip install -e '.[vllm]', docs/vllm.md)", allow_module_level=True)

CMD = [sys.executable, "-m", "kvsp_moq", "demo", "--engine", "vllm", "--json"]
GUARD = 1500.0  # safety net only: engine starts take minutes on a loaded 2-core machine
B = 32


def _session_members(sid: int) -> list[int]:
    """Processes of session ``sid`` still alive (zombies are dead)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rpartition(")")[2].split()
        if fields[0] != "Z" and int(fields[3]) == sid:
            out.append(int(entry.name))
    return out


@pytest.fixture(scope="module")
def demo() -> tuple[dict[str, Any], str, int]:
    proc = subprocess.Popen(CMD, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=GUARD)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait(10)
    assert proc.returncode == 0, err[-5000:]
    return json.loads(out), err, proc.pid


def test_engine_b_loads_a_s_blocks_over_moqt_and_answers_the_same(demo: tuple[dict[str, Any], str, int]) -> None:
    report, _, _ = demo
    assert report["ok"] is True and report["outputs_match"] is True
    blocks = report["prompt_blocks"]
    assert blocks == report["prompt_tokens"] // B and report["blocks_published"] == blocks
    assert report["hit_tokens"] == blocks * B  # every full block (the full-hit rule keeps one token)
    assert report["hit_tokens_shared_prefix"] == report["shared_prefix_blocks"] * B
    cold, published, warm, cached, off, partial, partial_off = report["requests"]
    assert cold["connector"] is False and cold["hit_tokens"] == 0 and cold["kvsp"] == {}
    assert published["kvsp"]["blocks_published"] == blocks and published["hit_tokens"] == 0
    assert warm["hit_tokens"] == cached["hit_tokens"] == blocks * B
    assert cached["kvsp"]["blocks_moqt"] == blocks and not {"blocks_http", "blocks_failed"} & set(cached["kvsp"])
    assert cached["computed_tokens"] == warm["computed_tokens"] == report["prompt_tokens"] - blocks * B
    assert partial["kvsp"]["blocks_moqt"] == report["shared_prefix_blocks"]
    assert published["token_ids"] == cached["token_ids"] == off["token_ids"] and len(off["token_ids"]) == 16
    assert partial["token_ids"] == partial_off["token_ids"] != off["token_ids"]
    # The transports add up over B's whole-output requests with the connector.
    t = report["transports"]
    moqt_blocks = blocks + report["shared_prefix_blocks"]
    block_bytes = cached["kvsp"]["bytes_moqt"] // blocks
    assert t["moqt"] == {"blocks": moqt_blocks, "bytes": moqt_blocks * block_bytes}
    assert t["http"] == {"blocks": 0, "bytes": 0} and t["failed"] == {"blocks": 0}
    assert t["recomputed"]["tokens"] == cached["computed_tokens"] + partial["computed_tokens"]
    assert t["recomputed"]["kv_bytes"] == t["recomputed"]["tokens"] * block_bytes // B
    # The relay saw B's first (timed) load, from a cold cache: one FETCH per block, upstream to
    # A's holder, every layer an object out of it.
    relay = report["relay_during_load"]
    assert relay["fetches_total"] == relay["upstream_fetches_total"] == blocks
    assert relay["objects_out_total"] == 4 * blocks and relay["bytes_out_total"] == blocks * block_bytes
    ttft = report["ttft_ms"]
    assert ttft["without_cache"] == cold["elapsed_ms"] > 0 and ttft["with_cache"] == warm["elapsed_ms"] > 0


def test_progress_and_shutdown(demo: tuple[dict[str, Any], str, int]) -> None:
    report, err, pid = demo
    lines = err.splitlines()
    assert any(line.startswith("[demo] engine B") and "ready" in line for line in lines)
    assert lines[-1] == "[demo] all servers stopped, relay and engines exited"
    assert {s["role"] for s in report["servers"]} >= {"index", "relay", "holder", "engine A", "engine B"}
    assert _session_members(pid) == []  # the engines, vLLM's engine cores, the relay: all gone


def test_sigterm_while_the_engines_start_stops_everything() -> None:
    """SIGTERM to the demo alone (the engines get no signal): 130, and nothing of its session left
    (engines still loading are given 10 s after their stdin closed, then killed with what they
    started)."""
    proc = subprocess.Popen(CMD, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    try:
        deadline = time.monotonic() + 300
        while True:  # until both engine processes are started
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            assert line is not None and time.monotonic() < deadline, "the demo ended before starting its engines"
            if line.startswith("[demo] engines "):
                break
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 130
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait(10)
    assert _session_members(proc.pid) == []
