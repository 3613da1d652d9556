"""Installing and locating third-party MOQT peers, each in its own virtual environment.

Peers pin dependencies that clash with ours (caprid-relay pins aioquic < 1.4) or need another
interpreter (aiomoqt 0.13 needs Python >= 3.12), so each gets a venv under a cache folder:
``$KVSP_PEER_CACHE`` or ``.peers/`` at the repository root (git-ignored), one folder per
requirement (``moq-rs@moq-rs==0.5.1``), so that a venv for another version never replaces one
in use. A venv is ready once its marker file (written last, atomically) records its requirement.

Several processes may set up the same peer at once (pytest-xdist workers on a fresh cache, the
test command's ``python -m interop.peers install`` beside them): set-up holds an exclusive
``fcntl`` lock on a file beside the venv, and checks again for the marker once it has the lock.
A venv without its marker is what a killed set-up leaves: no process uses it (users wait for
the marker, builders hold the lock), so the next set-up repairs it in place, never deletes it.

Servers of some peers ignore their bind address (aiomoqt listens on 0.0.0.0 and [::]): run
them only through :func:`isolated_command`, which wraps a command in a private network
namespace that has nothing but loopback (``unshare -n``, root only).

Command line (the README's test command runs it before pytest starts its workers)::

    python -m interop.peers install [NAME ...]    # every peer by default; one line per peer
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARKER = "kvsp-peer.txt"
#: One set-up (the venv, pip, the import check): a bound on each step, and on how long a
#: process waits for another's set-up (the lock) before it gives up on the peer.
SETUP_LIMIT_S = 900.0
#: ``flock`` has no timeout: a waiter polls the non-blocking form this often, up to its bound.
LOCK_POLL_S = 0.2


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


def venv_dir(spec: PeerSpec) -> Path:
    """The venv of ``spec``: one folder per name and requirement. A requirement with characters
    unsafe in a path (``<``, spaces, extras) is named by its digest instead."""
    requirement = spec.requirement
    if not re.fullmatch(r"[A-Za-z0-9._=-]+", requirement):
        requirement = hashlib.sha256(requirement.encode()).hexdigest()[:16]
    return cache_dir() / f"{spec.name}@{requirement}"


def ready_bin(spec: PeerSpec) -> Path | None:
    """The venv's ``bin`` folder if its set-up finished (the marker names the requirement)."""
    venv = venv_dir(spec)
    try:
        done = (venv / MARKER).read_text() == spec.requirement
    except OSError:
        return None
    return venv / "bin" if done else None


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
        root = subprocess.run([pyenv, "root"], capture_output=True, text=True,
                              timeout=30).stdout.strip()
        versions = sorted(Path(root, "versions").glob("3.*/bin/python3"), reverse=True)
        candidates += [str(p) for p in versions]
    candidates += [p for n in range(20, min_version[1] - 1, -1) if (p := shutil.which(f"python3.{n}"))]
    for python in candidates:
        version = _version_of(python)
        if version and version >= min_version:
            return python
    raise PeerUnavailable(f"no Python >= {min_version[0]}.{min_version[1]} found (pyenv or PATH)")


@contextmanager
def _exclusive(lock_path: Path, limit: float) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_path`` (created, never removed: removing a lock
    file races with its next user). The kernel releases it if the holder dies."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as lock:
        deadline = time.monotonic() + limit
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise PeerUnavailable(f"another process has been setting up {lock_path.stem} "
                                          f"for over {limit:.0f} s (lock {lock_path})") from None
                time.sleep(LOCK_POLL_S)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _build(spec: PeerSpec, python: str, venv: Path) -> None:
    """Make (or repair) the venv in place, then write its marker. Over a half-made venv,
    ``venv`` keeps what is there and restores the interpreter and pip, and
    ``--force-reinstall`` rewrites whatever files a killed pip left incomplete."""
    bin_dir = venv / "bin"
    steps = [[python, "-m", "venv", str(venv)],
             [str(bin_dir / "python"), "-m", "pip", "install", "-q", "--force-reinstall",
              spec.requirement],
             [str(bin_dir / "python"), "-c", f"import {spec.check_import}"]]
    deadline = time.monotonic() + SETUP_LIMIT_S
    for step in steps:
        left = deadline - time.monotonic()
        try:
            proc = subprocess.run(step, capture_output=True, text=True, timeout=max(left, 1.0))
        except subprocess.TimeoutExpired:
            raise PeerUnavailable(f"installing {spec.requirement} took over {SETUP_LIMIT_S:.0f} s "
                                  f"(at {' '.join(step[:4])})") from None
        if proc.returncode != 0:
            raise PeerUnavailable(f"installing {spec.requirement} failed at {' '.join(step[:4])}: "
                                  f"{proc.stderr.strip()[-800:]}")
    # Written aside and renamed: a reader sees no marker or the whole one.
    partial = venv / f"{MARKER}.{os.getpid()}"
    partial.write_text(spec.requirement)
    os.replace(partial, venv / MARKER)


def setup_peer(spec: PeerSpec) -> tuple[Path, bool]:
    """The venv's ``bin`` folder with ``spec`` installed, and whether this call installed it
    (False: it was ready, or another process finished it while this one waited)."""
    if (bin_dir := ready_bin(spec)) is not None:
        return bin_dir, False
    python = find_interpreter(spec.min_python)
    venv = venv_dir(spec)
    with _exclusive(venv.with_name(venv.name + ".lock"), SETUP_LIMIT_S + 60):
        if (bin_dir := ready_bin(spec)) is not None:
            return bin_dir, False
        _build(spec, python, venv)
    return venv / "bin", True


def ensure_peer(spec: PeerSpec) -> Path:
    """The venv's ``bin`` folder with ``spec`` installed; installs it on first use."""
    return setup_peer(spec)[0]


def can_isolate() -> bool:
    """Whether :func:`isolated_command` works here (root with ``unshare`` and ``ip``)."""
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("ip"):
        return False
    return subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode == 0


def isolated_command(script: str) -> list[str]:
    """A command running ``script`` (bash) in a fresh network namespace with only loopback up."""
    return ["unshare", "-n", "bash", "-c", f"ip link set lo up && {script}"]


def main(argv: Sequence[str] | None = None) -> int:
    """``install [NAME ...]``: set up the peers (all by default), one line each. A peer that
    cannot be installed here is reported and is not an error: its tests skip, loudly."""
    parser = argparse.ArgumentParser(prog="python -m interop.peers",
                                     description="Set up the third-party MOQT peers' venvs.")
    commands = parser.add_subparsers(dest="command", required=True)
    install = commands.add_parser("install", help="install the peers (all by default)")
    install.add_argument("names", nargs="*", metavar="NAME",
                         help=f"peers to install: {', '.join(PEERS)}")
    args = parser.parse_args(argv)
    unknown = [name for name in args.names if name not in PEERS]
    if unknown:
        parser.error(f"unknown peer {', '.join(unknown)} (known: {', '.join(PEERS)})")
    for name in args.names or list(PEERS):
        spec = PEERS[name]
        try:
            bin_dir, installed = setup_peer(spec)
        except PeerUnavailable as exc:
            print(f"{spec.requirement}: unavailable: {exc}", flush=True)
            continue
        print(f"{spec.requirement}: {'installed' if installed else 'ready'} in {bin_dir.parent}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
