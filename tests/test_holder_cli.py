"""``kvsp holder`` (cli_holder.register_cli) and the ``[holder]`` configuration section."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path

import aiohttp
import pytest

from kvsp_moq.control.common.config import load_config
from kvsp_moq.control.common.errors import ConfigError
from kvsp_moq.control.holder import cli as cli_holder

TOKEN = "tok-cli-client-xxxxxxxxxxxxxxxxxx"
SCOPE = "a1" * 16

CONFIG = f"""
[holder]
record_ttl_ms = 30000
max_lease_ttl_ms = 5000
tiers = [{{kind = "host", capacity = 1048576}}, {{kind = "disk", path = "blocks", capacity = 4194304}}]

[[principals]]
name = "client"
token = "{TOKEN}"
scopes = ["{SCOPE}"]
"""


def test_holder_section_is_read(tmp_path: Path) -> None:
    path = tmp_path / "kvsp.toml"
    path.write_text(CONFIG)
    config = load_config(path)
    assert config.holder.record_ttl_ms == 30_000 and config.holder.refresh_ms == 10_000
    assert [t.kind for t in config.holder.tiers] == ["host", "disk"]
    assert config.holder.tiers[1].path == str(tmp_path / "blocks")
    for bad in ("[holder]\nbogus = 1\n", "[holder]\ntiers = [{kind = \"tape\", capacity = 1}]\n",
                "[holder]\ntiers = [{kind = \"disk\", capacity = 1}]\n", "[holder]\nurl = \"not a url\"\n",
                "[holder]\nmax_lease_ttl_ms = 0\n"):
        path.write_text(bad)
        with pytest.raises(ConfigError):
            load_config(path)


def test_register_cli() -> None:
    parser = argparse.ArgumentParser(prog="kvsp")
    cli_holder.register_cli(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["holder", "--listen", "127.0.0.1:0", "--config", "x.toml"])
    assert args.handler is cli_holder.run_holder and args.listen == "127.0.0.1:0"


async def test_kvsp_holder_serves_until_sigterm(tmp_path: Path) -> None:
    path = tmp_path / "kvsp.toml"
    path.write_text(CONFIG)
    script = (
        "import argparse, sys; from kvsp_moq.control.holder import cli as cli_holder; p = argparse.ArgumentParser(); "
        "cli_holder.register_cli(p.add_subparsers()); a = p.parse_args(sys.argv[1:]); sys.exit(a.handler(a))"
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, "holder", "--listen", "127.0.0.1:0", "--config", str(path),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()  # type: ignore[union-attr]
        assert line.startswith("kvsp holder: listening on http://127.0.0.1:")
        url = line.split()[-1]
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{url}blocks/{'00' * 32}/{SCOPE}/{'11' * 32}", headers={"Authorization": f"Bearer {TOKEN}"}) as resp:
                assert resp.status == 404
    finally:
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0


def test_bad_config_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = argparse.Namespace(listen="127.0.0.1:0", config=str(tmp_path / "missing.toml"))
    assert cli_holder.run_holder(args) == 2
    assert "kvsp:" in capsys.readouterr().err
