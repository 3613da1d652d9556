"""``--qlog DIR`` on ``kvsp relay`` and ``kvsp moq publish|fetch``, as real processes on
loopback (docs/tracing.md): a block of objects published through the relay and fetched back
leaves one parseable qlog file per connection at each end: the publisher's and the fetcher's
client file, and the relay's server file of each, with the same ODCIDs; nothing without the
flag."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
from pathlib import Path

KVSP = [sys.executable, "-m", "kvsp_moq"]
GUARD = 60.0  # a safety net against hangs, never a way to wait for something


async def _line(proc: asyncio.subprocess.Process, pattern: str) -> re.Match[str]:
    """Read the process's stdout+stderr (merged) until a line matches ``pattern``."""
    assert proc.stdout is not None
    while True:
        line = (await asyncio.wait_for(proc.stdout.readline(), GUARD)).decode()
        assert line, f"exited before printing {pattern!r}"
        if m := re.search(pattern, line):
            return m


async def _stop(proc: asyncio.subprocess.Process) -> None:
    proc.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(proc.wait(), GUARD) == 0


def _odcids(directory: Path, vantage: str) -> list[str]:
    out = []
    for path in sorted(directory.iterdir()):
        document = json.loads(path.read_text())
        assert document["qlog_format"] == "JSON" and document["qlog_version"] == "0.3"
        (trace,) = document["traces"]
        assert trace["vantage_point"]["type"] == vantage
        names = {e["name"] for e in trace["events"]}
        assert {"transport:packet_sent", "transport:packet_received"} <= names
        assert path.name == f"{trace['common_fields']['ODCID']}_{vantage}.qlog"
        out.append(trace["common_fields"]["ODCID"])
    return out


async def _run_through_relay(tmp_path: Path, qlog: bool) -> tuple[Path, Path, Path]:
    relay_dir, pub_dir, fetch_dir = tmp_path / "relay", tmp_path / "pub", tmp_path / "fetch"
    flag = (lambda d: ["--qlog", str(d)]) if qlog else (lambda d: [])
    data = tmp_path / "data.bin"
    data.write_bytes(os.urandom(3 * 50_000))
    relay = await asyncio.create_subprocess_exec(
        *KVSP, "relay", "--listen", "127.0.0.1:0", *flag(relay_dir), stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT, cwd=tmp_path)
    try:
        url = (await _line(relay, r"relay listening on (moqt://\S+)")).group(1)
        pub = await asyncio.create_subprocess_exec(
            *KVSP, "moq", "publish", url, "qlog-test", "raw", "--file", str(data), "--object-size", "50000",
            "--insecure", "--linger", "600", *flag(pub_dir), stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT, cwd=tmp_path)
        try:
            await _line(pub, r"published 3 objects")
            fetch = await asyncio.create_subprocess_exec(
                *KVSP, "moq", "fetch", url, "qlog-test", "raw", "--insecure", *flag(fetch_dir),
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=tmp_path)
            out, err = await asyncio.wait_for(fetch.communicate(), GUARD)
            assert fetch.returncode == 0, err.decode()
            assert len(out.decode().splitlines()) == 3
        finally:
            await _stop(pub)
    finally:
        await _stop(relay)
    return relay_dir, pub_dir, fetch_dir


async def test_qlog_on_relay_publisher_and_fetcher(tmp_path: Path) -> None:
    relay_dir, pub_dir, fetch_dir = await _run_through_relay(tmp_path, qlog=True)
    (published,) = _odcids(pub_dir, "client")
    (fetched,) = _odcids(fetch_dir, "client")
    assert sorted(_odcids(relay_dir, "server")) == sorted([published, fetched])


async def test_no_qlog_without_the_flag(tmp_path: Path) -> None:
    await _run_through_relay(tmp_path, qlog=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.bin"]
