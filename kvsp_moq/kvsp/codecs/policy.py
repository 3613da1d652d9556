"""Codec policy: which codecs a consumer may load a block in (DESIGN.md §10: "lossy codecs are
used only where a scope's policy allows them"; docs/container.md "Codec policy").

A lossy codec changes the tokens a model produces, so it is never chosen silently: it is used
only where the operator configured it, for a scope (``scopes``: Scope ID -> codec) or for a
class of requests (``classes``: a name the engine gives its requests -> codec; the class wins
over the scope when both are configured). Everywhere else the consumer asks for the replica's
own codec, and a replica stored in a lossy codec is not a source unless the policy allows
that codec (:meth:`CodecPolicy.accepts`). A lossless codec (``lossless``, e.g.
``zstd-planes``) changes no value and may be configured for every scope.

Pure data (no I/O): the instance engine's prefetch (``control/instance/prefetch.py``) takes
one; an engine connector calls :meth:`CodecPolicy.choose` per request with its request class.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from ..errors import RecordError
from ..registries import CODEC_RAW, CODECS_BY_NAME, Codec

__all__ = ["LOSSY_CODECS", "CodecChoice", "CodecPolicy"]

#: The registered codecs that change values (docs/container.md "Codecs": lossy).
LOSSY_CODECS = frozenset({CODECS_BY_NAME["fp8-e4m3"].value, CODECS_BY_NAME["int8"].value})


@dataclass(frozen=True)
class CodecChoice:
    """The codec to ask holders and relays for (§6.7 ``codec=n``; binding v1: the track name)
    and why: ``codec`` None means the replica's own codec (no transcoding)."""

    codec: Codec | None
    reason: str

    @property
    def lossy(self) -> bool:
        return self.codec is not None and self.codec.value in LOSSY_CODECS

    @property
    def value(self) -> int | None:
        return None if self.codec is None else self.codec.value


def _codec(name: object, where: str) -> Codec:
    codec = CODECS_BY_NAME.get(name) if isinstance(name, str) else None
    if codec is None:
        raise RecordError(where, f"{name!r} is not a registered codec ({', '.join(sorted(CODECS_BY_NAME))})")
    return codec


@dataclass(frozen=True)
class CodecPolicy:
    """Per scope and per request class, the codec to load blocks in; raw elsewhere."""

    #: Scope ID (16 octets) -> the codec its blocks are loaded in.
    scopes: Mapping[bytes, Codec] = field(default_factory=lambda: MappingProxyType({}))
    #: Request class -> codec; wins over the scope's entry.
    classes: Mapping[str, Codec] = field(default_factory=lambda: MappingProxyType({}))
    #: A lossless codec for every scope without an entry (None: the replica's codec).
    lossless: Codec | None = None

    def __post_init__(self) -> None:
        if self.lossless is not None and self.lossless.value in LOSSY_CODECS:
            raise RecordError("lossless", f"{self.lossless.name} is lossy: name it per scope or per class")

    @classmethod
    def from_mapping(cls, doc: Mapping[str, object], where: str = "codec_policy") -> CodecPolicy:
        """From a TOML table: ``scopes = {"<scope hex16>" = "fp8-e4m3"}``, ``classes =
        {"batch" = "int8"}``, ``lossless = "zstd-planes"``; RecordError naming the key."""
        unknown = set(doc) - {"scopes", "classes", "lossless"}
        if unknown:
            raise RecordError(f"{where}.{sorted(unknown)[0]}", "unknown key")
        scopes_doc, classes_doc = doc.get("scopes", {}), doc.get("classes", {})
        if not isinstance(scopes_doc, Mapping) or not isinstance(classes_doc, Mapping):
            raise RecordError(where, "scopes and classes must be tables")
        scopes: dict[bytes, Codec] = {}
        for scope_hex, name in scopes_doc.items():
            try:
                scope = bytes.fromhex(scope_hex)
            except (TypeError, ValueError):
                scope = b""
            if len(scope) != 16:
                raise RecordError(f"{where}.scopes", f"{scope_hex!r} is not a Scope ID (hex16)")
            scopes[scope] = _codec(name, f"{where}.scopes.{scope_hex}")
        classes = {str(k): _codec(v, f"{where}.classes.{k}") for k, v in classes_doc.items()}
        lossless = doc.get("lossless")
        return cls(MappingProxyType(scopes), MappingProxyType(classes),
                   None if lossless is None else _codec(lossless, f"{where}.lossless"))

    def choose(self, scope_id: bytes, request_class: str | None = None) -> CodecChoice:
        """The codec to load a block of ``scope_id`` in, for a request of ``request_class``."""
        if request_class is not None and request_class in self.classes:
            codec = self.classes[request_class]
            return CodecChoice(_none_if_raw(codec), f"request class {request_class!r}: {codec.name}")
        if scope_id in self.scopes:
            codec = self.scopes[scope_id]
            return CodecChoice(_none_if_raw(codec), f"scope {scope_id.hex()}: {codec.name}")
        if self.lossless is not None:
            return CodecChoice(self.lossless, f"lossless default: {self.lossless.name}")
        return CodecChoice(None, "no codec configured: the replica's codec")

    def accepts(self, replica_codec: int, scope_id: bytes, request_class: str | None = None) -> bool:
        """Whether a replica stored in ``replica_codec`` may be loaded as it is: a lossless
        codec always, a lossy one only where :meth:`choose` names that very codec."""
        if replica_codec not in LOSSY_CODECS:
            return True
        return self.choose(scope_id, request_class).value == replica_codec


def _none_if_raw(codec: Codec) -> Codec | None:
    return None if codec.value == CODEC_RAW.value else codec
