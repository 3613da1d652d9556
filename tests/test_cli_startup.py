"""``kvsp --version``, ``kvsp --help`` and a mistyped command import no subcommand's module
(kvsp_moq/cli/commands.py): none of QUIC, aiohttp, numpy, redis, torch, vLLM, nor the relay
or the control plane, which took 0.9 s before the first line (issue 25). Each is run in a
fresh interpreter, which then lists what it imported; the help lines that stand in for the
modules are checked against the modules' own."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

#: Third-party packages a subcommand needs, never the top-level command.
HEAVY = {"torch", "numpy", "aioquic", "qh3", "aiopquic", "aiohttp", "vllm", "redis", "cryptography",
         "uvloop", "transformers", "safetensors", "prometheus_client"}
#: All of this project that ``kvsp`` itself imports.
OWN = {"kvsp_moq", "kvsp_moq.cli", "kvsp_moq.cli.commands", "kvsp_moq.cli.relay_cmd"}
#: Calls kvsp's main() with its arguments after the first, then writes the status it ended
#: with and every module imported to the file named by the first.
PROBE = """
import json, sys
from kvsp_moq.cli import main
try:
    status = main(sys.argv[2:])
except SystemExit as exc:
    status = exc.code
with open(sys.argv[1], "w") as fh:
    json.dump({"status": status, "modules": sorted(sys.modules)}, fh)
"""


@pytest.mark.parametrize(("argv", "status", "says"), [
    (["--version"], 0, "kvsp "),
    (["--help"], 0, "usage: kvsp [-h] [--version] COMMAND ..."),
    (["-h", "demo"], 0, "usage: kvsp [-h] [--version] COMMAND ..."),
    (["demos"], 2, "invalid choice: 'demos'"),
    ([], 2, "the following arguments are required: COMMAND"),
])
def test_the_top_level_command_imports_no_subcommand(argv: list[str], status: int, says: str,
                                                     tmp_path: Path) -> None:
    out = tmp_path / "imported.json"
    proc = subprocess.run([sys.executable, "-c", PROBE, str(out), *argv], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert says in proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["status"] == status
    modules = set(result["modules"])
    assert {m for m in modules if m.partition(".")[0] in HEAVY} == set()
    assert {m for m in modules if m.partition(".")[0] in ("kvsp_moq", "relay", "interop")} == OWN


def test_the_help_lines_are_the_modules_own() -> None:
    """The top-level help (names, order, help lines) and the list argparse refuses an unknown
    command with are the same from the table of cli/commands.py as from every module."""
    from kvsp_moq.cli import build_parser

    assert build_parser(()).format_help() == build_parser().format_help()
    for name in ("keys", "relay", "index", "demo"):  # one module loaded, the rest from the table
        assert build_parser({name}).format_help() == build_parser().format_help()
