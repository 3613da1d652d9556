"""``kvsp demo`` as a real process: the report's numbers agree with each other, nothing is left
running after it exits, and Ctrl-C shuts everything down with exit status 130."""

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
GUARD = 120.0  # safety net only: the demo takes a few seconds


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
def demo() -> tuple[dict[str, Any], str]:
    proc = subprocess.run(CMD + ["--json"], capture_output=True, text=True, timeout=GUARD)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout), proc.stderr


def test_the_report_adds_up(demo: tuple[dict[str, Any], str]) -> None:
    report, _ = demo
    assert report["ok"] is True and report["tensors_match"] is True
    blocks, size = report["blocks"], report["block_octets"]
    assert blocks >= 2
    assert report["lookup_matched"] == blocks == report["loaded_blocks"]
    assert report["prompt_blocks"] > blocks  # the question's block is not shared
    assert report["placed_on"] == "instance-2" and report["directive_state"] == "complete"
    moqt, http = report["transports"]["moqt_relay"], report["transports"]["http"]
    assert moqt["blocks"] + http["blocks"] == blocks
    assert moqt["bytes"] == moqt["blocks"] * size and http["bytes"] == http["blocks"] * size
    assert moqt["blocks"] == blocks - 1 and http["blocks"] == 1  # the stale MOQT record fell back
    assert report["directive_sources"][0].startswith("moqt://") and report["directive_sources"][1].startswith("http://")
    layers = report["geometry"]["layers"]
    assert report["layers_verified"] == blocks * layers
    # 20-octet header, 16 per layer, K and V sections of tokens x heads x dim x 2 octets
    g = report["geometry"]
    assert size == 20 + 16 * layers + layers * 2 * g["block_tokens"] * g["kv_heads"] * g["head_dim"] * 2
    cache = report["relay_cache"]
    assert cache["objects_in_total"] == moqt["blocks"] * layers == cache["cache_objects"]
    assert cache["upstream_fetches_total"] == moqt["blocks"]
    assert report["replicas_per_block_after"] == [3]  # HTTP holder, relay, instance 2
    assert report["load_ms"] > 0 and report["is_estimate_recompute_ms"] > 0


def test_progress_goes_to_stderr_and_everything_is_shut_down(demo: tuple[dict[str, Any], str]) -> None:
    report, stderr = demo
    assert "[demo] cluster up" in stderr and "[demo] all servers stopped, relay exited" in stderr
    roles = {s["role"] for s in report["servers"]}
    assert {"index", "relay", "holder", "pc", "instance-1", "instance-2"} <= roles
    relay = next(s for s in report["servers"] if s["role"] == "relay")
    assert _gone(relay["pid"])
    for server in report["servers"]:
        assert _port_free(server["port"], server["protocol"]), server


def test_ctrl_c_shuts_down_cleanly_with_130() -> None:
    proc = subprocess.Popen(CMD, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watchdog = threading.Timer(GUARD, proc.kill)
    watchdog.start()
    try:
        assert proc.stderr is not None
        lines: list[str] = []
        relay_pid = None
        for line in proc.stderr:
            lines.append(line)
            if line.startswith("[demo] relay ") and "(pid " in line:
                relay_pid = int(line.split("(pid ")[1].split(",")[0])
            if line.startswith("[demo] cluster up"):
                break
        assert relay_pid is not None, "".join(lines)
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
    assert _gone(relay_pid)
