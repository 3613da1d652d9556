"""Compatibility Descriptor and Compatibility ID (kvsp-draft §4.1).

    compat_id = SHA-256("KVSP-COMPAT-1" || 0x00 || JCS(descriptor))

:func:`validate_descriptor` checks every REQUIRED member and its type, the optional
``adapters`` (absent when no adapter is applied; an empty array is an error), digests as
``sha-256:`` + 64 lowercase hex, ``kv_dtype`` and ``positional`` against the registries
(§11.2; positional parameters parsed), and ``layout`` = ``kvsp-layout-1``.

The ID is the hash of the descriptor as given, canonicalized by RFC 8785 (``rfc8785``):
members this implementation does not know are validated by nobody but still part of the
identity (docs/decisions/0002-descriptor-unknown-members.md).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

import rfc8785

from .errors import DescriptorError
from .hexids import format_digest, parse_digest
from .registries import ELEMENT_TYPES, LAYOUTS, ElementType, Positional, parse_positional

_COMPAT_LABEL = b"KVSP-COMPAT-1\x00"
_READ_CHUNK = 1 << 20
_GEOMETRY_MEMBERS = ("layers", "kv_heads", "head_dim", "block_tokens")
_MAX_GEOMETRY = 1 << 31


@dataclass(frozen=True)
class CompatibilityDescriptor:
    """A validated descriptor: the original JSON object plus its typed members."""

    document: Mapping[str, Any]
    model: str
    model_digest: bytes
    tokenizer_digest: bytes
    adapters: tuple[bytes, ...] | None
    layers: int
    kv_heads: int
    head_dim: int
    kv_dtype: ElementType
    positional: Positional
    block_tokens: int
    layout: str

    @property
    def compat_id(self) -> bytes:
        return compat_id(self.document)


def _require(doc: Mapping[str, Any], member: str) -> Any:
    if member not in doc:
        raise DescriptorError(member, "is REQUIRED")
    return doc[member]


def _string(doc: Mapping[str, Any], member: str) -> str:
    value = _require(doc, member)
    if not isinstance(value, str) or not value:
        raise DescriptorError(member, "must be a non-empty string")
    return value


def _digest(value: Any, member: str) -> bytes:
    try:
        return parse_digest(value, member)
    except ValueError as exc:
        raise DescriptorError(member, str(exc)) from None


def _positive_int(doc: Mapping[str, Any], member: str) -> int:
    value = _require(doc, member)
    if isinstance(value, bool) or not isinstance(value, int):
        raise DescriptorError(member, "must be an integer")
    if not 0 < value < _MAX_GEOMETRY:
        raise DescriptorError(member, f"must be an integer in [1, 2**31), got {value}")
    return value


def validate_descriptor(doc: object) -> CompatibilityDescriptor:
    """Validate a descriptor (a parsed JSON object) against §4.1; ``DescriptorError`` names
    the first member at fault."""
    if not isinstance(doc, Mapping):
        raise DescriptorError(None, "must be a JSON object")
    adapters: tuple[bytes, ...] | None = None
    if "adapters" in doc:
        raw = doc["adapters"]
        if not isinstance(raw, list):
            raise DescriptorError("adapters", "must be an array of digests")
        if not raw:
            raise DescriptorError("adapters", "must be absent when no adapter is applied; "
                                  "an empty array is not allowed")
        adapters = tuple(_digest(a, f"adapters[{i}]") for i, a in enumerate(raw))
    geometry = {m: _positive_int(doc, m) for m in _GEOMETRY_MEMBERS}
    dtype_name = _string(doc, "kv_dtype")
    if dtype_name not in ELEMENT_TYPES:
        raise DescriptorError("kv_dtype", f"{dtype_name!r} is not a registered element type "
                              f"({', '.join(ELEMENT_TYPES)})")
    try:
        positional = parse_positional(_string(doc, "positional"))
    except ValueError as exc:
        raise DescriptorError("positional", str(exc)) from None
    layout = _string(doc, "layout")
    if layout not in LAYOUTS:
        raise DescriptorError("layout", f"{layout!r} is not a known layout (kvsp-layout-1)")
    return CompatibilityDescriptor(
        document=doc,
        model=_string(doc, "model"),
        model_digest=_digest(_require(doc, "model_digest"), "model_digest"),
        tokenizer_digest=_digest(_require(doc, "tokenizer_digest"), "tokenizer_digest"),
        adapters=adapters,
        kv_dtype=ELEMENT_TYPES[dtype_name],
        positional=positional,
        layout=layout,
        **geometry,
    )


def make_descriptor(*, model: str, model_digest: str, tokenizer_digest: str, layers: int, kv_heads: int,
                    head_dim: int, kv_dtype: str, positional: str, block_tokens: int, layout: str,
                    adapters: Iterable[str] | None = None,
                    extensions: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The one way this implementation writes a descriptor (the reference model and the vLLM
    connector both call it, so one model gets one document and one Compatibility ID): the
    §4.1 members, ``adapters`` only when an adapter is applied, then ``extensions`` (members
    beyond §4.1 that are part of the identity, docs/decisions/0002), validated."""
    document: dict[str, Any] = {
        "model": model,
        "model_digest": model_digest,
        "tokenizer_digest": tokenizer_digest,
        "layers": layers,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "kv_dtype": kv_dtype,
        "positional": positional,
        "block_tokens": block_tokens,
        "layout": layout,
    }
    applied = list(adapters or ())
    if applied:
        document["adapters"] = applied
    for member, value in (extensions or {}).items():
        if member in document or member == "adapters":
            raise DescriptorError(member, "an extension member cannot replace a §4.1 member")
        document[member] = value
    validate_descriptor(document)
    return document


