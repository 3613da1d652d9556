"""Two network namespaces for the tests that run processes on either side of a shaper
(tests/test_bench_wan.py, tests/test_bbr_transfer.py): made with iproute2 (root), loopback up,
deleted afterwards whatever happened."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def two_namespaces(prefix: str) -> Iterator[tuple[str, str]]:
    """``{prefix}a{pid}`` and ``{prefix}b{pid}`` (this process's pid: another test process's
    are others), yielded as a pair and deleted on exit."""
    names = (f"{prefix}a{os.getpid()}", f"{prefix}b{os.getpid()}")
    made: list[str] = []
    try:
        for ns in names:
            subprocess.run(["ip", "netns", "add", ns], check=True)
            made.append(ns)
            subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True)
        yield names
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
