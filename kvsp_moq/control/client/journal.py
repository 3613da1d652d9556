"""A holder's journal of the Replica Records it may have at the Index Service (kvsp-draft §6.1).

"A holder MUST withdraw a record with DELETE before or immediately after evicting the replica"
(§6.1). A process that is killed and restarted loses every replica of its memory tier at once,
and with them the list of what it published: without this journal its records stay at the IS
until their TTL, naming replicas nobody can serve (a restarted instance keeps its URL, so
clients are sent to it for blocks it no longer has). :class:`RecordJournal` keeps that list in
a file, so that the next start withdraws them first (``ReplicaPublisher.withdraw_previous``).

The file holds one JSON line per change, appended as it happens: ``{"put": [path, holder,
namespace, replica_id]}`` when the first PUT of a record is sent (it may reach the IS even if it
fails; its refreshes add nothing), ``{"del": [path, holder, namespace]}`` once the record is
withdrawn. ``path`` is the :attr:`RecordKey.path`, ``namespace`` the ``moqt_namespace`` of a
``moqt://`` record (else null). No expiry is kept: a record the last run refreshed just before
it died expires within one record TTL of the next start, which bounds how long that start keeps
trying to withdraw it. An append survives the process being killed (the
page cache keeps it); a torn last line, from a machine crash, is skipped when read. The file is
rewritten with the live entries alone once it has grown to twice their number (plus
:data:`COMPACT_SLACK` lines): its size stays proportional to what is published now.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from ...storage import RecordKey

__all__ = ["COMPACT_SLACK", "JournalEntry", "RecordJournal"]

log = logging.getLogger(__name__)

#: Lines beyond twice the live entries before the file is rewritten.
COMPACT_SLACK = 1024
#: A line longer than this is not one of ours (a path, two URLs and a namespace fit easily).
MAX_LINE = 8192

#: A record's identity at the IS (§6.1): the block, the holder, the MOQT namespace (or None).
Identity = tuple[str, str, str | None]


@dataclass(frozen=True)
class JournalEntry:
    key: RecordKey
    holder: str
    moqt_namespace: str | None
    replica_id: bytes

    @property
    def identity(self) -> Identity:
        return (self.key.path, self.holder, self.moqt_namespace)

    def line(self) -> dict[str, list[str | None]]:
        """Its ``put`` line of the file (module notes)."""
        return {"put": [self.key.path, self.holder, self.moqt_namespace, self.replica_id.hex()]}


def _parse_put(value: object) -> JournalEntry | None:
    if not (isinstance(value, list) and len(value) == 4):
        return None
    path, holder, namespace, replica_hex = value
    if not (isinstance(path, str) and isinstance(holder, str) and (namespace is None or isinstance(namespace, str))
            and isinstance(replica_hex, str)):
        return None
    parts = path.split("/")
    try:
        key = RecordKey.from_hex(*parts) if len(parts) == 3 else None
        replica_id = bytes.fromhex(replica_hex)
    except ValueError:
        return None
    return None if key is None else JournalEntry(key, holder, namespace, replica_id)


def _parse_del(value: object) -> Identity | None:
    if not (isinstance(value, list) and len(value) == 3):
        return None
    path, holder, namespace = value
    if isinstance(path, str) and isinstance(holder, str) and (namespace is None or isinstance(namespace, str)):
        return (path, holder, namespace)
    return None


class RecordJournal:
    """The journal file at ``path`` (module notes). :attr:`previous` is what the last run left:
    the records the file listed when it was opened (they stay listed until withdrawn)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._live: dict[Identity, JournalEntry] = {}
        self._lines = 0
        self.skipped_lines = 0
        self._load()
        self.previous: list[JournalEntry] = list(self._live.values())
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._rewrite()

    def _load(self) -> None:
        try:
            f = self.path.open("rb")
        except FileNotFoundError:
            return
        with f:
            for raw in f:
                line = raw.strip()
                if not line:
                    continue
                if len(line) > MAX_LINE:
                    self.skipped_lines += 1
                    continue
                try:
                    doc = json.loads(line)
                except ValueError:  # a torn line
                    self.skipped_lines += 1
                    continue
                put = _parse_put(doc.get("put")) if isinstance(doc, dict) else None
                gone = _parse_del(doc.get("del")) if isinstance(doc, dict) else None
                if put is not None:
                    self._live[put.identity] = put
                elif gone is not None:
                    self._live.pop(gone, None)
                else:
                    self.skipped_lines += 1
        if self.skipped_lines:
            log.warning("%s: %d line(s) unreadable, skipped", self.path, self.skipped_lines)

    # -- changes ---------------------------------------------------------------------------------

    def put(self, key: RecordKey, holder: str, moqt_namespace: str | None, replica_id: bytes) -> None:
        """A PUT of this record is about to be sent (a refresh of a listed one writes nothing)."""
        entry = JournalEntry(key, holder, moqt_namespace, replica_id)
        if self._live.get(entry.identity) == entry:
            return
        self._live[entry.identity] = entry
        self._append(entry.line())

    def delete(self, key: RecordKey, holder: str, moqt_namespace: str | None) -> None:
        """The record is withdrawn (or known gone: expired, never stored)."""
        identity = (key.path, holder, moqt_namespace)
        if self._live.pop(identity, None) is not None:
            self._append({"del": [key.path, holder, moqt_namespace]})

    def __len__(self) -> int:
        return len(self._live)

    # -- the file --------------------------------------------------------------------------------

    def _append(self, doc: object) -> None:
        line = json.dumps(doc, separators=(",", ":")) + "\n"
        try:
            with self.path.open("a") as f:
                f.write(line)
        except OSError as exc:  # the journal only speeds up what TTLs do anyway: never fatal
            log.warning("%s: %s; this record is not journaled", self.path, exc)
            return
        self._lines += 1
        if self._lines > 2 * len(self._live) + COMPACT_SLACK:
            self._rewrite()

    def _rewrite(self) -> None:
        """The live entries alone, written beside the file and renamed over it."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            with tmp.open("w") as f:
                for e in self._live.values():
                    f.write(json.dumps(e.line(), separators=(",", ":")) + "\n")
            os.replace(tmp, self.path)
        except OSError as exc:
            log.warning("%s: rewriting failed: %s", self.path, exc)
            return
        self._lines = len(self._live)
