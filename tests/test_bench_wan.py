"""The userspace WAN shaper of ``kvsp bench wan`` (``--shaper tun``), for kernels without
``sch_netem``: its delay line alone (netem's delay / loss / limit, pure), the shaper process
between two real network namespaces (UDP probes both ways), and the bench through it, which
leaves no namespace, TUN device or process behind, interrupted or not.

Real processes and devices, no mocks; no sleeps (each step waits on a line or an exit) and no
assertion on speed: the one-way time is checked as a lower bound (the delay is applied)."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvsp_moq.cli.bench.wan.netem import DelayLine
from netns_support import two_namespaces
from test_cli import kvsp

PROBE = str(Path(__file__).with_name("_wan_probe.py"))
A_IP, B_IP = "10.211.0.1", "10.211.0.2"
PACKET = 92  # the probe's IPv4 packet: 20 IP + 8 UDP + 64 payload

needs_tun = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or not os.path.exists("/dev/net/tun"),
    reason="needs root, iproute2 and /dev/net/tun (network namespaces and TUN devices)")


# -- the delay line alone (netem semantics, no devices) --------------------------------------

def test_delay_line_holds_each_packet_for_the_delay_in_order() -> None:
    line = DelayLine(0.020, 0, limit=10, seed=1)
    line.offer(b"a", 1.000)
    line.offer(b"b", 1.005)
    assert line.pop_due(1.0199) == [] and line.next_due() == pytest.approx(1.020)
    assert line.pop_due(1.020) == [b"a"]
    assert line.pop_due(1.030) == [b"b"] and line.next_due() is None
    assert line.counters.as_dict() == {"packets_in": 2, "bytes_in": 2, "forwarded": 2,
                                       "bytes_forwarded": 2, "dropped_loss": 0,
                                       "dropped_limit": 0, "late_ms_mean": 2.5,
                                       "late_ms_max": 5.0,  # b left 5 ms after its due time
                                       "queue_ms_max": 0.0}  # no rate: no queueing


def test_delay_line_tail_drops_beyond_its_limit() -> None:
    line = DelayLine(0.010, 0, limit=3, seed=1)
    for i in range(5):
        line.offer(bytes([i]), 0.0)
    assert len(line) == 3 and line.counters.dropped_limit == 2
    assert line.pop_due(0.010) == [b"\x00", b"\x01", b"\x02"]
    line.offer(b"x", 0.011)  # room again
    assert len(line) == 1 and line.counters.dropped_limit == 2


def test_delay_line_loss_is_seeded_bernoulli() -> None:
    def dropped(seed: int, loss: float) -> list[int]:
        line = DelayLine(0, loss, limit=100_000, seed=seed)
        out = []
        for i in range(10_000):
            before = line.counters.dropped_loss
            line.offer(b"p", 0.0)
            if line.counters.dropped_loss > before:
                out.append(i)
        return out

    assert dropped(7, 10) == dropped(7, 10) != dropped(8, 10)  # replayable, seed-dependent
    n, p = 10_000, 0.10
    assert abs(len(dropped(7, 10)) - n * p) <= 6 * math.sqrt(n * p * (1 - p))
    assert dropped(7, 0) == [] and len(dropped(7, 100)) == n


def test_delay_line_refuses_impossible_settings() -> None:
    for args in ((-1.0, 0.0, 10), (0.0, 101.0, 10), (0.0, 0.0, 0)):
        with pytest.raises(ValueError):
            DelayLine(*args, seed=1)
    with pytest.raises(ValueError):
        DelayLine(0.0, 0.0, 10, seed=1, rate=-1.0)


def test_delay_line_rate_serializes_packets_behind_each_other() -> None:
    """netem's ``rate``: at 1000 octets/s a 100-octet packet takes 0.1 s on the link, the
    next one waits for it, then both take the delay; the queueing is counted."""
    line = DelayLine(0.010, 0, limit=10, seed=1, rate=1000.0)
    line.offer(b"a" * 100, 1.0)
    line.offer(b"b" * 100, 1.0)
    assert line.next_due() == pytest.approx(1.110)
    assert line.pop_due(1.1099) == [] and line.pop_due(1.110) == [b"a" * 100]
    assert line.next_due() == pytest.approx(1.210)  # behind a on the link
    assert line.counters.queue_s_max == pytest.approx(0.2)
    line.offer(b"c" * 100, 5.0)  # an idle link: no wait behind anything
    assert line.pop_due(1.2101) == [b"b" * 100] and line.next_due() == pytest.approx(5.110)


# -- the shaper process between two namespaces ------------------------------------------------

def _namespaces_named(stderr: str) -> list[str]:
    """The namespaces this bench run made, as its "path up" line names them (another bench
    running on the machine at the same time has others)."""
    names = re.findall(r"\bkvsp-wan-[hl]\d+\b", stderr)
    assert len(names) == 2, stderr
    return names


def _netns() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _live_shaper_tags() -> set[str]:
    """The device tags (``pid % 100000``, shaper.py) of the TUN shapers running now."""
    tags = set()
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes() if entry.name.isdigit() else b""
        except OSError:
            continue
        if b"kvsp_moq.cli.bench.wan.shaper" in cmdline:
            tags.add(str(int(entry.name) % 100_000))
    return tags


def _tun_devices() -> set[str]:
    """The shapers' TUN devices (``kvtun{tag}a``/``b``) in this namespace, except those of a
    shaper still running: another test's (tests/test_bbr_transfer.py runs beside this module)."""
    out = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout
    devices = {line.split()[0].split("@")[0] for line in out.splitlines() if line.startswith("kvtun")}
    live = _live_shaper_tags()
    return {d for d in devices if d.removeprefix("kvtun")[:-1] not in live}


