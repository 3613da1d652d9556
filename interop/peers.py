"""Installing and locating third-party MOQT peers, each in its own virtual environment.

Peers pin dependencies that clash with ours (caprid-relay pins aioquic < 1.4) or need another
interpreter (aiomoqt 0.13 needs Python >= 3.12), so each gets a venv under a cache folder:
``$KVSP_PEER_CACHE`` or ``.peers/`` at the repository root (git-ignored). A venv is made once
and reused while its marker file records the same requirement.

Servers of some peers ignore their bind address (aiomoqt listens on 0.0.0.0 and [::]): run
them only through :func:`isolated_command`, which wraps a command in a private network
namespace that has nothing but loopback (``unshare -n``, root only).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class PeerSpec:
    name: str
    requirement: str
    min_python: tuple[int, int]
    check_import: str


MOQ_RS = PeerSpec("moq-rs", "moq-rs==0.5.1", (3, 10), "moq")
AIOMOQT = PeerSpec("aiomoqt", "aiomoqt==0.13.3", (3, 12), "aiomoqt")
CAPRID = PeerSpec("caprid-relay", "caprid-relay==0.1.0", (3, 11), "caprid_relay")
PEERS = {p.name: p for p in (MOQ_RS, AIOMOQT, CAPRID)}


class PeerUnavailable(RuntimeError):
    """The peer cannot be installed here; the message says why (tests skip with it, loudly)."""


def cache_dir() -> Path:
    return Path(os.environ.get("KVSP_PEER_CACHE", ROOT / ".peers"))


def _version_of(python: str) -> tuple[int, int] | None:
    try:
        out = subprocess.run([python, "-c", "import sys; print(*sys.version_info[:2])"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    major, minor = out.split()
    return int(major), int(minor)


def find_interpreter(min_version: tuple[int, int]) -> str:
    """A Python of at least ``min_version``: this one, then pyenv's, then ``python3.N`` on PATH."""
    if sys.version_info[:2] >= min_version:
        return sys.executable
    candidates: list[str] = []
    pyenv = shutil.which("pyenv")
    if pyenv:
        root = subprocess.run([pyenv, "root"], capture_output=True, text=True).stdout.strip()
        versions = sorted(Path(root, "versions").glob("3.*/bin/python3"), reverse=True)
        candidates += [str(p) for p in versions]
    candidates += [p for n in range(20, min_version[1] - 1, -1) if (p := shutil.which(f"python3.{n}"))]
    for python in candidates:
        version = _version_of(python)
        if version and version >= min_version:
            return python
    raise PeerUnavailable(f"no Python >= {min_version[0]}.{min_version[1]} found (pyenv or PATH)")


def ensure_peer(spec: PeerSpec) -> Path:
    """The venv's ``bin`` folder with ``spec`` installed; installs it on first use."""
    venv = cache_dir() / spec.name
    marker = venv / "kvsp-peer.txt"
    bin_dir = venv / "bin"
    if marker.exists() and marker.read_text() == spec.requirement:
        return bin_dir
    python = find_interpreter(spec.min_python)
    if venv.exists():
        shutil.rmtree(venv)
    steps = [[python, "-m", "venv", str(venv)],
             [str(bin_dir / "pip"), "install", "-q", spec.requirement],
             [str(bin_dir / "python"), "-c", f"import {spec.check_import}"]]
    for step in steps:
        proc = subprocess.run(step, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise PeerUnavailable(f"installing {spec.requirement} failed at {' '.join(step[:3])}: "
                                  f"{proc.stderr.strip()[-800:]}")
    marker.write_text(spec.requirement)
    return bin_dir


def can_isolate() -> bool:
    """Whether :func:`isolated_command` works here (root with ``unshare`` and ``ip``)."""
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("ip"):
        return False
    return subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode == 0


def isolated_command(script: str) -> list[str]:
    """A command running ``script`` (bash) in a fresh network namespace with only loopback up."""
    return ["unshare", "-n", "bash", "-c", f"ip link set lo up && {script}"]
