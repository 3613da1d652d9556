"""``kvsp bench moqt --url https://...``: WebTransport throughput beside raw QUIC in one run
(issue 20). Checks the figures' names and baselines, never their speed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvsp_moq", "bench", "moqt", *args],
                          capture_output=True, text=True, timeout=300)


def test_webtransport_figures_beside_raw_quic() -> None:
    proc = bench("--url", "https://127.0.0.1:0/bench", "--block-mib", "2", "--datagram-size", "16384",
                 "--repeat", "1")
    assert proc.returncode == 0, proc.stderr
    figs = {f["name"]: f for f in map(json.loads, proc.stdout.splitlines())}
    assert set(figs) == {"moqt_block_dgram16384", "moqt_first_object_dgram16384",
                         "moqt_wt_block_dgram16384", "moqt_wt_first_object_dgram16384"}
    assert figs["moqt_block_dgram16384"]["baseline_name"] == "tcp_copy"
    for kind in ("block", "first_object"):
        wt, quic = figs[f"moqt_wt_{kind}_dgram16384"], figs[f"moqt_{kind}_dgram16384"]
        assert wt["baseline_name"] == quic["name"] and wt["baseline_value"] == quic["value"]
        assert wt["value"] > 0 and wt["ratio"] == pytest.approx(wt["value"] / wt["baseline_value"], rel=1e-3)
        assert wt["params"]["max_datagram_size"] == 16384


def test_a_bad_url_is_a_usage_error() -> None:
    proc = bench("--url", "http://127.0.0.1:0/bench", "--block-mib", "1")
    assert proc.returncode == 2 and "--url" in proc.stderr and proc.stdout == ""
