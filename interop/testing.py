"""The pytest side of the interop harness (``tests/test_interop_*.py``).

:func:`run_case` runs ``python -m interop.cases`` in its own process group — inside
``unshare -n`` (loopback only) when asked — with a wall-clock limit, kills the whole group
afterwards, and returns the case's ``RESULT`` as a dict. Certificates come from our TLS helper.
:func:`run_matrix` runs ``python -m interop.matrix`` the same way and returns its JSON.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvsp_moq.transport.tls import make_self_signed

from . import peers
from .harness import ROOT, aiomoqt_counted, kill_group, payload, sha256

__all__ = ["KnownGap", "aiomoqt_counted", "describe", "expected_objects", "make_certs",
           "payload", "peer_bin", "run_case", "run_matrix", "sha256"]

class KnownGap(AssertionError):
    """Raised by a test when it observed exactly a documented gap (docs/interop.md); such tests
    are ``xfail(raises=KnownGap, strict=True)``, so any other failure still fails them and a fix
    turns them into a strict XPASS."""


CASE_LIMIT = 60.0  # seconds for one case process (its own guard is 45 s)


def peer_bin(spec: peers.PeerSpec) -> Path:
    """The peer's venv (installed on first use); skips the test, loudly, if it cannot be."""
    try:
        return peers.ensure_peer(spec)
    except peers.PeerUnavailable as exc:
        pytest.skip(f"LOUD SKIP: {spec.name} interop cannot run here: {exc}")


def make_certs(folder: Path) -> tuple[Path, Path]:
    """A self-signed certificate for localhost / 127.0.0.1 (our helper), as PEM files."""
    cert = make_self_signed()
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(_bytes(cert.cert_pem))
    key_path.write_bytes(_bytes(cert.key_pem))
    return cert_path, key_path


def _bytes(pem: str | bytes) -> bytes:
    return pem.encode() if isinstance(pem, str) else pem


def run_case(case: str, draft: int, bin_dir: Path, folder: Path, *, isolate: bool = False,
             alpn: str = "", limit: float = CASE_LIMIT,
             module: str = "interop.cases", transport: str = "quic") -> dict[str, Any]:
    """Run one case of ``module`` (``interop.cases``, or ``interop.relay_cases`` for the
    peer-via-our-relay cells) over ``transport`` (``quic`` or ``webtransport``); the
    returned dict also carries ``_output`` (its stdout+stderr tail)."""
    cert, key = make_certs(folder)
    argv = [sys.executable, "-m", module, case, "--draft", str(draft),
            "--peer-bin", str(bin_dir), "--cert", str(cert), "--key", str(key),
            "--guard", str(limit - 15)]
    if alpn:
        argv += ["--alpn", alpn]
    if transport != "quic":
        argv += ["--transport", transport]
    if isolate:
        argv = peers.isolated_command("exec " + shlex.join(argv))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        kill_group(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{case} draft {draft}: no result within {limit:.0f} s\n{_tail(out, err)}")
    finally:
        kill_group(proc.pid, signal.SIGKILL)  # whatever is left of the group
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        pytest.fail(f"{case} draft {draft}: no RESULT (rc={proc.returncode})\n{_tail(out, err)}")
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT "):])
    result["_output"] = _tail(out, err)
    return result


def _tail(out: str, err: str, n: int = 80) -> str:
    lines = (out.splitlines() + err.splitlines())[-n:]
    return "\n".join(lines)


def expected_objects(groups: int, objects: int, size: int, *, maker=payload
                     ) -> dict[tuple[int, int], str]:
    """{(group, object): sha256} of the payloads a case publishes."""
    return {(g, o): sha256(maker(g, o, size)) for g in range(groups) for o in range(objects)}


def describe(result: dict[str, Any]) -> str:
    """The result without bulky fields, plus the peer log and process output, for messages."""
    slim = {k: v for k, v in result.items()
            if k not in ("_output", "peer_log", "objects", "peer_events")}
    return (json.dumps(slim, indent=1) + "\n--- peer log ---\n" +
            "\n".join(result.get("peer_log") or []) + "\n--- case output ---\n" +
            result.get("_output", ""))


def run_matrix(args: list[str], out: Path, limit: float) -> tuple[dict[str, Any], str, int]:
    """``python -m interop.matrix ARGS --json OUT`` in its own process group within ``limit``
    seconds (the whole group killed afterwards); (its JSON, its output's tail, its exit
    status). Fails the test when it does not finish or writes no JSON."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.Popen([sys.executable, "-m", "interop.matrix", *args, "--json", str(out)],
                            cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        kill_group(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"interop.matrix {' '.join(args)} did not finish within {limit:.0f} s\n"
                    f"{output[-4000:]}")
    finally:
        kill_group(proc.pid, signal.SIGKILL)
    assert out.exists(), output[-4000:]
    return json.loads(out.read_text()), output[-4000:], proc.returncode
