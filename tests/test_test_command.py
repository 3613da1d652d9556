"""The README's test command is what CI runs, and installs what the suite starts (issue 25).

The system programs come from one list, ``.ci/system-packages.txt``: ``.ci/system-packages.sh``
installs from it, ``tests/system_programs.py`` skips (under CI fails) the tests it names when a
program is missing. These tests hold the command, the list and that behaviour together; the
last ones run pytest on real test modules with a list whose programs are missing.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import system_programs

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"


def readme_test_command() -> str:
    """The second ``sh`` block of the README's "Two commands" section."""
    section = (ROOT / "README.md").read_text().split("## Two commands", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```sh\n(.*?)\n```", section, re.S)
    assert len(blocks) == 2, blocks
    return blocks[1].strip()


def test_ci_runs_exactly_the_readme_test_command() -> None:
    lines = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert lines == ["set -euo pipefail", 'cd "$(dirname "$0")/.."', readme_test_command()]


def test_the_command_installs_the_programs_and_peers_before_pytest() -> None:
    steps = readme_test_command().split(" && ")
    assert steps[0] == system_programs.INSTALL_COMMAND
    assert steps.index(".venv/bin/python -m interop.peers install") == len(steps) - 2
    assert steps[-1] == ".venv/bin/python -m pytest"


def test_the_list_names_every_module_that_starts_a_program() -> None:
    """Each listed module exists, and every test module that starts a listed program (its path
    in the module, or in a helper module it imports) is listed for it; the files the native
    extension builds from are listed for every module that tests that extension (imports
    ``kvsp_moq.transport.native``)."""
    programs = system_programs.load(system_programs.DEFAULT_LIST)
    build = {"pkg-config", "libngtcp2-dev", "libngtcp2-crypto-gnutls-dev", "libgnutls28-dev"}
    assert {p.package for p in programs} == {"redis-server", "chromium"} | build
    sources = {path.name: path.read_text() for path in TESTS.glob("*.py")}
    native_tests = {name for name, text in sources.items() if name.startswith("test_")
                    and re.search(r"^from kvsp_moq\.transport import native\b", text, re.M)}
    for program in programs:
        assert program.modules <= sources.keys(), program.modules - sources.keys()
        if program.package in build:
            assert program.modules == native_tests, (program.path, program.modules ^ native_tests)
            continue
        helpers = {name.removesuffix(".py") for name, text in sources.items()
                   if not name.startswith("test_") and program.path in text}
        # A module that checks the program per test (system_programs.require) need not be listed.
        starters = {name for name, text in sources.items() if name.startswith("test_") and (
            program.path in text
            or any(re.search(rf"^(from|import) {h}\b", text, re.M) for h in helpers))
            and not re.search(r"^from system_programs import .*\brequire\b", text, re.M)}
        assert starters == program.modules, (program.path, starters ^ program.modules)


def test_install_script_is_silent_when_nothing_is_missing() -> None:
    missing = [p.path for p in system_programs.load(system_programs.DEFAULT_LIST) if not p.present]
    if missing:
        pytest.skip(f"{', '.join(missing)} missing: running the script here would install them")
    proc = subprocess.run(["bash", str(ROOT / ".ci" / "system-packages.sh")], capture_output=True,
                          text=True, timeout=60)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")


def run_pytest(tmp_path: Path, modules: list[str], *, ci: bool) -> subprocess.CompletedProcess[str]:
    """pytest in its own process on ``modules`` with a list whose redis-server is missing."""
    listed = tmp_path / "programs.txt"
    listed.write_text("# no such redis-server here\n"
                      "/nonexistent/redis-server redis-server " + " ".join(modules) + "\n")
    env = {k: v for k, v in os.environ.items() if k != "CI" and not k.startswith("PYTEST_")}
    env.update(KVSP_SYSTEM_PROGRAMS=str(listed), **({"CI": "true"} if ci else {}))
    argv = [sys.executable, "-m", "pytest", "-n", "0", "-v", "-p", "no:cacheprovider",
            *(f"tests/{m}" for m in modules)]
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_a_missing_program_skips_its_tests_with_one_reason(tmp_path: Path) -> None:
    proc = run_pytest(tmp_path, ["test_index_redis.py", "test_holder_leases.py"], ci=False)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:]
    reason = ("/nonexistent/redis-server is missing (Debian package redis-server): "
              "`bash .ci/system-packages.sh` installs it")
    assert f"system programs missing: {reason}" in out  # the header, once
    folded = re.findall(r"^SKIPPED \[(\d+)\] (.*)$", out, re.M)
    assert len(folded) == 1 and folded[0][1].endswith(f"programs.txt:2: {reason} "
                                                      "(the README's test command runs it)"), folded
    skipped = re.findall(r"^tests/\S+ SKIPPED", out, re.M)
    passed = re.findall(r"^(tests/\S+) PASSED", out, re.M)
    assert len(skipped) == int(folded[0][0]) > 0
    # On the in-memory store, the same module's tests run.
    assert passed and all("[memory]" in nodeid for nodeid in passed), passed


def test_under_ci_a_missing_program_fails_its_tests(tmp_path: Path) -> None:
    proc = run_pytest(tmp_path, ["test_index_redis.py"], ci=True)
    out = proc.stdout
    assert proc.returncode == 1, out[-3000:]
    errors = re.findall(r"^ERROR tests/test_index_redis\.py::\S+ - Failed: (.*)$", out, re.M)
    assert errors and set(errors) == {
        "/nonexistent/redis-server is missing (Debian package redis-server): `bash "
        ".ci/system-packages.sh` installs it (the README's test command runs it); CI=true: the "
        "test command should have installed it"}, out[-3000:]
    assert "passed" not in out.splitlines()[-1] and "skipped" not in out.splitlines()[-1]
