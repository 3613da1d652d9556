"""The TUN devices of the userspace WAN shaper (Linux ``/dev/net/tun``, iproute2).

:func:`open_tun` creates a layer-3 TUN device (``IFF_TUN | IFF_NO_PI``: each read or write is
one bare IP packet) in the caller's network namespace and returns its file descriptor,
non-blocking; the device lives as long as that descriptor (not persistent), so closing it, or
the process ending, removes the device. :func:`place` moves it into a namespace (the
descriptor keeps working after the move) and gives it a point-to-point address.
:func:`tx_dropped` reads the kernel's count of packets the device could not hand to the
shaper (its queue was full): drops that are not the emulated path's but the shaper's own.
"""

from __future__ import annotations

import fcntl
import json
import os
import struct
import subprocess

__all__ = ["TunError", "open_tun", "place", "tx_dropped"]

_TUNSETIFF = 0x400454CA  # _IOW('T', 202, int), linux/if_tun.h
_IFF_TUN = 0x0001
_IFF_NO_PI = 0x1000
_IFNAMSIZ = 16


class TunError(Exception):
    """A TUN device could not be created or configured (the message says which step)."""


def open_tun(name: str) -> int:
    """A new TUN device ``name`` (at most 15 characters) here; its non-blocking descriptor."""
    if not 0 < len(name) < _IFNAMSIZ:
        raise ValueError(f"device name {name!r}: 1 to {_IFNAMSIZ - 1} characters")
    try:
        fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise TunError(f"/dev/net/tun: {exc.strerror}") from None
    try:
        fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TUN | _IFF_NO_PI))
    except OSError as exc:
        os.close(fd)
        raise TunError(f"TUNSETIFF {name}: {exc.strerror}") from None
    return fd


def _ip(*args: str) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise TunError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")
    return done.stdout


def place(name: str, netns: str, local: str, peer: str, mtu: int, txqueuelen: int) -> None:
    """Move device ``name`` into ``netns``, address it ``local`` peer ``peer`` (IPv4,
    point-to-point), set ``mtu`` and ``txqueuelen`` (the kernel's queue towards the shaper)
    and bring it up. IPv6 and multicast are off, so that only the benchmark's packets cross."""
    _ip("link", "set", name, "netns", netns)
    sysctl = f"/proc/sys/net/ipv6/conf/{name}/disable_ipv6"
    done = subprocess.run(["ip", "netns", "exec", netns, "sh", "-c", f"echo 1 > {sysctl}"],
                          capture_output=True, text=True)
    if done.returncode != 0 and "No such file" not in done.stderr:  # no IPv6 in this kernel
        raise TunError(f"disabling IPv6 on {name}: {done.stderr.strip()}")
    _ip("-n", netns, "addr", "add", local, "peer", peer, "dev", name)
    _ip("-n", netns, "link", "set", name, "mtu", str(mtu), "txqueuelen", str(txqueuelen),
        "multicast", "off", "up")


def tx_dropped(name: str, netns: str) -> int | None:
    """The device's tx_dropped counter (None when it cannot be read, e.g. namespace gone)."""
    try:
        out = _ip("-n", netns, "-s", "-j", "link", "show", "dev", name)
        return int(json.loads(out)[0]["stats64"]["tx"]["dropped"])
    except (TunError, ValueError, LookupError, TypeError):
        return None