def canonical_json(doc: Mapping[str, Any]) -> bytes:
    """JCS (RFC 8785) of a JSON object; ``DescriptorError`` for values JCS cannot encode."""
    try:
        return rfc8785.dumps(doc)
    except (rfc8785.CanonicalizationError, TypeError, ValueError) as exc:
        raise DescriptorError(None, f"cannot be canonicalized (RFC 8785): {exc}") from None


def compat_id(doc: Mapping[str, Any]) -> bytes:
    """The Compatibility ID of a descriptor, validated first (§4.1: computed, never trusted)."""
    validate_descriptor(doc)
    return hashlib.sha256(_COMPAT_LABEL + canonical_json(doc)).digest()


def _hash_files(paths: Iterable[Path], hasher: "hashlib._Hash") -> None:
    buf = bytearray(_READ_CHUNK)
    view = memoryview(buf)
    for path in paths:
        with open(path, "rb", buffering=0) as fh:
            while n := fh.readinto(buf):
                hasher.update(view[:n])


def model_digest(weight_files: Iterable[str | os.PathLike[str]]) -> str:
    """``model_digest`` of §4.1: SHA-256 over the weight files concatenated in ascending byte
    order of their file names, streamed in 1 MiB reads (never a whole file in memory).

    A directory argument stands for the regular files directly inside it. File names are
    compared as bytes (``os.fsencode`` of the base name), not as locale-sorted text.
    """
    files: list[Path] = []
    for item in weight_files:
        path = Path(item)
        if path.is_dir():
            files.extend(p for p in path.iterdir() if p.is_file())
        else:
            files.append(path)
    if not files:
        raise DescriptorError("model_digest", "no weight files given")
    names = [os.fsencode(p.name) for p in files]
    if len(set(names)) != len(names):
        raise DescriptorError("model_digest", "two weight files share a file name; their order is undefined")
    ordered = [p for _, p in sorted(zip(names, files), key=lambda pair: pair[0])]
    hasher = hashlib.sha256()
    _hash_files(ordered, hasher)
    return format_digest(hasher.digest())


def tokenizer_digest(tokenizer_file: str | os.PathLike[str]) -> str:
    """``tokenizer_digest`` of §4.1: SHA-256 of the tokenizer definition file, streamed."""
    hasher = hashlib.sha256()
    _hash_files([Path(tokenizer_file)], hasher)
    return format_digest(hasher.digest())
