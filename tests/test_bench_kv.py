"""``kvsp bench kv`` and ``kvsp bench wan`` run as real processes with small sizes: the figures
(holder in its own process, torch sink, every layer verified), a backend the transport does
not have, and the WAN bench's namespaces. Never asserts on speed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from test_cli import kvsp


def test_bench_kv_prints_a_figure_set_per_datagram_size() -> None:
    pytest.importorskip("torch")
    proc = kvsp("bench", "kv", "--layers", "2", "--datagram-size", "16384,8952", "--repeat", "1",
                "--no-relay")
    figures = {f["name"]: f for f in map(json.loads, proc.stdout.splitlines())}
    for path in ("aioquic_dgram16384", "aioquic_dgram8952", "http"):
        first, block, rate = (figures[f"kv_{path}_{k}"] for k in ("first_layer", "block", "rate"))
        assert (first["baseline_name"], block["baseline_name"], rate["baseline_name"]) == \
            ("tcp_first_layer", "tcp_copy", "tcp_copy")
        assert first["value"] > 0 and block["value"] > 0
        assert rate["ratio"] == pytest.approx(block["baseline_value"] / block["value"], rel=1e-3)
    assert figures["kv_aioquic_dgram8952_block"]["params"]["max_datagram_size"] == 8952
    assert figures["kv_aioquic_dgram16384_block"]["params"]["sink"] == "torch-cpu"


def test_bench_kv_refuses_a_backend_the_transport_lacks() -> None:
    proc = kvsp("bench", "kv", "--backend", "aioquic,no-such-quic", check=False)
    assert proc.returncode != 0
    assert "transport backend 'no-such-quic' is not available" in proc.stderr


def _netns() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def test_bench_wan_measures_or_says_why_not_and_leaves_no_namespace() -> None:
    """Root with iproute2: a real two-namespace path (unshaped, so no netem is needed);
    otherwise the skip message. Either way no namespace of ours is left behind."""
    pytest.importorskip("torch")
    before = _netns() if shutil.which("ip") else set()
    proc = kvsp("bench", "wan", "--layers", "1", "--repeat", "1", "--delay-ms", "0", "--loss", "0")
    lines = proc.stdout.splitlines()
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        assert not lines and "kvsp bench wan: skipped:" in proc.stderr
        return
    if not lines:  # e.g. no permission for namespaces inside this container
        assert "kvsp bench wan: skipped:" in proc.stderr
    else:
        names = [json.loads(line)["name"] for line in lines]
        assert names == ["wan_moqt_first_layer", "wan_moqt_block", "wan_moqt_rate"]
    assert not {ns for ns in _netns() - before if ns.startswith("kvsp-wan-")}
