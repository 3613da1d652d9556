"""Deterministic object payloads shared by our side and the peer scripts (stdlib only, so the
peer venvs can import it by path).

* :func:`payload` — what *we* (and the peer scripts we wrote) publish: object (g, o) of a
  track is SHA-256 counter-mode bytes.
* :func:`aiomoqt_counted` — what aiomoqt's own generators (``moq-pub-server``,
  ``pub_example``, ``PublishedTrack``) publish: ``f"{g}.{o}|"`` followed by the byte counter
  ``0, 1, ..., 255, 0, ...``, cut to the object size (aiomoqt ``track.py``
  ``PublishedTrack._counted_pad``/``_generate_subgroup``, 0.13.3).
"""

from __future__ import annotations

import hashlib


def payload(group: int, obj: int, size: int) -> bytes:
    seed = f"kvsp-interop/{group}/{obj}".encode()
    out = bytearray()
    counter = 0
    while len(out) < size:
        out += hashlib.sha256(seed + counter.to_bytes(8, "big")).digest()
        counter += 1
    return bytes(out[:size])


def aiomoqt_counted(group: int, obj: int, size: int) -> bytes:
    pad = bytes(i & 0xFF for i in range(size))
    return (f"{group}.{obj}".encode() + b"|" + pad)[:size]


def sha256(data: bytes | bytearray | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()
