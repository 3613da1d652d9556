"""``kvsp index`` (kvsp_moq/control/index/cli.py) as a real process on 127.0.0.1 port 0."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path

import aiohttp
import pytest

from kvsp_moq.control.common.cli import parse_listen
from kvsp_moq.kvsp.records import dump_json
from test_index_support import DESCRIPTOR, H1, SCOPE_A, block_path, key, lookup_body, replica

GUARD = 30.0  # a safety net against hangs, never a way to wait for something
TOKEN = "cli-test-token-0123456789abcdef"

# The lead wires register_cli into kvsp_moq/cli/; until then, a parser of our own.
RUNNER = (
    "import argparse, sys\n"
    "from kvsp_moq.control.index.cli import register_cli\n"
    "parser = argparse.ArgumentParser(prog='kvsp')\n"
    "register_cli(parser.add_subparsers(dest='command', required=True))\n"
    "args = parser.parse_args()\n"
    "sys.exit(args.handler(args))\n"
)


def write_config(tmp_path: Path) -> Path:
    (tmp_path / "tiny.json").write_text(json.dumps(DESCRIPTOR))
    path = tmp_path / "kvsp.toml"
    path.write_text(f"""
[index]
base_path = "/is/"
descriptors = ["tiny.json"]

[[principals]]
name = "h1"
token = "{TOKEN}"
scopes = ["{SCOPE_A.hex()}"]
holders = ["{H1}"]
""")
    return path


def test_parse_listen() -> None:
    assert parse_listen("127.0.0.1:0") == ("127.0.0.1", 0)
    assert parse_listen("[::1]:8470") == ("::1", 8470)
    assert parse_listen("localhost:65535") == ("localhost", 65535)
    for bad in ("127.0.0.1", ":80", "host:http", "host:65536", "host:-1"):
        with pytest.raises(ValueError):
            parse_listen(bad)


async def test_kvsp_index_serves_until_terminated(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", RUNNER, "index", "--listen", "127.0.0.1:0", "--config", str(config),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), GUARD)).decode()
        prefix = "kvsp index: listening on "
        assert line.startswith(prefix), line
        url = line[len(prefix):].strip()
        assert url.startswith("http://127.0.0.1:") and url.endswith("/is/") and not url.endswith(":0/is/")
        headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/kvsp+json"}
        async with aiohttp.ClientSession(headers=headers) as session:
            async with session.put(url + block_path(key(0)), data=dump_json(replica(key(0)))) as resp:
                assert resp.status == 201
            async with session.post(url + "lookup", data=json.dumps(lookup_body([key(0)]))) as resp:
                assert resp.status == 200 and (await resp.json(content_type=None))["matched"] == 1
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        rc = await asyncio.wait_for(proc.wait(), GUARD)
    assert rc == 0


async def test_kvsp_index_rejects_a_bad_config(tmp_path: Path) -> None:
    (tmp_path / "bad.toml").write_text("[index]\nmax_ttl_ms = -1\n")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", RUNNER, "index", "--config", str(tmp_path / "bad.toml"),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    _, err = await asyncio.wait_for(proc.communicate(), GUARD)
    assert proc.returncode == 2
    assert err.decode().startswith(f"kvsp: invalid config {tmp_path / 'bad.toml'}: index.max_ttl_ms:")
