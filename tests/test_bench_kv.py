"""``kvsp bench kv`` and ``kvsp bench wan`` run as real processes with small sizes: the figures
(holder in its own process, torch sink, every layer verified), a backend the transport does
not have, and the WAN bench's namespaces. Never asserts on speed."""

from __future__ import annotations

import json
import os
import re
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
    # The Mooncake peer row (tests/test_bench_kv_mooncake.py): measured, or skipped saying why.
    if "kv_mooncake_tcp_rate" in figures:
        row = figures["kv_mooncake_tcp_rate"]
        assert row["baseline_name"] == "tcp_copy" and row["params"]["transport"] == "tcp"
        assert row["baseline_value"] == figures["kv_http_rate"]["baseline_value"]
    else:
        assert "kv_mooncake_tcp skipped:" in proc.stderr


def test_bench_kv_refuses_a_backend_the_transport_lacks() -> None:
    proc = kvsp("bench", "kv", "--backend", "aioquic,no-such-quic", check=False)
    assert proc.returncode != 0
    assert "transport backend 'no-such-quic' is not available" in proc.stderr


def test_bench_kv_loads_into_the_chosen_device_or_says_why_not() -> None:
    """``--device cuda``: with a GPU, the direct MOQT figures come from a sink on the GPU (the
    load timed to its last device copy); without one, a usage error naming the cause."""
    torch = pytest.importorskip("torch")
    args = ("bench", "kv", "--layers", "2", "--repeat", "1", "--no-relay", "--no-http",
            "--device", "cuda")
    if not torch.cuda.is_available():
        proc = kvsp(*args, check=False)
        assert proc.returncode == 2 and "this torch has no CUDA device" in proc.stderr
        return
    proc = kvsp(*args)
    figures = {f["name"]: f for f in map(json.loads, proc.stdout.splitlines())}
    block = figures["kv_aioquic_dgram16384_block"]
    assert block["params"]["sink"] == "torch-cuda (pinned staging)"
    assert block["value"] > 0 and block["baseline_name"] == "tcp_copy"


def test_bench_kv_refuses_an_unknown_device() -> None:
    proc = kvsp("bench", "kv", "--device", "tpu", check=False)
    assert proc.returncode == 2 and "--device 'tpu'" in proc.stderr


def _netns() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def test_bench_wan_measures_or_says_why_not_and_leaves_no_namespace() -> None:
    """Root with iproute2: a real two-namespace path (unshaped, so neither netem nor the TUN
    shaper is needed: a bare veth pair); otherwise the skip message. Either way no namespace
    of ours is left behind. (The shaped path through the TUN shaper: tests/test_bench_wan.py.)"""
    pytest.importorskip("torch")
    proc = kvsp("bench", "wan", "--layers", "1", "--repeat", "1", "--delay-ms", "0", "--loss", "0")
    lines = proc.stdout.splitlines()
    if os.geteuid() != 0 or shutil.which("ip") is None:
        assert not lines and "kvsp bench wan: skipped:" in proc.stderr
        return
    if not lines:  # e.g. no permission for namespaces inside this container
        assert "kvsp bench wan: skipped:" in proc.stderr
    else:
        figures = [json.loads(line) for line in lines]
        assert [f["name"] for f in figures] == ["wan_moqt_first_layer", "wan_moqt_block",
                                                "wan_moqt_rate"]
        assert {f["params"]["shaper"] for f in figures} == {"none"}
        assert not set(_namespaces_named(proc.stderr)) & _netns()


def _namespaces_named(stderr: str) -> list[str]:
    """The namespaces this bench run made, as its "path up" line names them (another bench
    running on the machine at the same time has others)."""
    names = re.findall(r"\bkvsp-wan-[hl]\d+\b", stderr)
    assert len(names) == 2, stderr
    return names


def test_bench_kv_parallel_figures_beside_tcp_and_n1_of_the_same_run() -> None:
    """--parallel 2 (N = 1 added as the baseline), in-process connections and worker
    processes: each N has a rate vs the TCP copy and vs N = 1 of the same kind."""
    pytest.importorskip("torch")
    proc = kvsp("bench", "kv", "--layers", "4", "--repeat", "1", "--no-relay", "--no-http",
                "--parallel", "2", "--workers", "connections,processes")
    figures = {f["name"]: f for f in map(json.loads, proc.stdout.splitlines())}
    for kind in ("connections", "processes"):
        for n in (1, 2):
            name = f"kv_aioquic_dgram16384_par{n}_{kind}"
            rate, vs1 = figures[f"{name}_rate"], figures[f"{name}_vs_par1"]
            assert rate["baseline_name"] == "tcp_copy" and rate["value"] > 0
            assert vs1["baseline_name"] == f"kv_aioquic_dgram16384_par1_{kind}_rate"
            assert vs1["baseline_value"] == figures[vs1["baseline_name"]]["value"]
            assert rate["params"]["parallel"] == n and rate["params"]["workers"] == kind
            assert figures[f"{name}_first_layer"]["baseline_name"] == "tcp_first_layer"


