"""Our moq-interop-runner test client (``python -m interop.test_client``) against our relay
(``python -m relay``; no third-party peer): TAP version 14 output and the exit codes of the
contract (0 pass, 1 fail, 127 unsupported). The cases our relay cannot pass yet are strict
xfails raising :class:`~interop.testing.KnownGap` with the documented cause (docs/interop.md).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from interop.client_cases import CASES
from interop.harness import ROOT, kill_group
from interop.testing import KnownGap

LIMIT = 60.0


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RELAY_URL", "TESTCASE",
                                                           "TLS_DISABLE_VERIFY", "MOQT_DRAFT", "DRAFT")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def relay_url() -> Iterator[str]:
    proc = subprocess.Popen([sys.executable, "-m", "relay", "--listen", "127.0.0.1:0"],
                            cwd=ROOT, env=_env(PYTHONUNBUFFERED="1"), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # readiness: the line the relay prints once bound
            if "relay listening on " in line:
                yield line.split("relay listening on ")[1].strip()
                break
        else:
            pytest.fail("our relay exited before listening")
    finally:
        kill_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        finally:
            kill_group(proc.pid, signal.SIGKILL)
            proc.wait()


def client(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "interop.test_client", *args], cwd=ROOT,
                          env=_env(**env), capture_output=True, text=True, timeout=LIMIT)


def test_list() -> None:
    proc = client("-l")
    assert proc.returncode == 0
    assert proc.stdout.split() == list(CASES) and len(CASES) == 14


def test_setup_only_tap_via_environment(relay_url: str) -> None:
    proc = client(RELAY_URL=relay_url, TESTCASE="setup-only", TLS_DISABLE_VERIFY="1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "TAP version 14"
    assert [ln for ln in lines if not ln.startswith("#")][1] == "1..1"
    i = lines.index("ok 1 - setup-only")
    assert lines[i + 1] == "  ---" and "  ..." in lines[i + 2:]
    assert re.search(r'^  message: "SETUP done, version 22"$', proc.stdout, re.M)


@pytest.mark.parametrize("draft", [22, 20, 18])
def test_wrapper_script_pins_draft(relay_url: str, draft: int) -> None:
    proc = subprocess.run([str(ROOT / "interop" / "moq-test-client"), "-r", relay_url,
                           "--tls-disable-verify", "-t", "data-subgroup-basic",
                           "--draft", str(draft)], env=_env(PYTHON=sys.executable),
                          capture_output=True, text=True, timeout=LIMIT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ok 1 - data-subgroup-basic" in proc.stdout


@pytest.mark.parametrize(("var", "value", "version"), [
    ("MOQT_DRAFT", "18", 18), ("MOQT_DRAFT", "draft-20", 20),
    ("DRAFT", "draft-ietf-moq-transport-18", 18), ("MOQT_DRAFT", "22", 22),
])
def test_moqt_draft_environment_pins_the_version(relay_url: str, var: str, value: str, version: int) -> None:
    """The contract's MOQT_DRAFT (and the runner's DRAFT) pins the version like --draft: the
    session's negotiated version is the one named (the relay itself would pick 22)."""
    proc = client(RELAY_URL=relay_url, TESTCASE="setup-only", TLS_DISABLE_VERIFY="1", **{var: value})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(rf'^  message: "SETUP done, version {version}"$', proc.stdout, re.M), proc.stdout
    assert f"# draft: {value}" in proc.stdout


def test_moqt_draft_we_do_not_speak_is_unsupported(relay_url: str) -> None:
    for value in ("14", "draft-99", "latest"):
        proc = client(RELAY_URL=relay_url, TESTCASE="setup-only", TLS_DISABLE_VERIFY="1", MOQT_DRAFT=value)
        assert proc.returncode == 127 and "# SKIP draft" in proc.stdout, (value, proc.stdout)
    # --draft on the command line wins over the environment.
    proc = client("--draft", "20", RELAY_URL=relay_url, TESTCASE="setup-only", TLS_DISABLE_VERIFY="1",
                  MOQT_DRAFT="18")
    assert proc.returncode == 0 and "SETUP done, version 20" in proc.stdout, proc.stdout


def test_failure_is_not_ok_and_exit_1(relay_url: str) -> None:
    proc = client("-r", relay_url, "-t", "setup-only")  # certificate verified: self-signed fails
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "not ok 1 - setup-only" in proc.stdout
    assert re.search(r"^  message: \".+\"$", proc.stdout, re.M)


def test_unsupported_test_and_draft_exit_127(relay_url: str) -> None:
    assert client("-r", relay_url, "-t", "no-such-case").returncode == 127
    assert client("-r", relay_url, "-t", "setup-only", "--draft", "14").returncode == 127


# The cases our relay fails, with the cause each must show (interop/matrix-baseline.json).
GAPS: dict[str, str] = {}  # none left today; an empty set collects as one skip


@pytest.mark.xfail(strict=True, raises=KnownGap)
@pytest.mark.parametrize("gap", sorted(GAPS))
def test_known_gaps_of_our_relay(relay_url: str, gap: str) -> None:
    case, _, draft = gap.partition("@")
    proc = client("-r", relay_url, "--tls-disable-verify", "-t", case, "--draft", draft or "22")
    if proc.returncode == 1 and GAPS[gap] in proc.stdout:
        raise KnownGap(f"{gap}: {GAPS[gap]}")
    assert proc.returncode == 0, proc.stdout + proc.stderr


# Gaps closed (docs/interop.md): PUBLISH into the relay, SUBSCRIBE_TRACKS, RENDEZVOUS_TIMEOUT.
@pytest.mark.parametrize("case", ["rendezvous-timeout", "namespace-discovery",
                                  "publish-track-only", "publish-track-subscribe"])
def test_closed_gaps_pass(relay_url: str, case: str) -> None:
    proc = client("-r", relay_url, "--tls-disable-verify", "-t", case, "--draft", "22")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"ok 1 - {case}" in proc.stdout


# Gap closed: join (draft 18 Joining FETCH; drafts 20/22 FILL_PARAMETERS fill fetch stream).
@pytest.mark.parametrize("draft", [22, 20, 18])
def test_join_passes(relay_url: str, draft: int) -> None:
    proc = client("-r", relay_url, "--tls-disable-verify", "-t", "join", "--draft", str(draft))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ok 1 - join" in proc.stdout
