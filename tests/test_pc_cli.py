"""``kvsp pc`` and ``kvsp instance`` as real processes on 127.0.0.1 port 0: the instance reports
to the PC over HTTP, and the PC sees it active."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

import aiohttp

GUARD = 30.0  # a safety net against hangs, never a way to wait for something
TOKEN = "cli-pc-test-token-0123456789abcdef"


async def start(role: str, config: Path) -> tuple[asyncio.subprocess.Process, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvsp_moq", role, "--listen", "127.0.0.1:0", "--config", str(config),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None
    line = (await asyncio.wait_for(proc.stdout.readline(), GUARD)).decode()
    prefix = f"kvsp {role}: listening on "
    assert line.startswith(prefix), (line, await proc.stderr.read(4000) if proc.stderr else b"")
    return proc, line[len(prefix):].strip()


async def stop(proc: asyncio.subprocess.Process) -> int:
    if proc.returncode is None:
        proc.send_signal(signal.SIGTERM)
    return await asyncio.wait_for(proc.wait(), GUARD)


PRINCIPAL = f'[[principals]]\nname = "all"\ntoken = "{TOKEN}"\nscopes = ["*"]\nholders = ["*"]\ninstances = ["*"]\n'


async def test_kvsp_pc_and_instance(tmp_path: Path) -> None:
    (tmp_path / "pc.toml").write_text(f'[pc]\ninstance_token = "{TOKEN}"\n' + PRINCIPAL)
    pc, pc_url = await start("pc", tmp_path / "pc.toml")
    try:
        (tmp_path / "ii.toml").write_text(
            f'[instance]\npc_url = "{pc_url}"\ntoken = "{TOKEN}"\nepoch_file = "epoch"\nstatus_ttl_ms = 30000\n' + PRINCIPAL
        )
        ii, ii_url = await start("instance", tmp_path / "ii.toml")
        try:
            headers = {"Authorization": f"Bearer {TOKEN}"}
            async with aiohttp.ClientSession(headers=headers) as session:
                # the instance's first report reached the PC before it printed its URL
                async with session.get(pc_url + "instances") as resp:
                    views = (await resp.json(content_type=None))["instances"]
                assert views == [{"instance": ii_url, "epoch": 1, "state": "active", "reported": "active",
                                  "running": 0, "queued": 0, "kv_utilization": 0.0}]
                async with session.put(pc_url + "instance-state", json={"instance": ii_url, "state": "sleeping"}) as resp:
                    assert resp.status == 200 and (await resp.json(content_type=None)) == {"state": "sleeping"}
        finally:
            assert await stop(ii) == 0
    finally:
        assert await stop(pc) == 0
    assert (tmp_path / "epoch").read_text().strip() == "1"


async def test_bad_config_exits_2(tmp_path: Path) -> None:
    (tmp_path / "bad.toml").write_text("[pc]\nsleep_policy = \"sometimes\"\n")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvsp_moq", "pc", "--config", str(tmp_path / "bad.toml"),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    _, err = await asyncio.wait_for(proc.communicate(), GUARD)
    assert proc.returncode == 2
    assert err.decode().startswith(f"kvsp: invalid config {tmp_path / 'bad.toml'}: pc.sleep_policy:")


def test_the_pc_urls_and_leader_lease_keys(tmp_path: Path) -> None:
    import pytest

    from kvsp_moq.control.common.config import load_config, pc_targets
    from kvsp_moq.control.common.errors import ConfigError

    (tmp_path / "ok.toml").write_text(
        '[instance]\npc_url = "http://a/"\npc_urls = ["http://b/", "http://a/"]\npc_failover_ms = 500\n'
        '[frontend]\npc_urls = ["http://a/", "http://b/"]\n'
        '[pc]\nstore = "redis://127.0.0.1:6379/0"\nleader_lease_ms = 1500\n')
    config = load_config(tmp_path / "ok.toml")
    assert config.instance.pc_urls == ("http://b/", "http://a/") and config.instance.pc_failover_ms == 500
    assert pc_targets(config.instance.pc_url, config.instance.pc_urls) == ("http://a/", "http://b/")
    assert pc_targets(config.frontend.pc_url, config.frontend.pc_urls) == ("http://a/", "http://b/")
    assert config.frontend.pc_failover_ms == 10_000 and config.pc.leader_lease_ms == 1500
    for text, key in (('[instance]\npc_urls = "http://a/"\n', "instance.pc_urls"),
                      ('[frontend]\npc_urls = ["a"]\n', "frontend.pc_urls"),
                      ('[frontend]\npc_failover_ms = 0\n', "frontend.pc_failover_ms"),
                      ('[pc]\nleader_lease_ms = 10\n', "pc.leader_lease_ms")):
        (tmp_path / "bad.toml").write_text(text)
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(tmp_path / "bad.toml")