def test_bench_kv_parallel_from_several_holder_processes() -> None:
    """--holders 2: two holder processes serve replicas of the block, the figures carry
    ``_h2`` and say how many holders served them; --holders without --parallel is refused."""
    pytest.importorskip("torch")
    proc = kvsp("bench", "kv", "--layers", "4", "--repeat", "1", "--no-relay", "--no-http",
                "--parallel", "2", "--holders", "2")
    figures = {f["name"]: f for f in map(json.loads, proc.stdout.splitlines())}
    for n in (1, 2):
        rate = figures[f"kv_aioquic_dgram16384_par{n}_connections_h2_rate"]
        assert rate["params"]["holders"] == 2 and rate["value"] > 0
        assert figures[f"kv_aioquic_dgram16384_par{n}_connections_h2_vs_par1"][
            "baseline_name"] == "kv_aioquic_dgram16384_par1_connections_h2_rate"
    refused = kvsp("bench", "kv", "--holders", "2", check=False)
    assert refused.returncode == 2 and "--holders" in refused.stderr


def test_bench_kv_refuses_unknown_workers() -> None:
    proc = kvsp("bench", "kv", "--parallel", "2", "--workers", "threads", check=False)
    assert proc.returncode != 0 and "--workers 'threads'" in proc.stderr


def test_bench_relay_reports_fanout_against_one_subscriber_on_the_chosen_backend() -> None:
    """``kvsp bench relay --backend native`` (issue 28): every endpoint, the relay process
    included, on the chosen backend; the fan-out rows carry the CPU the relay and the bench
    process spent per GiB delivered; the relay's cold and warm FETCH rates stand beside the
    same FETCH straight from the publisher."""
    from kvsp_moq.transport import native

    if not native.available():
        pytest.skip(f"the native backend is not built here: {native.unavailable_reason()}")
    proc = kvsp("bench", "relay", "--backend", "native", "--run-mib", "1", "--object-kib", "64", "--repeat", "1")
    figures = {f["name"]: f for f in map(json.loads, proc.stdout.splitlines())}
    one, eight, scaling = (figures[n] for n in ("relay_fanout_1_delivered", "relay_fanout_8_delivered", "relay_fanout_8_vs_1"))
    assert {f["params"]["backend"] for f in (one, eight, scaling)} == {"native"}
    assert (scaling["value"], scaling["baseline_name"], scaling["baseline_value"]) == \
        (eight["value"], "relay_fanout_1_delivered", one["value"])
    for fig in (one, eight):
        # 1 MiB runs: the relay's /proc figure counts 10 ms clock ticks, and may be 0
        assert fig["params"]["relay_cpu_s_per_gib"] >= 0 and fig["params"]["bench_process_cpu_s_per_gib"] > 0
    assert figures["relay_fetch_warm_cache"]["baseline_name"] == "relay_fetch_cold_cache"
    cold, warm = figures["relay_fetch_cold_rate"], figures["relay_fetch_warm_rate"]
    assert cold["baseline_name"] == warm["baseline_name"] == "direct_fetch_rate"
    assert cold["baseline_value"] == warm["baseline_value"] > 0
    refused = kvsp("bench", "relay", "--backend", "nonesuch", check=False)
    assert refused.returncode == 2 and "unknown transport backend" in refused.stderr


def test_bench_relay_with_each_subscriber_in_its_own_process() -> None:
    """``--subscriber-processes``: the N subscribers are N processes (each checks the bytes it
    got by SHA-256; a mismatch fails the bench), and the figures say so."""
    proc = kvsp("bench", "relay", "--run-mib", "1", "--object-kib", "64", "--repeat", "1",
                "--subscriber-processes")
    figures = {f["name"]: f for f in map(json.loads, proc.stdout.splitlines())}
    for n in (1, 4, 8):
        fig = figures[f"relay_fanout_{n}_delivered"]
        assert fig["params"]["subscribers_in"] == "own processes" and fig["value"] > 0
    assert figures["relay_fanout_8_vs_1"]["baseline_name"] == "relay_fanout_1_delivered"


def test_bench_live_refuses_bad_arguments_before_anything_starts() -> None:
    proc = kvsp("bench", "live", "--layers", "0", check=False)
    assert proc.returncode == 2 and "--layers and --repeat must be >= 1" in proc.stderr
