"""``kvsp demo`` as a real process (the reference model in two ``kvsp instance`` processes, every
request a §6.8 session through the front end): the report's numbers agree with each other and
with what the components counted (the instances' engine counters, the relay's metrics, the IS,
the front end's tally), reused KV gives the same greedy output, nothing is left running after it
exits, and Ctrl-C shuts everything down with 130."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from typing import Any

import pytest

CMD = [sys.executable, "-m", "kvsp_moq", "demo"]
GUARD = 180.0  # safety net only: the demo takes a few seconds


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _port_free(port: int, protocol: str) -> bool:
    kind = socket.SOCK_DGRAM if protocol == "udp" else socket.SOCK_STREAM
    with socket.socket(socket.AF_INET, kind) as s:
        if protocol == "tcp":
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is not a listener
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def demo(model_dir: str) -> tuple[dict[str, Any], str]:
    proc = subprocess.run(CMD + ["--json", "--model-dir", model_dir], capture_output=True, text=True, timeout=GUARD)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout), proc.stderr


def test_the_report_adds_up(demo: tuple[dict[str, Any], str]) -> None:
    report, _ = demo
    assert report["ok"] is True and report["outputs_match"] is True
    cold, warm, *more = report["requests"]
    prompt_blocks, system_blocks = cold["prompt_blocks"], report["system_blocks"]
    assert system_blocks >= 3 and prompt_blocks > system_blocks  # the question's block is not shared
    # request 1: an empty cache (nothing named by key), everything recomputed; then the system
    # prompt is prefetched ahead of traffic to the other instance; request 2 (the same prompt,
    # its blocks now named by key) runs there, the question's block prefetched in its path
    assert cold["blocks_named"] == 0 and cold["directive"] is None and cold["prefetched"] == {"moqt": 0, "http": 0}
    assert cold["blocks"] == {"local": 0, "moqt": 0, "http": 0, "recomputed": prompt_blocks}
    ahead = report["prefetch_ahead"]
    assert ahead == {**ahead, "instance": warm["instance"], "state": "complete", "loaded": system_blocks,
                     "blocks": system_blocks} and ahead["ms"] > 0
    assert warm["instance"] != cold["instance"] and warm["blocks_named"] == prompt_blocks
    in_path = prompt_blocks - system_blocks
    assert warm["directive"]["state"] == "complete" and len(warm["directive"]["loaded"]) == in_path
    assert warm["prefetched"] == {"moqt": in_path, "http": 0}
    assert warm["blocks"] == {"local": prompt_blocks, "moqt": 0, "http": 0, "recomputed": 0}
    assert report["prefetch"] == {**report["prefetch"], "state": "complete", "loaded": in_path,
                                  "directive": warm["directive"]["directive"]}
    # requests 3 and 4 name the system blocks (resident at the second instance: no directive)
    assert all(r["instance"] == warm["instance"] and r["blocks_named"] == system_blocks and r["directive"] is None
               and r["blocks"]["local"] == system_blocks for r in more)
    assert report["ttft_ms"]["without_cache"] == cold["ttft_ms"] > 0 and report["ttft_ms"]["with_cache"] == warm["ttft_ms"] > 0
    assert report["ttft_ms"]["client_without_cache"] == cold["client_ttft_ms"] >= cold["ttft_ms"]
    assert report["ttft_ms"]["client_with_cache"] == warm["client_ttft_ms"] >= warm["ttft_ms"]
    # every request was one session at its instance; the per-request figures add up to the counters
    engines = report["instances"]
    assert sum(c["sessions"] for c in engines.values()) == len(report["requests"])
    assert sum(c["failed_sessions"] + c["requests"] for c in engines.values()) == 0
    for name, c in engines.items():
        mine = [r for r in report["requests"] if r["instance"] == name]
        assert c["ttft_ms"] == [r["ttft_ms"] for r in mine]
        assert c["output_tokens"] == sum(r["output_tokens"] for r in mine)
        for source in ("local", "moqt", "http", "recomputed"):
            assert c["request_blocks"][source]["blocks"] == sum(r["blocks"][source] for r in mine)

    # the transports are what the instances counted ...
    t = report["transports"]
    assert t["moqt"]["blocks"] == sum(c["prefetch_blocks"]["moqt"]["blocks"] + c["request_blocks"]["moqt"]["blocks"]
                                      for c in engines.values()) == prompt_blocks
    assert t["moqt"]["bytes"] == prompt_blocks * report["block_octets"]
    assert t["http"] == {"blocks": 0, "bytes": 0}
    assert t["recomputed"]["blocks"] == sum(r["blocks"]["recomputed"] for r in report["requests"])
    assert t["local"]["blocks"] == sum(r["blocks"]["local"] for r in report["requests"])
    assert report["hits"] == t["local"]["blocks"] and report["misses"] == t["recomputed"]["blocks"]
    assert report["hit_ratio"] == round(report["hits"] / (report["hits"] + report["misses"]), 4)
    # request 1 published its prompt blocks and the blocks its output completed (§6.8): the
    # last token sampled is not in the KV cache
    published = (cold["prompt_tokens"] + cold["output_tokens"] - 1) // report["model"]["block_tokens"]
    assert published > prompt_blocks
    assert engines[cold["instance"]]["published"]["moqt"] == published == cold["published"]["moqt"]
    # ... and what the relay counted: each layer of each block came through it once
    relay, layers = report["relay"], report["model"]["layers"]
    assert relay["bytes_out_total"] == relay["bytes_in_total"] == t["moqt"]["bytes"]
    assert relay["objects_out_total"] == relay["objects_in_total"] == t["moqt"]["blocks"] * layers
    assert relay["upstream_fetches_total"] == t["moqt"]["blocks"]
    # ... and the IS: every system block at the first instance, the holder, the relay, the second instance
    assert report["system_blocks_matched_at_is"] == system_blocks
    assert report["replicas_per_system_block"] == [4]
    # ... and the front end: every token delivered once, in one epoch, and streamed once
    fe = report["front_end"]
    streamed = sum(r["output_tokens"] for r in report["requests"])
    assert fe["sessions"] == len(report["requests"]) and fe["epochs"] == [1]
    assert fe["tokens_delivered"] == fe["tokens_streamed"] == streamed
    assert fe["duplicates_dropped"] == 0 and fe["stale_batches"] == 0
    assert cold["output"] == warm["output"] and len(cold["output"]) > 0
    g = report["model"]
    assert report["block_octets"] == layers * 2 * g["block_tokens"] * g["kv_heads"] * g["head_dim"] * 4


def test_progress_goes_to_stderr_and_everything_is_shut_down(demo: tuple[dict[str, Any], str]) -> None:
    report, stderr = demo
    assert "[demo] cluster up" in stderr and "[demo] all servers stopped, relay and instances exited" in stderr
    roles = {s["role"] for s in report["servers"]}
    assert {"index", "relay", "holder", "pc", "frontend", "instance-1", "instance-2"} <= roles
    for server in report["servers"]:
        if "pid" in server:
            assert _gone(server["pid"]), server
        assert _port_free(server["port"], server["protocol"]), server


def test_ctrl_c_shuts_down_cleanly_with_130(model_dir: str) -> None:
    proc = subprocess.Popen(CMD + ["--model-dir", model_dir], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watchdog = threading.Timer(GUARD, proc.kill)
    watchdog.start()
    try:
        assert proc.stderr is not None
        lines: list[str] = []
        pids = []
        for line in proc.stderr:
            lines.append(line)
            if line.startswith(("[demo] relay ", "[demo] instance ")) and "(pid " in line:
                pids.append(int(line.split("(pid ")[1].split(",")[0].split(";")[0]))
            if line.startswith("[demo] cluster up"):
                break
        assert len(pids) == 3, "".join(lines)
        proc.send_signal(signal.SIGINT)
        rest = proc.stderr.read()
        code = proc.wait()
    finally:
        watchdog.cancel()
        proc.kill()
    assert code == 130, "".join(lines) + rest
    assert "[demo] interrupted: shutting down" in rest
    assert "[demo] interrupted: clean shutdown, exit 130" in rest
    assert "Traceback" not in rest
    assert all(_gone(pid) for pid in pids)
