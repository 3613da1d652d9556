"""The named shared memory an engine's processes made, and its removal once they are gone.

vLLM's CPU engine creates POSIX shared-memory segments (``/dev/shm/psm_*``:
``multiprocessing.shared_memory``, for its ``shm_broadcast`` message queues, a few hundred MB
each; and ``sem.mp-*`` semaphores) and frees them when it shuts down. Killed with SIGKILL, as
:meth:`.engine_process.EngineProcess.close` kills an engine that does not exit in time, it
cannot, and Python's resource tracker, which would free them after it, is in the same process
group and dies with it: the segments stay in the machine's memory until reboot. An engine
whose top process dies alone leaves its engine core running, mapping them, until its group is
ended.

A segment names no owner (``psm_`` and eight random hex digits), and other engines on the
machine have segments of the same kind. So :class:`SegmentLedger` notes the ``/dev/shm`` files
the processes of one engine map (``/proc/PID/maps``) while they live, by inode: a semaphore's
creator maps it under the temporary name ``sem_open`` made it with (shown ``(deleted)``) before
linking it to its own name, so only the inode ties the two. :meth:`SegmentLedger.sweep`, once
the group is gone, unlinks each ``/dev/shm`` entry of a noted inode that no live process maps
(one that does is not the dead engine's to free). A segment made and lost between two notes is
beyond it: the engine notes its group when it is ready (vLLM makes its segments while it
starts) and before every stop.

Linux only (``/proc``, ``/dev/shm``); elsewhere nothing is noted and nothing removed.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from pathlib import Path

__all__ = ["SHM_DIR", "SegmentLedger", "mapped_inodes", "shm_inodes"]

SHM_DIR = Path("/dev/shm")
_PREFIX = f"{SHM_DIR}/"


def shm_inodes(pid: int) -> set[int]:
    """Inodes of the ``/dev/shm`` files process ``pid`` maps, linked or not; empty for a
    process that is gone or whose maps cannot be read."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:  # gone meanwhile, or another user's process
        return set()
    inodes = set()
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)  # address perms offset dev inode path
        if len(fields) == 6 and fields[5].startswith(_PREFIX):
            inodes.add(int(fields[4]))
    return inodes


def mapped_inodes() -> set[int]:
    """Inodes of the ``/dev/shm`` files some live process maps (every ``/proc/PID/maps``
    this process may read)."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return set()
    inodes: set[int] = set()
    for entry in entries:
        if entry.isdigit():
            inodes |= shm_inodes(int(entry))
    return inodes


class SegmentLedger:
    """The ``/dev/shm`` files seen mapped by the processes of one engine (module notes);
    thread-safe."""

    def __init__(self) -> None:
        self._inodes: set[int] = set()
        self._lock = threading.Lock()

    @property
    def inodes(self) -> frozenset[int]:
        with self._lock:
            return frozenset(self._inodes)

    def note(self, pids: Iterable[int]) -> None:
        """Add what ``pids`` map now."""
        seen: set[int] = set()
        for pid in pids:
            seen |= shm_inodes(pid)
        with self._lock:
            self._inodes |= seen

    def sweep(self) -> list[str]:
        """Unlink every ``/dev/shm`` entry of a noted inode that no live process maps; the
        names unlinked. Call it once the engine's processes are gone."""
        noted = self.inodes
        if not noted:
            return []
        try:
            with os.scandir(SHM_DIR) as entries:
                present = sorted((e.name, e.inode()) for e in entries if e.inode() in noted)
        except OSError:
            return []
        if not present:
            return []
        busy = mapped_inodes()
        removed = []
        for name, inode in present:
            if inode in busy:
                continue
            path = SHM_DIR / name
            try:
                if path.stat(follow_symlinks=False).st_ino != inode:  # replaced meanwhile
                    continue
                path.unlink()
            except OSError:  # unlinked meanwhile by its owner, or not ours to remove
                continue
            removed.append(name)
        return removed
