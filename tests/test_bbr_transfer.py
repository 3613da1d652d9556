"""BBR (``congestion_control_algorithm="bbr"``, aioquic) in real transfers across the TUN shaper
between two network namespaces: a sender process in one (``_bbr_peer.py send``), a receiver
process in the other, the shaper's netem delay / loss / rate between them. Checked from what
the receiver got (every octet, by SHA-256), from the sender's controller state
(``Connection.congestion_state``) and from the shaper's counters; no sleeps (each step waits
for a line or an exit, bounded) and no timed assertion.

Needs root, iproute2 and /dev/net/tun (CI runs as root); skipped otherwise, as
tests/test_bench_wan.py is."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from netns_support import two_namespaces

PEER = str(Path(__file__).with_name("_bbr_peer.py"))
SENDER_IP, RECEIVER_IP = "10.213.0.1", "10.213.0.2"
PORT = 4433

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or not os.path.exists("/dev/net/tun"),
    reason="needs root, iproute2 and /dev/net/tun (network namespaces and TUN devices)")


@pytest.fixture(scope="module")
def namespaces() -> Iterator[tuple[str, str]]:
    with two_namespaces("kvsp-bbr-") as names:
        yield names


@contextmanager
def _shaped(namespaces: tuple[str, str], *, delay_ms: float, loss: float, rate_mbit: float = 0,
            limit: int = 10_000) -> Iterator[dict[str, Any]]:
    """The shaper between the namespaces; on exit its stdin is closed, it drains and its
    counters (per direction) are put in the yielded dict under ``counters``."""
    ns_s, ns_r = namespaces
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvsp_moq.cli.bench.wan.shaper", "--ns-a", ns_s, "--addr-a",
         SENDER_IP, "--ns-b", ns_r, "--addr-b", RECEIVER_IP, "--delay-ms", str(delay_ms),
         "--loss", str(loss), "--rate-mbit", str(rate_mbit), "--limit", str(limit),
         "--seed", "5"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    out: dict[str, Any] = {}
    try:
        assert proc.stdout is not None
        assert json.loads(proc.stdout.readline())["ready"]
        yield out
        report, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0
        out["counters"] = json.loads(report)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _host_drops(namespaces: tuple[str, str]) -> int:
    """UDP datagrams the two namespaces' kernels dropped at a full socket receive buffer so far
    (``Udp: RcvbufErrors`` of each one's /proc/net/snmp): a peer process that a loaded machine
    did not schedule in time loses packets beyond the shaper's, which a congestion controller is
    right to read as congestion."""
    total = 0
    for ns in namespaces:
        snmp = subprocess.run(["ip", "netns", "exec", ns, "cat", "/proc/net/snmp"], check=True,
                              capture_output=True, text=True).stdout.splitlines()
        names, values = [line.split()[1:] for line in snmp if line.startswith("Udp:")][:2]
        total += int(dict(zip(names, values, strict=True))["RcvbufErrors"])
    return total


def _transfer(namespaces: tuple[str, str], cc: str, size: int,
              connections: int = 1) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``connections`` concurrent transfers of ``size`` octets, sender to receiver; the
    receiver's report (with ``sent_sha256``: the sender's digest of what it sends) and the
    sender's lines (one per connection, in the order they ended)."""
    ns_s, ns_r = namespaces
    sender = subprocess.Popen(
        ["ip", "netns", "exec", ns_s, sys.executable, PEER, "send", SENDER_IP, str(PORT), cc,
         str(size)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert sender.stdout is not None
        ready = json.loads(sender.stdout.readline())
        assert ready["ready"]
        received = subprocess.run(
            ["ip", "netns", "exec", ns_r, sys.executable, PEER, "recv",
             f"moqt://{SENDER_IP}:{PORT}", str(connections)],
            capture_output=True, text=True, timeout=180)
        assert received.returncode == 0, received.stderr[-3000:]
        # the receiver has everything: closing the sender's stdin ends it once its
        # connections have reported (each reports when its bytes are acknowledged or closed)
        lines, _ = sender.communicate(timeout=60)
    finally:
        if sender.poll() is None:
            sender.kill()
            sender.wait()
    report = {**json.loads(received.stdout), "sent_sha256": ready["sha256"]}
    return report, [json.loads(line) for line in lines.splitlines()]


def test_bbr_completes_under_random_loss_without_reading_it_as_congestion(
        namespaces: tuple[str, str]) -> None:
    """5 ms and 0.5 % loss each way, 6 MB: every octet arrives; the sender lost packets, yet
    no round trip's loss was over the threshold, so the window was never bounded by loss.

    0.5 %, a quarter of BBR's 2 % threshold: at 1 % a round trip of a few hundred packets (what
    a loaded machine's longer RTT makes of this path) loses over 2 % by chance a few times in a
    hundred rounds, which BBR is right to read as congestion (seen here: one round in ~12)."""
    size = 6_000_000
    before = _host_drops(namespaces)
    with _shaped(namespaces, delay_ms=5, loss=0.5) as shaper:
        got, sent = _transfer(namespaces, "bbr", size)
    assert got["bytes"] == [size] and got["sha256"] == [got["sent_sha256"]]
    state = sent[0]["state"]
    assert state["algorithm"] == "bbr" and state["full_bw_reached"]
    assert state["lost_bytes"] > 0  # the path did lose packets (and they were resent)
    counters = shaper["counters"]
    assert counters["a_to_b"]["dropped_loss"] > 0
    # Only the path's random loss is never congestion: the hosts' own drops (a socket buffer
    # overrun while a loaded machine did not schedule a peer, a TUN queue the shaper did not
    # read in time) are a real bottleneck, which BBR may answer.
    host = (_host_drops(namespaces) - before
            + sum(counters[d]["tun_tx_dropped"] for d in ("a_to_b", "b_to_a")))
    assert host > 0 or (state["excessive_loss_rounds"] == 0 and state["inflight_hi"] is None), state


def test_bbr_backs_off_on_a_real_bottleneck(namespaces: tuple[str, str]) -> None:
    """A 16 Mbit/s link with a 1000-packet buffer (~0.7 s of queue at that rate, which a
    window that grows until a drop fills): BBR's bandwidth estimate is the link's, its window
    stays a few BDPs (Startup's overshoot included) and ends near gain x BDP plus the ACK
    aggregation it measured, the queue stays a fraction of the buffer, nothing is dropped."""
    size, rate_mbit, delay_ms = 3_000_000, 16.0, 10.0
    rate = rate_mbit * 1e6 / 8
    before = _host_drops(namespaces)
    with _shaped(namespaces, delay_ms=delay_ms, loss=0, rate_mbit=rate_mbit,
                 limit=1000) as shaper:
        got, sent = _transfer(namespaces, "bbr", size)
    assert got["bytes"] == [size] and got["sha256"] == [got["sent_sha256"]]
    state = sent[0]["state"]
    forward = shaper["counters"]["a_to_b"]
    assert forward["dropped_limit"] == 0
    assert state["lost_bytes"] == 0 or _host_drops(namespaces) > before, state  # (the first test's note)
    # the estimate is of QUIC bytes (IP packets carry a little more); a burst of ACKs can
    # make one sample over-read by a few per cent
    assert 0.6 * rate <= state["max_bw"] <= 1.25 * rate
    bdp = rate * 2 * delay_ms / 1e3
    assert state["min_rtt"] >= 2 * delay_ms / 1e3  # the path's delay is a floor
    assert state["max_congestion_window"] <= 8 * bdp < 1000 * 1480 / 4
    # at the end the window is the model's (ProbeBW: 2 x its BDP + the ACK aggregation it
    # measured), not the path's: on a loaded machine min_rtt carries scheduling delay
    assert state["congestion_window"] <= 2 * state["bdp"] + state["extra_acked"] + 3 * 1452 + 1
    assert forward["queue_ms_max"] <= 0.25 * 1000 * 1480 / rate * 1e3


def test_two_bbr_flows_share_a_bottleneck(namespaces: tuple[str, str]) -> None:
    """Two concurrent transfers of the same size through one 16 Mbit/s link: when the first
    ends, the other has delivered at least half as much (a fair share within 2x, by bytes);
    the queue they build together stays a fraction of the buffer."""
    size = 3_000_000
    with _shaped(namespaces, delay_ms=10, loss=0, rate_mbit=16.0, limit=1000) as shaper:
        got, sent = _transfer(namespaces, "bbr", size, connections=2)
    assert got["bytes"] == [size, size] and got["sha256"] == [got["sent_sha256"]] * 2
    first, second = sent
    other = next(iter(first["others"].values()))  # the second's delivered bytes by then
    assert other is not None and other >= 0.5 * first["state"]["delivered"], sent
    forward = shaper["counters"]["a_to_b"]
    assert forward["dropped_limit"] == 0
    assert forward["queue_ms_max"] <= 0.25 * 1000 * 1480 / 2e6 * 1e3
