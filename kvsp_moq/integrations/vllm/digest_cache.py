"""Digests of weight files, computed once per host (docs/vllm.md "Descriptor").

vLLM builds the connector in the scheduler and in every worker, and each derives the
Compatibility Descriptor (kvsp-draft §4.1), whose ``model_digest`` (and each adapter's digest)
is SHA-256 over gigabytes of weights. :func:`files_digest` computes it once per host: the
answer is kept in a small JSON file keyed by every file's absolute path, size and
modification time (``st_mtime_ns``), so a file rewritten in place is hashed again. Processes
starting together take an exclusive lock on the cache while one of them hashes, so the
others read its answer instead of hashing the same files at once.

The cache lives in ``$KVSP_DIGEST_CACHE`` (a file path), else
``$XDG_CACHE_HOME/kvsp/digests.json`` (``~/.cache/kvsp/digests.json``). A cache that cannot be
read or written is only a slower start: the digest is then computed here and not kept.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from ...kvsp.compat import model_digest

__all__ = ["cache_path", "files_digest"]

log = logging.getLogger(__name__)

#: Entries kept (oldest dropped first): a host sees few models and adapters.
MAX_ENTRIES = 256


def cache_path() -> Path:
    """Where the digests are kept (module notes)."""
    explicit = os.environ.get("KVSP_DIGEST_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base, "kvsp", "digests.json")


def _identity(files: Sequence[Path]) -> str:
    """The cache key: every file's absolute path, size and mtime, in the digest's order."""
    parts = []
    for f in sorted(files, key=lambda p: os.fsencode(p.name)):
        st = f.stat()
        parts.append([str(f.resolve()), st.st_size, st.st_mtime_ns])
    return json.dumps(parts, separators=(",", ":"))


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[bool]:
    """An exclusive lock beside the cache file; yields False where none can be taken."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(str(path) + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        log.debug("digest cache %s: no lock (%s)", path, exc)
        yield False
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # held for one hash at most: bounded by the files' size
        yield True
    finally:
        os.close(fd)


def _read(path: Path) -> dict[str, str]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str)}


def _write(path: Path, entries: dict[str, str]) -> None:
    """Atomically (a temporary file renamed over the cache): readers never see half a file."""
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".digests-")
        with os.fdopen(fd, "w") as out:
            json.dump(entries, out)
        os.replace(tmp, path)
    except OSError as exc:
        log.debug("digest cache %s not written: %s", path, exc)
        with contextlib.suppress(OSError, UnboundLocalError):
            os.unlink(tmp)


def files_digest(files: Sequence[Path], *, compute: Callable[[Sequence[Path]], str] = model_digest,
                 cache: Path | None = None) -> str:
    """``compute(files)`` (by default §4.1's ``model_digest``: SHA-256 over the files in
    ascending byte order of their names), from the host's cache when the files are unchanged."""
    path = cache or cache_path()
    key = _identity(files)
    found = _read(path).get(key)
    if found is not None:
        return found
    with _locked(path) as locked:
        entries = _read(path) if locked else {}
        found = entries.get(key)
        if found is not None:  # another process hashed them while this one waited
            return found
        digest = compute(files)
        if locked:
            entries[key] = digest
            while len(entries) > MAX_ENTRIES:
                entries.pop(next(iter(entries)))
            _write(path, entries)
        return digest
