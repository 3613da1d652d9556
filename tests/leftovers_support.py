"""What a run left behind, counting only what the run made (tests/test_demo.py,
tests/test_demo_vllm.py, tests/test_bridge_parallel.py).

Other work shares the machine (other test workers, other vLLM engines, other users), so no check
here compares all of ``/dev/shm``, ``/tmp`` or the process table before and after:

* processes: those of the run's own session (the run started with ``start_new_session``) or
  process group;
* shared memory: segments whose name carries one of the run's process ids (torch names its
  segments ``torch_<pid>_...``), and segments seen mapped by the run's processes while they
  lived (vLLM's ``psm_*`` and ``sem.mp-*`` carry no owner), by inode: a semaphore's creator
  maps it under the temporary name ``sem_open`` made it with;
* temporary directories: the run gets a ``TMPDIR`` of its own (:func:`private_tmpdir`), which
  must be empty after it.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import shutil
import signal
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

SHM = Path("/dev/shm")


def _stat_fields(pid: str) -> list[str] | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()  # state, ppid, pgrp, session, ...


def _live(field: int, value: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat_fields(entry)) is not None:
            if fields[0] != "Z" and int(fields[field]) == value:  # zombies are dead
                out.append(int(entry))
    return out


def session_members(sid: int) -> list[int]:
    """Processes of session ``sid`` still alive."""
    return _live(3, sid)


def group_members(pgid: int) -> list[int]:
    """Processes of process group ``pgid`` still alive."""
    return _live(2, pgid)


def shm_mappings(pids: Iterable[int]) -> dict[int, str]:
    """The ``/dev/shm`` files the processes map: inode -> the name they map it by (``NAME
    (deleted)`` once unlinked)."""
    found: dict[int, str] = {}
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        for line in maps.splitlines():
            fields = line.split(maxsplit=5)  # address perms offset dev inode path
            if len(fields) == 6 and fields[5].startswith(f"{SHM}/"):
                found[int(fields[4])] = fields[5][len(f"{SHM}/"):]
    return found


def own_segments(pids: Iterable[int], seen: Iterable[int] = ()) -> set[str]:
    """The ``/dev/shm`` segments still present that are the run's: named after one of ``pids``
    (``torch_<pid>_...``), or of an inode ``seen`` mapped by its processes."""
    prefixes, inodes = tuple(f"torch_{pid}_" for pid in pids), set(seen)
    if not SHM.is_dir():
        return set()
    with os.scandir(SHM) as entries:
        return {e.name for e in entries if e.name.startswith(prefixes) or e.inode() in inodes}


@dataclass
class Snapshot:
    """What a run had at some moment while it ran: its processes, the shared memory they
    mapped, what was in its TMPDIR."""

    pids: set[int] = field(default_factory=set)
    #: inode -> name mapped by (:func:`shm_mappings`)
    segments: dict[int, str] = field(default_factory=dict)
    tmp: list[str] = field(default_factory=list)

    def take(self, sid: int, tmp: Path) -> None:
        """Add session ``sid``'s processes and what they map now; list ``tmp``."""
        self.pids |= set(session_members(sid))
        self.segments.update(shm_mappings(self.pids))
        self.tmp = left_in(tmp)

    def linked(self) -> set[str]:
        """The names of the segments seen mapped by their own name (still linked then)."""
        return {name for name in self.segments.values() if not name.endswith(" (deleted)")}


@contextlib.contextmanager
def private_tmpdir() -> Iterator[Path]:
    """A fresh directory for a run's ``TMPDIR``, removed afterwards whatever the test found in
    it. Short (under the system's temporary directory): vLLM binds Unix sockets below it (108
    octets for a socket's path)."""
    path = Path(tempfile.mkdtemp(prefix="kvsp-t-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def run_env(tmpdir: Path) -> dict[str, str]:
    """The environment of a run whose ``TMPDIR`` is ``tmpdir``. torch's compile cache stays
    where it is for every process of the user (``torchinductor_<user>`` in the system's
    temporary directory, kept on purpose, shared by them all): not a run's to remove, and
    engines that compile keep their cache across runs."""
    cache = os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")
    return {"TORCHINDUCTOR_CACHE_DIR": cache, **os.environ, "TMPDIR": str(tmpdir)}


def left_in(tmpdir: Path) -> list[str]:
    """What is under ``tmpdir`` (relative paths, sorted)."""
    return sorted(str(p.relative_to(tmpdir)) for p in tmpdir.rglob("*"))


@dataclass
class Watched:
    """A finished run of :func:`run_watched`."""

    code: int
    stdout: str
    stderr: str
    pid: int


def run_watched(cmd: list[str], *, env: dict[str, str], timeout: float,
                on_line: Callable[[str, int], None]) -> Watched:
    """``cmd`` in a session of its own (its ``pid`` is the session's id); ``on_line(line, pid)``
    is called with each line of its stderr as it comes, while it runs. ``timeout`` is a safety
    net only: then, or when ``on_line`` raises, every process of the session is killed (the
    engines' process groups too, stopped ones included)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    assert proc.stdout is not None and proc.stderr is not None
    stdout, out = proc.stdout, []
    reader = threading.Thread(target=lambda: out.append(stdout.read()), daemon=True)
    reader.start()

    def kill() -> None:
        for pid in session_members(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    watchdog = threading.Timer(timeout, kill)
    watchdog.start()
    err = []
    try:
        for line in proc.stderr:
            err.append(line)
            on_line(line, proc.pid)
        code = proc.wait()
    except BaseException:
        kill()
        raise
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            kill()
            proc.wait()
    reader.join()
    return Watched(code, "".join(out), "".join(err), proc.pid)
