"""``kvsp demo --dashboard`` as a real process: after its report it prints the dashboard's URL
and leaves the cluster up; the page and its JSON answer there (the two instances, the sessions'
blocks at the IS); SIGINT (Ctrl-C) then stops everything and the command exits 0. And
``kvsp dashboard`` itself: a bad ``--listen`` is a one-line ``kvsp: ...`` error with status 2."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvsp_moq.cli.demo.cluster import http_request

pytest.importorskip("torch")

GUARD = 240.0  # a safety net against hangs, never a way to wait for something


async def test_demo_dashboard_stays_up_until_ctrl_c(tmp_path: Path) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvsp_moq", "demo", "--json", "--dashboard", "--model-dir", str(tmp_path / "model"),
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    stderr_task = asyncio.ensure_future(proc.stderr.read())
    try:
        async with asyncio.timeout(GUARD):
            report = json.loads(await proc.stdout.readline())  # the report comes first
            line = (await proc.stdout.readline()).decode()
        assert report["ok"] is True
        m = re.fullmatch(r"kvsp demo: dashboard on (http://127\.0\.0\.1:\d+/)\n", line)
        assert m, line
        url = m.group(1)
        page = await http_request(url)
        assert page.status == 200 and b"KVSP dashboard" in page.body
        assert page.headers["content-type"].startswith("text/html")
        snap = (await http_request(f"{url}api/snapshot")).json()
        assert snap["errors"] == []
        assert sorted(i["state"] for i in snap["instances"]) == ["active", "sleeping"]
        assert snap["relay"]["objects_out"] > 0 and snap["index"]["replica_records"] > 0
        assert snap["hit"]["ratio"] == pytest.approx(report["hit_ratio"], abs=1e-4)
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGINT)
        async with asyncio.timeout(GUARD):
            status = await proc.wait()
            stderr = (await stderr_task).decode()
    assert status == 0, stderr
    assert "dashboard stopped: clean shutdown" in stderr
    for server in report["servers"]:  # the relay and the instances are child processes: gone
        if "pid" in server:
            with pytest.raises(ProcessLookupError):
                os.kill(server["pid"], 0)


def test_dashboard_bad_listen_is_one_line() -> None:
    proc = subprocess.run([sys.executable, "-m", "kvsp_moq", "dashboard", "--pc", "http://127.0.0.1:1/",
                           "--listen", "nowhere"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.startswith("kvsp: --listen must be HOST:PORT") and proc.stderr.count("\n") == 1
