"""What ``kvsp moq`` reads from its arguments: Track Namespaces (text and binary fields,
binding-v1 block names), track names and bearer tokens.

A NAMESPACE is its fields joined by ``/``; a field ``hex:ab01`` (or ``0xab01``, as in the
relay's ``--config``) is the octets of those hex digits, any other field its UTF-8 text.
``--block COMPAT/SCOPE/KEY/REPLICA`` (hex; 64/32/64/32 digits) names a binding-v1 replica
(docs/binding.md): the namespace ``kvsp-1/<compat>/<scope>/<key>/<replica>`` as raw octets;
``--block`` also takes a Replica Record's ``moqt_namespace`` (base64url). Its track name is
the codec's (``raw``) unless TRACK is given.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from ..kvsp.errors import KvspError
from ..kvsp.naming import BlockName
from ..moqt.messages import MessageParameters, Token
from .errors import UsageError

__all__ = ["Names", "add_name_options", "add_token_options", "names", "parse_namespace",
           "request_parameters", "tokens"]

_HEX_PREFIXES = ("hex:", "0x", "0X")
#: Fields printed as text in messages; any other is printed ``hex:...``.
_TEXT = re.compile(rb"[A-Za-z0-9._~-]+")
#: The binding-v1 track name of codec raw, the one registered codec.
BLOCK_TRACK = "raw"


def _strip_hex_prefix(text: str) -> str:
    return next((text[len(p):] for p in _HEX_PREFIXES if text.startswith(p)), text)


def _hex_field(text: str, digits: str) -> bytes:
    if not digits or len(digits) % 2:
        raise UsageError(f"namespace field {text!r}: an even, non-zero number of hex digits")
    try:
        return bytes.fromhex(digits)
    except ValueError:
        raise UsageError(f"namespace field {text!r} is not hexadecimal") from None


def parse_namespace(text: str) -> tuple[bytes, ...]:
    """``kvsp-1/hex:ab01`` -> ``(b"kvsp-1", b"\\xab\\x01")``; :class:`UsageError` otherwise."""
    parts = text.split("/")
    if not text or any(not p for p in parts):
        raise UsageError(f"NAMESPACE {text!r}: fields joined by '/', none empty")
    return tuple(_hex_field(p, _strip_hex_prefix(p)) if p.startswith(_HEX_PREFIXES)
                 else p.encode("utf-8") for p in parts)


def parse_block(text: str) -> BlockName:
    """``COMPAT/SCOPE/KEY/REPLICA`` in hex (a ``hex:``/``0x`` prefix allowed on each), or a
    Replica Record's ``moqt_namespace``."""
    try:
        if "/" not in text:
            return BlockName.from_moqt_namespace(text)
        parts = text.split("/")
        if len(parts) != 4:
            raise UsageError(f"--block {text!r}: COMPAT/SCOPE/KEY/REPLICA (4 hex fields), "
                             f"got {len(parts)} fields")
        return BlockName(*(_hex_field(p, _strip_hex_prefix(p)) for p in parts))
    except KvspError as exc:
        raise UsageError(f"--block: {exc} (compat 64, scope 32, key 64, replica 32 hex digits)"
                         ) from None


class Names:
    """The namespace and track one ``kvsp moq`` command is about."""

    def __init__(self, namespace: tuple[bytes, ...], track: str) -> None:
        self.namespace = namespace
        self.track = track

    def __str__(self) -> str:
        return "/".join(f.decode() if _TEXT.fullmatch(f) else "hex:" + f.hex()
                        for f in self.namespace) + f" {self.track}"


def add_name_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--block", metavar="COMPAT/SCOPE/KEY/REPLICA",
                   help="a binding-v1 block name in hex (or a record's moqt_namespace) "
                        "instead of NAMESPACE; TRACK defaults to raw")


def names(args: argparse.Namespace, positionals: list[str], what: str) -> Names:
    """NAMESPACE TRACK, or ``--block`` [TRACK], from the positionals left after the URL."""
    if args.block is not None:
        if len(positionals) > 1:
            raise UsageError(f"with --block give at most TRACK after {what}, got {positionals}")
        return Names(parse_block(args.block).namespace_fields(),
                     positionals[0] if positionals else BLOCK_TRACK)
    if len(positionals) != 2:
        raise UsageError(f"give NAMESPACE and TRACK after {what} (or --block C/S/K/R)")
    if not positionals[1]:
        raise UsageError("TRACK must not be empty")
    return Names(parse_namespace(positionals[0]), positionals[1])


def add_token_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--token", action="append", default=[], metavar="TOKEN",
                   help="bearer token (the relay's or holder's principal) sent in SETUP and "
                        "with each request (repeatable)")
    p.add_argument("--token-file", action="append", default=[], metavar="FILE",
                   help="read the token from FILE (surrounding whitespace ignored; repeatable)")


def tokens(args: argparse.Namespace) -> list[bytes]:
    """The tokens of ``--token`` and ``--token-file``, in that order."""
    out = [t.encode("utf-8") for t in args.token]
    for name in args.token_file:
        try:
            text = Path(name).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"--token-file {name}: {getattr(exc, 'strerror', None) or exc}") from None
        if not text:
            raise UsageError(f"--token-file {name}: the file is empty")
        out.append(text.encode("utf-8"))
    if any(not t for t in out):
        raise UsageError("--token must not be empty")
    return out


def request_parameters(values: list[bytes]) -> MessageParameters:
    """Request parameters carrying ``values`` as AUTHORIZATION_TOKENs (Token Type 0)."""
    return MessageParameters(authorization_tokens=tuple(Token.use_value(0, v) for v in values))
