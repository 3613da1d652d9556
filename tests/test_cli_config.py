"""A bad ``--config`` of a role is one line on stderr that names the file and what is wrong,
with exit status 2, not the usage first (issue 25): ``kvsp relay`` (its own parser: ``kvsp
relay: error: ...``) and every control-plane role (``kvsp: ...``, as every failure of a
``kvsp`` command). The issue's case, a file that does not exist, runs the real command; a
file that cannot be read (a directory), one that is not TOML and one with an unknown section
run ``kvsp``'s main() in this process."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvsp_moq.cli import main

ROLES = ("relay", "index", "holder", "pc", "instance", "frontend")


def _prefix(role: str) -> str:
    return "kvsp relay: error: " if role == "relay" else "kvsp: "


def _kvsp(*args: str) -> subprocess.CompletedProcess[str]:
    # The console script when installed (as the README does), else the module.
    script = shutil.which("kvsp", path=str(Path(sys.executable).parent))
    cmd = [script] if script else [sys.executable, "-m", "kvsp_moq"]
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("role", ROLES)
def test_a_missing_config_is_one_line(role: str, tmp_path: Path) -> None:
    missing = tmp_path / "missing.toml"
    # port 0: were the file accepted, the role would serve on a free port (and time out here)
    proc = _kvsp(role, "--listen", "127.0.0.1:0", "--config", str(missing))
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == f"{_prefix(role)}cannot read config {missing}: No such file or directory\n"


def _main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int | str | None, str]:
    """main()'s status (the relay's parser exits with it) and its stderr; it prints nothing else."""
    try:
        status: int | str | None = main(argv)
    except SystemExit as exc:
        status = exc.code
    out, err = capsys.readouterr()
    assert out == ""
    return status, err


@pytest.mark.parametrize("role", ROLES)
def test_an_unreadable_or_invalid_config_is_one_line(role: str, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    directory = tmp_path / "conf.d"
    directory.mkdir()
    not_toml = tmp_path / "not.toml"
    not_toml.write_text("[index\n")
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("[bogus]\n")
    listen = ["--listen", "127.0.0.1:0"]
    prefix = _prefix(role)

    assert _main([role, *listen, "--config", str(directory)], capsys) == (
        2, f"{prefix}cannot read config {directory}: Is a directory\n")

    status, err = _main([role, *listen, "--config", str(not_toml)], capsys)
    assert status == 2 and err.startswith(f"{prefix}invalid config {not_toml}: not valid TOML: ")
    assert err.count("\n") == 1

    # the relay's file has principals, not role sections: [bogus] is an unknown key there
    what = "unknown key" if role == "relay" else "unknown section"
    assert _main([role, *listen, "--config", str(unknown)], capsys) == (
        2, f"{prefix}invalid config {unknown}: bogus: {what}\n")
