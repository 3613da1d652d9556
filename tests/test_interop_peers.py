"""The interop harness's plumbing: interpreters for peers and the loopback-only namespace."""

from __future__ import annotations

import subprocess

import pytest

from interop import peers


def test_find_interpreter_meets_the_minimum() -> None:
    try:
        python = peers.find_interpreter((3, 12))
    except peers.PeerUnavailable as exc:
        pytest.skip(f"LOUD SKIP: aiomoqt interop cannot run here: {exc}")
    out = subprocess.run([python, "-c", "import sys; print(sys.version_info >= (3, 12))"],
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "True"


def test_find_interpreter_refuses_the_impossible() -> None:
    with pytest.raises(peers.PeerUnavailable, match="99"):
        peers.find_interpreter((3, 99))


def test_isolated_namespace_has_only_loopback() -> None:
    if not peers.can_isolate():
        pytest.skip("LOUD SKIP: unshare -n needs root; third-party servers cannot be isolated here")
    out = subprocess.run(peers.isolated_command("ip -o link show"), capture_output=True, text=True,
                         check=True, timeout=30).stdout
    links = [line.split(":")[1].strip() for line in out.splitlines()]
    assert links == ["lo"]
    assert "state UNKNOWN" in out or "LOWER_UP" in out