@pytest.fixture
def namespaces() -> Iterator[tuple[str, str]]:
    with two_namespaces("kvsp-test-") as names:
        yield names


def _in(ns: str, *args: str, **kw: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, *args],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, **kw)


def _line(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    return proc.stdout.readline()


@needs_tun
def test_shaper_delays_loses_and_keeps_order_both_ways(namespaces: tuple[str, str]) -> None:
    """2000 UDP datagrams each way across the shaper (5 ms, 10 % loss): the loss is within a
    binomial tolerance, the order is kept, every delivered datagram took at least 5 ms, and
    the shaper's counters are what the two ends saw."""
    ns_a, ns_b = namespaces
    count, delay_ms, loss = 2000, 5.0, 10.0
    shaper = subprocess.Popen(
        [sys.executable, "-m", "kvsp_moq.cli.bench.wan.shaper", "--ns-a", ns_a, "--addr-a", A_IP,
         "--ns-b", ns_b, "--addr-b", B_IP, "--delay-ms", str(delay_ms), "--loss", str(loss),
         "--limit", "10000", "--seed", "3"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    procs = [shaper]
    try:
        ready = json.loads(_line(shaper))
        assert ready["ready"] and ready["delay_ms"] == delay_ms
        # receivers: at a (from b) and at b (from a)
        recv = {"b_to_a": _in(ns_a, PROBE, "recv", A_IP, "9000"),
                "a_to_b": _in(ns_b, PROBE, "recv", B_IP, "9000")}
        procs += recv.values()
        assert all(_line(p) == "ready\n" for p in recv.values())
        senders = [_in(ns_b, PROBE, "send", A_IP, "9000", str(count)),
                   _in(ns_a, PROBE, "send", B_IP, "9000", str(count))]
        procs += senders
        assert [p.wait(60) for p in senders] == [0, 0]
        # The senders are done: every datagram is at least in its device's queue, which the
        # shaper reads out before it stops (stdin closed), then drains, reports and exits.
        out, _ = shaper.communicate(timeout=60)
        assert shaper.returncode == 0
        counters = json.loads(out)
        seen = {}
        for direction, proc in recv.items():  # each reads until it has what was forwarded
            got, _ = proc.communicate(f"{counters[direction]['forwarded']}\n", timeout=60)
            seen[direction] = json.loads(got)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert not _tun_devices() & set(ready["devices"].values())  # gone with the shaper
    sd = math.sqrt(count * loss / 100 * (1 - loss / 100))
    for direction, got in seen.items():
        c = counters[direction]
        assert c["packets_in"] == count and c["bytes_in"] == count * PACKET, (direction, counters)
        assert c["tun_tx_dropped"] == 0 and c["write_errors"] == 0 and c["dropped_limit"] == 0
        assert c["forwarded"] + c["dropped_loss"] == count
        assert c["forwarded"] == len(got) and c["bytes_forwarded"] == len(got) * PACKET
        assert abs(c["dropped_loss"] - count * loss / 100) <= 6 * sd, c
        seqs = [seq for seq, _, _ in got]
        assert seqs == sorted(set(seqs)), "reordered or duplicated"
        assert min(received - sent for _, sent, received in got) >= delay_ms * 1e6


# -- the bench through it ---------------------------------------------------------------------

@needs_tun
def test_bench_wan_through_the_tun_shaper_leaves_nothing_behind() -> None:
    """``--shaper tun``: the MOQT figures against HTTP over TCP on the same shaped path, once
    per QUIC congestion controller (``--congestion-control reno,bbr``), and with ``--codec``
    the effective rate of a codec beside raw HTTP, with the shaper's
    counters, TCP's congestion control (here one set for the run) and the QUIC one in the
    params; afterwards no namespace and no TUN device of the run remain."""
    pytest.importorskip("torch")
    proc = kvsp("bench", "wan", "--shaper", "tun", "--layers", "1", "--delay-ms", "5",
                "--loss", "0.5", "--repeat", "1", "--tcp-cc", "reno",
                "--congestion-control", "reno,bbr", "--codec", "fp8-e4m3")
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    # --codec: the block in fp8-e4m3 from the transcoding holder, decoded, beside raw HTTP
    (coded,) = [f for f in lines if f["name"].startswith("wan_codec_")]
    (moqt_coded,) = [f for f in lines if f["name"].startswith("wan_moqt_codec_")]
    lines = [f for f in lines if f is not coded and f is not moqt_coded]
    assert coded["name"] == "wan_codec_fp8-e4m3_rate" and coded["baseline_name"] == "wan_http_rate"
    assert coded["value"] > 0 and coded["baseline_value"] > 0
    assert coded["params"]["ratio_on_wire"] > 1.9 and coded["params"]["raw_bytes"] == 1 << 20
    assert coded["params"]["tcp_congestion_control"] == "reno"
    # and over MOQT: the fp8-e4m3 track through the transcoding relay at the holder's end,
    # decoded, beside the same raw HTTP load, on the first --congestion-control
    assert moqt_coded["name"] == "wan_moqt_codec_fp8-e4m3_rate" and moqt_coded["baseline_name"] == "wan_http_rate"
    assert moqt_coded["value"] > 0 and moqt_coded["baseline_value"] == coded["baseline_value"]
    assert moqt_coded["params"]["ratio_on_wire"] > 1.9 and moqt_coded["params"]["moqt_raw_rate"] > 0
    assert moqt_coded["params"]["congestion_control"] == "reno"
    by_cc: dict[str, dict[str, Any]] = {}
    for fig in lines:  # one set of figures per QUIC controller, on the same path
        by_cc.setdefault(fig["params"]["congestion_control"], {})[fig["name"]] = fig
    assert list(by_cc) == ["reno", "bbr"]
    for figures in by_cc.values():
        assert list(figures) == ["wan_moqt_first_layer", "wan_moqt_block", "wan_moqt_rate"]
        for name, fig in figures.items():
            assert fig["baseline_name"] == name.replace("moqt", "http") and fig["value"] > 0
            params = fig["params"]
            assert params["shaper"] == "tun" and params["delay_ms_each_way"] == 5.0
            assert params["tcp_congestion_control"] == "reno"  # set in the namespaces only
    # one HTTP load per path: both controllers' figures have the same baseline
    assert by_cc["reno"]["wan_moqt_rate"]["baseline_value"] == by_cc["bbr"]["wan_moqt_rate"]["baseline_value"]
    counters = by_cc["bbr"]["wan_moqt_block"]["params"]["shaper_counters"]
    for c in counters.values():  # every packet accounted for
        assert c["packets_in"] == c["forwarded"] + c["dropped_loss"] + c["dropped_limit"]
    # every transfer (a 1 MiB block, twice per controller: warm-up and the timed run, and
    # twice over HTTP) crossed the shaper
    assert counters["holder_to_loader"]["bytes_forwarded"] > (2 * 2 + 2) * (1 << 20)
    assert not set(_namespaces_named(proc.stderr)) & _netns()
    assert not _tun_devices()


def test_bench_wan_into_a_numpy_sink_needs_no_torch() -> None:
    """``--sink numpy``: the loader verifies into numpy arrays (a Python without torch, such
    as one only the aiopquic backend runs on), and the params say so."""
    proc = kvsp("bench", "wan", "--shaper", "tun", "--layers", "1", "--delay-ms", "2",
                "--loss", "0", "--repeat", "1", "--sink", "numpy")
    figures = {f["name"]: f for f in map(json.loads, proc.stdout.splitlines())}
    assert figures["wan_moqt_rate"]["params"]["sink"] == "numpy"
    assert figures["wan_moqt_rate"]["baseline_name"] == "wan_http_rate"
    assert not _tun_devices()


def _processes_in(inodes: set[int]) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            link = os.readlink(entry / "ns" / "net") if entry.name.isdigit() else ""
        except OSError:
            continue
        if link and int(link[link.index("[") + 1:-1]) in inodes:
            pids.append(int(entry.name))
    return pids


@needs_tun
def test_bench_wan_interrupted_leaves_no_namespace_device_or_process() -> None:
    """SIGTERM to the bench once its path is up: it exits, and its namespaces, the TUN
    devices, the shaper and the processes it started in the namespaces are all gone."""
    pytest.importorskip("torch")
    script = shutil.which("kvsp", path=str(Path(sys.executable).parent))
    cmd = [script] if script else [sys.executable, "-m", "kvsp_moq"]
    bench = subprocess.Popen([*cmd, "bench", "wan", "--shaper", "tun", "--layers", "8",
                              "--repeat", "3"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        assert bench.stderr is not None
        line = ""
        for line in bench.stderr:  # whatever it says first (warnings), up to the path
            if line.startswith("kvsp bench wan: "):
                break
        assert line.startswith("kvsp bench wan: path up (tun)"), line
        namespaces = line.split(": ")[2].split(",")[0].split(" <-> ")
        inodes = {os.stat(f"/run/netns/{ns}").st_ino for ns in namespaces}
        bench.send_signal(signal.SIGTERM)
        bench.communicate(timeout=120)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
    assert bench.returncode == 128 + signal.SIGTERM
    assert not set(namespaces) & _netns()
    assert not _tun_devices()
    assert not _processes_in(inodes)
